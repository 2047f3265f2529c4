"""The EO benchmarks' tool metrics in the reports (``eogym_sft/evaluation/tool_report.py``): which calls an
episode ran, the gold list of a row, per-question and per-arm figures and the paired deltas, worked by hand."""

from __future__ import annotations

import json
import math

import pytest

from eogym_sft.config import TOOL_IMAGES
from eogym_sft.evaluation.report import format_rollout_report, format_turn_report, summarize_rollouts, summarize_turns
from eogym_sft.evaluation.tool_report import (
    executed_calls,
    gold_calls,
    paired_f1,
    question_tool_scores,
    tool_figures,
)
from eogym_sft.metrics.free_running import category_f1, f1_pseudo_values
from eogym_sft.models.loading import Arm


def turn(*calls, results=None):
    """An assistant turn calling ``calls`` (name, arguments) and the tool turns after it."""
    msg = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": n, "arguments": a if isinstance(a, str) else json.dumps(a)}} for n, a in calls
    ]}
    return [msg] + [{"role": "tool", "content": r} for r in (results if results is not None else ["ok"] * len(calls))]


def test_executed_calls_leave_out_the_calls_past_the_cap():
    notice = "Error: 2 tool calls in one turn; only the first 1 were run, the other 1 were not."
    messages = [
        {"role": "user", "content": "q"},
        *turn(("crop", {"aoi": [0, 0, 1, 1]}), ("count", "{bad json")),
        *turn(("crop", {"aoi": [0, 0, 0.5, 0.5]}), ("count", {}), results=["ok", notice]),  # as many results as calls
        *turn(("a", {}), ("b", {}), ("c", {}), results=["ok", "ok", "Error: 3 tool calls in one turn; only the first 2 were run"]),
        {"role": "assistant", "content": "Final Answer: 2"},
    ]
    assert executed_calls(messages) == [
        {"name": "crop", "arguments": {"aoi": [0, 0, 1, 1]}},
        {"name": "count", "arguments": "{bad json"},  # kept as written: it equals no gold object
        {"name": "crop", "arguments": {"aoi": [0, 0, 0.5, 0.5]}},
        {"name": "a", "arguments": {}},
        {"name": "b", "arguments": {}},
    ]


def test_gold_calls_of_a_row_and_of_a_question_only_row():
    question = [{"role": "system", "content": "s"}, {"role": "user", "content": "how many?"}]
    call = {"type": "function", "function": {"name": "crop", "arguments": '{"aoi": [0, 0, 1, 1]}'}}
    row = {"id": "r", "messages": question + [{"role": "assistant", "content": "", "tool_calls": [call]},
                                               {"role": "tool", "content": "ok"},
                                               {"role": "assistant", "content": "Final Answer: 3"}]}
    assert gold_calls(row, TOOL_IMAGES) == [{"name": "crop", "arguments": {"aoi": [0, 0, 1, 1]}}]
    assert gold_calls({"id": "q", "messages": question}, TOOL_IMAGES) is None
    direct = {"id": "d", "messages": question + [{"role": "assistant", "content": "Final Answer: 3"}]}
    assert gold_calls(direct, TOOL_IMAGES) == []


GOLD = [{"name": "crop_optical_or_sar_image", "arguments": {"aoi": [0, 0, 0.5, 0.5]}},
        {"name": "get_object_bbox_by_optical_image", "arguments": {"object_name": "car"}}]


def episode(arm, q, *calls, correct=True):
    messages = [{"role": "user", "content": "q"}]
    for name, args in calls:
        messages += turn((name, args))
    return {"arm": arm, "source_id": q, "messages": messages, "correct": correct, "tool_calls": len(calls), "tool_errors": 0,
            "tool_error_codes": {}, "turns": len(calls) + 1, "new_tokens": 1, "final_answer": "x", "stop_reason": "final_answer",
            "judge_error": None, "EO_task": "Counting", "question_type": "qt"}


CROP, NEAR, DETECT = (GOLD[0]["name"], GOLD[0]["arguments"]), (GOLD[0]["name"], {"aoi": [0, 0, 0.5, 0.45]}), (GOLD[1]["name"], GOLD[1]["arguments"])


def test_question_and_arm_figures_by_hand():
    """q1 (gold crop, detect): the exact trajectory and one with a near box and no detection; q2 (no gold calls): a crop."""
    q1 = question_tool_scores([episode("b", "q1", CROP, DETECT), episode("b", "q1", NEAR)], GOLD)
    assert (q1["param_prefix"], q1["param_prefix_aoi@0.5"], q1["tool_exact_match"]) == (0.5, 0.75, 0.75)
    assert (q1["efficiency"], q1["efficiency_infinite"], q1["all_tools_called_unique"]) == (0.75, 0, 0.5)
    assert q1["categories"] == {"operation": [2, 2, 2, 2], "perception": [2, 1, 1, 1]}
    q2 = question_tool_scores([episode("b", "q2", CROP)], [])
    assert (q2["efficiency"], q2["efficiency_infinite"], q2["tool_exact_match"], q2["param_prefix"]) == (None, 1, 0.0, 1.0)
    assert question_tool_scores([episode("b", "q3", CROP)], None) == {}
    figures = tool_figures([q1, q2, {}])
    assert figures["questions_with_gold"] == 2 and figures["efficiency_infinite"] == 1
    assert figures["efficiency"] == 0.75  # q2's infinite ratio is counted, not averaged
    assert figures["param_prefix"] == pytest.approx((0.5 + 1.0) / 2)
    assert round(figures["cat_f1"]["operation"], 4) == 0.8  # q2's crop is a predicted call with no gold: P 2/3, R 1
    assert round(figures["cat_f1"]["perception"], 4) == round(figures["cat_f1_gta"]["perception"], 4) == 0.6667


def test_paired_f1_centres_the_jackknife_interval_on_the_f1_delta():
    qa = {"q1": {"categories": {"perception": [1, 1, 1, 1]}}, "q2": {"categories": {"perception": [1, 0, 0, 0]}},
          "q3": {"categories": {"perception": [1, 1, 0, 0]}}}
    qb = {"q1": {"categories": {"perception": [1, 1, 1, 1]}}, "q2": {"categories": {"perception": [1, 1, 1, 1]}},
          "q3": {"categories": {"perception": [1, 1, 0, 0]}}, "q4": {"categories": {"perception": [1, 1, 1, 1]}}}
    oea, gta = paired_f1("base", "lora", qa, qb)
    assert (oea["metric"], gta["metric"], oea["n"], oea["ci_method"]) == ("cat_f1/perception", "cat_f1_gta/perception", 3, "jackknife t")
    assert oea["mean_a"] == pytest.approx(category_f1([3, 2, 1, 1])) and oea["mean_b"] == pytest.approx(category_f1([3, 3, 2, 2]))
    assert oea["delta"] == pytest.approx(oea["mean_b"] - oea["mean_a"])
    xs = f1_pseudo_values([qa[k]["categories"] for k in ("q1", "q2", "q3")], "perception")
    ys = f1_pseudo_values([qb[k]["categories"] for k in ("q1", "q2", "q3")], "perception")
    diffs = [y - x for x, y in zip(xs, ys)]
    mean = sum(diffs) / 3
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 2 / 3)
    assert oea["se"] == pytest.approx(se)
    assert oea["ci95"] == pytest.approx([oea["delta"] - 4.302652729749462 * se, oea["delta"] + 4.302652729749462 * se])


def test_rollout_summary_and_report_carry_the_free_running_metrics():
    records = [episode("base", "q1", CROP), episode("lora", "q1", CROP, DETECT),
               episode("base", "q2", NEAR, DETECT), episode("lora", "q2", CROP, DETECT), episode("base", "q3", CROP)]
    records.append(episode("lora", "q3", CROP))
    gold = {"q1": GOLD, "q2": GOLD, "q3": None}
    counts = {"questions": 3, "rows_failed": 0, "episodes": 6, "episode_errors": 0, "judge_failed": 0}
    summary = summarize_rollouts(records, ["base", "lora"], [1], {"ks": [1], "samples": 1}, counts, {}, gold)
    base, lora = summary["arms"]["base"]["overall"], summary["arms"]["lora"]["overall"]
    assert (base["questions_with_gold"], base["param_prefix"], base["param_prefix_aoi@0.5"]) == (2, 0.25, 0.75)
    assert (lora["param_prefix"], lora["tool_in_order"], lora["efficiency"]) == (1.0, 1.0, 1.0)
    paired = {p["metric"]: p for p in summary["paired"]}
    assert paired["param_prefix"]["n"] == 2 and paired["param_prefix"]["delta"] == pytest.approx(0.75)
    assert paired["all_tools_called_same_order"]["delta"] == pytest.approx(0.5)
    assert "cat_f1/operation" in paired and "tool_any" in paired
    text = format_rollout_report(summary).splitlines()
    start = text.index("EO benchmark metrics, free running: mean over questions with gold calls (docs/evaluation.md, section 17)")
    assert text[start + 1 : start + 4] == [
        "overall quest. eff=inf tool_any_order tool_in_order tool_exact_match param_prefix param_prefix_aoi@0.5 efficiency",
        "base         2       0          0.750         0.750            0.750        0.250                0.750      0.750",
        "lora         2       0          1.000         1.000            1.000        1.000                1.000      1.000",
    ]
    assert "  cat_f1 base: operation 1.000, perception 0.667" in text
    assert "cat_f1 rows: F1 of the pooled calls; SE and CI by the jackknife over questions" in text
    assert "questions_with_gold" in summarize_rollouts(records, ["base"], [1], {"ks": [1]}, {}, {})["arms"]["base"]["overall"]


def _turn(arm, trace, turn_index, steps, task="Counting"):
    return {"arm": arm, "trace_id": trace, "turn": turn_index, "prompt_sha256": f"{trace}/{turn_index}", "EO_task": task,
            "question_type": "qt", "scores": {"turn_correct": 0.0}, "steps": steps}


def _steps(tool, arg, inst, summ):
    return {"inst_acc": inst, "inst_acc_oea": tool[:1] + [tool[1]], "tool_acc": tool, "arg_keys_acc": tool, "arg_acc": arg,
            "arg_acc_aoi@0.5": arg, "summ_acc": summ}


def test_evaluate_summary_and_report_carry_the_gold_history_metrics():
    """t1: turn 0 has two gold calls, turn 1 the answer; base gets 1 tool, 0 args, no answer; lora 2, 1 and the answer."""
    records = [
        _turn("base", "t1", 0, _steps([1.0, 2], [0.0, 2], [1.0, 2], [0.0, 0])),
        _turn("base", "t1", 1, _steps([0.0, 0], [0.0, 0], [1.0, 1], [0.0, 1])),
        _turn("lora", "t1", 0, _steps([2.0, 2], [1.0, 2], [2.0, 2], [0.0, 0])),
        _turn("lora", "t1", 1, _steps([0.0, 0], [0.0, 0], [1.0, 1], [1.0, 1])),
    ]
    summary = summarize_turns(records, [Arm("base"), Arm("lora", "x")], {"samples": 1}, {}, {})
    base = summary["arms"]["base"]["gold_history"]
    assert base["overall"]["tool_acc"] == {"mean": 0.5, "n": 2} and base["overall"]["inst_acc"] == {"mean": 2 / 3, "n": 3}
    assert base["by_EO_task"]["Counting"]["summ_acc"] == {"mean": 0.0, "n": 1}
    paired = {p["metric"]: p for p in summary["paired"]}
    assert paired["tool_acc"]["n"] == 1 and paired["tool_acc"]["delta"] == pytest.approx(0.5)
    assert paired["inst_acc"]["n"] == 2 and paired["inst_acc"]["delta"] == pytest.approx(1 / 3)
    assert paired["inst_acc"]["mean_b"] == pytest.approx(1.0) and paired["summ_acc"]["delta"] == 1.0
    counts = {"rows_in": 1, "rows_failed": 0, "turns_total": 2, "turns_scored": 2, "turns_skipped": 0}
    text = format_turn_report({**summary, "counts": counts}).splitlines()
    start = text.index("EO benchmark metrics, gold history: micro over call steps (docs/evaluation.md, section 17)")
    assert text[start + 1 : start + 4] == [
        "overall  calls answers inst_acc inst_acc_oea tool_acc arg_keys_acc arg_acc arg_acc_aoi@0.5 summ_acc",
        "base         2       1    0.667        0.500    0.500        0.500   0.000           0.000    0.000",
        "lora         2       1    1.000        1.000    1.000        1.000   0.500           0.500    1.000",
    ]
    assert any(line.startswith("base         lora         arg_acc_aoi@0.5") for line in text)
