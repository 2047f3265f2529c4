"""EO-Gym's ``crop_optical_or_sar_image(image_url, aoi)``, computed on the data root.

``aoi`` is normalised ``[x0, y0, x1, y1]`` with ``0 <= x0 < x1 <= 1`` and ``0 <= y0 < y1 <= 1``. Each
edge becomes a pixel edge by ``floor(v * size + 0.5)`` (nearest integer, halves up; the product is
first rounded to 6 decimals so that ``0.15 * 10`` is 1.5, not 1.4999...), clamped to the image, and a
box that rounds to zero width or height grows to one pixel. On a 16x12 image ``[0.25, 0.25, 0.75, 0.75]``
gives ``bbox_px [4, 3, 12, 9]`` and an 8x6 crop, as EO-Gym's own tool does; EO-Gym's rule for halves
is not published, and this one is documented in ``docs/environment.md``.

The crop is the source decoded to 8-bit RGB by :func:`eogym_sft.data.images.load_rgb` (so 16-bit SAR is
stretched as everywhere else in the library), saved as PNG under the crop cache, named by a hash of
the source's bytes and the box: the same call on the same image gives the same name on every machine
and every run (the name is part of the tool result a model trains on), and a source that changes
gets a new name.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import tempfile
from pathlib import Path

from ...atomic import umask
from ...data.images import ImageError, load_rgb, resolve_image_path
from ...net import quoted, short
from ..results import CannotAnswer, ToolCallError

CROP_TOOL = "crop_optical_or_sar_image"
MAX_PATH_CHARS = 1024  # longer than any EO-Gym image path; a longer image_url is a model's mistake, not a file


def _finite(v) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)  # an int too large for a float raises OverflowError
    except OverflowError:
        return False


def parse_aoi(aoi) -> list[float]:
    """A valid normalised AOI as four floats, or :class:`ToolCallError` ``bad_arguments``."""
    if not (isinstance(aoi, (list, tuple)) and len(aoi) == 4 and all(_finite(v) for v in aoi)):
        raise ToolCallError("bad_arguments", f"aoi must be four numbers [x0, y0, x1, y1], got {quoted(aoi)}")
    x0, y0, x1, y1 = (float(v) for v in aoi)
    if not (0 <= x0 < x1 <= 1 and 0 <= y0 < y1 <= 1):
        raise ToolCallError("bad_arguments",
                            f"aoi must be normalised with 0 <= x0 < x1 <= 1 and 0 <= y0 < y1 <= 1, got {quoted(aoi)}")
    return [x0, y0, x1, y1]


def _edge(v: float, size: int) -> int:
    return min(size, max(0, math.floor(round(v * size, 6) + 0.5)))


def _span(lo: float, hi: float, size: int) -> tuple[int, int]:
    a, b = _edge(lo, size), _edge(hi, size)
    if b > a:
        return a, b
    return (a, a + 1) if a < size else (size - 1, size)


def crop_box(aoi: list[float], width: int, height: int) -> list[int]:
    """Pixel box ``[x0, y0, x1, y1]`` (end exclusive) of a valid normalised AOI on a ``width`` x ``height`` image."""
    x0, x1 = _span(aoi[0], aoi[2], width)
    y0, y1 = _span(aoi[1], aoi[3], height)
    return [x0, y0, x1, y1]


@functools.lru_cache(maxsize=4)
def _decoded(path: str, size: int, mtime_ns: int):
    """The last few sources, decoded: the samples of one row crop the same scene turn after turn, and
    decoding a 4000x4000 JPEG costs about a quarter of a second. Keyed by size and mtime, so a file
    that changes is decoded again; callers never modify the image (``crop`` makes a new one)."""
    return load_rgb(path)


@functools.lru_cache(maxsize=64)
def _content_digest(path: str, size: int, mtime_ns: int) -> str:
    """SHA-256 of the file's bytes; keyed by size and mtime (as :func:`_decoded`), so a file that changes
    is hashed again while the turns of one row read it once."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def crop_name(content_digest: str, box: list[int]) -> str:
    """The crop's file name: a hash of the source's content and the pixel box, never of its path or mtime."""
    return hashlib.sha256(json.dumps([content_digest, box]).encode()).hexdigest()[:32] + ".png"


def crop_image(source: Path, aoi: list[float], cache_dir: Path, data_root: Path) -> dict:
    """Crop ``source`` (an image under ``data_root``) to ``aoi``; write the PNG under ``cache_dir``
    (inside ``data_root``) unless it is there already; return the tool's result fields."""
    stat = source.stat()
    image = _decoded(str(source), stat.st_size, stat.st_mtime_ns)
    box = crop_box(aoi, *image.size)
    out = cache_dir / crop_name(_content_digest(str(source), stat.st_size, stat.st_mtime_ns), box)
    if not out.is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        # write then rename: parallel episodes asking for the same crop never see half a file
        fd, tmp = tempfile.mkstemp(suffix=".png", dir=cache_dir)
        os.fchmod(fd, 0o666 & ~umask())  # mkstemp makes 0600: a crop gets the user's umask as any output
        os.close(fd)
        try:
            # level 1: a quarter of the default level's time on a noisy 1000x1000 crop, and no larger
            image.crop(tuple(box)).save(tmp, format="PNG", compress_level=1)
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return {
        "cropped_path": out.relative_to(data_root).as_posix(),
        "width": box[2] - box[0],
        "height": box[3] - box[1],
        "bbox_px": box,
        "aoi_norm": aoi,
    }


class CropBackend:
    """The ``crop`` backend: answers ``crop_optical_or_sar_image`` for images under the data root."""

    name = "crop"

    def __init__(self, data_root: str | os.PathLike, cache_dir: str | os.PathLike, default_image: str | None = None):
        self.data_root = Path(data_root).resolve()
        self.cache_dir = Path(cache_dir).resolve()
        # a call without image_url crops this one (the row's only image); the row's schema decides
        # whether image_url may be left out at all (the environment checks required arguments first)
        self.default_image = default_image

    def answer(self, tool: str, arguments: dict) -> tuple[str, None]:
        if tool != CROP_TOOL:
            raise CannotAnswer(f"the crop backend only runs {CROP_TOOL}")
        aoi = parse_aoi(arguments.get("aoi"))
        rel = arguments.get("image_url", self.default_image)
        if not isinstance(rel, str) or not rel:
            raise ToolCallError("bad_arguments",
                                "image_url must be the path of an image, e.g. EO_GYM_DATA/<id>/<hash>.jpg")
        if len(rel) > MAX_PATH_CHARS:
            raise ToolCallError("bad_arguments",
                                f"image_url is {len(rel)} characters long, not an image path: {short(rel, 80)!r}")
        try:
            source = resolve_image_path(rel, self.data_root)
            found = source.is_file()
        except ImageError as err:
            raise ToolCallError("bad_arguments", f"image_url {short(rel, 80)!r}: {short(err.detail, 120)}") from None
        except OSError as err:  # ENAMETOOLONG for one path component, ELOOP, ...
            raise ToolCallError("bad_arguments",
                                f"image_url {short(rel, 80)!r} is not a usable path ({err.strerror})") from None
        if not found:
            raise CannotAnswer(f"no image {short(rel, 120)} under the data root")
        try:
            result = crop_image(source, aoi, self.cache_dir, self.data_root)
        except ImageError as err:
            raise CannotAnswer(f"cannot read {short(rel, 120)}: {err.reason}: {short(err.detail, 120)}") from None
        except OSError as err:  # the crop cache is full, read-only or not a folder: the tool failed, not the model
            raise ToolCallError("tool_failed",
                                f"the crop could not be saved to the crop cache ({err.strerror or err})") from None
        return json.dumps(result), None
