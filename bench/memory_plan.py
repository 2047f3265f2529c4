"""The memory plan against the GPU: calibration points for ``eogym_sft.training.memory_plan`` and checks of its
plans, through the SFT recipe's parser, YAML and builders on the Qwen3-VL-4B architecture with random bf16 weights
and the bench's EO-Gym-shaped rows. Each micro-batch's peak allocated and reserved memory (the allocator's peak
reset before it) is recorded with its sizes, next to the plan's prediction for it:

  calibration  micro-batches of chosen samples, one a step: no checkpointing at several token counts, LoRA dropout 0,
               every layer checkpointed, every 2nd layer checkpointed
  checks       the plan for the card's whole memory and for 48 and 24 GB (``set_per_process_memory_fraction``)

    python bench/memory_plan.py --workdir /tmp/bm --json bench/results/h100_memory_plan.json
    python bench/memory_plan.py --fit bench/results/h100_memory_plan_gc.json  # the fitted Calibration, to paste

On a CPU (a tiny ``--config``) it runs the same path with no memory figures: the smoke test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as the recipe sets it

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from common import command, machine_info, write_result  # noqa: E402
from train_throughput import DEVICE, RECIPE, build_base, parse_recipe, prepare_data, restore_base  # noqa: E402
from transformers.trainer_pt_utils import BatchRebalanceSampler  # noqa: E402

from eogym_sft.models import memory as mm  # noqa: E402
from eogym_sft.training import memory_plan as mp  # noqa: E402
from eogym_sft.training.memory_hook import batches_from  # noqa: E402

GB = 10**9  # a card's marketed size: "24 GB" is 24e9 bytes


class FixedBatches(BatchRebalanceSampler):
    """The given micro-batches, in order (a batch sampler the Trainer hands to its DataLoader as is)."""

    def __init__(self, groups: list[list[int]]):  # noqa: D107 (the parent's state is not used)
        self.groups, self.epoch = groups, 0

    def __iter__(self):
        yield from self.groups

    def __len__(self):
        return len(self.groups)


class Meter:
    """Each micro-batch's sizes and peak memory; the vision tower's own peak over what was allocated before it."""

    def __init__(self, trainer, image_token_id: int):
        self.records, self.image_token_id, self._vision = [], image_token_id, None
        self.inner, trainer.training_step = trainer.training_step, self
        tower = trainer.model.get_base_model().model.visual
        self.handles = [tower.register_forward_pre_hook(self._before_tower), tower.register_forward_hook(self._after_tower)]

    def _peaks(self) -> tuple[int, int]:
        return (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()) if DEVICE == "cuda" else (0, 0)

    def _reset(self):
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()

    def _before_tower(self, module, args):
        self._vision = {"before": self._peaks(), "base": torch.cuda.memory_allocated() if DEVICE == "cuda" else 0}
        self._reset()

    def _after_tower(self, module, args, output):
        self._vision["peak"] = self._peaks()
        self._reset()

    def __call__(self, model, inputs, *args, **kwargs):
        ids, labels = inputs["input_ids"], inputs["labels"]
        sizes = {"tokens": int(ids.numel()), "supervised": int((labels != -100).sum()),
                 "image_tokens": int((ids == self.image_token_id).sum()), "samples": int((inputs["position_ids"][0].reshape(-1) == 0).sum())}
        self._reset()
        self._vision = None
        loss = self.inner(model, inputs, *args, **kwargs)
        after = self._peaks()
        seen = [after] + ([self._vision["before"], self._vision["peak"]] if self._vision else [])
        record = {**sizes, "peak_allocated_gib": max(a for a, _ in seen) / mm.GIB, "peak_reserved_gib": max(r for _, r in seen) / mm.GIB}
        if self._vision:
            record["vision_increment_gib"] = (self._vision["peak"][0] - self._vision["base"]) / mm.GIB
        self.records.append(record)
        return loss


def build(base, dataset, root, processor, out: Path, *, batch: int, accumulation: int, steps: int, every: int,
          dropout: float, groups: list[list[int]] | None = None):
    """The recipe's trainer over ``base`` through its own builders (``groups``: fixed micro-batches, one a step)."""
    from eogym_sft.training.sft import build_collator, build_model, build_trainer, set_samples_per_step

    cpu = {"use_cpu": True, "bf16": False, "optim": "adamw_torch", "compile_layers": False, "dataloader_num_workers": 0,
           "dataloader_persistent_workers": False, "dataloader_pin_memory": False} if DEVICE == "cpu" else {}
    script, training, model_args = parse_recipe(
        output_dir=out, save_strategy="no", eval_strategy="no", logging_steps=1000, **cpu, data_root=root, max_steps=steps,
        per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation, activation_checkpointing=every > 0,
        samples_per_step=None if groups is not None else 64, lora_dropout=dropout,
    )
    if every > 1:
        training.activation_checkpointing_kwargs = {**(training.activation_checkpointing_kwargs or {}), "every_n_layers": every}
    set_samples_per_step(script, training)
    base.set_attn_implementation({"text_config": model_args.attn_implementation, "vision_config": "sdpa"})  # as load_base_model
    model = build_model(script, training, model_args, base=base)
    trainer = build_trainer(training, model, build_collator(script, training, processor, model), processor, dataset)
    if groups is not None:
        trainer._get_train_sampler = lambda *args: FixedBatches(groups)
    return trainer


def measure(ctx: dict, name: str, **settings) -> dict:
    """Train with ``settings`` and return every micro-batch's measured peak next to the plan's prediction; an error (an OOM)
    is recorded in the result, not raised."""
    base = ctx["base"]
    trainer = build(base, ctx["dataset"], ctx["root"], ctx["processor"], ctx["workdir"] / name, **settings)
    meter = Meter(trainer, ctx["cfg"]["image_token_id"])
    started, error = time.perf_counter(), None
    try:
        trainer.train()
    except Exception as err:  # noqa: BLE001 (recorded in the report: the other settings still run on the lead's GPU time)
        error = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
    finally:
        for handle in meter.handles:
            handle.remove()
        restore_base(base, trainer.model)
    setup = mm.Setup(1, 0, settings["dropout"], settings["every"])
    for i, record in enumerate(meter.records):
        step = meter.records[i - i % settings["accumulation"]:][:settings["accumulation"]]
        batch = mm.MicroBatch(record["tokens"], record["supervised"], record["image_tokens"], record["samples"],
                              sum(r["image_tokens"] for r in step))
        terms = mm.peak_terms(ctx["shape"], setup, batch)
        record.update(predicted_allocated_gib=terms["allocated"] / mm.GIB, predicted_reserved_gib=terms["reserved"] / mm.GIB)
    return {"name": name, "settings": {k: v for k, v in settings.items() if k != "groups"}, "wall_s": time.perf_counter() - started,
            "error": error, "micro_batches": meter.records}


def calibration_groups(dataset, max_length: int) -> dict[str, list[list[int]]]:
    """Micro-batches of chosen token counts, smallest first: one sample near 30%, 60% and 100% of ``max_length``,
    two samples near 125%, two near 200% and four near 400% (those for checkpointed layers only)."""
    tokens = list(dataset["n_tokens"])
    order = sorted(range(len(tokens)), key=tokens.__getitem__)

    def near(target: float, k: int, taken: set) -> list[int]:
        pick = []
        for _ in range(k):
            free = [i for i in order if i not in taken] or order  # a small dataset serves a sample twice
            i = min(free, key=lambda i: abs(tokens[i] - target / k))
            taken.add(i)
            pick.append(i)
        return pick

    taken: set = set()
    singles = [near(f * max_length, 1, taken) for f in (0.3, 0.6, 1.0)]
    return {"single": singles, "pair": [near(1.25 * max_length, 2, taken)], "many": [near(2 * max_length, 2, taken), near(4 * max_length, 4, taken)]}


def calibration(ctx: dict) -> list[dict]:
    groups = calibration_groups(ctx["dataset"], ctx["max_length"])
    warm = [groups["single"][0]]  # the first step compiles: its peak is not the model's
    runs = [
        ("no_checkpointing", warm + groups["single"] + groups["pair"], 0, RECIPE["lora_dropout"]),
        ("dropout0", warm + groups["single"][-1:], 0, 0.0),
        ("checkpoint_every_layer", warm + groups["single"][-1:] + groups["many"], 1, RECIPE["lora_dropout"]),
        ("checkpoint_every_2nd", warm + groups["single"][-1:], 2, RECIPE["lora_dropout"]),
    ]
    results = []
    for name, fixed, every, dropout in runs:
        result = measure(ctx, name, batch=1, accumulation=1, steps=len(fixed), every=every, dropout=dropout, groups=fixed)
        result["micro_batches"] = result["micro_batches"][1:]  # the warm-up's
        results.append(result)
    return results


def check(ctx: dict, gpu_gb: float | None, steps: int) -> dict:
    """The plan for ``gpu_gb`` (``None``: the card's whole memory), trained for ``steps`` steps of 64 samples under
    that memory cap."""
    total = torch.cuda.get_device_properties(0).total_memory if DEVICE == "cuda" else 80 * GB
    cap = total if gpu_gb is None else min(total, gpu_gb * GB)
    batches_for = batches_from(ctx["dataset"], 64, 1, steps, RECIPE["seed"], False)
    plan = mp.choose(ctx["shape"], mm.Setup(1, 0, RECIPE["lora_dropout"]), batches_for, mm.budget_bytes(cap), 64)
    if DEVICE == "cuda":
        torch.cuda.set_per_process_memory_fraction(cap / total)
    try:
        name = f"check_{'full' if gpu_gb is None else f'{gpu_gb:g}GB'}"
        result = measure(ctx, name, batch=plan.per_device_train_batch_size, accumulation=plan.gradient_accumulation_steps,
                         steps=steps, every=plan.checkpoint_every, dropout=RECIPE["lora_dropout"])
    finally:
        if DEVICE == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0)
    records = result["micro_batches"]
    result.update(gpu_gb=cap / GB, plan=plan.to_json(),
                  measured_peak_allocated_gib=max((r["peak_allocated_gib"] for r in records), default=None),
                  measured_peak_reserved_gib=max((r["peak_reserved_gib"] for r in records), default=None),
                  predicted_peak_allocated_gib=max((r["predicted_allocated_gib"] for r in records), default=None),
                  tokens_per_s=sum(r["tokens"] for r in records) / result["wall_s"])
    return result


def report_shape(report: dict, config: Path) -> mm.ModelShape:
    """The model shape of ``config`` (the architecture JSON), checked against the one the report was measured with."""
    shape = mm.ModelShape.of(json.loads(config.read_text()), RECIPE["lora_target_modules"], RECIPE["lora_r"])
    stored = {k: tuple(v) if isinstance(v, list) else v for k, v in report["shape"].items()}  # JSON made tuples lists
    differ = sorted(k for k, v in stored.items() if getattr(shape, k) != v)
    if differ:
        raise SystemExit(f"{config}: the report was measured with another shape ({', '.join(differ)} differ)")
    return shape


def fit(report: dict, config: Path = REPO / "recipes/configs/qwen3_vl_4b_instruct.json") -> mm.Calibration:
    """Calibration constants fitted to a report's calibration points (least squares on the allocated peaks); runs
    that ended in an error are left out, and a constant no point measures keeps its value."""
    import numpy as np

    shape = report_shape(report, config)
    cal = mm.CALIBRATION
    rows, targets = [], []
    points = [(run["settings"], r) for run in report["calibration"] if not run["error"] for r in run["micro_batches"]]
    for settings, r in points:
        if settings["every"] == 0:
            static = sum(v for k, v in mm.static_terms(shape, mm.Setup(1, 0, settings["dropout"]), cal).items() if k != "fixed")
            static += mm.step_input_bytes(shape, mm.MicroBatch(r["tokens"], r["supervised"], r["image_tokens"]))  # one a step
            dropped = shape.lora_inputs if settings["dropout"] > 0 else 0
            loss = r["supervised"] * shape.vocab * cal.loss_bytes_per_logit
            rows.append([1.0, r["tokens"] * shape.layers, r["tokens"] * shape.layers * dropped])
            targets.append(r["peak_allocated_gib"] * mm.GIB - static - loss)
    fixed, per_layer, per_dropped = np.linalg.lstsq(np.array(rows), np.array(targets), rcond=None)[0]
    if fixed < 0:  # workspaces take no negative bytes: the points say none beyond the other terms
        fixed, (per_layer, per_dropped) = 0.0, np.linalg.lstsq(np.array(rows)[:, 1:], np.array(targets), rcond=None)[0]
    cal = mm.Calibration(**{**cal.__dict__, "fixed_bytes": float(fixed), "layer_bytes_per_token": float(per_layer),
                            "dropped_input_bytes_per_element": float(per_dropped)})
    kept = []
    for settings, r in points:
        if settings["every"] == 1:
            terms = mm.peak_terms(shape, mm.Setup(1, 0, settings["dropout"], 1), mm.MicroBatch(r["tokens"], r["supervised"], r["image_tokens"]), cal)
            rest = terms["allocated"] - terms["decoder_activations"]
            kept.append((r["peak_allocated_gib"] * mm.GIB - rest) / (r["tokens"] * shape.layers))
    ratios = [r["peak_reserved_gib"] / r["peak_allocated_gib"] for _, r in points if r["peak_allocated_gib"]]
    ratios += [max(r["peak_reserved_gib"] for r in run["micro_batches"]) / max(r["peak_allocated_gib"] for r in run["micro_batches"])
               for run in report.get("checks", []) if not run["error"] and run.get("measured_peak_allocated_gib")]  # a reserve kept
    vision = [r["vision_increment_gib"] * mm.GIB / (r["image_tokens"] * shape.patches_per_token) for _, r in points if r.get("image_tokens")]
    return mm.Calibration(**{**cal.__dict__, "checkpointed_layer_bytes_per_token": float(np.mean(kept)) if kept else cal.checkpointed_layer_bytes_per_token,
                             "reserved_over_allocated": max(ratios, default=cal.reserved_over_allocated),
                             "vision_bytes_per_patch": max(vision, default=cal.vision_bytes_per_patch)})


def context(base, cfg: dict, dataset, root, processor, workdir: Path) -> dict:
    shape = mm.ModelShape.of(cfg, RECIPE["lora_target_modules"], RECIPE["lora_r"])
    max_length = min(RECIPE["max_length"], max(dataset["n_tokens"]))
    return {"base": base, "cfg": cfg, "dataset": dataset, "root": root, "processor": processor, "workdir": workdir,
            "shape": shape, "max_length": max_length}


def run(ctx: dict, checks: list[float | None], check_steps: int) -> dict:
    """The calibration points, then the checks (GPU sizes in GB, ``None`` the card's own)."""
    report = {"machine": machine_info(DEVICE), "shape": ctx["shape"].__dict__, "calibration_used": mm.CALIBRATION.__dict__}
    started = time.perf_counter()
    report["calibration"] = calibration(ctx)
    report["checks"] = [check(ctx, size, check_steps) for size in checks]
    report["wall_s"] = time.perf_counter() - started
    return report


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO / "recipes/configs/qwen3_vl_4b_instruct.json", help="architecture JSON")
    parser.add_argument("--rows", type=int, default=220, help="EO-Gym-shaped rows to generate and prepare")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench_memory_plan"))
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--checks", default="full,48,24", help="GPU sizes to plan and run for: full (the card), or GB")
    parser.add_argument("--check-steps", type=int, default=1, help="optimizer steps of 64 samples per check")
    parser.add_argument("--max-pixels", type=int, default=None, help="pixel cap (default: the recipe's; small for a CPU smoke run)")
    parser.add_argument("--fit", type=Path, help="only print the Calibration fitted to this report")
    args = parser.parse_args(argv)
    if args.fit:
        print(fit(json.loads(args.fit.read_text()), args.config))
        return {}
    args.workdir.mkdir(parents=True, exist_ok=True)
    base, cfg, model_dir = build_base(args.config, args.workdir)
    dataset, _, root, processor = prepare_data(args.workdir, args.rows, model_dir, args.max_pixels or RECIPE["max_pixels"])
    ctx = context(base, cfg, dataset, root, processor, args.workdir)
    checks = [None if size == "full" else float(size) for size in args.checks.split(",") if size]
    report = run(ctx, checks, args.check_steps)
    report["command"] = command("memory_plan", argv)
    write_result(report, args.json)
    for check in report["checks"]:
        print(f"{check['name']}: plan {check['plan']['per_device_train_batch_size']} a micro-batch, checkpoint every "
              f"{check['plan']['checkpoint_every']}; peak {check['measured_peak_allocated_gib']} measured, "
              f"{check['predicted_peak_allocated_gib']} predicted (GiB allocated); {check['error'] or 'ok'}")
    return report


if __name__ == "__main__":
    main()
