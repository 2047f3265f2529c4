"""Summaries and printed reports of both protocols (``eogym_sft/evaluation/report.py``): the shared pieces (groups,
paired units, tables) with exact values, Pass@k and paired deltas worked out by hand, and both reports'
text pinned for small hand-made results."""

from __future__ import annotations

import pytest

from eogym_sft.evaluation.report import (
    arm_tables,
    by_group,
    format_rollout_report,
    format_turn_report,
    paired_table,
    paired_turns,
    paired_units,
    pass_at_k,
    questions,
    summarize_rollouts,
    summarize_turns,
    table,
)
from eogym_sft.models.loading import Arm

# ---------------------------------------------------------------- shared pieces


def test_by_group_names_missing_values_and_sorts():
    items = [{"t": "b", "i": 0}, {"i": 1}, {"t": "a", "i": 2}, {"t": "", "i": 3}, {"t": "b", "i": 4}]
    items.append({"t": None, "i": 5})
    groups = by_group(items, "t")
    assert list(groups) == ["(none)", "a", "b"]
    assert {g: [x["i"] for x in xs] for g, xs in groups.items()} == {"(none)": [1, 3, 5], "a": [2], "b": [0, 4]}
    assert by_group([], "t") == {}


def test_paired_units_on_common_scored_units_with_clusters():
    a = {("t1", 0): {"m": 0.0, "x": 1.0}, ("t1", 1): {"m": 1.0, "x": None}, ("t2", 0): {"m": 0.0}}
    a[("t3", 0)] = {"m": 1.0}  # not in b
    b = {("t1", 0): {"m": 1.0, "x": 1.0}, ("t1", 1): {"m": 1.0, "x": 0.0}, ("t2", 0): {"m": 1.0}}
    m, x = paired_units("base", "lora", a, b, ["m", "x", "absent"], cluster=lambda key: key[0])
    assert (m["a"], m["b"], m["metric"], m["n"], m["n_clusters"]) == ("base", "lora", "m", 3, 2)
    assert (m["mean_a"], m["mean_b"], m["delta"]) == (pytest.approx(1 / 3), 1.0, pytest.approx(2 / 3))
    assert (m["wins"], m["losses"], m["ties"]) == (2, 0, 1)
    assert m["se"] == pytest.approx(1 / 3)  # diffs 1, 0, 1: sd sqrt(1/3), over sqrt(3)
    assert (x["metric"], x["n"], x["delta"], x["se"]) == ("x", 1, 0.0, None)  # only ("t1", 0) scored in both
    (plain,) = paired_units("base", "lora", a, b, ["m"])
    assert "se_clustered" not in plain and plain["se"] == m["se"]


def test_table_aligns_counts_and_metrics():
    rows = [("base", [12, 3], {"m": 0.5, "longer_metric": None}), ("a much longer name", [7, 100], {"m": 1 / 3})]
    assert table("overall", [("quest.", 6), ("eps", 5)], ["m", "longer_metric"], rows) == [
        "overall            quest.   eps      m longer_metric",
        "base                   12     3  0.500             -",
        "a much longer name      7   100  0.333             -",
    ]


def test_arm_tables_rows_per_group_and_arm():
    arms = {
        "base": {
            "overall": {"n": 3, "m": 0.5},
            "by_EO_task": {"A": {"n": 1, "m": 1.0}, "B": {"n": 2, "m": 0.25}},
            "by_question_type": {"q": {"n": 3, "m": 0.5}},
        },
        "lora": {
            "overall": {"n": 2, "m": 1.0},
            "by_EO_task": {"B": {"n": 2, "m": 1.0}},
            "by_question_type": {"q": {"n": 2, "m": 1.0}},
        },
    }

    def row(name, figures):  # leave out an arm without the group
        return None if figures is None else (name, [figures["n"]], figures)

    assert arm_tables(arms, [("n", 3)], ["m"], row) == [
        "overall   n      m",
        "base      3  0.500",
        "lora      2  1.000",
        "",
        "by EO_task | arm   n      m",
        "A | base           1  1.000",
        "B | base           2  0.250",
        "B | lora           2  1.000",
        "",
        "by question_type | arm   n      m",
        "q | base                 3  0.500",
        "q | lora                 2  1.000",
    ]


PAIR = {"a": "base", "b": "an-adapter-name-too-long", "metric": "pass@1", "n": 4, "mean_a": 0.25, "mean_b": 0.75,
        "delta": 0.5, "se": 0.2886751, "ci95": [-0.4187, 1.4187], "ci_method": "paired t", "wins": 2, "losses": 0, "ties": 2}


def test_paired_table_per_question():
    one = dict(PAIR, n=1, se=None, ci95=None, wins=1, ties=0)
    assert paired_table([PAIR, one]) == [
        "paired, B - A on identical questions; SE = sd(diff)/sqrt(n); 95% CI, paired t = delta +/- t(0.975, n - 1) SE;",
        "W/L/T = questions where B is better/worse/equal",
        "A            B            metric                     n  mean A  mean B    delta      SE       95% CI, paired t         W/L/T",
        "base         an-adapter-n pass@1                     4   0.250   0.750   +0.500  0.2887       [-0.419, +1.419]    2/0/2",
        "base         an-adapter-n pass@1                     1   0.250   0.750   +0.500       -                      -    1/0/0",
    ]


def test_paired_table_per_turn_with_the_clustered_se():
    lines = paired_table([dict(PAIR, se_clustered=0.3)], "turns", cluster="trace", notes=("a note",))
    assert lines == [
        "paired, B - A on identical turns; SE = sd(diff)/sqrt(n); 95% CI, paired t = delta +/- t(0.975, n - 1) SE;",
        "SE (trace-clustered) allows for correlated turns of one trace; W/L/T = turns where B is better/worse/equal;",
        "a note",
        "A            B            metric                     n  mean A  mean B    delta      SE       95% CI, paired t "
        "SE (trace-cl.)         W/L/T",
        "base         an-adapter-n pass@1                     4   0.250   0.750   +0.500  0.2887       [-0.419, +1.419]"
        "         0.3000    2/0/2",
    ]


# ---------------------------------------------------------------- teacher-forced turns


def _turn(arm, trace, turn, task, **scores):
    return {
        "arm": arm, "trace_id": trace, "turn": turn, "prompt_sha256": f"{trace}/{turn}",
        "EO_task": task, "question_type": "qt", "scores": scores,
    }


TURNS = [
    _turn("base", "t1", 0, "Counting", turn_correct=0.0, call_match=0.0, name_match=1.0, answer_normalized=None),
    _turn("base", "t1", 1, "Counting", turn_correct=1.0, call_match=None, name_match=None, answer_normalized=1.0),
    _turn("base", "t2", 0, "", turn_correct=0.0, call_match=None, name_match=None, answer_normalized=0.0),
    _turn("lora", "t1", 0, "Counting", turn_correct=1.0, call_match=1.0, name_match=1.0, answer_normalized=None),
    _turn("lora", "t1", 1, "Counting", turn_correct=1.0, call_match=None, name_match=None, answer_normalized=1.0),
]


def test_paired_turns_align_turns_by_key():
    def rec(arm, trace, turn, value, sha="h"):
        sha = sha + trace + str(turn)
        return {"arm": arm, "trace_id": trace, "turn": turn, "prompt_sha256": sha, "scores": {"turn_correct": value}}

    records = [
        rec("base", "t", 0, 0.0),
        rec("base", "t", 1, 1.0),
        rec("lora", "t", 1, 1.0),
        rec("lora", "t", 0, 1.0),
        rec("lora", "u", 0, 1.0),
    ]
    (out,) = paired_turns(records, ["base", "lora"])
    assert (out["a"], out["b"], out["n"], out["delta"], out["wins"], out["ties"]) == ("base", "lora", 2, 0.5, 1, 1)
    records[2]["prompt_sha256"] = "different"
    with pytest.raises(RuntimeError, match="different prompts"):
        paired_turns(records, ["base", "lora"])


def test_summarize_turns_by_hand():
    arms = [Arm("base"), Arm("lora", "runs/lora")]
    summary = summarize_turns(TURNS, arms, {"samples": 1}, {"rows_in": 2}, {"lora": {"seconds": 1.5}})
    base, lora = summary["arms"]["base"], summary["arms"]["lora"]
    assert (base["adapter"], lora["adapter"]) == (None, "runs/lora")
    assert (base["timing"], lora["timing"]) == ({}, {"seconds": 1.5})
    assert base["overall"]["turn_correct"] == {"mean": pytest.approx(1 / 3), "n": 3}
    assert base["overall"]["answer_normalized"] == {"mean": 0.5, "n": 2}
    assert base["overall"]["args_match_given_name"] == {"mean": 0.0, "n": 1}
    assert list(base["by_EO_task"]) == ["(none)", "Counting"] and list(lora["by_EO_task"]) == ["Counting"]
    assert base["by_EO_task"]["Counting"]["turn_correct"] == {"mean": 0.5, "n": 2}
    assert [(p["metric"], p["n"], p["delta"], p["n_clusters"]) for p in summary["paired"]] == [
        ("turn_correct", 2, 0.5, 1),
        ("call_match", 1, 1.0, 1),
        ("name_match", 1, 0.0, 1),
        ("answer_normalized", 1, 0.0, 1),
    ]
    assert (summary["settings"], summary["counts"]) == ({"samples": 1}, {"rows_in": 2})


def test_format_turn_report_text():
    counts = {"rows_in": 3, "rows_failed": 1, "turns_total": 4, "turns_scored": 3, "turns_skipped": 1}
    summary = summarize_turns(TURNS, [Arm("base"), Arm("lora", "runs/lora")], {"samples": 1}, counts, {})
    assert format_turn_report(summary).splitlines() == [
        "rows 3 (failed 1), turns 4 (scored 3, skipped 1), arms 2, samples per turn 1",
        "",
        "overall  turns turn_correct name_match call_match answer_normalized",
        "base         3        0.333      1.000      0.000             0.500",
        "lora         2        1.000      1.000      1.000             1.000",
        "",
        "by EO_task | arm  turns turn_correct name_match call_match answer_normalized",
        "(none) | base         1        0.000          -          -             0.000",
        "(none) | lora         0            -          -          -                 -",
        "Counting | base       2        0.500      1.000      0.000             1.000",
        "Counting | lora       2        1.000      1.000      1.000             1.000",
        "",
        "by question_type | arm  turns turn_correct name_match call_match answer_normalized",
        "qt | base                   3        0.333      1.000      0.000             0.500",
        "qt | lora                   2        1.000      1.000      1.000             1.000",
        "",
        "paired, B - A on identical turns; SE = sd(diff)/sqrt(n); 95% CI, paired t = delta +/- t(0.975, n - 1) SE;",
        "SE (trace-clustered) allows for correlated turns of one trace; W/L/T = turns where B is better/worse/equal;",
        "headline metrics only: summary.json has every positive metric",
        "* paired t, clipped to [-1, 1]: the t interval passed a bound a difference of proportions cannot pass",
        "A            B            metric                     n  mean A  mean B    delta      SE       95% CI, paired t SE (trace-cl.)         W/L/T",
        "base         lora         turn_correct               2   0.500   1.000   +0.500  0.5000      [-1.000, +1.000]*              -    1/0/1",
        "base         lora         call_match                 1   0.000   1.000   +1.000       -                      -              -    1/0/0",
        "base         lora         answer_normalized          1   1.000   1.000   +0.000       -                      -              -    0/0/1",
    ]


# ---------------------------------------------------------------- closed-loop episodes


def test_pass_at_k_exact_values():
    assert pass_at_k(3, 1, 1) == pytest.approx(1 / 3)
    assert pass_at_k(3, 1, 3) == 1.0
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(10, 3, 3) == pytest.approx(1 - 35 / 120)
    assert pass_at_k(5, 0, 2) == 0.0
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def _record(arm, q, correct, calls=0, task="Counting", stop="final_answer"):
    return {
        "arm": arm, "source_id": q, "correct": correct, "tool_calls": calls, "tool_errors": 0, "tool_error_codes": {},
        "turns": calls + 1, "new_tokens": 10, "final_answer": "x", "stop_reason": stop, "judge_error": None,
        "EO_task": task, "question_type": "qt",
    }


def test_summary_pass_at_k_and_paired_deltas_by_hand():
    # question q1: base 0/3, lora 2/3; q2: base 1/3, lora 3/3; q3: base 1/3 (one unscored), lora 1/3
    outcomes = {("base", "q1"): [0, 0, 0], ("lora", "q1"): [1, 1, 0], ("base", "q2"): [1, 0, 0],
                ("lora", "q2"): [1, 1, 1], ("base", "q3"): [1, 0, None], ("lora", "q3"): [0, 1, 0]}
    records = [_record(a, q, None if c is None else bool(c), calls=int(a == "lora")) for (a, q), cs in outcomes.items() for c in cs]
    per_q = questions(records, [1, 3])
    assert per_q[("base", "q3")]["n"] == 2 and per_q[("base", "q3")]["pass@3"] is None
    assert per_q[("lora", "q1")]["pass@1"] == pytest.approx(2 / 3) and per_q[("lora", "q1")]["pass@3"] == 1.0
    summary = summarize_rollouts(records, ["base", "lora"], [1, 3], {"ks": [1, 3], "samples": 3}, {}, {})
    base, lora = summary["arms"]["base"]["overall"], summary["arms"]["lora"]["overall"]
    assert base["pass@1"] == pytest.approx((0 + 1 / 3 + 1 / 2) / 3)
    assert (base["pass@3"], base["pass@3_questions"]) == (pytest.approx(0.5), 2)
    assert lora["pass@1"] == pytest.approx((2 / 3 + 1 + 1 / 3) / 3) and lora["pass@3"] == 1.0
    assert (base["tool_any"], lora["tool_any"], lora["calls_per_episode"]) == (0.0, 1.0, 1.0)
    paired = {p["metric"]: p for p in summary["paired"]}
    p1 = paired["pass@1"]
    diffs = [2 / 3, 2 / 3, 1 / 3 - 1 / 2]
    mean = sum(diffs) / 3
    se = (sum((d - mean) ** 2 for d in diffs) / 2 / 3) ** 0.5
    assert (p1["a"], p1["b"], p1["n"], p1["wins"], p1["losses"]) == ("base", "lora", 3, 2, 1)
    assert p1["delta"] == pytest.approx(mean) and p1["se"] == pytest.approx(se)
    t2 = 4.302652729749462  # Student's t, 97.5%, 2 degrees of freedom (3 questions)
    assert mean + t2 * se > 1  # the t interval passes 1: cut there, and the record says so
    assert p1["ci95"] == pytest.approx([mean - t2 * se, 1.0], rel=1e-9) and p1["ci_method"] == "paired t, clipped to [-1, 1]"
    assert paired["pass@3"]["n"] == 2 and paired["pass@3"]["delta"] == pytest.approx(0.5)
    assert summary["arms"]["lora"]["by_EO_task"]["Counting"]["pass@1"] == lora["pass@1"]


def test_summary_counts_the_calls_past_the_per_turn_cap():
    records = [_record("base", "q1", True, calls=8) | {"skipped_calls": 12}, _record("base", "q2", False), _record("base", "q3", True)]
    summary = summarize_rollouts(records, ["base"], [1], {"ks": [1], "samples": 1}, {}, {})
    assert summary["arms"]["base"]["overall"]["skipped_calls"] == 12


def test_format_rollout_report_text():
    records = [
        _record("base", "q1", False), _record("base", "q1", True, calls=1, stop="max_turns"),
        _record("base", "q2", None, task=""), _record("base", "q2", False, task=""),
        _record("lora", "q1", True, calls=2), _record("lora", "q1", True, calls=1),
    ]
    timing = {"lora": {"episodes_per_min": 12.345, "new_tokens_per_s": 67.89}}
    counts = {"questions": 2, "rows_failed": 1, "episodes": 6, "episode_errors": 0, "judge_failed": 1}
    summary = summarize_rollouts(records, ["base", "lora"], [1, 2], {"ks": [1, 2], "samples": 2}, counts, timing)
    assert format_rollout_report(summary).splitlines() == [
        "questions 2 (rows failed 1), samples per question 2, episodes 6 (errors 0, judge failures 1)",
        "",
        "overall quest.   eps pass@1 pass@2 mean_score answered tool_any tool_error_rate calls_per_episode turns_per_episode",
        "base         2     4  0.250  1.000      0.333    1.000    0.250           0.000             0.250             1.250",
        "lora         1     2  1.000  1.000      1.000    1.000    1.000           0.000             1.500             2.500",
        "",
        "by EO_task | arm quest.   eps pass@1 pass@2 mean_score answered tool_any tool_error_rate calls_per_episode turns_per_episode",
        "(none) | base         1     2  0.000      -      0.000    1.000    0.000               -             0.000             1.000",
        "Counting | base       1     2  0.500  1.000      0.500    1.000    0.500           0.000             0.500             1.500",
        "Counting | lora       1     2  1.000  1.000      1.000    1.000    1.000           0.000             1.500             2.500",
        "",
        "by question_type | arm quest.   eps pass@1 pass@2 mean_score answered tool_any tool_error_rate calls_per_episode turns_per_episode",
        "qt | base                   2     4  0.250  1.000      0.333    1.000    0.250           0.000             0.250             1.250",
        "qt | lora                   1     2  1.000  1.000      1.000    1.000    1.000           0.000             1.500             2.500",
        "",
        "stop reasons",
        "  base: final_answer 3, max_turns 1",
        "  lora: final_answer 2",
        "  lora: 12.3 episodes/min, 67.9 generated tokens/s",
        "",
        "paired, B - A on identical questions; SE = sd(diff)/sqrt(n); 95% CI, paired t = delta +/- t(0.975, n - 1) SE;",
        "W/L/T = questions where B is better/worse/equal",
        "A            B            metric                     n  mean A  mean B    delta      SE       95% CI, paired t         W/L/T",
        "base         lora         pass@1                     1   0.500   1.000   +0.500       -                      -    1/0/0",
        "base         lora         pass@2                     1   1.000   1.000   +0.000       -                      -    0/0/1",
        "base         lora         tool_any                   1   0.500   1.000   +0.500       -                      -    1/0/0",
    ]
