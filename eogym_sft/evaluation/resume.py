"""Resumable rollouts: ``episodes.jsonl`` is an append-only log, one complete line per finished
episode (flushed and fsynced), so a run killed at any moment loses at most the episodes in flight.

``run.json`` in the output records the settings that decide the episodes (:func:`resume_key`); a
rerun into the same output with the same settings skips the ``(arm, question, sample)`` triples the
log already holds, and one with other settings or data is refused with what differs. A half-written
last line (the process died mid-write) is cut off and its episode runs again. Under several ranks
each rank appends to its own ``episodes.rank{R}.jsonl`` and rank 0 merges them into ``episodes.jsonl``.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict
from pathlib import Path

from ..guards import refuse_nonempty_output

RUN_FILE = "run.json"
EPISODES = "episodes.jsonl"
# Settings that change how a run is carried out, not which episodes it produces.
HOW_NOT_WHAT = ("output", "overwrite", "slots", "compile", "cuda_graphs", "judge_retries")
OUTPUTS = ("skipped.jsonl", "summary.json", "report.txt")


def resume_key(cfg) -> dict:
    """The settings and data hashes a resumed run must share with the run it continues."""
    from ..data.datasets import file_sha256
    from ..agent.policy_server import TRANSPORT_FIELDS

    key = {k: v for k, v in asdict(cfg).items() if k not in HOW_NOT_WHAT}
    key["policies"] = [{k: v for k, v in p.items() if k not in TRANSPORT_FIELDS} for p in key.get("policies", [])]
    key["data_sha256"] = {f: file_sha256(f) for f in cfg.data}
    return json.loads(json.dumps(key, default=str))  # what run.json holds reads back equal


def open_run(out: Path, key: dict, overwrite: bool, command: str) -> None:
    """Make ``out`` ready: new (write ``run.json``), the same run (continue), or refuse.

    ``overwrite`` drops an earlier run's episodes and starts over; a non-empty folder that is not a
    run, or a run of other settings, is refused (``FileExistsError`` naming what differs)."""
    record = out / RUN_FILE
    if overwrite:
        for path in [record, *episode_logs(out), *(out / name for name in OUTPUTS)]:
            path.unlink(missing_ok=True)
    elif record.is_file():
        earlier = json.loads(record.read_text())
        problems = differences(earlier, key)
        if problems:
            raise FileExistsError(
                f"{command}: {out} holds a run with other settings ({'; '.join(problems)}): "
                "rerun with the same settings to continue it, pick another output, or pass --overwrite"
            )
        return
    else:
        refuse_nonempty_output(out, False, command)
    out.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(key, indent=2, ensure_ascii=False) + "\n")


def differences(old: dict, new: dict, limit: int = 120) -> list[str]:
    """``field: old -> new`` for every top-level field that differs."""
    out = []
    for k in sorted(set(old) | set(new)):
        if old.get(k) != new.get(k):
            out.append(f"{k}: {json.dumps(old.get(k))[:limit]} -> {json.dumps(new.get(k))[:limit]}")
    return out


def episode_logs(out: Path) -> list[Path]:
    """The episode logs in ``out``: the merged one and any rank's own."""
    return [p for p in [out / EPISODES, *sorted(out.glob("episodes.rank*.jsonl"))] if p.is_file()]


def episode_file(group) -> str:
    return EPISODES if group.world == 1 else f"episodes.rank{group.rank}.jsonl"


def read_log(path: Path, repair: bool = False) -> list[dict]:
    """The episodes of one log. A last line with no newline is a write cut short: cut off when
    ``repair``, else left out. Any other line that is not a JSON object is an error naming it."""
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    if repair and len(complete) < len(data):
        with open(path, "r+b") as fh:
            fh.truncate(len(complete))
    records = []
    for n, line in enumerate(complete.decode("utf-8").splitlines(), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{n}: not a JSON episode ({err.msg}); the log is damaged: pass --overwrite to start over") from None
        if not isinstance(record, dict) or not {"arm", "source_id", "sample"} <= set(record):
            raise ValueError(f"{path}:{n}: not an episode record (arm, source_id, sample)")
        records.append(record)
    return records


def read_episodes(out: Path) -> dict[tuple, dict]:
    """Every finished episode in ``out`` by ``(arm, question id, sample)``."""
    done = {}
    for path in episode_logs(out):
        for record in read_log(path):
            done.setdefault((record["arm"], str(record["source_id"]), record["sample"]), record)
    return done


def order_key(arms: list[str], rows: list[tuple[str, dict]]):
    """Sort records as an uninterrupted one-process run writes them: by arm, row, sample."""
    arm_at = {a: i for i, a in enumerate(arms)}
    row_at = {str(r.get("id")): i for i, (_, r) in enumerate(rows)}
    return lambda rec: (arm_at.get(rec["arm"], len(arm_at)), row_at.get(str(rec["source_id"]), len(row_at)), rec["sample"])


def merge_episodes(out: Path, key) -> list[dict]:
    """All episodes of the run, sorted by ``key``; where ranks wrote logs of their own, also written
    as one ``episodes.jsonl`` (atomically) and the ranks' logs removed."""
    records = sorted(read_episodes(out).values(), key=key)
    if any(out.glob("episodes.rank*.jsonl")):
        tmp = out / (EPISODES + ".tmp")
        with open(tmp, "w") as fh:
            for record in records:
                fh.write(json.dumps(record, ensure_ascii=False) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, out / EPISODES)
        for path in out.glob("episodes.rank*.jsonl"):
            path.unlink()
    return records


class EpisodeLog:
    """Appends episode records to ``path``, one whole line at a time, flushed and fsynced; safe to
    share between threads. A half-written last line left by a killed run is cut off first."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if self.path.is_file():
            read_log(self.path, repair=True)
        self._lock = threading.Lock()
        self._fh = None

    def __enter__(self):
        self._fh = open(self.path, "a", encoding="utf-8")
        return self

    def write(self, record: dict) -> None:
        line = json.dumps(record, ensure_ascii=False) + "\n"
        with self._lock:
            self._fh.write(line)
            self._fh.flush()
            os.fsync(self._fh.fileno())

    def __exit__(self, *exc):
        self._fh.close()
