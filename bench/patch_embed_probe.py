"""The vision tower's patch embedding, forward only (the tower is frozen): transformers' ``Conv3d`` (kernel = stride, so
each patch meets the kernel once) against the same weights as one matmul, ``F.linear`` over the flattened patches,
the arms alternating in one process.

    python bench/patch_embed_probe.py --patches 256 --json patch_embed_cpu.json             # CPU, float32
    python bench/patch_embed_probe.py --device cuda --json patch_embed_gpu.json             # bf16, a micro-batch's patches

Several inference stacks replaced this ``Conv3d`` by a matmul after cuDNN picked slow algorithms for it on some
versions (transformers' ``fusion_config={"patch_embeddings": True}`` does it at load, but patches the class for every
later load in the process). Arm B's profile gives the vision tower 15% of a step's kernel time (docs/benchmarks.md);
this says how much of it the convolution is on the machine at hand. The shape is the 4B's vision config
(``recipes/configs/qwen3_vl_4b_instruct.json``); ``--patches`` defaults to about a micro-batch of arm B (two samples of
about 3,750 image tokens, four patches each).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eval_throughput import machine_info  # noqa: E402
from prep_throughput import write_result  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "recipes" / "configs" / "qwen3_vl_4b_instruct.json"


def arms(conv: torch.nn.Conv3d) -> dict:
    """name -> fn(flat patches (P, C*T*H*W)) -> (P, hidden): transformers' forward, and the same weights as a matmul."""
    kernel, hidden = conv.kernel_size, conv.out_channels
    weight = conv.weight.reshape(hidden, -1)

    def conv3d(flat):
        return conv(flat.view(-1, conv.in_channels, *kernel)).view(-1, hidden)

    def linear(flat):
        return F.linear(flat, weight, conv.bias)

    return {"conv3d": conv3d, "linear": linear}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--patches", type=int, default=30000, help="patches in one call (arm B's micro-batch: about 30,000)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=20, help="timed calls of each arm, alternating, after 3 warm-up calls each")
    ap.add_argument("--json", default="patch_embed_probe.json")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    vision = json.loads(CONFIG.read_text())["vision_config"]
    kernel = (vision["temporal_patch_size"], vision["patch_size"], vision["patch_size"])
    g = torch.Generator().manual_seed(0)
    conv = torch.nn.Conv3d(vision["in_channels"], vision["hidden_size"], kernel_size=kernel, stride=kernel, bias=True)
    conv = conv.to(device, dtype).requires_grad_(False)
    flat = torch.randn(args.patches, vision["in_channels"] * kernel[0] * kernel[1] * kernel[2], generator=g).to(device, dtype)
    fns = arms(conv)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    seconds = {name: [] for name in fns}
    with torch.no_grad():
        for k in range(args.repeats + 3):
            for name, fn in fns.items():
                sync()
                start = time.perf_counter()
                fn(flat)
                sync()
                if k >= 3:
                    seconds[name].append(time.perf_counter() - start)
        diff = float((fns["conv3d"](flat).float() - fns["linear"](flat).float()).abs().max())
    result = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(device),
        "settings": {"patches": args.patches, "kernel": list(kernel), "hidden": vision["hidden_size"], "dtype": str(dtype),
                     "repeats": args.repeats},
        "arms": {name: {"median_ms": sorted(s)[len(s) // 2] * 1e3, "ms": [x * 1e3 for x in s]} for name, s in seconds.items()},
        "max_abs_diff": diff,
    }
    result["conv3d_over_linear"] = result["arms"]["conv3d"]["median_ms"] / result["arms"]["linear"]["median_ms"]
    lines = [f"{args.patches} patches, kernel {kernel} -> {vision['hidden_size']}, {dtype}, {device}"]
    lines += [f"{name:<7} median {r['median_ms']:.3f} ms" for name, r in result["arms"].items()]
    lines.append(f"conv3d takes {result['conv3d_over_linear']:.2f}x the matmul's time; largest difference {diff:.3g}")
    return write_result(result, args.json, "\n".join(lines))


if __name__ == "__main__":
    main()
