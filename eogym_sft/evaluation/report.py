"""Results of both evaluation protocols as ``summary.json`` and printed tables, per arm, per ``EO_task``
and ``question_type``, with paired deltas between arms: the teacher-forced turns of ``eogym-sft
evaluate`` (mean scores, paired over turns) and the closed-loop episodes of ``eogym-sft rollout``
(Pass@k per question, paired over questions). Pure functions over result records; no model, no I/O.
``docs/evaluation.md`` defines every figure.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from itertools import combinations
from math import comb

from ..metrics.gold_history import GOLD_HISTORY_METRICS
from ..metrics.scoring import CI_CLIPPED, CI_METHOD, POSITIVE_METRICS, mean_scores, paired_stats
from ..metrics.free_running import FREE_RUNNING_METRICS
from .tool_report import paired_f1, paired_steps, question_tool_scores, step_figures, tool_figures

GROUP_FIELDS = ("EO_task", "question_type")
# The evaluate report's columns, in this order, where any arm has them; its paired table shows these
# (and their @k); summary.json has every metric.
TURN_METRICS = (
    "turn_correct",
    "action_match",
    "name_match",
    "call_match",
    "invalid_call",
    "unknown_tool",
    "answer_exact",
    "answer_normalized",
    "no_answer",
)
TURN_PAIRED_METRICS = ("turn_correct", "call_match", "answer_normalized", "answer_judge")
# The free-running tool metrics' columns: Earth-Agent's (and our box-tolerant one), then OpenEarthAgent's.
EARTH_AGENT_COLUMNS = ("tool_any_order", "tool_in_order", "tool_exact_match", "param_prefix", "param_prefix_aoi@0.5",
                       "efficiency")
OEA_COLUMNS = ("all_tools_called_any_order", "all_tools_called_same_order", "all_tools_called_unique")
# The rollout report's columns after Pass@k.
EPISODE_METRICS = ("mean_score", "answered", "tool_any", "tool_error_rate", "calls_per_episode", "turns_per_episode")


# ---------------------------------------------------------------- shared by both protocols


def by_group(items: list[dict], field: str) -> dict[str, list[dict]]:
    """``items`` per value of ``field`` (``"(none)"`` where it is missing or empty), sorted by that value."""
    groups = defaultdict(list)
    for item in items:
        groups[item.get(field) or "(none)"].append(item)
    return dict(sorted(groups.items()))


def paired_units(a: str, b: str, units_a: dict, units_b: dict, metrics: list[str], cluster=None) -> list[dict]:
    """Arm ``b`` against arm ``a`` per metric on the units (keys of ``units_a``/``units_b``, each a dict of
    metric values) where both have a value, with :func:`eogym_sft.metrics.scoring.paired_stats`; ``cluster(key)``
    names a unit's cluster for the clustered SE."""
    keys = sorted(units_a.keys() & units_b.keys())
    out = []
    for metric in metrics:
        units = [k for k in keys if units_a[k].get(metric) is not None and units_b[k].get(metric) is not None]
        if not units:
            continue
        xs = [units_a[k][metric] for k in units]
        ys = [units_b[k][metric] for k in units]
        clusters = [cluster(k) for k in units] if cluster else None
        out.append({"a": a, "b": b, "metric": metric, **paired_stats(xs, ys, clusters=clusters)})
    return out


def _cell(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def table(
    title: str, columns: list[tuple[str, int]], metrics: list[str], rows: list[tuple[str, list[int], dict]]
) -> list[str]:
    """Text lines: a header, then per ``(name, counts, values)`` row the counts right-aligned under
    ``columns`` (``(header, width)`` each) and the ``metrics`` of ``values`` to 3 decimals (``-`` if none)."""
    width = max([len(title)] + [len(name) for name, _, _ in rows])
    widths = [max(len(m), 6) for m in metrics]

    def line(name: str, counts: list, cells: list[str]) -> str:
        lead = " ".join([f"{name:<{width}}", *(f"{c:>{w}}" for c, (_, w) in zip(counts, columns))])
        return lead + " " + " ".join(f"{c:>{w}}" for c, w in zip(cells, widths))

    lines = [line(title, [head for head, _ in columns], metrics)]
    return lines + [line(name, counts, [_cell(values.get(m)) for m in metrics]) for name, counts, values in rows]


def arm_tables(arms: dict, columns: list[tuple[str, int]], metrics: list[str], row) -> list[str]:
    """The ``overall`` table of every arm, then one per group field with a row per group and arm.
    ``row(name, figures)`` makes a :func:`table` row from an arm's figures (``None`` where that arm has
    no such group), or returns ``None`` to leave the row out."""
    lines = table("overall", columns, metrics, [row(name, a["overall"]) for name, a in arms.items()])
    for field in GROUP_FIELDS:
        groups = sorted({g for a in arms.values() for g in a[f"by_{field}"]})
        rows = [row(f"{g} | {name}", a[f"by_{field}"].get(g)) for g in groups for name, a in arms.items()]
        lines += ["", *table(f"by {field} | arm", columns, metrics, [r for r in rows if r is not None])]
    return lines


def paired_table(
    paired: list[dict], unit: str = "questions", cluster: str | None = None, notes: tuple[str, ...] = ()
) -> list[str]:
    """The paired comparisons as text lines (SE = sd(diff)/sqrt(n); 95% CI = delta +/- t SE, Student's t
    at n - 1 degrees of freedom, named in the header as each record's ``ci_method``); with
    ``cluster`` (what units cluster in, e.g. ``"trace"``) a column of the clustered SE; ``notes`` go
    under the legend."""
    wlt = f"W/L/T = {unit} where B is better/worse/equal"
    wide = max([22] + [len(p["metric"]) for p in paired])
    clustered_head = f" {f'SE ({cluster}-cl.)':>14}" if cluster else ""
    lines = [
        f"paired, B - A on identical {unit}; SE = sd(diff)/sqrt(n); 95% CI, {CI_METHOD} = delta +/- t(0.975, n - 1) "
        "SE;",
        f"SE ({cluster}-clustered) allows for correlated {unit} of one {cluster}; {wlt};" if cluster else wlt,
        *notes,
        f"{'A':<12} {'B':<12} {'metric':<{wide}} {'n':>5} {'mean A':>7} {'mean B':>7} {'delta':>8} {'SE':>7} "
        f"{f'95% CI, {CI_METHOD}':>22}{clustered_head} {'W/L/T':>13}",
    ]
    if any(p["ci_method"] == CI_CLIPPED for p in paired):
        lines.insert(len(lines) - 1,
                     f"* {CI_CLIPPED}: the t interval passed a bound a difference of proportions cannot pass")
    for p in paired:
        ci = (
            "-"
            if p["ci95"] is None
            else "[{:+.3f}, {:+.3f}]".format(*p["ci95"]) + ("*" if p["ci_method"] == CI_CLIPPED else "")
        )
        se = "-" if p["se"] is None else f"{p['se']:.4f}"
        sec = "-" if p.get("se_clustered") is None else f"{p['se_clustered']:.4f}"
        names = f"{p['a'][:12]:<12} {p['b'][:12]:<12} {p['metric']:<{wide}} {p['n']:>5}"
        means = f"{p['mean_a']:>7.3f} {p['mean_b']:>7.3f} {p['delta']:>+8.3f}"
        clustered = f" {sec:>14}" if cluster else ""
        lines.append(f"{names} {means} {se:>7} {ci:>22}{clustered} {p['wins']:>4}/{p['losses']}/{p['ties']}")
    return lines


# ---------------------------------------------------------------- teacher-forced turns (eogym-sft evaluate)


def paired_turns(records: list[dict], arms: list[str]) -> list[dict]:
    """Every later arm against every earlier one, per positive metric, on the turns both have scored
    (a turn is ``(trace_id, turn)``; SEs also clustered by trace). Turns must have identical prompts."""
    by_arm = {a: {(r["trace_id"], r["turn"]): r for r in records if r["arm"] == a} for a in arms}
    names = dict.fromkeys(k for r in records for k in r["scores"])
    metrics = [m for m in names if m.split("@")[0] in POSITIVE_METRICS]
    out = []
    for a, b in combinations(arms, 2):
        for key in sorted(by_arm[a].keys() & by_arm[b].keys()):
            if by_arm[a][key]["prompt_sha256"] != by_arm[b][key]["prompt_sha256"]:
                raise RuntimeError(f"turn {key} has different prompts in arms {a} and {b}")
        scores_a = {k: r["scores"] for k, r in by_arm[a].items()}
        scores_b = {k: r["scores"] for k, r in by_arm[b].items()}
        out += paired_units(a, b, scores_a, scores_b, metrics, cluster=lambda key: key[0])
        out += paired_steps(a, b, by_arm[a], by_arm[b])
    return out


def summarize_turns(records: list[dict], arms: list, settings: dict, counts: dict, timing: dict) -> dict:
    """``summary.json`` of ``eogym-sft evaluate``: settings, counts, per arm (:class:`eogym_sft.models.loading.Arm`)
    the mean scores overall and per group and the timing, and the paired comparisons."""
    per_arm = {}
    for arm in arms:
        mine = [r for r in records if r["arm"] == arm.name]
        per_arm[arm.name] = {
            "adapter": arm.adapter,
            "overall": mean_scores([r["scores"] for r in mine]),
            **{
                f"by_{field}": {g: mean_scores([r["scores"] for r in rs]) for g, rs in by_group(mine, field).items()}
                for field in GROUP_FIELDS
            },
            "timing": timing.get(arm.name, {}),
            "gold_history": {
                "overall": step_figures(mine),
                **{f"by_{f}": {g: step_figures(rs) for g, rs in by_group(mine, f).items()} for f in GROUP_FIELDS},
            },
        }
    paired = paired_turns(records, [a.name for a in arms])
    return {"settings": settings, "counts": counts, "arms": per_arm, "paired": paired}


def _turn_row(name: str, scores: dict | None) -> tuple[str, list[int], dict]:
    scores = scores or {}  # an arm without this group: a row of 0 turns
    return name, [max((v["n"] for v in scores.values()), default=0)], {m: v["mean"] for m, v in scores.items()}


def _step_row(name: str, figures: dict | None) -> tuple[str, list[int], dict]:
    figures = figures or {}
    counts = [figures.get(m, {}).get("n", 0) for m in ("tool_acc", "summ_acc")]
    return name, counts, {m: v["mean"] for m, v in figures.items()}


def format_turn_report(summary: dict) -> str:
    """The report of ``eogym-sft evaluate``: counts, per-arm metrics overall and per group, then the
    paired comparisons of the headline metrics."""
    counts, arms = summary["counts"], summary["arms"]
    k = summary["settings"]["samples"]
    extra = ("answer_judge", f"turn_correct@{k}", f"answer_normalized@{k}")
    metrics = [m for m in TURN_METRICS + extra if any(m in a["overall"] for a in arms.values())]
    lines = [
        f"rows {counts['rows_in']} (failed {counts['rows_failed']}), turns {counts['turns_total']} "
        f"(scored {counts['turns_scored']}, skipped {counts['turns_skipped']}), "
        f"arms {len(arms)}, samples per turn {k}",
        "",
        *arm_tables(arms, [("turns", 6)], metrics, _turn_row),
    ]
    steps = {name: a["gold_history"] for name, a in arms.items() if "gold_history" in a}
    if any(a["overall"] for a in steps.values()):
        lines += ["", "EO benchmark metrics, gold history: micro over call steps (docs/evaluation.md, section 17)"]
        lines += arm_tables(steps, [("calls", 6), ("answers", 7)], list(GOLD_HISTORY_METRICS), _step_row)
    headline = [
        p
        for p in summary["paired"]
        if p["metric"].split("@")[0] in TURN_PAIRED_METRICS or p["metric"] in GOLD_HISTORY_METRICS
    ]
    if headline:
        notes = ("headline metrics only: summary.json has every positive metric",)
        lines += ["", *paired_table(headline, "turns", cluster="trace", notes=notes)]
    return "\n".join(lines)


# ---------------------------------------------------------------- closed-loop episodes (eogym-sft rollout)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased Pass@k estimator from ``n`` samples of which ``c`` are correct (Chen et al., 2021):
    ``1 - C(n - c, k) / C(n, k)``, the chance that ``k`` of the ``n`` drawn without replacement hold one
    correct. Needs ``n >= k``.

    >>> pass_at_k(5, 2, 1), pass_at_k(5, 2, 3), pass_at_k(3, 0, 3)
    (0.4, 0.9, 0.0)
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - comb(n - c, k) / comb(n, k)


def policy_error_code(record: dict) -> str | None:
    """The code of the policy-server failure that ended this episode (``timeout``, ``http_status``, ``too_large``,
    ``bad_json``...: :class:`eogym_sft.agent.policy_server.PolicyError`), or ``None``."""
    error = str(record.get("error") or "")
    if record.get("stop_reason") != "error" or not error.startswith("PolicyError: "):
        return None
    return error.removeprefix("PolicyError: ").split(":", 1)[0]


def episode_score(record: dict) -> bool | None:
    """The episode's score for Pass@k and the mean: ``None`` (left out) when it has none, and when a policy
    server failed it (an outage says nothing of the policy's answers)."""
    return None if policy_error_code(record) else record.get("correct")


def questions(records: list[dict], ks: list[int], gold: dict | None = None) -> dict:
    """Per ``(arm, question)``: the episodes' outcomes, the question's Pass@k and, where ``gold`` (question id ->
    the row's gold call list) has its calls, the free-running tool metrics (:mod:`eogym_sft.evaluation.tool_report`).

    A sample whose score is ``None`` (no ``gt_answer``, a failed judge request, a failed policy-server call) is
    left out of ``n``; Pass@k needs ``n >= k`` scored samples and is ``None`` otherwise."""
    grouped = defaultdict(list)
    for r in records:
        grouped[(r["arm"], r["source_id"])].append(r)
    out = {}
    for key, eps in grouped.items():
        scored = [episode_score(e) for e in eps if episode_score(e) is not None]
        ran = [e for e in eps if not policy_error_code(e)]  # an outage is no choice of whether to call tools
        n, c = len(scored), sum(scored)
        out[key] = {
            "n": n,
            "correct": c,
            **{f"pass@{k}": pass_at_k(n, c, k) if n >= k else None for k in ks},
            "tool_any": sum(e["tool_calls"] > 0 for e in ran) / len(ran) if ran else None,
            **{f: eps[0].get(f) or "" for f in GROUP_FIELDS},
            **question_tool_scores(ran, (gold or {}).get(key[1])),
        }
    return out


def episode_metrics(eps: list[dict], per_question: list[dict], ks: list[int]) -> dict:
    """Figures over a set of episodes and their questions (one arm, possibly one group)."""
    attempts = sum(e["tool_calls"] + e["tool_error_codes"].get("invalid_call", 0) for e in eps)
    scored = [episode_score(e) for e in eps if episode_score(e) is not None]
    out = {
        "questions": len(per_question),
        "episodes": len(eps),
        "mean_score": sum(scored) / len(scored) if scored else None,
        "scored_episodes": len(scored),
    }
    for k in ks:
        values = [q[f"pass@{k}"] for q in per_question if q[f"pass@{k}"] is not None]
        out[f"pass@{k}"] = sum(values) / len(values) if values else None
        out[f"pass@{k}_questions"] = len(values)
    n = max(len(eps), 1)
    out.update(
        {
            "answered": sum(e["final_answer"] is not None for e in eps) / n,
            "tool_any": sum(e["tool_calls"] > 0 for e in eps) / n,
            "tool_error_rate": sum(e["tool_errors"] for e in eps) / attempts if attempts else None,
            "calls_per_episode": sum(e["tool_calls"] for e in eps) / n,
            "skipped_calls": sum(e.get("skipped_calls", 0) for e in eps),  # past the per-turn cap: not run
            "turns_per_episode": sum(e["turns"] for e in eps) / n,
            "new_tokens_per_episode": sum(e["new_tokens"] for e in eps) / n,
            "stop_reasons": dict(sorted(Counter(e["stop_reason"] for e in eps).items())),
            "tool_error_codes": dict(sorted(sum((Counter(e["tool_error_codes"]) for e in eps), Counter()).items())),
            "judge_failed": sum(1 for e in eps if e.get("judge_error")),
            "policy_errors": dict(sorted(Counter(c for c in map(policy_error_code, eps) if c).items())),
            **tool_figures(per_question),
        }
    )
    return out


def paired_arms(per_q: dict, arms: list[str], ks: list[int]) -> list[dict]:
    """Every later arm against every earlier one on the questions both scored: Pass@k, tool-any and the
    free-running tool metrics, with the SE and 95% CI of :func:`eogym_sft.metrics.scoring.paired_stats`
    (questions are the units), and the category F1s (:func:`eogym_sft.evaluation.tool_report.paired_f1`)."""
    mine = {arm: {q: v for (a, q), v in per_q.items() if a == arm} for arm in arms}
    metrics = [f"pass@{k}" for k in ks] + ["tool_any", *FREE_RUNNING_METRICS]
    pairs = list(combinations(arms, 2))
    return [p for a, b in pairs
            for p in paired_units(a, b, mine[a], mine[b], metrics) + paired_f1(a, b, mine[a], mine[b])]


def summarize_rollouts(
    records: list[dict], arms: list[str], ks: list[int], settings: dict, counts: dict, timing: dict,
    gold: dict | None = None
) -> dict:
    """``summary.json`` of a closed-loop run; ``gold`` maps a question id to its row's gold calls (``None``: none)."""
    per_q = questions(records, ks, gold)
    per_arm = {}
    for arm in arms:
        eps = [r for r in records if r["arm"] == arm]
        qs = [v for (a, _), v in per_q.items() if a == arm]
        entry = {"overall": episode_metrics(eps, qs, ks), "timing": timing.get(arm, {})}
        for field in GROUP_FIELDS:
            qs_by_group = by_group(qs, field)
            entry[f"by_{field}"] = {
                g: episode_metrics(members, qs_by_group.get(g, []), ks) for g, members in by_group(eps, field).items()
            }
        per_arm[arm] = entry
    return {"settings": settings, "counts": counts, "arms": per_arm, "paired": paired_arms(per_q, arms, ks)}


def _episode_row(name: str, figures: dict | None) -> tuple[str, list[int], dict] | None:
    return None if figures is None else (name, [figures["questions"], figures["episodes"]], figures)


def _policy_errors(counts: dict) -> str:
    by_code = counts.get("policy_errors_by_code") or {}
    if not by_code:
        return ""
    codes = ", ".join(f"{code} {n}" for code, n in by_code.items())
    return f", policy errors {sum(by_code.values())}: {codes}; left out of Pass@k"


def format_rollout_report(summary: dict) -> str:
    """The printed tables: overall, per ``EO_task`` and ``question_type``, stop reasons, paired deltas."""
    ks, arms, counts = summary["settings"]["ks"], summary["arms"], summary["counts"]
    lines = [
        f"questions {counts['questions']} (rows failed {counts['rows_failed']}), samples per question "
        f"{summary['settings']['samples']}, episodes {counts['episodes']} (errors {counts['episode_errors']}, "
        f"judge failures {counts['judge_failed']}{_policy_errors(counts)})",
        "",
    ]
    metrics = [f"pass@{k}" for k in ks] + list(EPISODE_METRICS)
    lines += arm_tables(arms, [("quest.", 6), ("eps", 5)], metrics, _episode_row)
    lines += ["", "stop reasons"]
    for name, a in arms.items():
        reasons = ", ".join(f"{r} {n}" for r, n in a["overall"]["stop_reasons"].items())
        lines.append(f"  {name}: {reasons}")
    for name, a in arms.items():
        t = a.get("timing") or {}
        if t:
            lines.append(f"  {name}: {t['episodes_per_min']:.1f} episodes/min, {t['new_tokens_per_s']:.1f} generated "
                         "tokens/s")
    lines += _tool_lines(arms)
    if summary["paired"]:
        f1 = ("cat_f1 rows: F1 of the pooled calls; SE and CI by the jackknife over questions",)
        notes = f1 if any(p["metric"].startswith("cat_f1") for p in summary["paired"]) else ()
        lines += ["", *paired_table(summary["paired"], notes=notes)]
    return "\n".join(lines)


def _tool_row(name: str, figures: dict | None) -> tuple[str, list[int], dict] | None:
    if figures is None or not figures.get("questions_with_gold"):
        return None
    return name, [figures["questions_with_gold"], figures["efficiency_infinite"]], figures


def _tool_lines(arms: dict) -> list[str]:
    """The free-running tool metrics' tables, when some question had gold calls."""
    if not any(a["overall"].get("questions_with_gold") for a in arms.values()):
        return []
    lines = ["", "EO benchmark metrics, free running: mean over questions with gold calls "
                 "(docs/evaluation.md, section 17)"]
    rows = [r for r in (_tool_row(name, a["overall"]) for name, a in arms.items()) if r is not None]
    lines += table("overall", [("quest.", 6), ("eff=inf", 7)], list(EARTH_AGENT_COLUMNS), rows)
    lines += ["", *table("overall", [("quest.", 6)], list(OEA_COLUMNS), [(n, c[:1], f) for n, c, f in rows])]
    for key in ("cat_f1", "cat_f1_gta"):
        for name, a in arms.items():
            cells = ", ".join(f"{c} {'-' if v is None else f'{v:.3f}'}" for c, v in a["overall"][key].items())
            lines.append(f"  {key} {name}: {cells}")
    return lines
