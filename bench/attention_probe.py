"""Causal attention of packed EO-Gym-sized samples, forward + backward, by kernel: torch's varlen_attn
(what ``eogym_varlen`` calls) against SDPA's backends on the same samples as a dense batch.

    python bench/attention_probe.py --length 6000 --samples 2 --json attention.json

Qwen3-VL-4B's text attention shape (32 query heads, 8 key/value heads, head dim 128), bf16. Reports ms
per forward + backward and TFLOP/s (causal: half the square; backward counted as 2.5 forwards).
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


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=6000)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.varlen import varlen_attn

    from eogym_sft.attention import takes_gqa_flag

    n, length, heads, kv_heads, dim = args.samples, args.length, 32, 8, 128
    torch.manual_seed(0)
    make = lambda h: torch.randn(n * length, h, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    q, k, v = make(heads), make(kv_heads), make(kv_heads)
    grad = torch.randn_like(q)
    cu = torch.arange(0, n * length + 1, length, dtype=torch.int32, device="cuda")
    gqa = {"enable_gqa": True} if takes_gqa_flag() else {}

    def varlen():
        varlen_attn(q, k, v, cu, cu, length, length, window_size=(-1, 0), **gqa).backward(grad)

    # Expanded key/value heads (for kernels without grouped heads) are made once, outside the timing.
    ek, ev = (t.detach().repeat_interleave(heads // kv_heads, 1).requires_grad_() for t in (k, v))

    def varlen_op_causal_full_window():
        # torch >= 2.14's private op picks cuDNN (cuDNN >= 9.18, sm90/sm100) for a causal call only when
        # the window is the full one and heads are not grouped, which the public varlen_attn never asks for
        out = torch.ops.torch_attn._varlen_attn(q, ek, ev, cu, cu, length, length, True, None, [-1, -1], False, None, None, None)
        out[0].backward(grad)

    def dense(backend, expand: bool):
        def run():
            bq = q.view(n, length, heads, dim).transpose(1, 2)
            kv_source, kv_count = ((ek, ev), heads) if expand else ((k, v), kv_heads)
            bk, bv = (t.view(n, length, kv_count, dim).transpose(1, 2) for t in kv_source)
            with sdpa_kernel(backend):
                out = torch.nn.functional.scaled_dot_product_attention(bq, bk, bv, is_causal=True, enable_gqa=not expand)
            out.transpose(1, 2).reshape_as(q).backward(grad)

        return run

    flops = 3.5 * n * 2 * 2 * length * length * heads * dim / 2
    arms = {"varlen_attn (flash)": varlen, "varlen op, causal, full window, k/v expanded (cuDNN where it can)": varlen_op_causal_full_window}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        arms[f"sdpa {name}"] = dense(backend, expand=False)
        arms[f"sdpa {name}, k/v expanded"] = dense(backend, expand=True)
    results = []
    for name, fn in arms.items():
        try:
            ms = timed(fn, args.iters)
            results.append({"arm": name, "ms": round(ms, 2), "tflops": round(flops / ms / 1e9, 1)})
        except Exception as err:  # a backend that refuses these shapes is reported, not hidden
            results.append({"arm": name, "error": f"{type(err).__name__}: {str(err)[:160]}"})
        print(json.dumps(results[-1]), flush=True)
    report = {"command": "python bench/attention_probe.py " + " ".join(sys.argv[1:] if argv is None else argv), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "shape": {"samples": n, "length": length, "heads": heads, "kv_heads": kv_heads, "dim": dim},
              "results": results}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    return report


if __name__ == "__main__":
    main()
