"""Resumable rollouts and rows over ranks: a run killed with SIGKILL mid-run and rerun ends with the
summary of an uninterrupted run; other settings are refused naming what differs; a half-written line
is cut off; two processes under torchrun (gloo, CPU) give one process's summary."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from policy_servers import scripted_policy, serve

from eogym_sft.evaluation.resume import EpisodeLog, read_log

REPO = Path(__file__).resolve().parents[2]


def _data(tmp_path, row_factory, n: int) -> Path:
    rows = []
    for i in range(n):
        row = row_factory(row_id=f"q{i}")
        row["gt_answer"] = "3" if i % 2 == 0 else "7"
        rows.append(json.dumps(row))
    path = tmp_path / "test.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def _command(tiny_model_dir, data, data_root, out, url, *extra) -> list[str]:
    return [
        "-m", "eogym_sft.cli", "rollout", "--model", str(tiny_model_dir), "--data", str(data), "--data-root", str(data_root),
        "--output", str(out), "--max-turns", "3", "--max-new-tokens", "2", "--max-length", "1024", "--no-progress",
        "--policy-url", url, "--policy-model", "scripted", "--policy-config", '{"concurrency": 1}', *extra,
    ]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}


def _outcome(out: Path) -> tuple[dict, list[dict]]:
    """What must not depend on how the run was carried out: the arms' figures, the paired deltas and
    counts, and the episodes (timing and the resume count aside)."""
    summary = json.loads((out / "summary.json").read_text())
    arms = {name: {k: v for k, v in a.items() if k != "timing"} for name, a in summary["arms"].items()}
    counts = {k: v for k, v in summary["counts"].items() if k != "episodes_resumed"}
    episodes = sorted(map(json.loads, (out / "episodes.jsonl").read_text().splitlines()), key=lambda e: e["id"])
    return {"arms": arms, "paired": summary["paired"], "counts": counts}, episodes


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.is_file() else 0


@pytest.mark.slow(22)
def test_a_killed_run_resumes_to_the_uninterrupted_summary(tmp_path, data_root, row_factory, tiny_model_dir):
    from eogym_sft.cli import main

    data = _data(tmp_path, row_factory, 6)
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    slow = [True]  # replies take 0.25 s until the kill, so that it lands mid-run; the runs after it need no wait

    def policy(body, handler):
        if slow[0]:
            time.sleep(0.25)
        return scripted_policy(body)

    with serve(policy) as (url, _):
        args = _command(tiny_model_dir, data, data_root, killed, url, "--no-base")
        log = open(tmp_path / "stderr.txt", "w")
        proc = subprocess.Popen([sys.executable, *args], cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 180
        while _lines(killed / "episodes.jsonl") < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        log.close()
        slow[0] = False
        assert proc.returncode == -signal.SIGKILL, (tmp_path / "stderr.txt").read_text()[-2000:]
        written = _lines(killed / "episodes.jsonl")
        assert 2 <= written < 6 and not (killed / "summary.json").exists()
        with open(killed / "episodes.jsonl", "a") as fh:
            fh.write('{"arm": "scripted", "source_id": "q5", "sam')  # a write cut short by the kill
        with pytest.raises(SystemExit, match=r"max_turns: 3 -> 4"):
            main([*args[2:], "--max-turns", "4"])
        for out in (killed, whole):
            main(_command(tiny_model_dir, data, data_root, out, url, "--no-base")[2:])
    resumed, uninterrupted = _outcome(killed), _outcome(whole)
    assert resumed == uninterrupted
    assert uninterrupted[0]["arms"]["scripted"]["overall"]["pass@1"] == 0.5
    assert json.loads((killed / "summary.json").read_text())["counts"]["episodes_resumed"] == written


def test_episode_log_cuts_a_half_written_line(tmp_path):
    path = tmp_path / "episodes.jsonl"
    path.write_text('{"arm": "a", "source_id": "q", "sample": 0}\n{"arm": "a", "sour')
    assert [r["source_id"] for r in read_log(path)] == ["q"]
    with EpisodeLog(path) as log:
        log.write({"arm": "a", "source_id": "q2", "sample": 0})
    assert path.read_text() == '{"arm": "a", "source_id": "q", "sample": 0}\n{"arm": "a", "source_id": "q2", "sample": 0}\n'
    path.write_text('{"arm": "a", "source_id": "q", "sample": 0}\nnot json\n{"arm": "a", "source_id": "q2", "sample": 0}\n')
    with pytest.raises(ValueError, match="episodes.jsonl:2: not a JSON episode"):
        read_log(path)


@pytest.mark.slow(31)
def test_two_ranks_under_torchrun_give_one_process_summary(tmp_path, data_root, row_factory, tiny_model_dir):
    from eogym_sft.cli import main

    data = _data(tmp_path, row_factory, 3)
    one, two = tmp_path / "one", tmp_path / "two"
    with serve(lambda body, handler: scripted_policy(body)) as (url, _):
        main(_command(tiny_model_dir, data, data_root, one, url, "--slots", "1")[2:])
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
        done = subprocess.run([*launch, *_command(tiny_model_dir, data, data_root, two, url, "--slots", "1")],
                              cwd=tmp_path, env=_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _outcome(two) == _outcome(one)
    assert sorted(p.name for p in two.iterdir()) == ["episodes.jsonl", "report.txt", "run.json", "skipped.jsonl", "summary.json"]
    summary = json.loads((two / "summary.json").read_text())
    assert summary["settings"]["world_size"] == 2 and summary["arms"]["base"]["timing"]["ranks"] == 2
    assert done.stdout.count("questions 3 (rows failed 0)") == 1  # rank 0 alone reports
