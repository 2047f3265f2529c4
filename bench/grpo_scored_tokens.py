"""GRPO's loss forward scoring only the model's own tokens against scoring every completion token (tool results
and their crops too, as before 40da0b3), on the agent demo's GRPO stage, the arms alternating.

    eogym-sft demo --agent --output /tmp/agdemo          # once: the task, the model and the SFT adapter
    python bench/grpo_scored_tokens.py --demo /tmp/agdemo --repeats 2 --json /tmp/scored.json

Each arm is the demo's own GRPO stage (``AgentDemoConfig`` defaults: 6 steps of 1 question x 8 episodes) from the
demo's SFT adapter; reported per run: wall time, the trainer's ``step_time`` per step and the reward per step
(equal in both arms when the two forwards give the loss the same numbers).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def run_arm(demo: Path, arm: str, output: Path) -> dict:
    from eogym_sft.demo import AgentDemoConfig, _grpo_configs, grpo_per_step
    from eogym_sft.training import grpo, grpo_slots

    original = grpo_slots.loss_token_mask
    if arm == "every-token":
        grpo_slots.loss_token_mask = lambda inputs: None
    try:
        args = _grpo_configs(AgentDemoConfig(), demo / "small-qwen3-vl", demo / "task" / "train.jsonl", demo / "task",
                             str(demo / "sft" / "adapter"), output, overwrite=True)
        start = time.perf_counter()
        out = grpo.train(*args)
        wall = time.perf_counter() - start
    finally:
        grpo_slots.loss_token_mask = original
    return {"arm": arm, "wall_s": round(wall, 1), "step_time": grpo_per_step(out, "step_time"), "reward": grpo_per_step(out)}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--demo", required=True, help="the output folder of `eogym-sft demo --agent`")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workdir", default="/tmp/grpo_scored_tokens")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    runs = []
    for k in range(args.repeats):
        for arm in ("model-tokens", "every-token"):
            runs.append(run_arm(Path(args.demo), arm, Path(args.workdir) / f"{arm}_{k}"))
            r = runs[-1]
            print(f"{arm:<13} wall {r['wall_s']:6.1f} s  step {min(r['step_time']):.2f}-{max(r['step_time']):.2f} s  reward {r['reward']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1) + "\n")
    return runs


if __name__ == "__main__":
    main()
