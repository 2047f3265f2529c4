"""Validate throughput: tokens/s of ``eogym-sft validate``'s forward, the padded SDPA path it had
against the packed variable-length path it runs now, side by side on the same samples and adapter.

Commands (from the repository root)::

    # CPU smoke run on the tiny model
    eogym-sft tiny-model --output /tmp/tiny && python bench/validate_throughput.py --model /tmp/tiny --rows 4

    # the Qwen3-VL-4B architecture with random weights on a GPU (bench/h200_session.sh validate_1gpu)
    PYTHONPATH=. python bench/validate_throughput.py --model /tmp/qwen3vl4b-random --rows 100 --json validate_h200.json

What it does: (a) takes ``--data``/``--data-root`` or writes the EO-Gym-shaped sample of
``bench/prep_throughput.py`` and prepares it as ``validate`` does; (b) loads the model twice in the
evaluation dtype (bf16 on GPU, fp32 on CPU), once with SDPA and once with the recipe's attention
(``eogym_varlen_cudnn`` on CUDA, ``eogym_varlen`` elsewhere), each with the same random rank-16 LoRA
adapter (the recipe's targets); (c) runs one warm-up batch per path, then times
:func:`~eogym_sft.evaluation.validate.score_dataset` over every sample: ``old`` = padded batches of
``--old-batch-size`` (validate's former default, 4) through SDPA, ``new`` = packed batches of
``--batch-size`` through the varlen attention. Tokens/s counts every token the forward runs (context
included, padding excluded) over that wall time; model loading, prep and warm-up are excluded. The
JSON also records how far the two paths' figures are apart (bf16 on GPU: not bit-equal).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eval_throughput import add_random_lora, machine_info  # noqa: E402 (the bench folder)
from prep_throughput import generate_sample, scratch_dir, write_result  # noqa: E402


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_path(name: str, model, collator, dataset, batch_size: int, device) -> tuple[dict, dict]:
    """``(run, scores)`` of one path: a warm-up batch, then every sample timed."""
    import torch

    from eogym_sft.evaluation.validate import score_dataset

    score_dataset(model, collator, dataset.select(range(min(batch_size, len(dataset)))), batch_size, device, progress=False)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    stats: dict = {}
    start = time.perf_counter()
    scores = score_dataset(model, collator, dataset, batch_size, device, progress=False, stats=stats)
    _sync(device)
    wall = time.perf_counter() - start
    run = {
        "path": name,
        "attention": model.config.text_config._attn_implementation,
        "packed": collator.padding_free,
        "batch_size": batch_size,
        "samples": len(dataset),
        "tokens": stats["tokens"],
        "supervised_tokens": scores["overall"]["tokens"],
        "wall_s": round(wall, 3),
        "tokens_per_s": round(stats["tokens"] / wall, 1),
        "peak_gpu_mem_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
    }
    return run, scores


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model folder (e.g. written by eogym-sft tiny-model)")
    parser.add_argument("--data", default=None, help="EO-Gym JSONL or a prepared folder (default: a generated sample)")
    parser.add_argument("--data-root", default=".", help="data root of --data")
    parser.add_argument("--rows", type=int, default=100, help="rows of the generated sample")
    parser.add_argument("--batch-size", type=int, default=8, help="samples per packed batch (new path)")
    parser.add_argument("--old-batch-size", type=int, default=4, help="samples per padded batch (old path)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="folder for the generated sample (default: a temp folder, removed after)")
    parser.add_argument("--json", default="validate_throughput.json", help="where to write the result")
    args = parser.parse_args(argv)

    from eogym_sft.config import SampleConfig
    from eogym_sft.data.datasets import load_or_prepare
    from eogym_sft.data.prepare import PrepConfig
    from eogym_sft.evaluation.validate import default_attention
    from eogym_sft.models.loading import load_base_model, resolve_device
    from eogym_sft.models.processor import load_processor
    from eogym_sft.training.collator import EOGymCollator

    with scratch_dir(args.workdir, "eogym_validate_bench_") as workdir:
        data, root = (Path(args.data), Path(args.data_root)) if args.data else generate_sample(workdir / "sample", args.rows, args.seed)
        device, dtype = resolve_device(args.device, args.dtype)
        sample = SampleConfig()
        processor = load_processor(args.model, sample.max_pixels, sample.min_pixels)
        t0 = time.perf_counter()
        dataset, _ = load_or_prepare(str(data), args.model, processor, PrepConfig(max_length=sample.max_length, data_root=str(root)), workdir / "prepared")
        prep_s = time.perf_counter() - t0
        print(f"{len(dataset)} samples prepared in {prep_s:.1f}s", flush=True)

        runs, scores = [], {}
        paths = (("old", "sdpa", False, args.old_batch_size), ("new", default_attention(device), True, args.batch_size))
        for name, attention, packed, batch_size in paths:
            model = add_random_lora(load_base_model(args.model, dtype, attention).to(device), args.seed)
            collator = EOGymCollator(processor, max_length=sample.max_length, data_root=str(root), padding_free=packed, pixel_dtype=dtype)
            run, scores[name] = time_path(name, model, collator, dataset, batch_size, device)
            runs.append(run)
            print(json.dumps(run), flush=True)
            del model
        old, new = scores["old"]["overall"], scores["new"]["overall"]
        result = {
            "bench": "validate_throughput",
            "command": " ".join(["python", "bench/validate_throughput.py", *(argv if argv is not None else sys.argv[1:])]),
            "model": args.model,
            "dtype": str(dtype).replace("torch.", ""),
            "data": str(data) if args.data else f"generated by bench/prep_throughput.py, {args.rows} rows, seed {args.seed}",
            "samples": len(dataset),
            "mean_sample_tokens": round(runs[0]["tokens"] / max(len(dataset), 1), 1),
            "prep_s": round(prep_s, 2),
            "machine": machine_info(device),
            "runs": runs,
            "speedup": round(runs[1]["tokens_per_s"] / runs[0]["tokens_per_s"], 3),
            "agreement": {
                "loss_old": old["loss"], "loss_new": new["loss"], "abs_loss_diff": abs(old["loss"] - new["loss"]),
                "accuracy_old": old["token_accuracy"], "accuracy_new": new["token_accuracy"],
                "same_tokens": old["tokens"] == new["tokens"],
            },
        }
        return write_result(result, args.json, format_table(result))


def format_table(result: dict) -> str:
    lines = [
        f"validate throughput: {result['samples']} samples (mean {result['mean_sample_tokens']} tokens), {result['dtype']} on "
        f"{result['machine']['device_name']}",
        f"{'path':<5}{'attention':>20}{'packed':>8}{'batch':>6}{'tokens/s':>11}{'wall s':>9}{'peak GiB':>9}",
    ]
    for r in result["runs"]:
        peak = "-" if r["peak_gpu_mem_gib"] is None else f"{r['peak_gpu_mem_gib']}"
        lines.append(f"{r['path']:<5}{r['attention']:>20}{r['packed']!s:>8}{r['batch_size']:>6}{r['tokens_per_s']:>11}{r['wall_s']:>9}{peak:>9}")
    a = result["agreement"]
    lines.append(f"new/old tokens/s {result['speedup']}x; loss {a['loss_old']:.6f} vs {a['loss_new']:.6f}, "
                 f"token accuracy {a['accuracy_old']:.4f} vs {a['accuracy_new']:.4f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
