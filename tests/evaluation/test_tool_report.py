"""The EO benchmarks' tool metrics in the reports (``eogym_sft/evaluation/tool_report.py``): which calls an
episode ran, the gold list of a row, per-question and per-arm figures and the paired deltas, worked by hand."""

from __future__ import annotations

import json
import math

import pytest

from eogym_sft.evaluation.report import format_rollout_report, format_turn_report, summarize_rollouts, summarize_turns
from eogym_sft.evaluation.tool_report import (
    executed_calls,
    paired_f1,
    question_tool_scores,
    tool_figures,
)
from eogym_sft.metrics.free_running import category_f1, f1_pseudo_values
from eogym_sft.metrics.tool_args import gold_calls
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


GOLD = [{"name": "crop_optical_or_sar_image", "arguments": {"aoi": [0, 0, 0.5, 0.5]}},
        {"name": "get_object_bbox_by_optical_image", "arguments": {"object_name": "car"}}]


def episode(arm, q, *calls, correct=True):
    messages = [{"role": "user", "content": "q"}]
    for name, args in calls:
        messages += turn((name, args))
    return {"arm": arm, "source_id": q, "messages": messages, "correct": correct, "tool_calls": len(calls), "tool_errors": 0,
            "tool_error_codes": {}, "turns": len(calls) + 1, "new_tokens": 1, "final_answer": "x", "stop_reason": "final_answer",
            "judge_error": None, "EO_task": "Counting", "question_type": "qt"}


CROP, DETECT = (GOLD[0]["name"], GOLD[0]["arguments"]), (GOLD[1]["name"], GOLD[1]["arguments"])
NEAR = (GOLD[0]["name"], {"aoi": [0, 0, 0.5, 0.45]})


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


# ---------------------------------------------------------------- end to end on the bundled sample

# Two rows of the bundled sample: line 3 (detect airplanes, crop; gt 7) and line 4 (two crops in one turn; gt 7).
COUNT_ID, DAMAGE_ID = "train_0000002_ea4be2f690ee", "train_0000003_6e2dc157f748"


def _sample_rows(sample_dir) -> dict:
    rows = [json.loads(line) for line in (sample_dir / "eogym_sample.jsonl").read_text().splitlines()[2:4]]
    return {row["id"]: row for row in rows}


def _gold_turns(row) -> list[tuple[str, list[tuple[str, dict]]]]:
    """The row's assistant turns: ``(content, [(name, arguments), ...])``."""
    from eogym_sft.data.traces import normalize_row

    turns = [m for m in normalize_row(row).messages if m["role"] == "assistant"]
    return [(m["content"], [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls", [])]) for m in turns]


def _question(row) -> str:
    from eogym_sft.data.traces import normalize_row

    user = next(m for m in normalize_row(row).messages if m["role"] == "user")
    return "".join(p.get("text", "") for p in user["content"]).strip()


def _sloppy_turns(rows) -> dict:
    """On the counting row: a crop 8% short of the gold box first, then the detection, then a wrong count. On the
    damage row: the first crop only, then the right answer."""
    (_, [detect]), (_, [crop]), _ = _gold_turns(rows[COUNT_ID])
    near = (crop[0], {**crop[1], "aoi": [0.02, 0.05, 0.62, 0.60]})  # IoU with the gold box 0.917
    (_, [first, _]), _ = _gold_turns(rows[DAMAGE_ID])
    return {
        COUNT_ID: [("I crop first.", [near]), ("Now I detect.", [detect]), ("Final Answer: 6", [])],
        DAMAGE_ID: [("One crop.", [first]), ("Final Answer: 7", [])],
    }


def _as_text(content, calls) -> str:
    blocks = "".join(f"\n<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)
    return content + blocks + "<|im_end|>"


@pytest.mark.slow(30)
def test_scripted_policies_on_the_bundled_sample_through_rollout_and_evaluate(tmp_path, sample_dir, processor, monkeypatch):
    """Hand-counted. Free running, the gold arm replays each row's trace; the sloppy arm, on the counting row
    (G = detect, crop; P = near crop, detect) scores any-order 1, in-order 1/2, exact 0, param 0, efficiency 1,
    OEA T/F/T; on the damage row (G = crop, crop; P = crop) 1, 1/2, 1/2, 1/2, 1/2, F/F/T. Teacher-forced on the
    damage row (call steps: crop, crop; then the answer), the base arm's box is near on the first crop (arg 1/2,
    within IoU 2/2) and it calls where the reference answers (inst 2/3, summ 0/1)."""
    import shutil

    from policy_servers import reply, serve

    from eogym_sft.cli import main

    root = tmp_path / "sample"
    shutil.copytree(sample_dir, root)  # crops are written under the data root
    rows = _sample_rows(sample_dir)
    data = tmp_path / "two.jsonl"
    data.write_text("".join(json.dumps(rows[i]) + "\n" for i in (COUNT_ID, DAMAGE_ID)))
    scripts = {"gold": {i: _gold_turns(r) for i, r in rows.items()}, "sloppy": _sloppy_turns(rows)}
    questions = {i: _question(r) for i, r in rows.items()}

    def policy(body, handler):
        asked = "".join(p.get("text", "") for p in body["messages"][1]["content"])
        row = next(i for i, q in questions.items() if q in asked)
        content, calls = scripts[body["model"]][row][sum(m["role"] == "assistant" for m in body["messages"])]
        tool_calls = [{"id": f"c{k}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
                      for k, (n, a) in enumerate(calls)]
        return reply({"content": content, **({"tool_calls": tool_calls} if calls else {})}, "tool_calls" if calls else "stop")

    out = tmp_path / "rollout"
    with serve(policy) as (url, _):
        main(["rollout", "--model", str(_tiny_with_adapter(tmp_path, processor)[0]), "--no-base", "--data", str(data),
              "--data-root", str(root), "--output", str(out), "--max-turns", "4", "--no-progress", "--policy-url", url,
              "--policy-model", "gold", "--policy-url", url, "--policy-model", "sloppy"])
    summary = json.loads((out / "summary.json").read_text())
    gold, sloppy = summary["arms"]["gold"]["overall"], summary["arms"]["sloppy"]["overall"]
    assert (gold["pass@1"], sloppy["pass@1"], summary["counts"]["questions_with_gold"]) == (1.0, 0.5, 2)
    ea = ("tool_any_order", "tool_in_order", "tool_exact_match", "param_prefix", "param_prefix_aoi@0.5", "efficiency")
    assert [gold[m] for m in ea] == [1.0] * 6
    assert [sloppy[m] for m in ea] == [1.0, 0.5, 0.25, 0.25, 0.25, 0.75]
    oea = ("all_tools_called_any_order", "all_tools_called_same_order", "all_tools_called_unique")
    assert [gold[m] for m in oea] == [1.0, 1.0, 1.0] and [sloppy[m] for m in oea] == [0.5, 0.0, 1.0]
    # operation (crops): gold 3, predicted 2, matched 2 (OEA) or 3 (GTA: both gold crops are "in P")
    assert round(sloppy["cat_f1"]["operation"], 4) == 0.8 and round(sloppy["cat_f1_gta"]["operation"], 4) == 1.2
    assert round(gold["cat_f1"]["perception"], 4) == 1.0
    paired = {p["metric"]: p for p in summary["paired"]}
    assert (paired["param_prefix"]["n"], paired["param_prefix"]["delta"]) == (2, -0.75)
    assert paired["pass@1"]["delta"] == -0.5
    report = (out / "report.txt").read_text()
    episodes = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    assert len(episodes) == 4 and all(e["gold_calls"] == gold_calls(rows[e["source_id"]]) for e in episodes)
    assert "sloppy       2       0          1.000         0.500            0.250        0.250                0.250      0.750" in report

    # teacher-forced, on the damage row (decoding is the slow part): base writes a near box for the first crop, the
    # second exact, and a crop for the answer; the adapter ("gold") the reference's turns
    (_, [first, second]), _ = scripts["gold"][DAMAGE_ID]
    near = (first[0], {**first[1], "aoi": [0.31, 0.35, 0.81, 0.80]})  # IoU with the gold box 0.9
    texts = [_as_text("Two crops.", [near, second]), _as_text("Again.", [second])]
    texts += [_as_text(c, calls) for c, calls in scripts["gold"][DAMAGE_ID]]
    monkeypatch.setattr("eogym_sft.agent.sampling.Sampling", _scripted_sampling(processor.tokenizer, texts))
    model, adapter = _tiny_with_adapter(tmp_path, processor)
    damage, out = tmp_path / "damage.jsonl", tmp_path / "evaluate"
    damage.write_text(json.dumps(rows[DAMAGE_ID]) + "\n")
    main(["evaluate", "--model", str(model), "--adapter", f"gold={adapter}", "--data", str(damage), "--data-root", str(root),
          "--output", str(out), "--max-new-tokens", "256", "--batch-size", "1", "--max-pixels", "65536", "--no-progress"])
    summary = json.loads((out / "summary.json").read_text())
    base = {m: (v["mean"], v["n"]) for m, v in summary["arms"]["base"]["gold_history"]["overall"].items()}
    assert base == {"inst_acc": (2 / 3, 3), "inst_acc_oea": (1.0, 2), "tool_acc": (1.0, 2), "arg_keys_acc": (1.0, 2),
                    "arg_acc": (0.5, 2), "arg_acc_aoi@0.5": (1.0, 2), "summ_acc": (0.0, 1)}
    steps = {m: (v["mean"], v["n"]) for m, v in summary["arms"]["gold"]["gold_history"]["overall"].items()}
    assert steps == {m: (1.0, n) for m, (_, n) in base.items()}
    assert summary["arms"]["base"]["gold_history"]["by_EO_task"]["Disaster Impact"]["arg_acc"] == {"mean": 0.5, "n": 2}
    paired = {p["metric"]: p for p in summary["paired"]}
    assert (paired["arg_acc"]["delta"], paired["summ_acc"]["delta"], paired["inst_acc"]["delta"]) == (0.5, 1.0, pytest.approx(1 / 3))
    assert paired["arg_acc_aoi@0.5"]["delta"] == 0.0
    assert "EO benchmark metrics, gold history" in (out / "report.txt").read_text()


def _tiny_with_adapter(tmp_path, processor):
    """A tiny Qwen3-VL folder and a LoRA adapter on it (made once per test)."""
    from peft import LoraConfig, get_peft_model

    from eogym_sft.models.tiny import build_tiny_model

    root = tmp_path / "models"
    if not (root / "lora").is_dir():
        build_tiny_model(0).save_pretrained(root / "base")
        processor.save_pretrained(root / "base")
        get_peft_model(build_tiny_model(0), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"])).save_pretrained(root / "lora")
    return root / "base", root / "lora"


def _scripted_sampling(tokenizer, texts: list[str]):
    """A ``Sampling`` that writes ``texts`` in turn, one a model turn, whatever the logits (evaluate makes one per arm)."""
    from eogym_sft.agent.sampling import Sampling

    script = iter([tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts])

    class Scripted(Sampling):
        def pick(self, logits, generated, stop_ids, generator=None, banned_ids=()):
            out = []
            for n in generated:
                if n == 0:
                    self.tokens = next(script)
                out.append(self.tokens[n])
            return out

    return Scripted
