"""Probe (removed after its run; its figures are in bench/results/h200_agent.json): GRPO settings from fixed SFT
adapters on colour_grid, on one GPU, 6 variants at a time.

python bench/agent_sweep.py --out /tmp/sweep --json $OUT/sweep.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

SCALES = {  # name -> (train_rows, held_out_rows, samples)
    "demo": (96, 128, 4),
    "big": (384, 128, 4),
}
SFTS = [("demo", 100), ("demo", 60), ("big", 40), ("big", 80)]
VARIANTS = [  # (scale, sft_steps, grpo_steps, lr, questions, gens)
    ("demo", 100, 6, 1e-4, 1, 8), ("demo", 100, 12, 3e-4, 1, 8), ("demo", 100, 12, 1e-3, 1, 8), ("demo", 100, 12, 3e-4, 2, 4),
    ("demo", 100, 24, 3e-4, 1, 8), ("demo", 60, 12, 3e-4, 1, 8), ("demo", 60, 12, 1e-3, 1, 8), ("demo", 60, 24, 3e-4, 1, 8),
    ("big", 40, 60, 3e-4, 2, 8), ("big", 40, 60, 1e-3, 2, 8), ("big", 80, 60, 3e-4, 2, 8), ("big", 80, 60, 1e-4, 2, 8),
]


SMOKE = __import__("os").environ.get("SWEEP_SMOKE") == "1"  # a CPU check of the script itself
if SMOKE:
    SCALES = {"demo": (8, 4, 1), "big": (8, 4, 1)}
    SFTS = [("demo", 2)]
    VARIANTS = [("demo", 2, 1, 1e-4, 1, 2), ("demo", 2, 1, 1e-3, 1, 2)]


def cfg_for(scale, sft_steps, **kw):
    from eogym_sft.demo import AgentDemoConfig

    train, held, samples = SCALES[scale]
    return AgentDemoConfig(device="cpu" if SMOKE else "cuda", train_rows=train, held_out_rows=held, samples=samples, sft_steps=sft_steps, **kw)


def prepare(out: Path):
    from eogym_sft.demo import _sft_configs, save_agent_model
    from eogym_sft.environment.tasks import write_task
    from eogym_sft.training.sft import train

    for scale, (train_rows, held, _) in SCALES.items():
        root = out / scale / "task"
        write_task(root, train_rows, 0, start=0, name="train.jsonl")
        write_task(root, held, 0, start=train_rows, name="held_out.jsonl")
    cfg = cfg_for("demo", 100)
    save_agent_model(out / "model", cfg)
    for scale, steps in SFTS:
        t = time.perf_counter()
        root = out / scale / "task"
        path = train(*_sft_configs(cfg_for(scale, steps), out / "model", root / "train.jsonl", root, out / scale / f"sft{steps}", steps))
        print(f"sft {scale} {steps}: {path} {time.perf_counter() - t:.0f} s", flush=True)


def variant(out: Path, k: int):
    from eogym_sft.demo import _grpo_configs, _rollout, grpo_rewards
    from eogym_sft.training import grpo

    scale, sft_steps, steps, lr, q, g = VARIANTS[k]
    cfg = cfg_for(scale, sft_steps, grpo_steps=steps, grpo_learning_rate=lr, grpo_questions_per_step=q, num_generations=g, seed=k)
    root = out / scale / "task"
    sft = str(out / scale / f"sft{sft_steps}" / "adapter")
    t = time.perf_counter()
    gdir = grpo.train(*_grpo_configs(cfg, out / "model", root / "train.jsonl", root, sft, out / f"v{k}" / "grpo"))
    tg = time.perf_counter() - t
    summary = _rollout(cfg, out / "model", root / "held_out.jsonl", root, [f"sft={sft}", f"grpo={gdir}"], out / f"v{k}" / "rollout", cfg.samples, False)
    paired = [p for p in summary["paired"] if p["metric"] == "pass@1"]
    result = {"variant": VARIANTS[k], "rewards": grpo_rewards(gdir), "grpo_s": round(tg, 1),
              "pass@1": {a: e["overall"]["pass@1"] for a, e in summary["arms"].items()}, "paired": paired}
    (out / f"v{k}.json").write_text(json.dumps(result))
    print(json.dumps(result), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/sweep")
    ap.add_argument("--variant", type=int)
    ap.add_argument("--json")
    ap.add_argument("--parallel", type=int, default=6)
    a = ap.parse_args()
    out = Path(a.out)
    if a.variant is not None:
        return variant(out, a.variant)
    prepare(out)
    procs, results = [], []
    pending = list(range(len(VARIANTS)))
    while pending or procs:
        while pending and len(procs) < a.parallel:
            k = pending.pop(0)
            log = open(out / f"v{k}.log", "w")
            procs.append((k, subprocess.Popen([sys.executable, __file__, "--out", str(out), "--variant", str(k)], stdout=log, stderr=subprocess.STDOUT)))
        time.sleep(2)
        for k, p in list(procs):
            if p.poll() is not None:
                procs.remove((k, p))
                f = out / f"v{k}.json"
                results.append(json.loads(f.read_text()) if f.exists() else {"variant": VARIANTS[k], "error": p.returncode,
                                                                              "log": (out / f"v{k}.log").read_text()[-1500:]})
                print(json.dumps(results[-1])[:600], flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
