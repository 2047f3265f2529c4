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


def _record(source_id="q0", arm="scripted", sample=0, **extra) -> dict:
    return {"arm": arm, "source_id": source_id, "sample": sample, **extra}


def test_foreign_records_in_the_log_are_refused_by_name(tmp_path):
    from eogym_sft.evaluation.resume import read_episodes

    expected = {("scripted", f"q{i}", 0) for i in range(3)}
    log = tmp_path / "episodes.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in [_record("q0"), _record("q1")]))
    assert sorted(read_episodes(tmp_path, expected)) == [("scripted", "q0", 0), ("scripted", "q1", 0)]
    foreigns = [(_record("q9"), "source_id", "'q9'"), (_record(arm="other"), "arm", "'other'"), (_record(sample=4), "sample", "4")]
    for foreign, field, value in foreigns:
        log.write_text("".join(json.dumps(r) + "\n" for r in [_record("q0"), foreign]))
        refused = rf"episodes.jsonl:2: field {field} {value} is no {field} of this run: the log holds another run's records"
        with pytest.raises(ValueError, match=refused):
            read_episodes(tmp_path, expected)


def _cfg(tmp_path, row_factory, model: Path, **extra):
    from eogym_sft.agent.policy_server import PolicyServer
    from eogym_sft.evaluation.rollout import RolloutConfig

    data = _data(tmp_path, row_factory, 2)
    policy = PolicyServer(url="http://alice:pw-in-url@127.0.0.1:9/v1/chat/completions?api_key=qk-1", model="scripted")
    return RolloutConfig(model=str(model), data=[str(data)], data_root=str(tmp_path), output=str(tmp_path / "out"), include_base=False,
                         policies=[policy], **extra)


def test_weights_replaced_under_the_same_folder_are_another_run(tmp_path, row_factory):
    from eogym_sft.evaluation.resume import open_run, resume_key

    model = tmp_path / "model"
    model.mkdir()
    weights = model / "model.safetensors"
    weights.write_bytes(b"a" * (3 << 20))
    (model / "config.json").write_text("{}")
    cfg, out = _cfg(tmp_path, row_factory, model), tmp_path / "out"
    open_run(out, resume_key(cfg), False, "eogym-sft rollout").release()
    recorded = (out / "run.json").read_text()
    assert "pw-in-url" not in recorded and "qk-1" not in recorded  # the URL's credentials stay out of run.json
    open_run(out, resume_key(cfg), False, "eogym-sft rollout").release()  # the same run continues
    weights.write_bytes(b"a" * ((3 << 20) - 1) + b"b")  # retrained in place: same size, same name
    with pytest.raises(FileExistsError, match=r"holds a run with other settings \(model_fingerprint: .*model.safetensors"):
        open_run(out, resume_key(cfg), False, "eogym-sft rollout")


def test_one_run_at_a_time_in_a_folder(tmp_path, row_factory):
    from eogym_sft.evaluation.resume import open_run, resume_key

    cfg, out = _cfg(tmp_path, row_factory, tmp_path / "hub-model"), tmp_path / "out"
    first = open_run(out, resume_key(cfg), False, "eogym-sft rollout")
    refused = rf"^eogym-sft rollout: {out} is in use by another run \(locked\): wait for it or pick another output$"
    with pytest.raises(FileExistsError, match=refused):
        open_run(out, resume_key(cfg), False, "eogym-sft rollout")
    first.release()
    open_run(out, resume_key(cfg), False, "eogym-sft rollout").release()


def test_an_output_holding_the_data_is_refused_and_a_damaged_record_named(tmp_path, row_factory):
    from eogym_sft.evaluation.resume import open_run, resume_key

    cfg = _cfg(tmp_path, row_factory, tmp_path / "hub-model")
    with pytest.raises(FileExistsError, match=f"the output {tmp_path} holds the input {cfg.data[0]}"):
        open_run(tmp_path, resume_key(cfg), True, "eogym-sft rollout", inputs=cfg.data)
    out = tmp_path / "out"
    out.mkdir()
    (out / "run.json").write_text("")  # a run killed while writing it, before run.json was atomic
    with pytest.raises(ValueError, match=r"out/run.json: empty, not the record of a rollout's settings \(JSON\)"):
        open_run(out, resume_key(cfg), False, "eogym-sft rollout")


def test_a_record_json_cannot_hold_fails_alone(tmp_path):
    from eogym_sft.evaluation.rollout import Scorer

    class Finished:
        def __init__(self, record):
            self._record = record

        def record(self):
            return self._record

    good = {**_record("q0"), "messages": [], "gt_answer": "3", "final_answer": "3", "stop_reason": "final_answer", "error": None}
    bad = {**good, "source_id": "q1", "messages": [{"role": "tool", "content": object()}]}
    path = tmp_path / "episodes.jsonl"
    with EpisodeLog(path) as log, Scorer(None, log) as scorer:
        scorer.add(Finished(good))
        scorer.add(Finished(bad))
    first, second = read_log(path)
    assert (first["source_id"], first["correct"]) == ("q0", True)
    assert (second["source_id"], second["stop_reason"], second["messages"]) == ("q1", "error", [])
    assert second["error"].startswith("unrecordable: the record is not JSON (TypeError: Object of type object is not JSON serializable")


try:
    from hypothesis import given, settings, strategies as st
except ImportError:  # pragma: no cover
    given = None

if given is not None:

    @settings(max_examples=200, deadline=None)
    @given(text=st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x10FFFF)))  # lone surrogates and U+2028 included
    def test_any_text_round_trips_through_the_episode_log(tmp_path_factory, text):
        path = tmp_path_factory.mktemp("log") / "episodes.jsonl"
        record = _record(text, messages=[{"role": "tool", "content": text}])
        with EpisodeLog(path) as log:
            log.write(record)
            log.write(_record("after"))
        assert read_log(path) == [record, _record("after")]


def _tmpfs(path: Path, size: str) -> None:
    path.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
    if os.geteuid() != 0 or subprocess.run(mount, capture_output=True).returncode:
        pytest.skip("needs root to mount a small tmpfs")


def test_a_full_disk_leaves_the_log_on_a_whole_record(tmp_path):
    disk = tmp_path / "disk"
    _tmpfs(disk, "64k")
    try:
        path = disk / "episodes.jsonl"
        with EpisodeLog(path) as log:
            log.write(_record("q0"))
            with pytest.raises(OSError) as err:
                log.write(_record("q1", messages=[{"content": "x" * (1 << 20)}]))
        assert err.value.errno == 28  # ENOSPC
        assert read_log(path) == [_record("q0")] and path.read_bytes().endswith(b"\n")
    finally:
        subprocess.run(["umount", str(disk)], check=True)


IDENTITY_CHANGES = {  # each part of a run's identity, and a change of it that keeps questions and arm names
    "model": {"model_fingerprint": {"model.safetensors": "9:other"}},
    "adapter": {"adapter_fingerprints": {"sft=runs/a": {"adapter_model.safetensors": "9:other"}}},
    "policy": {"policies": [{"url": "http://127.0.0.1:9/v1", "model": "another-model", "name": "scripted"}]},
    "settings": {"temperature": 0.7},
}


def test_the_identity_is_what_the_files_hold_not_where_they_are():
    """The same model, adapter and data under other paths are the same run; other data content is another run."""
    from eogym_sft.evaluation.resume import run_identity

    key = {"model": "/a/model", "model_fingerprint": {"w.safetensors": "9:abc"}, "adapters": ["sft=/a/sft"],
           "adapter_fingerprints": {"sft=/a/sft": {"adapter_model.safetensors": "9:def"}}, "data": ["/a/q.jsonl"],
           "data_root": "/a", "data_sha256": {"/a/q.jsonl": "f00d"}, "policies": [], "temperature": 0.0}
    moved = {**key, "model": "/b/model", "adapters": ["sft=/b/sft"], "adapter_fingerprints": {"sft=/b/sft": {"adapter_model.safetensors": "9:def"}},
             "data": ["/b/q.jsonl"], "data_root": "/b", "data_sha256": {"/b/q.jsonl": "f00d"}}
    assert run_identity(moved) == run_identity(key)
    other = run_identity({**key, "data_sha256": {"/a/q.jsonl": "beef"}})
    assert [p for p in other if other[p] != run_identity(key)[p]] == ["settings"]


@pytest.mark.parametrize("part", list(IDENTITY_CHANGES))
def test_a_log_of_another_run_with_the_same_questions_and_arms_is_refused_naming_what_differs(tmp_path, part):
    from eogym_sft.evaluation.resume import read_episodes, run_identity

    key = {"model": "m", "model_fingerprint": {"model.safetensors": "9:abc"}, "adapters": ["sft=runs/a"],
           "adapter_fingerprints": {"sft=runs/a": {"adapter_model.safetensors": "9:def"}},
           "policies": [{"url": "http://127.0.0.1:9/v1", "model": "scripted", "name": "scripted"}], "temperature": 0.0}
    expected = {("scripted", "q0", 0), ("scripted", "q1", 0)}
    with EpisodeLog(tmp_path / "episodes.jsonl", identity=run_identity(key)) as log:
        log.write(_record("q0"))
    assert list(read_episodes(tmp_path, expected, run_identity(key))) == [("scripted", "q0", 0)]  # its own: resumed
    with EpisodeLog(tmp_path / "episodes.jsonl", identity=run_identity({**key, **IDENTITY_CHANGES[part]})) as log:
        log.write(_record("q1"))
    refused = (rf"episodes.jsonl:2: an episode another run wrote \(its {part} differ from this run's\): not resumed as this "
               "run's; remove the log, pick another output, or pass --overwrite$")
    with pytest.raises(ValueError, match=refused):
        read_episodes(tmp_path, expected, run_identity(key))
    (tmp_path / "episodes.jsonl").write_text(json.dumps(_record("q0")) + "\n")  # no identity at all
    with pytest.raises(ValueError, match=r"episodes.jsonl:1: an episode another run wrote \(it carries no run identity"):
        read_episodes(tmp_path, expected, run_identity(key))


def test_a_log_reached_through_a_link_is_never_resumed_cut_or_written(tmp_path):
    from eogym_sft.evaluation.resume import read_episodes, run_identity

    elsewhere = tmp_path / "elsewhere.jsonl"
    elsewhere.write_text(json.dumps(_record("q0")) + '\n{"arm": "scri')
    out = tmp_path / "out"
    out.mkdir()
    for name in ("episodes.jsonl", "episodes.rank1.jsonl"):
        (out / name).symlink_to(elsewhere)
        refused = rf"{out / name} is a symbolic link \(to {elsewhere}\): a run's log is never resumed or written through a link"
        with pytest.raises(FileExistsError, match=refused):
            EpisodeLog(out / name, identity={})
        with pytest.raises(FileExistsError, match=refused):
            read_episodes(out, {("scripted", "q0", 0)}, run_identity({}))
        (out / name).unlink()
    assert elsewhere.read_text() == json.dumps(_record("q0")) + '\n{"arm": "scri'  # not cut, not appended to


@pytest.mark.slow(20)
def test_a_rollout_refuses_to_resume_a_log_copied_in_from_another_policy(tmp_path, data_root, row_factory, tiny_model_dir):
    """The probe's case: same questions, same arm name, another policy; resumed, it changed Pass@1."""
    import shutil

    from eogym_sft.cli import main

    data = _data(tmp_path, row_factory, 2)
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    with serve(lambda body, handler: scripted_policy(body)) as (url, _):
        other = _command(tiny_model_dir, data, data_root, theirs, url, "--no-base")
        other[other.index("scripted")] = "scripted=other-model"  # the same arm name, another served model
        main(other[2:])
        main(_command(tiny_model_dir, data, data_root, mine, url, "--no-base")[2:])
        (mine / "summary.json").unlink()
        shutil.copy(theirs / "episodes.jsonl", mine / "episodes.jsonl")
        with pytest.raises(SystemExit) as stop:
            main(_command(tiny_model_dir, data, data_root, mine, url, "--no-base")[2:])
    assert str(stop.value.code).startswith(
        f"eogym-sft rollout: {mine / 'episodes.jsonl'}:1: an episode another run wrote (its policy differ from this run's)")
