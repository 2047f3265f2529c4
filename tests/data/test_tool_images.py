"""The per-tool image rule: what each mode attaches from a tool result's text, and spec parsing."""

from __future__ import annotations

import json

import pytest

from eogym_sft.data.tool_images import ToolImageRule

CROP_TEXT = json.dumps(
    {"cropped_path": "/srv/x/image_cache/crops/a.png", "source": "EO_GYM_DATA/ab/scene.jpg", "mask": "image_cache/m/w.nc"}
)
LISTING = json.dumps([{"image_url": "EO_GYM_DATA/bb/t1.jpg"}, {"image_url": "EO_GYM_DATA/cc/t2.JPG"}, {"image_url": "EO_GYM_DATA/bb/t1.jpg"}])
PREVIEW = "NDVI written to image_cache/index/n.png and image_cache/index/n.png (same file)"
OWN_CROP_OUT = json.dumps({"cropped_path": "EO_GYM_DATA/ab/crop_of_scene.png"})


@pytest.mark.parametrize(
    "mode, text, images",
    [
        ("produced", CROP_TEXT, ["image_cache/crops/a.png"]),  # the crop; its source stays text
        ("produced", LISTING, []),
        ("produced", PREVIEW, ["image_cache/index/n.png"]),
        ("produced", OWN_CROP_OUT, ["EO_GYM_DATA/ab/crop_of_scene.png"]),  # a cropped_path field, whatever its prefix
        ("attach", CROP_TEXT, ["image_cache/crops/a.png", "EO_GYM_DATA/ab/scene.jpg"]),
        ("attach", LISTING, ["EO_GYM_DATA/bb/t1.jpg", "EO_GYM_DATA/cc/t2.JPG"]),  # distinct, in order
        ("text", CROP_TEXT, []),
        ("text", PREVIEW, []),
    ],
)
def test_modes(mode, text, images):
    assert ToolImageRule(mode).images("any_tool", text) == images


def test_per_tool_overrides():
    rule = ToolImageRule.parse("produced, get_optical_image_list=attach ,crop_optical_or_sar_image=text")
    assert rule == ToolImageRule("produced", {"get_optical_image_list": "attach", "crop_optical_or_sar_image": "text"})
    assert rule.images("get_optical_image_list", LISTING) == ["EO_GYM_DATA/bb/t1.jpg", "EO_GYM_DATA/cc/t2.JPG"]
    assert rule.images("crop_optical_or_sar_image", CROP_TEXT) == []
    assert rule.images("compute_index", PREVIEW) == ["image_cache/index/n.png"]
    assert rule.images(None, PREVIEW) == ["image_cache/index/n.png"]  # a result whose tool is unknown: the default
    assert ToolImageRule.parse("get_sar_image=attach") == ToolImageRule("produced", {"get_sar_image": "attach"})
    assert ToolImageRule.parse(rule) is rule


@pytest.mark.parametrize("spec", ["inline", "produced,=attach", "produced,get_sar_image=all"])
def test_bad_specs(spec):
    with pytest.raises(ValueError):
        ToolImageRule.parse(spec)
