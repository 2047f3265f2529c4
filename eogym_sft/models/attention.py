"""Variable-length causal attention for the text tower, so packed batches cost what their samples cost.

With a packed (padding-free) batch, SDPA needs a dense block-diagonal mask and then never takes a
flash kernel (docs/benchmarks.md has what packing with this attention gains). ``eogym_varlen`` finds the
sample boundaries where the text position row restarts at 0 (the collator's 4-row position ids) and
calls ``torch.nn.attention.varlen.varlen_attn`` with a causal window on CUDA; on CPU it runs causal SDPA
per sample, the same arithmetic, so tests can check it. Right-padded batches work too: a pad token's
position is 0, so it is a sample of its own that nothing real attends to.

Finding the boundaries needs a host sync. :func:`add_sample_boundaries` does it once per forward, before
the decoder layers, so that a regionally compiled layer (attention kernel included) is one graph; for
``eogym_varlen_cudnn``, whose per-sample loop runs on the host, it hands them over there.

``eogym_varlen_cudnn`` is the same attention by cuDNN's kernels. :func:`per_sample_op` calls cuDNN's dense
kernel once per sample, each run at its length rounded up to a multiple of 128 tokens; it is faster than
flash's varlen kernel, per call and per training step (docs/benchmarks.md, "Attention"). cuDNN's ragged
(packed) kernel would take the rows as they are, but it is not used: torch routes to it only from 2.14, whose
backward fix (pytorch#186142) no GPU here has been able to check. Right-padding a micro-batch's samples to
its longest into one dense batch instead costs the pad rows' causal work: a sample of ``l`` tokens padded to
``L`` adds ``(L**2 - l**2) / 2`` scores, and on unequal lengths it was slower than flash (docs/benchmarks.md,
"Levers tried").

Shared prompts (GRPO's loss forward): the episodes of one question share their prompt, so
:func:`eogym_sft.training.packed_logps.pack_rows` packs it once and each episode's own tokens after it, and
hands the layout as ``eogym_shared_prefixes`` (:class:`SharedPrefixes`). Each episode's queries then attend to
the prompt's keys and values and to their own, causally (:func:`shared_prefix_attention`): the same arithmetic
as the episode packed whole, the prompt (and its images) encoded once instead of once an episode.

Nothing is registered at import: :func:`register_varlen_attention` does it when a model asks for it.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch

NAME = "eogym_varlen"
CUDNN_NAME = "eogym_varlen_cudnn"  # the same attention by cuDNN's kernels (CUDA)
NAMES = (NAME, CUDNN_NAME)


def sample_boundaries(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens, max_len)`` of the samples in flattened ``position_ids`` (one host sync): a sample
    starts where the position is 0 and at the start of every batch row."""
    is_start = position_ids.reshape(-1, position_ids.shape[-1]) == 0
    is_start[:, 0] = True  # a batch row always starts a sample, whatever its first position
    starts = is_start.flatten().nonzero().flatten()
    cu = torch.cat([starts, starts.new_tensor([is_start.numel()])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


class SampleBoundaries:
    """:func:`sample_boundaries` for attention called without them, computed once per forward pass.

    Every decoder layer of a forward pass gets the same ``position_ids`` tensor, so the result for the
    last tensor is kept, together with that tensor (it cannot be freed and its identity reused while it
    is held here). Each registration of ``eogym_varlen`` owns one instance.
    """

    def __init__(self):
        self._last: tuple[torch.Tensor, torch.Tensor, int] | None = None

    def __call__(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        if self._last is None or self._last[0] is not position_ids:
            self._last = (position_ids, *sample_boundaries(position_ids))
        return self._last[1], self._last[2]


def takes_gqa_flag() -> bool:
    """Whether this torch's ``varlen_attn`` has ``enable_gqa`` (older ones take grouped heads without it)."""
    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def _varlen_cuda(q, k, v, cu, max_len, scale, gqa_flag: bool):
    from torch.nn.attention.varlen import varlen_attn

    kwargs = {"scale": scale, "window_size": (-1, 0)}
    if gqa_flag:
        kwargs["enable_gqa"] = q.shape[1] != k.shape[1]
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)


# per-sample lengths are padded up to a multiple: cuDNN builds a plan per new shape (docs/benchmarks.md)
LENGTH_BUCKET = 128


def _sample_kernels(device_type: str):
    """One sample's causal attention forward (``-> (out, log-sum-exp [heads, length])``) and backward, by aten's fused
    kernels: cuDNN's dense kernel on CUDA; torch's flash kernel for CPU elsewhere, which runs the same per-sample
    code in the CPU tests. Both take ``[1, heads, length, dim]``, grouped key/value heads as they are (both kernels
    read query head ``h`` against key/value head ``h // group``, as SDPA's ``enable_gqa``), and no dropout."""
    aten = torch.ops.aten
    if device_type == "cuda":
        def forward(q, k, v, scale):
            try:
                out, lse = aten._scaled_dot_product_cudnn_attention(
                    q, k, v, None, True, 0.0, True, False, scale=scale
                )[:2]
            except RuntimeError as err:  # a GPU, dtype or build without cuDNN's fused attention: say what to set
                raise RuntimeError(
                    f"attn_implementation={CUDNN_NAME!r}: cuDNN's fused attention failed on a sample of {q.shape[2]} "
                    f"rows ({q.dtype}, {torch.cuda.get_device_name(q.device)}); set attn_implementation: {NAME} for "
                    f"flash's kernel. cuDNN: {err}"
                ) from err
            return out, lse.reshape(q.shape[1], q.shape[2])

        def backward(grad, q, k, v, out, lse, scale):
            unused = q.new_empty((), dtype=torch.int64)  # the dropout seed and offset: no dropout, cuDNN reads neither
            return aten._scaled_dot_product_cudnn_attention_backward(
                grad, q, k, v, out, lse.view(1, *lse.shape, 1), unused, unused, None, None, None, q.shape[2],
                k.shape[2],
                0.0, True, scale=scale,
            )
    else:
        def forward(q, k, v, scale):
            out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
            return out, lse.reshape(q.shape[1], q.shape[2])

        def backward(grad, q, k, v, out, lse, scale):
            return aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad, q, k, v, out, lse.view(1, *lse.shape), 0.0, True, scale=scale
            )
    return forward, backward


def _samples(cu: torch.Tensor):
    """``(start, end, padded length)`` of each non-empty sample. The loop reads the boundaries on the host: the
    pre-hook hands them over there (:func:`add_sample_boundaries`); boundaries on the GPU cost a sync here, inside
    the op, where it does not split a compiled graph."""
    bounds = cu.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:  # boundaries padded to a fixed count repeat; CPU's kernel dies on an empty sample (SIGFPE)
            yield start, end, -(-(end - start) // LENGTH_BUCKET) * LENGTH_BUCKET


def _padded_sample(t: torch.Tensor, start: int, end: int, length: int) -> torch.Tensor:
    """Rows ``start:end`` of packed ``[tokens, heads, dim]`` as ``[1, heads, length, dim]``, zero rows after the
    sample."""
    padded = t.new_empty(length, *t.shape[1:])
    padded[:end - start] = t[start:end]
    padded[end - start:] = 0
    return padded.transpose(0, 1)[None]


def _window(t: torch.Tensor, start: int, end: int, length: int) -> torch.Tensor:
    """``length`` rows of contiguous packed ``t`` from a sample's start as ``[1, heads, length, dim]``: a view where
    the packed rows reach that far (the rows after the sample are the next samples'), else a zero-padded copy.

    Rows after the sample change nothing of it: under the causal mask none of its rows attends to them, and the
    backward gives them a log-sum-exp of +inf (:func:`_sample_lse`), so their softmax weights are 0 and their
    output gradients are not read into the sample's."""
    if start + length <= t.shape[0]:
        return t[start:start + length].transpose(0, 1)[None]
    return _padded_sample(t, start, end, length)


def _sample_lse(lse: torch.Tensor, heads: int, start: int, end: int, length: int) -> torch.Tensor:
    """A sample's saved log-sum-exp ``[heads, length]`` for the backward kernel, +inf in the rows after it."""
    sample_lse = lse.new_full((heads, length), float("inf"))
    sample_lse[:, :end - start] = lse[start * heads:end * heads].view(heads, end - start)
    return sample_lse


def _per_sample_forward(q, k, v, cu, scale):
    forward, _ = _sample_kernels(q.device.type)
    heads = q.shape[1]
    # lse: [heads, length] a sample
    out, lse = torch.empty_like(q), q.new_empty(q.shape[0] * heads, dtype=torch.float32)
    # Windows are row ranges of a token-major [tokens, heads, dim], as the model's projections give them; other
    # strides would change with the token count, and cuDNN builds a plan for every new stride too.
    q, k, v = (t.contiguous() for t in (q, k, v))
    for start, end, length in _samples(cu):
        res, res_lse = forward(*(_window(t, start, end, length) for t in (q, k, v)), scale)
        out[start:end] = res[0, :, :end - start].transpose(0, 1)
        lse[start * heads:end * heads].view(heads, end - start).copy_(res_lse[:, :end - start])
    return out, lse


def _per_sample_backward(grad, q, k, v, out, lse, cu, scale):
    _, backward = _sample_kernels(q.device.type)
    heads = q.shape[1]
    grads = [torch.empty_like(t) for t in (q, k, v)]
    grad, q, k, v, out = (t.contiguous() for t in (grad, q, k, v, out))
    for start, end, length in _samples(cu):
        sample_lse = _sample_lse(lse, heads, start, end, length)
        parts = backward(*(_window(t, start, end, length) for t in (grad, q, k, v, out)), sample_lse, scale)
        for full, part in zip(grads, parts):
            full[start:end] = part[0, :, :end - start].transpose(0, 1)
    return tuple(grads)


@functools.cache
def per_sample_op():
    """Causal attention of the packed samples, one fused dense kernel call per sample, as one custom op with its
    own backward (defined on first use, not at import).

    The kernel is cuDNN's dense one on CUDA, sample by sample (module docstring). cuDNN builds an execution
    plan for each new shape, which takes longer than the attention itself (docs/benchmarks.md, "Levers
    tried"), and nearly every sample has a length of its own; so each
    sample is run at a length rounded up to a multiple of ``LENGTH_BUCKET`` tokens, which bounds the shapes (and
    plans) of a run to ``max_length / LENGTH_BUCKET``, at the cost of at most 127 rows a sample. The extra rows are
    the packed rows that follow the sample, read in place (:func:`_window`); only a sample too close to the end of
    the pack is copied and zero-padded. Under ``torch.compile`` it is one opaque node whose loop reads the
    boundaries on the host (from the pre-hook, :func:`add_sample_boundaries`, without a sync): a compiled layer
    stays one graph for any number of samples. The forward keeps each sample's log-sum-exp (sample-major, flat)
    for the backward kernel. ``q/k/v`` are ``[tokens, heads, dim]``.
    """

    @torch.library.custom_op("eogym::per_sample_attention", mutates_args=())
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return _per_sample_forward(q, k, v, cu, scale)

    @torch.library.custom_op("eogym::per_sample_attention_backward", mutates_args=())
    def attend_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, cu: torch.Tensor,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _per_sample_backward(grad, q, k, v, out, lse, cu, scale)

    @attend.register_fake
    def _(q, k, v, cu, scale):
        return torch.empty_like(q), q.new_empty(q.shape[0] * q.shape[1], dtype=torch.float32)

    @attend_backward.register_fake
    def _(grad, q, k, v, out, lse, cu, scale):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup_context(ctx, inputs, output):
        q, k, v, cu, ctx.scale = inputs
        ctx.save_for_backward(q, k, v, *output, cu)
        ctx.mark_non_differentiable(output[1])

    def backward(ctx, grad, _grad_lse):
        return (*attend_backward(grad, *ctx.saved_tensors, ctx.scale), None, None)

    attend.register_autograd(backward, setup_context=setup_context)
    return attend


def _varlen_reference(q, k, v, cu, scale):
    out = torch.empty_like(q)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        seg = [t[start:end].transpose(0, 1)[None] for t in (q, k, v)]
        res = torch.nn.functional.scaled_dot_product_attention(*seg, is_causal=True, scale=scale, enable_gqa=True)
        out[start:end] = res[0].transpose(0, 1)
    return out


def _varlen_reference_backward(grad, q, k, v, cu, scale):
    """Gradients of :func:`_varlen_reference` by hand (a custom op's body runs below autograd), sample by sample:
    with ``P = softmax(scale * q k^T)`` causal, ``dV = P^T dO``, ``dS = P * (dO v^T - rowsum(dO * O))``,
    ``dQ = scale * dS k``, ``dK = scale * dS^T q``; grouped query heads add up onto their key/value head."""
    group, compute = q.shape[1] // k.shape[1], torch.promote_types(q.dtype, torch.float32)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, do = (t[start:end].transpose(0, 1).to(compute) for t in (q, grad))  # [heads, length, dim]
        ks, vs = (t[start:end].transpose(0, 1).to(compute).repeat_interleave(group, 0) for t in (k, v))
        causal = torch.ones(end - start, end - start, dtype=torch.bool, device=q.device).tril()
        probs = (scale * qs @ ks.transpose(1, 2)).masked_fill(~causal, float("-inf")).softmax(-1)
        out = probs @ vs
        d_scores = probs * (do @ vs.transpose(1, 2) - (do * out).sum(-1, keepdim=True))
        parts = (scale * d_scores @ ks, scale * d_scores.transpose(1, 2) @ qs, probs.transpose(1, 2) @ do)
        for full, part, heads in zip(grads, parts, (1, group, group)):
            part = part.unflatten(0, (-1, heads)).sum(1)  # sum the query heads of each key/value head
            full[start:end] = part.transpose(0, 1).to(full.dtype)
    return tuple(grads)


@functools.cache
def reference_op():
    """The CPU reference as one custom op with its own backward, defined on first use (not at import).

    Under ``torch.compile`` it is, like the CUDA kernel (torch's ``varlen_attn`` is a custom op too), one
    opaque node: its per-sample loop reads the boundaries on the host, which would otherwise break the
    compiled layer's graph on CPU. So a compiled layer is one graph on both devices, and the CPU tests
    count the graphs that the GPU compiles. Eager code calls the reference itself: its backward
    recomputes the forward, which autograd through SDPA does not, so eager code through the op is slower.
    """

    @torch.library.custom_op("eogym::varlen_attention_reference", mutates_args=())
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float) -> torch.Tensor:
        return _varlen_reference(q, k, v, cu, scale)

    @torch.library.custom_op("eogym::varlen_attention_reference_backward", mutates_args=())
    def attend_backward(
        grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _varlen_reference_backward(grad, q, k, v, cu, scale)

    @attend.register_fake
    def _(q, k, v, cu, scale):
        return torch.empty_like(q)

    @attend_backward.register_fake
    def _(grad, q, k, v, cu, scale):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup_context(ctx, inputs, output):
        q, k, v, cu, ctx.scale = inputs
        ctx.save_for_backward(q, k, v, cu)

    def backward(ctx, grad):
        return (*attend_backward(grad, *ctx.saved_tensors, ctx.scale), None, None)

    attend.register_autograd(backward, setup_context=setup_context)
    return attend


@dataclass(frozen=True)
class SharedPrefixes:
    """A packed row's segments ``(start, end, prefix_start, prefix_end)``, host ints covering the row in order:
    the rows ``start:end`` attend, causally, to the rows ``prefix_start:prefix_end`` and to themselves (a segment
    with an empty prefix is a sample of its own). Positions are the caller's: a segment after a prefix continues
    the prefix's positions, as the unshared sequence would."""

    segments: tuple[tuple[int, int, int, int], ...]


def shared_prefix_attention(q, k, v, shared: SharedPrefixes, scale: float) -> torch.Tensor:
    """Causal attention of packed ``[tokens, heads, dim]`` segments, each after its shared prefix (see
    :class:`SharedPrefixes`), through SDPA with the diagonal aligned to the bottom right: on CUDA flash's kernel
    with the grouped heads unrepeated, on CPU its math. Autograd sums a prefix's key and value gradients over
    every segment that reads it, as the unshared episodes' backward sums them over the copies."""
    from torch.nn.attention.bias import causal_lower_right

    parts = []
    for start, end, prefix_start, prefix_end in shared.segments:
        qs = q[start:end].transpose(0, 1)[None]
        ks, vs = (
            (
                torch.cat([t[prefix_start:prefix_end], t[start:end]]) if prefix_end > prefix_start else t[start:end]
            ).transpose(0, 1)[None]
            for t in (k, v)
        )
        n, total = end - start, end - start + prefix_end - prefix_start
        mask = causal_lower_right(n, total) if total > n else None
        out = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
        parts.append(out[0].transpose(0, 1))
    return torch.cat(parts)


@torch.compiler.disable  # a host sync and a data-dependent length: eager, between the compiled halves of a layer
def _boundaries_in_layer(boundaries: SampleBoundaries | None, position_ids) -> tuple[torch.Tensor, int]:
    return (boundaries or SampleBoundaries())(position_ids)


def varlen_attention_forward(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
    boundaries: SampleBoundaries | None = None, gqa_flag: bool = True, reference=None, cuda_kernel: str = "flash",
    per_sample=None,
    cu_seq_lens_q=None, max_length_q=None, eogym_shared_prefixes: SharedPrefixes | None = None, **kwargs
):
    """Attention-interface function: ``query/key/value`` are ``[batch, heads, length, head_dim]``.

    The samples' boundaries come as transformers' packed-sequence arguments ``cu_seq_lens_q`` and
    ``max_length_q`` (:func:`add_sample_boundaries` computes them once per forward, before the layers, so a
    compiled layer has no graph break); without them they are found from ``position_ids`` here, which
    splits a compiled layer in two. ``boundaries``, ``gqa_flag``, ``reference`` (the CPU op), ``per_sample`` (the
    cuDNN op) and ``cuda_kernel`` (``"flash"``: torch's varlen kernel; ``"cudnn"``: :func:`per_sample_op` for packed
    batches, flash for right-padded ones) are bound by :func:`register_varlen_attention`. A packed row whose
    episodes share their prompts comes with ``eogym_shared_prefixes`` and takes :func:`shared_prefix_attention`.
    """
    name = CUDNN_NAME if cuda_kernel == "cudnn" else NAME  # the one the user asked for, in errors
    if dropout:
        raise ValueError(f"attn_implementation={name!r} has no attention dropout")
    if key.shape[2] != query.shape[2]:
        raise ValueError(f"attn_implementation={name!r} runs whole sequences without a KV cache (training, scoring); "
                         "generate with sdpa")
    if eogym_shared_prefixes is not None:
        if query.shape[0] != 1:
            raise ValueError(f"attn_implementation={name!r}: shared prompts come packed in one row, not "
                             f"{query.shape[0]}")
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
        out = shared_prefix_attention(q, k, v, eogym_shared_prefixes,
                                      scaling if scaling is not None else query.shape[-1]**-0.5)
        return out[None], None
    if cu_seq_lens_q is None:
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            raise ValueError(f"attn_implementation={name!r} needs position_ids (EOGymCollator provides them)")
        cu_seq_lens_q, max_length_q = _boundaries_in_layer(boundaries, position_ids)
    elif max_length_q is None:  # a caller's own boundaries without their longest sample
        max_length_q = int((cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).max())
    cu_k = kwargs.get("cu_seq_lens_k")
    if cu_k is not None and cu_k is not cu_seq_lens_q and not torch.equal(cu_k, cu_seq_lens_q):
        raise ValueError(f"attn_implementation={name!r} is self-attention: cu_seq_lens_k must equal cu_seq_lens_q")
    batch, heads, length, dim = query.shape
    q, k, v = (t.transpose(1, 2).reshape(batch * length, t.shape[1], dim) for t in (query, key, value))
    scale = scaling if scaling is not None else dim**-0.5
    # Right-padded rows (batch > 1) make each pad token a sample of its own: padded to the longest sample,
    # they would cost memory of pads x max_len, so those batches take the flash kernel.
    if q.is_cuda and cuda_kernel == "cudnn" and batch == 1:
        # The op reads the boundaries on the host: where they are there already (the pre-hook's), without a sync.
        return (per_sample or per_sample_op())(q, k, v, cu_seq_lens_q, scale)[0].view(batch, length, heads, dim), None
    cu = cu_seq_lens_q.to(q.device)
    if q.is_cuda:
        out = _varlen_cuda(q, k, v, cu, max_length_q, scale, gqa_flag)
    elif torch.compiler.is_compiling():  # one opaque op, so the compiled layer stays one graph
        out = (reference or reference_op())(q, k, v, cu, scale)
    else:  # eager: autograd through SDPA keeps what the op's backward would recompute
        out = _varlen_reference(q, k, v, cu, scale)
    return out.view(batch, length, heads, dim), None


def text_positions(position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """The text row of the position ids a Qwen3-VL text model is given (4 rows: text, then mRoPE t/h/w)."""
    if position_ids is None:
        return None
    if position_ids.dim() == 3:
        return position_ids[0] if position_ids.shape[0] == 4 else None
    return position_ids


def add_sample_boundaries(model) -> None:
    """Find the packed samples' boundaries once per forward pass, before the decoder layers.

    A forward pre-hook on the text model (``model.get_decoder()``) adds ``cu_seq_lens_q/k`` and
    ``max_length_q/k`` (transformers' names for packed sequences) from the text position row; the text
    model hands them to every layer's attention. The one host sync of a forward then happens outside the
    compiled layers, which compile to a single graph. Arguments the caller passes itself are kept, and
    nothing is added while the text model runs another attention (``set_attn_implementation`` switches freely).
    """

    def add(module, args, kwargs):
        positions = text_positions(kwargs.get("position_ids"))
        if (
            module.config._attn_implementation not in NAMES
            or positions is None
            or kwargs.get("cu_seq_lens_q") is not None
            or kwargs.get("eogym_shared_prefixes") is not None
        ):  # shared prompts carry their own layout
            return None
        cu, max_len = sample_boundaries(positions)  # on the positions' device
        return args, {**kwargs, **packed_arguments(cu, max_len, module.config._attn_implementation, positions.shape[0],
                                                   positions.device)}

    model.get_decoder().register_forward_pre_hook(add, with_kwargs=True)


def packed_arguments(cu: torch.Tensor, max_len: int, attn_implementation: str, rows: int, device) -> dict:
    """Transformers' packed-sequence arguments for the text tower from the boundaries ``cu`` (on the host or on
    ``device``): ``{}`` unless it runs ``eogym_varlen*``. ``eogym_varlen_cudnn``'s op on a packed batch (one row) loops
    over the samples on the host, in every layer's forward and backward, so it gets them there: from here, not a
    GPU sync each time (one a sample and layer: docs/benchmarks.md); flash's kernel gets them on the device
    (a host copy goes over without waiting: pinned by the DataLoader,
    :class:`~eogym_sft.models.host_layout.HostLayout`)."""
    if attn_implementation not in NAMES:
        return {}
    if attn_implementation == CUDNN_NAME and rows == 1:
        cu = cu.cpu()
    else:
        cu = cu.to(device, non_blocking=True)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max_len, "max_length_k": max_len}


def register_varlen_attention() -> None:
    """Make ``eogym_varlen`` and ``eogym_varlen_cudnn`` available to transformers' attention and mask interfaces."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    # Looked up (and the CPU op defined) here rather than inside a compiled layer, where either breaks the graph.
    for name, cuda_kernel in ((NAME, "flash"), (CUDNN_NAME, "cudnn")):
        attend = functools.partial(
            varlen_attention_forward, boundaries=SampleBoundaries(), gqa_flag=takes_gqa_flag(),
            reference=reference_op(),
            cuda_kernel=cuda_kernel, per_sample=per_sample_op(),
        )
        AttentionInterface.register(name, attend)
        AttentionMaskInterface.register(name, flash_attention_mask)
