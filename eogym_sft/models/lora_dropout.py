"""LoRA's input dropout drawn as a packed keep mask: one bit an element, eight elements a Philox evaluation.

PEFT applies ``nn.Dropout(p)`` to each projection's input before ``lora_A``. Under the compiled layers, Inductor
(torch 2.11) draws one Philox evaluation an element for it (``tl.rand`` keeps one of the evaluation's four 32-bit
outputs) and keeps a byte of mask an element for the backward; the dropout costs arm B 11% of its step
(``B-dropout0``, docs/benchmarks.md). Here :func:`keep_bits` draws the keep decisions as 16-bit uniforms, eight from
each evaluation (``tl.randint4x``, each output split in halves), into int32 words, one bit an element.
:class:`PackedMaskDropout` expands those bits and scales the input by pointwise torch ops, which Inductor fuses into
the layer as it fused PEFT's multiply, and can recompute in the backward from the words (one bit an element).

The bits come from this op, not from Inductor's random lowering, so a seed gives the same mask on every torch release
and in a forward recomputed under activation checkpointing (pytorch#198333: torch 2.13's "4x" random path can give a
recomputed backward another mask). The same Philox (Triton's, 10 rounds) runs in torch on other devices, so a CPU run
draws the mask a GPU run draws from the same seed.

Element ``e`` of a row-major input reads bit ``e % 32`` of word ``e // 32``; bit ``8 * j + 2 * k + h`` of word ``w`` is
half ``h`` (0 the low 16 bits) of output ``k`` of the evaluation at counter ``4 * w + j``. An element is kept when its
uniform is at least ``round(p * 65536)``: it is dropped with probability ``p`` to within 2**-17 (``p = 0.05``: 3277 /
65536 = 0.050003), and a kept one is scaled by ``1 / (1 - p)``, as PEFT's.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # installs without triton: the bits are drawn by the torch Philox below on every device
    triton = None

WORD_BITS = 32
BLOCK = 1024  # words a Triton program writes
_KEY = (0x9E3779B9, 0xBB67AE85)  # Triton's 32-bit Philox constants (triton/language/random.py)
_ROUND = (0xD2511F53, 0xCD9E8D57)
_ROUNDS = 10
_LOW32 = 0xFFFFFFFF


def threshold(p: float) -> int:
    """The 16-bit uniform at or above which an element is kept."""
    return round(p * 65536)


def available(device) -> bool:
    """Whether :func:`keep_bits` runs as a Triton kernel on ``device`` (elsewhere: the same numbers in torch)."""
    return triton is not None and torch.device(device).type == "cuda"


def keep_bits(seed: torch.Tensor, words: int, p: float) -> torch.Tensor:
    """``words`` int32 words of keep bits for dropout probability ``p``, fixed by ``seed`` (a one-element int64
    tensor on the device the words are wanted on). One ``eogym::keep_bits`` op under ``torch.compile``."""
    if not 0 < p < 1:
        raise ValueError(f"keep_bits: the dropout probability must be in (0, 1), not {p}")
    if words >= 2**29:  # counters 4 * w + j must fit the kernel's int32 offsets
        raise ValueError(f"keep_bits: {words} words is more than one call draws (2**29)")
    if not torch.compiler.is_compiling():  # a compiled caller finds it registered by PackedMaskDropout
        _op()
    return torch.ops.eogym.keep_bits(seed, words, threshold(p))


def expand(words: torch.Tensor, shape) -> torch.Tensor:
    """The keep mask of ``shape`` (bool) from its packed ``words``: bit ``e % 32`` of word ``e // 32``."""
    shifts = torch.arange(WORD_BITS, dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & 1).bool().view(shape)


class PackedMaskDropout(torch.nn.Dropout):
    """``nn.Dropout`` whose mask is :func:`keep_bits`' (a new seed from torch's generator each call). A subclass,
    so what finds dropout by type (TRL's ``disable_dropout``, PEFT) still finds it and setting ``p`` still works.
    An input whose last dimension is not a multiple of 32 runs ``nn.Dropout``'s forward."""

    def __init__(self, p: float = 0.5, inplace: bool = False):
        super().__init__(p, inplace)
        _op()  # registered before any compiled forward calls it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if not 0 < self.p < 1 or x.shape[-1] % WORD_BITS or self.inplace:
            return super().forward(x)
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=x.device)
        keep = expand(keep_bits(seed, x.numel() // WORD_BITS, self.p), x.shape)
        return x * keep.to(x.dtype) * (1.0 / (1.0 - self.p))


def use_packed_mask_dropout(model) -> int:
    """Swap each PEFT LoRA layer's ``nn.Dropout`` (``lora_dropout[adapter]``) for a :class:`PackedMaskDropout` of the
    same ``p``; return how many were swapped. ``nn.Identity`` (dropout 0) stays."""
    swapped = 0
    for module in model.modules():
        dropouts = getattr(module, "lora_dropout", None)
        if not isinstance(dropouts, torch.nn.ModuleDict):
            continue
        for name, dropout in dropouts.items():
            if type(dropout) is torch.nn.Dropout:
                dropouts[name] = PackedMaskDropout(dropout.p)
                swapped += 1
    return swapped


def _mul32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The high and low 32 bits of ``a * b`` (``a`` a 32-bit constant, ``b`` int64 holding 32-bit values), from
    16-bit halves so that no int64 product overflows."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    b_hi, b_lo = b >> 16, b & 0xFFFF
    middle = a_hi * b_lo + a_lo * b_hi
    low = a_lo * b_lo + ((middle & 0xFFFF) << 16)
    return (a_hi * b_hi + (middle >> 16) + (low >> 32)) & _LOW32, low & _LOW32


def philox(seed: torch.Tensor, counters: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Triton's ``randint4x(seed, counters)`` for int32 counters, in torch (int64 tensors holding uint32 values)."""
    c0, c1, c2, c3 = counters & _LOW32, torch.zeros_like(counters), torch.zeros_like(counters), torch.zeros_like(counters)
    k0, k1 = seed & _LOW32, (seed >> 32) & _LOW32
    for _ in range(_ROUNDS):
        hi_b, lo_b = _mul32(_ROUND[1], c2)
        hi_a, lo_a = _mul32(_ROUND[0], c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY[0]) & _LOW32, (k1 + _KEY[1]) & _LOW32
    return c0, c1, c2, c3


def keep_bits_torch(seed: torch.Tensor, words: int, cut: int) -> torch.Tensor:
    """:func:`keep_bits`' words by torch ops, on ``seed``'s device: the kernel's numbers, bit for bit."""
    index = torch.arange(words, dtype=torch.int64, device=seed.device)
    packed = torch.zeros_like(index)
    for j in range(4):
        for k, r in enumerate(philox(seed, 4 * index + j)):
            pair = ((r & 0xFFFF) >= cut).long() | (((r >> 16) >= cut).long() << 1)
            packed |= pair << (8 * j + 2 * k)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


@functools.cache
def _op():
    """Register ``eogym::keep_bits`` (the first call, not at import): a ``triton_op``, so Inductor launches the
    kernel from its own code. On a device without the kernel it calls the torch Philox as one opaque op
    (``eogym::keep_bits_torch``): traced into a compiled layer, its thousands of integer ops would triple the
    layer's compile time on a CPU (tiny model: first step 66 s against 21 s with PEFT's dropout)."""
    from torch.library import custom_op, triton_op, wrap_triton

    reference = custom_op("eogym::keep_bits_torch", keep_bits_torch, mutates_args=())

    @reference.register_fake
    def _(seed, words, cut):
        return seed.new_empty(words, dtype=torch.int32)

    @triton_op("eogym::keep_bits", mutates_args=())
    def op(seed: torch.Tensor, words: int, cut: int) -> torch.Tensor:
        if not available(seed.device):
            return reference(seed, words, cut)
        out = torch.empty(words, dtype=torch.int32, device=seed.device)
        wrap_triton(_keep_bits_kernel)[(triton.cdiv(words, BLOCK),)](seed, out, words, cut, BLOCK=BLOCK)
        return out

    return op


if triton is not None:

    @triton.jit
    def _pair(r, cut):
        """Two keep bits from one 32-bit output: bit 0 from its low half, bit 1 from its high half."""
        low = ((r & 0xFFFF).to(tl.int32) >= cut).to(tl.uint32)
        high = ((r >> 16).to(tl.int32) >= cut).to(tl.uint32)
        return low | (high << 1)

    @triton.jit
    def _keep_bits_kernel(seed_ptr, out_ptr, words, cut, BLOCK: tl.constexpr):
        index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        seed = tl.load(seed_ptr)
        packed = tl.zeros([BLOCK], dtype=tl.uint32)
        for j in tl.static_range(4):
            r0, r1, r2, r3 = tl.randint4x(seed, 4 * index + j)
            packed |= _pair(r0, cut) << (8 * j)
            packed |= _pair(r1, cut) << (8 * j + 2)
            packed |= _pair(r2, cut) << (8 * j + 4)
            packed |= _pair(r3, cut) << (8 * j + 6)
        tl.store(out_ptr + index, packed.to(tl.int32, bitcast=True), mask=index < words)
