"""Closed-loop results: Pass@k per question, per arm, per ``EO_task`` and ``question_type``, paired
deltas between arms, and the printed tables. Pure functions over episode records; no model, no I/O.
``docs/evaluation.md`` defines every figure.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from math import comb

from .scoring import paired_stats

GROUP_FIELDS = ("EO_task", "question_type")


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


def questions(records: list[dict], ks: list[int]) -> dict:
    """Per ``(arm, question)``: the episodes' outcomes and the question's Pass@k.

    A sample whose score is ``None`` (no ``gt_answer``, a failed judge request) is left out of ``n``;
    Pass@k needs ``n >= k`` scored samples and is ``None`` otherwise."""
    grouped = defaultdict(list)
    for r in records:
        grouped[(r["arm"], r["source_id"])].append(r)
    out = {}
    for key, eps in grouped.items():
        scored = [e["correct"] for e in eps if e.get("correct") is not None]
        n, c = len(scored), sum(scored)
        out[key] = {
            "n": n,
            "correct": c,
            **{f"pass@{k}": pass_at_k(n, c, k) if n >= k else None for k in ks},
            "tool_any": sum(e["tool_calls"] > 0 for e in eps) / len(eps),
            **{f: eps[0].get(f) or "" for f in GROUP_FIELDS},
        }
    return out


def episode_metrics(eps: list[dict], per_question: list[dict], ks: list[int]) -> dict:
    """Figures over a set of episodes and their questions (one arm, possibly one group)."""
    attempts = sum(e["tool_calls"] + e["tool_error_codes"].get("invalid_call", 0) for e in eps)
    scored = [e["correct"] for e in eps if e.get("correct") is not None]
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
            "turns_per_episode": sum(e["turns"] for e in eps) / n,
            "new_tokens_per_episode": sum(e["new_tokens"] for e in eps) / n,
            "stop_reasons": dict(sorted(Counter(e["stop_reason"] for e in eps).items())),
            "tool_error_codes": dict(sorted(sum((Counter(e["tool_error_codes"]) for e in eps), Counter()).items())),
            "judge_failed": sum(1 for e in eps if e.get("judge_error")),
        }
    )
    return out


def paired_arms(per_q: dict, arms: list[str], ks: list[int]) -> list[dict]:
    """Every later arm against every earlier one on the questions both scored: Pass@k and tool-any deltas,
    with the SE and 95% CI of :func:`eogym_sft.scoring.paired_stats` (questions are the units)."""
    out = []
    for i, a in enumerate(arms):
        for b in arms[i + 1 :]:
            for metric in [f"pass@{k}" for k in ks] + ["tool_any"]:
                keys = sorted(
                    q for (arm, q) in per_q
                    if arm == a and (b, q) in per_q and per_q[(a, q)][metric] is not None and per_q[(b, q)][metric] is not None
                )
                if keys:
                    xs = [per_q[(a, q)][metric] for q in keys]
                    ys = [per_q[(b, q)][metric] for q in keys]
                    out.append({"a": a, "b": b, "metric": metric, **paired_stats(xs, ys)})
    return out


def summarize_rollouts(records: list[dict], arms: list[str], ks: list[int], settings: dict, counts: dict, timing: dict) -> dict:
    """``summary.json`` of a closed-loop run."""
    per_q = questions(records, ks)
    per_arm = {}
    for arm in arms:
        eps = [r for r in records if r["arm"] == arm]
        qs = [v for (a, _), v in per_q.items() if a == arm]
        entry = {"overall": episode_metrics(eps, qs, ks), "timing": timing.get(arm, {})}
        for field in GROUP_FIELDS:
            groups = sorted({r.get(field) or "" for r in eps})
            entry[f"by_{field}"] = {
                g or "(none)": episode_metrics([e for e in eps if (e.get(field) or "") == g], [q for q in qs if q[field] == g], ks)
                for g in groups
            }
        per_arm[arm] = entry
    return {"settings": settings, "counts": counts, "arms": per_arm, "paired": paired_arms(per_q, arms, ks)}


TABLE_METRICS = ("mean_score", "answered", "tool_any", "tool_error_rate", "calls_per_episode", "turns_per_episode")


def _cell(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _table(title: str, rows: list[tuple[str, dict]], ks: list[int]) -> list[str]:
    metrics = [f"pass@{k}" for k in ks] + list(TABLE_METRICS)
    width = max([len(title)] + [len(name) for name, _ in rows])
    lines = [f"{title:<{width}} {'quest.':>6} {'eps':>5} " + " ".join(f"{m:>{max(len(m), 6)}}" for m in metrics)]
    for name, m in rows:
        cells = " ".join(f"{_cell(m.get(x)):>{max(len(x), 6)}}" for x in metrics)
        lines.append(f"{name:<{width}} {m['questions']:>6} {m['episodes']:>5} {cells}")
    return lines


def paired_table(paired: list[dict], unit: str = "questions") -> list[str]:
    """The paired comparisons as text lines (SE = sd(diff)/sqrt(n); 95% CI = delta +/- 1.96 SE)."""
    lines = [
        f"paired, B - A on identical {unit}; SE = sd(diff)/sqrt(n); 95% CI, normal approx. = delta +/- 1.96 SE;",
        f"W/L/T = {unit} where B is better/worse/equal",
        f"{'A':<12} {'B':<12} {'metric':<22} {'n':>5} {'mean A':>7} {'mean B':>7} {'delta':>8} {'SE':>7} "
        f"{'95% CI, normal approx.':>22} {'W/L/T':>13}",
    ]
    for p in paired:
        ci = "-" if p["ci95_normal_approx"] is None else "[{:+.3f}, {:+.3f}]".format(*p["ci95_normal_approx"])
        se = "-" if p["se"] is None else f"{p['se']:.4f}"
        names = f"{p['a'][:12]:<12} {p['b'][:12]:<12} {p['metric'][:22]:<22} {p['n']:>5}"
        means = f"{p['mean_a']:>7.3f} {p['mean_b']:>7.3f} {p['delta']:>+8.3f}"
        lines.append(f"{names} {means} {se:>7} {ci:>22} {p['wins']:>4}/{p['losses']}/{p['ties']}")
    return lines


def format_rollout_report(summary: dict) -> str:
    """The printed tables: overall, per ``EO_task`` and ``question_type``, stop reasons, paired deltas."""
    ks, arms, counts = summary["settings"]["ks"], summary["arms"], summary["counts"]
    lines = [
        f"questions {counts['questions']} (rows failed {counts['rows_failed']}), samples per question "
        f"{summary['settings']['samples']}, episodes {counts['episodes']} (errors {counts['episode_errors']}, "
        f"judge failures {counts['judge_failed']})",
        "",
    ]
    lines += _table("overall", [(name, a["overall"]) for name, a in arms.items()], ks)
    for field in GROUP_FIELDS:
        groups = sorted({g for a in arms.values() for g in a[f"by_{field}"]})
        rows = [(f"{g} | {name}", a[f"by_{field}"][g]) for g in groups for name, a in arms.items() if g in a[f"by_{field}"]]
        lines += ["", *_table(f"by {field} | arm", rows, ks)]
    lines += ["", "stop reasons"]
    for name, a in arms.items():
        reasons = ", ".join(f"{r} {n}" for r, n in a["overall"]["stop_reasons"].items())
        lines.append(f"  {name}: {reasons}")
    for name, a in arms.items():
        t = a.get("timing") or {}
        if t:
            lines.append(f"  {name}: {t['episodes_per_min']:.1f} episodes/min, {t['new_tokens_per_s']:.1f} generated tokens/s")
    if summary["paired"]:
        lines += ["", *paired_table(summary["paired"])]
    return "\n".join(lines)
