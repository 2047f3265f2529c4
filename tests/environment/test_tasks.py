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
    with pytest.raises(SystemExit) as stop:  # refused as it parses (eogym_sft.config.number)
        main(["make-task", "--output", str(tmp_path), "--rows", "0", "--name", "other.jsonl"])
    assert stop.value.code == 2 and capsys.readouterr().err == "eogym-sft make-task: argument --rows: must be at least 1, got 0 (--help lists the flags)\n"
    with pytest.raises(ValueError, match="rows must be at least 1"):
        write_task(tmp_path, 0)


@pytest.mark.parametrize("name", ["../x.jsonl", "/tmp/x.jsonl", "sub/x.jsonl", "..", ".", "", "a\\b.jsonl", "x\x00.jsonl"])
def test_make_task_name_is_a_file_name_never_a_path(tmp_path, capsys, name):
    """``--name`` names a file inside ``--output``: ``../``, an absolute path or a separator would write outside it."""
    out = tmp_path / "root"
    with pytest.raises(SystemExit) as stop:
        main(["make-task", "--output", str(out), "--rows", "1", "--name", name])
    assert stop.value.code == 2
    assert capsys.readouterr().err == (
        f"eogym-sft make-task: argument --name: {name!r} is a path, not a file name: give a name without / or \\, "
        "not . or .. (--help lists the flags)\n"
    )
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="is a path, not a file name"):
        write_task(out, 1, name=name)


def _files(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("task_name", ["colour_grid", "colour_pair", "colour_count"])
def test_make_task_writes_the_same_bytes_for_a_seed(tmp_path, task_name):
    """The crop names are in the gold tool results: two runs (in two folders, at two times) write
    byte-equal JSONL, scenes and crops."""
    import os
    import time

    for run in ("a", "b"):
        main(["make-task", "--task", task_name, "--output", str(tmp_path / run), "--rows", "4", "--seed", "0"])
        for scene in (tmp_path / run / "EO_GYM_DATA").rglob("*.png"):
            os.utime(scene, ns=(1, time.time_ns() + 10**9 * (run == "a")))  # scenes of the first run look older or newer
    a, b = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert a == b and "tasks.jsonl" in a and sum(k.startswith("EO_GYM_DATA/") for k in a) == 4
    assert sum(k.startswith("image_cache/crops/") for k in a) == {"colour_grid": 4, "colour_pair": 8, "colour_count": 16}[task_name]


def test_rows_stream_to_a_temporary_file_and_a_stopped_run_leaves_no_jsonl(tmp_path, monkeypatch):
    """The 21st question's write finds the rows before it on disk (not held in memory; a few may still be in
    the file's buffer) under a dot-name;
    stopped there, the run leaves the old JSONL as it was, no temporary file and only whole scenes."""
    from eogym_sft.environment import tasks

    (tmp_path / "tasks.jsonl").write_text("old\n")
    real, seen = tasks._write_question, []

    def stop_at_the_21st(output, spec, task):
        if spec["id"].endswith("_0020"):
            seen.extend(p.read_text().count("\n") for p in tmp_path.glob(".tasks.jsonl.*.tmp"))
            raise KeyboardInterrupt
        return real(output, spec, task)

    monkeypatch.setattr(tasks, "_write_question", stop_at_the_21st)
    with pytest.raises(KeyboardInterrupt):
        write_task(tmp_path, 1000, seed=0)
    assert len(seen) == 1 and 10 <= seen[0] <= 20, seen
    assert (tmp_path / "tasks.jsonl").read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.rglob(".*")) == []
    scenes = sorted(tmp_path.rglob("*.png"))
    assert all(Image.open(p).size in ((SCENE_PX, SCENE_PX), (SCENE_PX // 2, SCENE_PX // 2)) for p in scenes)


def test_rows_that_cannot_fit_the_disk_are_refused_before_anything_is_written(tmp_path):
    with pytest.raises(SystemExit, match=r"make-task: --rows 1000000000000 needs about [\d,.]+ GB under .* GB free"):
        main(["make-task", "--output", str(tmp_path / "big"), "--rows", "1000000000000"])
    assert not (tmp_path / "big").exists()


def test_make_task_refuses_an_unknown_task(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["make-task", "--task", "nope", "--output", str(tmp_path), "--rows", "1"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err


# ---------------------------------------------------------------- colour_pair: two crops, two colours in order


def test_pair_gold_traces_crop_the_two_quadrants_asked_in_order(tmp_path):
    """Each gold call re-run through the crop backend returns the gold result, and the colours read back from the
    two crops, in the order asked, are the answer."""
    from eogym_sft.environment.tasks import pair_spec

    path = write_task(tmp_path, 12, seed=2, task="colour_pair")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for index, row in enumerate(rows):
        spec = pair_spec(2, index)
        first, second = row["question_type"].split("+")
        assert first != second and row["messages"][1]["content"].endswith(f"are the {first} and the {second} quadrants, in that order?")
        assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant", "tool", "tool", "assistant"]
        calls = [json.loads(c["function"]["arguments"]) for c in row["messages"][2]["tool_calls"]]
        assert calls == [{"aoi": QUADRANTS[first]}, {"aoi": QUADRANTS[second]}]
        env = EOGymEnvironment(row, tmp_path, backends=("crop",))
        seen = []
        for call, gold in zip(calls, row["messages"][3:5]):
            result = env.call("crop_optical_or_sar_image", call)
            assert result.ok and result.text == gold["content"]
            seen.append(read_colour(np.array(Image.open(tmp_path / json.loads(result.text)["cropped_path"]).convert("RGB"))))
        assert seen == [spec["colours"][first], spec["colours"][second]]
        assert row["gt_answer"] == f"{seen[0]}, {seen[1]}" and row["messages"][-1]["content"] == f"Final Answer: {row['gt_answer']}"
    assert len({r["question_type"] for r in rows}) > 6  # the ordered pairs vary


def test_a_pair_is_right_only_with_both_colours_in_order():
    from eogym_sft.metrics.scoring import extract_final_answer, normalize_answer

    def right(text, gt):
        answer = extract_final_answer(text)
        return answer is not None and normalize_answer(answer) == normalize_answer(gt)

    assert right("Final Answer: green, blue", "green, blue") and right("Final Answer: Green blue", "green, blue")
    assert not right("Final Answer: blue, green", "green, blue") and not right("Final Answer: green", "green, blue")


# ---------------------------------------------------------------- colour_count: four crops, one count


@pytest.fixture(scope="module")
def count_task(tmp_path_factory):
    root = tmp_path_factory.mktemp("colour_count")
    path = write_task(root, 20, seed=1, task="colour_count")
    return root, [json.loads(line) for line in path.read_text().splitlines()]


def test_count_gold_traces_reach_the_answer_through_the_real_crop_backend(count_task):
    """Each gold call re-run through the crop backend returns the gold result; the colours read back from
    the four crops give the count; one crop alone leaves the count open."""
    from eogym_sft.environment.tasks import count_spec

    root, rows = count_task
    for index, row in enumerate(rows):
        asked = row["question_type"]
        assert row["messages"][1]["content"].startswith(f"<image>\nHow many of the four quadrants are {asked} ")
        assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant", "tool", "tool", "tool", "tool", "assistant"]
        calls = [json.loads(c["function"]["arguments"]) for c in row["messages"][2]["tool_calls"]]
        assert calls == [{"aoi": aoi} for aoi in QUADRANTS.values()]
        env = EOGymEnvironment(row, root, backends=("crop",))
        seen = []
        for call, gold in zip(calls, row["messages"][3:7]):
            result = env.call("crop_optical_or_sar_image", call)
            assert result.ok and result.text == gold["content"]
            seen.append(read_colour(np.array(Image.open(root / json.loads(result.text)["cropped_path"]).convert("RGB"))))
        assert seen == list(count_spec(1, index)["colours"].values())
        assert str(seen.count(asked)) == row["gt_answer"] and row["messages"][-1]["content"] == f"Final Answer: {row['gt_answer']}"
        assert len(normalize_row(row).images) == 5  # data prep shows the scene and the four crops
    assert {r["gt_answer"] for r in rows} == {"0", "1", "2", "3", "4"}


def test_count_answers_are_spread_evenly():
    from collections import Counter

    from eogym_sft.environment.tasks import count_spec

    counts = Counter(count_spec(0, i)["answer"] for i in range(2000))
    assert sorted(counts) == ["0", "1", "2", "3", "4"] and max(counts.values()) < 2000 * 0.23  # no answer is a free 42%


def test_the_full_count_image_at_the_demo_cap_shows_no_colour(count_task):
    from eogym_sft.models.tiny import build_offline_processor

    root, rows = count_task
    processor = build_offline_processor(DEMO_CAP, 4096)
    full = [processor.image_processor(images=[Image.open(root / r["images"][0]).convert("RGB")], return_tensors="pt")["pixel_values"] for r in rows]
    assert len({r["gt_answer"] for r in rows}) == 5
    for f in full[1:]:
        assert float((f - full[0]).abs().mean()) < 0.005
    assert float(full[0].std()) < 0.02


def test_the_count_is_scored_exactly():
    from eogym_sft.metrics.scoring import extract_final_answer, normalize_answer

    def right(text, gt):
        answer = extract_final_answer(text)
        return answer is not None and normalize_answer(answer) == normalize_answer(gt)

    assert right("Final Answer: 2", "2") and right("Final Answer: 2.0", "2")
    assert not right("Final Answer: 3", "2") and not right("Final Answer: two", "2") and not right("Final Answer: 12", "2")


def test_make_task_overwrite_replaces_the_jsonl_and_keeps_the_rest(tmp_path, capsys):
    """What --help says: --output/--name is replaced (refused without --overwrite), other files stay."""
    with pytest.raises(SystemExit):
        main(["make-task", "--help"])
    assert "replace --output/--name if it exists (refused otherwise); other files under --output stay" in " ".join(capsys.readouterr().out.split())
    main(["make-task", "--output", str(tmp_path), "--rows", "2"])
    (tmp_path / "notes.txt").write_text("mine")
    main(["make-task", "--output", str(tmp_path), "--rows", "1", "--start", "5", "--overwrite"])
    assert [json.loads(x)["id"] for x in (tmp_path / "tasks.jsonl").read_text().splitlines()] == ["cg0_0005"]
    assert (tmp_path / "notes.txt").read_text() == "mine" and (tmp_path / "EO_GYM_DATA/colour_grid/cg0_0000.png").is_file()
