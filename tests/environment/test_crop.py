"""The crop tool's geometry against hand-computed boxes (non-square images, halves, tiny AOIs), the
pixels it writes, its cache, and the arguments it refuses."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from eogym_sft.environment.backends.crop import CropBackend, crop_box, parse_aoi
from eogym_sft.environment.results import CannotAnswer, ToolCallError


@pytest.mark.parametrize(
    "aoi, size, box",
    [
        # EO-Gym's known point: 16x12, the middle half
        ([0.25, 0.25, 0.75, 0.75], (16, 12), [4, 3, 12, 9]),
        # 10x7: 0.15*10 = 1.5 -> 2 (halves up), 0.5*7 = 3.5 -> 4, 0.55*10 = 5.5 -> 6, 0.93*7 = 6.51 -> 7
        ([0.15, 0.5, 0.55, 0.93], (10, 7), [2, 4, 6, 7]),
        # 10x3: 0.25*10 = 2.5 -> 3 (Python's round() would give 2), 0.34*3 = 1.02 -> 1, 0.85*10 = 8.5 -> 9
        ([0.25, 0.0, 0.85, 0.34], (10, 3), [3, 0, 9, 1]),
        # 7x20 (portrait): the whole image
        ([0.0, 0.0, 1.0, 1.0], (7, 20), [0, 0, 7, 20]),
        # 320x256 (a sample frame): 6.4 -> 6, 104.96 -> 105, 166.4 -> 166, 232.96 -> 233
        ([0.02, 0.41, 0.52, 0.91], (320, 256), [6, 105, 166, 233]),
        # an AOI thinner than a pixel grows to one pixel: 0.40*5 = 2.0 and 0.44*5 = 2.2 both -> 2
        ([0.40, 0.2, 0.44, 0.8], (5, 5), [2, 1, 3, 4]),
        # ... and at the right edge it grows leftwards: 0.95*4 = 3.8 and 1.0*4 both -> 4
        ([0.95, 0.0, 1.0, 1.0], (4, 2), [3, 0, 4, 2]),
    ],
)
def test_crop_box_hand_computed(aoi, size, box):
    assert crop_box(aoi, *size) == box


@pytest.mark.parametrize(
    "aoi",
    [[0.5, 0.1, 0.4, 0.9], [0.1, 0.1, 0.1, 0.9], [-0.1, 0, 0.5, 0.5], [0, 0, 1.2, 1], [0, 0, 1], "[0,0,1,1]",
     [0, 0, float("nan"), 1], [True, 0, 1, 1], [0, 0, 500, 500]],
)
def test_bad_aois_are_refused(aoi):
    with pytest.raises(ToolCallError) as err:
        parse_aoi(aoi)
    assert err.value.code == "bad_arguments"


def _gradient(root, rel, width, height):
    arr = np.zeros((height, width, 3), dtype=np.uint8)
    arr[..., 0] = np.arange(width)[None, :] * 10
    arr[..., 1] = np.arange(height)[:, None] * 12
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path)
    return arr


def test_the_crop_holds_exactly_the_box_pixels_and_is_cached(tmp_path):
    arr = _gradient(tmp_path, "EO_GYM_DATA/ab/scene.png", 16, 12)
    backend = CropBackend(tmp_path, tmp_path / "image_cache" / "crops")
    text, images = backend.answer("crop_optical_or_sar_image", {"image_url": "EO_GYM_DATA/ab/scene.png", "aoi": [0.25, 0.25, 0.75, 0.75]})
    result = json.loads(text)
    assert images is None  # the environment applies the tool-image rule to the text
    assert list(result) == ["cropped_path", "width", "height", "bbox_px", "aoi_norm"]
    assert (result["width"], result["height"], result["bbox_px"], result["aoi_norm"]) == (8, 6, [4, 3, 12, 9], [0.25, 0.25, 0.75, 0.75])
    assert result["cropped_path"].startswith("image_cache/crops/") and result["cropped_path"].endswith(".png")
    crop = np.asarray(Image.open(tmp_path / result["cropped_path"]))
    assert np.array_equal(crop, arr[3:9, 4:12])
    # the same call names the same file; another box another file
    again, _ = backend.answer("crop_optical_or_sar_image", {"image_url": "EO_GYM_DATA/ab/scene.png", "aoi": [0.25, 0.25, 0.75, 0.75]})
    assert json.loads(again)["cropped_path"] == result["cropped_path"]
    other, _ = backend.answer("crop_optical_or_sar_image", {"image_url": "EO_GYM_DATA/ab/scene.png", "aoi": [0, 0, 0.5, 0.5]})
    assert json.loads(other)["cropped_path"] != result["cropped_path"]
    assert sorted(p.name for p in (tmp_path / "image_cache" / "crops").iterdir()) == sorted(
        [result["cropped_path"].rsplit("/", 1)[1], json.loads(other)["cropped_path"].rsplit("/", 1)[1]]
    )  # no temporary files left behind


def test_paths_outside_the_data_root_are_refused_and_missing_images_left_to_other_backends(tmp_path):
    backend = CropBackend(tmp_path, tmp_path / "image_cache" / "crops")
    for path in ("../secret.png", "/etc/passwd", "EO_GYM_DATA/../../x.png"):
        with pytest.raises(ToolCallError) as err:
            backend.answer("crop_optical_or_sar_image", {"image_url": path, "aoi": [0, 0, 1, 1]})
        assert err.value.code == "bad_arguments"
    with pytest.raises(CannotAnswer, match="no image EO_GYM_DATA/none.png"):
        backend.answer("crop_optical_or_sar_image", {"image_url": "EO_GYM_DATA/none.png", "aoi": [0, 0, 1, 1]})
    with pytest.raises(CannotAnswer):
        backend.answer("get_optical_image_list", {"image_url": "EO_GYM_DATA/none.png"})


def test_a_source_that_changes_is_cropped_again(tmp_path):
    import os

    _gradient(tmp_path, "EO_GYM_DATA/ab/scene.png", 16, 12)
    backend = CropBackend(tmp_path, tmp_path / "image_cache" / "crops")
    call = {"image_url": "EO_GYM_DATA/ab/scene.png", "aoi": [0.25, 0.25, 0.75, 0.75]}
    first = json.loads(backend.answer("crop_optical_or_sar_image", call)[0])["cropped_path"]
    inverted = 255 - np.asarray(Image.open(tmp_path / "EO_GYM_DATA/ab/scene.png"))
    Image.fromarray(inverted).save(tmp_path / "EO_GYM_DATA/ab/scene.png")
    os.utime(tmp_path / "EO_GYM_DATA/ab/scene.png", ns=(1, 10**18))  # a new mtime even on coarse clocks
    second = json.loads(backend.answer("crop_optical_or_sar_image", call)[0])["cropped_path"]
    assert second != first
    assert np.array_equal(np.asarray(Image.open(tmp_path / second)), inverted[3:9, 4:12])


def test_the_crop_is_named_by_content_and_box_not_path_or_mtime(tmp_path):
    """The name is part of the tool result a model trains on: a copy of the scene elsewhere, written at
    another time, gives the same name; the name is sha256([sha256(bytes), box])[:32]."""
    import hashlib
    import os
    import shutil

    _gradient(tmp_path / "a", "EO_GYM_DATA/ab/scene.png", 16, 12)
    (tmp_path / "b" / "EO_GYM_DATA" / "cd").mkdir(parents=True)
    shutil.copyfile(tmp_path / "a" / "EO_GYM_DATA/ab/scene.png", tmp_path / "b" / "EO_GYM_DATA/cd/other.png")
    os.utime(tmp_path / "b" / "EO_GYM_DATA/cd/other.png", ns=(1, 10**18))
    names = []
    for root, rel in ((tmp_path / "a", "EO_GYM_DATA/ab/scene.png"), (tmp_path / "b", "EO_GYM_DATA/cd/other.png")):
        backend = CropBackend(root, root / "image_cache" / "crops")
        names.append(json.loads(backend.answer("crop_optical_or_sar_image", {"image_url": rel, "aoi": [0.25, 0.25, 0.75, 0.75]})[0])["cropped_path"])
    content = hashlib.sha256((tmp_path / "a" / "EO_GYM_DATA/ab/scene.png").read_bytes()).hexdigest()
    expected = hashlib.sha256(json.dumps([content, [4, 3, 12, 9]]).encode()).hexdigest()[:32]
    assert names == [f"image_cache/crops/{expected}.png"] * 2


################
# Property tests of the AOI validator (issue 28)
################

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

NUMBER = st.integers() | st.integers(min_value=10**300, max_value=10**400) | st.floats(allow_nan=True, allow_infinity=True) | st.booleans()
ANY_AOI = st.lists(NUMBER | st.text(max_size=5) | st.none(), max_size=6) | NUMBER | st.text(max_size=5) | st.none()


@settings(max_examples=300, deadline=None)
@given(aoi=ANY_AOI, width=st.integers(1, 5000), height=st.integers(1, 5000))
def test_any_aoi_is_a_box_inside_the_image_or_bad_arguments(aoi, width, height):
    from eogym_sft.environment.backends.crop import crop_box, parse_aoi
    from eogym_sft.environment.results import ToolCallError

    try:
        valid = parse_aoi(aoi)
    except ToolCallError as err:
        assert err.code == "bad_arguments" and len(err.message) < 300
        return
    x0, y0, x1, y1 = crop_box(valid, width, height)
    assert 0 <= x0 < x1 <= width and 0 <= y0 < y1 <= height


@settings(max_examples=200, deadline=None)
@given(edges=st.lists(st.floats(0, 1), min_size=4, max_size=4), width=st.integers(1, 5000), height=st.integers(1, 5000))
def test_every_normalised_aoi_is_accepted(edges, width, height):
    from eogym_sft.environment.backends.crop import crop_box, parse_aoi

    x0, x1 = sorted(edges[:2])
    y0, y1 = sorted(edges[2:])
    if x0 == x1 or y0 == y1:
        return
    box = crop_box(parse_aoi([x0, y0, x1, y1]), width, height)
    assert 0 <= box[0] < box[2] <= width and 0 <= box[1] < box[3] <= height
