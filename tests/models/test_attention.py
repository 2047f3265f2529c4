"""``eogym_varlen`` attention: the same loss as SDPA on padded and packed batches, sample boundaries
from the position row, and (on a GPU) the CUDA varlen kernel against the CPU reference path;
``eogym_varlen_cudnn``'s per-sample op (on CPU with torch's flash kernel for CPU) against the reference."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import chat_example, sharpen

from eogym_sft.models.attention import SampleBoundaries, SharedPrefixes, _varlen_reference, shared_prefix_attention

MIN_PIXELS, MAX_PIXELS = 1024, 16384


@pytest.fixture(scope="module")
def sharp_model_dir(tmp_path_factory):
    from eogym_sft.models.tiny import build_tiny_model

    path = tmp_path_factory.mktemp("sharp_tiny")
    sharpen(build_tiny_model(seed=3), seed=3).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def processor_at_cap(capped_processor):
    """The offline processor carrying this module's pixel cap, which the collator resizes with."""
    return capped_processor(MAX_PIXELS, MIN_PIXELS)


@pytest.fixture(scope="module")
def models(sharp_model_dir):
    from eogym_sft.models.loading import load_base_model

    sdpa = load_base_model(str(sharp_model_dir), dtype="float32").eval()
    varlen = load_base_model(str(sharp_model_dir), dtype="float32", attn_implementation="eogym_varlen").eval()
    return sdpa, varlen


def _examples():
    from PIL import Image

    return [
        chat_example("How many ships are in the harbour?", "Final Answer: 3", [Image.new("RGB", (64, 64), (200, 30, 30))]),
        chat_example("Flooded?", "No.\nFinal Answer: no"),
        chat_example(
            "Compare the two scenes.",
            "The second is greener.",
            [Image.new("RGB", (32, 96), "green"), Image.new("RGB", (64, 32), "blue")],
        ),
    ]


def test_varlen_model_uses_varlen_for_text_only(models):
    _, varlen = models
    assert varlen.config.text_config._attn_implementation == "eogym_varlen"
    assert varlen.config.vision_config._attn_implementation == "sdpa"


def test_cudnn_name_loads_for_the_text_tower_with_the_same_cpu_result(sharp_model_dir, models, processor_at_cap):
    """``load_base_model(..., "eogym_varlen_cudnn")`` switches the text tower only, finds the boundaries
    (its hook acts for both names), and on CPU computes exactly what ``eogym_varlen`` does."""
    from eogym_sft.models.loading import load_base_model
    from eogym_sft.data.collator import EOGymCollator

    _, varlen = models
    cudnn = load_base_model(str(sharp_model_dir), dtype="float32", attn_implementation="eogym_varlen_cudnn").eval()
    assert cudnn.config.text_config._attn_implementation == "eogym_varlen_cudnn"
    assert cudnn.config.vision_config._attn_implementation == "sdpa"
    batch = EOGymCollator(processor_at_cap, padding_free=True)(_examples())
    with torch.no_grad():
        assert torch.equal(cudnn(**batch, use_cache=False).logits, varlen(**batch, use_cache=False).logits)


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "packed"])
def test_varlen_gives_the_sdpa_loss(models, processor_at_cap, padding_free):
    from eogym_sft.data.collator import EOGymCollator

    sdpa, varlen = models
    collator = EOGymCollator(processor_at_cap, padding_free=padding_free)
    batch = collator(_examples())
    with torch.no_grad():
        want = sdpa(**batch, use_cache=False)
        got = varlen(**batch, use_cache=False)
    assert abs(got.loss.item() - want.loss.item()) < 1e-5
    valid = batch["labels"] != -100
    assert torch.allclose(got.logits[valid], want.logits[valid], atol=1e-4, rtol=0)
    if padding_free:
        # the comparison can fail: without sample boundaries the varlen loss moves by far more than 1e-5
        leaky = dict(batch, position_ids=batch["position_ids"].clone())
        leaky["position_ids"][0, 0] = torch.arange(batch["input_ids"].shape[1])
        with torch.no_grad():
            assert abs(varlen(**leaky, use_cache=False).loss.item() - want.loss.item()) > 1e-3


def testboundaries_from_a_position_row():
    boundaries = SampleBoundaries()
    row = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 0, 1, 2]])
    cu, max_len = boundaries(row)
    assert cu.dtype == torch.int32
    assert cu.tolist() == [0, 4, 6, 7, 10] and max_len == 4
    # a padded batch flattens row after row; each pad (position 0) is a sample of one token
    padded = torch.tensor([[0, 1, 2, 0, 0], [0, 1, 2, 3, 4]])
    cu, max_len = boundaries(padded)
    assert cu.tolist() == [0, 3, 4, 5, 10] and max_len == 5
    # cached per tensor object, recomputed for a new one
    assert boundaries(padded)[0] is cu
    assert boundaries(padded.clone())[0] is not cu
    # a row that does not start at position 0 still starts a sample: nothing attends across rows
    offset = torch.tensor([[0, 1, 2, 0, 1], [5, 6, 7, 8, 9]])
    cu, max_len = boundaries(offset)
    assert cu.tolist() == [0, 3, 5, 10] and max_len == 5


def test_varlen_refuses_what_it_cannot_compute():
    """A KV cache (queries shorter than keys: generation) and key boundaries other than the queries' are
    refused by name rather than computed wrongly; a caller's boundaries without a length get one."""
    from eogym_sft.models.attention import varlen_attention_forward

    q, kv = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="KV cache"):
        varlen_attention_forward(None, q[:, :, :1], kv, kv, None, cu_seq_lens_q=torch.tensor([0, 1], dtype=torch.int32))
    cu = torch.tensor([0, 2, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seq_lens_k must equal"):
        varlen_attention_forward(None, q, kv, kv, None, cu_seq_lens_q=cu, cu_seq_lens_k=torch.tensor([0, 1, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="'eogym_varlen_cudnn' has no attention dropout"):  # the name the user chose
        varlen_attention_forward(None, q, kv, kv, None, dropout=0.1, cuda_kernel="cudnn", cu_seq_lens_q=cu)
    out, _ = varlen_attention_forward(None, q, kv, kv, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu.clone())
    want = _varlen_reference(*(t.transpose(1, 2)[0] for t in (q, kv, kv)), cu, 8**-0.5)
    torch.testing.assert_close(out[0], want)


def test_reference_path_is_causal_per_segment():
    torch.manual_seed(0)
    total, heads, kv_heads, dim = 9, 4, 2, 8
    q, k, v = torch.randn(total, heads, dim), torch.randn(total, kv_heads, dim), torch.randn(total, kv_heads, dim)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    out = _varlen_reference(q, k, v, cu, 1 / math.sqrt(dim))
    # by hand for one query: token 2 of the first segment (head 3 -> kv head 1) sees keys 0..2 only
    scores = (q[2, 3] @ k[:3, 1].T) / math.sqrt(dim)
    assert torch.allclose(out[2, 3], torch.softmax(scores, -1) @ v[:3, 1], atol=1e-6)
    # the second segment starts afresh: its first token attends to itself only
    assert torch.allclose(out[4], v[4].repeat_interleave(2, 0), atol=1e-6)


def _shared_and_unshared(prefix, lengths, device="cpu", dtype=torch.float64):
    """A packed row of one prefix then segments of ``lengths`` after it, and the same episodes unshared (the prefix
    copied before each segment): ``(q, k, v, layout)`` of each."""
    q, k, v, _ = _packed([prefix, *lengths], heads=4, kv_heads=2, device=device, dtype=dtype)
    ends = torch.tensor([prefix, *lengths]).cumsum(0).tolist()
    layout = SharedPrefixes(((0, prefix, 0, 0), *((a, b, 0, prefix) for a, b in zip(ends[:-1], ends[1:]))))
    whole = [torch.cat([t[:prefix], t[a:b]]) for t in (q, k, v) for a, b in zip(ends[:-1], ends[1:])]
    episodes = [torch.cat(whole[i * len(lengths):(i + 1) * len(lengths)]) for i in range(3)]
    cu = torch.tensor([0, *torch.tensor([prefix + n for n in lengths]).cumsum(0).tolist()], dtype=torch.int32)
    return (q, k, v, layout), (*episodes, cu)


def test_shared_prefix_attention_is_each_episode_attended_whole_with_its_gradient():
    """Segments after a shared prefix give what each episode (prefix + segment) gives packed whole, and the
    prefix's gradients are the sums over its copies."""
    prefix, lengths = 5, [3, 1, 4]
    (q, k, v, layout), (qw, kw, vw, cu) = _shared_and_unshared(prefix, lengths)
    for t in (q, k, v, qw, kw, vw):
        t.requires_grad_(True)
    scale = 0.3
    out, whole = shared_prefix_attention(q, k, v, layout, scale), _varlen_reference(qw, kw, vw, cu, scale)
    starts = [0, *torch.tensor([prefix + n for n in lengths]).cumsum(0).tolist()]
    want = torch.cat([whole[:prefix]] + [whole[a + prefix:b] for a, b in zip(starts[:-1], starts[1:])])
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-10)
    for a, b in zip(starts[1:-1], starts[2:]):  # every episode's prefix rows are the first episode's
        torch.testing.assert_close(whole[a:a + prefix], whole[:prefix], atol=1e-12, rtol=1e-10)
    grad = torch.randn_like(out)
    out.backward(grad)
    full_grad = torch.zeros_like(whole)
    for i, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
        full_grad[a + prefix:b] = grad[prefix + sum(lengths[:i]):prefix + sum(lengths[:i + 1])]
    full_grad[:prefix] = grad[:prefix]  # the prefix's own rows count once: in the first episode
    whole.backward(full_grad)
    for shared, unshared in ((q, qw), (k, kw), (v, vw)):
        copies = [unshared.grad[a:a + prefix] for a in starts[:-1]]
        torch.testing.assert_close(shared.grad[:prefix], sum(copies), atol=1e-10, rtol=1e-8)
        own = torch.cat([unshared.grad[a + prefix:b] for a, b in zip(starts[:-1], starts[1:])])
        torch.testing.assert_close(shared.grad[prefix:], own, atol=1e-10, rtol=1e-8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_shared_prefix_attention_on_cuda_in_bf16_matches_the_float64_reference():
    """On CUDA in bf16 (flash's kernel, the grouped heads unrepeated) the shared path is the CPU one."""
    prefix, lengths = 300, [40, 129, 7]
    (q, k, v, layout), _ = _shared_and_unshared(prefix, lengths, device="cuda", dtype=torch.bfloat16)
    got = shared_prefix_attention(q, k, v, layout, 0.1)
    want = shared_prefix_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), layout, 0.1)
    torch.testing.assert_close(got.double().cpu(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_varlen_matches_the_reference_and_is_causal():
    from eogym_sft.models.attention import _varlen_cuda, takes_gqa_flag

    torch.manual_seed(0)
    lengths = [37, 128, 91]
    total, heads, kv_heads, dim = sum(lengths), 32, 8, 128
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(total, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(total, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    scale = 1 / math.sqrt(dim)
    got = _varlen_cuda(q, k, v, cu, max(lengths), scale, takes_gqa_flag())
    want = _varlen_reference(q.float(), k.float(), v.float(), cu, scale)
    assert got.shape == q.shape and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    # causality and isolation: change the keys/values of the last token of segment 1 and everything of
    # segment 2; only that last token of segment 1 and segment 2 may change
    k2, v2 = k.clone(), v.clone()
    last = lengths[0] + lengths[1] - 1
    k2[last:] = torch.randn_like(k2[last:])
    v2[last:] = torch.randn_like(v2[last:])
    again = _varlen_cuda(q, k2, v2, cu, max(lengths), scale, takes_gqa_flag())
    assert torch.equal(again[:last], got[:last])
    assert not torch.equal(again[last], got[last])
    assert (again[last + 1 :] != got[last + 1 :]).any(-1).any(-1).all()


def _packed(lengths, heads=4, kv_heads=2, dim=8, dtype=torch.float64, device="cpu", seed=0):
    torch.manual_seed(seed)
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    make = lambda h: torch.randn(total, h, dim, dtype=dtype, device=device)  # noqa: E731
    return make(heads), make(kv_heads), make(kv_heads), cu


def test_per_sample_op_is_the_reference_with_its_gradient():
    """``eogym_varlen_cudnn``'s per-sample op (here with torch's flash kernel for CPU, the same loop as cuDNN's on
    a GPU) gives the reference's output and gradients, with samples of 1 token, of exactly and just over
    ``LENGTH_BUCKET`` tokens (each padded to a multiple of it) and grouped heads, and returns each sample's
    log-sum-exp, sample-major."""
    from eogym_sft.models.attention import LENGTH_BUCKET, per_sample_op

    lengths = [3, 1, 6, 2, LENGTH_BUCKET, LENGTH_BUCKET + 1]
    q, k, v, cu = _packed(lengths, dtype=torch.float32)
    grad = torch.randn_like(q)
    results = []
    for attend in (_varlen_reference, lambda *t: per_sample_op()(*t)[0]):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attend(*leaves, cu, 0.3)
        results.append((out, *torch.autograd.grad(out, leaves, grad)))
    for want, got in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    lse = per_sample_op()(q, k, v, cu, 0.3)[1]
    start, end = 4, 10  # the third sample
    scores = 0.3 * q[start:end].transpose(0, 1) @ k[start:end].repeat_interleave(2, 1).permute(1, 2, 0)
    causal = torch.ones(end - start, end - start, dtype=torch.bool).tril()
    want_lse = scores.masked_fill(~causal, float("-inf")).logsumexp(-1)  # [heads, length]
    torch.testing.assert_close(lse[start * 4:end * 4].view(4, end - start), want_lse, rtol=1e-5, atol=1e-5)


def test_per_sample_op_passes_torchs_op_checks_on_strided_inputs():
    """``torch.library.opcheck`` (fake tensors against the real op, strides included; the autograd registration;
    AOTAutograd with dynamic shapes) on queries strided as ``varlen_attention_forward`` passes them from
    ``[1, heads, length, dim]``: head-major, not contiguous."""
    from eogym_sft.models.attention import per_sample_op

    q, k, v, cu = _packed([3, 1, 6], dtype=torch.float32)
    q = q.transpose(0, 1).contiguous().transpose(0, 1)
    assert not q.is_contiguous()
    torch.library.opcheck(per_sample_op(), ([t.clone().requires_grad_() for t in (q, k, v)] + [cu, 0.3]))


def test_per_sample_op_in_bf16_with_strided_gradients():
    """bf16 as training runs it, a strided query, an upstream gradient that is not contiguous and one that is
    broadcast (``out.sum()``'s): the reference's output and gradients in float32, up to bf16 rounding."""
    from eogym_sft.models.attention import per_sample_op

    q, k, v, cu = _packed([5, 130], dtype=torch.bfloat16)
    q = q.transpose(0, 1).contiguous().transpose(0, 1)
    for grad in (torch.randn(q.shape[::-1]).permute(2, 1, 0), torch.ones(()).expand(q.shape)):
        results = []
        for attend, dtype in ((_varlen_reference, torch.float32), (lambda *t: per_sample_op()(*t)[0], torch.bfloat16)):
            leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
            out = attend(*leaves, cu, 0.3)
            results.append((out, *torch.autograd.grad(out, leaves, grad.to(dtype))))
        for want, got in zip(*results):
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_per_sample_op_skips_empty_samples():
    """Boundaries that repeat (an empty sample, as boundaries padded to a fixed count have) give the result of
    the same boundaries without the repeat; CPU's kernel on an empty sample kills the process instead."""
    from eogym_sft.models.attention import per_sample_op

    q, k, v, cu = _packed([3, 4], dtype=torch.float32)
    repeated = torch.tensor([0, 3, 3, 7, 7], dtype=torch.int32)
    out, lse = per_sample_op()(q, k, v, repeated, 0.3)
    want_out, want_lse = per_sample_op()(q, k, v, cu, 0.3)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def test_per_sample_op_compiles_to_one_graph_for_any_boundaries():
    """One opaque node: one dynamic graph for packs of 1-5 samples, each with the eager result and gradients."""
    from torch._dynamo.utils import counters

    from eogym_sft.models.attention import per_sample_op

    op = per_sample_op()  # looked up outside the compiled function, as register_varlen_attention does
    attend = lambda q, k, v, cu: op(q, k, v, cu, 0.3)[0] * 2  # noqa: E731
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(attend, backend="aot_eager", dynamic=True, fullgraph=True)
    for lengths in ([3, 5], [2, 7, 4], [9, 1, 1, 3, 8], [6]):
        q, k, v, cu = _packed(lengths, dim=16, dtype=torch.float32)
        grad = torch.randn_like(q)
        results = []
        for fn in (attend, compiled):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = fn(*leaves, cu)
            results.append((out, *torch.autograd.grad(out, leaves, grad)))
        for want, got in zip(*results):
            torch.testing.assert_close(got, want)
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


def test_per_sample_cudnn_kernels_take_our_arguments():
    """The private aten cuDNN ops the per-sample op calls on CUDA, on meta tensors (their fakes are torch's): the
    arguments we pass bind, the log-sum-exp is ``[1, heads, length, 1]`` (the layout the backward is handed back),
    flattens to ``heads * length`` and goes back in, and gradients come back in the inputs' shapes, grouped
    key/value heads as they are."""
    from eogym_sft.models.attention import _padded_sample, _sample_kernels

    forward, backward = _sample_kernels("cuda")
    q = torch.empty(11, 32, 128, dtype=torch.bfloat16, device="meta")
    kv = torch.empty(11, 8, 128, dtype=torch.bfloat16, device="meta")
    views = [_padded_sample(q, 2, 9, 16), _padded_sample(kv, 2, 9, 16), _padded_sample(kv, 2, 9, 16)]
    assert [tuple(t.shape) for t in views] == [(1, 32, 16, 128), (1, 8, 16, 128), (1, 8, 16, 128)]
    raw_lse = torch.ops.aten._scaled_dot_product_cudnn_attention(*views, None, True, 0.0, True, False, scale=0.1)[1]
    assert tuple(raw_lse.shape) == (1, 32, 16, 1) and raw_lse.is_contiguous()
    out, lse = forward(*views, 0.1)
    assert tuple(out.shape) == (1, 32, 16, 128) and tuple(lse.shape) == (32, 16) and lse.dtype == torch.float32
    grads = backward(out, *views, out, lse, 0.1)
    assert [tuple(g.shape) for g in grads] == [(1, 32, 16, 128), (1, 8, 16, 128), (1, 8, 16, 128)]


def test_cudnn_kernel_failure_names_the_setting_to_change(monkeypatch):
    """A machine without cuDNN's fused attention (GPU, dtype or build) gets an error that names
    ``eogym_varlen_cudnn`` and the setting that avoids it, with cuDNN's own message kept as the cause."""
    from eogym_sft.models.attention import _sample_kernels

    def refuse(*args, **kwargs):
        raise RuntimeError("No valid execution plans built.")

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", refuse)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some GPU")
    forward, _ = _sample_kernels("cuda")
    q = torch.zeros(1, 4, 256, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="'eogym_varlen_cudnn'.*256 rows.*Some GPU.*attn_implementation: eogym_varlen .*"
                                           "No valid execution plans") as caught:
        forward(q, q, q, 0.3)
    assert str(caught.value.__cause__) == "No valid execution plans built."


def test_padded_sample_zero_pads_a_samples_rows():
    """Sample rows 1:3 of 2 heads padded to 4 rows: ``[1, heads, rows, dim]``, zero after the sample."""
    from eogym_sft.models.attention import _padded_sample

    t = torch.arange(4 * 2 * 1, dtype=torch.float32).view(4, 2, 1)  # [tokens, heads, dim]: token * 2 + head
    got = _padded_sample(t, 1, 3, 4)[0, :, :, 0]  # [heads, rows]
    assert torch.equal(got, torch.tensor([[2.0, 4, 0, 0], [3, 5, 0, 0]]))


def test_window_is_a_view_where_the_packed_rows_reach():
    """A sample's rows padded to ``length``: the packed rows themselves (the next sample's after it) while they
    reach that far, a zero-padded copy at the end of the pack."""
    from eogym_sft.models.attention import _window

    t = torch.arange(5 * 2 * 1, dtype=torch.float32).view(5, 2, 1)  # [tokens, heads, dim]: token * 2 + head
    inside = _window(t, 1, 3, 4)
    assert inside.data_ptr() == t[1].data_ptr() and torch.equal(inside[0, :, :, 0], torch.tensor([[2.0, 4, 6, 8], [3, 5, 7, 9]]))
    at_end = _window(t, 3, 5, 4)
    assert torch.equal(at_end[0, :, :, 0], torch.tensor([[6.0, 8, 0, 0], [7, 9, 0, 0]]))


def test_sample_lse_is_infinite_after_the_sample():
    """The backward's log-sum-exp of sample rows 1:3 (2 heads, stored sample-major) padded to 4 rows: +inf in the
    rows after the sample, whose softmax weights are then 0 whatever their scores."""
    from eogym_sft.models.attention import _sample_lse

    lse = torch.arange(10, dtype=torch.float32)  # 5 tokens x 2 heads; the sample at rows 1:3 holds [h0: 2, 3; h1: 4, 5]
    inf = float("inf")
    assert torch.equal(_sample_lse(lse, 2, 1, 3, 4), torch.tensor([[2.0, 3, inf, inf], [4, 5, inf, inf]]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cudnn_kernels_match_the_varlen_kernel():
    """``eogym_varlen_cudnn``'s kernel (cuDNN's dense one per sample, grouped heads as they are)
    against ``eogym_varlen``'s on the same packed samples (Qwen3-VL-4B's heads, bf16, one sample over 256
    tokens): outputs and gradients agree to bf16 rounding."""
    from eogym_sft.models.attention import _varlen_cuda, per_sample_op, takes_gqa_flag

    lengths = [37, 300, 91]
    q, k, v, cu = _packed(lengths, heads=32, kv_heads=8, dim=128, dtype=torch.bfloat16, device="cuda")
    grad = torch.randn_like(q)
    kernels = [lambda *t: _varlen_cuda(*t, cu, max(lengths), 128**-0.5, takes_gqa_flag()),
               lambda *t: per_sample_op()(*t, cu, 128**-0.5)[0]]
    results = []
    for attend in kernels:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attend(*leaves)
        results.append((out, *torch.autograd.grad(out, leaves, grad)))
    for flash, cudnn in zip(*results):
        torch.testing.assert_close(cudnn.float(), flash.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cudnn_kernel_leaves_right_padded_batches_to_flash():
    """Right-padded rows make each pad token a sample (position 0); padding those to the longest sample would
    take pads x max_len memory, so ``eogym_varlen_cudnn`` runs such batches on the flash kernel: the same
    output as ``eogym_varlen``, bit for bit."""
    from eogym_sft.models.attention import takes_gqa_flag, varlen_attention_forward

    torch.manual_seed(0)
    query = torch.randn(2, 32, 300, 128, device="cuda", dtype=torch.bfloat16)
    key, value = (torch.randn(2, 8, 300, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    positions = torch.arange(300, device="cuda").repeat(2, 1)
    positions[1, 200:] = 0  # row 1: 200 real tokens, then 100 pad tokens
    outs = [varlen_attention_forward(None, query, key, value, None, gqa_flag=takes_gqa_flag(), cuda_kernel=kernel,
                                     position_ids=positions)[0] for kernel in ("flash", "cudnn")]
    assert torch.equal(outs[0], outs[1])


def test_reference_backward_is_the_autograd_gradient():
    """The CPU op's hand-written backward against autograd through the per-sample SDPA reference (float64),
    and torch's own checks of the op (fake tensor, autograd registration, schema)."""
    from eogym_sft.models.attention import _varlen_reference_backward, reference_op

    torch.manual_seed(0)
    q = torch.randn(9, 4, 8, dtype=torch.float64)
    k, v = torch.randn(9, 2, 8, dtype=torch.float64), torch.randn(9, 2, 8, dtype=torch.float64)
    cu = torch.tensor([0, 4, 5, 9], dtype=torch.int32)
    grad = torch.randn_like(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(_varlen_reference(*leaves, cu, 0.3), leaves, grad)
    got = _varlen_reference_backward(grad, q, k, v, cu, 0.3)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    torch.library.opcheck(reference_op(), ([t.clone().requires_grad_() for t in (q, k, v)] + [cu, 0.3]))
    # bf16 in, bf16 out: computed in float32 and rounded once
    low = [t.bfloat16() for t in (grad, q, k, v)]
    for g, w in zip(_varlen_reference_backward(*low, cu, 0.3), want):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.double(), w, rtol=2e-2, atol=2e-2)


def _layer_kwargs(model, batch, layer=None) -> dict:
    """The keyword arguments a layer (the first decoder layer unless given) is called with."""
    seen = {}
    layer = layer or model.get_decoder().layers[0]
    handle = layer.register_forward_pre_hook(lambda module, args, kwargs: seen.update(kwargs), with_kwargs=True)
    with torch.no_grad():
        model(**batch, use_cache=False)
    handle.remove()
    return seen


def test_boundaries_reach_the_layers_from_the_text_positions(models, processor_at_cap):
    """``load_base_model(..., "eogym_varlen")`` finds the packed samples once, before the layers, from the
    text row of the collator's 4-row position ids; a model switched to SDPA gets nothing added."""
    from eogym_sft.data.collator import EOGymCollator

    _, varlen = models
    batch = EOGymCollator(processor_at_cap, padding_free=True)(_examples())
    starts = (batch["position_ids"][0, 0] == 0).nonzero().flatten().tolist() + [batch["input_ids"].shape[1]]
    assert len(starts) == 4  # three samples
    seen = _layer_kwargs(varlen, batch)
    assert seen["cu_seq_lens_q"].tolist() == starts and seen["cu_seq_lens_k"] is seen["cu_seq_lens_q"]
    assert seen["max_length_q"] == seen["max_length_k"] == max(b - a for a, b in zip(starts, starts[1:]))
    vision_block = varlen.model.visual.blocks[0]  # the vision tower keeps its own per-image boundaries
    assert "cu_seq_lens_q" not in _layer_kwargs(varlen, batch, vision_block)
    try:
        varlen.set_attn_implementation({"text_config": "eogym_varlen_cudnn", "vision_config": "sdpa"})
        assert _layer_kwargs(varlen, batch)["cu_seq_lens_q"].tolist() == starts  # the other kernel, the same boundaries
        varlen.set_attn_implementation({"text_config": "sdpa", "vision_config": "sdpa"})
        assert "cu_seq_lens_q" not in _layer_kwargs(varlen, batch)
    finally:
        varlen.set_attn_implementation({"text_config": "eogym_varlen", "vision_config": "sdpa"})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("attn", ["eogym_varlen", "eogym_varlen_cudnn"])
def test_compiled_layers_on_cuda_are_one_graph_with_the_eager_loss(tmp_path, processor_at_cap, attn):
    """On each GPU kernel (torch's varlen_attn; cuDNN's, sample by sample) and Inductor: no graph break in a
    compiled layer, one graph for micro-batches of several lengths and sample counts (one sample included),
    and the eager loss up to bf16 rounding. (The demo's tiny model:
    flash kernels need a head dim that is a multiple of 8, and the tests' tiny one has 4.)"""
    from helpers import perturb_lora_b
    from torch._dynamo.utils import counters

    from eogym_sft.models.loading import (
        apply_lora,
        compile_language_layers,
        load_base_model,
    )
    from eogym_sft.models.tiny import DEMO_QWEN3_VL_CONFIG, build_tiny_model
    from eogym_sft.data.collator import EOGymCollator

    build_tiny_model(seed=3, config=DEMO_QWEN3_VL_CONFIG).save_pretrained(tmp_path)
    sharp_model_dir = tmp_path

    collator = EOGymCollator(processor_at_cap, padding_free=True)
    batches = [{k: v.cuda() for k, v in collator(examples).items()} for examples in (_examples(), _examples()[1:], _examples()[:1])]

    def lora_model():  # the same non-zero adapter each time (PEFT draws LoRA A from the global RNG)
        base = load_base_model(str(sharp_model_dir), attn_implementation=attn)
        torch.manual_seed(3)
        return perturb_lora_b(apply_lora(base, dropout=0.0), seed=3).cuda().train()

    eager = lora_model()
    want = [eager(**b, use_cache=False).loss.item() for b in batches]
    # cuDNN's per-sample loop gets a packed batch's boundaries on the host from the pre-hook (no sync in each layer);
    # flash's kernel, and right-padded batches (flash's kernel under either name), on the GPU
    boundaries = _layer_kwargs(eager, batches[0])["cu_seq_lens_q"]
    assert boundaries.device.type == ("cpu" if attn == "eogym_varlen_cudnn" else "cuda")
    padded = EOGymCollator(processor_at_cap, padding_free=False)(_examples())
    assert _layer_kwargs(eager, {k: v.cuda() for k, v in padded.items()})["cu_seq_lens_q"].device.type == "cuda"
    torch._dynamo.reset()
    counters.clear()
    compiled = lora_model()
    compile_language_layers(compiled)
    got = []
    for b in batches:
        loss = compiled(**b, use_cache=False).loss
        loss.backward()
        got.append(loss.item())
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    assert got == pytest.approx(want, rel=2e-2)
    torch._dynamo.reset()
