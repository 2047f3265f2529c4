"""bench/rollout_throughput.py runs end to end on CPU with the tiny model and tiny settings."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_rollout_bench_runs_all_arms_on_the_same_episodes(tiny_model_dir, tmp_path, data_root, row_factory):
    sys.path.insert(0, str(BENCH))
    from rollout_throughput import format_table, main

    rows = [row_factory(row_id=f"r{k}", n_steps=2) for k in range(2)]  # two recorded crop steps each
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "rollout.json"
    result = main([
        "--model", str(tiny_model_dir), "--data", str(data), "--data-root", str(data_root), "--episodes", "2",
        "--serial-episodes", "1", "--concurrency", "2", "--turns", "2", "--new-tokens", "2", "--min-prompt-tokens", "0",
        "--max-context", "2048", "--json", str(out),
    ])
    assert json.loads(out.read_text()) == result
    serial, batched, slots = result["runs"]
    assert (serial["arm"], batched["arm"], slots["arm"]) == ("serial", "batched2", "slots2")
    # the same episodes (2 turns: a recorded crop result comes back), exactly --new-tokens per turn in every arm
    assert batched["turns"] == slots["turns"] == 4 and batched["new_tokens"] == slots["new_tokens"] == 8
    assert (serial["episodes"], serial["turns"], serial["new_tokens"]) == (1, 2, 4)
    assert 0 < slots["prefill_tokens"] and batched["speedup_vs_batched"] == 1.0
    assert slots["decode_attention"] == "masked_sdpa"  # the split-KV kernels run on CUDA only
    assert "gen tok/s" in format_table(result)


def test_rollout_bench_switches_from_the_base_to_an_adapter(tiny_model_dir, tmp_path, data_root, row_factory):
    sys.path.insert(0, str(BENCH))
    from helpers import perturb_lora_b
    from rollout_throughput import main

    from eogym_sft.models.loading import apply_lora, load_base_model

    adapter = tmp_path / "adapter"
    perturb_lora_b(apply_lora(load_base_model(str(tiny_model_dir), "float32", "sdpa")), seed=0).save_pretrained(adapter)
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(row_factory(row_id="r0", n_steps=2)) + "\n")
    result = main([
        "--model", str(tiny_model_dir), "--data", str(data), "--data-root", str(data_root), "--episodes", "1",
        "--concurrency", "1", "--turns", "2", "--new-tokens", "2", "--min-prompt-tokens", "0", "--max-context", "2048",
        "--arms", "slots", "--adapter", str(adapter), "--json", str(tmp_path / "rollout.json"),
    ])
    base, tuned = result["runs"]
    assert (base["arm"], tuned["arm"]) == ("slots1-base", "slots1-adapter")
    assert base["new_tokens"] == tuned["new_tokens"] == 4 and "error" not in tuned
