"""One policy for outputs (refuse a non-empty one unless --overwrite) and adapters (only on their base)."""

from __future__ import annotations

import json

import pytest

from eogym_sft.guards import (
    check_adapter_base,
    model_key,
    refuse_nonempty_output,
    same_base,
)


def test_a_non_empty_output_is_refused_unless_overwrite(tmp_path):
    refuse_nonempty_output(tmp_path / "new", overwrite=False, command="eogym-sft x")  # absent: fine
    (tmp_path / "empty").mkdir()
    refuse_nonempty_output(tmp_path / "empty", overwrite=False, command="eogym-sft x")  # empty folder: fine
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "a.txt").write_text("x")
    (tmp_path / "report.json").write_text("{}")
    for taken in ("full", "report.json"):
        with pytest.raises(FileExistsError, match=rf"eogym-sft x: .*{taken} exists and is not empty: .*--overwrite"):
            refuse_nonempty_output(tmp_path / taken, overwrite=False, command="eogym-sft x")
        refuse_nonempty_output(tmp_path / taken, overwrite=True, command="eogym-sft x")


def test_which_bases_are_the_same(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "Qwen3-VL-4B-Instruct").mkdir(parents=True)
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen3-VL-4B-Instruct" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    local = str(tmp_path / "models" / "Qwen3-VL-4B-Instruct")
    assert model_key(str(snapshot)) == "Qwen/Qwen3-VL-4B-Instruct"
    assert model_key("models/Qwen3-VL-4B-Instruct/") == local
    same = [
        ("Qwen/Qwen3-VL-4B-Instruct", "Qwen/Qwen3-VL-4B-Instruct"),
        ("Qwen/Qwen3-VL-4B-Instruct", str(snapshot)),  # the hub cache's copy is the hub id
        ("models/Qwen3-VL-4B-Instruct", local),  # relative and absolute
        ("Qwen/Qwen3-VL-4B-Instruct", local),  # a local copy of the hub model, by name
        ("/scratch/elsewhere/tiny-qwen3-vl", "runs/demo/tiny-qwen3-vl"),  # a folder moved between machines
    ]
    other = [
        ("Qwen/Qwen3-VL-4B-Instruct", "Qwen/Qwen3-VL-8B-Instruct"),
        ("Qwen/Qwen3-VL-4B-Instruct", "someone/Qwen3-VL-4B-Instruct"),  # two hub ids: exact
        ("Qwen/Qwen3-VL-4B-Thinking", local),
    ]
    assert all(same_base(a, b) and same_base(b, a) for a, b in same)
    assert not any(same_base(a, b) or same_base(b, a) for a, b in other)


def test_an_adapter_on_another_base_is_refused_naming_both(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "Qwen/Qwen3-VL-8B-Instruct"}))
    with pytest.raises(ValueError, match=r"trained on 'Qwen/Qwen3-VL-8B-Instruct' but --model is 'Qwen/Qwen3-VL-4B-Instruct'"):
        check_adapter_base(tmp_path, "Qwen/Qwen3-VL-4B-Instruct")
    check_adapter_base(tmp_path, "Qwen/Qwen3-VL-4B-Instruct", allow_other_base=True)
    check_adapter_base(tmp_path, "Qwen/Qwen3-VL-8B-Instruct")
    with pytest.raises(FileNotFoundError, match="no adapter_config.json"):
        check_adapter_base(tmp_path / "nowhere", "Qwen/Qwen3-VL-4B-Instruct")


def test_every_writing_command_refuses_a_non_empty_output(tmp_path):
    from eogym_sft.cli import main

    used = tmp_path / "used"
    used.mkdir()
    (used / "keep.txt").write_text("an earlier run")
    report = tmp_path / "report.json"
    report.write_text("{}")
    (tmp_path / "in.jsonl").write_text("")
    commands = {
        "prepare": ["prepare", "--input", str(tmp_path / "in.jsonl"), "--model", "m", "--output", str(used)],
        "tiny-model": ["tiny-model", "--output", str(used)],
        "validate": ["validate", "--model", "m", "--data", str(used), "--output", str(report)],
    }
    for name, argv in commands.items():
        with pytest.raises(SystemExit, match=rf"^eogym-sft {name}: .* exists and is not empty: .*--overwrite"):
            main(argv)
    assert (used / "keep.txt").read_text() == "an earlier run" and report.read_text() == "{}"


def test_validate_refuses_an_adapter_of_another_base(tmp_path):
    from eogym_sft.cli import main

    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "Qwen/Qwen3-VL-8B-Instruct"}))
    argv = ["validate", "--model", "Qwen/Qwen3-VL-4B-Instruct", "--adapter", str(tmp_path / "adapter"), "--data", "d", "--output", str(tmp_path / "r.json")]
    with pytest.raises(SystemExit, match=r"trained on 'Qwen/Qwen3-VL-8B-Instruct' but --model is 'Qwen/Qwen3-VL-4B-Instruct'"):
        main(argv)


def test_a_hub_id_offline_fails_at_once_with_the_hint(tmp_path, monkeypatch):
    import time

    from eogym_sft.cli import main

    (tmp_path / "rows.jsonl").write_text("{}\n")
    argv = ["prepare", "--input", str(tmp_path / "rows.jsonl"), "--model", "someorg/not-a-cached-model", "--output", str(tmp_path / "out")]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(SystemExit, match=r"^eogym-sft prepare: --model someorg/not-a-cached-model: .*HF_HUB_OFFLINE is set: "
                       r"offline, --model must be a local folder"):
        main(argv)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: as a machine with no network
    with pytest.raises(SystemExit, match=r"127\.0\.0\.1 cannot be reached .*offline, --model must be a local folder"):
        main(argv)
    assert time.monotonic() - start < 10  # not the hub client's minutes of retries
