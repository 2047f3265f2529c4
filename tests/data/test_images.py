"""Image paths, header sizes and decoding: every input becomes 8-bit RGB of its header size."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import threading
import zlib

import numpy as np
import pytest
from PIL import Image

from eogym_sft.data import images
from eogym_sft.data.images import (
    ImageCache,
    ImageError,
    checked_image_size,
    image_size,
    load_rgb,
    resolve_image_path,
    to_rgb8,
)


def _reason(fn, *args):
    with pytest.raises(ImageError) as info:
        fn(*args)
    return info.value.reason


# ---- paths ---------------------------------------------------------------------------------------


def test_relative_paths_resolve_under_the_root(tmp_path):
    assert resolve_image_path("EO_GYM_DATA/ab/x.jpg", tmp_path) == tmp_path.resolve() / "EO_GYM_DATA/ab/x.jpg"
    # `..` that stays inside the root is fine
    assert resolve_image_path("EO_GYM_DATA/../image_cache/c.png", tmp_path) == tmp_path.resolve() / "image_cache/c.png"


@pytest.mark.parametrize(
    "path",
    [
        "/etc/passwd",
        "../outside.png",
        "EO_GYM_DATA/../../outside.png",
        "image_cache/../../../x.png",
        "~/x.png",
        "https://host/x.png",
    ],
)
def test_unsafe_paths_are_rejected(tmp_path, path):
    assert _reason(resolve_image_path, path, tmp_path / "root") == "unsafe_image_path"


def test_paths_that_cannot_be_resolved_are_rejected(tmp_path):
    (tmp_path / "loop_a").symlink_to(tmp_path / "loop_b")
    (tmp_path / "loop_b").symlink_to(tmp_path / "loop_a")
    assert _reason(resolve_image_path, "EO_GYM_DATA/a\x00.png", tmp_path) == "unsafe_image_path"  # NUL byte
    assert _reason(resolve_image_path, "loop_a", tmp_path) == "unsafe_image_path"


def test_a_symlink_that_leaves_the_root_is_rejected(tmp_path):
    root = tmp_path / "root"
    (root / "EO_GYM_DATA").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(tmp_path / "outside.png")
    (root / "EO_GYM_DATA" / "link.png").symlink_to(tmp_path / "outside.png")
    assert _reason(resolve_image_path, "EO_GYM_DATA/link.png", root) == "unsafe_image_path"


# ---- headers -------------------------------------------------------------------------------------


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` and whose pixel data is a few bytes."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")
    )


def test_sizes_come_from_the_header_without_decoding(tmp_path):
    path = tmp_path / "big.png"
    path.write_bytes(_png_header_only(4000, 3000))  # 12 MP claimed, 60 bytes on disk
    assert image_size(path) == (4000, 3000)
    assert _reason(load_rgb, path) == "corrupt_image"  # decoding would fail: the pixels are not there


def test_a_huge_header_is_refused_before_decoding(tmp_path):
    path = tmp_path / "bomb.png"
    path.write_bytes(_png_header_only(20000, 20000))
    assert _reason(image_size, path) == "image_too_large"
    assert _reason(load_rgb, path) == "image_too_large"


def test_the_own_pixel_limit_holds_when_pillows_is_switched_off(tmp_path, monkeypatch):
    path = tmp_path / "bomb.png"
    path.write_bytes(_png_header_only(20000, 20000))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)  # some libraries do this globally
    assert _reason(image_size, path) == "image_too_large"
    monkeypatch.setattr(images, "MAX_SOURCE_PIXELS", 64 * 64 - 1)
    Image.new("RGB", (64, 64)).save(tmp_path / "small.png")
    assert _reason(image_size, tmp_path / "small.png") == "image_too_large"
    monkeypatch.setattr(images, "MAX_SOURCE_PIXELS", 64 * 64)
    assert image_size(tmp_path / "small.png") == (64, 64)


def test_missing_and_corrupt_files(tmp_path):
    assert _reason(image_size, tmp_path / "nope.jpg") == "missing_image"
    (tmp_path / "garbage.png").write_bytes(b"this is not an image at all")
    assert _reason(image_size, tmp_path / "garbage.png") == "corrupt_image"
    (tmp_path / "empty.jpg").write_bytes(b"")
    assert _reason(image_size, tmp_path / "empty.jpg") == "corrupt_image"
    (tmp_path / "folder.png").mkdir()
    assert _reason(image_size, tmp_path / "folder.png") == "not_a_file"


def _in_thread(fn, *args):
    """``fn(*args)``'s ImageError reason, or "blocked" when it has not returned within 10 s."""
    box = []
    worker = threading.Thread(target=lambda: box.append(_reason(fn, *args)), daemon=True)
    worker.start()
    worker.join(10)
    return box[0] if box else "blocked"


@pytest.mark.parametrize("fn", [image_size, checked_image_size, load_rgb])
def test_a_fifo_named_like_an_image_is_refused_without_blocking(tmp_path, fn):
    os.mkfifo(tmp_path / "x.png")  # opening it for reading would wait for a writer for ever
    assert _in_thread(fn, tmp_path / "x.png") == "not_a_file"


def test_decoding_memory_is_bounded_not_only_pixels(tmp_path):
    path = tmp_path / "wide.png"
    path.write_bytes(_png_header_only(12000, 12000))  # 144 MP: under the pixel cap, but 1.15 GB to decode as RGB
    with pytest.raises(ImageError) as err:
        image_size(path)
    assert err.value.reason == "image_too_large"
    assert err.value.detail == f"12000x12000 RGB needs 1152000000 bytes to decode, over {images.MAX_DECODED_BYTES}"
    assert images.decoded_bytes("I;16", 13000, 13000) == 1_014_000_000  # a 13000x13000 16-bit scene fits
    assert images.decoded_bytes("L", 10, 10) == 500 and images.decoded_bytes("RGBA", 10, 10) == 800


def test_a_truncated_body_passes_the_header_but_not_decoding(tmp_path):
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8)).save(tmp_path / "t.jpg")
    data = (tmp_path / "t.jpg").read_bytes()
    (tmp_path / "t.jpg").write_bytes(data[: len(data) // 2])
    assert image_size(tmp_path / "t.jpg") == (96, 64)
    assert _reason(load_rgb, tmp_path / "t.jpg") == "corrupt_image"


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "TIFF"])
@pytest.mark.parametrize("keep", [0.5, -12])  # half the file; all but its last bytes (JPEG EOI, PNG IEND)
def test_data_prep_check_refuses_a_cut_body_that_passes_the_header(tmp_path, fmt, keep):
    path = tmp_path / f"t.{fmt.lower()}"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8)).save(path, fmt)
    assert checked_image_size(path) == (96, 64)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)] if keep > 0 else data[:keep])
    assert image_size(path) == (96, 64)  # the header alone looks fine
    assert _reason(checked_image_size, path) == "corrupt_image"  # a changed file is checked again


def test_data_prep_check_decodes_each_distinct_file_once(tmp_path, monkeypatch):
    path = tmp_path / "x.png"
    Image.new("RGB", (40, 30)).save(path)
    opened = []
    real_open = Image.open
    monkeypatch.setattr(Image, "open", lambda *a, **k: opened.append(a[0]) or real_open(*a, **k))
    assert [checked_image_size(path) for _ in range(3)] == [(40, 30)] * 3
    assert len(opened) == 2  # header + body, once
    Image.new("RGB", (41, 30)).save(path)  # rewritten: new size and mtime
    assert checked_image_size(path) == (41, 30)
    assert len(opened) == 4
    assert _reason(checked_image_size, tmp_path / "gone.png") == "missing_image"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the pixel data: its chunk's CRC no longer matches
    (tmp_path / "flipped.png").write_bytes(bytes(data))
    assert image_size(tmp_path / "flipped.png") == (41, 30)
    assert _reason(checked_image_size, tmp_path / "flipped.png") == "corrupt_image"


# ---- decoding ------------------------------------------------------------------------------------


def _load(tmp_path, img: Image.Image, name: str, **save_args) -> np.ndarray:
    img.save(tmp_path / name, **save_args)
    out = load_rgb(tmp_path / name)
    assert out.mode == "RGB" and out.size == img.size == image_size(tmp_path / name)
    arr = np.asarray(out)
    assert arr.dtype == np.uint8 and arr.shape == (img.size[1], img.size[0], 3)
    return arr


def test_16_bit_is_stretched_from_its_own_range(tmp_path):
    arr = np.full((6, 10), 2000, np.uint16)
    arr[0, 0], arr[0, 1] = 1000, 5000  # min and max
    for name in ("d.png", "d.tif"):
        out = _load(tmp_path, Image.fromarray(arr), name)
        assert out[0, 0].tolist() == [0, 0, 0]
        assert out[0, 1].tolist() == [255, 255, 255]
        assert out[3, 3].tolist() == [64, 64, 64]  # (2000 - 1000) * 255 / 4000 = 63.75


@pytest.mark.parametrize("fn", [checked_image_size, load_rgb])
def test_decoding_stops_at_its_deadline(tmp_path, monkeypatch, fn):
    path = tmp_path / "noise.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (300, 300, 3), dtype=np.uint8)).save(path)  # 270 KB: several reads
    monkeypatch.setattr(images, "MAX_DECODE_SECONDS", -1.0)  # already past
    with pytest.raises(ImageError) as err:
        fn(path)
    assert (err.value.reason, err.value.detail) == ("image_too_slow", "decoding took more than -1.0 s")
    monkeypatch.setattr(images, "MAX_DECODE_SECONDS", 60.0)
    assert fn(path).size == (300, 300) if fn is load_rgb else fn(path) == (300, 300)


def test_16_bit_is_stretched_band_by_band_as_in_one_piece(tmp_path, monkeypatch):
    arr = np.random.default_rng(0).integers(300, 60000, (37, 23), dtype=np.uint16)
    arr[36, 22] = 65535
    expected = np.round((arr.astype(np.float64) - arr.min()) * (255.0 / (65535 - arr.min()))).astype(np.uint8)
    monkeypatch.setattr(images, "STRETCH_BAND_PIXELS", 23 * 5)  # eight bands, the last of two rows
    for mode, data in (("I;16", arr), ("I", arr.astype(np.int32)), ("F", arr.astype(np.float32))):
        img = Image.fromarray(data)
        assert img.mode == mode
        out = _load(tmp_path, img, f"b_{mode[0]}.tif")
        assert np.array_equal(out[..., 0], expected), mode


RSS_PROBE = """
import resource, sys
from eogym_sft.data import images
images.image_size(sys.argv[1])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
images.load_rgb(sys.argv[1])
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_16_bit_decoding_peaks_near_its_own_size(tmp_path):
    arr = np.zeros((6000, 6000), np.uint16)  # 72 MB as 16-bit, 144 MB as Pillow RGB; a float64 copy is 288 MB
    arr[::7, ::5] = 40000
    Image.fromarray(arr).save(tmp_path / "sar.png", compress_level=1)
    probe = subprocess.run([sys.executable, "-c", RSS_PROBE, str(tmp_path / "sar.png")], capture_output=True, text=True, check=True)
    assert int(probe.stdout) < 320  # MiB above the peak before decoding: 16-bit + 8-bit + RGB + one band (was ~1100)


def test_a_flat_16_bit_image_is_black(tmp_path):
    assert _load(tmp_path, Image.fromarray(np.full((4, 4), 777, np.uint16)), "flat.png").max() == 0


def test_float_tiff_is_stretched(tmp_path):
    arr = np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(3, 4)
    out = _load(tmp_path, Image.fromarray(arr), "f.tif")
    assert out[0, 0, 0] == 0 and out[2, 3, 0] == 255 and out[1, 1, 0] == round(5 / 11 * 255)


def test_palette_with_transparency_goes_on_white(tmp_path):
    img = Image.new("P", (5, 4), 0)
    img.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)
    img.putpixel((1, 1), 1)
    out = _load(tmp_path, img, "p.png", transparency=1)
    assert out[0, 0].tolist() == [255, 0, 0]
    assert out[1, 1].tolist() == [255, 255, 255]  # the transparent index
    out = _load(tmp_path, img, "p_opaque.png")
    assert out[1, 1].tolist() == [0, 0, 255]


def test_grayscale_and_bilevel(tmp_path):
    assert _load(tmp_path, Image.new("L", (7, 3), 100), "g.png")[2, 6].tolist() == [100, 100, 100]
    bits = Image.new("1", (8, 2), 0)
    bits.putpixel((3, 1), 1)
    out = _load(tmp_path, bits, "b.png")
    assert out[1, 3].tolist() == [255, 255, 255] and out[0, 0].tolist() == [0, 0, 0]


def test_alpha_is_composited_on_white_as_qwen_vl_utils_does(tmp_path):
    from qwen_vl_utils.vision_process import to_rgb

    arr = np.zeros((4, 6, 4), np.uint8)
    arr[..., 0] = 200
    arr[..., 3] = np.array([0, 64, 128, 192, 255, 255])[None, :]
    img = Image.fromarray(arr, "RGBA")
    out = _load(tmp_path, img, "a.png")
    assert out[0, 0].tolist() == [255, 255, 255]
    assert out[0, 4].tolist() == [200, 0, 0]
    assert np.array_equal(out, np.asarray(to_rgb(img)))
    la = Image.new("LA", (3, 2), (50, 0))
    la.putpixel((2, 1), (50, 255))
    out = _load(tmp_path, la, "la.png")
    assert out[0, 0].tolist() == [255, 255, 255] and out[1, 2].tolist() == [50, 50, 50]


def test_multi_frame_tiff_uses_frame_zero(tmp_path):
    frames = [Image.new("RGB", (9, 5), (10, 20, 30)), Image.new("RGB", (9, 5), (200, 100, 0))]
    frames[0].save(tmp_path / "m.tif", save_all=True, append_images=frames[1:])
    with Image.open(tmp_path / "m.tif") as check:
        assert check.n_frames == 2
    assert np.asarray(load_rgb(tmp_path / "m.tif"))[4, 8].tolist() == [10, 20, 30]


def test_cmyk_jpeg(tmp_path):
    out = _load(tmp_path, Image.new("CMYK", (16, 8), (0, 0, 0, 0)), "c.jpg")
    assert out.min() >= 250  # no ink: white


def test_exif_orientation_is_ignored_so_sizes_match_headers(tmp_path):
    img = Image.new("RGB", (40, 20), (0, 128, 0))
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW" on display
    _load(tmp_path, img, "o.jpg", exif=exif)  # asserts the decoded size is the header's 40x20


def test_to_rgb8_keeps_rgb_untouched():
    img = Image.new("RGB", (3, 3), (1, 2, 3))
    assert to_rgb8(img) is img


def test_image_cache_loads_once_and_drops_the_least_recently_used():
    loads = []

    def load(path):
        loads.append(path)
        return f"image {path}"

    cache = ImageCache(budget=2, load=load, cost=lambda entry: 1)
    assert cache.get("a") == "image a" and cache.get("b") == "image b" and cache.get("a") == "image a"
    assert loads == ["a", "b"]  # "a" came from the cache
    cache.get("c")  # over budget: "b", the least recently used, goes
    cache.get("a")
    cache.get("b")
    assert loads == ["a", "b", "c", "b"]
    big = ImageCache(budget=1, load=load, cost=lambda entry: 5)
    assert big.get("x") == "image x" and big.get("x") == "image x" and loads[-1] == "x" and loads.count("x") == 1


def test_image_cache_default_decodes_rgb_within_a_pixel_budget(tmp_path):
    for name, size in (("a.png", (10, 10)), ("b.png", (10, 20))):
        Image.new("RGBA", size).save(tmp_path / name)
    cache = ImageCache(budget=250)
    a = cache.get(tmp_path / "a.png")
    assert a.mode == "RGB" and cache.get(tmp_path / "a.png") is a
    cache.get(tmp_path / "b.png")  # 100 + 200 pixels > 250: a goes
    assert cache.get(tmp_path / "a.png") is not a


def test_threads_asking_for_one_path_at_once_share_one_load_and_one_object(tmp_path):
    import threading
    import time

    loads = []

    def slow_load(path):
        loads.append(path)
        time.sleep(0.2)  # the other threads ask while this one decodes
        if path.name == "bad":
            raise ValueError("unreadable")
        return object()

    cache = ImageCache(budget=10, load=slow_load, cost=lambda entry: 1)
    got, errors = [], []

    def ask(name):
        try:
            got.append((name, cache.get(tmp_path / name)))
        except ValueError as err:
            errors.append(str(err))

    threads = [threading.Thread(target=ask, args=(name,)) for name in ["a"] * 4 + ["bad"] * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(p.name for p in loads) == ["a", "bad"]  # one load a path
    assert len({id(entry) for name, entry in got if name == "a"}) == 1 and len(got) == 4
    assert errors == ["unreadable", "unreadable"]  # every asker sees the failure
    assert cache.get(tmp_path / "a") is got[0][1]
