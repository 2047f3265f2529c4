"""What a training run leaves next to its adapter: resolved config, git SHA, data hash, versions."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..provenance import git_sha, versions

__all__ = ["as_dict", "git_sha", "save_run", "versions", "write_run_info"]


def as_dict(config) -> dict:
    """A config dataclass as a plain dict (TrainingArguments through its own ``to_dict``)."""
    if hasattr(config, "to_dict"):  # TrainingArguments redacts tokens and makes enums plain
        return config.to_dict()
    return dataclasses.asdict(config)


def write_run_info(output_dir: str | Path, configs: dict, data_stats: dict, processor,
                   skipped: dict | None = None) -> Path:
    """Write ``eogym_run.json`` next to the adapter and return its path. ``skipped``: samples skipped
    for an image that failed after prep, ``{"train": n, "eval": n}`` (listed in skipped_samples.jsonl)."""
    ip = processor.image_processor
    info = {
        "git_sha": git_sha(),
        "config": {name: as_dict(cfg) for name, cfg in configs.items()},
        "data": {
            "content_hash": data_stats.get("content_hash"),
            "inputs": data_stats.get("settings", {}).get("input_hashes"),
            "samples": data_stats.get("samples_out"),
            "rows_in": data_stats.get("rows_in"),
            "rows_dropped": data_stats.get("rows_dropped"),
        },
        "processor": {"size": dict(ip.size), "patch_size": ip.patch_size, "merge_size": ip.merge_size},
        "versions": versions(),
        "skipped_samples": skipped or {"train": 0, "eval": 0},
    }
    path = Path(output_dir) / "eogym_run.json"
    path.write_text(json.dumps(info, indent=2, default=str) + "\n")
    return path


def save_run(trainer, processor, configs: dict, data_stats: dict) -> str:
    """Save the adapter, the processor (with its pixel cap) and ``eogym_run.json`` side by side in the
    trainer's ``output_dir``; return that folder."""
    from ..models.processor import save_processor
    from .trainer import (
        skipped_counts,  # the trainer is built already: no import cost here
    )

    output_dir = trainer.args.output_dir
    trainer.save_model(output_dir)
    if trainer.accelerator.is_main_process:
        save_processor(processor, output_dir)
        write_run_info(output_dir, configs, data_stats, processor, skipped_counts(trainer.state.log_history))
    return output_dir
