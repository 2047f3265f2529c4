"""Variable-length causal attention for the text tower, so packed batches cost what their samples cost.

With a packed (padding-free) batch, SDPA needs a dense block-diagonal mask and then never takes a
flash kernel (docs/benchmarks.md has what packing with this attention gains). ``eogym_varlen`` finds the sample boundaries
where the text position row restarts at 0 (the collator's 4-row position ids) and calls
``torch.nn.attention.varlen.varlen_attn`` with a causal window on CUDA; on CPU it runs causal SDPA
per sample, the same arithmetic, so tests can check it. Right-padded batches work too: a pad token's
position is 0, so it is a sample of its own that nothing real attends to.

Nothing is registered at import: :func:`register_varlen_attention` does it when a model asks for it.
"""

from __future__ import annotations

import functools
import inspect

import torch

NAME = "eogym_varlen"


class SampleBoundaries:
    """``(cu_seqlens, max_len)`` of the samples in flattened ``position_ids``, computed once per forward pass.

    Every decoder layer of a forward pass gets the same ``position_ids`` tensor, and finding the
    boundaries costs a host sync, so the result for the last tensor is kept, together with that tensor
    (it cannot be freed and its identity reused while it is held here). Each registration of
    ``eogym_varlen`` owns one instance.
    """

    def __init__(self):
        self._last: tuple[torch.Tensor, torch.Tensor, int] | None = None

    def __call__(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        if self._last is not None and self._last[0] is position_ids:
            return self._last[1], self._last[2]
        flat = position_ids.reshape(-1)
        starts = (flat == 0).nonzero().flatten()
        cu = torch.cat([starts, starts.new_tensor([flat.numel()])]).to(torch.int32)
        max_len = int((cu[1:] - cu[:-1]).max())
        self._last = (position_ids, cu, max_len)
        return cu, max_len


def _varlen_cuda(q, k, v, cu, max_len, scale):
    from torch.nn.attention.varlen import varlen_attn

    kwargs = {"scale": scale, "window_size": (-1, 0)}
    if "enable_gqa" in inspect.signature(varlen_attn).parameters:
        kwargs["enable_gqa"] = q.shape[1] != k.shape[1]
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)


def _varlen_reference(q, k, v, cu, scale):
    out = torch.empty_like(q)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        seg = [t[start:end].transpose(0, 1)[None] for t in (q, k, v)]
        res = torch.nn.functional.scaled_dot_product_attention(*seg, is_causal=True, scale=scale, enable_gqa=True)
        out[start:end] = res[0].transpose(0, 1)
    return out


# Finding the boundaries is data-dependent (a host sync and an int length), so under regional
# torch.compile this function runs eagerly between the compiled halves of each decoder layer.
@torch.compiler.disable
def varlen_attention_forward(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, boundaries: SampleBoundaries | None = None, **kwargs
):
    """Attention-interface function: ``query/key/value`` are ``[batch, heads, length, head_dim]``; ``boundaries``
    is bound by :func:`register_varlen_attention` (a fresh :class:`SampleBoundaries` when called without one)."""
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        raise ValueError(f"attn_implementation={NAME!r} needs position_ids (EOGymCollator provides them)")
    if dropout:
        raise ValueError(f"attn_implementation={NAME!r} has no attention dropout")
    batch, heads, length, dim = query.shape
    q, k, v = (t.transpose(1, 2).reshape(batch * length, t.shape[1], dim) for t in (query, key, value))
    cu, max_len = (boundaries or SampleBoundaries())(position_ids)
    cu = cu.to(q.device)
    if q.is_cuda:
        out = _varlen_cuda(q, k, v, cu, max_len, scaling)
    else:
        out = _varlen_reference(q, k, v, cu, scaling)
    return out.view(batch, length, heads, dim), None


def register_varlen_attention() -> None:
    """Make ``eogym_varlen`` available to transformers' attention and mask interfaces."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(NAME, functools.partial(varlen_attention_forward, boundaries=SampleBoundaries()))
    AttentionMaskInterface.register(NAME, flash_attention_mask)
