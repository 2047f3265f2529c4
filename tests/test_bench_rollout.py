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


def test_prefill_probe_times_each_part_and_its_attention_arms_agree(tiny_model_dir, tmp_path, data_root, row_factory):
    sys.path.insert(0, str(BENCH))
    from prefill_probe import main

    rows = [row_factory(row_id=f"r{k}", n_steps=2) for k in range(2)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "probe.json"
    result = main([
        "--model", str(tiny_model_dir), "--data", str(data), "--data-root", str(data_root), "--episodes", "2",
        "--min-prompt-tokens", "0", "--max-context", "4096", "--reps", "1", "--profile-rows", "3", "--json", str(out),
    ])
    assert json.loads(out.read_text()) == result
    first, second = result["episodes"]
    for row in (first, second):
        assert row["images"] >= 1 and row["next_new_images"] == 1  # the recorded crop comes back as an image
        assert 0 < row["next_tokens"] < row["first_tokens"] and row["vision_ms"] > 0 and row["first_ms"] > 0
    # on CPU every arm is SDPA's math over the same inputs: the same numbers
    arms = result["attention_one_layer"]
    assert set(arms) == {f"{shape}/{arm}" for shape in ("first", "next") for arm in ("repeat_kv_bool_mask", "gqa_bool_mask", "gqa_lower_right")}
    assert all(a["max_abs_diff"] < 1e-5 for a in arms.values())
    assert len(result["profile_one_first_and_next"]["by_host_time"]) == 3


def test_decode_probe_times_every_part_and_its_attention_arms_agree(tiny_model_dir, tmp_path):
    sys.path.insert(0, str(BENCH))
    from decode_probe import main

    out = tmp_path / "decode.json"
    result = main([
        "--model", str(tiny_model_dir), "--slots", "4", "--history", "200", "--span-bucket", "128", "--max-context", "512",
        "--repeats", "2", "--warmup", "1", "--profile", "1", "--profile-rows", "3", "--device", "cpu", "--json", str(out),
    ])
    assert json.loads(out.read_text()) == result
    assert result["machine"]["device"] == "cpu" and result["setup"]["cuda_graphs"] is False
    assert (result["setup"]["attended"], result["setup"]["span"]) == (201, 256)  # 200 held + the step's token, to a bucket
    parts = result["parts"]
    assert set(parts) == {"step", "decode", "pick/temperature1", "pick/greedy", "pick/greedy_held_stops",
                          "loop_step/temperature1", "loop_step/greedy_held_stops"}
    assert all(p["ms"] > 0 and p["min_ms"] > 0 and p["gpu_ms"] is None and p["repeats"] == 2 for p in parts.values())
    # every slot holds the same 200 tokens: the masked call over the span equals no mask over exactly 201 keys
    attention = result["attention_one_layer"]
    assert set(attention) == {"masked", "unmasked"}
    assert all(a["ms"] > 0 and a["back_to_back"] for a in attention.values())
    assert attention["unmasked"]["max_abs_diff"] < 1e-5
    floor = result["floor"]
    assert floor["kv_bytes"] == 4 * 201 * floor["kv_bytes_per_token"] < floor["kv_bytes_span"] == 4 * 256 * floor["kv_bytes_per_token"]
    assert 0 < floor["weight_bytes"] <= floor["model_weight_bytes"] and floor["floor_ms"] <= floor["floor_span_ms"]
    assert set(result["derived"]) >= {"decode_minus_step_ms", "loop_minus_decode_ms", "step_over_floor"}
    profile = result["profile_eager_loop_steps"]
    assert profile["steps"] == 1 and len(profile["by_host_time"]) == 3
