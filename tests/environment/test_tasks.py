"""The colour_grid task family: rows in EO-Gym's format whose gold crop is what the crop backend returns,
answers read back from the crop at native resolution, and nothing of them left in the full image at
the agent demo's pixel cap."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from eogym_sft.cli import main
from eogym_sft.data.traces import normalize_row
from eogym_sft.environment.env import EOGymEnvironment
from eogym_sft.environment.tasks import (
    COLOURS,
    QUADRANTS,
    SCENE_PX,
    checkerboard,
    read_colour,
    task_spec,
    write_task,
)

DEMO_CAP = SCENE_PX * SCENE_PX // 4


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("colour_grid")
    path = write_task(root, 12, seed=3)
    return root, [json.loads(line) for line in path.read_text().splitlines()]


def test_rows_are_eogym_rows_with_a_gold_crop_call(task):
    root, rows = task
    assert len(rows) == 12 and len({r["id"] for r in rows}) == 12
    for row in rows:
        assert {"id", "images", "tools", "messages", "gt_answer", "data_source", "question_type", "EO_task"} <= set(row)
        assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
        assert row["messages"][-1]["content"] == f"Final Answer: {row['gt_answer']}"
        assert row["tools"][0]["function"]["name"] == "crop_optical_or_sar_image"
        call = json.loads(row["messages"][2]["tool_calls"][0]["function"]["arguments"])
        assert call == {"aoi": QUADRANTS[row["question_type"]]}  # image_url left out: the row's only image
        assert row["gt_answer"] in COLOURS and (root / row["images"][0]).is_file()
        trace = normalize_row(row)  # data prep reads it: the crop named by the result is shown to the model
        assert trace.images[0] == row["images"][0] and trace.images[1].startswith("image_cache/crops/")


def test_the_gold_tool_result_is_what_the_crop_backend_returns(task):
    root, rows = task
    for row in rows:
        call = json.loads(row["messages"][2]["tool_calls"][0]["function"]["arguments"])
        result = EOGymEnvironment(row, root, backends=("crop",)).call("crop_optical_or_sar_image", call)
        assert result.ok and result.text == row["messages"][3]["content"]


def test_the_answer_is_in_the_crop(task):
    root, rows = task
    for row in rows:
        crop = json.loads(row["messages"][3]["content"])
        assert (crop["width"], crop["height"]) == (SCENE_PX // 2, SCENE_PX // 2)
        assert read_colour(np.array(Image.open(root / crop["cropped_path"]).convert("RGB"))) == row["gt_answer"]


def test_the_full_image_at_the_demo_cap_shows_no_colour(task):
    """At a quarter of the scene's pixels every quadrant is grey, whatever its colour: the processor's
    pixels of all scenes are equal but for a few values at the quadrants' seams (bicubic overshoot),
    so nothing in them tells the answers apart; the crops keep the full checkerboard."""
    from eogym_sft.models.tiny import build_offline_processor

    root, rows = task
    processor = build_offline_processor(DEMO_CAP, 4096)  # its own: the session's processor keeps its cap
    answers = {r["gt_answer"] for r in rows}
    assert len(answers) > 1
    full = [processor.image_processor(images=[Image.open(root / r["images"][0]).convert("RGB")], return_tensors="pt") for r in rows]
    assert all(f["image_grid_thw"].tolist() == [[1, 8, 8]] for f in full)
    first = full[0]["pixel_values"]
    for f in full[1:]:
        assert float((f["pixel_values"] - first).abs().mean()) < 0.005
    assert float(first.std()) < 0.02
    crops = [
        processor.image_processor(images=[Image.open(root / json.loads(r["messages"][3]["content"])["cropped_path"]).convert("RGB")], return_tensors="pt")
        for r in rows
    ]
    assert all(float(c["pixel_values"].std()) > 0.3 for c in crops)  # the crop keeps the checkerboard


def test_checkerboard_and_read_colour():
    board = checkerboard((230, 30, 30), 2, 3)
    assert board[0, 0].tolist() == [230, 30, 30] and board[0, 1].tolist() == [25, 225, 225] and board[1, 0].tolist() == [25, 225, 225]
    for name, rgb in COLOURS.items():
        assert read_colour(checkerboard(rgb, 8, 8)) == name


def test_specs_are_seeded_and_disjoint_by_index():
    assert task_spec(0, 5) == task_spec(0, 5)
    assert task_spec(0, 5)["id"] != task_spec(0, 6)["id"] and task_spec(1, 5)["id"] != task_spec(0, 5)["id"]


def test_make_task_command(tmp_path, capsys):
    main(["make-task", "--output", str(tmp_path), "--rows", "3", "--seed", "1", "--start", "10", "--name", "held.jsonl"])
    rows = [json.loads(line) for line in (tmp_path / "held.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["cg1_0010", "cg1_0011", "cg1_0012"]
    with pytest.raises(SystemExit, match="exists"):
        main(["make-task", "--output", str(tmp_path), "--rows", "3", "--name", "held.jsonl"])
    with pytest.raises(SystemExit, match="rows must be at least 1"):
        main(["make-task", "--output", str(tmp_path), "--rows", "0", "--name", "other.jsonl"])
