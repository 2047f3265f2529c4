"""Validate throughput: tokens/s of ``eogym-sft validate``'s forward by path (``PATHS``, bench/README.md), side by
side on the same samples and random rank-16 adapter in one process, each through
:func:`~eogym_sft.evaluation.validate.score_arms` after one warm-up batch (where the layers compile). Tokens/s counts
every token the forwards run (padding excluded, each arm's) over the timed wall; loading, prep and the warm-up
(``warmup_s``) are excluded. The JSON records how far the old and new paths' figures are apart.

    PYTHONPATH=. python bench/validate_throughput.py --model /tmp/qwen3vl4b-random --rows 100 --json validate_h200.json
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

# old: validate's former padded SDPA batches, collated in the main process, eager; new: its defaults (packed batches,
# workers, compiled layers on CUDA); new-2arms: the base arm too; new-eager, new-inline: new without compiled layers,
# collated in the main process
PATHS = ("old", "new", "new-2arms", "new-eager", "new-inline")


def path_settings(name: str, device, batch_size: int, old_batch_size: int) -> dict:
    """What path ``name`` runs: attention, packing, batch size, workers, compile, arms."""
    from eogym_sft.evaluation.validate import ValidateConfig, dataloader_workers, default_attention, default_compile

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
        "path": name, **{k: list(v) if k == "arms" else v for k, v in settings.items()}, "samples": len(dataset),
        "tokens": stats["tokens"], "supervised_tokens": scores["lora"]["overall"]["tokens"], "warmup_s": round(warmup, 3),
        "wall_s": round(wall, 3), "tokens_per_s": round(stats["tokens"] / wall, 1), "peak_gpu_mem_gib": peak_gib(device),
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
            "bench": "validate_throughput", "command": command("validate_throughput", argv), "model": args.model,
            "dtype": str(dtype).replace("torch.", ""), "data": data_note(args, data), "samples": len(dataset),
            "mean_sample_tokens": round(runs[0]["tokens"] / max(len(dataset), 1), 1), "prep_s": round(prep_s, 2),
            "machine": machine_info(device), "runs": runs,
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
    columns = [("path", 10, "path"), ("attention", 19, "attention"), ("packed", 6, "packed"), ("batch", 5, "batch_size"),
               ("workers", 7, "workers"), ("compiled", 8, "compiled"), ("arms", 4, lambda r: len(r["arms"])),
               ("tokens/s", 10, "tokens_per_s"), ("vs old", 6, lambda r: result["speedup_vs_old"].get(r["path"], 1.0)),
               ("wall s", 8, "wall_s"), ("warm-up s", 9, "warmup_s"), ("peak GiB", 8, "peak_gpu_mem_gib")]
    a = result["agreement"]
    return runs_table(result["runs"], columns, machine_line(result), f"{result['samples']} samples, mean {result['mean_sample_tokens']} tokens") + (
        f"\nloss old {a['loss_old']:.6f} vs {a['compared'][1]} {a['loss_new']:.6f}, "
        f"token accuracy {a['accuracy_old']:.4f} vs {a['accuracy_new']:.4f}")


if __name__ == "__main__":
    main()
