"""Replay: recorded calls of every dialect are found, matched with a numeric tolerance (closest wins),
answered with the recorded text and the images prep attaches; rows without a trajectory record nothing."""

from __future__ import annotations

import json

import pytest

from eogym_sft.data.tool_images import ToolImageRule
from eogym_sft.environment.backends.replay import (
    ReplayBackend,
    distance,
    recorded_calls,
)
from eogym_sft.environment.results import CannotAnswer

IMG = "EO_GYM_DATA/aa/scene.jpg"
CROP = "crop_optical_or_sar_image"
LISTING = json.dumps([{"image_url": "EO_GYM_DATA/bb/t1.jpg"}, {"image_url": "EO_GYM_DATA/cc/t2.jpg"}])
CROP_TEXT_1 = json.dumps({"cropped_path": "image_cache/crops/one.png", "width": 8, "height": 6})
CROP_TEXT_2 = json.dumps({"cropped_path": "/srv/cache/image_cache/crops/two.png", "width": 4, "height": 4})


def _hermes_row() -> dict:
    """Qwen/Hermes dialect: two calls in one turn, answered by one user turn of two <tool_response> blocks."""
    calls = [
        {"name": "get_optical_image_list", "arguments": {"image_url": IMG}},
        {"name": CROP, "arguments": {"image_url": IMG, "aoi": [0.1, 0.2, 0.5, 0.6]}},
    ]
    crop2 = {"name": CROP, "arguments": {"image_url": IMG, "aoi": [0.12, 0.2, 0.5, 0.6]}}
    return {
        "id": "r1",
        "images": [IMG],
        "messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "<image>How many?"},
            {"role": "assistant", "content": "".join(f"<tool_call>{json.dumps(c)}</tool_call>" for c in calls)},
            {"role": "user", "content": f"<tool_response>{LISTING}</tool_response><tool_response>{CROP_TEXT_1}</tool_response>"},
            {"role": "assistant", "content": f"Closer.<tool_call>{json.dumps(crop2)}</tool_call>"},
            {"role": "user", "content": f"<tool_response>{CROP_TEXT_2}</tool_response>"},
            {"role": "assistant", "content": "Final Answer: 2"},
        ],
    }


def test_recorded_calls_pair_results_with_calls_and_carry_prep_images():
    recs = recorded_calls(_hermes_row(), ToolImageRule())
    assert [(r.name, r.text, r.images) for r in recs] == [
        ("get_optical_image_list", LISTING, []),  # listed frames stay text
        (CROP, CROP_TEXT_1, ["image_cache/crops/one.png"]),
        (CROP, CROP_TEXT_2, ["image_cache/crops/two.png"]),  # the absolute prefix dropped, as prep does
    ]
    assert recs[1].arguments == {"image_url": IMG, "aoi": [0.1, 0.2, 0.5, 0.6]}
    attach_all = recorded_calls(_hermes_row(), ToolImageRule("attach"))
    assert attach_all[0].images == ["EO_GYM_DATA/bb/t1.jpg", "EO_GYM_DATA/cc/t2.jpg"]


def test_openai_results_pair_by_tool_call_id_even_out_of_order():
    call = lambda i, aoi: {"id": f"c{i}", "type": "function", "function": {"name": CROP, "arguments": json.dumps({"image_url": IMG, "aoi": aoi})}}  # noqa: E731
    row = {
        "id": "r2",
        "images": [IMG],
        "messages": [
            {"role": "user", "content": "<image>q"},
            {"role": "assistant", "content": None, "tool_calls": [call(1, [0, 0, 0.5, 0.5]), call(2, [0.5, 0.5, 1, 1])]},
            {"role": "tool", "tool_call_id": "c2", "content": CROP_TEXT_2},
            {"role": "tool", "tool_call_id": "c1", "content": CROP_TEXT_1},
            {"role": "assistant", "content": "Final Answer: 1"},
        ],
    }
    recs = recorded_calls(row, ToolImageRule())
    assert [(r.arguments["aoi"], r.text) for r in recs] == [([0.5, 0.5, 1, 1], CROP_TEXT_2), ([0, 0, 0.5, 0.5], CROP_TEXT_1)]


def test_matching_within_tolerance_picks_the_closest():
    backend = ReplayBackend(_hermes_row(), ToolImageRule(), tolerance=0.01)
    # 0.105 is 0.005 from the first crop (0.1) and 0.015 from the second (0.12): the first
    assert backend.answer(CROP, {"image_url": IMG, "aoi": [0.105, 0.2, 0.5, 0.6]}) == (CROP_TEXT_1, ["image_cache/crops/one.png"])
    assert backend.answer(CROP, {"image_url": IMG, "aoi": [0.115, 0.2, 0.5, 0.6]}) == (CROP_TEXT_2, ["image_cache/crops/two.png"])
    assert backend.answer("get_optical_image_list", {"image_url": IMG}) == (LISTING, [])
    for tool, args in [
        (CROP, {"image_url": IMG, "aoi": [0.14, 0.2, 0.5, 0.6]}),  # 0.02 from the nearest
        (CROP, {"image_url": "EO_GYM_DATA/zz/other.jpg", "aoi": [0.1, 0.2, 0.5, 0.6]}),  # another image
        (CROP, {"image_url": IMG, "aoi": [0.1, 0.2, 0.5, 0.6], "extra": 1}),  # another argument set
        ("get_water_mask", {"image_url": IMG}),  # never called in the trace
    ]:
        with pytest.raises(CannotAnswer):
            backend.answer(tool, args)
    assert ReplayBackend(_hermes_row(), ToolImageRule(), tolerance=0.05).answer(CROP, {"image_url": IMG, "aoi": [0.14, 0.2, 0.5, 0.6]})[0] == CROP_TEXT_2


def test_distance():
    assert distance({"a": [1, 2.5], "b": "x"}, {"a": [1, 2.0], "b": "x"}) == 0.5
    assert distance({"a": [1, 2]}, {"a": [1, 2, 3]}) == float("inf")
    assert distance({"a": "x"}, {"a": "y"}) == float("inf")
    assert distance({"a": True}, {"a": 1}) == float("inf")  # booleans are not numbers here


def test_question_only_and_unpreparable_rows_record_nothing():
    question_only = {"id": "t1", "images": [IMG], "messages": [{"role": "user", "content": "<image>How many?"}]}
    assert recorded_calls(question_only, ToolImageRule()) == []
    broken = dict(_hermes_row(), images=[])  # an <image> tag without a row image: prep drops the row
    assert recorded_calls(broken, ToolImageRule()) == []


def _raw_call_count(row: dict) -> int:
    """Tool calls written in a raw row, in any dialect, counted without the parser under test."""
    n = 0
    for msg in row["messages"]:
        n += len(msg.get("tool_calls") or []) + bool(msg.get("function_call"))
        content = msg.get("content")
        parts = [content] if isinstance(content, str) else [p.get("text", "") for p in content or [] if isinstance(p, dict)]
        n += sum(text.count("<tool_call>") for text in parts)
    return n


def test_every_call_of_the_sample_is_recorded_and_replays(sample_dir):
    lines = (sample_dir / "eogym_sample.jsonl").read_text().splitlines()
    total = 0
    for line in lines[:40]:  # the good rows; the last four are deliberately bad
        row = json.loads(line)
        recs = recorded_calls(row, ToolImageRule())
        assert len(recs) == _raw_call_count(row), row["id"]
        backend = ReplayBackend(row, ToolImageRule())
        for rec in recs:
            assert backend.answer(rec.name, rec.arguments) == (rec.text, rec.images)
        total += len(recs)
    assert total == 98
