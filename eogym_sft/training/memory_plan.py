"""How a step's samples are grouped and whether layers are recomputed, chosen from the GPU's memory.

A step's loss is the token mean over all its samples, so how they are grouped into micro-batches does not
change the update; it changes the peak memory and the speed. The plan predicts a micro-batch's peak from named
terms (:func:`peak_terms`): the frozen weights, LoRA's weights, gradients and optimizer state (split by ZeRO over
the processes), the decoder's activations per token (with and without activation checkpointing, LoRA's dropped
inputs by target), the vision tower per patch, the loss over the supervised positions, attention's backward
workspace and a fixed part (CUDA workspaces, compiled graphs). It then takes the fewest micro-batches a step
whose largest micro-batch fits, with no checkpointing if one fits, and layers recomputed only when none does
(:func:`choose`). With a prepared dataset the micro-batches are the ones :class:`TokenBalancedSampler` will deal,
every step of every epoch; without one, the worst case: every sample ``max_length`` tokens (:func:`worst_case_batches`).

Nothing here touches a GPU: ``eogym-sft plan`` runs it anywhere, and the recipe calls it with the free memory
it reads at start (:mod:`eogym_sft.training.memory_hook`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

GIB = 2**30
# The settings the plan chooses when they are not given (on the command line or in the config file).
PLANNED = ("per_device_train_batch_size", "gradient_accumulation_steps", "activation_checkpointing")
# Activation checkpointing, least recompute first: off, every 2nd decoder layer, every layer.
CHECKPOINT_CHOICES = (0, 2, 1)


@dataclass(frozen=True)
class Calibration:
    """The measured constants of the memory model, in bytes (what is not measured is computed from shapes)."""

    layer_bytes_per_token: float  # what a decoder layer keeps for its backward, per token, LoRA's dropped inputs aside
    checkpointed_layer_bytes_per_token: float  # what a checkpointed layer keeps per token (its input)
    vision_bytes_per_patch: float  # the vision tower's forward, per patch (nothing of it is kept: it does not train)
    fixed_bytes: float  # CUDA and cuBLAS workspaces, compiled graphs' buffers, the allocator's rounding at the peak
    reserved_over_allocated: float  # the caching allocator's reserve over its peak allocation (expandable segments)
    budget_margin_bytes: float  # free memory left unplanned: NCCL, cuDNN plans, another process's growth
    dropped_input_bytes_per_element: float = 2.0  # LoRA dropout's output, kept per input element of each target (bf16)
    loss_bytes_per_logit: float = 8.0  # the loss per supervised position and vocab entry (bench/sft_loss.py's peak)


# The one calibration table. Fitted by `python bench/memory_plan.py --fit` from the peaks it measures (one H200,
# the Qwen3-VL-4B architecture, the bench's EO-Gym-shaped data, compiled layers, cuDNN attention); the figures and
# the command are in docs/benchmarks.md ("The memory plan"). Until an H100 run refits it, the values come from the
# H200 peaks there: one sample a micro-batch, two, and one with activation checkpointing.
CALIBRATION = Calibration(
    layer_bytes_per_token=106_750.0,
    checkpointed_layer_bytes_per_token=6_150.0,
    vision_bytes_per_patch=60_000.0,  # not measured yet: the tower's phase is never the peak at these sizes
    fixed_bytes=1.0 * GIB,
    reserved_over_allocated=1.06,
    budget_margin_bytes=2.0 * GIB,
)


@dataclass(frozen=True)
class ModelShape:
    """What the memory model reads of the architecture and the LoRA adapter."""

    parameters: int  # every weight of the model (embeddings tied to the LM head counted once)
    layers: int
    hidden: int
    vocab: int
    attention_width: int  # heads x head dim
    lora_parameters: int
    lora_inputs: int  # input features summed over one decoder layer's LoRA targets
    patches_per_token: int  # vision patches merged into one image token
    weight_bytes: int = 2  # bf16

    @classmethod
    def of(cls, config: dict, targets, rank: int) -> ModelShape:
        """From a Qwen3-VL ``config.json`` (as a dict) and the LoRA targets and rank."""
        if config.get("model_type") != "qwen3_vl":
            raise ValueError(f"the memory plan knows Qwen3-VL (model_type qwen3_vl), not {config.get('model_type')!r}")
        t, v = config["text_config"], config["vision_config"]
        h, inter, layers, vocab = t["hidden_size"], t["intermediate_size"], t["num_hidden_layers"], t["vocab_size"]
        q, kv = t["num_attention_heads"] * t["head_dim"], t["num_key_value_heads"] * t["head_dim"]
        shapes = {  # (in, out) of each projection a LoRA target may name
            "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h),
        }
        unknown = sorted(set(targets) - set(shapes))
        if unknown:
            raise ValueError(f"lora_target_modules {unknown} are not language-model projections of Qwen3-VL: {sorted(shapes)}")
        layer = sum(i * o for i, o in shapes.values()) + 2 * t["head_dim"] + 2 * h
        tied = t.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
        text = vocab * h * (1 if tied else 2) + layers * layer + h
        return cls(
            parameters=text + vision_parameters(v), layers=layers, hidden=h, vocab=vocab, attention_width=q,
            lora_parameters=layers * sum(rank * sum(shapes[name]) for name in targets),
            lora_inputs=sum(shapes[name][0] for name in targets), patches_per_token=v["spatial_merge_size"] ** 2,
        )


def vision_parameters(v: dict) -> int:
    """Qwen3-VL's vision tower, its patch merger and DeepStack mergers (biases and norms included)."""
    hv, iv, merged = v["hidden_size"], v["intermediate_size"], v["hidden_size"] * v["spatial_merge_size"] ** 2
    patch = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2 * hv + hv
    block = 4 * hv + (hv * 3 * hv + 3 * hv) + (hv * hv + hv) + (hv * iv + iv) + (iv * hv + hv)
    merger = (merged * merged + merged) + (merged * v["out_hidden_size"] + v["out_hidden_size"])
    deepstack = len(v.get("deepstack_visual_indexes", ())) * (merger + 2 * merged)
    return patch + v["num_position_embeddings"] * hv + v["depth"] * block + merger + 2 * hv + deepstack


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch's sizes: what its peak depends on."""

    tokens: int
    supervised: int
    image_tokens: int
    samples: int = 1


@dataclass(frozen=True)
class Setup:
    """How the run trains, beside the micro-batches: processes, ZeRO stage, LoRA dropout, checkpointing."""

    processes: int = 1
    zero_stage: int = 0  # 0: one process or DDP; 1-3: DeepSpeed ZeRO
    lora_dropout: float = 0.05
    checkpoint_every: int = 0  # 0: no activation checkpointing; N: every N-th decoder layer recomputed


def checkpointed_layers(layers: int, every: int) -> int:
    """Decoder layers that transformers' ``every_n_layers`` checkpoints (layer 0, N, 2N, ...)."""
    return 0 if every == 0 else math.ceil(layers / every)


def static_terms(shape: ModelShape, setup: Setup, cal: Calibration | None = None) -> dict[str, float]:
    """Bytes that do not depend on the micro-batch. LoRA weights are float32 (PEFT's), their gradients too;
    AdamW's two moments are float32; ZeRO-1 and up split the optimizer state over the processes, ZeRO-2 and up
    the gradients as well."""
    cal = cal or CALIBRATION
    split_optimizer = setup.processes if setup.zero_stage >= 1 else 1
    split_gradients = setup.processes if setup.zero_stage >= 2 else 1
    return {
        "frozen_weights": shape.parameters * shape.weight_bytes,
        "lora_weights": shape.lora_parameters * 4,
        "lora_gradients": shape.lora_parameters * 4 / split_gradients,
        "optimizer_state": shape.lora_parameters * 8 / split_optimizer,
        "fixed": cal.fixed_bytes,
    }


def activation_bytes_per_token(shape: ModelShape, setup: Setup, cal: Calibration | None = None) -> dict[str, float]:
    """Per token: what the decoder keeps until the backward, and what one recomputed layer rebuilds."""
    cal = cal or CALIBRATION
    dropped = cal.dropped_input_bytes_per_element * shape.lora_inputs if setup.lora_dropout > 0 else 0.0
    full = cal.layer_bytes_per_token + dropped
    kept_layers = checkpointed_layers(shape.layers, setup.checkpoint_every)
    return {
        "kept": (shape.layers - kept_layers) * full + kept_layers * cal.checkpointed_layer_bytes_per_token,
        "recomputed": full if kept_layers else 0.0,
    }


def peak_terms(shape: ModelShape, setup: Setup, batch: MicroBatch, cal: Calibration | None = None) -> dict[str, float]:
    """The named terms of one micro-batch's peak, in bytes, and the peak (``allocated``, ``reserved``).

    The vision tower runs first and keeps nothing; then the decoder's kept activations grow to the end of the
    forward, where the loss's logits join them; in the backward a recomputed layer and attention's workspace
    come and go one layer at a time. The peak is the larger of the tower's phase and the decoder's."""
    cal = cal or CALIBRATION
    per_token = activation_bytes_per_token(shape, setup, cal)
    terms = dict(static_terms(shape, setup, cal))
    terms["vision_tower"] = batch.image_tokens * shape.patches_per_token * cal.vision_bytes_per_patch
    terms["decoder_activations"] = batch.tokens * per_token["kept"]
    terms["loss"] = batch.supervised * shape.vocab * cal.loss_bytes_per_logit
    terms["recomputed_layer"] = batch.tokens * per_token["recomputed"]
    terms["attention_workspace"] = batch.tokens * shape.attention_width * 4  # float32 dQ accumulator of one layer
    static = sum(static_terms(shape, setup, cal).values())
    backward = max(terms["loss"], terms["recomputed_layer"] + terms["attention_workspace"])
    terms["allocated"] = static + max(terms["vision_tower"], terms["decoder_activations"] + backward)
    terms["reserved"] = terms["allocated"] * cal.reserved_over_allocated
    return terms


# Without data, the share of a sample's tokens taken as supervised: a sample is a conversation whose prompt (system,
# tool schemas, question, images) and tool results are never supervised. With data the plan reads each sample's count.
WORST_SUPERVISED_SHARE = 0.5


def worst_case_batches(samples: int, max_length: int) -> list[MicroBatch]:
    """Without data: ``samples`` samples of ``max_length`` tokens, each an image's and half of them supervised."""
    tokens = samples * max_length
    return [MicroBatch(tokens, int(tokens * WORST_SUPERVISED_SHARE), tokens, samples)]


@dataclass
class Plan:
    """The chosen grouping and checkpointing, what it is predicted to take and what it was chosen against."""

    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    checkpoint_every: int
    micro_batch_tokens: int  # the largest micro-batch's tokens over the run
    predicted_peak_gib: float  # allocated, at that micro-batch
    predicted_reserved_gib: float
    budget_gib: float
    fits: bool
    terms_gib: dict = field(default_factory=dict)

    @property
    def activation_checkpointing(self) -> bool:
        return self.checkpoint_every > 0

    def to_json(self) -> dict:
        return {**asdict(self), "activation_checkpointing": self.activation_checkpointing}


def batch_sizes(samples_per_step: int, processes: int) -> list[int]:
    """Samples a micro-batch that split a step evenly over the processes, largest first.

    Only exact divisors: the Trainer multiplies ``per_device_train_batch_size`` into the samples its sampler draws a
    step, into the total batch it logs and checkpoints, and into DeepSpeed's batch settings, so a grouping whose
    micro-batches hold a fractional number of samples on average would make those disagree with the step.

    >>> batch_sizes(64, 1)
    [64, 32, 16, 8, 4, 2, 1]
    >>> batch_sizes(64, 16)
    [4, 2, 1]
    """
    if samples_per_step % processes:
        raise ValueError(f"{samples_per_step} samples a step do not split over {processes} processes")
    per_process = samples_per_step // processes
    return [b for b in range(per_process, 0, -1) if per_process % b == 0]


def evaluate(shape: ModelShape, setup: Setup, batches: list[MicroBatch], cal: Calibration | None = None) -> dict:
    """The terms of the micro-batch with the largest predicted peak among ``batches``."""
    return max((peak_terms(shape, setup, b, cal) | {"tokens": b.tokens} for b in batches), key=lambda t: t["reserved"])


def choose(shape: ModelShape, setup: Setup, batches_for, budget_bytes: float, samples_per_step: int, *,
           batch_size: int | None = None, checkpoint_every: int | None = None, cal: Calibration | None = None) -> Plan:
    """The fastest plan that fits ``budget_bytes``: no checkpointing before any, then the most samples a
    micro-batch. ``batches_for(b)`` lists the micro-batches of b samples (on average) a process meets over the run.
    ``batch_size`` and ``checkpoint_every`` given are kept; when nothing fits, the plan returned is the
    smallest-peak one with ``fits`` false."""
    sizes = [batch_size] if batch_size else batch_sizes(samples_per_step, setup.processes)
    checkpoints = [checkpoint_every] if checkpoint_every is not None else list(CHECKPOINT_CHOICES)
    tried = []
    for every in checkpoints:
        for b in sizes:
            worst = evaluate(shape, Setup(setup.processes, setup.zero_stage, setup.lora_dropout, every), batches_for(b), cal)
            plan = make_plan(b, samples_per_step // (b * setup.processes), every, worst, budget_bytes)
            if plan.fits:
                return plan
            tried.append((worst["reserved"], plan))
    return min(tried, key=lambda pair: pair[0])[1]


def make_plan(batch: int, accumulation: int, every: int, worst: dict, budget_bytes: float) -> Plan:
    terms = {k: round(v / GIB, 3) for k, v in worst.items() if k != "tokens"}
    return Plan(
        per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation, checkpoint_every=every,
        micro_batch_tokens=worst["tokens"], predicted_peak_gib=round(worst["allocated"] / GIB, 2),
        predicted_reserved_gib=round(worst["reserved"] / GIB, 2), budget_gib=round(budget_bytes / GIB, 2),
        fits=worst["reserved"] <= budget_bytes, terms_gib=terms,
    )


def budget_bytes(free_bytes: float, cal: Calibration | None = None) -> float:
    """The part of a GPU's free memory the plan may fill."""
    return max(0.0, free_bytes - (cal or CALIBRATION).budget_margin_bytes)


def dealt_batches(lengths: list[int], supervised: list[int], images: list[int], samples_per_step: int, groups: int,
                  steps: int, seed: int, drop_last: bool = False) -> list[MicroBatch]:
    """Every distinct micro-batch :class:`TokenBalancedSampler` deals over ``steps`` optimizer steps, a step's
    samples in ``groups`` groups over all processes (the groups are the same however they are spread over ranks)."""
    from .sampler import TokenBalancedSampler

    sampler = TokenBalancedSampler(lengths, samples_per_step, 1, groups, seed=seed, drop_last=drop_last)
    per_epoch = max(1, len(sampler) // groups)
    seen = set()
    for epoch in range(math.ceil(steps / per_epoch)):
        sampler.set_epoch(epoch)
        for i, group in enumerate(sampler):
            if (epoch * per_epoch) + i // groups >= steps:
                break
            seen.add((sum(lengths[j] for j in group), sum(supervised[j] for j in group), sum(images[j] for j in group), len(group)))
    return [MicroBatch(*sizes) for sizes in sorted(seen)]


def run_steps(n_samples: int, samples_per_step: int, max_steps: int, epochs: float, drop_last: bool = False) -> int:
    """Optimizer steps the run takes, as the Trainer counts them."""
    per_epoch = max(1, n_samples // samples_per_step + (0 if drop_last or n_samples % samples_per_step == 0 else 1))
    return max_steps if max_steps > 0 else math.ceil(epochs * per_epoch)


def ordinal(n: int) -> str:
    """>>> [ordinal(n) for n in (2, 3, 4, 11, 21)]
    ['2nd', '3rd', '4th', '11th', '21st']"""
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def plan_line(plan: Plan, device: str, free_bytes: float, processes: int) -> str:
    """The one line the recipe prints at start."""
    micro = plan.gradient_accumulation_steps
    checkpointing = ("off" if not plan.checkpoint_every else
                     "every layer" if plan.checkpoint_every == 1 else f"every {ordinal(plan.checkpoint_every)} layer")
    return (
        f"memory plan: {device}, {free_bytes / GIB:.1f} GiB free, budget {plan.budget_gib:.1f} GiB: {micro} micro-batches a "
        f"step on each of {processes} process(es), {plan.per_device_train_batch_size} sample(s) each (largest "
        f"{plan.micro_batch_tokens:,} tokens), activation checkpointing {checkpointing}, predicted peak "
        f"{plan.predicted_peak_gib:.1f} GiB allocated, {plan.predicted_reserved_gib:.1f} GiB reserved"
    )
