"""Resume only from a complete checkpoint of the same run; a new run leaves an earlier run's folder alone."""

from __future__ import annotations

import json

import pytest

from eogym_sft.training.resume import (
    MARKER,
    finished,
    identity_differences,
    refuse_used_output_dir,
    resolve_resume,
    run_identity,
)

IDENTITY = run_identity({"training": {"learning_rate": 1e-4, "seed": 42, "output_dir": "runs/a"}, "script": {"max_pixels": 1003520}}, "abc")


def _checkpoint(root, step: int, identity=IDENTITY, complete: bool = True, max_steps: int = 10):
    folder = root / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, "max_steps": max_steps}))
    if complete:
        (folder / MARKER).write_text(json.dumps({**identity, "step": step}))
    return folder


def test_last_takes_the_newest_complete_checkpoint(tmp_path, caplog):
    _checkpoint(tmp_path, 2)
    _checkpoint(tmp_path, 10)
    _checkpoint(tmp_path, 12, complete=False)  # killed while saving
    with caplog.at_level("WARNING"):
        assert resolve_resume("last", tmp_path, IDENTITY) == tmp_path / "checkpoint-10"
    assert "checkpoint-12 is incomplete" in caplog.text
    assert resolve_resume("true", tmp_path, IDENTITY) == tmp_path / "checkpoint-10"
    assert resolve_resume(str(tmp_path / "checkpoint-2"), tmp_path, IDENTITY) == tmp_path / "checkpoint-2"
    assert resolve_resume(None, tmp_path, IDENTITY) is None and resolve_resume("false", tmp_path, IDENTITY) is None
    with pytest.raises(FileNotFoundError, match="checkpoint-12: not a complete checkpoint"):
        resolve_resume(str(tmp_path / "checkpoint-12"), tmp_path, IDENTITY)


def test_no_complete_checkpoint_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint-\\* folder"):
        resolve_resume("last", tmp_path, IDENTITY)
    _checkpoint(tmp_path, 3, complete=False)
    with pytest.raises(FileNotFoundError, match=r"only incomplete ones \(checkpoint-3\)"):
        resolve_resume("last", tmp_path, IDENTITY)


def test_a_checkpoint_of_another_run_is_refused_saying_what_differs(tmp_path):
    _checkpoint(tmp_path, 4)
    other = run_identity(
        {"training": {"learning_rate": 2e-4, "seed": 42, "output_dir": "runs/b"}, "script": {"max_pixels": 1003520}}, "def"
    )
    with pytest.raises(ValueError) as info:
        resolve_resume("last", tmp_path, other)
    assert str(info.value).splitlines()[1:] == ["  data content hash: abc -> def", "  training.learning_rate: 0.0001 -> 0.0002"]
    assert identity_differences(IDENTITY, run_identity({"training": {"learning_rate": 1e-4, "seed": 42, "output_dir": "x"}, "script": {"max_pixels": 1003520}}, "abc")) == []


def test_finished_and_used_output_dirs(tmp_path):
    assert finished(_checkpoint(tmp_path, 10, max_steps=10)) and not finished(_checkpoint(tmp_path, 5, max_steps=10))
    refuse_used_output_dir(tmp_path / "new", overwrite=False, resuming=False)
    (tmp_path / "prepared_only" / "prepared").mkdir(parents=True)  # a data cache is no earlier run
    refuse_used_output_dir(tmp_path / "prepared_only", overwrite=False, resuming=False)
    with pytest.raises(FileExistsError, match=r"holds an earlier run \(checkpoint-10, checkpoint-5\): .*--resume_from_checkpoint last"):
        refuse_used_output_dir(tmp_path, overwrite=False, resuming=False)
    refuse_used_output_dir(tmp_path, overwrite=True, resuming=False)
    refuse_used_output_dir(tmp_path, overwrite=False, resuming=True)


@pytest.mark.parametrize("damaged", [MARKER, "trainer_state.json"])
@pytest.mark.parametrize("content", ['{"config": {"tra', "", "\xff not json", "[1, 2]"])
def test_a_damaged_marker_or_trainer_state_falls_back_to_the_previous_checkpoint(tmp_path, caplog, damaged, content):
    _checkpoint(tmp_path, 2)
    newest = _checkpoint(tmp_path, 4)
    (newest / damaged).write_text(content)  # cut short while written, or overwritten with junk
    with caplog.at_level("WARNING"):
        assert resolve_resume("last", tmp_path, IDENTITY) == tmp_path / "checkpoint-2"
    assert "checkpoint-4 is incomplete" in caplog.text and "missing or damaged" in caplog.text
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        resolve_resume(str(newest), tmp_path, IDENTITY)


def test_the_marker_is_written_atomically(tmp_path, monkeypatch):
    import os
    from types import SimpleNamespace

    from eogym_sft.training.resume import CheckpointIdentity

    (tmp_path / "checkpoint-3").mkdir()
    (tmp_path / "checkpoint-3" / MARKER).write_text("old, whole")
    state = SimpleNamespace(global_step=3, is_world_process_zero=True)

    def killed(src, dst):
        raise KeyboardInterrupt  # a kill just before the rename

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        CheckpointIdentity(IDENTITY).on_save(SimpleNamespace(output_dir=str(tmp_path)), state, None)
    assert (tmp_path / "checkpoint-3" / MARKER).read_text() == "old, whole"
    assert sorted(p.name for p in (tmp_path / "checkpoint-3").iterdir()) == [MARKER]  # no temporary left behind
    monkeypatch.undo()
    CheckpointIdentity(IDENTITY).on_save(SimpleNamespace(output_dir=str(tmp_path)), state, None)
    assert json.loads((tmp_path / "checkpoint-3" / MARKER).read_text()) == {**IDENTITY, "step": 3}


def test_overwrite_starts_new_run_records(tmp_path):
    from eogym_sft.training.resume import clear_earlier_run

    _checkpoint(tmp_path, 2)
    (tmp_path / "skipped_samples.jsonl").write_text('{"sample_id": "old"}\n')
    (tmp_path / "eogym_run.json").write_text("{}")
    clear_earlier_run(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_skipped_samples_log_that_is_a_link_is_refused_before_the_run(tmp_path):
    elsewhere = tmp_path / "elsewhere.jsonl"
    elsewhere.write_text("mine\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "skipped_samples.jsonl").symlink_to(elsewhere)
    for overwrite, resuming in ((False, False), (True, True), (False, True)):
        with pytest.raises(FileExistsError, match=r"skipped_samples.jsonl is a symbolic link: a run's log is never written through a link"):
            refuse_used_output_dir(out, overwrite=overwrite, resuming=resuming)
    from eogym_sft.training.resume import clear_earlier_run

    refuse_used_output_dir(out, overwrite=True, resuming=False)  # a new run: clear_earlier_run removes the link itself
    clear_earlier_run(out)
    assert not (out / "skipped_samples.jsonl").exists() and elsewhere.read_text() == "mine\n"
