"""The recipe as launched, timed step by step, beside arm B of ``bench/train_throughput.py``.

    accelerate launch --config_file recipes/accelerate/deepspeed_zero2.yaml --num_processes 1 bench/recipe_throughput.py \\
        --model /tmp/qwen3vl4b-random --dataset /tmp/bt/prepared --data-root /tmp/bt/sample/data \\
        --warmup 1 --steps 2 --baseline train_b32.json --json recipe.json

It runs ``recipes/eo_gym_4b.py`` (``parse_args`` with its YAML, then ``eogym_sft.training.sft.train``) (64 samples a step as 32 token-balanced
micro-batches of 2, regional compile, ZeRO-2 from the accelerate config it is launched with), changing
only: the model and data, ``max_steps`` (warm-up + timed steps), ``logging_steps 1`` (the trainer's
``num_tokens`` then gives each step's real tokens, one host sync a step), one evaluation after the last
step, and the output folder. Flags after ``--`` go to the recipe before these.

The trainer class is swapped for a subclass that only adds the bench's callbacks (as
tests/test_recipe.py does), so what runs is the recipe's own code path. Reported: real tokens/s after
warm-up, median step, time to the first step (from process start, and from ``train()``), the wait
before each step (the Trainer draws a whole step's micro-batches first), optimizer step, evaluation,
graphs Dynamo compiled and its recompiles with their reasons, peak memory. With ``--baseline`` (the JSON
of ``train_throughput.py``), arm B's figures are put beside these, with the ratio.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

PROCESS_START = time.perf_counter()
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as the recipe sets it

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from step_probe import (  # noqa: E402
    CacheBypassLog,
    RecompileLog,
    StepProbe,
    compile_caches,
    compile_phases,
)


def load_recipe():
    spec = importlib.util.spec_from_file_location("eo_gym_4b_recipe", REPO / "recipes" / "eo_gym_4b.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class TokenLog:
    """Trainer callback: the cumulative real tokens the trainer logs (``num_tokens``), step by step."""

    def __init__(self):
        self.num_tokens: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs and "num_tokens" in logs:
            self.num_tokens.append(float(logs["num_tokens"]))

    def __getattr__(self, name):
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)


class StopAfter:
    """Trainer callback: end training after optimizer step ``step`` (the run's ``save_steps`` puts a
    checkpoint there), so that a run longer than one call can be timed in resumed halves."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True

    def __getattr__(self, name):
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)


def recipe_argv(args, extra: list[str]) -> list[str]:
    """The recipe's flags: the caller's extra ones first, so that the bench's own (which decide what is
    timed) come last and win. ``--total-steps`` is the run's length when it is timed in halves (both
    halves must agree on it: it is part of what a resumed run is checked against)."""
    total = args.total_steps or args.warmup + args.steps
    save = args.stop_after or 10 * total
    return [
        *extra, "--model_name_or_path", args.model, "--dataset_path", args.dataset, "--data_root", args.data_root,
        "--max_steps", str(total), "--logging_steps", "1", "--eval_strategy", "steps", "--eval_steps", str(total),
        "--save_steps", str(save), "--output_dir", args.output_dir,
    ]


def run(args, extra: list[str]) -> dict:
    import eogym_sft.training.sft as sft

    recipe = load_recipe()
    probe, tokens = StepProbe(), TokenLog()
    made = []

    class ProbedTrainer(sft.EOGymSFTTrainer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.add_callback(probe)
            self.add_callback(tokens)
            if args.stop_after:
                self.add_callback(StopAfter(args.stop_after))
            made.append(self)

    argv = recipe_argv(args, extra)
    script_args, training_args, model_args = recipe.parse_args(argv)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    original, sft.EOGymSFTTrainer = sft.EOGymSFTTrainer, ProbedTrainer
    try:
        with RecompileLog() as recompiles, CacheBypassLog() as bypasses:
            sft.train(script_args, training_args, model_args)
    finally:
        sft.EOGymSFTTrainer = original
    trainer = made[0]
    per_step = [b - a for a, b in zip([0.0, *tokens.num_tokens], tokens.num_tokens)]
    timing = probe.summary(args.warmup)
    real = sum(per_step[args.warmup : args.warmup + args.steps])
    return {
        "recipe_flags": argv,
        "gpus": trainer.accelerator.num_processes,
        "distributed": str(trainer.accelerator.distributed_type),
        "micro_batches_per_step": training_args.gradient_accumulation_steps,
        "samples_per_step": training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps,
        "dataloader": {"workers": training_args.dataloader_num_workers, "prefetch_factor": training_args.dataloader_prefetch_factor},
        "pixel_dtype": str(trainer.data_collator.pixel_dtype),  # the collator's, from the model's dtype
        "real_tokens_per_step": per_step,
        "real_tokens_per_s": real / trainer.accelerator.num_processes / timing["timed_wall_s"],  # per GPU
        **timing,
        "step_s": [e - b for b, e in zip(probe.begins, probe.ends)],
        "wait_before_step_s": [probe.begins[0] - probe.train_start] + [b - e for b, e in zip(probe.begins[1:], probe.ends)],
        "optimizer_s": probe.optimizer_s,
        "setup_s": probe.train_start - PROCESS_START,  # imports, data, model load, LoRA, compile wrappers, DeepSpeed init
        "time_to_first_step_from_start_s": probe.ends[0] - PROCESS_START,
        "graphs_per_step": probe.graphs,
        "recompiles": len(recompiles.messages),
        "recompile_reasons": recompiles.reasons(),
        "compile_phases_s": compile_phases(),
        "compile_caches": compile_caches(),
        "cache_bypass_reasons": sorted(set(bypasses.reasons)),
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if torch.cuda.is_available() else 0.0,
    }


def side_by_side(recipe: dict, baseline_path: str | None, arm: str = "B") -> dict | None:
    """Arm B of a ``train_throughput.py`` JSON next to the recipe's figures."""
    if not baseline_path:
        return None
    results = json.loads(Path(baseline_path).read_text())["results"]
    b = next((r for r in results if r["arm"] == arm and "error" not in r), None)
    if b is None:
        return {"error": f"no arm {arm} in {baseline_path}"}
    keys = ("real_tokens_per_s", "median_step_s", "time_to_first_step_s", "dataloader_wait_fraction", "median_optimizer_s",
            "graphs_compiled_first_step", "recompiles", "peak_allocated_gib", "micro_batches_per_step")
    return {
        "arm": arm,
        **{f"{arm}_{k}": b.get(k) for k in keys},
        "recipe_vs_B_tokens_per_s": recipe["real_tokens_per_s"] / b["real_tokens_per_s"],
    }


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="model folder (e.g. from `eogym-sft tiny-model --config ...`)")
    parser.add_argument("--dataset", required=True, help="prepared folder or EO-Gym JSONL, as the recipe's --dataset_path")
    parser.add_argument("--data-root", required=True)
    parser.add_argument("--warmup", type=int, default=1, help="optimizer steps not timed (compilation happens here)")
    parser.add_argument("--steps", type=int, default=2, help="timed optimizer steps of 64 samples")
    parser.add_argument("--total-steps", type=int, default=None, help="the run's max_steps (default: warmup + steps)")
    parser.add_argument("--stop-after", type=int, default=None,
                        help="end after this optimizer step with a checkpoint; time the rest with `-- --resume_from_checkpoint last`")
    parser.add_argument("--output-dir", default="/tmp/recipe_bench")
    parser.add_argument("--baseline", default=None, help="train_throughput.py JSON with arm B, run in the same session")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(own)
    result = run(args, extra)
    report = {
        "date": dt.date.today().isoformat(),
        "command": " ".join(["bench/recipe_throughput.py", *argv]),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "versions": {m.__name__: m.__version__ for m in (torch, __import__("transformers"), __import__("trl"), __import__("peft"))},
        "recipe": result,
        "side_by_side": side_by_side(result, args.baseline),
    }
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({k: v for k, v in report.items() if k != "recipe"}, indent=1))
        print({k: result[k] for k in ("real_tokens_per_s", "median_step_s", "time_to_first_step_s", "dataloader_wait_fraction", "recompiles")})
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
