"""Split-KV decode attention against masked SDPA: on CPU under triton's interpreter, compiled for sm_90 without a GPU,
and (marked gpu) on CUDA, in a CUDA graph and inside the slot decoder."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton", reason="the split-KV kernels are triton's (setup.cfg's dev extra installs it)")

from eogym_sft.models import decode_attention as split_kv  # noqa: E402 (after the skip)

LENGTHS = (0, 1, 64, 100, 129, 192)  # empty, one key, a block, ragged, a block and one, the span
SPAN, MAX_LEN = 192, 200  # three 64-key blocks; the cache longer than the span
# (dtype, atol, rtol): fp32 to its rounding of sums of 192 terms; fp16 to the output's rounding (2**-11 relative)
# plus the probabilities rounded to fp16 before they multiply the values, as flash kernels do
TOLERANCES = {torch.float32: (2e-6, 2e-6), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def _case(groups: int, head_dim: int, dtype, lengths=LENGTHS, kv_heads: int = 2, device="cpu", seed: int = 0):
    """``(q, keys, values, lengths)``: q a strided view (the query heads' dim in the middle, as a reshape may leave it),
    every cache row at or past a slot's length NaN (read, it would make that slot's output NaN)."""
    g = torch.Generator().manual_seed(seed)
    slots = len(lengths)
    q = torch.randn(slots, groups, kv_heads, head_dim, generator=g).transpose(1, 2)
    keys, values = (torch.randn(slots, kv_heads, MAX_LEN, head_dim, generator=g) for _ in range(2))
    for s, n in enumerate(lengths):
        keys[s, :, n:] = values[s, :, n:] = float("nan")
    lengths = torch.tensor(lengths)
    return [t.to(device) for t in (q.to(dtype), keys.to(dtype), values.to(dtype), lengths)]


def _reference(q, keys, values, lengths, span: int, scale: float):
    """Masked SDPA over the span's keys, a boolean mask keys < length; the NaN rows zeroed first (a boolean mask
    still multiplies them by 0)."""
    visible = (torch.arange(span, device=q.device)[None] < lengths[:, None])[:, None, None]
    return F.scaled_dot_product_attention(
        q, keys[:, :, :span].nan_to_num(), values[:, :, :span].nan_to_num(), attn_mask=visible, scale=scale
    )


def _check(out, q, keys, values, lengths, span: int, scale: float) -> None:
    atol, rtol = TOLERANCES[q.dtype]
    assert out.shape == q.shape and out.dtype == q.dtype
    empty = lengths == 0
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))  # no key: zeros, never NaN
    expected = _reference(q, keys, values, lengths, span, scale)
    torch.testing.assert_close(out[~empty], expected[~empty], atol=atol, rtol=rtol)


# (dtype, groups, head_dim, splits) under the interpreter, about 0.3 s each: every groups, head_dim and split count in
# each dtype, the 4B's groups and head_dim over one-block splits (the short slots' later splits empty) in both; None:
# splits_for(span), one for this span
INTERPRETED = [
    ("float32", 1, 4, 1), ("float32", 2, 16, 3), ("float32", 4, 128, 3), ("float32", 4, 128, None),
    ("float32", 1, 128, 3), ("float32", 2, 4, None),
    ("float16", 4, 128, 3), ("float16", 1, 16, 1), ("float16", 2, 4, 3), ("float16", 4, 16, None),
]


def interpreted_checks() -> list[str]:
    """The ``INTERPRETED`` cases under the interpreter (TRITON_INTERPRET=1 set before triton was imported), each
    checked by :func:`_check`; the cases checked, one a line."""
    done = []
    for dtype, groups, head_dim, splits in INTERPRETED:
        q, keys, values, lengths = _case(groups, head_dim, getattr(torch, dtype), seed=groups * head_dim)
        scale = head_dim**-0.5
        out = split_kv.decode_attention(q, keys, values, lengths, SPAN, scale, splits=splits)
        _check(out, q, keys, values, lengths, SPAN, scale)
        done.append(f"{dtype} groups {groups} head_dim {head_dim} splits {splits}")
    return done


def test_the_kernels_equal_masked_sdpa_under_the_interpreter():
    # TRITON_INTERPRET is read when triton's jit decorates the kernels: a fresh process, which imports this checkout's
    # package whether or not it is installed
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(filter(None, (repo, os.environ.get("PYTHONPATH"))))}
    ran = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stdout.splitlines() == [f"{c[0]} groups {c[1]} head_dim {c[2]} splits {c[3]}" for c in INTERPRETED]


def test_splits_depend_on_the_span_alone_and_cover_it_in_whole_blocks():
    assert [split_kv.splits_for(span) for span in (1, 512, 513, 6144, 8192, 14336)] == [1, 1, 2, 12, 16, 16]
    assert [split_kv.split_size(span, split_kv.splits_for(span)) for span in (192, 512, 6144, 14336)] == [192, 512, 512, 896]
    assert split_kv.split_size(192, 3) == 64 and split_kv.split_size(200, 3) == 128  # 67 keys each, rounded up to 2 blocks


def test_available_needs_a_cuda_device():
    assert not split_kv.available("cpu")
    assert not split_kv.available(torch.device("meta"))


def _signature(kernel, pointers: dict, floats=(), constexprs: dict = {}):  # noqa: B006 (read only)
    return {name: pointers.get(name, "fp32" if name in floats else "constexpr" if name in constexprs else "i32")
            for name in kernel.arg_names}


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_triton_compiles_both_kernels_for_sm90_without_a_gpu(dtype):
    """What the GPU host's compiler must accept, at the 4B's shapes (4 query rows padded to 16, head_dim 128), down to
    a cubin by ptxas (triton's own) for an H100/H200."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter's kernels are no JIT functions to compile")
    target = GPUTarget("cuda", 90, 64)
    first = {"ROWS": 16, "BLOCK_D": 128, "BLOCK_N": 64, "PRECISION": "ieee" if dtype == "fp32" else "tf32"}
    data = {name: f"*{dtype}" for name in ("q", "k", "v")} | {"lengths": "*i64", "partial": "*fp32", "stats": "*fp32"}
    second = {"MAX_SPLITS": split_kv.MAX_SPLITS, "ROWS": 16, "BLOCK_D": 128}
    for kernel, pointers, floats, constexprs in (
        (split_kv._partials, data, ("scale_log2",), first),
        (split_kv._combine, {"partial": "*fp32", "stats": "*fp32", "out": f"*{dtype}"}, (), second),
    ):
        signature = _signature(kernel, pointers, floats, constexprs)
        source = ASTSource(kernel, signature, constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()})
        compiled = triton.compile(source, target=target)
        assert compiled.asm["cubin"][:4] == b"\x7fELF" and ".target sm_90" in compiled.asm["ptx"]


# --------------------------------------------------------------------------- on a GPU


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("groups,head_dim", [(1, 64), (4, 128), (2, 16)])
@pytest.mark.parametrize("splits", [1, 3, None])
def test_the_kernels_equal_masked_sdpa_on_cuda(dtype, groups, head_dim, splits):
    device = _cuda()
    q, keys, values, lengths = _case(groups, head_dim, dtype, kv_heads=8, device=device)
    scale = head_dim**-0.5
    out = split_kv.decode_attention(q, keys, values, lengths, SPAN, scale, splits=splits)
    _check(out, q, keys, values, lengths, SPAN, scale)


@pytest.mark.gpu
def test_a_long_span_of_ragged_slots_equals_masked_sdpa_on_cuda():
    """32 slots of the 4B's shapes (8 KV heads of 4 query heads, head_dim 128), lengths up to a 6,144-key span: 12
    splits, most of them empty for the short slots."""
    device = _cuda()
    g = torch.Generator(device=device).manual_seed(0)
    slots, span = 32, 6144
    lengths = torch.randint(1, span + 1, (slots,), generator=g, device=device)
    lengths[:3] = torch.tensor([1, 513, span], device=device)
    q = torch.randn(slots, 8, 4, 128, generator=g, device=device, dtype=torch.bfloat16)
    keys, values = (torch.randn(slots, 8, 8192, 128, generator=g, device=device, dtype=torch.bfloat16) for _ in range(2))
    out = split_kv.decode_attention(q, keys, values, lengths, span, 128**-0.5)
    _check(out, q, keys, values, lengths, span, 128**-0.5)


@pytest.mark.gpu
def test_a_captured_graph_replays_over_new_lengths():
    """The grids depend on the span alone: a graph captured at one set of lengths gives masked SDPA's output for
    others, the lengths read from the tensor it was captured with."""
    device = _cuda()
    q, keys, values, lengths = _case(4, 128, torch.bfloat16, kv_heads=8, device=device)
    q = q.contiguous()
    split_kv.decode_attention(q, keys, values, lengths, SPAN, 0.1)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = split_kv.decode_attention(q, keys, values, lengths, SPAN, 0.1)
    for new in ((192, 0, 1, 65, 191, 128), (5, 6, 7, 8, 9, 10), LENGTHS):
        _, fresh_keys, fresh_values, fresh_lengths = _case(4, 128, torch.bfloat16, lengths=new, kv_heads=8, device=device)
        keys.copy_(fresh_keys)
        values.copy_(fresh_values)
        lengths.copy_(fresh_lengths)
        graph.replay()
        _check(out, q, keys, values, lengths, SPAN, 0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_the_slot_decoder_with_the_kernels_equals_its_masked_sdpa_step(graphs):
    """The tiny model in fp32 on CUDA: two decoders, one switched to masked SDPA, the same prompts and tokens; slots of
    different lengths, one idle, spans crossing 64-token buckets (several graphs when graphed)."""
    device = _cuda()
    from helpers import decode_side_by_side  # not at the top: this file also runs as a script under the interpreter

    from eogym_sft.agent.decoder import SlotDecoder
    from eogym_sft.models.tiny import TINY_QWEN3_VL_CONFIG, build_tiny_model

    config = copy.deepcopy(TINY_QWEN3_VL_CONFIG)
    config["text_config"]["initializer_range"] = 1.0  # varied logits
    model = build_tiny_model(0, config).eval().to(device)
    kernel = SlotDecoder(model, slots=3, max_len=512, attn_bucket=64, cuda_graphs=graphs)
    sdpa = SlotDecoder(model, slots=3, max_len=512, attn_bucket=64, cuda_graphs=graphs)
    sdpa.attention = "masked_sdpa"
    assert kernel.attention == "split_kv"
    g = torch.Generator().manual_seed(0)
    prompts = {0: torch.randint(0, 1000, (40,), generator=g).tolist(), 2: torch.randint(0, 1000, (100,), generator=g).tolist()}
    for decoder in (kernel, sdpa):
        for slot, ids in prompts.items():
            decoder.prefill(slot, ids, [])
    decode_side_by_side(kernel, sdpa, atol=1e-4)
    if graphs:
        assert len(kernel._step.graphs) >= 2


if __name__ == "__main__":  # the interpreter's run: see test_the_kernels_equal_masked_sdpa_under_the_interpreter
    assert os.environ.get("TRITON_INTERPRET") == "1"
    print(*interpreted_checks(), sep="\n")
