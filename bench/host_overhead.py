"""Host work the Trainer does between micro-batches that grows with the model, on the 4B architecture.

One command::

    python bench/host_overhead.py --json host_overhead.json

Builds Qwen3-VL-4B's architecture on the meta device (no weights, no GPU) with the recipe's LoRA and times,
per call, what transformers' Trainer runs on the host for every micro-batch outside the model: its
``floating_point_ops`` (which counts the model's parameters each time), ``EOGymSFTTrainer.floating_point_ops``
(the count taken once) and ``model.train()`` (``training_step`` walks every module). On a GPU this runs
after the backward's last kernels are queued, so where the backward ends in a host sync the GPU waits for it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from prep_throughput import machine_info  # noqa: E402


def build_model(config_path: Path):
    from transformers import AutoConfig, AutoModelForImageTextToText

    from eogym_sft.models.loading import apply_lora

    config = AutoConfig.for_model(**json.loads(config_path.read_text()))
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    return apply_lora(model)


def per_call_ms(fn, calls: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def main(argv=None) -> dict:
    from transformers import Trainer

    from eogym_sft.training.trainer import EOGymSFTTrainer

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(REPO / "recipes/configs/qwen3_vl_4b_instruct.json"))
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    model = build_model(Path(args.config))
    inputs = {"input_ids": torch.zeros(1, 14_000, dtype=torch.long, device="meta")}
    # Only the attributes the two methods read: a whole trainer needs a dataset and a device.
    trainer = EOGymSFTTrainer.__new__(EOGymSFTTrainer)
    trainer.model, trainer._flops_per_token = model, None
    timings = {
        "trainer_floating_point_ops_ms": per_call_ms(lambda: Trainer.floating_point_ops(trainer, inputs), args.calls),
        "eogym_floating_point_ops_ms": per_call_ms(lambda: trainer.floating_point_ops(inputs), args.calls),
        "model_train_ms": per_call_ms(model.train, args.calls),
    }
    assert trainer.floating_point_ops(inputs) == Trainer.floating_point_ops(trainer, inputs)
    report = {"date": dt.date.today().isoformat(),
              "command": "python bench/host_overhead.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "machine": machine_info(), "torch": torch.__version__, "modules": sum(1 for _ in model.modules()),
              "parameters": sum(1 for _ in model.parameters()), "calls": args.calls, **timings}
    for key, value in timings.items():
        print(f"{key:32s} {value:8.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
