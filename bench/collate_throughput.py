"""Collation: what one dataloader worker spends on a micro-batch, with ``pixel_values`` in float32 and in bfloat16.

One command::

    python bench/collate_throughput.py --micro-batches 8 --json collate.json

It writes the train bench's EO-Gym-shaped images (``prep_throughput.generate_sample``: files up to 4000x4000
px) unless ``--data-root`` names a folder of images, draws ``--images`` files per sample (default 6 and 5: 11
a micro-batch of 2, as arm B's micro-batches hold on average), and collates each micro-batch with
``EOGymCollator(padding_free=True)`` once per arm, the arms side by side (each first in every other
micro-batch), on one torch thread (as in a
dataloader worker). For each arm: collating, ms a micro-batch (images decoded, resized, patchified); the
``pixel_values``' MiB; and the copy the main process then makes of the batch (pinning it where CUDA is
available, else a plain copy), ms. The first micro-batch warms up and is not timed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from prep_throughput import generate_sample, machine_info  # noqa: E402

from eogym_sft.config import SampleConfig  # noqa: E402
from eogym_sft.models.tiny import build_offline_processor  # noqa: E402
from eogym_sft.data.collator import EOGymCollator  # noqa: E402

ARMS = {"float32": None, "bfloat16": torch.bfloat16}


def sample_files(data_root: Path) -> list[Path]:
    files = sorted(p for p in data_root.rglob("*") if p.suffix.lower() in {".jpg", ".jpeg", ".png", ".tif", ".tiff"})
    if not files:
        raise SystemExit(f"{data_root}: no images")
    return files


def micro_batches(files: list[Path], count: int, per_sample: list[int], seed: int) -> list[list[dict]]:
    """``count`` micro-batches of plain conversational examples, one per entry of ``per_sample`` images."""
    rng = random.Random(seed)

    def example(n: int) -> dict:
        content = [{"type": "image"}] * n + [{"type": "text", "text": "What changed?"}]
        messages = [{"role": "user", "content": content}, {"role": "assistant", "content": "Final Answer: yes"}]
        return {"messages": messages, "images": [str(p) for p in rng.sample(files, n)]}

    return [[example(n) for n in per_sample] for _ in range(count)]


def handover(pixel_values: torch.Tensor) -> None:
    """The main process's copy of a worker's batch: pinned where CUDA is available (the dataloader's pin thread)."""
    if torch.cuda.is_available():
        pixel_values.pin_memory()
    else:
        pixel_values.clone()


def run(batches: list[list[dict]], max_pixels: int, min_pixels: int) -> dict:
    processor = build_offline_processor(max_pixels, min_pixels)  # the collator resizes with the processor's cap
    collators = {arm: EOGymCollator(processor, padding_free=True, max_length=None, pixel_dtype=dtype) for arm, dtype in ARMS.items()}
    times = {arm: {"collate_ms": [], "handover_ms": [], "pixel_mib": []} for arm in ARMS}
    for i, examples in enumerate(batches):
        order = list(collators.items())
        for arm, collator in order if i % 2 else order[::-1]:  # each arm first in every other micro-batch
            start = time.perf_counter()
            pixels = collator(examples)["pixel_values"]
            collated = time.perf_counter()
            handover(pixels)
            done = time.perf_counter()
            if i == 0:
                continue  # warm-up
            times[arm]["collate_ms"].append((collated - start) * 1e3)
            times[arm]["handover_ms"].append((done - collated) * 1e3)
            times[arm]["pixel_mib"].append(pixels.numel() * pixels.element_size() / 2**20)
    return {arm: {key: statistics.median(values) for key, values in t.items()} for arm, t in times.items()}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--micro-batches", type=int, default=8, help="timed micro-batches (one more warms up)")
    parser.add_argument("--images", default="6,5", help="images per sample of a micro-batch, comma-separated")
    parser.add_argument("--data-root", help="a folder of images (default: generate the train bench's)")
    parser.add_argument("--workdir", default="/tmp/collate_bench")
    parser.add_argument("--max-pixels", type=int, default=SampleConfig.max_pixels)
    parser.add_argument("--min-pixels", type=int, default=SampleConfig.min_pixels)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as in a dataloader worker
    if args.data_root:
        data_root = Path(args.data_root)
    else:
        data_root = generate_sample(Path(args.workdir) / "sample", rows=60, seed=0)[1]
    per_sample = [int(n) for n in args.images.split(",")]
    batches = micro_batches(sample_files(data_root), args.micro_batches + 1, per_sample, args.seed)
    arms = run(batches, args.max_pixels, args.min_pixels)
    command = "python bench/collate_throughput.py " + " ".join(sys.argv[1:] if argv is None else argv)
    report = {"date": dt.date.today().isoformat(), "command": command,
              "machine": machine_info(), "images_per_sample": per_sample, "timed_micro_batches": args.micro_batches,
              "median_per_micro_batch": arms}
    base = arms["float32"]
    for arm, row in arms.items():
        print(f"{arm:9s} collate {row['collate_ms']:7.1f} ms ({row['collate_ms'] / base['collate_ms']:.2f}x)  "
              f"pixel_values {row['pixel_mib']:6.1f} MiB  hand-over copy {row['handover_ms']:6.1f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
