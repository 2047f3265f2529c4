"""Evaluation throughput: scored turns/s of ``eogym-sft evaluate`` for one model, per batch size and arm.

Commands (from the repository root)::

    # CPU smoke run on the tiny model
    eogym-sft tiny-model --output /tmp/tiny && python bench/eval_throughput.py --model /tmp/tiny --rows 4

    # the Qwen3-VL-4B architecture with random weights, on a GPU (a bf16 folder of ~9 GB)
    python -c "import json; from eogym_sft.models.tiny import save_tiny_model; save_tiny_model('outputs/qwen3vl4b_random', \
        config=json.load(open('recipes/configs/qwen3_vl_4b_instruct.json')), dtype='bfloat16', device='cuda')"
    PYTHONPATH=. python bench/eval_throughput.py --model outputs/qwen3vl4b_random --rows 32 --batch-size 8 32 \
        --max-new-tokens 128 --json eval_throughput_h200.json

What it does: (a) takes ``--data``/``--data-root`` or writes the EO-Gym-shaped sample of
``bench/prep_throughput.py`` (row images up to 4000x4000 px, 1-5 a row, tool-result crops, 1-6 tool
steps); (b) loads the processor and plans every assistant turn as ``evaluate`` does (timed apart); (c)
loads the model once in the evaluation dtype (bf16 on GPU, fp32 on CPU) and, unless ``--no-lora-arm``, adds
one random rank-16 LoRA adapter on q/k/v/o/gate/up/down (the EO-Gym-4B recipe) so that both the base
arm (adapter disabled) and an adapter arm are timed; (d) runs one warm-up batch, then for each batch
size, path (``generate``: batched ``generate``; ``slots``: the slot decoder ``evaluate`` runs for greedy
turns) and arm times the generation + :func:`score_turns` over all planned turns. Turns/s is
scored turns over that wall time: model loading, planning and the warm-up are excluded.

Random weights never emit ``<|im_end|>``, so every turn generates exactly ``--max-new-tokens`` tokens:
the figure is a floor for a trained model that stops after a short tool call. The JSON records mean
new tokens per turn, so the figure can be scaled.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import time
from pathlib import Path

from eogym_sft.config import SampleConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prep_throughput import generate_sample, scratch_dir, write_result  # noqa: E402 (the bench folder)


def machine_info(device) -> dict:
    import peft
    import torch
    import transformers

    info = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "cpu_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if device.type == "cuda":
        info["cuda"] = torch.version.cuda
    return info


def runs_table(result: dict, subtitle: str, columns: list[tuple]) -> str:
    """A GPU bench's printed table: where and when it ran (:func:`machine_info`), ``subtitle``, then a line
    per run of ``result["runs"]`` with ``(header, width, key)`` columns right-aligned, ``key`` a run's
    field or a function of the run (``-`` for None); a run that failed shows its error instead."""
    m = result["machine"]
    lines = [
        f"{m['device_name']} | {result['dtype']} | torch {m['torch']} | transformers {m['transformers']} | {m['date']}",
        subtitle,
        " ".join(f"{head:>{width}}" for head, width, _ in columns),
    ]
    for r in result["runs"]:
        if "error" in r:
            _, width, key = columns[0]
            lines.append(f"{r[key]:>{width}} failed: {r['error'][:80]}")
            continue
        cells = [key(r) if callable(key) else r[key] for _, _, key in columns]
        lines.append(" ".join(f"{'-' if v is None else v:>{width}}" for v, (_, width, _) in zip(cells, columns)))
    return "\n".join(lines)


def run_data(args: argparse.Namespace, workdir: Path) -> tuple[Path, Path]:
    """The JSONL and data root a bench of :func:`add_run_args` runs on: ``--data`` and ``--data-root``, or else
    ``--rows`` rows of the EO-Gym-shaped sample of ``bench/prep_throughput.py`` (seed ``--seed``) under ``workdir``."""
    if args.data:
        return Path(args.data), Path(args.data_root)
    return generate_sample(workdir / "sample", args.rows, args.seed)


def add_random_lora(model, seed: int):
    """Wrap ``model`` in peft with one random rank-16 adapter named ``arm0`` (B is not zero, so it acts)."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets, init_lora_weights=False)
    return get_peft_model(model, lora, adapter_name="arm0").eval()


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_arm(model, processor, prompts, cfg, arm, device, path: str = "generate") -> dict:
    """Generate and score every prompt with ``arm`` active, by ``path`` (``generate``: batched
    ``model.generate``; ``slots``: the slot decoder evaluate runs for greedy turns, built inside the
    timing, CUDA graphs captured too); wall time, rates and peak memory."""
    import torch

    from eogym_sft.data.images import ImageCache
    from eogym_sft.evaluation.offline import (
        decode_turns,
        generate_turns,
        score_turns,
        turn_decoder,
        use_arm,
    )

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    start = time.perf_counter()
    with use_arm(model, arm):
        if path == "slots":
            generations = decode_turns(turn_decoder(model, prompts, cfg), processor, prompts, cfg)
        else:
            generations = generate_turns(model, processor, prompts, cfg, ImageCache())
    records = score_turns(arm.name, prompts, generations, cfg)
    _sync(device)
    wall = time.perf_counter() - start
    new_tokens = sum(sum(g["new_tokens"]) for g in generations)
    return {
        "path": path,
        "arm": arm.name,
        "batch_size": cfg.batch_size,
        "turns": len(records),
        "wall_s": round(wall, 3),
        "turns_per_s": round(len(records) / wall, 4),
        "new_tokens_per_s": round(new_tokens / wall, 1),
        "mean_new_tokens": round(new_tokens / max(len(records), 1), 1),
        "peak_gpu_mem_gib": (
            round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None
        ),
    }


def add_run_args(parser: argparse.ArgumentParser, name: str, data_help: str) -> None:
    """The arguments every GPU bench of evaluation, validation and rollouts takes: the data (a generated
    sample by default), the device and dtype, the seed, the work folder and where the JSON goes."""
    parser.add_argument("--data", default=None, help=data_help)
    parser.add_argument("--data-root", default=".", help="data root of --data")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="folder for the generated sample (default: a temp folder, removed after)")
    parser.add_argument("--json", default=f"{name}.json", help="where to write the result")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
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
        cfg = EvalConfig(
            model=args.model,
            data=[str(data)],
            data_root=str(root),
            limit=args.rows,
            max_new_tokens=args.max_new_tokens,
            max_prompt_tokens=args.max_prompt_tokens,
            device=args.device,
            dtype=args.dtype,
            seed=args.seed,
        )
        device, dtype = resolve_device(cfg)
        processor = load_processor(cfg.model, cfg.max_pixels, cfg.min_pixels)
        t0 = time.perf_counter()
        traces, failures = read_traces(cfg)
        prompts, skipped = plan_turns(processor, traces, cfg)
        plan_s = time.perf_counter() - t0
        print(
            f"{len(traces)} rows ({len(failures)} failed), {len(prompts)} turns ({len(skipped)} skipped), "
            f"planned in {plan_s:.1f}s",
            flush=True,
        )

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
            "bench": "eval_throughput",
            "command": " ".join(["python", "bench/eval_throughput.py", *(argv if argv is not None else sys.argv[1:])]),
            "model": args.model,
            "parameters": n_params,
            "dtype": str(dtype).replace("torch.", ""),
            "data": (
                str(data)
                if args.data
                else f"generated by bench/prep_throughput.py, {args.rows} rows, seed {args.seed}"
            ),
            "rows": len(traces),
            "turns": len(prompts),
            "turns_skipped": len(skipped),
            "mean_prompt_tokens": round(sum(n_tokens) / max(len(n_tokens), 1), 1),
            "max_prompt_tokens_seen": max(n_tokens, default=0),
            "max_new_tokens": args.max_new_tokens,
            "plan_s": round(plan_s, 2),
            "model_load_s": round(load_s, 2),
            "machine": machine_info(device),
            "runs": runs,
        }
        return write_result(result, args.json, format_table(result))


def format_table(result: dict) -> str:
    subtitle = (
        f"{result['turns']} turns (mean prompt {result['mean_prompt_tokens']} tokens), "
        f"max_new_tokens {result['max_new_tokens']}"
    )
    columns = [
        ("batch", 5, "batch_size"), ("path", 9, "path"), ("arm", 10, "arm"), ("turns/s", 9, "turns_per_s"), ("new tok/s", 10, "new_tokens_per_s"),
        ("new tok/turn", 12, "mean_new_tokens"), ("wall s", 8, "wall_s"), ("peak GiB", 9, "peak_gpu_mem_gib"),
    ]
    return runs_table(result, subtitle, columns)


if __name__ == "__main__":
    main()
