"""LoRA's input dropout and its ``lora_A`` matmul as one Triton kernel each way: ``dropout(x) @ A.T``.

PEFT computes ``lora_B(lora_A(dropout(x)))`` for each of the seven projections of a layer. Under the compiled layers
the dropout costs arm B 11% of its step and 20 GiB (``B-dropout0``, docs/benchmarks.md): Inductor draws one Philox
evaluation a random number (``tl.rand``), writes each dropped input and keeps a mask or the dropped input per
projection for the backward (q, k and v take the same input, with three masks).

Here the dropped input is never written. :func:`dropout_matmul` reads ``x`` in tiles, takes eight 16-bit random
numbers from each Philox evaluation (``tl.randint4x``, four 32-bit outputs split in halves), scales or zeroes each
element and accumulates the tile's product with ``A`` (rank ``r`` columns) in fp32. Its backward keeps only ``x`` (the
same tensor for q, k and v), the weight and the 8-byte seed, and draws the same numbers again: element ``(m, c)`` of an
``(M, K)`` input takes half ``c % 8`` of the evaluation at counter ``m * K // 8 + c // 8``, which no block size
changes. The backward kernel writes ``dx = (dy @ A) * factor`` and each program's share of ``dA = dy.T @ (x *
factor)`` in fp32, summed afterwards in a fixed order (deterministic).

The dropout distribution is PEFT's (each element kept with probability ``1 - p``, to within 2**-17 by the 16-bit
comparison, and scaled by ``1 / (1 - p)``; a new mask each call and projection); the random numbers are Triton's, not torch's, so a run's masks differ from an unfused one
with the same seed. :func:`fuse_lora_dropout` swaps it into a PEFT model's LoRA layers; on a device the kernels do not
run on (CPU), the swapped layer runs torch's dropout and matmul, the same numbers as PEFT's forward.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton: the swapped layers run torch's dropout
    triton = None

BLOCK_M = 64  # input rows a program's tile holds
BLOCK_K = 64  # input columns a tile holds (a multiple of 8: a Philox evaluation's eight 16-bit halves)
BACKWARD_ROWS = 256  # input rows one backward program sums its dA share over


def available(device) -> bool:
    """Whether :func:`dropout_matmul` runs on ``device`` as kernels: a CUDA device and triton importable."""
    return triton is not None and torch.device(device).type == "cuda"


def _rank_block(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))  # tl.dot takes at least 16 along each side


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def threshold(p: float) -> int:
    """The 16-bit number at or above which an element is kept: ``p * 65536`` rounded, so an element is dropped with
    probability ``p`` to within 2**-17 (``p = 0.05``: 3277 / 65536 = 0.050003)."""
    return round(p * 65536)


def _check(x: torch.Tensor, weight: torch.Tensor, p: float) -> None:
    if x.shape[-1] % 8:
        raise ValueError(f"dropout_matmul takes inputs of a multiple of 8 features, not {x.shape[-1]}")
    if x.dtype != weight.dtype or weight.shape[-1] != x.shape[-1]:
        raise ValueError(f"dropout_matmul: x {tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} {weight.dtype} do not match")
    if not 0 <= p < 1:
        raise ValueError(f"dropout probability must be in [0, 1), not {p}")


def dropout_matmul(x: torch.Tensor, weight: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
    """``dropout(x, p) @ weight.T`` without the dropped ``x`` in memory: ``x`` ``(..., K)``, ``weight`` ``(r, K)`` of
    the same dtype, ``seed`` a one-element int64 tensor on ``x``'s device that, with the shape, fixes the mask.
    Returns ``(..., r)`` in ``x``'s dtype. One opaque op (``eogym::dropout_matmul``) under ``torch.compile``,
    differentiable in ``x`` and ``weight``."""
    return _ops()(x, weight, seed, p)


def dropout_matmul_backward(grad, x, weight, seed, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dweight)`` of :func:`dropout_matmul` for the output gradient ``grad``, its mask drawn again from ``seed``."""
    _ops()
    return torch.ops.eogym.dropout_matmul_backward(grad, x, weight, seed, p)


@functools.cache
def _ops():
    """Register the two ops (the first call, not at import) and return the forward one. They are ``triton_op``s:
    Inductor sees their kernels and launches them from its own code, so a compiled layer pays no Python dispatch
    for them (as opaque custom ops, about 125 us of host time a call, 504 calls a micro-batch, starved the GPU)."""
    from torch.library import triton_op, wrap_triton

    @triton_op("eogym::dropout_matmul", mutates_args=())
    def forward(x: torch.Tensor, weight: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
        _check(x, weight, p)
        k, rank = weight.shape[1], weight.shape[0]
        rows = x.reshape(-1, k).contiguous()
        out = rows.new_empty((rows.shape[0], rank))
        if rows.shape[0]:
            wrap_triton(_forward)[(triton.cdiv(rows.shape[0], BLOCK_M),)](
                rows, weight, out, seed, rows.shape[0], rank, weight.stride(0), 1.0 / (1.0 - p), threshold(p),
                K=k, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, BLOCK_R=_rank_block(rank),
            )
        return out.view(*x.shape[:-1], rank)

    @triton_op("eogym::dropout_matmul_backward", mutates_args=())
    def backward(
        grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, seed: torch.Tensor, p: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k, rank = weight.shape[1], weight.shape[0]
        rows, grads = x.reshape(-1, k).contiguous(), grad.reshape(-1, rank).to(x.dtype).contiguous()
        programs = triton.cdiv(rows.shape[0], BACKWARD_ROWS)
        dx = torch.empty_like(rows)
        shares = rows.new_zeros((programs, rank, k), dtype=torch.float32)  # each program's dA share, summed in order
        if rows.shape[0]:
            wrap_triton(_backward)[(programs, triton.cdiv(k, BLOCK_K))](
                grads, rows, weight, dx, shares, seed, rows.shape[0], rank, weight.stride(0), 1.0 / (1.0 - p), threshold(p),
                K=k, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, BLOCK_R=_rank_block(rank), ROWS=BACKWARD_ROWS,
            )
        return dx.view(x.shape), shares.sum(0).to(weight.dtype)

    def setup_context(ctx, inputs, output):
        x, weight, seed, ctx.p = inputs
        ctx.save_for_backward(x, weight, seed)

    def differentiate(ctx, grad):
        x, weight, seed = ctx.saved_tensors
        dx, dweight = backward(grad, x, weight, seed, ctx.p)
        return dx, dweight, None, None

    forward.register_autograd(differentiate, setup_context=setup_context)
    return forward


def dropout_factors(seed: torch.Tensor, m: int, k: int, p: float, device) -> torch.Tensor:
    """The ``(m, k)`` fp32 factors :func:`dropout_matmul` multiplies an ``(m, k)`` input by for ``seed``: ``1 / (1 - p)``
    where an element is kept, 0 where dropped. For tests: the mask the kernels draw, written out."""
    out = torch.empty((m, k), dtype=torch.float32, device=device)
    _factors[(triton.cdiv(m, BLOCK_M), triton.cdiv(k, BLOCK_K))](out, seed, m, k, 1.0 / (1.0 - p), threshold(p), BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K)
    return out


if triton is not None:

    @triton.jit
    def _factor(seed, rows, k0, k, scale, threshold, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        """(BLOCK_M, BLOCK_K) fp32: ``scale`` where kept, 0 where dropped, for columns ``k0`` on (``k0 % 8 == 0``).
        Element ``(m, c)`` reads half ``c % 8`` (low half first) of the four 32-bit outputs of the Philox evaluation at
        counter ``m * k // 8 + c // 8``, and is kept when that 16-bit number is at least ``threshold``."""
        octets = (k0 // 8 + tl.arange(0, BLOCK_K // 8)).to(tl.int64)
        counter = rows.to(tl.int64)[:, None] * (k // 8) + octets[None, :]
        r0, r1, r2, r3 = tl.randint4x(seed, counter)
        halves = tl.join(
            tl.join(tl.join(r0 & 0xFFFF, r0 >> 16), tl.join(r1 & 0xFFFF, r1 >> 16)),
            tl.join(tl.join(r2 & 0xFFFF, r2 >> 16), tl.join(r3 & 0xFFFF, r3 >> 16)),
        )
        bits = tl.reshape(halves, (BLOCK_M, BLOCK_K))  # half j of an octet is column 8q+j
        return tl.where(bits >= threshold, scale, 0.0)

    @triton.jit
    def _forward(x, w, out, seed_ptr, m, rank, w_r, scale, threshold, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        ranks = tl.arange(0, BLOCK_R)
        row_ok, rank_ok = rows < m, ranks < rank
        seed = tl.load(seed_ptr)
        acc = tl.zeros((BLOCK_M, BLOCK_R), tl.float32)
        for k0 in range(0, K, BLOCK_K):  # a for loop over a constexpr bound: the compiler pipelines its loads
            cols = k0 + tl.arange(0, BLOCK_K)
            col_ok = cols < K
            xs = tl.load(x + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
            dropped = (xs.to(tl.float32) * _factor(seed, rows, k0, K, scale, threshold, BLOCK_M, BLOCK_K)).to(xs.dtype)
            ws = tl.load(w + ranks[None, :] * w_r + cols[:, None], mask=rank_ok[None, :] & col_ok[:, None], other=0.0)
            acc += tl.dot(dropped, ws)
        tl.store(out + rows.to(tl.int64)[:, None] * rank + ranks[None, :], acc.to(out.dtype.element_ty), mask=row_ok[:, None] & rank_ok[None, :])

    @triton.jit
    def _backward(
        dy, x, w, dx, shares, seed_ptr, m, rank, w_r, scale, threshold,
        K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, ROWS: tl.constexpr,
    ):
        cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        ranks = tl.arange(0, BLOCK_R)
        col_ok, rank_ok = cols < K, ranks < rank
        seed = tl.load(seed_ptr)
        ws = tl.load(w + ranks[:, None] * w_r + cols[None, :], mask=rank_ok[:, None] & col_ok[None, :], other=0.0)  # (R, K)
        share = tl.zeros((BLOCK_R, BLOCK_K), tl.float32)
        for block in range(0, ROWS // BLOCK_M):
            rows = tl.program_id(0) * ROWS + block * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = rows < m
            both = row_ok[:, None] & col_ok[None, :]
            grads = tl.load(dy + rows.to(tl.int64)[:, None] * rank + ranks[None, :], mask=row_ok[:, None] & rank_ok[None, :], other=0.0)
            factor = _factor(seed, rows, tl.program_id(1) * BLOCK_K, K, scale, threshold, BLOCK_M, BLOCK_K)
            tl.store(dx + rows.to(tl.int64)[:, None] * K + cols[None, :], (tl.dot(grads, ws) * factor).to(dx.dtype.element_ty), mask=both)
            xs = tl.load(x + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=both, other=0.0)
            share += tl.dot(tl.trans(grads), (xs.to(tl.float32) * factor).to(xs.dtype))
        tl.store(shares + tl.program_id(0) * rank * K + ranks[:, None] * K + cols[None, :], share, mask=rank_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _factors(out, seed_ptr, m, k, scale, threshold, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        k0 = tl.program_id(1) * BLOCK_K
        cols = k0 + tl.arange(0, BLOCK_K)
        factor = _factor(tl.load(seed_ptr), rows, k0, k, scale, threshold, BLOCK_M, BLOCK_K)
        tl.store(out + rows.to(tl.int64)[:, None] * k + cols[None, :], factor, mask=(rows < m)[:, None] & (cols < k)[None, :])


class DropoutLoRAA(torch.nn.Linear):
    """A PEFT ``lora_A`` layer that applies its adapter's input dropout itself (``dropout_p``): :func:`dropout_matmul`
    in training mode where the kernels run, torch's ``dropout`` then ``linear`` elsewhere. Its weight and state-dict
    key stay the ``nn.Linear``'s, so saved adapters are PEFT's."""

    dropout_p: float = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and self.dropout_p > 0):
            return F.linear(x, self.weight)
        if not available(x.device) or x.shape[-1] % 8:
            return F.linear(F.dropout(x, self.dropout_p, training=True), self.weight)
        # the dtype F.linear would compute in: autocast's (the Trainer's bf16), else the input's
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        seed = torch.randint(0, 2**31 - 1, (1,), device=x.device)  # from torch's generator: a seeded run repeats its masks
        # the registered op itself: registering (the first dropout_matmul call) inside a compiled layer would break its graph
        return torch.ops.eogym.dropout_matmul(x.to(dtype), self.weight.to(dtype), seed, self.dropout_p)


def fuse_lora_dropout(model) -> int:
    """Move each plain LoRA adapter's input dropout into its ``lora_A`` (:class:`DropoutLoRAA`) in every PEFT LoRA
    ``Linear`` of ``model``; the ``lora_dropout`` entry becomes ``nn.Identity``, as PEFT has it for ``p = 0``. Adapters
    with DoRA, a LoRA variant or a biased ``lora_A`` are left as they are. Returns how many adapters were fused."""
    from peft.tuners.lora.layer import Linear

    if triton is not None:
        _ops()  # registered here, outside any compiled region
    fused = 0
    for module in model.modules():
        if type(module) is not Linear:
            continue
        for name, dropout in list(module.lora_dropout.items()):
            lora_a = module.lora_A[name]
            plain = not (module.use_dora.get(name, False) or name in getattr(module, "lora_variant", {}))
            if plain and isinstance(dropout, torch.nn.Dropout) and dropout.p > 0 and type(lora_a) is torch.nn.Linear and lora_a.bias is None:
                lora_a.__class__ = DropoutLoRAA
                lora_a.dropout_p = float(dropout.p)
                module.lora_dropout[name] = torch.nn.Identity()
                fused += 1
    return fused
