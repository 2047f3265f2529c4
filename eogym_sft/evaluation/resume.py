"""Resumable rollouts: ``episodes.jsonl`` is an append-only log, one complete line per finished
episode (flushed and fsynced), so a run killed at any moment loses at most the episodes in flight.

``run.json`` in the output records the run's identity (:func:`resume_key`): the settings that decide the
episodes, the data's SHA-256, and fingerprints of the model's and each adapter's files (weights replaced
or retrained in place under the same path are another run). A rerun into the same output with the same
identity skips the ``(arm, question, sample)`` triples the log already holds; one with another identity
is refused with what differs, and a log record of no arm, question or sample of this run is refused by
file, line and field. Every record carries its run's identity (:func:`run_identity`: digests of the model, the
adapters, the policies and the other settings), so a log copied in from another run with the same questions and
arm names is refused naming which of them differ; a log reached through a symbolic link is never resumed, cut or
written through. One run at a time: the output folder is locked (``flock``) while a run uses it.
A write cut short (killed, disk full) is cut off (at once when the write fails, else on resume) and its
episode runs again. Records are ASCII JSON lines (:func:`eogym_sft.safe_json.record_line`) read back split
on ``b"\n"`` alone. Under several ranks each rank appends to its own ``episodes.rank{R}.jsonl`` and rank 0
merges them into ``episodes.jsonl``.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import threading
from dataclasses import asdict
from pathlib import Path

from ..atomic import write_lines_atomic, write_text_atomic
from ..guards import check_output, read_json_object, refuse_nonempty_output, refuse_output_over_input
from ..net import redact
from ..safe_json import UntrustedJSONError, jsonl_lines, loads, record_line

RUN_FILE = "run.json"
EPISODES = "episodes.jsonl"
# Settings that change how a run is carried out, not which episodes it produces.
HOW_NOT_WHAT = ("output", "overwrite", "slots", "cuda_graphs", "judge_retries")
OUTPUTS = ("skipped.jsonl", "summary.json", "report.txt")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
FINGERPRINT_SPAN = 1 << 20  # bytes hashed at each end of a weights file: a safetensors header and its last tensors


def files_fingerprint(folder: str | Path) -> dict | str:
    """What identifies the weights in ``folder`` cheaply: per weights or JSON file its size and the SHA-256 of its
    first and last MiB (a safetensors header holds every tensor's name, shape and offsets; a retrained file differs
    at its end). Not a folder (a hub id): its snapshot in the hub cache, else the name as given."""
    root = Path(folder)
    if not root.is_dir():
        root = _hub_snapshot(str(folder))
        if root is None:
            return str(folder)
    prints = {}
    for path in sorted(root.iterdir()):  # weights folders are flat; a nested checkpoint is another model
        if path.is_file() and (path.suffix in WEIGHT_SUFFIXES or path.suffix == ".json"):
            size = path.stat().st_size
            digest = hashlib.sha256()
            with open(path, "rb") as fh:
                digest.update(fh.read(FINGERPRINT_SPAN))
                if size > FINGERPRINT_SPAN:
                    fh.seek(max(FINGERPRINT_SPAN, size - FINGERPRINT_SPAN))
                    digest.update(fh.read(FINGERPRINT_SPAN))
            prints[path.name] = f"{size}:{digest.hexdigest()[:16]}"
    return prints


def _hub_snapshot(name: str) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache

        config = try_to_load_from_cache(name, "config.json")
    except (ImportError, ValueError):
        return None
    return Path(config).parent if isinstance(config, str) else None


def resume_key(cfg) -> dict:
    """The run's identity: the settings, data hashes and model and adapter fingerprints a resumed run must share
    with the run it continues (URLs with their credentials redacted: this is written to ``run.json``)."""
    from ..data.datasets import file_sha256
    from ..agent.policy_server import TRANSPORT_FIELDS

    key = {k: v for k, v in asdict(cfg).items() if k not in HOW_NOT_WHAT}
    key["policies"] = [{k: v for k, v in p.items() if k not in TRANSPORT_FIELDS} for p in key.get("policies", [])]
    key["data_sha256"] = {f: file_sha256(f) for f in cfg.data}
    key["model_fingerprint"] = files_fingerprint(cfg.model)
    key["adapter_fingerprints"] = {spec: files_fingerprint(spec.partition("=")[2] or spec) for spec in cfg.adapters}
    return redacted(json.loads(json.dumps(key, default=str)))  # what run.json holds reads back equal


IDENTITY = "run_identity"  # the field of an episode record that says which run wrote it
# Where the run's files are, not what they hold (the fingerprints and hashes say that): left out of the identity.
WHERE = ("model", "adapters", "adapter_fingerprints", "data", "data_root", "data_sha256", "policies",
         "model_fingerprint")


def run_identity(key: dict) -> dict:
    """What each episode record carries of the run that wrote it: a short digest of its model's files, its adapters'
    (by arm name), its policies and every other setting of :func:`resume_key` (the data by content)."""
    adapters = sorted((spec.partition("=")[0] if "=" in spec else "", json.dumps(fp, sort_keys=True))
                      for spec, fp in (key.get("adapter_fingerprints") or {}).items())
    parts = {
        "model": key.get("model_fingerprint"),
        "adapter": adapters,
        "policy": key.get("policies"),
        "settings": {**{k: v for k, v in key.items() if k not in WHERE},
                     "data": sorted((key.get("data_sha256") or {}).values())},
    }
    return {name: hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]
            for name, value in parts.items()}


def redacted(value):
    """``value`` (parsed JSON) with credentials redacted from every string (:func:`eogym_sft.net.redact`)."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, list):
        return [redacted(v) for v in value]
    if isinstance(value, dict):
        return {k: redacted(v) for k, v in value.items()}
    return value


class OutputLock:
    """An exclusive ``flock`` on the output folder itself, held while a run writes there; released when the
    process ends, however it ends. A second run into the folder is refused at once."""

    def __init__(self, out: Path, command: str):
        self.fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(self.fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise FileExistsError(f"{command}: {out} is in use by another run (locked): wait for it or pick "
                                      "another output") from None
            raise

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the last descriptor drops the flock
            self.fd = None


def open_run(out: Path, key: dict, overwrite: bool, command: str, inputs=()) -> OutputLock:
    """Make ``out`` ready and lock it: new (write ``run.json``), the same run (continue), or refuse.

    ``overwrite`` drops an earlier run's episodes and starts over; a folder holding one of ``inputs``, a
    non-empty folder that is not a run, or a run of another identity, is refused (``FileExistsError``
    naming what differs). Returns the lock, to release when the run is done."""
    refuse_output_over_input(out, inputs, command)
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    lock = OutputLock(out, command)
    try:
        _prepare(out, key, overwrite, command)
    except BaseException:
        lock.release()
        if made and not any(out.iterdir()):
            out.rmdir()
        raise
    return lock


def _prepare(out: Path, key: dict, overwrite: bool, command: str) -> None:
    record = out / RUN_FILE
    if overwrite:
        check_output(out, command, True, "rollout")  # never over another kind of run's files
        for path in [record, *episode_logs(out), *(out / name for name in OUTPUTS)]:
            path.unlink(missing_ok=True)
    elif record.exists():
        earlier = read_json_object(record, "the record of a rollout's settings")
        problems = differences(earlier, key)
        if problems:
            raise FileExistsError(
                f"{command}: {out} holds a run with other settings ({'; '.join(problems)}): "
                "rerun with the same settings to continue it, pick another output, or pass --overwrite"
            )
        return
    else:
        refuse_nonempty_output(out, False, command)
    write_text_atomic(record, json.dumps(key, indent=2, ensure_ascii=True) + "\n")


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


def refuse_link(path: Path) -> None:
    """A log reached through a symbolic link is another file's: never resumed, cut or appended to."""
    if path.is_symlink():
        raise FileExistsError(
            f"{path} is a symbolic link (to {os.readlink(path)}): a run's log is never resumed or written through a "
            "link; replace it with the file itself, pick another output, or pass --overwrite"
        )


def read_log(path: Path, repair: bool = False, expected: set | None = None,
             identity: dict | None = None) -> list[dict]:
    """The episodes of one log. A last line with no newline is a write cut short: cut off when
    ``repair``, else left out. Any other line that is not a JSON episode, or (given ``expected``, the run's
    ``(arm, question id, sample)`` triples) an episode of no arm, question or sample of this run, or (given
    ``identity``) one another run wrote, is an error naming file, line and field: the log holds records of
    another run."""
    if repair or identity is not None:
        refuse_link(path)
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    if repair and len(complete) < len(data):
        with open(path, "r+b") as fh:
            fh.truncate(len(complete))
    records = []
    for n, line in jsonl_lines(complete):
        try:
            record = loads(line)
        except UntrustedJSONError as err:
            raise ValueError(f"{path}:{n}: not a JSON episode ({err}); the log is damaged: pass --overwrite to start "
                             "over") from None
        if not isinstance(record, dict) or not {"arm", "source_id", "sample"} <= set(record):
            raise ValueError(f"{path}:{n}: not an episode record (arm, source_id, sample)")
        if expected is not None:
            _check_belongs(path, n, record, expected)
        if identity is not None:
            _check_identity(path, n, record, identity)
        records.append(record)
    return records


def _check_belongs(path: Path, n: int, record: dict, expected: set) -> None:
    triple = (record["arm"], str(record["source_id"]), record["sample"])
    if triple in expected:
        return
    arms = {a for a, _, _ in expected}
    questions = {q for _, q, _ in expected}
    field = "arm" if triple[0] not in arms else "source_id" if triple[1] not in questions else "sample"
    raise ValueError(
        f"{path}:{n}: field {field} {record[field]!r} is no {field} of this run: the log holds another run's records; "
        "remove them, pick another output, or pass --overwrite"
    )


def _check_identity(path: Path, n: int, record: dict, identity: dict) -> None:
    carried = record.get(IDENTITY)
    if carried == identity:
        return
    if not isinstance(carried, dict):
        which = "it carries no run identity (written by another tool or an older version)"
    else:
        which = f"its {', '.join(p for p in identity if carried.get(p) != identity[p])} differ from this run's"
    raise ValueError(
        f"{path}:{n}: an episode another run wrote ({which}): not resumed as this run's; remove the log, pick another "
        "output, or pass --overwrite"
    )


def read_episodes(out: Path, expected: set | None = None, identity: dict | None = None) -> dict[tuple, dict]:
    """Every finished episode in ``out`` by ``(arm, question id, sample)`` (each one of ``expected`` and written by
    the run of ``identity``, if given)."""
    done = {}
    for path in episode_logs(out):
        for record in read_log(path, expected=expected, identity=identity):
            done.setdefault((record["arm"], str(record["source_id"]), record["sample"]), record)
    return done


def order_key(arms: list[str], rows: list[tuple[str, dict]]):
    """Sort records as an uninterrupted one-process run writes them: by arm, row, sample."""
    arm_at = {a: i for i, a in enumerate(arms)}
    row_at = {str(r.get("id")): i for i, (_, r) in enumerate(rows)}
    return lambda rec: (arm_at.get(rec["arm"], len(arm_at)), row_at.get(str(rec["source_id"]), len(row_at)),
                        rec["sample"])


def merge_episodes(out: Path, key) -> list[dict]:
    """All episodes of the run, sorted by ``key``; where ranks wrote logs of their own, also written
    as one ``episodes.jsonl`` (atomically) and the ranks' logs removed."""
    records = sorted(read_episodes(out).values(), key=key)
    if any(out.glob("episodes.rank*.jsonl")):
        write_lines_atomic(out / EPISODES, (record_line(r) for r in records))
        for path in out.glob("episodes.rank*.jsonl"):
            path.unlink()
    return records


class EpisodeLog:
    """Appends episode records to ``path``, one whole line at a time, fsynced; safe to share between
    threads. A half-written last line left by a killed run is cut off first; a write that fails (disk full,
    interrupted) is cut off at once, so the log always ends on a whole record."""

    def __init__(self, path: Path, secrets=(), identity: dict | None = None):
        self.path = Path(path)
        self.identity = identity  # stamped on every record (run_identity): a resumed run takes only its own
        refuse_link(self.path)
        # the run's keys (a server may quote one back in a reply); only token-shaped ones: JSON-safe to replace
        self.secrets = [s for s in secrets if s and len(s) >= 8 and re.fullmatch(r"[A-Za-z0-9._~+/=:-]+", s)]
        if self.path.is_file():
            read_log(self.path, repair=True)
        self._lock = threading.Lock()
        self._fd = None

    def __enter__(self):
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
        return self

    def write(self, record: dict) -> None:
        line = record_line(record if self.identity is None else {**record, IDENTITY: self.identity})
        for secret in self.secrets:
            line = line.replace(secret, "***")
        data = memoryview(line.encode("ascii"))
        with self._lock:
            start = os.lseek(self._fd, 0, os.SEEK_END)
            try:
                while data:
                    data = data[os.write(self._fd, data):]
                os.fsync(self._fd)
            except BaseException:
                os.ftruncate(self._fd, start)
                raise

    def __exit__(self, *exc):
        os.close(self._fd)
