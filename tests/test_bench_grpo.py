"""bench/grpo_step.py runs both rollout engines end to end on CPU with the tiny model, and the forced
episodes make them do the same multi-turn work (the same tool calls and generated tokens per episode)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.mark.slow(18)
def test_grpo_bench_runs_both_engines_on_the_same_forced_episodes(tiny_model_dir, tmp_path):
    sys.path.insert(0, str(BENCH))
    from grpo_step import format_table, main

    out = tmp_path / "grpo.json"
    result = main([
        "--model", str(tiny_model_dir), "--questions", "1", "--generations", "2", "--images", "1", "--image-px", "64",
        "--max-pixels", "4096", "--calls", "1", "--call-tokens", "72", "--steps", "1", "--warmup", "0",
        "--max-completion-length", "1024", "--max-episode-tokens", "4096", "--workdir", str(tmp_path / "work"), "--json", str(out),
    ])
    assert json.loads(out.read_text()) == result
    trl, slots = result["arms"]
    assert (trl["arm"], slots["arm"]) == ("trl", "slots")
    for arm in (trl, slots):
        # one forced crop turn of 72 tokens, then the answer turn; the crop ran; nothing was cut
        assert arm["tool_calls_per_episode"] == 1.0 and arm["clipped_ratio"] == 0.0
        assert arm["generated_tokens_per_episode"] == arm["forced_tokens_per_episode"] > 72
        shares = [arm[k] for k in ("generation_share", "tools_share", "scoring_share", "forward_backward_share", "optimizer_share", "other_share")]
        assert abs(sum(shares) - 1) < 1e-9 and arm["forward_backward_s"] > 0 and arm["tools_s"] > 0
        assert 0 < arm["other_dataloader_s"] + arm["other_logging_s"] <= arm["other_s"]
    assert slots["rollout_slots"] == 2.0
    assert (trl["text_attention"], slots["text_attention"]) == ("sdpa", "eogym_varlen_cudnn")  # padded vs packed loss
    assert result["speedup_slots_vs_trl"] == trl["step_s"] / slots["step_s"]
    assert "slots vs trl" in format_table(result)


def test_the_recipe_arm_is_the_yamls_defaults_for_one_step(tmp_path):
    sys.path.insert(0, str(BENCH))
    from grpo_step import arm_settings, parse_args

    args = parse_args(["--model", "unused"])
    script, training, _ = arm_settings(args, "recipe", "rows.jsonl", str(tmp_path), str(tmp_path / "out"))
    assert training.max_steps == 1 and script.rollout_engine == "slots"
    assert (training.per_device_train_batch_size, training.gradient_accumulation_steps, training.num_generations) == (8, 2, 8)
    assert (training.max_completion_length, script.rollout_turn_tokens, script.rollout_cache_gib) == (6144, 1024, None)
    _, forced, _ = arm_settings(args, "trl", "rows.jsonl", str(tmp_path), str(tmp_path / "out"))
    assert forced.max_tool_calling_iterations == args.calls + 1 and forced.max_steps == args.warmup + args.steps
    # --recipe-args come last: they override the bench's own flags on every arm
    args = parse_args(["--model", "unused", "--recipe-args=--rollout_cache_gib 20 --max_steps 7"])
    for arm in ("recipe", "slots"):
        script, training, _ = arm_settings(args, arm, "rows.jsonl", str(tmp_path), str(tmp_path / "out"))
        assert (script.rollout_cache_gib, training.max_steps) == (20.0, 7)
