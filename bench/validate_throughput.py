"""Validate throughput: tokens/s of ``eogym-sft validate``'s forward, the padded path it had against
the defaults it runs now, side by side on the same samples and adapter in one process.

Commands (from the repository root)::

    # CPU smoke run on the tiny model
    eogym-sft tiny-model --output /tmp/tiny && python bench/validate_throughput.py --model /tmp/tiny --rows 4

    # the Qwen3-VL-4B architecture with random weights on a GPU (bench/h200_session.sh validate_1gpu)
    PYTHONPATH=. python bench/validate_throughput.py --model /tmp/qwen3vl4b-random --rows 100 --json validate_h200.json

It prepares ``--data`` (or the EO-Gym-shaped sample of ``bench/common.py``) as ``validate`` does, loads the model
with one random rank-16 LoRA adapter once per attention and compile setting, and runs each path of ``--paths`` (bench/README.md,
its Validation section) on every sample through :func:`~eogym_sft.evaluation.validate.score_arms`, after one warm-up batch
(where the layers compile). Tokens/s counts every token the forwards run (padding excluded, each arm's) over the
timed wall time; loading, prep and the warm-up (``warmup_s``) are excluded. The JSON records how far the old and new
paths' figures are apart (bf16 on GPU: not bit-equal).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_random_lora, add_run_args, machine_info, peak_gib, run_data, scratch_dir, sync, write_result  # noqa: E402


PATHS = ("old", "new", "new-2arms", "new-eager", "new-inline")


def path_settings(name: str, device, batch_size: int, old_batch_size: int) -> dict:
    """What path ``name`` runs (module docstring): attention, packing, batch size, workers, compile, arms."""
    from eogym_sft.evaluation.validate import (
        ValidateConfig,
        dataloader_workers,
        default_attention,
        default_compile,
    )

    if name == "old":
        return {"attention": "sdpa", "packed": False, "batch_size": old_batch_size, "workers": 0, "compiled": False, "arms": ("lora",)}
    new = {
        "attention": default_attention(device), "packed": True, "batch_size": batch_size,
        "workers": dataloader_workers(ValidateConfig.dataloader_workers), "compiled": default_compile(device), "arms": ("lora",),
    }
    changes = {"new": {}, "new-2arms": {"arms": ("base", "lora")}, "new-eager": {"compiled": False}, "new-inline": {"workers": 0}}
    return {**new, **changes[name]}


def time_path(name: str, settings: dict, model, collator, dataset, device) -> tuple[dict, dict]:
    """``(run, scores per arm)`` of one path: a warm-up batch, then every sample timed."""
    import torch

    from eogym_sft.evaluation.validate import score_arms
    from eogym_sft.models.loading import Arm

    arms = [Arm("base") if a == "base" else Arm("lora", "random", "arm0") for a in settings["arms"]]
    batch_size, workers = settings["batch_size"], settings["workers"]
    start = time.perf_counter()
    score_arms(model, arms, collator, dataset.select(range(min(batch_size, len(dataset)))), batch_size, device, progress=False)
    sync(device)
    warmup = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    stats: dict = {}
    start = time.perf_counter()
    scores = score_arms(model, arms, collator, dataset, batch_size, device, progress=False, stats=stats, workers=workers)
    sync(device)
    wall = time.perf_counter() - start
    run = {
        "path": name,
        **{k: list(v) if k == "arms" else v for k, v in settings.items()},
        "samples": len(dataset),
        "tokens": stats["tokens"],
        "supervised_tokens": scores["lora"]["overall"]["tokens"],
        "warmup_s": round(warmup, 3),
        "wall_s": round(wall, 3),
        "tokens_per_s": round(stats["tokens"] / wall, 1),
        "peak_gpu_mem_gib": peak_gib(device),
    }
    return run, scores


def load_model(model_dir: str, settings: dict, dtype, device, seed: int):
    """The base with the random adapter, attention and compile as ``settings`` say."""
    from eogym_sft.models.loading import compile_language_layers, load_base_model

    model = add_random_lora(load_base_model(model_dir, dtype, settings["attention"]).to(device), seed)
    if settings["compiled"]:
        compile_language_layers(model)
    return model


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model folder (e.g. written by eogym-sft tiny-model)")
    add_run_args(parser, "validate_throughput", "EO-Gym JSONL or a prepared folder (default: a generated sample)")
    parser.add_argument("--rows", type=int, default=100, help="rows of the generated sample")
    parser.add_argument("--paths", default="old,new,new-2arms", help=f"comma-separated, from {', '.join(PATHS)}; old first")
    parser.add_argument("--batch-size", type=int, default=8, help="samples per packed batch (the new paths)")
    parser.add_argument("--old-batch-size", type=int, default=4, help="samples per padded batch (old path)")
    args = parser.parse_args(argv)
    paths = args.paths.split(",")
    if paths[0] != "old" or any(p not in PATHS for p in paths):
        parser.error(f"--paths: old first, then any of {', '.join(PATHS[1:])}; got {args.paths}")

    from eogym_sft.config import SampleConfig
    from eogym_sft.data.datasets import load_or_prepare
    from eogym_sft.data.prepare import PrepConfig
    from eogym_sft.evaluation.validate import scoring_collator
    from eogym_sft.models.loading import resolve_device
    from eogym_sft.models.processor import load_processor

    with scratch_dir(args.workdir, "eogym_validate_bench_") as workdir:
        data, root = run_data(args, workdir)
        device, dtype = resolve_device(args.device, args.dtype)
        sample = SampleConfig()
        processor = load_processor(args.model, sample.max_pixels, sample.min_pixels)
        t0 = time.perf_counter()
        dataset, _ = load_or_prepare(str(data), args.model, processor, PrepConfig(max_length=sample.max_length, data_root=str(root)), workdir / "prepared")
        prep_s = time.perf_counter() - t0
        print(f"{len(dataset)} samples prepared in {prep_s:.1f}s", flush=True)

        runs, scores, models = [], {}, {}
        for name in paths:
            settings = path_settings(name, device, args.batch_size, args.old_batch_size)
            kind = (settings["attention"], settings["compiled"])
            if kind not in models:
                models.clear()  # one model in memory at a time
                models[kind] = load_model(args.model, settings, dtype, device, args.seed)
            collator = scoring_collator(processor, sample.max_length, str(root), settings["attention"], dtype)  # validate's own
            run, scores[name] = time_path(name, settings, models[kind], collator, dataset, device)
            runs.append(run)
            print(json.dumps(run), flush=True)
        compared = "new" if "new" in scores else paths[-1]
        old, new = scores["old"]["lora"]["overall"], scores[compared]["lora"]["overall"]
        result = {
            "bench": "validate_throughput",
            "command": " ".join(["python", "bench/validate_throughput.py", *(argv if argv is not None else sys.argv[1:])]),
            "model": args.model,
            "dtype": str(dtype).replace("torch.", ""),
            "data": str(data) if args.data else f"generated by bench/common.py, {args.rows} rows, seed {args.seed}",
            "samples": len(dataset),
            "mean_sample_tokens": round(runs[0]["tokens"] / max(len(dataset), 1), 1),
            "prep_s": round(prep_s, 2),
            "machine": machine_info(device),
            "runs": runs,
            "speedup_vs_old": {r["path"]: round(r["tokens_per_s"] / runs[0]["tokens_per_s"], 3) for r in runs[1:]},
            "agreement": {
                "compared": ["old", compared],
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
        f"{'path':<11}{'attention':>20}{'packed':>7}{'batch':>6}{'workers':>8}{'compiled':>9}{'arms':>5}{'tokens/s':>11}{'vs old':>7}"
        f"{'wall s':>9}{'warm-up s':>10}{'peak GiB':>9}",
    ]
    for r in result["runs"]:
        peak = "-" if r["peak_gpu_mem_gib"] is None else f"{r['peak_gpu_mem_gib']}"
        ratio = result["speedup_vs_old"].get(r["path"], 1.0)
        lines.append(
            f"{r['path']:<11}{r['attention']:>20}{r['packed']!s:>7}{r['batch_size']:>6}{r['workers']:>8}{r['compiled']!s:>9}{len(r['arms']):>5}"
            f"{r['tokens_per_s']:>11}{ratio:>7}{r['wall_s']:>9}{r['warmup_s']:>10}{peak:>9}"
        )
    a = result["agreement"]
    lines.append(f"loss old {a['loss_old']:.6f} vs {a['compared'][1]} {a['loss_new']:.6f}, "
                 f"token accuracy {a['accuracy_old']:.4f} vs {a['accuracy_new']:.4f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
