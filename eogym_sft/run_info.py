"""What a training run leaves next to its adapter: resolved config, git SHA, data hash, versions."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from importlib import metadata
from pathlib import Path

PACKAGES = ("eogym_sft", "torch", "transformers", "trl", "peft", "datasets", "accelerate", "deepspeed", "qwen-vl-utils", "liger-kernel")


def git_sha(repo: str | Path | None = None) -> str:
    """HEAD of the checkout this package runs from, with ``-dirty`` when it has local changes; ``unknown`` outside git."""
    repo = repo or Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("-dirty" if dirty.strip() else "")


def versions() -> dict:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _as_dict(config) -> dict:
    if hasattr(config, "to_dict"):  # TrainingArguments redacts tokens and makes enums plain
        return config.to_dict()
    return dataclasses.asdict(config)


def write_run_info(output_dir: str | Path, configs: dict, data_stats: dict, processor) -> Path:
    """Write ``eogym_run.json`` next to the adapter and return its path."""
    ip = processor.image_processor
    info = {
        "git_sha": git_sha(),
        "config": {name: _as_dict(cfg) for name, cfg in configs.items()},
        "data": {
            "content_hash": data_stats.get("content_hash"),
            "inputs": data_stats.get("settings", {}).get("input_hashes"),
            "samples": data_stats.get("samples_out"),
            "rows_in": data_stats.get("rows_in"),
            "rows_dropped": data_stats.get("rows_dropped"),
        },
        "processor": {"size": dict(ip.size), "patch_size": ip.patch_size, "merge_size": ip.merge_size},
        "versions": versions(),
    }
    path = Path(output_dir) / "eogym_run.json"
    path.write_text(json.dumps(info, indent=2, default=str) + "\n")
    return path
