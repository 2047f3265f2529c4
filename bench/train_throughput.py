"""Training throughput on one GPU: plain TRL against this library's recipe, feature by feature, one run.

    python bench/train_throughput.py --rows 160 --steps 6 --warmup 2 --grad-accum 2 --json bench_train.json

Model: the Qwen3-VL-4B architecture (``recipes/configs/qwen3_vl_4b_instruct.json``) with random bf16
weights (speed does not depend on their values), built once and shared by every arm. Data: the
EO-Gym-shaped sample of ``bench/common.py`` (row images up to 4000x4000 px, crops in tool results),
prepared by the recipe's own :func:`~eogym_sft.training.sft.build_datasets` (8,192-token budget, 1,003,520-px cap).

Arms (all LoRA r16/alpha32 on the 7 language-model projections, bf16):
  A        plain TRL ``SFTTrainer`` with its own vision collator and defaults (gradient checkpointing,
           padded batches of 4, SDPA, every non-pad token trained, dataloader_num_workers=0, dropout 0.05)
  B        the recipe as shipped: ``recipes/eo_gym_4b.yaml`` read by TrlParser as ``recipes/eo_gym_4b.py``
           reads it, its model, collator and trainer built by the recipe's own builders in
           ``eogym_sft/training/sft.py`` (per-device batch x --grad-accum micro-batches a step; with the
           YAML's 2, the same 4 samples a step as A)
  B-...    B with one feature switched (see ARMS)

Per arm: real (non-pad) tokens/s wall-clock including data loading, supervised tokens/s, peak
allocated/reserved GPU memory, MFU against 790 TFLOP/s (formula in docs/benchmarks.md), time to first
step, the dataloader wait fraction (time between a step's end and the next step's start), and each step's
training loss (the B arms start from the same adapter on the same micro-batches, so their losses compare).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as the recipe sets it, for every arm

import torch  # noqa: E402
import yaml  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from common import generate_sample  # noqa: E402
from step_probe import ProfileLastStep, RecompileLog, StepProbe, annotate, component_times  # noqa: E402

from eogym_sft.config import ImageConfig  # noqa: E402
from eogym_sft.training.trainer import stop_dataloader_workers  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU only for a smoke run with a tiny --config
PEAK_FLOPS = 790e12  # the H200 bf16 dense figure that MFU is computed against (docs/benchmarks.md, MFU formula)

RECIPE = yaml.safe_load((REPO / "recipes/eo_gym_4b.yaml").read_text())
# B is the recipe as shipped, read from its YAML; the bench only shortens a step to --grad-accum micro-batches.
SHIPPED = {
    "pack": RECIPE["padding_free"],
    "attn": RECIPE["attn_implementation"],
    "gc": False,  # the recipe leaves it and the batch to the memory plan, which picks these two on an H200
    "compile": RECIPE["compile_layers"],
    "rebalance": RECIPE["train_sampling_strategy"] == "batch_rebalance",
    "workers": RECIPE["dataloader_num_workers"],
    "prefetch": RECIPE.get("dataloader_prefetch_factor"),  # None: the trainer keeps a whole step in flight
    "dropout": RECIPE["lora_dropout"],
    "batch": 2,
    "nan_filter": RECIPE["logging_nan_inf_filter"],
    # the recipe's own, switched off by the bench only for an arm that measures them
    "model_dtype_pixels": True,  # build_collator: pixel_values in the model's dtype (bf16), not float32
    "host_layout": True,  # build_collator: what the forward would read back from the GPU, from the workers
    "patch_matmul": True,  # load_base_model: the vision tower's patch embedding as one matmul (models/patch_embed.py)
    "compile_vision": True,  # build_model under compile_layers: the vision blocks and mergers compiled (models/vision_blocks.py)
}
ARMS = {
    "A": None,
    "B": {},
    "B-b1": {"batch": 1},  # one sample (at most 8,192 tokens) a micro-batch: the 80 GB setting
    "B-b1-GC": {"batch": 1, "gc": True},  # the 24 GB setting
    "B-GC": {"gc": True},
    "B-nocompile": {"compile": False},
    "B-fixedcount": {"rebalance": False},
    "B-padded": {"pack": False},
    "B-flash": {"attn": "eogym_varlen"},  # flash's varlen kernel (B: cuDNN's, per sample)
    "B-dropout0": {"dropout": 0.0},
    "B-workers4": {"workers": 4},  # the first step waits longer for its 32 micro-batches
    "B-prefetch2": {"prefetch": 2},  # torch's default queue: 2 micro-batches a worker in flight
    "B-nanfilter": {"nan_filter": True},  # transformers' default: a host sync after every micro-batch
    "B-pixels32": {"model_dtype_pixels": False},  # the processor's float32 pixel_values (twice the bytes to pin and copy)
    "B-syncs": {"host_layout": False},  # no HostLayout: the forward reads its layout back from the GPU (about 104 syncs a micro-batch)
    "B-b1-syncs": {"batch": 1, "host_layout": False},  # B-syncs at the 80 GB setting, against B-b1 on an H100
    "B-conv3d": {"patch_matmul": False},  # transformers' Conv3d patch embedding, on the same weights
    "B-b1-conv3d": {"batch": 1, "patch_matmul": False},  # B-conv3d at the 80 GB setting, against B-b1 on an H100
    "B-visioneager": {"compile_vision": False},  # the vision tower eager, transformers' per-image SDPA loop
    "B-b1-visioneager": {"batch": 1, "compile_vision": False},  # B-visioneager at the 80 GB setting, against B-b1
    # B without the two vision-tower levers (patch matmul, compiled vision blocks): their sum
    "B-nolevers": {"patch_matmul": False, "compile_vision": False},
    "B-b1-nolevers": {"batch": 1, "patch_matmul": False, "compile_vision": False},  # B-nolevers against B-b1 (80 GB)
}


def arm_settings(arm: str) -> dict | None:
    """A B arm's settings: the shipped ones with the arm's changes (``None`` for plain TRL's arm A)."""
    return None if ARMS[arm] is None else dict(SHIPPED, **ARMS[arm])


def _memory(kind: str) -> float:
    if DEVICE != "cuda":
        return 0.0
    return (torch.cuda.max_memory_allocated() if kind == "allocated" else torch.cuda.max_memory_reserved()) / 2**30


def flops_per_sample(lengths_and_sup, images, cfg) -> float:
    """Model FLOPs of one step (formula in docs/benchmarks.md)."""
    t, v = cfg["text_config"], cfg["vision_config"]
    h, inter, layers = t["hidden_size"], t["intermediate_size"], t["num_hidden_layers"]
    hq, hkv, d = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    body = layers * (h * hq * d * 2 + h * hkv * d * 2 + 3 * h * inter)  # q,o + k,v + MLP
    lora = layers * 16 * (h + hq * d + 2 * (h + hkv * d) + hq * d + h + 3 * (h + inter))
    total = 0.0
    for length, supervised in lengths_and_sup:
        total += length * (4 * body + 6 * lora) + 3 * 2 * length * length * hq * d * layers
        total += supervised * 4 * h * t["vocab_size"]
    vh, depth = v["hidden_size"], v["depth"]
    vit_linear = depth * (4 * vh * vh + 2 * vh * v["intermediate_size"])
    for n_patches in images:
        total += 2 * vit_linear * n_patches + 4 * n_patches * n_patches * vh * depth
    return total


def prepare_data(workdir: Path, rows: int, model_dir: Path, max_pixels: int = ImageConfig.max_pixels):
    """``rows`` rows of the bench's sample, prepared by the recipe's :func:`build_datasets` into ``workdir/prepared``."""
    from eogym_sft.models.processor import load_processor
    from eogym_sft.training.sft import build_datasets

    jsonl, root = generate_sample(workdir / "sample", rows=rows, seed=0)
    min_pixels = min(ImageConfig.min_pixels, max_pixels)  # a CPU smoke run's cap may be under the floor
    processor = load_processor(str(model_dir), max_pixels, min_pixels)
    script, training, model_args = recipe_configs(SHIPPED, workdir, 1, 1, model_dir, root)
    script.dataset_path, script.prepared_dir = str(jsonl), str(workdir / "prepared")
    script.max_pixels, script.min_pixels = max_pixels, min_pixels
    dataset, _, stats = build_datasets(script, training, model_args, processor)
    return dataset, stats, root, processor


def trl_dataset(dataset, root: Path, processor):
    """Arm A's rows: the same conversations as rendered text plus images, for TRL's own collator."""
    from datasets import Dataset, Image, Sequence

    from eogym_sft.data.encoding import render

    rows = {"text": [], "images": []}
    for sample in dataset:
        rows["text"].append(render(processor, json.loads(sample["messages"]), json.loads(sample["tools"])))
        rows["images"].append([str(root / p) for p in sample["images"]])
    return Dataset.from_dict(rows).cast_column("images", Sequence(Image()))


COUNTS_KEY = "_bench_counts"  # where CountingCollator puts a micro-batch's counts; Counted takes them out


def batch_counts(batch: dict) -> tuple[list[int], int, list[int]]:
    """A collated micro-batch's sample lengths (real tokens), supervised tokens and image patch counts."""
    if "attention_mask" in batch:
        lengths = batch["attention_mask"].sum(-1).tolist()
    else:
        pos = batch["position_ids"][0].reshape(-1)
        starts = (pos == 0).nonzero().flatten().tolist() + [pos.numel()]
        lengths = [b - a for a, b in zip(starts[:-1], starts[1:])]
    sup = int((batch["labels"][:, 1:] != -100).sum())
    grid = batch.get("image_grid_thw")
    return lengths, sup, [] if grid is None else grid.prod(-1).tolist()


class CountingCollator:
    """The trainer's collator, plus :func:`batch_counts` of each micro-batch, counted on the host where it is built
    (in the dataloader's workers): counting the GPU copy in the step would add host syncs to what is timed."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, examples):
        batch = self.inner(examples)
        batch[COUNTS_KEY] = batch_counts(batch)  # plain lists: the trainer moves tensors to the GPU, not these
        return batch


class Counted:
    """Record each micro-batch's counts (see :class:`CountingCollator`) as ``compute_loss`` takes it."""

    def __init__(self, trainer):
        self.lengths, self.images, self.real, self.supervised = [], [], [], []
        trainer.data_collator = CountingCollator(trainer.data_collator)  # the dataloader is built in train()
        self.inner = trainer.compute_loss
        trainer.compute_loss = self

    def __call__(self, model, inputs, *args, **kwargs):
        lengths, sup, images = inputs.pop(COUNTS_KEY)
        self.lengths.append([(n, sup / len(lengths)) for n in lengths])
        self.images.append(images)
        self.real.append(sum(lengths))
        self.supervised.append(sup)
        return self.inner(model, inputs, *args, **kwargs)


class StepLosses:
    """Each optimizer step's training loss as the Trainer logs it (the sum of its micro-batches' ``training_step``
    values). Kept on the GPU until the arm ends: an ``.item()`` a micro-batch would add a host sync to what is timed."""

    def __init__(self, trainer):
        self.values = []
        self.inner = trainer.training_step
        trainer.training_step = self

    def __call__(self, *args, **kwargs):
        loss = self.inner(*args, **kwargs)
        self.values.append(loss)
        return loss

    def per_step(self, micro: int) -> list[float]:
        return torch.stack(self.values).view(-1, micro).sum(1).tolist()


def recipe_configs(s: dict, out: Path, steps: int, grad_accum: int, model_dir, root):
    """A B arm's ``(script, training, model)`` configs: the recipe's YAML through TrlParser, as ``recipes/eo_gym_4b.py``
    reads it, with the arm's settings ``s``, the bench's run length and no eval, save or (nearly) logging."""
    from trl import ModelConfig, SFTConfig, TrlParser

    from eogym_sft.config import EOGymScriptArguments

    cpu = DEVICE == "cpu"
    flags = {
        "model_name_or_path": model_dir, "data_root": root, "output_dir": out, "eval_fraction": 0, "eval_strategy": "no",
        "save_strategy": "no", "logging_steps": 1000, "report_to": "none", "max_steps": steps,
        "gradient_accumulation_steps": grad_accum, "per_device_train_batch_size": s["batch"], "padding_free": s["pack"],
        "attn_implementation": s["attn"], "activation_checkpointing": s["gc"], "compile_layers": s["compile"],
        "train_sampling_strategy": "batch_rebalance" if s["rebalance"] else "random", "lora_dropout": s["dropout"],
        "dataloader_num_workers": s["workers"], "dataloader_persistent_workers": s["workers"] > 0,
        "logging_nan_inf_filter": s["nan_filter"], "use_cpu": cpu, "bf16": not cpu,
    }
    if s["prefetch"] is not None and s["workers"] > 0:
        flags["dataloader_prefetch_factor"] = s["prefetch"]
    if cpu:  # a smoke run: the fused optimizer and bf16 are the GPU's
        flags.update(optim="adamw_torch", dtype="float32")
    argv = ["--config", str(REPO / "recipes/eo_gym_4b.yaml")]
    for key, value in flags.items():
        argv += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return TrlParser((EOGymScriptArguments, SFTConfig, ModelConfig), allow_abbrev=False).parse_args_and_config(argv)


def build_trainer(arm: str, base, dataset, root, processor, out: Path, steps: int, grad_accum: int):
    """Arm A: plain TRL. A B arm: the recipe's configs (:func:`recipe_configs`) through the recipe's builders, on
    ``base``; the bench itself only switches off what an arm measures (the patch matmul, the compiled vision
    blocks, the collator's pixel dtype and host layout)."""
    from dataclasses import replace

    from trl import SFTConfig, SFTTrainer

    from eogym_sft.models.loading import compile_language_layers
    from eogym_sft.training.sft import build_collator, build_model
    from eogym_sft.training.sft import build_trainer as recipe_trainer

    if arm == "A":
        from peft import LoraConfig

        from eogym_sft.models.loading import LORA_TARGETS

        base.set_attn_implementation("sdpa")
        _patch_conv3d(base)  # plain transformers: its Conv3d patch embedding
        args = SFTConfig(
            output_dir=str(out), max_steps=steps, learning_rate=1e-4, bf16=DEVICE == "cuda", logging_steps=1000,
            save_strategy="no", report_to="none", seed=42, remove_unused_columns=False, max_length=None,
            use_cpu=DEVICE == "cpu", activation_checkpointing_kwargs={"use_reentrant": False},
            per_device_train_batch_size=4, activation_checkpointing=True, dataloader_num_workers=0,
        )
        peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=list(LORA_TARGETS), task_type="CAUSAL_LM")
        return SFTTrainer(model=base, args=args, train_dataset=trl_dataset(dataset, root, processor), processing_class=processor, peft_config=peft_config)
    s = arm_settings(arm)
    script, training, model_args = recipe_configs(s, out, steps, grad_accum, out.parent / "processor", root)  # build_base's folder
    base.set_attn_implementation({"text_config": s["attn"], "vision_config": "sdpa"})  # load_base_model's, on this base
    if not s["patch_matmul"]:
        _patch_conv3d(base)
    eager_vision = s["compile"] and not s["compile_vision"]
    script.compile_layers = s["compile"] and not eager_vision
    model = build_model(script, training, model_args, base=base)  # seeded: the same adapter in every B arm
    if eager_vision:
        compile_language_layers(model)
    collator = build_collator(script, training, processor, model)
    if not (s["model_dtype_pixels"] and s["host_layout"]):
        collator = replace(collator, pixel_dtype=collator.pixel_dtype if s["model_dtype_pixels"] else None,
                           host_layout=s["host_layout"], vision=collator.vision if s["host_layout"] else None)
    return recipe_trainer(training, model, collator, processor, dataset)


def _patch_conv3d(model) -> None:
    """transformers' ``Conv3d`` back in the patch embedding, on the same parameters (``B-conv3d``; ``_restore`` undoes it)."""
    from eogym_sft.models.patch_embed import PatchMatmul

    for module in model.modules():
        if isinstance(getattr(module, "proj", None), PatchMatmul):
            module.proj = module.proj.as_conv3d()


def _uncompile(model) -> None:
    """Arms share the base model: drop what ``Module.compile`` set on its layers for one arm."""
    for module in model.modules():
        if getattr(module, "_compiled_call_impl", None) is not None:
            module._compiled_call_impl = None
    torch._dynamo.reset()


def run_arm(arm: str, base, dataset, root, processor, cfg, workdir: Path, steps: int, warmup: int, grad_accum: int,
            profile: bool = False, trace: str | None = None) -> dict:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    micro = 1 if arm == "A" else grad_accum
    extra = 1 if profile else 0  # the profiled step runs after the timed ones and is not timed
    trainer = build_trainer(arm, base, dataset, root, processor, workdir / arm, steps + warmup + extra, micro)
    probe = StepProbe()
    trainer.add_callback(probe)
    profiler = ProfileLastStep(steps + warmup, micro, trace=trace) if profile else None
    hooks = []
    settings = arm_settings(arm) or {}
    if profiler:
        trainer.add_callback(profiler)
        hooks += annotate(trainer.model)
    counted = Counted(trainer)
    losses = StepLosses(trainer)
    t0 = time.perf_counter()
    try:
        with RecompileLog() as recompiles:
            trainer.train()
    finally:
        stop_dataloader_workers(trainer)  # the TRL arms' SFTTrainer does not (ours does in train())
        for handle in hooks:
            handle.remove()
        _restore(base, trainer.model)
        del trainer
    timing = probe.summary(warmup, skip_last=extra)
    wall = timing["timed_wall_s"]
    world = int(_all_ranks_sum(1))
    # Token and FLOP counts are summed over every GPU; figures below are per GPU.
    skip, stop = warmup * micro, (warmup + steps) * micro  # Counted sees micro-batches, the probe optimizer steps
    real = _all_ranks_sum(sum(counted.real[skip:stop])) / world
    sup = _all_ranks_sum(sum(counted.supervised[skip:stop])) / world
    local_flops = sum(flops_per_sample(counted.lengths[i], counted.images[i], cfg) for i in range(skip, stop))
    flops = _all_ranks_sum(local_flops) / world
    result = {
        "arm": arm,
        "settings": settings or "TRL defaults",
        "micro_batches_per_step": micro,
        "max_micro_batch_tokens": max(counted.real[skip:stop]),
        "gpus": world,
        "real_tokens_per_s": real / wall,
        "supervised_tokens_per_s": sup / wall,
        "real_tokens_per_step": real / timing["timed_steps"],
        "peak_allocated_gib": _memory("allocated"),
        "peak_reserved_gib": _memory("reserved"),
        "mfu": flops / wall / PEAK_FLOPS,
        **timing,
        "time_to_first_step_s": probe.ends[0] - t0,  # from the call to train(): dataloader and optimizer set-up included
        # of it, before the Trainer's loop begins (on_train_begin): a later arm's first step is best read from the loop
        "pre_loop_s": probe.train_start - t0,
        # a step's pace is its tokens over its seconds; a trend across steps shows what warms up late
        "timed_step_s": [e - b for b, e in zip(probe.begins[warmup:warmup + steps], probe.ends[warmup:warmup + steps])],
        "timed_step_real_tokens": [sum(counted.real[i * micro:(i + 1) * micro]) for i in range(warmup, warmup + steps)],
        "recompiles": len(recompiles.messages),
        "recompile_reasons": recompiles.reasons(),
        # warm-up steps included; between B arms that batch alike they compare (bench/README.md)
        "step_losses": losses.per_step(micro),
    }
    if profiler:
        result["profile"] = component_times(profiler.prof, RECIPE["lora_r"], cfg["text_config"]["vocab_size"], profiler.window_s)
        result["profile"]["window"] = f"last {min(2, micro)} micro-batches and the optimizer step of step {steps + warmup + 1}"
    return result


def _restore(base, model) -> None:
    """Arms share the base model: undo what an arm switched on for itself, whether it ran or failed."""
    from peft import PeftModel

    from eogym_sft.models.patch_embed import patch_embed_as_matmul

    if isinstance(model, PeftModel):
        model.unload()
    base.activation_checkpointing_disable()
    base.disable_input_require_grads()
    patch_embed_as_matmul(base)
    _uncompile(base)
    if DEVICE == "cuda":
        import gc

        gc.collect()
        torch.cuda.empty_cache()


def build_base(config_path: Path, workdir: Path):
    """The model every arm shares: ``config_path``'s architecture with random weights, readied as
    ``load_base_model`` readies a checkpoint; and its folder (config and processor) for the configs' model path."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from eogym_sft.models.attention import (
        add_sample_boundaries,
        register_varlen_attention,
    )
    from eogym_sft.models.patch_embed import patch_embed_as_matmul
    from eogym_sft.models.tiny import build_offline_processor

    register_varlen_attention()
    cfg = json.loads(config_path.read_text())
    model_dir = workdir / "processor"
    build_offline_processor().save_pretrained(model_dir)
    (model_dir / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(0)
    with torch.device(DEVICE):
        base = Qwen3VLForConditionalGeneration(Qwen3VLConfig.from_dict(cfg))
    base = base.to(torch.bfloat16 if DEVICE == "cuda" else torch.float32)
    base.config.use_cache = False
    add_sample_boundaries(base)  # as load_base_model does; acts only while the text tower runs an eogym_varlen kernel
    patch_embed_as_matmul(base)  # as load_base_model does
    return base, cfg, model_dir


@torch.no_grad()
def loss_parity(base, dataset, root, processor, n_samples: int = 4) -> dict:
    """The same 4 samples: padded + SDPA + full logits (the plain path) against packed + varlen + the
    supervised-only head (the shipped path), eager and with the decoder layers compiled by Inductor.
    Equal up to bf16 rounding."""
    from eogym_sft.metrics.token_accuracy import IGNORE_INDEX
    from eogym_sft.models.loading import compile_language_layers
    from eogym_sft.data.collator import EOGymCollator

    examples = [dataset[i] for i in range(n_samples)]
    out = {}
    paths = (("padded_sdpa_full_logits", "sdpa", False), ("packed_varlen_supervised_head", "eogym_varlen", True),
             ("packed_varlen_supervised_head_compiled", "eogym_varlen", True))
    for name, attn, pack in paths:
        base.set_attn_implementation({"text_config": attn, "vision_config": "sdpa"})
        if name.endswith("compiled"):
            compile_language_layers(base)
        batch = {k: v.to(DEVICE) for k, v in EOGymCollator(processor, data_root=str(root), padding_free=pack)(examples).items()}
        if pack:
            labels = batch.pop("labels")
            keep = (labels[:, 1:] != IGNORE_INDEX).any(0).nonzero().flatten()
            logits = base(**batch, use_cache=False, logits_to_keep=keep).logits.float()
            loss = torch.nn.functional.cross_entropy(logits[0], labels[0, 1:][keep], ignore_index=IGNORE_INDEX)
        else:
            loss = base(**batch, use_cache=False).loss
        out[name] = loss.item()
    _uncompile(base)
    reference = out["padded_sdpa_full_logits"]
    out["abs_diff"] = abs(reference - out["packed_varlen_supervised_head"])
    out["abs_diff_compiled"] = abs(reference - out["packed_varlen_supervised_head_compiled"])
    return out


def _all_ranks_sum(value: float) -> float:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        t = torch.tensor([float(value)], device=DEVICE)
        torch.distributed.all_reduce(t)
        return t.item()
    return value


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(REPO / "recipes/configs/qwen3_vl_4b_instruct.json"))
    parser.add_argument("--rows", type=int, default=160)
    parser.add_argument("--max-pixels", type=int, default=ImageConfig.max_pixels, help="pixel cap per image (smaller for a CPU smoke run)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per arm")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--parity-samples", type=int, default=4, help="samples in the loss-parity batch (0: skip)")
    parser.add_argument("--grad-accum", type=int, default=2, help="micro-batches a step for the B arms (the recipe has 32)")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--profile", default="", help="comma-separated arms to profile for one extra step (component breakdown)")
    parser.add_argument("--trace", default=None, help="with --profile: the profiled window's Chrome trace, gzipped, to "
                        "this path (ARM in it replaced by the arm's name); open it in Perfetto")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from accelerate import PartialState

    state = PartialState()  # under `accelerate launch` this joins the process group, one GPU a process
    if DEVICE == "cuda":
        torch.cuda.set_device(state.local_process_index)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_train_"))
    with state.main_process_first():
        base, cfg, model_dir = build_base(Path(args.config), workdir)
        dataset, stats, root, processor = prepare_data(workdir, args.rows, model_dir, args.max_pixels)
    parity = None
    if state.num_processes == 1 and args.parity_samples:
        parity = loss_parity(base, dataset, root, processor, args.parity_samples)
    if state.is_main_process:
        print("loss parity:", json.dumps(parity), flush=True)
    results = []
    for arm in args.arms.split(","):
        try:
            profile = arm in args.profile.split(",")
            trace = args.trace.replace("ARM", arm) if args.trace and profile else None
            results.append(run_arm(arm, base, dataset, root, processor, cfg, workdir, args.steps, args.warmup, args.grad_accum,
                                   profile, trace))
        except Exception as err:  # a failing arm is reported, not hidden, and the others still run
            traceback.print_exc()
            results.append({"arm": arm, "error": f"{type(err).__name__}: {err}"})
        if state.is_main_process:
            print(json.dumps(results[-1]), flush=True)
            if args.json:  # written after every arm, so a run cut short keeps what it measured
                Path(args.json).with_suffix(".partial.json").write_text(json.dumps(results, indent=2))
    anchor = next((r for r in results if r["arm"] == "A" and "error" not in r), None)
    for r in results:
        if anchor and "error" not in r:
            r["vs_A"] = r["real_tokens_per_s"] / anchor["real_tokens_per_s"]
    report = {
        "date": dt.date.today().isoformat(),
        "command": "python bench/train_throughput.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "versions": {m.__name__: m.__version__ for m in (torch, __import__("transformers"), __import__("trl"), __import__("peft"))},
        "data": {k: stats[k] for k in ("samples_out", "tokens_total", "trained_token_share", "image_token_share")},
        "loss_parity": parity,
        "results": results,
    }
    if not state.is_main_process:
        return report
    print(format_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


def format_table(report: dict) -> str:
    head = f"{'arm (per GPU)':<20}{'real tok/s':>12}{'sup tok/s':>11}{'vs A':>7}{'MFU':>7}{'alloc GiB':>10}{'rsrv GiB':>10}{'1st step s':>11}{'wait':>7}"
    lines = [head]
    for r in report["results"]:
        if "error" in r:
            lines.append(f"{r['arm']:<20}ERROR {r['error'][:100]}")
            continue
        lines.append(
            f"{r['arm']:<20}{r['real_tokens_per_s']:>12.0f}{r['supervised_tokens_per_s']:>11.0f}{r.get('vs_A', float('nan')):>7.2f}"
            f"{r['mfu']:>7.1%}{r['peak_allocated_gib']:>10.1f}{r['peak_reserved_gib']:>10.1f}{r['time_to_first_step_s']:>11.1f}"
            f"{r['dataloader_wait_fraction']:>7.1%}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
