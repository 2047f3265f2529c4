"""The commands docs tell a newcomer to run first, run verbatim from the docs' text."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def marked_block(doc: Path, marker: str) -> list[str]:
    """The shell lines of the code block between ``<!-- marker -->`` and ``<!-- /marker -->``, continuations joined."""
    text = doc.read_text()
    block = re.search(rf"<!-- {marker}[^>]*-->\s*```bash\n(.*?)```\s*<!-- /{marker} -->", text, re.S)
    assert block, f"{doc}: no block marked {marker}"
    return [line for line in block.group(1).replace("\\\n", " ").splitlines() if line.strip()]


def as_argv(line: str) -> list[str]:
    """A doc line as this interpreter runs it: ``eogym-sft`` as this checkout's CLI, ``python`` as this Python."""
    argv = shlex.split(line)
    if argv[0] == "eogym-sft":
        return [sys.executable, "-m", "eogym_sft.cli", *argv[1:]]
    assert argv[0] == "python", line
    return [sys.executable, *argv[1:]]


@pytest.mark.slow(45)
def test_the_cpu_quickstart_in_training_md_runs_first_time(tmp_path):
    """docs/training.md's first command, in a fresh folder that sees the checkout's recipes/ and sample (as
    its root does): it trains, evaluates and saves, and prints no warning of ours."""
    for name in ("recipes", "eogym_sft"):
        (tmp_path / name).symlink_to(REPO / name)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "default"}
    outputs = []
    for line in marked_block(REPO / "docs" / "training.md", "cpu-quickstart"):
        done = subprocess.run(as_argv(line), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        outputs.append(done.stdout + done.stderr)
    run = tmp_path / "runs" / "eo_gym_4b_cpu"
    assert (run / "adapter_model.safetensors").is_file() and (run / "checkpoint-2").is_dir()
    info = json.loads((run / "eogym_run.json").read_text())
    assert info["data"]["samples"] == 40 and info["skipped_samples"] == {"train": 0, "eval": 0}
    log = "\n".join(outputs)
    assert "eval_loss" in log
    assert "Warning" not in log and "[WARNING]" not in log, [l for l in log.splitlines() if "arning" in l]
