"""The EO tool-agent benchmarks' metrics in both reports: gold-history ones over the teacher-forced turns of
``eogym-sft evaluate`` (micro over call steps, paired over turns), free-running ones over the episodes of
``eogym-sft rollout`` (per episode, then per question and the mean over questions, paired over questions). The
gold call list of an episode is its EO-Gym row's own trace. Pure functions over result records; the metrics
themselves are :mod:`eogym_sft.metrics.gold_history` and :mod:`eogym_sft.metrics.free_running`.
"""

from __future__ import annotations

import math

from ..environment.env import SKIPPED_CALLS_NOTICE
from ..metrics.free_running import (
    FREE_RUNNING_METRICS,
    category_f1,
    episode_scores,
    f1_pseudo_values,
    pooled,
)
from ..metrics.gold_history import GOLD_HISTORY_METRICS, micro, paired_units
from ..metrics.scoring import paired_stats, t_quantile_975
from ..safe_json import UntrustedJSONError, loads

F1_CI_METHOD = "jackknife t"  # a pooled F1 is no mean over questions: its SE comes from leave-one-question-out

# ---------------------------------------------------------------- gold history (eogym-sft evaluate)


def step_figures(records: list[dict]) -> dict:
    """``{metric: {"mean", "n"}}`` over the turns' step counts, ``n`` the metric's steps."""
    return micro([r["steps"] for r in records if r.get("steps")])


def paired_steps(a: str, b: str, turns_a: dict, turns_b: dict) -> list[dict]:
    """Arm ``b`` against arm ``a`` per gold-history metric on the turns both scored: ``delta`` is the difference
    of the micro ratios, the SEs those of :func:`~eogym_sft.metrics.gold_history.paired_units`, clustered by trace."""
    counts_a = {k: r["steps"] for k, r in turns_a.items() if r.get("steps")}
    counts_b = {k: r["steps"] for k, r in turns_b.items() if r.get("steps")}
    out = []
    for metric in GOLD_HISTORY_METRICS:
        units = paired_units(counts_a, counts_b, metric)
        if units is not None:
            keys, xs, ys = units
            out.append({"a": a, "b": b, "metric": metric, **paired_stats(xs, ys, clusters=[k[0] for k in keys])})
    return out


# ---------------------------------------------------------------- free running (eogym-sft rollout)


def _arguments(text):
    try:
        return loads(text) if isinstance(text, str) else text
    except UntrustedJSONError:
        return text  # kept as written: it equals no gold argument object


def executed_calls(messages: list[dict]) -> list[dict]:
    """The calls of an episode's messages that the environment ran, in order: each assistant turn's calls, less
    those past the per-turn cap, which got one notice (:data:`~eogym_sft.environment.env.SKIPPED_CALLS_NOTICE`)
    and no result."""
    messages = [m for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []
    out = []
    for i, msg in enumerate(messages):
        calls = msg.get("tool_calls") if msg.get("role") == "assistant" else None
        if not isinstance(calls, list) or not calls:
            continue
        results = []
        for later in messages[i + 1 :]:
            if later.get("role") != "tool":
                break
            results.append(later.get("content"))
        notice = SKIPPED_CALLS_NOTICE.split("{cap}")[0].format(calls=len(calls))
        ran = len(results) - 1 if results and str(results[-1]).startswith(notice) else min(len(results), len(calls))
        for call in calls[:ran]:
            function = call.get("function") if isinstance(call, dict) else None
            function = function if isinstance(function, dict) else {}
            out.append({"name": function.get("name"), "arguments": _arguments(function.get("arguments"))})
    return out


def question_tool_scores(episodes: list[dict], gold: list[dict] | None) -> dict:
    """One question's free-running figures over its episodes: each metric's mean (``efficiency`` over finite
    ratios), ``efficiency_infinite`` (episodes with calls where the gold list is empty) and the pooled category
    counts. ``{}`` without a gold list or episodes."""
    if gold is None or not episodes:
        return {}
    scores = [episode_scores(gold, executed_calls(e["messages"])) for e in episodes]
    out = {m: sum(s[m] for s in scores) / len(scores) for m in FREE_RUNNING_METRICS if m != "efficiency"}
    finite = [s["efficiency"] for s in scores if not math.isinf(s["efficiency"])]
    out["efficiency"] = sum(finite) / len(finite) if finite else None
    out["efficiency_infinite"] = len(scores) - len(finite)
    out["categories"] = pooled([s["categories"] for s in scores])
    return out


def tool_figures(per_question: list[dict]) -> dict:
    """An arm's (or group's) figures: the mean over questions of each metric, ``questions_with_gold``,
    ``efficiency_infinite`` (episodes), and ``cat_f1`` / ``cat_f1_gta`` per category over the pooled calls."""
    scored = [q for q in per_question if q.get("categories") is not None]
    out: dict = {"questions_with_gold": len(scored)}
    for m in FREE_RUNNING_METRICS:
        values = [q[m] for q in scored if q.get(m) is not None]
        out[m] = sum(values) / len(values) if values else None
    out["efficiency_infinite"] = sum(q["efficiency_infinite"] for q in scored)
    totals = pooled([q["categories"] for q in scored])
    out["cat_f1"] = {c: category_f1(t) for c, t in totals.items()}
    out["cat_f1_gta"] = {c: category_f1(t, gta=True) for c, t in totals.items()}
    return out


def paired_f1(a: str, b: str, questions_a: dict, questions_b: dict) -> list[dict]:
    """Arm ``b`` against arm ``a`` on each category's pooled F1 (both formulas) over the questions both scored:
    ``delta`` the difference of the F1s, ``se`` the jackknife SE of that difference (leave one question out)."""
    keys = sorted(
        k
        for k in questions_a.keys() & questions_b.keys()
        if "categories" in questions_a[k] and "categories" in questions_b[k]
    )
    cats_a, cats_b = [questions_a[k]["categories"] for k in keys], [questions_b[k]["categories"] for k in keys]
    out = []
    for gta, name in ((False, "cat_f1"), (True, "cat_f1_gta")):
        for cat in sorted(pooled(cats_a).keys() | pooled(cats_b).keys()):
            xs, ys = f1_pseudo_values(cats_a, cat, gta), f1_pseudo_values(cats_b, cat, gta)
            if xs is None or ys is None:
                continue
            stats = paired_stats(xs, ys)
            mean_a, mean_b = category_f1(pooled(cats_a)[cat], gta), category_f1(pooled(cats_b)[cat], gta)
            delta, half = mean_b - mean_a, t_quantile_975(len(keys) - 1) * stats["se"]
            stats.update(mean_a=mean_a, mean_b=mean_b, delta=delta, ci95=[delta - half, delta + half],
                         ci_method=F1_CI_METHOD)
            out.append({"a": a, "b": b, "metric": f"{name}/{cat}", **stats})
    return out
