"""The agent demo's checkpoint pick: of a stage's saved checkpoints, the one whose closed-loop episodes on the
validation questions (a split of the training questions, trained on by no stage and never the held-out ones)
score the best Pass@1 goes on.

Why: at the GPU study's settings SFT's constant LR (5e-3) lets the call format break and recover between
checkpoints, so the last step can be one where the adapter writes malformed AOIs (docs/agent.md); the held-out
rollouts would then measure that moment, and GRPO's gain would be mostly repairing it.
"""

from __future__ import annotations

from pathlib import Path


def checkpoint_step(path: Path) -> int:
    return int(path.name.split("-")[1])


def checkpoints(run_dir: str | Path) -> list[Path]:
    """``run_dir``'s ``checkpoint-N`` folders, by step."""
    found = sorted(Path(run_dir).glob("checkpoint-*"), key=checkpoint_step)
    if not found:
        raise FileNotFoundError(f"no checkpoint-* under {run_dir}: the stage saved no checkpoint to pick from")
    return found


def best_step(scores: dict[int, float]) -> int:
    """The step with the best score; a tie goes to the later step (more trained)."""
    return max(scores, key=lambda step: (scores[step], step))


def pick_checkpoint(run_dir: str | Path, score_arms, start: str | Path | None = None) -> tuple[Path, dict]:
    """The checkpoint under ``run_dir`` with the best validation Pass@1, and ``{"step": picked, "pass@1": {step:
    score}}``. ``score_arms(arms, name)`` rolls the ``NAME=DIR`` arms out on the validation questions (into a
    folder named ``name``) and returns the rollout's summary. ``start`` (the adapter the stage began from) is
    step 0's candidate: early stopping may stop before the first step."""
    found = ({0: Path(start)} if start is not None else {}) | {checkpoint_step(c): c for c in checkpoints(run_dir)}
    summary = score_arms([f"step{step}={path}" for step, path in found.items()], f"validation_{Path(run_dir).name}")
    scores = {step: summary["arms"][f"step{step}"]["overall"]["pass@1"] for step in found}
    step = best_step(scores)
    steps = ", ".join(f"{s} {v:.3f}" for s, v in scores.items())
    print(f"[agent demo] {Path(run_dir).name}: validation Pass@1 by step {steps}: step {step} goes on", flush=True)
    return found[step], {"step": step, "pass@1": scores}
