"""bench/rollout_throughput.py runs end to end on CPU with the tiny model and tiny settings."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_rollout_bench_runs_all_arms_on_the_same_episodes(tiny_model_dir, tmp_path):
    sys.path.insert(0, str(BENCH))
    from rollout_throughput import main

    out = tmp_path / "rollout.json"
    result = main([
        "--model", str(tiny_model_dir), "--episodes", "2", "--serial-episodes", "1", "--concurrency", "2", "--turns", "2",
        "--new-tokens", "2", "--min-prompt-tokens", "0", "--max-prompt-tokens", "2600", "--rows", "12",
        "--max-context", "4096", "--workdir", str(tmp_path / "work"), "--json", str(out),
    ])
    assert json.loads(out.read_text()) == result
    serial, batched, slots = result["runs"]
    assert (serial["arm"], batched["arm"], slots["arm"]) == ("serial", "batched2", "slots2")
    # the same episodes and exactly --new-tokens per turn in every arm
    assert batched["turns"] == slots["turns"] and batched["new_tokens"] == slots["new_tokens"] == 2 * slots["turns"]
    assert serial["new_tokens"] == 2 * serial["turns"] and serial["episodes"] == 1
    assert slots["prefill_tokens"] > 0 and batched["speedup_vs_batched"] == 1.0
    assert "gen tok/s" in __import__("rollout_throughput").format_table(result)
