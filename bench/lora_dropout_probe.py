"""LoRA's input dropout and lora_A, forward and backward, at a micro-batch of the recipe, compiled by Inductor:
``linear(dropout(x), A)`` with the packed keep bits (``eogym_sft/models/lora_dropout.py``) against PEFT's
``nn.Dropout``, and against no dropout at all (what ``B-dropout0`` saves), one projection input width at a time
(q/k/v/gate/up read 2,560 features, o 4,096, down 9,728 on the 4B).

    python bench/lora_dropout_probe.py --json lora_dropout_probe.json             # a GPU
    python bench/lora_dropout_probe.py --device cpu --rows 64 --widths 64 --reps 1 --warmup 1   # smoke run

Each arm: ``--warmup`` calls, then ``--reps`` timed calls of forward and backward together (the gradients of x and
A), synchronised; and the memory the forward keeps for the backward (allocated after it, less before it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eogym_sft.models import lora_dropout  # noqa: E402


def arms(p: float):
    """name -> fn(x, weight) -> output, each differentiable in x and weight."""
    packed_dropout = lora_dropout.PackedMaskDropout(p)
    packed = torch.compile(lambda x, w: F.linear(packed_dropout(x), w), dynamic=True)
    peft = torch.compile(lambda x, w: F.linear(F.dropout(x, p, training=True), w), dynamic=True)
    plain = torch.compile(lambda x, w: F.linear(x, w), dynamic=True)
    return {"packed": packed, "inductor_dropout": peft, "no_dropout": plain}


def measure(fn, x, weight, grad, warmup: int, reps: int, device) -> dict:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn(x, weight).backward(grad)
    sync()
    before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    out = fn(x, weight)
    kept = (torch.cuda.memory_allocated() - before) if device.type == "cuda" else 0
    out.backward(grad)
    del out
    sync()
    start = time.perf_counter()
    for _ in range(reps):
        fn(x, weight).backward(grad)
    sync()
    return {"ms": round((time.perf_counter() - start) / reps * 1e3, 3), "kept_for_backward_mib": round(kept / 2**20, 1)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, default=13699, help="tokens of a micro-batch (arm B's largest: 13,699)")
    parser.add_argument("--widths", default="2560,4096,9728", help="input features of the projections, comma-separated")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--p", type=float, default=0.05)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    result = {"bench": "lora_dropout_probe", "command": " ".join(["python", "bench/lora_dropout_probe.py", *(argv or sys.argv[1:])]),
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": args.rows, "rank": args.rank, "p": args.p,
              "widths": {}}
    fns = arms(args.p)
    for width in (int(w) for w in args.widths.split(",")):
        x = torch.randn(args.rows, width, generator=g).to(device, dtype).requires_grad_()
        weight = (torch.randn(args.rank, width, generator=g) * 0.02).to(device, dtype).requires_grad_()
        grad = torch.randn(args.rows, args.rank, generator=g).to(device, dtype)
        result["widths"][width] = {name: measure(fn, x, weight, grad, args.warmup, args.reps, device) for name, fn in fns.items()}
        print(width, json.dumps(result["widths"][width]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
