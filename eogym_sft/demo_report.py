"""The agent demo's report (``agent_report.json`` and its table): per arm the held-out rollout's figures and the
argument figures (:mod:`eogym_sft.demo_arguments`), the paired deltas, GRPO's training reward per step and by
quarter, the rejection-sampling counts and each stage's seconds.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from itertools import pairwise
from pathlib import Path
from statistics import mean, variance

from .demo_arguments import argument_figures, argument_lines
from .metrics.scoring import t_quantile_975


def grpo_per_step(grpo_dir: str | Path, key: str = "reward") -> list[float]:
    """``key`` of each GRPO step (the mean training reward by default), from the last checkpoint's
    ``trainer_state.json``. TRL logs the reward (and the rollout metrics) only on steps that generate: with
    ``num_iterations`` N, one value every N steps."""
    states = sorted(Path(grpo_dir).glob("checkpoint-*/trainer_state.json"),
                    key=lambda p: int(p.parent.name.split("-")[1]))
    if not states:
        raise FileNotFoundError(f"no checkpoint-*/trainer_state.json under {grpo_dir}: the GRPO run saved no state")
    history = json.loads(states[-1].read_text())["log_history"]
    return [h[key] for h in history if key in h]


# one step's reward is one group's: a quarter's mean over fewer steps follows the questions drawn
MIN_STEPS_PER_QUARTER = 5


def reward_by_part(rewards: list[float], parts: int = 4, min_steps: int = MIN_STEPS_PER_QUARTER) -> list[float] | None:
    """GRPO's training reward averaged over ``parts`` consecutive runs of steps (the last takes the remainder),
    to show whether the policy's reward rises; None when a part would hold fewer than ``min_steps`` steps
    (the per-step rewards are then the curve)."""
    if len(rewards) < parts * min_steps:
        return None
    size = len(rewards) // parts
    bounds = [k * size for k in range(parts)] + [len(rewards)]
    return [sum(rewards[a:b]) / (b - a) for a, b in pairwise(bounds)]


def late_reward_change(rewards: list[float], parts: int = 4, min_steps: int = MIN_STEPS_PER_QUARTER) -> dict | None:
    """The last part's mean training reward minus the one before it (parts as :func:`reward_by_part` cuts them),
    with a 95% CI by Welch's t over the two parts' per-step rewards: ``{"delta", "ci95"}``, None where
    :func:`reward_by_part` is None. Why a CI: one step's reward is one group's, so the two parts of a run at a
    plateau differ by the questions they drew, and a fade is a difference beyond that."""
    if len(rewards) < parts * min_steps:
        return None
    size = len(rewards) // parts
    before, last = rewards[(parts - 2) * size:(parts - 1) * size], rewards[(parts - 1) * size:]
    delta = mean(last) - mean(before)
    var_b, var_l = variance(before) / len(before), variance(last) / len(last)  # each mean's squared SE
    if var_b + var_l == 0:
        return {"delta": delta, "ci95": [delta, delta]}
    df = (var_b + var_l) ** 2 / (var_b**2 / (len(before) - 1) + var_l**2 / (len(last) - 1))
    half = t_quantile_975(max(1, int(df))) * math.sqrt(var_b + var_l)
    return {"delta": delta, "ci95": [delta - half, delta + half]}


ARM_FIELDS = ("pass@1", "mean_score", "tool_any", "calls_per_episode", "answered", "questions", "episodes",
              "stop_reasons")


def agent_report(summary: dict, rewards: list[float], rft: dict | None, seconds: dict, cfg,
                 forced: dict | None = None) -> dict:
    """``agent_report.json`` of a run with ``cfg`` (:class:`~eogym_sft.demo.AgentDemoConfig`): per arm the rollout's
    overall and argument figures (``forced``: the teacher-forced summary),
    the paired deltas over held-out questions, GRPO's reward per step, the rejection-sampling counts and stage
    seconds."""
    k, arms = cfg.samples, {}
    for name, entry in summary["arms"].items():
        overall = entry["overall"]
        arms[name] = ({f: overall.get(f) for f in ARM_FIELDS} | {f"pass@{k}": overall.get(f"pass@{k}")}
                      | argument_figures(name, overall, forced))
    return {
        "arms": arms,
        "paired": summary["paired"],
        "grpo_reward_per_step": rewards,
        "grpo_reward_by_quarter": reward_by_part(rewards),
        "rejection_sampling": rft,
        "seconds": seconds | {"total": round(sum(seconds.values()), 1)},
        "settings": asdict(cfg),
    }


def format_agent_report(report: dict, output: Path) -> str:
    """The table (arm, Pass@1, Pass@k, mean score, tool_any, calls/episode) and paired deltas with 95% CIs."""
    k = report["settings"]["samples"]
    lines = ["", f"agent demo: held-out questions, {k} episodes each (never trained on)",
             f"  {'arm':<6}{'Pass@1':>8}{f'Pass@{k}':>8}{'score':>8}{'tool_any':>10}{'calls/ep':>10}"]
    for name, a in report["arms"].items():
        cells = [a["pass@1"], a[f"pass@{k}"], a["mean_score"], a["tool_any"], a["calls_per_episode"]]
        lines.append(f"  {name:<6}" + "".join(f"{v:>{w}.3f}" if v is not None else f"{'-':>{w}}"
                                              for v, w in zip(cells, (8, 8, 8, 10, 10))))
    methods = sorted({p["ci_method"] for p in report["paired"]})
    lines += [*argument_lines(report["arms"]), f"  paired over questions (B - A, 95% CI, {', '.join(methods)}):"]
    for p in report["paired"]:
        if p["metric"] in ("pass@1", "tool_any"):
            ci = p["ci95"]
            ci_text = f"[{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else "(n < 2)"
            lines.append(f"    {p['b']:>4} - {p['a']:<4} {p['metric']:<8} {p['delta']:+.3f} {ci_text}  n={p['n']}")
    rewards = report["grpo_reward_per_step"]
    if rewards:
        passes = report["settings"].get("grpo_num_iterations", 1)  # TRL logs a reward where it generated
        per = "per step" if passes == 1 else f"per generated batch (every {passes} steps)"
        lines.append(f"  GRPO training reward {per}: " + " ".join(f"{r:.2f}" for r in rewards))
        if report["grpo_reward_by_quarter"] is not None:
            lines.append("  GRPO training reward by quarter of its steps: "
                         + " ".join(f"{r:.3f}" for r in report["grpo_reward_by_quarter"]))
    if report["rejection_sampling"]:
        r = report["rejection_sampling"]
        lines.append(f"  rejection sampling: kept {r['episodes_kept']} correct of {r['episodes_sampled']} SFT "
                     "episodes on training questions"
                     + ("" if r["episodes_kept"] else " (nothing to train on: no rft arm)"))
    lines.append("  seconds: " + ", ".join(f"{s} {v}" for s, v in report["seconds"].items()))
    lines.append(f"report: {output / 'agent_report.json'}   episodes: {output / 'rollout' / 'episodes.jsonl'}")
    return "\n".join(lines)
