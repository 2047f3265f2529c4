"""What the evaluation tests share (tests/evaluation/test_offline.py, test_turn_prompts.py): EO-Gym rows with a
crop call and an answer, and a data folder of good and bad rows."""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

TOOLS = [
    {
        "type": "function",
        "function": {"name": name, "description": name, "parameters": {"type": "object", "properties": {}}},
    }
    for name in ("crop_optical_or_sar_image", "get_optical_image_list")
]
CROP = {
    "name": "crop_optical_or_sar_image",
    "arguments": {"image_url": "EO_GYM_DATA/a/b.jpg", "aoi": [0.25, 0.25, 0.75, 0.75]},
}


def eval_row(row_id, question_image=True, crop_path="image_cache/crops/c1.png", final="Final Answer: 5.0"):
    messages = [
        {"role": "system", "content": "You are an expert remote-sensing analyst."},
        {"role": "user", "content": ("<image>" if question_image else "") + "How many ships are in the harbour?"},
        {
            "role": "assistant",
            "content": "I will crop the harbour.",
            "tool_calls": [
                {"type": "function", "function": {"name": CROP["name"], "arguments": json.dumps(CROP["arguments"])}}
            ],
        },
        {"role": "tool", "content": json.dumps({"cropped_path": crop_path})},
        {"role": "assistant", "content": final},
    ]
    return {
        "id": row_id,
        "images": ["EO_GYM_DATA/a/b.png"] if question_image else [],
        "tools": TOOLS,
        "messages": messages,
        "gt_answer": "5",
        "EO_task": "Object Counting",
        "question_type": "ship counting",
        "data_source": "test",
    }


def write_eval_data(root: Path) -> tuple[Path, Path]:
    """Two good rows, one whose crop is missing, bad lines, and a row whose crop does not decode, under ``root``:
    ``(root, the JSONL file)``."""
    (root / "EO_GYM_DATA/a").mkdir(parents=True)
    (root / "image_cache/crops").mkdir(parents=True)
    Image.new("RGB", (64, 48), (20, 90, 160)).save(root / "EO_GYM_DATA/a/b.png")
    Image.new("RGB", (40, 40), (200, 50, 10)).save(root / "image_cache/crops/c1.png")
    Image.effect_noise((40, 40), 60).convert("RGB").save(root / "image_cache/crops/full.png")
    data = (root / "image_cache/crops/full.png").read_bytes()
    (root / "image_cache/crops/broken.png").write_bytes(data[: len(data) // 2])  # a good header, truncated pixels
    no_assistant = {"id": "r4", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}
    lines = [
        json.dumps(eval_row("r1")),
        json.dumps(eval_row("r2", question_image=False, final="Let me think.\nFinal Answer: five")),
        json.dumps(eval_row("r3", crop_path="image_cache/crops/missing.png")),
        "{not json",
        "",
        json.dumps(no_assistant),
        json.dumps(eval_row("r1")),
        json.dumps(eval_row("r5", crop_path="image_cache/crops/broken.png")),
    ]
    path = root / "test.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return root, path


def eval_cfg(data, **kw):
    """An ``EvalConfig`` over ``data`` (``(root, JSONL file)``)."""
    from eogym_sft.evaluation.offline import EvalConfig

    root, path = data
    return EvalConfig(**{"model": "unused", "data": [str(path)], "data_root": str(root), **kw})
