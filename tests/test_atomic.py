"""Atomic writes (``eogym_sft/atomic.py``): whole or not at all, with the mode any new file of the user gets."""

from __future__ import annotations

import os
import stat

import pytest

from eogym_sft.atomic import umask, write_lines_atomic, write_text_atomic


@pytest.fixture
def mask():
    """Run with umask 027 (a mask no default gives), restored after."""
    old = os.umask(0o027)
    yield 0o027
    os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_umask_reads_the_mask_without_changing_it(mask):
    assert umask() == mask and umask() == mask


def test_an_atomic_write_gets_the_users_umask_not_0600(tmp_path, mask):
    write_text_atomic(tmp_path / "a.json", "{}")
    write_lines_atomic(tmp_path / "b.jsonl", ["{}\n"])
    (tmp_path / "c.txt").write_text("x")  # what any new file gets
    assert mode(tmp_path / "a.json") == mode(tmp_path / "b.jsonl") == mode(tmp_path / "c.txt") == 0o640
    os.chmod(tmp_path / "a.json", 0o600)
    write_text_atomic(tmp_path / "a.json", "{}")  # a replaced file gets it too
    assert mode(tmp_path / "a.json") == 0o640 and sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.jsonl", "c.txt"]


def test_every_kind_of_output_gets_the_users_umask(tmp_path, mask):
    """A task's rows, its scenes and the crop backend's crops, a rollout's episode log: none is left 0600."""
    from eogym_sft.environment.tasks import write_task
    from eogym_sft.evaluation.resume import EpisodeLog

    write_task(tmp_path / "task", 1)
    written = [p for p in (tmp_path / "task").rglob("*") if p.is_file()]
    assert {p.parts[len(tmp_path.parts) + 1] for p in written} == {"tasks.jsonl", "EO_GYM_DATA", "image_cache"}
    with EpisodeLog(tmp_path / "episodes.jsonl") as log:
        log.write({"arm": "a", "source_id": "q", "sample": 0})
    written.append(tmp_path / "episodes.jsonl")
    assert {p.name: mode(p) for p in written} == {p.name: 0o640 for p in written}


def test_the_view_page_gets_the_users_umask(tmp_path, mask):
    """The probe's case: ``eogym-sft view`` wrote its page 0600."""
    import json

    from eogym_sft.evaluation.view import write_report

    run = tmp_path / "roll"
    run.mkdir()
    record = {"id": "q:base:0", "arm": "base", "source_id": "q", "sample": 0, "messages": []}
    (run / "episodes.jsonl").write_text(json.dumps(record) + "\n")
    assert mode(write_report([run], tmp_path / "report.html")) == 0o640
