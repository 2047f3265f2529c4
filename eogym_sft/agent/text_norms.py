"""The text tower's RMSNorms run as torch's fused ``F.rms_norm`` where every one is transformers' plain
Qwen3-VL norm in the activations' dtype (:func:`norms_fuse`), else as their modules."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def norms_fuse(text, dtype) -> bool:
    """Whether every RMSNorm of the text tower ``text`` (each layer's four and the last) can run as torch's fused
    ``F.rms_norm``: each a plain ``weight * x / rms(x)`` (transformers' Qwen3-VL text norm: a ``weight`` and a
    ``variance_epsilon``, nothing else) whose weight has the activations' dtype ``dtype``."""
    norms = [text.norm] + [n for layer in text.layers for n in (layer.input_layernorm, layer.post_attention_layernorm,
                                                                layer.self_attn.q_norm, layer.self_attn.k_norm)]
    return all(
        type(n).__name__.endswith("TextRMSNorm") and hasattr(n, "variance_epsilon") and n.weight.dtype == dtype
        for n in norms
    )


def fused_rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` by torch's one-kernel RMSNorm, for a norm :func:`norms_fuse` accepted. transformers' forward runs
    about seven kernels (casts, square, mean, rsqrt, two products); a decode step runs 145 norms. The result can
    differ from it in the last bit of bf16: the product by the weight is rounded once, not twice."""
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


def module_norm(norm, x: torch.Tensor) -> torch.Tensor:
    return norm(x)
