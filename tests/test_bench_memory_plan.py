"""``bench/memory_plan.py`` on CPU with the tiny model: every calibration run and a check go through the recipe's
trainer, each micro-batch recorded with its sizes and the plan's prediction (no memory figures on a CPU), and the
fit reads the report back."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))


@pytest.mark.slow(30)
def test_memory_bench_runs_its_calibration_and_checks_on_cpu(tmp_path):
    import memory_plan as bench
    from test_recipe import MAX_PIXELS, MIN_PIXELS, write_rows
    from train_throughput import build_base

    from eogym_sft.data.datasets import load_or_prepare
    from eogym_sft.data.prepare import PrepConfig
    from eogym_sft.models.processor import load_processor
    from eogym_sft.models.tiny import TINY_QWEN3_VL_CONFIG

    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY_QWEN3_VL_CONFIG))
    base, cfg, model_dir = build_base(config, tmp_path)
    data = write_rows(tmp_path / "data")
    processor = load_processor(str(model_dir), MAX_PIXELS, MIN_PIXELS)
    dataset, _ = load_or_prepare(str(data), str(model_dir), processor, PrepConfig(data_root=str(data.parent)), tmp_path / "prepared", 1)
    ctx = bench.context(base, cfg, dataset, data.parent, processor, tmp_path)
    report = bench.run(ctx, [None], 1)

    runs = {run["name"]: run for run in report["calibration"]}
    assert list(runs) == ["no_checkpointing", "dropout0", "checkpoint_every_layer", "checkpoint_every_2nd"]
    assert [len(run["micro_batches"]) for run in runs.values()] == [4, 1, 3, 1]  # the warm-up micro-batch left out
    assert all(run["error"] is None for run in runs.values())
    tokens = list(dataset["n_tokens"])
    for record in runs["no_checkpointing"]["micro_batches"]:
        assert record["tokens"] in {tokens[i] for i in range(len(tokens))} | {a + b for a in tokens for b in tokens}
        assert record["predicted_allocated_gib"] > 0 and record["peak_allocated_gib"] == 0  # no allocator figures on a CPU
    (checked,) = report["checks"]
    assert checked["name"] == "check_full" and checked["error"] is None
    plan = checked["plan"]
    assert plan["per_device_train_batch_size"] * plan["gradient_accumulation_steps"] == 64
    assert len(checked["micro_batches"]) == plan["gradient_accumulation_steps"]
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    assert bench.main(["--fit", str(path), "--config", str(config)]) == {}
