"""The agent demo's argument figures: how close each arm's tool calls come to the gold calls on the held-out
questions, closed loop (``param_prefix``, ``param_prefix_aoi@0.5`` of the held-out rollouts) and teacher-forced
(``arg_acc_aoi@0.5`` of an ``eogym-sft evaluate`` of the same questions), so that GRPO's effect on the crop box
shows beside its effect on the answer. ``docs/evaluation.md``, section 17, defines them.
"""

from __future__ import annotations

from pathlib import Path

# closed loop, closed loop, teacher-forced
ARGUMENT_FIELDS = ("param_prefix", "param_prefix_aoi@0.5", "arg_acc_aoi@0.5")


def teacher_forced(cfg, model_dir: Path, data: Path, data_root: Path, adapters: list[str], output: Path,
                   overwrite: bool) -> dict:
    """The summary of ``eogym-sft evaluate`` of the demo's arms on ``data``'s gold traces: greedy, every turn's
    prompt the gold history, every turn of every question decoded side by side."""
    from .evaluation.offline import EvalConfig, evaluate

    return evaluate(
        EvalConfig(
            model=str(model_dir), data=[str(data)], output=str(output), adapters=adapters, data_root=str(data_root),
            include_base=cfg.held_out_base, max_new_tokens=cfg.max_new_tokens,
            batch_size=cfg.held_out_rows * cfg.max_turns,
            max_pixels=cfg.max_pixels, min_pixels=cfg.min_pixels, device=cfg.device, dtype="float32",
            overwrite=overwrite,
        ),
        progress=False,
    )


def argument_figures(arm: str, rollout_overall: dict, forced: dict | None) -> dict:
    """One arm's :data:`ARGUMENT_FIELDS`: the rollout's two, and ``arg_acc_aoi@0.5`` from the teacher-forced
    summary ``forced`` (``None`` where it has no such arm or no call steps)."""
    steps = ((forced or {}).get("arms", {}).get(arm) or {}).get("gold_history", {}).get("overall", {})
    return {
        "param_prefix": rollout_overall.get("param_prefix"),
        "param_prefix_aoi@0.5": rollout_overall.get("param_prefix_aoi@0.5"),
        "arg_acc_aoi@0.5": steps.get("arg_acc_aoi@0.5", {}).get("mean"),
    }


def argument_lines(arms: dict) -> list[str]:
    """The demo report's table of :data:`ARGUMENT_FIELDS`, one row per arm."""
    lines = ["  arguments against the gold calls (docs/evaluation.md, section 17):"]
    lines.append(f"  {'arm':<6}" + "".join(f"{f:>22}" for f in ARGUMENT_FIELDS))
    for name, a in arms.items():
        lines.append(
            "  "
            f"{name:<6}"
            + "".join(f"{a.get(f):>22.3f}" if a.get(f) is not None else f"{'-':>22}" for f in ARGUMENT_FIELDS)
        )
    return lines
