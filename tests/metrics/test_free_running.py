"""Free-running metrics against eo-metrics.md's worked examples C1-C6, D, E and G."""

from __future__ import annotations

import math

import pytest

from eogym_sft.metrics.free_running import (
    category_counts,
    category_f1,
    earth_agent_answer,
    episode_scores,
    f1_pseudo_values,
    pooled,
)

EA = ("tool_any_order", "tool_in_order", "tool_exact_match", "param_prefix", "efficiency")
OEA = ("all_tools_called_any_order", "all_tools_called_same_order", "all_tools_called_unique")


def calls(*names):
    return [{"name": n, "arguments": {"k": n}} for n in names]


def scores(gold, pred):
    got = episode_scores(calls(*gold), calls(*pred))
    return [round(got[m], 4) for m in EA], tuple(got[m] for m in OEA)


@pytest.mark.parametrize(
    "gold, pred, earth_agent, oea",
    [
        (["crop", "detect", "count"], ["crop", "crop", "detect", "count"], [1, 1, 0.3333, 0.3333, 1.3333], (True, True, True)),
        (["detect", "crop", "count"], ["crop", "detect", "count"], [1, 0.3333, 0, 0, 1], (True, False, True)),
        (["crop", "crop", "count"], ["crop", "count"], [1, 0.3333, 0.3333, 0.3333, 0.6667], (False, False, True)),
        (["crop", "count"], [], [0, 0, 0, 0, 0], (False, False, False)),
    ],
    ids=["C1-extra-call", "C2-swapped", "C3-repeated-gold", "C4-no-tools"],
)
def test_examples_c1_to_c4(gold, pred, earth_agent, oea):
    assert scores(gold, pred) == (earth_agent, oea)


def test_macro_over_c1_to_c4():
    cases = [
        (["crop", "detect", "count"], ["crop", "crop", "detect", "count"]),
        (["detect", "crop", "count"], ["crop", "detect", "count"]),
        (["crop", "crop", "count"], ["crop", "count"]),
        (["crop", "count"], []),
    ]
    rows = [episode_scores(calls(*g), calls(*p)) for g, p in cases]
    macro = [round(sum(r[m] for r in rows) / len(rows), 4) for m in EA]
    assert macro == [0.75, 0.4167, 0.1667, 0.1667, 0.75]


def test_example_c5_empty_gold():
    got = episode_scores([], calls("crop"))
    assert [got[m] for m in EA[:4]] == [1, 1, 0, 1] and math.isinf(got["efficiency"])
    assert tuple(got[m] for m in OEA) == (True, True, True)
    assert episode_scores([], [])["efficiency"] == 1.0


def test_example_c6_parameter_strictness():
    gold = [{"name": "crop", "arguments": {"aoi": [0, 0, 0.5, 0.5]}}, {"name": "count", "arguments": {"label": "car"}}]
    pred = [{"name": "crop", "arguments": {"aoi": [0, 0, 0.5, 0.5]}}, {"name": "count", "arguments": {"label": "cars"}}]
    assert episode_scores(gold, pred)["param_prefix"] == 0.5
    pred[0]["arguments"]["aoi"] = [0, 0, 0.5, 0.51]
    got = episode_scores(gold, pred)
    assert got["param_prefix"] == 0 and got["param_prefix_aoi@0.5"] == 0.5


def test_example_d_category_f1():
    counts = category_counts(["OCR", "OCR", "Calculator"], ["OCR", "Calculator", "Calculator"])
    assert counts == {"perception": [2, 1, 1, 2], "logic": [1, 2, 1, 1]}
    assert round(100 * category_f1(counts["perception"], gta=True), 2) == 133.33  # GTA's P = 2/1
    assert round(100 * category_f1(counts["logic"], gta=True), 2) == 66.67
    assert round(100 * category_f1(counts["perception"]), 2) == 66.67
    assert round(100 * category_f1(counts["logic"]), 2) == 66.67
    assert category_f1([0, 3, 0, 0], gta=True) is None and category_f1([0, 3, 0, 0]) == 0.0
    assert category_counts(["zoom"], ["zoom"]) == {"other": [1, 1, 1, 1]}


def test_example_e_efficiency_is_a_mean_of_ratios():
    ratios = [episode_scores(calls("a", "b"), calls("a", "b", "c", "d"))["efficiency"],
              episode_scores(calls("a", "b", "c", "d"), calls("a", "b"))["efficiency"]]
    assert sum(ratios) / 2 == 1.25


def test_example_g_earth_agent_answer_extraction():
    assert earth_agent_answer("<Answer>b<Answer>") == "B"
    assert earth_agent_answer("<Answer>C</Answer> because") == "C"
    assert earth_agent_answer("The answer is C. A larger area") == "A"
    assert earth_agent_answer("FAILED to compute") == "FAIL"
    assert earth_agent_answer("no idea") == "UNKNOWN"
    assert all(earth_agent_answer(t) != "0.408" for t in ("0.408", "<Answer>0.408<Answer>", "The value is 0.408"))


def test_jackknife_pseudo_values_of_a_pooled_f1():
    units = [{"perception": [1, 1, 1, 1]}, {"perception": [1, 0, 0, 0]}, {"perception": [0, 1, 0, 0]}]
    whole = category_f1(pooled(units)["perception"])
    assert round(whole, 4) == 0.5
    pseudo = f1_pseudo_values(units, "perception")
    leave_out = [category_f1([1, 1, 0, 0]), category_f1([1, 2, 1, 1]), category_f1([2, 1, 1, 1])]
    assert pseudo == pytest.approx([3 * whole - 2 * f for f in leave_out])
    assert f1_pseudo_values(units[:1], "perception") is None
