"""Image paths, sizes and decoding. Pillow and numpy only, so the collator can import it.

Rules (documented in ``docs/data.md``):

* paths are relative to the data root; absolute paths and paths that leave the root are rejected;
* sizes come from the file header, without decoding pixels;
* data prep also checks that the whole file decodes (:func:`checked_image_size`), so that a file with a
  good header and a cut or corrupt body is dropped as ``corrupt_image`` before training;
* only regular files are opened (a FIFO, socket or device is ``not_a_file``: opening one can block for ever);
* a header above ``MAX_SOURCE_PIXELS``, or whose decoding would take more than ``MAX_DECODED_BYTES`` of
  memory, is refused before decoding (decompression bombs); a decode still reading after
  ``MAX_DECODE_SECONDS`` stops (``image_too_slow``);
* decoding gives 8-bit RGB: 16-bit and float images are stretched linearly from their own min..max
  to 0..255, a band of rows at a time; palette, grayscale and CMYK go through Pillow's ``convert("RGB")``; images with
  alpha are composited on white (the rule qwen-vl-utils' ``to_rgb`` applies); multi-frame TIFFs use frame 0;
  EXIF orientation is ignored so that decoded size equals header size.
"""

from __future__ import annotations

import functools
import math
import os
import stat
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

# Twice Pillow's own warning threshold: the point where Pillow itself raises DecompressionBombError.
MAX_SOURCE_PIXELS = 2 * 89_478_485
# Memory one image may take to decode and convert (:func:`decoded_bytes`): a 328 KB PNG can claim a 13000x13000
# 16-bit scene. 1 GiB holds a whole 10980x10980 Sentinel-2 tile in RGB (964 MB); a 16-bit scene of that size
# needs 723 MB. Decoding time follows from it: inflating and converting 1 GB takes a few seconds.
MAX_DECODED_BYTES = 1 << 30
# Seconds one file may take to decode (read and inflate; the 8-bit stretch after it is bounded by the bytes):
# a 1 GB decode takes a few seconds, so only a stalled or pathological file reaches it.
MAX_DECODE_SECONDS = 60.0
HIGH_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")  # stretched to 8 bits from their own range
STRETCH_BAND_PIXELS = 1 << 22  # pixels stretched at a time (32 MB as float64)


class ImageError(ValueError):
    """An image that cannot be used; ``reason`` is a stable code for the manifest."""

    def __init__(self, reason: str, path: str, detail: str):
        super().__init__(f"{reason}: {path}: {detail}")
        self.reason = reason
        self.path = path
        self.detail = detail


def resolve_image_path(path: str, data_root: str | os.PathLike) -> Path:
    """Resolve a row's relative image path under ``data_root``, refusing anything that escapes it."""
    if os.path.isabs(path) or path.startswith("~") or "://" in path:
        raise ImageError("unsafe_image_path", path, "image paths must be relative to the data root")
    root = Path(data_root).resolve()
    try:
        full = (root / path).resolve()
    except (ValueError, OSError, RuntimeError) as err:  # a NUL byte, a symlink loop
        raise ImageError("unsafe_image_path", path, f"cannot resolve the path ({err})") from None
    if not full.is_relative_to(root):
        raise ImageError("unsafe_image_path", path, "the path leaves the data root")
    return full


class _Deadline:
    """A file whose reads fail (``image_too_slow``) once ``seconds`` have passed since it was opened: Pillow
    decodes as it reads, a block of at most 64 KB at a time, so this bounds the time a decode takes."""

    def __init__(self, fh, path: str, seconds: float):
        self._fh, self._path, self._seconds = fh, path, seconds
        self._end = time.monotonic() + seconds

    def read(self, size: int = -1) -> bytes:
        if time.monotonic() > self._end:
            raise ImageError("image_too_slow", self._path, f"decoding took more than {self._seconds} s")
        return self._fh.read(size)

    def __getattr__(self, name):
        return getattr(self._fh, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._fh.close()


def open_regular(path: str | os.PathLike, seconds: float | None = None):
    """``path`` opened for reading in binary, refused (``not_a_file``) unless it is a regular file: opening a
    FIFO named ``x.png`` would wait for a writer for ever. ``O_NONBLOCK`` makes that open return at once,
    and the check is on the descriptor opened, so a file swapped for a FIFO after a ``stat`` is caught too.
    With ``seconds``, reads fail once that long has passed (:class:`_Deadline`)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ImageError("missing_image", str(path), "no such file") from None
    except IsADirectoryError:
        raise ImageError("not_a_file", str(path), "a folder, not an image file") from None
    except OSError as err:
        raise ImageError("corrupt_image", str(path), f"cannot open ({err.strerror or err})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ImageError("not_a_file", str(path), "not a regular file (a FIFO, socket, device or folder)")
    os.set_blocking(fd, True)
    fh = os.fdopen(fd, "rb")
    return fh if seconds is None else _Deadline(fh, str(path), seconds)


def decoded_bytes(mode: str, width: int, height: int) -> int:
    """Memory to decode a ``mode`` image and convert it to 8-bit RGB: Pillow's own pixels plus the RGB copy
    (Pillow keeps 4 bytes a pixel for RGB)."""
    source = 1 if mode in ("1", "L", "P") else 2 if mode.startswith("I;16") else 4
    return width * height * (source + 4)


def image_size(path: str | os.PathLike) -> tuple[int, int]:
    """``(width, height)`` from the file header, without decoding pixels; refused above ``MAX_SOURCE_PIXELS``
    pixels or ``MAX_DECODED_BYTES`` of decoding memory."""
    try:
        with open_regular(path) as fh, Image.open(fh) as img:
            width, height = img.size
            mode = img.mode
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        if isinstance(err, ImageError):
            raise
        raise ImageError("corrupt_image", str(path), f"unreadable header ({err})") from None
    except Image.DecompressionBombError as err:
        raise ImageError("image_too_large", str(path), str(err)) from None
    if width * height > MAX_SOURCE_PIXELS:
        raise ImageError("image_too_large", str(path), f"{width}x{height} exceeds {MAX_SOURCE_PIXELS} pixels")
    if width < 1 or height < 1:
        raise ImageError("corrupt_image", str(path), f"empty image {width}x{height}")
    need = decoded_bytes(mode, width, height)
    if need > MAX_DECODED_BYTES:
        raise ImageError("image_too_large", str(path),
                         f"{width}x{height} {mode} needs {need} bytes to decode, over {MAX_DECODED_BYTES}")
    return width, height


def checked_image_size(path: str | os.PathLike) -> tuple[int, int]:
    """``(width, height)`` of a file whose whole body has been checked to decode, as training will decode it.

    Each distinct file (path, size, modification time) is checked once per process: rows and their
    windows name the same scenes and crops many times.
    """
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise ImageError("missing_image", str(path), "no such file") from None
    return _checked_size(str(path), info.st_size, info.st_mtime_ns)


@functools.lru_cache(maxsize=1 << 16)
def _checked_size(path: str, size: int, mtime_ns: int) -> tuple[int, int]:
    width, height = image_size(path)
    try:
        with open_regular(path, MAX_DECODE_SECONDS) as fh, Image.open(fh) as img:
            if img.format == "PNG":
                img.verify()  # every chunk's CRC through IEND, without inflating the pixels
            else:
                if img.format == "JPEG":
                    # DCT scaling: the whole entropy-coded stream is still walked (a cut body fails), at
                    # a fraction of the inverse-DCT and colour work of a full decode.
                    img.draft(img.mode, (max(1, width // 8), max(1, height // 8)))
                img.seek(0)
                img.load()
    except (OSError, SyntaxError, ValueError) as err:
        if isinstance(err, ImageError):
            raise
        raise ImageError("corrupt_image", path, f"the file does not decode to the end ({err})") from None
    return width, height


def _bands(img: Image.Image):
    """Row bands of a one-band image as arrays of at most ``STRETCH_BAND_PIXELS`` pixels each."""
    rows = max(1, STRETCH_BAND_PIXELS // img.width)
    for top in range(0, img.height, rows):
        yield top, np.asarray(img.crop((0, top, img.width, min(img.height, top + rows))))


def stretch_to_l8(img: Image.Image) -> Image.Image:
    """A 16-bit, 32-bit or float image stretched linearly from its own min..max to 8-bit ``L``, a band of rows
    at a time (a whole-image float64 copy of a 13000x13000 scene is 1.35 GB, and the stretch made several);
    16-bit values go through a 65536-entry table computed by the same formula."""
    lo, hi = math.inf, -math.inf
    for _, band in _bands(img):
        lo, hi = min(lo, float(band.min())), max(hi, float(band.max()))
    out = np.zeros((img.height, img.width), np.uint8)
    if hi > lo:
        scale = 255.0 / (hi - lo)
        table = None
        if img.mode.startswith("I;16"):
            table = np.round((np.arange(65536, dtype=np.float64) - lo) * scale).clip(0, 255).astype(np.uint8)
        for top, band in _bands(img):
            rows = out[top : top + band.shape[0]]
            rows[:] = table[band] if table is not None else np.round((band.astype(np.float64) - lo) * scale)
    return Image.fromarray(out, mode="L")


def to_rgb8(img: Image.Image) -> Image.Image:
    """Convert any Pillow image to 8-bit RGB by the rules in this module's docstring."""
    if img.mode in HIGH_BIT_MODES:
        img = stretch_to_l8(img)
    if img.mode == "P":
        img = img.convert("RGBA" if "transparency" in img.info else "RGB")
    if img.mode in ("LA", "La", "PA", "RGBa"):
        img = img.convert("RGBA")
    if img.mode == "RGBA":
        background = Image.new("RGB", img.size, (255, 255, 255))
        background.paste(img, mask=img.getchannel("A"))
        return background
    return img.convert("RGB") if img.mode != "RGB" else img


def load_rgb(path: str | os.PathLike) -> Image.Image:
    """Decode an image file to 8-bit RGB (frame 0 of multi-frame files), refusing decompression bombs."""
    image_size(path)
    try:
        with open_regular(path, MAX_DECODE_SECONDS) as fh, Image.open(fh) as img:
            img.seek(0)
            img.load()
            if img.mode not in HIGH_BIT_MODES:
                return to_rgb8(img)
            gray = stretch_to_l8(img)
            img.close()  # frees the 16-bit pixels before the RGB copy is made (leaving ``with`` does not)
        return to_rgb8(gray)
    except (OSError, SyntaxError, ValueError) as err:
        if isinstance(err, ImageError):
            raise
        raise ImageError("corrupt_image", str(path), f"cannot decode ({err})") from None


def _pixels(image: Image.Image) -> int:
    return image.width * image.height


class ImageCache:
    """Images loaded by path, least recently used first out, within a budget; safe to share between threads.

    ``load(path)`` makes an entry (by default the decoded RGB image of :func:`load_rgb`) and ``cost(entry)``
    says how much of ``budget`` it takes (by default its pixels). The entry just loaded always stays, even
    over budget. A path is loaded once however many threads ask for it at the same time, and they all get
    the same object: the slot decoder tells images apart by identity (a prompt's cache is shared between
    the samples of a question only when their images are the very same objects).
    """

    def __init__(self, budget: int = 200_000_000, load=load_rgb, cost=_pixels):
        self.budget, self.load, self.cost = budget, load, cost
        self._entries: OrderedDict = OrderedDict()
        self._loading: dict = {}  # path -> Future of the load one thread is running
        self._used = 0
        self._lock = threading.Lock()

    def get(self, path: Path):
        with self._lock:
            if path in self._entries:
                self._entries.move_to_end(path)
                return self._entries[path]
            pending = self._loading.get(path)
            owner = pending is None
            if owner:
                pending = self._loading[path] = Future()
        if not owner:
            return pending.result()  # the owner's entry, or its exception raised again
        try:
            entry = self.load(path)  # outside the lock: decoding is the slow part, and threads share it
        except BaseException as err:
            with self._lock:
                del self._loading[path]
            pending.set_exception(err)
            raise
        with self._lock:
            del self._loading[path]
            self._entries[path] = entry
            self._used += self.cost(entry)
            while self._used > self.budget and len(self._entries) > 1:
                _, old = self._entries.popitem(last=False)
                self._used -= self.cost(old)
        pending.set_result(entry)
        return entry
