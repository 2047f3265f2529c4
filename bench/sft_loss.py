"""The SFT loss and its logged entropy over the LM head's logits, forward and backward: one softmax
(``eogym_sft.training.loss``, the trainer's) against ``log_softmax`` + ``nll_loss`` + an entropy from the
log-probabilities (the trainer's path before it), the arms alternating in one process.

    python bench/sft_loss.py --positions 1024 --json sft_loss_cpu.json              # CPU, float32 logits
    python bench/sft_loss.py --positions 8192 --device cuda --json sft_loss_gpu.json  # bf16 logits, as the recipe's

The logits are the head's output in the model's dtype (bf16 on a GPU), upcast with ``.float()`` as the
trainer does; the gradient reaches them. Reported per arm: median seconds of forward + backward, and on a
GPU the peak memory above the logits themselves; and the largest differences between the arms' losses,
entropies and gradients.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eval_throughput import machine_info  # noqa: E402
from prep_throughput import write_result  # noqa: E402

from eogym_sft.metrics.token_accuracy import IGNORE_INDEX  # noqa: E402
from eogym_sft.training.loss import cross_entropy_with_entropy  # noqa: E402


def log_softmax_arm(logits: torch.Tensor, targets: torch.Tensor):
    log_p = logits.log_softmax(-1)
    loss = torch.nn.functional.nll_loss(log_p, targets, ignore_index=IGNORE_INDEX, reduction="none")
    with torch.no_grad():
        entropy = -(log_p.exp() * log_p).sum(-1)
        predicted = logits.argmax(-1)  # the trainer's token accuracy, a pass of its own on this path
    return loss, entropy, predicted


ARMS = {"one-softmax": cross_entropy_with_entropy, "log_softmax": log_softmax_arm}


def run_once(arm: str, head_out: torch.Tensor, targets: torch.Tensor) -> dict:
    cuda = head_out.device.type == "cuda"
    head_out.grad = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    loss, entropy, predicted = ARMS[arm](head_out.float(), targets)
    loss.sum().backward()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() - before) / 2**30 if cuda else None
    return {"seconds": seconds, "peak_gib": peak, "loss": loss.detach(), "entropy": entropy, "grad": head_out.grad.float(),
            "predicted": predicted}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--positions", type=int, default=1024, help="scored positions (the head's rows)")
    ap.add_argument("--vocab", type=int, default=151936, help="Qwen3's vocabulary")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each arm, alternating, after one warm-up each")
    ap.add_argument("--json", default="sft_loss.json")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    head_out = (torch.randn(args.positions, args.vocab, generator=g, device=device) * 3).to(dtype).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.positions,), generator=g, device=device)
    targets[::8] = IGNORE_INDEX
    runs = {arm: [] for arm in ARMS}
    last = {}
    for k in range(args.repeats + 1):
        for arm in ARMS:
            last[arm] = run_once(arm, head_out, targets)
            if k:  # the first of each arm warms up
                runs[arm].append(last[arm]["seconds"])
    a, b = last["one-softmax"], last["log_softmax"]
    result = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(device),
        "settings": {"positions": args.positions, "vocab": args.vocab, "logits_dtype": str(dtype), "repeats": args.repeats},
        "arms": {arm: {"median_s": sorted(s)[len(s) // 2], "seconds": s, "peak_gib": last[arm]["peak_gib"]} for arm, s in runs.items()},
        "max_abs_diff": {key: float((a[key] - b[key]).abs().max()) for key in ("loss", "entropy", "grad")},
        "same_argmax": bool(torch.equal(a["predicted"], b["predicted"])),
    }
    result["speedup"] = result["arms"]["log_softmax"]["median_s"] / result["arms"]["one-softmax"]["median_s"]
    lines = [f"{args.positions} positions x {args.vocab} vocab, {dtype} logits, {device}"]
    for arm, r in result["arms"].items():
        peak = f"  peak {r['peak_gib']:.2f} GiB" if r["peak_gib"] is not None else ""
        lines.append(f"{arm:<12} median {r['median_s']:.4f} s{peak}")
    lines.append(f"one-softmax is {result['speedup']:.2f}x; largest differences {result['max_abs_diff']}")
    return write_result(result, args.json, "\n".join(lines))


if __name__ == "__main__":
    main()
