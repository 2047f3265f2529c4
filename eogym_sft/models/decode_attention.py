"""Split-KV (flash-decoding) attention for the slot decoder's one-token decode step, in Triton.

The decode step attends one query token per slot over a KV cache ``(slots, kv_heads, max_len, head_dim)`` of which
each slot holds its own number of keys. Masked SDPA (cuDNN on a GPU) runs one CTA per (slot, KV head), 256 for 32
slots on the 4B, over the whole span, reading keys past each slot's length: most of the step, well above the
step's KV-read floor (docs/benchmarks.md). Here:

* :func:`_partials` (kernel 1), grid ``(slots * kv_heads, splits)``: each program takes one split of the span's keys
  for one (slot, KV head), loads each ``BLOCK_N``-key block once for all ``groups`` query heads of that KV head (one
  ``tl.dot``, the query rows padded to 16), runs an fp32 online softmax, and stops at its slot's length. It writes its
  unnormalised fp32 output, running max (log2 units) and sum of exponentials per query row; a split that starts at or
  past the slot's length writes max ``-inf``, sum 0 and zeros.
* :func:`_combine` (kernel 2), grid ``(slots * kv_heads,)``: rescales the splits to their common max and divides by
  the total, in the query's dtype. A slot of length 0 (no key at all) gives zeros, where masked SDPA with an all-false
  mask gives NaN (and with the decoder's finite additive mask, the mean of all values): the decoder's idle slots have
  length 0 and their rows are never read.

The number of splits depends on the span only (:func:`splits_for`), never on the lengths, so a CUDA graph captured
for one span has fixed grids and replays over any lengths: they are read from a device tensor by the kernels. Keys
at or past a slot's length are never loaded, so whatever the cache holds there (stale rows, the scratch row) cannot
reach the output.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton: the decoder keeps masked SDPA
    triton = None

BLOCK_N = 64  # keys a program loads at once
SPLIT_KEYS = 512  # keys a split covers at least: 12 splits of a 6k span, 3072 programs for 32 slots x 8 KV heads
MAX_SPLITS = 16
MIN_ROWS = 16  # tl.dot takes at least 16 rows: the groups query rows (4 on the 4B) are padded to this


def available(device) -> bool:
    """Whether :func:`decode_attention` runs on ``device``: a CUDA device and triton importable."""
    return triton is not None and torch.device(device).type == "cuda"


def splits_for(span: int) -> int:
    """Splits of a ``span``-key attention: one per ``SPLIT_KEYS`` keys, 1 to ``MAX_SPLITS``. A function of the span
    alone, so that a graph captured for a span launches the same grid whatever the lengths."""
    return max(1, min(MAX_SPLITS, math.ceil(span / SPLIT_KEYS)))


def split_size(span: int, splits: int) -> int:
    """Keys of each split: the span over ``splits``, rounded up to whole ``BLOCK_N`` blocks."""
    return math.ceil(math.ceil(span / splits) / BLOCK_N) * BLOCK_N


def decode_attention(q, keys, values, lengths, span: int, scale: float, splits: int | None = None):
    """Attention of one query token per slot over each slot's first ``lengths[s]`` keys (at most ``span``).

    ``q`` ``(slots, kv_heads, groups, head_dim)``: the query heads of one KV head folded into the query length, as the
    decoder's masked SDPA call takes them; ``keys``/``values`` ``(slots, kv_heads, max_len, head_dim)`` (the cache,
    any strides with a unit last one); ``lengths`` ``(slots,)`` integer on the device. Returns ``(slots, kv_heads,
    groups, head_dim)`` in ``q``'s dtype, as SDPA's output. ``splits`` overrides :func:`splits_for` (tests)."""
    slots, kv_heads, groups, head_dim = q.shape
    if splits is not None and not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits must be 1 to {MAX_SPLITS}, not {splits}")
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("decode_attention reads keys and values with a unit stride along head_dim")
    splits = splits or splits_for(span)
    rows, block_d = max(MIN_ROWS, triton.next_power_of_2(groups)), max(16, triton.next_power_of_2(head_dim))
    partial = torch.empty((slots, kv_heads, splits, groups, head_dim), dtype=torch.float32, device=q.device)
    stats = torch.empty((2, slots, kv_heads, splits, groups), dtype=torch.float32, device=q.device)  # max, sum
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    # fp32 inputs: tl.dot would round them to tf32 on a GPU; "ieee" keeps fp32 (fp16/bf16 take the default)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _partials[(slots * kv_heads, splits)](
        q, keys, values, lengths, partial, stats,
        *q.stride(), *keys.stride()[:3], *values.stride()[:3],
        kv_heads, groups, head_dim, span, split_size(span, splits), scale * math.log2(math.e),
        ROWS=rows, BLOCK_D=block_d, BLOCK_N=BLOCK_N, PRECISION=precision,
    )
    _combine[(slots * kv_heads,)](
        partial, stats, out, *out.stride(), kv_heads, groups, head_dim, splits,
        MAX_SPLITS=MAX_SPLITS, ROWS=rows, BLOCK_D=block_d,
    )
    return out


if triton is not None:

    @triton.jit
    def _partials(
        q, k, v, lengths, partial, stats,
        q_s, q_h, q_g, q_d, k_s, k_h, k_n, v_s, v_h, v_n,
        kv_heads, groups, head_dim, span, split_keys, scale_log2,
        ROWS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    ):
        pid, split = tl.program_id(0), tl.program_id(1)
        splits = tl.num_programs(1)
        s, h = (pid // kv_heads).to(tl.int64), pid % kv_heads  # int64: a layer's cache may pass 2**31 elements
        g = tl.arange(0, ROWS)
        d = tl.arange(0, BLOCK_D)
        n = tl.arange(0, BLOCK_N)
        row_ok, d_ok = g < groups, d < head_dim
        qs = tl.load(q + s * q_s + h * q_h + g[:, None] * q_g + d[None, :] * q_d, mask=row_ok[:, None] & d_ok[None, :],
                     other=0.0)
        end = tl.minimum(tl.load(lengths + s).to(tl.int32), span)
        start = split * split_keys
        stop = tl.minimum(start + split_keys, end)
        k_base = k + s * k_s + h * k_h
        v_base = v + s * v_s + h * v_h
        m = tl.full((ROWS,), float("-inf"), tl.float32)
        total = tl.zeros((ROWS,), tl.float32)
        acc = tl.zeros((ROWS, BLOCK_D), tl.float32)
        first = start
        # A while loop, not range(start, stop): triton's interpreter (the CPU tests) cannot take tensor bounds to a
        # range under numpy 2.4. No iteration when the split starts at or past the length.
        while first < stop:
            keys_at = first + n
            key_ok = keys_at < stop
            both = key_ok[:, None] & d_ok[None, :]  # keys past the length are never loaded: they may hold anything
            ks = tl.load(k_base + keys_at[:, None] * k_n + d[None, :], mask=both, other=0.0)
            vs = tl.load(v_base + keys_at[:, None] * v_n + d[None, :], mask=both, other=0.0)
            score = tl.dot(qs, tl.trans(ks), input_precision=PRECISION) * scale_log2  # (ROWS, BLOCK_N), log2 units
            score = tl.where(key_ok[None, :], score, float("-inf"))
            new_m = tl.maximum(m, tl.max(score, 1))  # finite: every block has a key below the length
            p = tl.exp2(score - new_m[:, None])
            alpha = tl.exp2(m - new_m)  # 0 on the first block (m = -inf)
            total = total * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(vs.dtype), vs, input_precision=PRECISION)
            m = new_m
            first += BLOCK_N
        row = (pid * splits + split) * groups + g  # (slot, head, split, row) flattened
        tl.store(partial + row[:, None] * head_dim + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(stats + row, m, mask=row_ok)
        tl.store(stats + tl.num_programs(0) * splits * groups + row, total, mask=row_ok)

    @triton.jit
    def _combine(
        partial, stats, out, o_s, o_h, o_g, o_d, kv_heads, groups, head_dim, splits,
        MAX_SPLITS: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        pid = tl.program_id(0)
        s, h = (pid // kv_heads).to(tl.int64), pid % kv_heads
        g = tl.arange(0, ROWS)
        d = tl.arange(0, BLOCK_D)
        row_ok, d_ok = g < groups, d < head_dim
        sums = tl.num_programs(0) * splits * groups  # where the sums start in stats
        # MAX_SPLITS iterations, those past splits masked: one compile for every span (a constexpr count would compile
        # once per split count as the spans first come; a runtime loop bound the interpreter cannot take)
        top = tl.full((ROWS,), float("-inf"), tl.float32)
        for split in range(0, MAX_SPLITS):
            ok = row_ok & (split < splits)
            top = tl.maximum(top, tl.load(stats + (pid * splits + split) * groups + g, mask=ok, other=float("-inf")))
        top = tl.where(top == float("-inf"), 0.0, top)  # no key in any split (length 0): every weight below is 0
        total = tl.zeros((ROWS,), tl.float32)
        acc = tl.zeros((ROWS, BLOCK_D), tl.float32)
        for split in range(0, MAX_SPLITS):
            ok = row_ok & (split < splits)
            row = (pid * splits + split) * groups + g
            # 0 for an empty or absent split
            weight = tl.exp2(tl.load(stats + row, mask=ok, other=float("-inf")) - top)
            total += weight * tl.load(stats + sums + row, mask=ok, other=0.0)
            acc += weight[:, None] * tl.load(partial + row[:, None] * head_dim + d[None, :],
                                             mask=ok[:, None] & d_ok[None, :], other=0.0)
        result = acc / tl.where(total > 0, total, 1.0)[:, None]  # length 0: zeros, not 0 / 0
        tl.store(out + s * o_s + h * o_h + g[:, None] * o_g + d[None, :] * o_d, result.to(out.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])
