"""What Qwen3-VL takes in GPU memory while it trains or generates, as named terms, from its shapes and a few
measured constants (:data:`CALIBRATION`, the one table of them).

A training micro-batch's peak (:func:`peak_terms`): the frozen weights, LoRA's weights, gradients and optimizer
state (split by ZeRO over the processes), what the decoder keeps for the backward per token (with and without
activation checkpointing, LoRA's dropped inputs counted by target), the vision tower per patch, the loss per
supervised position, attention's backward workspace, the pixel values of the micro-batch's whole optimizer step
(:func:`step_input_bytes`) and a fixed part. Generation's (:func:`generation_reserve`):
the merged LoRA weights, a prefill's forward and the tower, beside the KV cache that
:mod:`eogym_sft.agent.rollout_config` sizes. The plan that uses them to choose micro-batches is
:mod:`eogym_sft.training.memory_plan`. Nothing here touches a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

GIB = 2**30


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


# The one calibration table, fitted by `python bench/memory_plan.py --fit bench/results/h100_memory_plan_gc.json` to
# the peaks that bench measured on an H100 (the 4B architecture, the bench's EO-Gym-shaped data, the recipe's
# settings); docs/benchmarks.md ("The memory plan") holds the figures. The vision constant is the tower's own
# increment, not a peak: the tower's phase is never the peak at these sizes.
CALIBRATION = Calibration(
    layer_bytes_per_token=119_720.0,
    checkpointed_layer_bytes_per_token=8_870.0,
    vision_bytes_per_patch=26_690.0,
    fixed_bytes=0.0,  # the fit's intercept, negative unconstrained: nothing beyond the named terms
    reserved_over_allocated=1.041,
    budget_margin_bytes=2.0 * GIB,
    dropped_input_bytes_per_element=1.572,
)
# The widths of the architecture CALIBRATION was measured on (Qwen3-VL-4B, :func:`widths_of`): a decoder layer's,
# a vision block's and the hidden size. Activations scale with them, so another size's constants are these scaled.
CALIBRATED_WIDTHS = (57_344, 16_384, 2_560)


def widths_of(config: dict) -> tuple[int, int, int]:
    """A Qwen3-VL ``config.json``'s activation widths: a decoder layer's (the inputs and outputs of its seven
    projections), a vision block's (likewise, its four) and the hidden size."""
    t, v = config["text_config"], config["vision_config"]
    h, inter = t["hidden_size"], t["intermediate_size"]
    q, kv = t["num_attention_heads"] * t["head_dim"], t["num_key_value_heads"] * t["head_dim"]
    return 7 * h + 2 * q + 2 * kv + 3 * inter, 8 * v["hidden_size"] + 2 * v["intermediate_size"], h


def calibration_for(widths: tuple[int, int, int], cal: Calibration | None = None) -> Calibration:
    """``cal`` (the calibrated architecture's constants) for a model of ``widths``: per-token and per-patch bytes
    scaled by the width ratios; the rest as measured."""
    cal = cal or CALIBRATION
    layer, vision, hidden = (w / c for w, c in zip(widths, CALIBRATED_WIDTHS))
    return replace(cal, layer_bytes_per_token=cal.layer_bytes_per_token * layer,
                   checkpointed_layer_bytes_per_token=cal.checkpointed_layer_bytes_per_token * hidden,
                   vision_bytes_per_patch=cal.vision_bytes_per_patch * vision)


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
    patch_elements: int  # pixel values of one vision patch (channels x frames x patch height x width)
    targeted_weights: int = 0  # weights of the projections LoRA targets, all layers (the slot decoder merges them)
    widths: tuple[int, int, int] = CALIBRATED_WIDTHS  # :func:`widths_of`
    weight_bytes: int = 2  # bf16
    pixel_bytes: int = 2  # the collator's pixel dtype (bfloat16 in the recipes)

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
            raise ValueError(f"lora_target_modules {unknown} are not language-model projections of Qwen3-VL: "
                             f"{sorted(shapes)}")
        layer = sum(i * o for i, o in shapes.values()) + 2 * t["head_dim"] + 2 * h
        tied = t.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
        text = vocab * h * (1 if tied else 2) + layers * layer + h
        return cls(
            parameters=text + vision_parameters(v), layers=layers, hidden=h, vocab=vocab, attention_width=q,
            lora_parameters=layers * sum(rank * sum(shapes[name]) for name in targets),
            lora_inputs=sum(shapes[name][0] for name in targets), patches_per_token=v["spatial_merge_size"] ** 2,
            patch_elements=v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2,
            targeted_weights=layers * sum(i * o for i, o in (shapes[name] for name in targets)),
            widths=widths_of(config),
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
    step_image_tokens: int = 0  # image tokens of its optimizer step's micro-batches on this process (0: its own)


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


def activation_bytes_per_token(shape: ModelShape, setup: Setup, cal: Calibration) -> dict[str, float]:
    """Per token: what the decoder keeps until the backward, and what one recomputed layer rebuilds (``cal``
    already scaled to the shape, :func:`calibration_for`)."""
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
    cal = calibration_for(shape.widths, cal)
    per_token = activation_bytes_per_token(shape, setup, cal)
    terms = dict(static_terms(shape, setup, cal))
    terms["vision_tower"] = batch.image_tokens * shape.patches_per_token * cal.vision_bytes_per_patch
    terms["decoder_activations"] = batch.tokens * per_token["kept"]
    terms["loss"] = batch.supervised * shape.vocab * cal.loss_bytes_per_logit
    terms["recomputed_layer"] = batch.tokens * per_token["recomputed"]
    terms["attention_workspace"] = batch.tokens * shape.attention_width * 4  # float32 dQ accumulator of one layer
    terms["step_inputs"] = step_input_bytes(shape, batch)
    static = sum(static_terms(shape, setup, cal).values())
    backward = max(terms["loss"], terms["recomputed_layer"] + terms["attention_workspace"])
    phase = max(terms["vision_tower"], terms["decoder_activations"] + backward)
    terms["allocated"] = static + terms["step_inputs"] + phase
    terms["reserved"] = terms["allocated"] * cal.reserved_over_allocated
    return terms


def step_input_bytes(shape: ModelShape, batch: MicroBatch) -> float:
    """The pixel values of the micro-batch's whole optimizer step: the Trainer fetches a step's micro-batches before
    its first (to count the step's supervised tokens) and accelerate's loader has already moved each to the GPU, so
    all of them stay there until the step ends."""
    images = max(batch.step_image_tokens, batch.image_tokens)
    return float(images * shape.patches_per_token * shape.patch_elements * shape.pixel_bytes)


def budget_bytes(free_bytes: float, cal: Calibration | None = None) -> float:
    """The part of a GPU's free memory the plan may fill."""
    return max(0.0, free_bytes - (cal or CALIBRATION).budget_margin_bytes)


def generation_reserve(patches_per_token: int, prefill_tokens: int, merged_bytes: float,
                       cal: Calibration | None = None, widths: tuple[int, int, int] = CALIBRATED_WIDTHS,
                       ) -> dict[str, float]:
    """Bytes a slot decoder needs beside the loaded weights and its KV cache: the merged copies of the projections
    LoRA targets (``merged_bytes``, when an adapter runs), the larger of one prefill forward of ``prefill_tokens``
    tokens (a decoder layer's activations per token, nothing kept) and the vision tower on as many image tokens, and
    the margin."""
    cal = calibration_for(widths, cal)
    return {
        "merged_weights": float(merged_bytes),
        "prefill": max(prefill_tokens * cal.layer_bytes_per_token,
                       prefill_tokens * patches_per_token * cal.vision_bytes_per_patch),
        "margin": cal.budget_margin_bytes,
    }


def forward_bytes(batch: MicroBatch, vocab: int, patches_per_token: int, cal: Calibration | None = None,
                  widths: tuple[int, int, int] = CALIBRATED_WIDTHS) -> float:
    """Bytes one forward without gradients takes beside the weights (``validate``'s scoring): the vision tower
    first, then a decoder layer's activations per token (nothing kept) and the logits at the supervised positions;
    and the margin."""
    cal = calibration_for(widths, cal)
    decoder = batch.tokens * cal.layer_bytes_per_token + batch.supervised * vocab * cal.loss_bytes_per_logit
    return max(decoder, batch.image_tokens * patches_per_token * cal.vision_bytes_per_patch) + cal.budget_margin_bytes
