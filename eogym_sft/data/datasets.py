"""Training and validation data: a prepared folder, or raw EO-Gym JSONL prepared on the way in."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..models.processor import processor_fingerprint
from .prepare import (MAX_MESSAGES, PrepConfig, _check_row_size, _decode_line, check_drop_share, pixel_cap,
                      prepare_files, read_lines)
from .prepared import format_summary, load_prepared, write_prepared
from .traces import TraceError


def load_or_prepare(
    path: str, model: str, processor, cfg: PrepConfig, workdir: str | Path, num_proc: int = 1,
    allow_flag: str = "--allow-drops"
):
    """The dataset at ``path``: a prepared folder is loaded; a ``.jsonl`` file (or several, comma-separated)
    is prepared into ``workdir`` first. Fails if the folder was prepared with another processor. ``allow_flag``:
    how the caller's users spell the setting that goes on past the drop-share check."""
    if Path(path).is_dir():
        dataset, stats = load_prepared(path)
        expected = stats.get("settings", {}).get("processor_fingerprint")
        if expected is not None and expected != processor_fingerprint(processor):
            raise ValueError(
                f"{path} was prepared with a different processor or pixel cap (fingerprint {expected}, this model's "
                f"is {processor_fingerprint(processor)}): prepare it again with this --model and pixel settings"
            )
        return dataset, stats
    files = [p for p in path.split(",") if p]
    missing = [p for p in files if not Path(p).is_file()]
    if missing:
        raise FileNotFoundError(f"no such dataset file or prepared folder: {', '.join(missing)}")
    cached = Path(workdir) / "stats.json"
    if cached.is_file() and json.loads(cached.read_text()).get("settings") == prep_settings(
        files, model, processor, cfg
    ):
        return load_prepared(workdir)
    prepare_dataset(files, model, processor, cfg, workdir, num_proc, allow_flag)
    return load_prepared(workdir)


def prep_settings(files: list[str], model: str, processor, cfg: PrepConfig) -> dict:
    """What a prepared folder was made from, recorded in its ``stats.json`` (a folder is reused only when they
    match)."""
    min_pixels, max_pixels = pixel_cap(processor)
    settings = dict(
        vars(cfg), max_pixels=max_pixels, min_pixels=min_pixels, model=model, inputs=[str(p) for p in files],
        processor_fingerprint=processor_fingerprint(processor),
    )
    settings["input_hashes"] = {str(p): file_sha256(p) for p in files}
    return settings


def prepare_dataset(
    files: list[str], model: str, processor, cfg: PrepConfig, output: str | Path, num_proc: int = 1,
    allow_flag: str = "--allow-drops"
) -> dict:
    """Prepare EO-Gym JSONL ``files`` into ``output`` (``dataset/``, ``manifest.jsonl``, ``stats.json``) with
    ``processor`` (loaded from ``model``; it carries the pixel cap); print the summary and return the stats."""
    results = prepare_files(files, model, cfg, num_proc=num_proc, processor=processor)
    check_drop_share(results, cfg.max_drop_share, allow_flag)
    stats = write_prepared(output, results, prep_settings(files, model, processor, cfg))
    print(format_summary(stats))
    return stats


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_held_out(source_id: str, eval_fraction: float, seed: int = 42) -> bool:
    """Whether :func:`split_by_trace` puts the trace ``source_id`` (a row's id) in the eval set: a seeded hash of the
    id."""
    digest = hashlib.sha256(f"{seed}:{source_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < eval_fraction


def split_by_trace(dataset, eval_fraction: float, seed: int = 42):
    """``(train, eval)`` with every window of a trace on the same side, chosen by :func:`is_held_out`."""
    if eval_fraction <= 0:
        return dataset, None
    flags = [is_held_out(s, eval_fraction, seed) for s in dataset["source_id"]]
    train = dataset.select([i for i, f in enumerate(flags) if not f])
    held_out = dataset.select([i for i, f in enumerate(flags) if f])
    if len(held_out) == 0 or len(train) == 0:
        raise ValueError(f"eval_fraction={eval_fraction} leaves {len(train)} train and {len(held_out)} eval samples")
    return train, held_out


def read_rows(files: list[str], limit: int | None = None):
    """``(file:line, row)`` for the first ``limit`` lines of ``files`` (all when None); a line that is
    blank, not UTF-8 or not JSON comes as ``(file:line, TraceError)`` instead, so that callers name it."""
    count = 0
    for file in files:
        for line, raw in read_lines(file):
            if limit is not None and count >= limit:
                return
            count += 1
            try:
                if not raw.strip():
                    raise TraceError("blank_line", "<line>", "empty line")
                row = _decode_line(raw)
                _check_row_size(row, MAX_MESSAGES)
                yield f"{file}:{line}", row
            except TraceError as err:
                yield f"{file}:{line}", err
