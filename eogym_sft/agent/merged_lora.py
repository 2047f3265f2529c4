"""The slot decoder's projections over merged LoRA weights: which weight stands for a projection in the model's
adapter state (:func:`merge_plan`), the merged weight as one matmul (:class:`MergedLinear`), and what a captured
decode step reads through each projection (:func:`reads`). :meth:`~eogym_sft.agent.decoder.SlotDecoder.refresh_weights`
fills the merged buffers.

Each layer projection of the slot decoder (q, k, v, o and the MLP's gate, up and down, which the decoder then
combines itself as the MLP does: :func:`plain_mlp`) runs over the weight :func:`merge_plan` chooses for the model's
adapter state. A plain ``nn.Linear`` (the base model, a projection no adapter targets, adapters disabled or merged)
is called as it is. A PEFT LoRA projection with active adapters runs as one matmul over a merged weight ``W +
scaling * B @ A`` (PEFT's ``get_delta_weight``: scaling, rsLoRA and ``fan_in_fan_out`` included) kept in a buffer:
its unmerged forward is the base matmul, two small LoRA matmuls, a scale and an add, kernels that a decode step pays
for even replayed from CUDA graphs. What a merged weight cannot express (DoRA, a LoRA bias, another PEFT variant,
dropout in training mode, a quantized or non-Linear LoRA layer, ``modules_to_save`` over a projection) keeps that
projection's module forward, one projection at a time; a layer whose MLP is not the plain one calls its MLP.

The merged weight rounds ``W + delta`` once in the weight's dtype, so the logits differ from PEFT's unmerged
forward at that dtype's rounding (bf16's on a GPU; in float32 they agree to about 1e-5). A buffer is allocated
the first time a projection needs one (same dtype and device as its base weight) and kept, so that CUDA graphs
read it at one address: while an adapter is active they hold one more copy of the projection weights (for the
4B: docs/benchmarks.md), and stay allocated when the base arm runs next
(:meth:`~eogym_sft.agent.decoder.SlotDecoder.merged_bytes`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def plain_mlp(mlp) -> bool:
    """Whether ``mlp`` is transformers' Qwen3-VL text MLP, ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, which the
    decoder then computes itself over its projections' weights."""
    return type(mlp).__name__.endswith("TextMLP") and all(hasattr(mlp, name) for name in (*MLP_PROJECTIONS, "act_fn"))


def merge_plan(module):
    """How the decoder runs the projection ``module``: ``(linear, adapters)``, a plain ``nn.Linear`` whose weight and
    bias stand for it once the deltas of the LoRA ``adapters`` are added to that weight (none: the weight as it is),
    or None where only the module's own forward is right.

    A plain ``nn.Linear`` is itself. A PEFT LoRA ``Linear`` over one is its base layer when its adapters are disabled
    or already merged into the base weight, and its base layer plus the active adapters it holds otherwise. None
    (the module called as it is) for another layer type (a quantized or non-Linear LoRA layer, a ``modules_to_save``
    copy, another tuner) and for what ``get_delta_weight`` leaves out: an active adapter with DoRA, a LoRA bias or
    another PEFT variant, dropout in training mode, and adapters merged but disabled (PEFT's forward unmerges them)."""
    if type(module) is torch.nn.Linear:
        return module, []
    if not is_lora_linear(module) or type(module.base_layer) is not torch.nn.Linear:
        return None
    if module.merged:
        return None if module.disable_adapters else (module.base_layer, [])
    if module.disable_adapters:
        return module.base_layer, []
    adapters = [name for name in module.active_adapters if name in module.lora_A]
    if any(not mergeable(module, name) for name in adapters):
        return None
    return module.base_layer, adapters


def is_lora_linear(module) -> bool:
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:
        return False
    return type(module) is Linear


def mergeable(module, adapter: str) -> bool:
    """Whether LoRA ``adapter`` of ``module`` is, in its forward, exactly ``x @ get_delta_weight(adapter).T``."""
    dropout = module.lora_dropout[adapter]
    return not (
        module.use_dora.get(adapter, False)
        or module.lora_bias.get(adapter, False)
        or adapter in getattr(module, "lora_variant", {})
        or (module.training and not isinstance(dropout, torch.nn.Identity))
    )


class MergedLinear:
    """A projection as one matmul over ``weight``, a buffer holding its base layer's weight plus its active LoRA
    deltas, with the base layer's bias."""

    def __init__(self, weight: torch.Tensor, linear: torch.nn.Linear):
        self.weight, self.linear = weight, linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.linear.bias)


def projection_kind(projection) -> str:
    """``"merged"`` (a :class:`MergedLinear`), ``"weight"`` (a plain ``nn.Linear``) or ``"module"`` (anything else)."""
    if isinstance(projection, MergedLinear):
        return "merged"
    return "weight" if type(projection) is torch.nn.Linear else "module"


def reads(projection) -> tuple:
    """What a decode step captured with ``projection`` relies on: the address of the weight it reads, or for a module
    called as it is, the module and its adapter state (a graph replays the adapter it was captured with)."""
    kind = projection_kind(projection)
    if kind != "module":
        return kind, projection.weight.data_ptr()
    state = (getattr(projection, attr, None) for attr in ("active_adapters", "disable_adapters", "merged"))
    return kind, id(projection), *(tuple(v) if isinstance(v, list) else v for v in state)
