"""GRPO step time: the recipe's trainer (``recipes/eo_gym_4b_grpo.yaml``) for a few optimizer steps, with
the time per step, the share of it spent in ``generate``, and peak GPU memory.

Commands (from the repository root)::

    # CPU smoke run on the tiny model
    eogym-sft tiny-model --output /tmp/tiny && PYTHONPATH=. python bench/grpo_step.py --model /tmp/tiny --rows 4 \
        --steps 1 --warmup 0 --num-generations 2 --batch 2 --grad-accum 1 --max-completion-length 16 --max-pixels 16384

    # the Qwen3-VL-4B architecture with random weights on one GPU (bench/h200_session.sh grpo)
    PYTHONPATH=. python bench/grpo_step.py --model /tmp/qwen3vl4b-random --rows 16 --steps 2 --warmup 1 --num-generations 8 \
        --batch 8 --grad-accum 1 --max-completion-length 256 --workdir /tmp/grpo_bench --json grpo_1gpu.json

What it does: (a) writes the EO-Gym-shaped sample of ``bench/prep_throughput.py`` (or takes ``--data``);
(b) reads the recipe's YAML with the flags here as overrides; (c) loads the model, adds a new LoRA
adapter as the recipe does, and builds the trainer with :func:`eogym_sft.training.grpo.build_trainer`; (d) runs
``--warmup`` + ``--steps`` optimizer steps and times each, and the ``generate`` calls inside it (the
model's own ``generate``, wrapped), after a CUDA synchronize.

Random weights rarely close a turn or write a tool call, so episodes are one turn of
``--max-completion-length`` tokens: generation is at its longest and no tool runs. The JSON records the
mean completion length and tool calls per episode next to the times, so the figures can be read right.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from eogym_sft.config import ImageConfig

REPO = Path(__file__).resolve().parents[1]


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class StepClock(TrainerCallback):
    """Wall time of each optimizer step and of the ``generate`` calls made during it."""

    def __init__(self):
        self.steps: list[dict] = []
        self.generate_s = 0.0
        self._start = None

    def wrap(self, generate):
        def timed_generate(*args, **kwargs):
            _sync()
            start = time.perf_counter()
            out = generate(*args, **kwargs)
            _sync()
            self.generate_s += time.perf_counter() - start
            return out

        return timed_generate

    def on_train_begin(self, args, state, control, **kwargs):
        _sync()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        _sync()
        now = time.perf_counter()
        self.steps.append({"step_s": now - self._start, "generate_s": self.generate_s})
        if torch.cuda.is_available():
            self.steps[-1]["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
            self.steps[-1]["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
            torch.cuda.reset_peak_memory_stats()
        print(f"step {state.global_step}: " + json.dumps(self.steps[-1]), flush=True)  # survives a time limit
        self._start, self.generate_s = now, 0.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", help="EO-Gym JSONL (default: the synthetic sample, --rows rows)")
    p.add_argument("--data-root")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed optimizer steps first")
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--batch", type=int, default=8, help="per_device_train_batch_size")
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--max-completion-length", type=int, default=1024)
    p.add_argument("--max-pixels", type=int, default=ImageConfig.max_pixels)
    p.add_argument("--gradient-checkpointing", choices=("true", "false"), default="true")
    p.add_argument("--workdir", default=None)
    p.add_argument("--json", help="write the results here")
    return p.parse_args(argv)


def recipe_settings(args, data: str, data_root: str, output_dir: str):
    """The recipe's YAML parsed with TrlParser, as ``recipes/eo_gym_4b_grpo.py`` does, plus these overrides."""
    from trl import GRPOConfig, ModelConfig, TrlParser

    from eogym_sft.training.grpo import GRPOScriptArguments

    cpu = not torch.cuda.is_available()
    argv = [
        "--config", str(REPO / "recipes" / "eo_gym_4b_grpo.yaml"), "--model_name_or_path", args.model,
        "--dataset_path", data, "--data_root", data_root, "--output_dir", output_dir,
        "--max_steps", str(args.warmup + args.steps), "--num_generations", str(args.num_generations),
        "--per_device_train_batch_size", str(args.batch), "--gradient_accumulation_steps", str(args.grad_accum),
        "--max_completion_length", str(args.max_completion_length), "--max_pixels", str(args.max_pixels),
        "--gradient_checkpointing", args.gradient_checkpointing, "--save_strategy", "no",
        "--use_cpu", str(cpu).lower(), "--bf16", str(not cpu).lower(), "--dtype", "float32" if cpu else "bfloat16",
    ]
    return TrlParser((GRPOScriptArguments, GRPOConfig, ModelConfig)).parse_args_and_config(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="grpo_bench_"))
    if args.data:
        data, data_root = args.data, args.data_root
    else:
        sys.path.insert(0, str(REPO / "bench"))
        from prep_throughput import generate_sample

        data, data_root = (str(p) for p in generate_sample(workdir / "sample", rows=args.rows, seed=0))

    from eogym_sft.models.loading import apply_lora, load_base_model
    from eogym_sft.models.processor import load_processor
    from eogym_sft.training.grpo import build_trainer, load_episodes

    script, training, model_args = recipe_settings(args, data, data_root, str(workdir / "run"))
    processor = load_processor(args.model, script.max_pixels, script.min_pixels)
    episodes = load_episodes(data, data_root)
    model = load_base_model(args.model, model_args.dtype, model_args.attn_implementation)
    model = apply_lora(model, model_args.lora_r, model_args.lora_alpha, model_args.lora_dropout, model_args.lora_target_modules)
    if torch.cuda.is_available():
        model.to("cuda")
    clock = StepClock()
    model.generate = clock.wrap(model.generate)
    trainer = build_trainer(model, processor, episodes, script, training)
    trainer.add_callback(clock)
    trainer.train()

    timed = clock.steps[args.warmup :]
    logs = [h for h in trainer.state.log_history if "step_time" in h][args.warmup :]
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    result = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "versions": {m.__name__: m.__version__ for m in map(__import__, ("torch", "transformers", "trl", "peft"))},
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "workdir")},
        "episodes_per_step": args.batch * args.grad_accum,
        "steps": timed,
        "step_s": mean([s["step_s"] for s in timed]),
        "generate_share": mean([s["generate_s"] / s["step_s"] for s in timed]),
        "peak_allocated_gib": max((s["peak_allocated_gib"] for s in timed if "peak_allocated_gib" in s), default=None),
        "peak_reserved_gib": max((s["peak_reserved_gib"] for s in timed if "peak_reserved_gib" in s), default=None),
        "completion_tokens_per_episode": mean([h["completions/mean_length"] for h in logs]),
        "tool_calls_per_episode": mean([h.get("tools/call_frequency", 0.0) for h in logs]),
        "episodes_skipped": episodes.stats()["skipped"],
    }
    print(json.dumps({k: v for k, v in result.items() if k != "steps"}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
