"""What ``eogym-sft view`` shows, gathered from run folders: the runs, their episodes and summaries.

A RUN is a folder (or a file) that one of the commands wrote, recognised by what it holds:

* a rollout (``eogym-sft rollout``, the demos' rollouts): ``episodes.jsonl`` (or its ``episodes.rank*.jsonl``
  of an interrupted multi-rank run), with ``run.json``, ``summary.json`` and ``skipped.jsonl`` where present;
* an evaluation (``eogym-sft evaluate``): ``results.jsonl``, one record per scored turn, and ``summary.json``;
* a training run (SFT or GRPO): ``trainer_state.json`` in it or in its last ``checkpoint-*/``;
* a validation report (``eogym-sft validate``, the SFT demo's ``validation.json``): a JSON file with ``models``.

A folder that is none of these is searched two levels down, so a demo's output folder is one RUN.

Every run folder is untrusted input (it may come from someone else): a file is read only if it is a regular
file (a FIFO or device is never opened to block), under a size cap (:data:`MAX_JSON_BYTES`,
:data:`MAX_LOG_BYTES`, :data:`MAX_LINE_BYTES`, :data:`MAX_IMAGE_BYTES`), and inside the paths given on the
command line; JSON of any shape, depth or size is skipped and named in the page's problems. Images are read
from the data root given with ``--data-root``, or from the one ``run.json`` records only when it lies inside
the paths given (a received ``run.json`` never points the page at files elsewhere).

Images become downscaled thumbnails here (deduplicated by content hash, within ``image_budget`` bytes: beyond it
an image is a link to its file); one that is missing or does not decode is a placeholder naming it.
:mod:`.view_episodes` turns the episodes into the page's records; :mod:`.view` renders the page.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ..data.images import ImageError, load_rgb, resolve_image_path
from ..data.tool_images import ToolImageRule
from ..safe_json import UntrustedJSONError, jsonl_lines, loads

IMAGE_BUDGET = 64 * 2**20  # bytes of embedded image data in one page
MAX_JSON_BYTES = 64 * 2**20  # one JSON file a run holds (summary.json, run.json, trainer_state.json, a report)
MAX_LOG_BYTES = 2**30  # one JSONL file (episodes.jsonl, results.jsonl, skipped.jsonl)
MAX_LINE_BYTES = 16 * 2**20  # one JSONL record
MAX_IMAGE_BYTES = 256 * 2**20  # one image file
THUMB_SIDE = 512  # longest side of an embedded image; the page shows it smaller and, clicked, at this size
LOSSLESS_PIXELS = 256 * 256  # images this small are embedded as PNG: a crop's fine texture survives
TEXT_LIMIT = 20_000  # characters of one message kept in the page (the rest is cut, and says so)
ATTACH_ALL = ToolImageRule("attach")  # every image path a tool result names is shown
# What the summary of an unfinished rollout needs of each episode (the fields agent.episodes.Episode.record() writes),
# with their types.
EPISODE_TYPES = {
    "arm": str, "source_id": (str, int), "stop_reason": str, "turns": int, "tool_calls": int, "tool_errors": int,
    "tool_error_codes": dict, "new_tokens": int, "final_answer": (str, type(None)),
}
EPISODE_FIELDS = tuple(EPISODE_TYPES)


class ViewError(ValueError):
    """A RUN that cannot be shown (nothing recognisable in it); the message names the path."""


class Unreadable(ValueError):
    """A file of a run that is not read: not a regular file, over its cap, or outside the paths given."""


def read_regular(path: Path, limit: int, roots=()) -> bytes:
    """The bytes of ``path`` if it is a regular file of at most ``limit`` bytes whose real path lies inside one of
    ``roots`` (when given); :class:`Unreadable` naming why not. The open never blocks (``O_NONBLOCK``) and the
    type is checked on the descriptor opened, so a FIFO, socket or device is refused, not waited on."""
    real = path.resolve()
    if roots and not any(real == root or root in real.parents for root in roots):
        raise Unreadable(f"{path}: leads to {real}, outside the paths given on the command line: not read")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise Unreadable(f"{path}: cannot be opened ({err.strerror or err})") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size > limit:  # checked before fdopen, which refuses a folder
        os.close(fd)
        if not stat.S_ISREG(info.st_mode):
            raise Unreadable(f"{path}: not a regular file (a FIFO, socket, device or folder): not read")
        raise Unreadable(f"{path}: {info.st_size} bytes, over the {limit}-byte cap for it: not read")
    os.set_blocking(fd, True)
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise Unreadable(f"{path}: over the {limit}-byte cap for it: not read")
    return data


# ---------------------------------------------------------------- finding and reading runs


@dataclass
class Run:
    """One recognised run: its ``kind`` (rollout, evaluation, training, validation) and its path."""

    kind: str
    path: Path
    name: str = ""
    roots: tuple[Path, ...] = field(default=())  # the real paths given on the command line: nothing outside is read


def run_kind(path: Path) -> str | None:
    """What ``path`` holds, or None."""
    if path.is_file():
        return "validation" if path.suffix == ".json" and _is_validation(path) else None
    if (path / "episodes.jsonl").is_file() or any(path.glob("episodes.rank*.jsonl")):
        return "rollout"
    if (path / "results.jsonl").is_file():
        return "evaluation"
    if trainer_state(path) is not None:
        return "training"
    return None


def _is_validation(path: Path) -> bool:
    try:
        report = loads(read_regular(path, MAX_JSON_BYTES))
    except (OSError, ValueError):
        return False
    return isinstance(report, dict) and isinstance(report.get("models"), dict)


def trainer_state(path: Path) -> Path | None:
    """``trainer_state.json`` of a training output: its own, else its highest ``checkpoint-N``'s."""
    if (path / "trainer_state.json").is_file():
        return path / "trainer_state.json"
    states = [p for p in path.glob("checkpoint-*/trainer_state.json") if p.parent.name.split("-")[-1].isdigit()]
    return max(states, key=lambda p: int(p.parent.name.split("-")[-1]), default=None)


def find_runs(paths: list[str | Path]) -> list[Run]:
    """The runs named by ``paths``: each path itself, or, if it is none, the runs up to two levels under it
    (a demo's output) plus a ``validation.json`` there. Raises :class:`ViewError` for a path with none."""
    runs = []
    for given in map(Path, paths):
        if not given.exists():
            raise ViewError(f"{given}: no such file or folder")
        if given.is_file() and given.name in ("episodes.jsonl", "results.jsonl", "trainer_state.json"):
            given = given.parent  # the run is the folder the file is in
        root = given.resolve()
        found = [
            Run(r.kind, r.path, r.name, (root if root.is_dir() else root.parent,))
            for r in _runs_in(given, given, depth=2)
        ]
        if not found:
            raise ViewError(
                f"{given}: no run found (looked for episodes.jsonl, results.jsonl, trainer_state.json or "
                "checkpoint-*/, a validation report, here and two levels down)"
            )
        runs += found
    return runs


def _runs_in(path: Path, top: Path, depth: int) -> list[Run]:
    kind = run_kind(path)
    if kind:
        name = path.name if path == top else path.relative_to(top.parent).as_posix()
        return [Run(kind, path, name)]
    if depth == 0 or not path.is_dir():
        return []
    found = []
    for child in sorted(path.iterdir()):
        if child.is_dir() or child.name == "validation.json":
            found += _runs_in(child, top, depth - 1)
    return found


def read_jsonl(path: Path, problems: list[str], roots=()) -> list[dict]:
    """The JSON objects of ``path``; a line that is not one (malformed, too deep, over :data:`MAX_LINE_BYTES`, not
    an object) is left out and named in ``problems`` (the half-written last line of a killed run is one), and so
    is a file :func:`read_regular` refuses."""
    try:
        data = read_regular(path, MAX_LOG_BYTES, roots)
    except Unreadable as err:
        problems.append(str(err))
        return []
    records = []
    for number, line in jsonl_lines(data):
        if len(line) > MAX_LINE_BYTES:
            problems.append(f"{path}:{number}: a line of {len(line)} bytes, over the {MAX_LINE_BYTES}-byte cap: "
                            "skipped")
            continue
        try:
            record = loads(line)
        except UntrustedJSONError as err:
            problems.append(f"{path}:{number}: not usable JSON ({err}): skipped")
            continue
        if not isinstance(record, dict):
            problems.append(f"{path}:{number}: not a JSON object: skipped")
            continue
        records.append(record)
    return records


def read_json(path: Path, problems: list[str], roots=()) -> dict | None:
    """The JSON object in ``path`` (None when there is no such file); anything else is named in ``problems``."""
    if not (path.exists() or path.is_symlink()):
        return None
    try:
        value = loads(read_regular(path, MAX_JSON_BYTES, roots))
    except (Unreadable, UntrustedJSONError) as err:
        problems.append(f"{path}: not read ({err})" if isinstance(err, UntrustedJSONError) else str(err))
        return None
    if not isinstance(value, dict):
        problems.append(f"{path}: not a JSON object ({type(value).__name__}): not read")
        return None
    return value


# ---------------------------------------------------------------- images and texts shared by the page


class ImageStore:
    """The page's images by id: ``src`` (a data URI) for an embedded one; ``missing`` (why) for one that
    cannot be shown; ``file`` (its URI) for one over the budget. Identical files are embedded once."""

    def __init__(self, budget: int = IMAGE_BUDGET):
        self.budget, self.used = budget, 0
        self.entries: dict[str, dict] = {}
        self._by_path: dict[tuple[str, str], str] = {}

    def ref(self, rel, data_root: Path | None) -> str:
        """The id of the image ``rel`` (a row's relative path) under ``data_root``."""
        key = (str(data_root), str(rel))
        if key not in self._by_path:
            self._by_path[key] = self._add(rel, data_root)
        return self._by_path[key]

    def _missing(self, rel, why: str) -> str:
        ref = f"missing:{rel}"
        self.entries.setdefault(ref, {"path": str(rel), "missing": why})
        return ref

    def _add(self, rel, data_root: Path | None) -> str:
        if not isinstance(rel, str) or not rel:
            return self._missing(rel, "no image for this <image> tag")
        if data_root is None:
            return self._missing(rel, "no data root (pass --data-root)")
        try:
            path = resolve_image_path(rel, data_root)
            data = read_regular(path, MAX_IMAGE_BYTES)
        except ImageError as err:
            return self._missing(rel, err.reason)
        except Unreadable as err:
            return self._missing(rel, str(err).removeprefix(f"{path}: "))
        ref = hashlib.sha256(data).hexdigest()[:20]
        if ref in self.entries:
            return ref
        try:
            src, width, height = thumbnail(path)
        except (ImageError, OSError, ValueError) as err:
            return self._missing(rel, f"does not decode ({err})")
        entry = {"path": rel, "w": width, "h": height, "file": path.as_uri()}
        if self.used + len(src) <= self.budget:
            entry["src"] = src
            self.used += len(src)
        self.entries[ref] = entry
        return ref


def thumbnail(path: Path) -> tuple[str, int, int]:
    """``(data URI, width, height)``: the image at most :data:`THUMB_SIDE` on its longest side; PNG when
    small (a crop's pixels intact), else JPEG."""
    image = load_rgb(path)
    width, height = image.size
    out = io.BytesIO()
    if width * height <= LOSSLESS_PIXELS:
        image.save(out, "PNG", optimize=True)
        kind = "png"
    else:
        image.thumbnail((THUMB_SIDE, THUMB_SIDE))
        image.save(out, "JPEG", quality=80)
        kind = "jpeg"
    return f"data:image/{kind};base64," + base64.b64encode(out.getvalue()).decode(), width, height


class Texts:
    """Message texts interned once for the page (a system prompt or question repeats in every sample)."""

    def __init__(self):
        self.items: list[str] = []
        self._index: dict[str, int] = {}

    def add(self, text: str) -> int:
        if len(text) > TEXT_LIMIT:
            text = text[:TEXT_LIMIT] + f"\n[... {len(text) - TEXT_LIMIT} more characters not shown]"
        if text not in self._index:
            self._index[text] = len(self.items)
            self.items.append(text)
        return self._index[text]


# ---------------------------------------------------------------- training metrics


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def run_data_root(run: Run, data_root: str | None, problems: list[str]) -> Path | None:
    """Where ``run``'s images are read from: ``--data-root`` if given, else the data root its ``run.json`` records
    when that lies inside the paths given on the command line (named in ``problems`` when it does not)."""
    if data_root:
        return Path(data_root)
    recorded = read_json(run.path / "run.json", problems, run.roots) or {}
    root = recorded.get("data_root")
    if not isinstance(root, str) or not root or "\0" in root:
        return None
    real = Path(root).resolve()
    if not any(real == r or r in real.parents for r in run.roots):
        problems.append(
            f"{run.path / 'run.json'}: its data_root {root} lies outside the paths given: its images are not read "
            "(pass --data-root to show them)"
        )
        return None
    return Path(root)
