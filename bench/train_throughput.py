"""Training throughput on one GPU: plain TRL (arm A) against the SFT recipe (arm B: ``recipes/eo_gym_4b.yaml``
through the recipe's parser and builders in ``eogym_sft/training/sft.py``) and B with one setting switched
(``ARMS``), on the Qwen3-VL-4B architecture with random bf16 weights shared by every arm and the sample of
``bench/common.py`` prepared by the recipe's own ``build_datasets``. Figures: bench/README.md; MFU: docs/benchmarks.md.

    python bench/train_throughput.py --rows 160 --steps 6 --warmup 2 --grad-accum 2 --json bench_train.json
"""

from __future__ import annotations

import argparse
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
from common import command, generate_sample, machine_info, now, runs_table  # noqa: E402

from eogym_sft.config import ImageConfig  # noqa: E402
from eogym_sft.training.trainer import stop_dataloader_workers  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU only for a smoke run with a tiny --config
PEAK_FLOPS = 790e12  # the H200 bf16 dense figure that MFU is computed against (docs/benchmarks.md, MFU formula)

RECIPE = yaml.safe_load((REPO / "recipes/eo_gym_4b.yaml").read_text())
# B is the recipe as shipped, read from its YAML; the bench only shortens a step to --grad-accum micro-batches and
# fixes the two settings the recipe leaves to the memory plan (checkpointing, the batch).
SHIPPED = {
    "pack": RECIPE["padding_free"], "attn": RECIPE["attn_implementation"], "gc": False, "batch": 2,
    "compile": RECIPE["compile_layers"], "rebalance": RECIPE["train_sampling_strategy"] == "batch_rebalance",
    "workers": RECIPE["dataloader_num_workers"], "dropout": RECIPE["lora_dropout"],
    # the recipe's own, switched off by the bench only for an arm that measures them: build_collator's pixel_values in
    # the model's dtype and its host layout (what the forward would read back from the GPU, from the workers),
    # load_base_model's patch embedding as one matmul, build_model's compiled vision blocks (under compile_layers)
    "model_dtype_pixels": True, "host_layout": True, "patch_matmul": True, "compile_vision": True,
}
ARMS = {  # B-b1-X: B-X at one sample (at most 8,192 tokens) a micro-batch, the 80 GB setting (arm_settings)
    "A": None, "B": {}, "B-b1": {"batch": 1}, "B-GC": {"gc": True}, "B-nocompile": {"compile": False},
    "B-fixedcount": {"rebalance": False}, "B-padded": {"pack": False}, "B-dropout0": {"dropout": 0.0},
    "B-flash": {"attn": "eogym_varlen"}, "B-workers4": {"workers": 4},
    "B-pixels32": {"model_dtype_pixels": False},  # the processor's float32 pixel_values
    "B-syncs": {"host_layout": False},  # no HostLayout: the forward reads its layout back from the GPU
    "B-conv3d": {"patch_matmul": False},  # transformers' Conv3d patch embedding, on the same weights
    "B-visioneager": {"compile_vision": False},  # the vision tower eager, transformers' per-image SDPA loop
    "B-nolevers": {"patch_matmul": False, "compile_vision": False},  # both vision-tower levers off
    # the recipe as launched: the memory plan chooses the batch and checkpointing for this GPU, and a step is the
    # recipe's samples_per_step (--grad-accum does not apply)
    "B-plan": {"batch": None, "gc": None},
}


def arm_settings(arm: str) -> dict | None:
    """A B arm's settings: the shipped ones with the arm's changes (``None`` for plain TRL's arm A)."""
    if arm.startswith("B-b1-"):
        return dict(SHIPPED, **ARMS["B-" + arm[5:]], batch=1)
    return None if ARMS[arm] is None else dict(SHIPPED, **ARMS[arm])


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
    """Record each micro-batch's counts (see :class:`CountingCollator`) as ``compute_loss`` takes it, and its
    ``training_step`` loss, kept on the GPU until the arm ends (an ``.item()`` would add a host sync)."""

    def __init__(self, trainer):
        self.lengths, self.images, self.real, self.supervised, self.losses = [], [], [], [], []
        trainer.data_collator = CountingCollator(trainer.data_collator)  # the dataloader is built in train()
        self.inner, self.inner_step = trainer.compute_loss, trainer.training_step
        trainer.compute_loss = self

        def training_step(*args, **kwargs):
            self.losses.append(self.inner_step(*args, **kwargs))
            return self.losses[-1]

        trainer.training_step = training_step

    def __call__(self, model, inputs, *args, **kwargs):
        lengths, sup, images = inputs.pop(COUNTS_KEY)
        self.lengths.append([(n, sup / len(lengths)) for n in lengths])
        self.images.append(images)
        self.real.append(sum(lengths))
        self.supervised.append(sup)
        return self.inner(model, inputs, *args, **kwargs)

    def step_losses(self, micro: int) -> list[float]:
        """Each optimizer step's loss as the Trainer logs it: its micro-batches' ``training_step`` values summed."""
        return torch.stack(self.losses).view(-1, micro).sum(1).tolist()


def compile_stats() -> dict:
    """Dynamo's running totals: graphs compiled and seconds spent compiling (forward and backward)."""
    from torch._dynamo.utils import calculate_time_spent, counters

    spent = calculate_time_spent()
    return {"graphs": int(counters["stats"]["unique_graphs"]), "compile_s": spent.get("total_wall_time", 0.0)}


class StepProbe:
    """Trainer callback: per optimizer step its wall time, the wait before it (the Trainer fetches a step's
    micro-batches before it starts), its optimizer step and the graphs Dynamo compiled since training began (not
    before: another arm in the same process; new graphs after the warm-up are recompiles)."""

    def __init__(self):
        self.train_start = self._pre_optimizer = None
        self.begins, self.ends, self.optimizer_s, self.graphs, self.compile_s = [], [], [], [], []

    def on_train_begin(self, *a, **k):
        self.train_start = now()
        self._compiled_before = compile_stats()  # Dynamo's totals are the process's: count this run's own

    def on_step_begin(self, *a, **k):
        self.begins.append(now())

    def on_pre_optimizer_step(self, *a, **k):
        self._pre_optimizer = now()

    def on_optimizer_step(self, *a, **k):
        self.optimizer_s.append(now() - self._pre_optimizer)

    def on_step_end(self, *a, **k):
        self.ends.append(now())
        stats, before = compile_stats(), self._compiled_before
        self.graphs.append(stats["graphs"] - before["graphs"])
        self.compile_s.append(stats["compile_s"] - before["compile_s"])

    def __getattr__(self, name):  # the other TrainerCallback hooks do nothing
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)

    def summary(self, warmup: int) -> dict:
        """Timing of the steps after ``warmup``."""
        b, e, optimizer = self.begins[warmup:], self.ends[warmup:], sorted(self.optimizer_s[warmup:])
        wall = e[-1] - b[0]
        waits = [b[i + 1] - e[i] for i in range(len(b) - 1)]
        return {
            "timed_steps": len(b), "timed_wall_s": wall, "median_step_s": sorted(y - x for x, y in zip(b, e))[len(b) // 2],
            "first_step_wait_s": self.begins[0] - self.train_start, "dataloader_wait_fraction": sum(waits) / wall,
            "median_optimizer_s": optimizer[len(b) // 2] if optimizer else None, "graphs_compiled_first_step": self.graphs[0],
            "graphs_compiled_after_warmup": self.graphs[-1] - (self.graphs[warmup - 1] if warmup else 0),
            "compile_s_total": self.compile_s[-1], "compile_s_first_step": self.compile_s[0],
        }


def parse_recipe(**flags):
    """The SFT recipe's ``(script, training, model)`` configs: its YAML through its own parser, with ``flags`` as on
    its command line."""
    from eogym_sft.training.sft import recipe_parser

    argv = ["--config", str(REPO / "recipes/eo_gym_4b.yaml")]
    for key, value in flags.items():
        argv += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return recipe_parser().parse_args_and_config(argv)


def recipe_configs(s: dict, out: Path, steps: int, grad_accum: int, model_dir, root):
    """A B arm's configs: the recipe's with the arm's settings ``s``, the bench's run length and no eval or save."""
    cpu = DEVICE == "cpu"
    flags = {
        "model_name_or_path": model_dir, "data_root": root, "output_dir": out, "eval_fraction": 0, "eval_strategy": "no",
        "save_strategy": "no", "logging_steps": 1000, "report_to": "none", "max_steps": steps, "padding_free": s["pack"],
        "attn_implementation": s["attn"], "compile_layers": s["compile"],
        "train_sampling_strategy": "batch_rebalance" if s["rebalance"] else "random", "lora_dropout": s["dropout"],
        "dataloader_num_workers": s["workers"], "dataloader_persistent_workers": s["workers"] > 0,
        "use_cpu": cpu, "bf16": not cpu,
    }
    if s["batch"] is not None:  # else the memory plan's (build_trainer)
        flags.update(gradient_accumulation_steps=grad_accum, per_device_train_batch_size=s["batch"],
                     activation_checkpointing=s["gc"])
    if cpu:  # a smoke run: the fused optimizer and bf16 are the GPU's
        flags.update(optim="adamw_torch", dtype="float32")
    return parse_recipe(**flags)


def build_trainer(arm: str, base, dataset, root, processor, out: Path, steps: int, grad_accum: int):
    """Arm A: plain TRL. A B arm: the recipe's configs (:func:`recipe_configs`) through the recipe's builders, on
    ``base``; the bench itself only switches off what an arm measures (the patch matmul, the compiled vision
    blocks, the collator's pixel dtype and host layout)."""
    from dataclasses import replace

    from trl import SFTConfig, SFTTrainer

    from eogym_sft.models.loading import LORA_TARGETS, compile_language_layers
    from eogym_sft.training.memory_hook import plan_run
    from eogym_sft.training.sft import build_collator, build_model, set_samples_per_step
    from eogym_sft.training.sft import build_trainer as recipe_trainer

    if arm == "A":
        from peft import LoraConfig

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
    if s["batch"] is None:  # as train() plans it, before the model is built
        plan_run(script, training, model_args, dataset, frozenset())
        set_samples_per_step(script, training)
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
    """transformers' ``Conv3d`` back in the patch embedding, on the same parameters (``restore_base`` undoes it)."""
    from eogym_sft.models.patch_embed import PatchMatmul

    for module in model.modules():
        if isinstance(getattr(module, "proj", None), PatchMatmul):
            module.proj = module.proj.as_conv3d()


def restore_base(base, model) -> None:
    """Arms share the base model: undo what an arm switched on for itself (LoRA, checkpointing, the Conv3d patch
    embedding, compiled layers), whether it ran or failed."""
    from peft import PeftModel

    from eogym_sft.models.patch_embed import patch_embed_as_matmul

    if isinstance(model, PeftModel):
        model.unload()
    base.activation_checkpointing_disable()
    base.disable_input_require_grads()
    patch_embed_as_matmul(base)
    for module in base.modules():
        if getattr(module, "_compiled_call_impl", None) is not None:
            module._compiled_call_impl = None
    torch._dynamo.reset()
    if DEVICE == "cuda":
        import gc

        gc.collect()
        torch.cuda.empty_cache()


def _peak_gib() -> tuple[float, float]:
    if DEVICE != "cuda":
        return 0.0, 0.0
    return torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30


def run_arm(arm: str, base, dataset, root, processor, cfg, workdir: Path, steps: int, warmup: int, grad_accum: int) -> dict:
    """Train ``arm`` for ``warmup`` then ``steps`` timed optimizer steps; its figures (bench/README.md)."""
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    trainer = build_trainer(arm, base, dataset, root, processor, workdir / arm, steps + warmup, grad_accum)
    micro = trainer.args.gradient_accumulation_steps  # arm A: 1; B-plan: the plan's
    probe = StepProbe()
    trainer.add_callback(probe)
    counted = Counted(trainer)
    t0 = time.perf_counter()
    try:
        trainer.train()
    finally:
        stop_dataloader_workers(trainer)  # the TRL arms' SFTTrainer does not (ours does in train())
        restore_base(base, trainer.model)
        del trainer
    timing = probe.summary(warmup)
    wall, world = timing["timed_wall_s"], int(_all_ranks_sum(1))
    skip, stop = warmup * micro, (warmup + steps) * micro  # Counted sees micro-batches, the probe optimizer steps
    # token and FLOP counts summed over every GPU; the figures are per GPU
    real = _all_ranks_sum(sum(counted.real[skip:stop])) / world
    sup = _all_ranks_sum(sum(counted.supervised[skip:stop])) / world
    flops = _all_ranks_sum(sum(flops_per_sample(counted.lengths[i], counted.images[i], cfg) for i in range(skip, stop))) / world
    allocated, reserved = _peak_gib()
    return {
        "arm": arm, "settings": arm_settings(arm) or "TRL defaults", "micro_batches_per_step": micro,
        "max_micro_batch_tokens": max(counted.real[skip:stop]), "gpus": world,
        "real_tokens_per_s": real / wall, "supervised_tokens_per_s": sup / wall, "real_tokens_per_step": real / timing["timed_steps"],
        "peak_allocated_gib": allocated, "peak_reserved_gib": reserved, "mfu": flops / wall / PEAK_FLOPS,
        **timing,
        "time_to_first_step_s": probe.ends[0] - t0,  # from the call to train(): dataloader and optimizer set-up included
        "pre_loop_s": probe.train_start - t0,  # of it, before the Trainer's loop begins
        "timed_step_s": [e - b for b, e in zip(probe.begins[warmup:warmup + steps], probe.ends[warmup:warmup + steps])],
        "timed_step_real_tokens": [sum(counted.real[i * micro:(i + 1) * micro]) for i in range(warmup, warmup + steps)],
        "step_losses": counted.step_losses(micro),  # warm-up steps included
    }


def build_base(config_path: Path, workdir: Path):
    """The model every arm shares: ``config_path``'s architecture with random weights, readied as
    ``load_base_model`` readies a checkpoint; and its folder (config and processor) for the configs' model path."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from eogym_sft.models.attention import add_sample_boundaries, register_varlen_attention
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
    add_sample_boundaries(base)  # as load_base_model does
    patch_embed_as_matmul(base)
    return base, cfg, model_dir


@torch.no_grad()
def loss_parity(base, dataset, root, processor, n_samples: int = 4) -> dict:
    """The same samples' loss: padded + SDPA + full logits against packed + varlen + the supervised-only head, eager
    and with the decoder layers compiled. Equal up to bf16 rounding."""
    from eogym_sft.data.collator import EOGymCollator
    from eogym_sft.metrics.token_accuracy import IGNORE_INDEX
    from eogym_sft.models.loading import compile_language_layers

    examples = [dataset[i] for i in range(n_samples)]
    out = {}
    for name, attn, pack in (("padded_sdpa_full_logits", "sdpa", False), ("packed_varlen_supervised_head", "eogym_varlen", True),
                             ("packed_varlen_supervised_head_compiled", "eogym_varlen", True)):
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
    restore_base(base, base)
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


def run_arms(args, state, base, cfg, dataset, root, processor, workdir: Path) -> list[dict]:
    """Every arm of ``--arms`` in turn: a failing arm is reported, not hidden, and the others still run; the results
    so far go to ``*.partial.json`` after each arm, so a run cut short keeps what it measured."""
    results = []
    for arm in args.arms.split(","):
        try:
            steps = args.a_steps if arm == "A" and args.a_steps else args.steps
            results.append(run_arm(arm, base, dataset, root, processor, cfg, workdir, steps, args.warmup, args.grad_accum))
        except Exception as err:
            traceback.print_exc()
            results.append({"arm": arm, "error": f"{type(err).__name__}: {err}"})
        if state.is_main_process:
            print(json.dumps(results[-1]), flush=True)
            if args.json:
                Path(args.json).with_suffix(".partial.json").write_text(json.dumps(results, indent=2))
    anchor = next((r for r in results if r["arm"] == "A" and "error" not in r), None)
    for r in results:
        if anchor and "error" not in r:
            r["vs_A"] = r["real_tokens_per_s"] / anchor["real_tokens_per_s"]
    return results


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(REPO / "recipes/configs/qwen3_vl_4b_instruct.json"), help="architecture JSON")
    parser.add_argument("--rows", type=int, default=160)
    parser.add_argument("--max-pixels", type=int, default=ImageConfig.max_pixels, help="pixel cap per image (smaller for a CPU smoke run)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per arm")
    parser.add_argument("--a-steps", type=int, default=None, help="timed steps for arm A (4 samples each; default --steps): more, so its tok/s is not a few samples' mix")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--parity-samples", type=int, default=4, help="samples in the loss-parity batch (0: skip)")
    parser.add_argument("--grad-accum", type=int, default=2, help="micro-batches a step for the B arms (the recipe has 32)")
    parser.add_argument("--arms", default=",".join(ARMS))
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
    parity = loss_parity(base, dataset, root, processor, args.parity_samples) if state.num_processes == 1 and args.parity_samples else None
    if state.is_main_process:
        print("loss parity:", json.dumps(parity), flush=True)
    report = {
        "command": command("train_throughput", argv), "machine": machine_info(DEVICE),
        "data": {k: stats[k] for k in ("samples_out", "tokens_total", "trained_token_share", "image_token_share")},
        "loss_parity": parity, "results": run_arms(args, state, base, cfg, dataset, root, processor, workdir),
    }
    if state.is_main_process:
        print(format_table(report))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


def format_table(report: dict) -> str:
    columns = [("arm (per GPU)", 16, "arm"), ("real tok/s", 11, "real_tokens_per_s", ".0f"), ("sup tok/s", 10, "supervised_tokens_per_s", ".0f"),
               ("vs A", 6, "vs_A", ".2f"), ("MFU", 6, "mfu", ".1%"), ("alloc GiB", 9, "peak_allocated_gib", ".1f"),
               ("rsrv GiB", 9, "peak_reserved_gib", ".1f"), ("1st step s", 10, "time_to_first_step_s", ".1f"),
               ("wait", 6, "dataloader_wait_fraction", ".1%")]
    return runs_table(report["results"], columns)


if __name__ == "__main__":
    main()
