"""Gold-history metrics against eo-metrics.md's worked examples A (GTA/ThinkGeo) and B (OpenEarthAgent)."""

from __future__ import annotations

import json

import pytest

from eogym_sft.metrics.gold_history import (
    GOLD_HISTORY_METRICS,
    combine_step_counts,
    gta_iscorrect,
    micro,
    paired_units,
    step_counts,
    whitelist_reference,
)
from eogym_sft.metrics.scoring import ParsedOutput, Reference, paired_stats

TOOLS = ["OCR", "Calculator", "TextToBbox", "ObjectDetection"]
WHITELIST = json.dumps({"whitelist": [["5", "five"]], "blacklist": None})


def call(name, **arguments):
    return {"name": name, "arguments": arguments}


def message(*calls, content=""):
    return ParsedOutput(content, list(calls))


def example_a(answer="There are 5 cars.", second=None):
    """Gold: OCR, Calculator{2+3}, then an answer; the model: the same OCR, Calculator{2 + 3}, then ``answer``."""
    refs = [
        Reference([call("OCR", image="/d/a.png")], "", TOOLS),
        Reference([call("Calculator", expression="2+3")], "", TOOLS),
        Reference([], "5", TOOLS, gt_answer=WHITELIST, is_last=True),
    ]
    preds = [
        message(call("OCR", image="/d/a.png")),
        second or message(call("Calculator", expression="2 + 3")),
        message(content=answer),
    ]
    return micro([step_counts(p, r) for p, r in zip(preds, refs)])


def means(summary):
    return {m: round(100 * v["mean"], 2) for m, v in summary.items()}


def test_example_a_gta_teacher_forced():
    got = example_a()
    assert means(got)["inst_acc"] == 100.0 and got["inst_acc"]["n"] == 3  # 2 call steps + 1 sample with a reference
    assert means(got)["tool_acc"] == 100.0 and got["tool_acc"]["n"] == 2
    assert means(got)["arg_acc"] == 50.0  # "2 + 3" is not "2+3": no normalisation
    assert means(got)["summ_acc"] == 100.0 and got["summ_acc"]["n"] == 1


def test_example_a_whole_words_and_answering_too_early():
    assert means(example_a("There are 15 cars."))["summ_acc"] == 0.0  # "15" holds no whole word "5"
    early = means(example_a(second=message(content="It is 5.")))
    assert (early["inst_acc"], early["tool_acc"], early["arg_acc"]) == (66.67, 50.0, 50.0)


def test_example_b_openearthagent_step():
    ref = Reference([call("TextToBbox", image="img_1", text="plane", top1=True)], "", TOOLS)
    preds = [
        message(call("TextToBbox", image="img_1", text="planes", top1=True)),
        message(call("TextToBbox", image="img_1", text="plane")),
        message(None),  # no parseable action
        message(call("ObjectDetection", image="img_1")),
    ]
    rows = [step_counts(p, ref) for p in preds]
    assert [r["inst_acc_oea"][0] for r in rows] == [1, 1, 0, 1]
    assert [r["tool_acc"][0] for r in rows] == [1, 1, 0, 0]
    assert [r["arg_keys_acc"][0] for r in rows] == [1, 0, 0, 0]
    assert [r["arg_acc"][0] for r in rows] == [0, 0, 0, 0]
    got = means(micro(rows))
    assert (got["inst_acc_oea"], got["tool_acc"], got["arg_keys_acc"], got["arg_acc"]) == (75.0, 50.0, 25.0, 0.0)


def test_example_c6_a_box_within_iou_is_our_extension_only():
    ref = Reference([call("crop", aoi=[0, 0, 0.5, 0.5])], "", ["crop"])
    near = step_counts(message(call("crop", aoi=[0, 0, 0.5, 0.51])), ref)
    assert near["arg_acc"][0] == 0 and near["arg_acc_aoi@0.5"][0] == 1
    exact = step_counts(message(call("crop", aoi=[0, 0, 0.5, 0.5])), ref)
    assert exact["arg_acc"][0] == 1  # 0.5 == 0.5 and 0 == 0.0: Python equality
    far = step_counts(message(call("crop", aoi=[0.5, 0.5, 1, 1])), ref)
    assert far["arg_acc_aoi@0.5"][0] == 0


def test_several_calls_in_a_turn_are_steps_in_order_and_an_unknown_tool_is_an_error():
    ref = Reference([call("OCR", image="a"), call("Calculator", expression="1")], "", TOOLS)
    swapped = step_counts(message(call("Calculator", expression="1"), call("OCR", image="a")), ref)
    assert swapped["tool_acc"] == [0, 2] and swapped["inst_acc"] == [2, 2]
    unknown = step_counts(message(call("Search", q="x")), ref)
    assert unknown["inst_acc"] == [0, 2] and unknown["inst_acc_oea"] == [1, 2]


def test_a_sample_without_reference_counts_its_answer_above_the_line_only():
    """GTA's quirk: the answer step of an image-generation sample (no gt_answer) is in InstAcc's numerator."""
    counts = step_counts(message(content="done"), Reference([], "done", TOOLS, is_last=True))
    assert counts["inst_acc"] == [1.0, 0] and counts["summ_acc"] == [0.0, 0]


def test_gta_iscorrect_blacklist_and_reference_parsing():
    ref = {"whitelist": [["left"], ["3", "three"]], "blacklist": [["right"]]}
    assert gta_iscorrect("Three boats on the LEFT", ref)
    assert not gta_iscorrect("3 on the left, not the right", ref)
    assert whitelist_reference(WHITELIST) == json.loads(WHITELIST)
    assert whitelist_reference("5 cars") is None and whitelist_reference("{not json") is None


def test_a_plain_reference_is_scored_by_the_normalised_final_answer():
    ref = Reference([], "Final Answer: 5", TOOLS, gt_answer="5.0", is_last=True)
    assert step_counts(ParsedOutput("Final Answer: 5", [], [], "5"), ref)["summ_acc"] == [1.0, 1]
    assert step_counts(ParsedOutput("five", [], [], None), ref)["summ_acc"] == [0.0, 1]


def test_samples_average_hits_and_keep_steps():
    ref = Reference([call("OCR", image="a")], "", TOOLS)
    rows = [step_counts(message(call("OCR", image="a")), ref), step_counts(message(content="no"), ref)]
    assert combine_step_counts(rows)["arg_acc"] == [0.5, 1]
    assert set(combine_step_counts(rows)) == set(GOLD_HISTORY_METRICS)


def test_paired_units_give_the_micro_delta():
    """Turn 1 has 2 call steps, turn 2 one: A hits 1 + 0, B 2 + 1; micro 1/3 against 3/3."""
    a = {"t1": {"tool_acc": [1.0, 2]}, "t2": {"tool_acc": [0.0, 1]}}
    b = {"t1": {"tool_acc": [2.0, 2]}, "t2": {"tool_acc": [1.0, 1]}}
    keys, xs, ys = paired_units(a, b, "tool_acc")
    stats = paired_stats(xs, ys)
    assert keys == ["t1", "t2"]
    assert stats["mean_a"] == pytest.approx(1 / 3) and stats["mean_b"] == pytest.approx(1.0)
    assert stats["delta"] == pytest.approx(2 / 3)
    assert paired_units({"t": {"summ_acc": [0.0, 0]}}, {"t": {"summ_acc": [0.0, 0]}}, "summ_acc") is None
