"""``eogym_run.json``'s provenance: the library's own version, and a git SHA only from its own checkout."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import eogym_sft
from eogym_sft.provenance import git_sha, versions

REPO = Path(__file__).resolve().parents[1]


def _git(cwd: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin"}
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True, env=env).stdout.strip()


def _repo_with(root: Path, files: dict[str, str]) -> str:
    root.mkdir(parents=True, exist_ok=True)
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "x")
    return _git(root, "rev-parse", "HEAD")


def test_sha_of_the_own_checkout_and_dirty_when_changed(tmp_path):
    root = tmp_path / "eogym_sft_checkout"
    head = _repo_with(root, {"setup.cfg": "[metadata]\nname = eogym_sft\n", "eogym_sft/__init__.py": ""})
    assert git_sha(root / "eogym_sft") == head
    (root / "eogym_sft/__init__.py").write_text("# changed\n")
    assert git_sha(root / "eogym_sft") == head + "-dirty"


def test_no_sha_from_a_repository_that_merely_holds_the_package(tmp_path):
    # a virtualenv inside the user's own project: the enclosing repository is not ours
    project = tmp_path / "project"
    _repo_with(project, {"setup.cfg": "[metadata]\nname = their_project\n", "venv/lib/site-packages/eogym_sft/__init__.py": ""})
    assert git_sha(project / "venv/lib/site-packages/eogym_sft") is None
    # their project at the top with our package vendored beside it: still not our checkout
    assert git_sha(project / "eogym_sft") is None
    assert git_sha(tmp_path / "not_git" / "eogym_sft") is None


def test_version_is_the_running_copys_even_when_not_installed(tmp_path):
    copy = tmp_path / "copy" / "eogym_sft"
    shutil.copytree(REPO / "eogym_sft", copy, ignore=shutil.ignore_patterns("__pycache__"))
    init = copy / "__init__.py"
    init.write_text(init.read_text().replace(f'__version__ = "{eogym_sft.__version__}"', '__version__ = "9.9.9"'))
    code = "import json, eogym_sft.provenance as r; print(json.dumps([r.__file__, r.versions()['eogym_sft'], r.git_sha()]))"
    out = subprocess.run([sys.executable, "-c", code], cwd=copy.parent, capture_output=True, text=True, check=True)
    where, version, sha = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(where).parent == copy and version == "9.9.9" and sha is None
    assert versions()["eogym_sft"] == eogym_sft.__version__
