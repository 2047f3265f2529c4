"""Argument comparison: the benchmarks' Python equality and this library's box rule."""

from __future__ import annotations

import pytest

from eogym_sft.metrics.tool_args import arguments_match_aoi, best_box_iou, box_iou, call_of, crop_iou, gold_calls, same_call


def test_python_equality_is_the_benchmarks_rule():
    gold = {"name": "f", "arguments": {"n": 5, "flag": True}}
    assert same_call({"name": "f", "arguments": {"n": 5.0, "flag": 1}}, gold)
    assert not same_call({"name": "f", "arguments": {"n": "5", "flag": True}}, gold)
    assert not same_call(None, gold)


def test_box_iou_values():
    assert box_iou([0, 0, 1, 1], [0, 0, 1, 1]) == 1.0
    assert box_iou([0, 0, 1, 1], [0.5, 0, 1.5, 1]) == pytest.approx(1 / 3)
    assert box_iou([0, 0, 0.5, 0.5], [0, 0, 0.5, 0.51]) == pytest.approx(0.25 / 0.255)
    assert box_iou([0, 0, 0, 0], [0, 0, 0, 0]) == 0.0


def test_the_box_rule_keeps_other_arguments_exact():
    gold = {"image_url": "a.jpg", "aoi": [0.2, 0.2, 0.6, 0.6]}
    assert arguments_match_aoi({"image_url": "a.jpg", "aoi": [0.2, 0.2, 0.6, 0.62]}, gold)
    assert not arguments_match_aoi({"image_url": "b.jpg", "aoi": [0.2, 0.2, 0.6, 0.6]}, gold)
    assert not arguments_match_aoi({"image_url": "a.jpg", "aoi": [0.6, 0.6, 1.0, 1.0]}, gold)
    assert not arguments_match_aoi({"image_url": "a.jpg", "aoi": [0.6, 0.6, 0.2, 0.2]}, gold)  # not a box
    assert not arguments_match_aoi({"image_url": "a.jpg"}, gold)
    assert arguments_match_aoi({"label": [1, 2, 3, 5]}, {"label": [1, 2, 3, 5]})  # not a box name: ==
    assert not arguments_match_aoi({"label": [1, 2, 3, 4.9]}, {"label": [1, 2, 3, 5]})


def test_best_box_iou_and_call_shapes():
    gold = {"name": "crop", "arguments": {"aoi": [0, 0, 0.5, 0.5]}}
    assert best_box_iou({"name": "crop", "arguments": {"aoi": [0, 0, 0.5, 0.25]}}, gold) == pytest.approx(0.5)
    assert best_box_iou({"name": "other", "arguments": {"aoi": [0, 0, 0.5, 0.5]}}, gold) == 0.0
    assert best_box_iou({"name": "crop", "arguments": {"aoi": "x"}}, gold) == 0.0
    assert best_box_iou(gold, {"name": "count", "arguments": {"label": "car"}}) is None
    assert call_of({"type": "function", "function": {"name": "f", "arguments": {}}}) == {"name": "f", "arguments": {}}


def test_gold_calls_of_a_row_and_of_a_question_only_row():
    question = [{"role": "system", "content": "s"}, {"role": "user", "content": "how many?"}]
    call = {"type": "function", "function": {"name": "crop", "arguments": '{"aoi": [0, 0, 1, 1]}'}}
    row = {"id": "r", "messages": question + [{"role": "assistant", "content": "", "tool_calls": [call]},
                                               {"role": "tool", "content": "ok"},
                                               {"role": "assistant", "content": "Final Answer: 3"}]}
    assert gold_calls(row) == [{"name": "crop", "arguments": {"aoi": [0, 0, 1, 1]}}]
    assert gold_calls({"id": "q", "messages": question}) is None
    direct = {"id": "d", "messages": question + [{"role": "assistant", "content": "Final Answer: 3"}]}
    assert gold_calls(direct) == []


def test_crop_iou_takes_each_gold_boxs_best_match():
    gold = [{"name": "crop", "arguments": {"aoi": [0, 0, 0.5, 0.5]}}, {"name": "crop", "arguments": {"aoi": [0.5, 0.5, 1, 1]}},
            {"name": "count", "arguments": {"label": "car"}}]
    pred = [{"name": "crop", "arguments": {"aoi": [0, 0, 0.5, 0.25]}}, {"name": "crop", "arguments": {"aoi": [0, 0, 0.5, 0.5]}}]
    assert crop_iou(gold, pred) == 0.5  # the first gold box found exactly, the second by no crop
    assert crop_iou(gold, []) == 0.0
    assert crop_iou(gold[2:], pred) is None
