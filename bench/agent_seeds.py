"""GRPO after SFT on the agent demo's task, several seeds side by side: the per-seed table of held-out Pass@1.

Each seed runs ``eogym_sft.demo.run_agent_demo`` in its own process (they share one GPU: the demo's model is
small, so five seeds at once take about as long as one), then the table lists per seed SFT's and GRPO's
held-out Pass@1, GRPO - SFT with its paired 95% CI, the training reward by part of the run and the policy's
entropy. ``--set name=value`` overrides an ``AgentDemoConfig`` field for every seed (JSON values).

    python bench/agent_seeds.py --seeds 0 1 2 3 4 --device cuda --workdir /tmp/seeds --json agent_seeds.json \\
        --set train_rows=384 held_out_rows=128 samples=4 sft_steps=60 grpo_steps=120 rft_steps=0
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eval_throughput import machine_info  # noqa: E402

from eogym_sft.demo import grpo_per_step, reward_by_part  # noqa: E402

RUN_ONE = """
import json, sys
from eogym_sft.demo import AgentDemoConfig, run_agent_demo
settings = json.loads(sys.argv[1])
run_agent_demo(sys.argv[2], overwrite=True, cfg=AgentDemoConfig(**settings))
"""


def parse_settings(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        try:
            out[name] = json.loads(value)
        except json.JSONDecodeError:
            out[name] = value  # a bare string, e.g. task=colour_grid
    return out


def child_env(parallel: int, env: dict | None = None, cpus: int | None = None) -> dict:
    """The environment of each seed's process: ``OMP_NUM_THREADS`` (unless set) shares the host's cores between the
    seeds running at once. Each torch process otherwise starts a thread per core: ten seeds on 16 cores then took
    38 s for each SFT step, against 20.6 s for all 60 with one thread each (one H200, 2026-12-02)."""
    env = dict(os.environ if env is None else env)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (cpus or os.cpu_count() or 1) // max(1, parallel))))
    return env


def run_seeds(seeds: list[int], settings: dict, workdir: Path, parallel: int, on_done=lambda reports: None) -> dict[int, dict]:
    """Run every seed (``parallel`` at a time) and return ``{seed: agent_report}``; a failed seed is reported
    with its log's tail and left out. ``on_done(reports)`` runs after each seed ends (the partial JSON)."""
    workdir.mkdir(parents=True, exist_ok=True)
    pending, running, reports = list(seeds), {}, {}
    while pending or running:
        while pending and len(running) < parallel:
            seed = pending.pop(0)
            out = workdir / f"seed{seed}"
            log = open(workdir / f"seed{seed}.log", "w")
            cmd = [sys.executable, "-c", RUN_ONE, json.dumps(settings | {"seed": seed}), str(out)]
            running[seed] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(parallel)), log, time.time())
        for seed, (proc, log, start) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            del running[seed]
            report = workdir / f"seed{seed}" / "agent_report.json"
            if report.is_file():  # written before the demo's viewer page: a failure there loses no figure
                entropy = grpo_per_step(workdir / f"seed{seed}" / "grpo", "entropy") if (workdir / f"seed{seed}" / "grpo").is_dir() else []
                reports[seed] = json.loads(report.read_text()) | {"wall_s": round(time.time() - start, 1), "grpo_entropy_per_step": entropy}
            else:
                tail = (workdir / f"seed{seed}.log").read_text().splitlines()[-15:]
                print(f"seed {seed}: exit {proc.returncode}\n  " + "\n  ".join(tail), file=sys.stderr)
            on_done(reports)
        time.sleep(1)
    return reports


def by_part(values: list[float]) -> list[float]:
    """The demo's means over four parts of the steps; the values themselves when a part would average too few."""
    return reward_by_part(values) or list(values)


def seed_row(seed: int, report: dict, a: str = "sft", b: str = "grpo") -> dict:
    """One seed's line: both arms' Pass@1, the paired delta and its CI, reward and entropy by part."""
    paired = next((p for p in report["paired"] if p["a"] == a and p["b"] == b and p["metric"] == "pass@1"), None)
    return {
        "seed": seed,
        a: report["arms"][a]["pass@1"],
        b: report["arms"].get(b, {}).get("pass@1"),
        "delta": paired["delta"] if paired else None,
        "ci95": paired["ci95"] if paired else None,
        "ci_method": paired["ci_method"] if paired else None,
        "reward_by_part": by_part(report["grpo_reward_per_step"]),
        "entropy_by_part": by_part(report["grpo_entropy_per_step"]),
        "wall_s": report["wall_s"],
    }


def format_table(rows: list[dict]) -> str:
    lines = ["seed   SFT   GRPO  GRPO-SFT  95% CI              reward by part            entropy by part"]
    for r in rows:
        ci = f"[{r['ci95'][0]:+.3f}, {r['ci95'][1]:+.3f}]" if r["ci95"] else "-"
        parts = " ".join(f"{v:.2f}" for v in r["reward_by_part"] or [])
        ent = " ".join(f"{v:.2f}" for v in r["entropy_by_part"] or [])
        grpo = f"{r['grpo']:.3f}" if r["grpo"] is not None else "-"
        delta = f"{r['delta']:+.3f}" if r["delta"] is not None else "-"
        lines.append(f"{r['seed']:>4} {r['sft']:.3f} {grpo:>6} {delta:>9}  {ci:<18}  {parts:<24}  {ent}")
    deltas = [r["delta"] for r in rows if r["delta"] is not None]
    if deltas:
        above = sum(1 for r in rows if r["ci95"] and r["ci95"][0] > 0)
        lines.append(f"mean GRPO-SFT {sum(deltas) / len(deltas):+.3f} over {len(deltas)} seeds; GRPO >= SFT in "
                     f"{sum(d >= 0 for d in deltas)}; CI lower bound > 0 in {above}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--parallel", type=int, default=5, help="seeds run at once")
    parser.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE", help="AgentDemoConfig fields for every seed")
    parser.add_argument("--workdir", default="/tmp/agent_seeds")
    parser.add_argument("--json", default="agent_seeds.json")
    args = parser.parse_args(argv)
    import torch

    settings = parse_settings(args.set) | {"device": args.device}
    machine = machine_info(torch.device(args.device))

    def write(reports: dict) -> dict:
        rows = [seed_row(seed, reports[seed]) for seed in args.seeds if seed in reports]
        result = {"settings": settings, "seeds": rows, "reports": reports, "machine": machine}
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        return result

    result = write(run_seeds(args.seeds, settings, Path(args.workdir), args.parallel, write))
    print(format_table(result["seeds"]))
    return result


if __name__ == "__main__":
    main()
