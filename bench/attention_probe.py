"""Causal attention of packed EO-Gym-sized samples, forward + backward, by kernel: what ``eogym_varlen``
and ``eogym_varlen_cudnn`` call (cuDNN's dense kernel per sample, also with new sample lengths every call,
which would make cuDNN build a plan each time but for the 128-token rounding), cuDNN's ragged kernel by its
bare aten ops (torch routes to it from 2.14; on 2.11 its backward is wrong), and SDPA's backends on a dense batch.

    python bench/attention_probe.py --lengths 6000,6000 --json attention.json
    python bench/attention_probe.py --lengths 3500,8500 --json attention_unequal.json

Qwen3-VL-4B's text attention shape (32 query heads, 8 key/value heads, head dim 128), bf16. Reports ms
per forward + backward and TFLOP/s of the real (unpadded) work (causal: half the square per sample;
backward counted as 2.5 forwards), and each packed arm's largest output difference from flash's varlen;
for cuDNN's ragged kernel also its gradients' differences, its ops' schemas and its log-sum-exp's layout.
The dense SDPA arms need samples of equal length and run only then. GPU only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def timed(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def cudnn_ragged(q, k, v, cu, max_len, scale, grad):
    """cuDNN's ragged kernel on the packed rows, by its aten ops (forward, then the backward op itself, so
    that it runs whether or not this torch registers the forward's autograd); torch 2.14's varlen_attn routes
    here only calls without a causal window or grouped heads, on cuDNN >= 9.18. Returns the output, the three
    gradients and the log-sum-exp (a wrapper's fake implementation needs its shape)."""
    with torch.no_grad():
        res = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, max_len, max_len, True, 0.0, True, False, scale=scale)
        out, lse, seed, offset = res[0], res[1], res[6], res[7]
        grads = torch.ops.aten._cudnn_attention_backward(grad, q, k, v, out, lse, seed, offset, None, cu, cu, max_len, max_len,
                                                         0.0, True, scale=scale)
    return out, *grads, lse


def ragged_check(q, k, v, ek, ev, cu, max_len, scale, grad, flash_grads) -> dict:
    """What a library wrapper of the ragged kernel needs to know: the ops' schemas on this torch, the
    log-sum-exp's layout, and the largest gradient differences from flash's varlen (the expanded heads'
    key/value gradients summed back onto their group)."""
    ops = torch.ops.aten
    report = {"schemas": [str(op.default._schema) for op in (ops._cudnn_attention_forward, ops._cudnn_attention_backward)]}
    out, dq, dk, dv, lse = cudnn_ragged(q, ek, ev, cu, max_len, scale, grad)
    report["lse"] = {"shape": list(lse.shape), "stride": list(lse.stride()), "dtype": str(lse.dtype)}
    group = q.shape[1] // k.shape[1]
    summed = [g.unflatten(1, (-1, group)).sum(2) for g in (dk, dv)]
    for name, got, want in zip(("dq", "dk", "dv"), (dq, *summed), flash_grads):
        report[f"max_abs_diff_{name}"] = round((got.float() - want.float()).abs().max().item(), 4)
    return report


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="6000,6000", help="comma-separated sample lengths packed together")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from eogym_sft.models.attention import _varlen_cuda, per_sample_op, takes_gqa_flag

    lengths = [int(n) for n in args.lengths.split(",")]
    heads, kv_heads, dim, max_len, scale = 32, 8, 128, max(lengths), 128**-0.5
    torch.manual_seed(0)
    make = lambda h: torch.randn(sum(lengths), h, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    q, k, v = make(heads), make(kv_heads), make(kv_heads)
    grad = torch.randn_like(q)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    # Expanded key/value heads (for kernels without grouped heads) are made once, outside the timing.
    ek, ev = (t.detach().repeat_interleave(heads // kv_heads, 1).requires_grad_() for t in (k, v))
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    flash_out = _varlen_cuda(*leaves, cu, max_len, scale, takes_gqa_flag())
    flash_grads = torch.autograd.grad(flash_out, leaves, grad)
    reference = flash_out.detach().float()

    def packed(attend):  # an arm that returns its output, for the difference from flash's varlen
        def run():
            out = attend()
            if out.requires_grad:
                out.backward(grad)
            return out
        return run

    op = per_sample_op()
    cu_host = cu.cpu()
    shifted = iter(range(1, 10**6))

    def per_sample_new_lengths():  # the first boundary one token later each call: cuDNN builds a plan per new shape
        moved = cu.clone()
        moved[1] += next(shifted) % 64  # the work stays within ~1% of the arms' (samples of thousands of tokens)
        return op(q, k, v, moved, scale)[0].backward(grad)

    arms = {
        "eogym_varlen: varlen_attn (flash)": packed(lambda: _varlen_cuda(q, k, v, cu, max_len, scale, takes_gqa_flag())),
        "eogym_varlen_cudnn: cuDNN's dense kernel per sample": packed(lambda: op(q, k, v, cu, scale)[0]),
        "the same, boundaries on the host (as the model's pre-hook hands them)": packed(lambda: op(q, k, v, cu_host, scale)[0]),
        "cuDNN per sample, new lengths every call": per_sample_new_lengths,
    }
    if len(set(lengths)) == 1:
        n, length = len(lengths), lengths[0]

        def dense(backend, expand: bool):
            def run():
                bq = q.view(n, length, heads, dim).transpose(1, 2)
                kv_source, kv_count = ((ek, ev), heads) if expand else ((k, v), kv_heads)
                bk, bv = (t.view(n, length, kv_count, dim).transpose(1, 2) for t in kv_source)
                with sdpa_kernel(backend):
                    out = torch.nn.functional.scaled_dot_product_attention(bq, bk, bv, is_causal=True, enable_gqa=not expand)
                out.transpose(1, 2).reshape_as(q).backward(grad)
            return run

        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
            arms[f"sdpa {name}, dense"] = dense(backend, expand=False)
            arms[f"sdpa {name}, dense, k/v expanded"] = dense(backend, expand=True)
    # cuDNN's ragged arms last: on torch < 2.14 its packed backward can hit an illegal memory access
    # (pytorch#186142), which leaves the CUDA context unusable for every arm after it.
    arms["cuDNN ragged (aten ops), k/v expanded"] = packed(
        lambda: cudnn_ragged(q, ek, ev, cu, max_len, scale, grad)[0])
    flops = 3.5 * sum(2 * 2 * n * n * heads * dim / 2 for n in lengths)
    results = []
    for name, fn in arms.items():
        try:
            out = fn()
            entry = {"arm": name}
            if isinstance(out, torch.Tensor):
                entry["max_abs_diff_from_flash"] = round((out.detach().float() - reference).abs().max().item(), 4)
            ms = timed(fn, args.iters)
            results.append({**entry, "ms": round(ms, 2), "tflops": round(flops / ms / 1e9, 1)})
        except Exception as err:  # a kernel that refuses these shapes is reported, not hidden
            results.append({"arm": name, "error": f"{type(err).__name__}: {str(err)[:200]}"})
        print(json.dumps(results[-1]), flush=True)
    try:
        ragged = ragged_check(q, k, v, ek, ev, cu, max_len, scale, grad, flash_grads)
    except Exception as err:  # reported, not hidden: this torch may lack the ops or take other arguments
        ragged = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
    print(json.dumps({"cudnn_ragged": ragged}), flush=True)
    report = {"command": "python bench/attention_probe.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
              "shape": {"lengths": lengths, "heads": heads, "kv_heads": kv_heads, "dim": dim}, "results": results,
              "cudnn_ragged": ragged}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    return report


if __name__ == "__main__":
    main()
