"""Evaluation throughput: scored turns/s of ``eogym-sft evaluate`` for one model, per batch size, path and arm.

It plans every assistant turn of ``--data`` (or the sample of ``bench/common.py``) as ``evaluate`` does, loads the
model with one random rank-16 LoRA adapter (unless ``--no-lora-arm``), runs one warm-up batch, then times for each
batch size, path (``generate``: batched ``generate``; ``slots``: the slot decoder ``evaluate`` runs for greedy turns)
and arm the generation and :func:`score_turns` over all planned turns. Random weights never stop early, so the
figure is a floor.

    python bench/eval_throughput.py --model /tmp/qwen3vl4b --rows 32 --batch-size 8 32 --json bench_eval.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    add_random_lora, add_run_args, command, data_note, machine_info, machine_line, peak_gib, run_data, runs_table, scratch_dir, sync,
    write_result,
)

from eogym_sft.config import SampleConfig  # noqa: E402


def time_arm(model, processor, prompts, cfg, arm, device, path: str = "generate") -> dict:
    """Generate and score every prompt with ``arm`` active, by ``path`` (the slot decoder is built inside the
    timing, CUDA graphs captured too); wall time, rates and peak memory."""
    import torch

    from eogym_sft.data.images import ImageCache
    from eogym_sft.evaluation.offline import decode_turns, generate_turns, score_turns, turn_decoder, use_arm

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    start = time.perf_counter()
    with use_arm(model, arm):
        if path == "slots":
            generations = decode_turns(turn_decoder(model, prompts, cfg), processor, prompts, cfg)
        else:
            generations = generate_turns(model, processor, prompts, cfg, ImageCache())
    records = score_turns(arm.name, prompts, generations, cfg)
    sync(device)
    wall = time.perf_counter() - start
    new_tokens = sum(sum(g["new_tokens"]) for g in generations)
    return {
        "path": path, "arm": arm.name, "batch_size": cfg.batch_size, "turns": len(records), "wall_s": round(wall, 3),
        "turns_per_s": round(len(records) / wall, 4), "new_tokens_per_s": round(new_tokens / wall, 1),
        "mean_new_tokens": round(new_tokens / max(len(records), 1), 1), "peak_gpu_mem_gib": peak_gib(device),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model folder (e.g. written by eogym_sft.models.tiny.save_tiny_model)")
    add_run_args(parser, "eval_throughput", "EO-Gym JSONL to evaluate (default: a generated sample)")
    parser.add_argument("--rows", type=int, default=32, help="rows of the generated sample, or rows read from --data")
    parser.add_argument("--batch-size", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-prompt-tokens", "--max-length", type=int, default=SampleConfig.max_length)
    parser.add_argument("--no-lora-arm", action="store_true", help="time the base arm only")
    parser.add_argument("--paths", nargs="+", default=["generate", "slots"], choices=("generate", "slots"),
                        help="generation paths to time: batched generate, the slot decoder (evaluate's for greedy turns)")
    args = parser.parse_args(argv)

    from eogym_sft.evaluation.offline import Arm, EvalConfig, generate_turns, load_model, plan_turns, read_traces, resolve_device
    from eogym_sft.models.processor import load_processor

    with scratch_dir(args.workdir, "eogym_eval_bench_") as workdir:
        data, root = run_data(args, workdir)
        cfg = EvalConfig(model=args.model, data=[str(data)], data_root=str(root), limit=args.rows, max_new_tokens=args.max_new_tokens,
                         max_prompt_tokens=args.max_prompt_tokens, device=args.device, dtype=args.dtype, seed=args.seed)
        device, dtype = resolve_device(cfg)
        processor = load_processor(cfg.model, cfg.max_pixels, cfg.min_pixels)
        t0 = time.perf_counter()
        traces, failures = read_traces(cfg)
        prompts, skipped = plan_turns(processor, traces, cfg)
        plan_s = time.perf_counter() - t0
        print(f"{len(traces)} rows ({len(failures)} failed), {len(prompts)} turns ({len(skipped)} skipped), planned in {plan_s:.1f}s",
              flush=True)

        t0 = time.perf_counter()
        model = load_model(cfg, [Arm("base")])
        arms = [Arm("base")]
        if not args.no_lora_arm:
            model = add_random_lora(model, args.seed)
            arms.append(Arm("lora_r16", "<random>", "arm0"))
        load_s = time.perf_counter() - t0
        n_params = sum(p.numel() for p in model.parameters())
        print(f"model loaded in {load_s:.1f}s: {n_params / 1e9:.2f}B parameters, {dtype} on {device}", flush=True)

        cfg.batch_size = min(args.batch_size)
        generate_turns(model, processor, prompts[: cfg.batch_size], cfg)  # warm-up: CUDA context, kernels
        runs = []
        for batch_size in args.batch_size:
            cfg.batch_size = batch_size
            for path in args.paths:
                for arm in arms:
                    runs.append(time_arm(model, processor, prompts, cfg, arm, device, path))
                    print(json.dumps(runs[-1]), flush=True)

        n_tokens = [p.prompt_tokens for p in prompts]
        result = {
            "bench": "eval_throughput", "command": command("eval_throughput", argv), "model": args.model, "parameters": n_params,
            "dtype": str(dtype).replace("torch.", ""), "data": data_note(args, data), "rows": len(traces), "turns": len(prompts),
            "turns_skipped": len(skipped), "mean_prompt_tokens": round(sum(n_tokens) / max(len(n_tokens), 1), 1),
            "max_prompt_tokens_seen": max(n_tokens, default=0), "max_new_tokens": args.max_new_tokens,
            "plan_s": round(plan_s, 2), "model_load_s": round(load_s, 2), "machine": machine_info(device), "runs": runs,
        }
        return write_result(result, args.json, format_table(result))


def format_table(result: dict) -> str:
    subtitle = f"{result['turns']} turns (mean prompt {result['mean_prompt_tokens']} tokens), max_new_tokens {result['max_new_tokens']}"
    columns = [
        ("batch", 5, "batch_size"), ("path", 9, "path"), ("arm", 10, "arm"), ("turns/s", 9, "turns_per_s"), ("new tok/s", 10, "new_tokens_per_s"),
        ("new tok/turn", 12, "mean_new_tokens"), ("wall s", 8, "wall_s"), ("peak GiB", 9, "peak_gpu_mem_gib"),
    ]
    return runs_table(result["runs"], columns, machine_line(result), subtitle)


if __name__ == "__main__":
    main()
