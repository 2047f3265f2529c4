"""What ``eogym-sft view`` gathers from run folders (eogym_sft/evaluation/view_data.py); the page built from
it is tested in test_view.py."""

from __future__ import annotations

import json

import pytest

from eogym_sft.evaluation.view import plot_keys
from eogym_sft.evaluation.view_data import ViewError, find_runs, trainer_state


def test_plot_keys_order_known_first_then_the_rest():
    history = [{"grad_norm": 1.0, "zeta": 2, "loss": 3.0, "epoch": 1.0, "flag": True}, {"mean_token_accuracy": 0.5, "eval_runtime": 2}]
    assert plot_keys(history) == ["loss", "mean_token_accuracy", "grad_norm", "zeta"]


def test_a_demo_folder_is_searched_and_a_folder_without_runs_refused(tmp_path):
    demo = tmp_path / "demo"
    (demo / "rollout").mkdir(parents=True)
    (demo / "rollout/episodes.jsonl").write_text("{}\n")
    for step in (1, 3):
        (demo / f"grpo/checkpoint-{step}").mkdir(parents=True)
        (demo / f"grpo/checkpoint-{step}/trainer_state.json").write_text(json.dumps({"global_step": step}))
    (demo / "validation.json").write_text(json.dumps({"samples": 3, "models": {}}))
    (demo / "task").mkdir()
    (demo / "task/notes.json").write_text("[]")
    runs = find_runs([demo])
    assert [(r.kind, r.name) for r in runs] == [
        ("training", "demo/grpo"), ("rollout", "demo/rollout"), ("validation", "demo/validation.json")
    ]
    assert trainer_state(demo / "grpo") == demo / "grpo/checkpoint-3/trainer_state.json"
    assert [(r.kind, r.name) for r in find_runs([demo / "rollout/episodes.jsonl"])] == [("rollout", "rollout")]
    with pytest.raises(ViewError, match="task: no run found"):
        find_runs([demo / "task"])
    with pytest.raises(ViewError, match="gone: no such file or folder"):
        find_runs([demo / "gone"])


# ---------------------------------------------------------------- a run folder from someone else is untrusted


def _rollout(folder, records, **files):
    """A rollout folder: ``episodes.jsonl`` of ``records`` (dicts, or raw lines as str) and other files as given."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "episodes.jsonl").write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    for name, text in files.items():
        (folder / name.replace("__", ".")).write_text(text if isinstance(text, str) else json.dumps(text))
    return folder


def _episode(question="q0", arm="base", **extra) -> dict:
    record = {"id": f"{question}:{arm}:0", "source_id": question, "arm": arm, "sample": 0, "stop_reason": "final_answer",
              "turns": 1, "tool_calls": 0, "tool_errors": 0, "tool_error_codes": {}, "new_tokens": 3, "final_answer": "red",
              "correct": True, "gt_answer": "red", "images": ["EO_GYM_DATA/a.png"],
              "messages": [{"role": "user", "content": "<image>what colour?"}, {"role": "assistant", "content": "Final Answer: red"}]}
    return {**record, **extra}


def _render(paths, data_root=None):
    from eogym_sft.evaluation.view import render

    return render(find_runs(paths), data_root)


def _data(page: str) -> dict:
    start = page.index('id="eogym-data">') + len('id="eogym-data">')
    return json.loads(page[start : page.index("</script>", start)])


def _scene(root):
    from PIL import Image

    (root / "EO_GYM_DATA").mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (32, 32), (200, 30, 30)).save(root / "EO_GYM_DATA" / "a.png")
    return root


def test_images_come_only_from_the_paths_given_or_the_data_root_passed(tmp_path):
    """A received run.json names where images are read from: only a place inside the paths given counts."""
    elsewhere = _scene(tmp_path / "someone_elses_disk")
    run = _rollout(tmp_path / "received" / "rollout", [_episode()], run__json={"data_root": str(elsewhere)})
    page = _render([run])
    images = _data(page)["images"]
    assert [e.get("missing") for e in images.values()] == ["no data root (pass --data-root)"]
    assert f"{run / 'run.json'}: its data_root {elsewhere} lies outside the paths given: its images are not read" in page
    assert [("src" in e) for e in _data(_render([run], str(elsewhere)))["images"].values()] == [True]  # passed: read
    inside = _scene(tmp_path / "received" / "task")
    (run / "run.json").write_text(json.dumps({"data_root": str(inside)}))
    assert [("src" in e) for e in _data(_render([tmp_path / "received"]))["images"].values()] == [True]  # a demo's folder
    (run / "run.json").write_text(json.dumps({"data_root": str(tmp_path / "received" / ".." / "someone_elses_disk")}))
    assert "lies outside the paths given" in _render([tmp_path / "received"])


def test_a_file_of_the_run_that_leads_outside_it_is_not_read(tmp_path):
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"arms": {}, "token": "hunter2"}))
    run = _rollout(tmp_path / "run", [_episode()])
    (run / "summary.json").symlink_to(secret)
    (run / "episodes.rank0.jsonl").symlink_to(secret)
    page = _render([run])
    assert "hunter2" not in page and f"{run / 'summary.json'}: leads to {secret}, outside the paths given on the command line" in page


def test_fifos_and_devices_are_never_opened_to_block(tmp_path):
    import os
    import threading

    root = _scene(tmp_path / "run" / "root")
    os.mkfifo(root / "EO_GYM_DATA" / "fifo.png")
    run = _rollout(tmp_path / "run", [_episode(images=["EO_GYM_DATA/fifo.png"])], run__json={"data_root": str(root)})
    os.mkfifo(run / "summary.json")
    os.mkfifo(run / "skipped.jsonl")
    done = []
    worker = threading.Thread(target=lambda: done.append(_render([run])), daemon=True)
    worker.start()
    worker.join(30)
    assert done, "the page waited on a FIFO"
    page = done[0]
    for name in ("summary.json", "skipped.jsonl"):
        assert f"{run / name}: not a regular file (a FIFO, socket, device or folder): not read" in page
    assert [e["missing"] for e in _data(page)["images"].values()] == ["not a regular file (a FIFO, socket, device or folder): not read"]


def test_files_over_their_cap_are_named_not_read(tmp_path, monkeypatch):
    import eogym_sft.evaluation.view_data as view_data

    monkeypatch.setattr(view_data, "MAX_JSON_BYTES", 100)
    monkeypatch.setattr(view_data, "MAX_LINE_BYTES", 2000)
    big = _episode("q1", messages=[{"role": "user", "content": "x" * 3000}])
    run = _rollout(tmp_path / "run", [_episode(), big], summary__json={"arms": {}, "pad": "y" * 200})
    page = _render([run])
    size = (run / "summary.json").stat().st_size
    assert size > 100 and f"{run / 'summary.json'}: {size} bytes, over the 100-byte cap for it: not read" in page
    assert f"{run / 'episodes.jsonl'}:2: a line of " in page and "over the 2000-byte cap: skipped" in page
    assert [e["id"] for e in _data(page)["runs"][0]["episodes"]] == ["q0:base:0"]


HOSTILE_LINES = [
    "[" * 5000 + "]" * 5000,  # deeper than any parser's stack
    '{"a": ' + "[" * 100 + "]" * 100 + "}",  # deeper than MAX_DEPTH
    '{"turns": ' + "9" * 5000 + "}",  # past Python's digit limit
    "[1, 2]", '"a string"', "null", "{not json",
    json.dumps(_episode("q2", messages={"role": "user"})),
    json.dumps(_episode("q3", messages=[["not", "a", "message"], {"role": 3, "content": {"deep": [1]}}])),
    json.dumps(_episode("q4", images={"a": 1}, tool_error_codes=["x"], turns="many", EO_task=["a", "list"])),
    json.dumps(_episode("q5", messages=[{"role": "assistant", "tool_calls": [{"function": {"name": [1], "arguments": {"aoi": "x"}}}]},
                                        {"role": "tool", "content": [{"image": {"url": 5}}, {"text": None}]}])),
    json.dumps(_episode("q6", EO_task=["unhashable"], question_type={"a": 1})),
]
HOSTILE_SUMMARIES = [
    [], "text", {"arms": []}, {"arms": {"base": "x"}}, {"arms": {"base": {"overall": []}}},
    {"arms": {"base": {"overall": {"pass@1": "x"}, "by_EO_task": []}}, "paired": "x"},
    {"arms": {"base": {"overall": {}}}, "paired": [{"delta": "big", "ci95": "wide"}]},
    {"arms": {"base": {"overall": {}}}, "settings": {"ks": "1"}},
    {"arms": {"base": {"overall": {"n": 1}}}, "paired": [None, 3]},
]


@pytest.mark.parametrize("summary", HOSTILE_SUMMARIES, ids=range(len(HOSTILE_SUMMARIES)))
def test_json_of_any_shape_depth_or_size_is_named_never_a_traceback(tmp_path, summary):
    """One received run with hostile lines and a hostile summary beside a good run: the good run is shown whole,
    every bad line is named, and the page is written."""
    good = _rollout(tmp_path / "good", [_episode("g0"), _episode("g1")])
    bad = _rollout(tmp_path / "bad", [_episode("b0"), *HOSTILE_LINES], summary__json=summary)
    training = tmp_path / "training"
    training.mkdir()
    (training / "trainer_state.json").write_text(json.dumps({"log_history": [{"step": "one", "loss": 1.0}, {"loss": "x"}, 5]}))
    (tmp_path / "validation.json").write_text(json.dumps({"models": {"a": "x", "b": {"overall": [1]}}}))
    page = _render([good, bad, training, tmp_path / "validation.json"])
    runs = {r["name"]: r for r in _data(page)["runs"]}
    assert [e["id"] for e in runs["good"]["episodes"]] == ["g0:base:0", "g1:base:0"]
    assert {e["id"] for e in runs.get("bad", {"episodes": []})["episodes"]} >= {"b0:base:0"} or "bad: not shown" in page
    for number in (2, 3, 4, 5, 6, 7, 8):
        assert f"{bad / 'episodes.jsonl'}:{number}: " in page, number
    assert '<section id="run-0">' in page and '<section id="run-3">' in page


def test_read_regular_takes_only_a_regular_file_under_its_cap_inside_the_roots(tmp_path):
    import os

    from eogym_sft.evaluation.view_data import Unreadable, read_regular

    inside, outside = tmp_path / "run", tmp_path / "elsewhere"
    inside.mkdir()
    outside.mkdir()
    (inside / "a.json").write_text("{}")
    (outside / "secret.json").write_text("{}")
    (inside / "link.json").symlink_to(outside / "secret.json")
    os.mkfifo(inside / "fifo.json")
    assert read_regular(inside / "a.json", 2, (inside.resolve(),)) == b"{}"
    refusals = {
        inside / "link.json": f"leads to {outside / 'secret.json'}, outside the paths given on the command line: not read",
        inside / "fifo.json": "not a regular file (a FIFO, socket, device or folder): not read",
        inside: "not a regular file (a FIFO, socket, device or folder): not read",
        inside / "missing.json": "cannot be opened (No such file or directory)",
    }
    for path, why in refusals.items():
        with pytest.raises(Unreadable) as caught:
            read_regular(path, 100, (inside.resolve(),))
        assert str(caught.value) == f"{path}: {why}"
    with pytest.raises(Unreadable, match=r"a.json: 2 bytes, over the 1-byte cap for it: not read$"):
        read_regular(inside / "a.json", 1)
