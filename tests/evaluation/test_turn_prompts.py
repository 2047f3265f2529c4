"""The turns evaluate scores, from EO-Gym traces (eogym_sft/evaluation/turn_prompts.py): failed rows named, prompts
rendered and counted as data prep does, turns that cannot be used skipped with a reason."""

from __future__ import annotations

import pytest
from offline_rows import CROP, eval_cfg, write_eval_data
from PIL import Image


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_eval_data(tmp_path_factory.mktemp("eval_data"))


def test_read_traces_lists_every_failed_row(data):
    from eogym_sft.evaluation.turn_prompts import read_traces

    traces, failures = read_traces(eval_cfg(data))
    assert [t.id for _, t in traces] == ["r1", "r2", "r3", "r5"]
    assert [(f["source"].rsplit(":", 1)[1], f["reason"]) for f in failures] == [
        ("4", "malformed_json"),
        ("5", "blank_line"),
        ("6", "no_assistant_turn"),
        ("7", "duplicate_id"),
    ]
    assert len(read_traces(eval_cfg(data, limit=2))[0]) == 2


def test_plan_turns_prompts_tokens_and_skips(data, processor):
    from eogym_sft.evaluation.turn_prompts import plan_turns, read_traces

    cfg = eval_cfg(data)
    prompts, skipped = plan_turns(processor, read_traces(cfg)[0], cfg)
    assert [(p.trace_id, p.turn) for p in prompts] == [
        ("r1", 0),
        ("r1", 1),
        ("r2", 0),
        ("r2", 1),
        ("r3", 0),
        ("r5", 0),
        ("r5", 1),
    ]
    assert [(s["trace_id"], s["turn"], s["reason"]) for s in skipped] == [("r3", 1, "missing_image")]
    first, final = prompts[0], prompts[1]
    assert first.text.endswith("<|im_start|>assistant\n") and "How many ships" in first.text
    assert first.reference.calls == [CROP] and not first.reference.is_final
    assert final.reference.is_final and final.reference.gt_answer == "5" and len(final.images) == 2
    assert prompts[0].prompt_sha256 == prompts[4].prompt_sha256  # r1 and r3 share their first prompt
    for p in prompts[:5]:  # the token count of data prep is the processor's own length (r5's crop does not decode)
        pictures = [Image.open(path).convert("RGB") for path in p.images] or None
        assert p.prompt_tokens == processor(text=[p.text], images=pictures, return_tensors="pt")["input_ids"].shape[1]
    limit = prompts[1].prompt_tokens - 1
    cfg = eval_cfg(data, max_prompt_tokens=limit)
    short, skipped = plan_turns(processor, read_traces(cfg)[0], cfg)
    assert ("r1", 1, "prompt_too_long") in {(s["trace_id"], s["turn"], s["reason"]) for s in skipped}
    assert all(p.prompt_tokens <= limit for p in short)
