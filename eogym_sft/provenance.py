"""Where a run's code came from: this library's version and git SHA, and its dependencies' versions."""

from __future__ import annotations

import configparser
import subprocess
from importlib import metadata
from pathlib import Path

from . import __version__

PACKAGES = ("torch", "transformers", "trl", "peft", "datasets", "accelerate", "deepspeed", "qwen-vl-utils",
            "liger-kernel")


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()


def is_own_checkout(root: Path) -> bool:
    """``root`` is a checkout of this project: its setup.cfg names the package (not, say, a user's
    repository that holds a virtualenv with eogym_sft installed in it)."""
    parser = configparser.ConfigParser()
    try:
        parser.read(root / "setup.cfg")
    except configparser.Error:
        return False
    return parser.get("metadata", "name", fallback=None) == "eogym_sft"


def git_sha(package_dir: str | Path | None = None) -> str | None:
    """HEAD of the eogym_sft checkout the package runs from, with ``-dirty`` when it has local changes.

    ``None`` unless the package's parent folder is the top of a git checkout of this project: an
    installed copy inside another repository (a virtualenv in the user's project) has no SHA of ours.
    """
    root = Path(package_dir or Path(__file__).resolve().parent).parent
    try:
        top = Path(_git(root, "rev-parse", "--show-toplevel")).resolve()
        if top != root.resolve() or not is_own_checkout(root):
            return None
        dirty = _git(root, "status", "--porcelain", "--untracked-files=no")
        return _git(root, "rev-parse", "HEAD") + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def versions() -> dict:
    """This library's own version (of the copy running, installed or not) and its dependencies'."""
    out = {"eogym_sft": __version__}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out
