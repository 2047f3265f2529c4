"""The training bench on CPU with the tiny model: ``bench/train_throughput.py`` with its step probe, arm B built by
the recipe's own builders. Figures are not checked (CPU), the accounting is: steps, tokens, losses. And the bench
stays a thin layer: under its line limit."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> Path:
    """The tiny Qwen3-VL with dimensions unlike the LoRA rank (16)."""
    from eogym_sft.models.tiny import TINY_QWEN3_VL_CONFIG

    config = copy.deepcopy(TINY_QWEN3_VL_CONFIG)
    config["text_config"].update(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=12)
    config["vision_config"].update(hidden_size=32, intermediate_size=64, out_hidden_size=32)
    path = tmp_path_factory.mktemp("config") / "tiny.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.slow(12)
def test_train_bench_times_steps_and_counts_tokens(tiny_config, tmp_path):
    """One arm of train_throughput.py (its main() only adds the generated 4000-px sample, slow to decode on CPU)."""
    import train_throughput
    from test_recipe import MAX_PIXELS, MIN_PIXELS, write_rows

    from eogym_sft.data.datasets import load_or_prepare
    from eogym_sft.data.prepare import PrepConfig
    from eogym_sft.models.processor import load_processor

    base, cfg, model_dir = train_throughput.build_base(tiny_config, tmp_path)
    data = write_rows(tmp_path / "data")
    processor = load_processor(str(model_dir), MAX_PIXELS, MIN_PIXELS)
    prep = PrepConfig(data_root=str(data.parent))
    dataset, _ = load_or_prepare(str(data), str(model_dir), processor, prep, tmp_path / "prepared", 1)
    result = train_throughput.run_arm("B-nocompile", base, dataset, data.parent, processor, cfg, tmp_path, steps=1, warmup=1,
                                      grad_accum=2)
    assert result["timed_steps"] == 1 and result["micro_batches_per_step"] == 2
    assert result["timed_step_s"] == [pytest.approx(result["timed_wall_s"])]
    assert result["timed_step_real_tokens"] == [result["real_tokens_per_step"]]
    assert result["real_tokens_per_s"] == pytest.approx(result["real_tokens_per_step"] / result["timed_wall_s"])
    assert result["graphs_compiled_first_step"] == result["graphs_compiled_after_warmup"] == 0  # nothing compiled in this arm
    assert 0 < result["pre_loop_s"] < result["time_to_first_step_s"]
    assert len(result["step_losses"]) == 2 and all(loss > 0 for loss in result["step_losses"])  # warm-up, timed
    assert result["settings"] == dict(train_throughput.SHIPPED, compile=False) and result["peak_allocated_gib"] == 0.0


def test_a_b_arm_is_the_recipes_yaml_with_only_its_own_changes(tmp_path):
    """Arm B's configs are ``recipes/eo_gym_4b.yaml`` as TrlParser reads it; an arm changes only its settings."""
    from train_throughput import arm_settings, recipe_configs

    script, training, model = recipe_configs(arm_settings("B"), tmp_path / "B", 3, 2, "m", "r")
    assert (script.compile_layers, training.padding_free, training.train_sampling_strategy) == (True, True, "batch_rebalance")
    assert (model.attn_implementation, model.lora_r, model.lora_dropout) == ("eogym_varlen_cudnn", 16, 0.05)
    assert (training.per_device_train_batch_size, training.gradient_accumulation_steps, training.max_steps) == (2, 2, 3)
    assert (training.weight_decay, training.lr_scheduler_type, training.seed) == (0.1, "cosine", 42)  # the YAML's, untouched
    assert training.dataloader_num_workers == 8 and not training.logging_nan_inf_filter and not training.activation_checkpointing
    _, b1, _ = recipe_configs(arm_settings("B-b1-GC"), tmp_path / "b1", 3, 2, "m", "r")
    assert (b1.per_device_train_batch_size, b1.activation_checkpointing) == (1, True)
    _, fixed, flash = recipe_configs(arm_settings("B-fixedcount"), tmp_path / "f", 3, 2, "m", "r")
    assert fixed.train_sampling_strategy == "random" and flash.attn_implementation == "eogym_varlen_cudnn"


@pytest.mark.slow(16)
def test_the_plan_arm_takes_the_memory_plans_batch_and_the_recipes_step(tiny_config, tmp_path):
    """Arm B-plan leaves the batch, accumulation and checkpointing to the recipe's memory plan (on CPU: one sample
    a micro-batch) and runs the recipe's own 64 samples a step, whatever --grad-accum says."""
    import train_throughput
    from test_recipe import MAX_PIXELS, MIN_PIXELS, write_rows

    from eogym_sft.data.datasets import load_or_prepare
    from eogym_sft.data.prepare import PrepConfig
    from eogym_sft.models.processor import load_processor

    script, training, _ = train_throughput.recipe_configs(train_throughput.arm_settings("B-plan"), tmp_path / "p", 3, 2, "m", "r")
    assert (training.gradient_accumulation_steps, script.samples_per_step) == (1, 64)  # TRL's default: not given
    base, cfg, model_dir = train_throughput.build_base(tiny_config, tmp_path)
    data = write_rows(tmp_path / "data")
    processor = load_processor(str(model_dir), MAX_PIXELS, MIN_PIXELS)
    dataset, _ = load_or_prepare(str(data), str(model_dir), processor, PrepConfig(data_root=str(data.parent)),
                                 tmp_path / "prepared", 1)
    result = train_throughput.run_arm("B-plan", base, dataset, data.parent, processor, cfg, tmp_path, steps=1, warmup=0,
                                      grad_accum=2)
    assert result["micro_batches_per_step"] == 64 and result["timed_steps"] == 1
    assert result["settings"] == dict(train_throughput.SHIPPED, batch=None, gc=None)


def test_micro_batches_are_counted_where_they_are_collated():
    """The bench counts each micro-batch on the host, as the collator builds it (no sync in the timed step):
    packed samples by their position restarts, padded rows by their mask; supervised tokens after the shift."""
    from train_throughput import COUNTS_KEY, Counted

    packed = {"position_ids": torch.tensor([0, 1, 2, 0, 1]).expand(4, 1, 5), "labels": torch.tensor([[-100, 5, 6, -100, 7]]),
              "image_grid_thw": torch.tensor([[1, 4, 6]])}
    padded = {"attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]), "labels": torch.tensor([[-100, 5, 6], [-100, 7, -100]])}
    trainer = type("Trainer", (), {})()
    trainer.data_collator = lambda examples: dict(examples[0])
    trainer.compute_loss = lambda model, inputs: sorted(inputs)
    trainer.training_step = lambda model, inputs, n: torch.tensor(inputs)
    counted = Counted(trainer)
    for batch, keys in ((packed, ["image_grid_thw", "labels", "position_ids"]), (padded, ["attention_mask", "labels"])):
        inputs = trainer.data_collator([batch])
        assert isinstance(inputs[COUNTS_KEY], tuple)
        assert trainer.compute_loss(None, inputs) == keys  # the counts do not reach the model
    assert counted.real == [5, 5] and counted.supervised == [3, 3] and counted.images == [[24], []]
    assert counted.lengths == [[(3, 1.5), (2, 1.5)], [(3, 1.5), (2, 1.5)]]


def test_step_losses_sum_each_steps_micro_batches():
    """Each step's loss as the Trainer logs it: its micro-batches' training_step values summed (they come scaled)."""
    from train_throughput import Counted

    trainer = type("Trainer", (), {"data_collator": None, "compute_loss": None})()
    trainer.training_step = lambda model, inputs, n: torch.tensor(inputs)
    counted = Counted(trainer)
    for value in (1.0, 2.0, 0.5, 0.25):
        assert trainer.training_step(None, value, None) == value
    assert counted.step_losses(2) == [3.0, 0.75]


def test_a_b1_arm_is_its_b_arm_at_one_sample_a_micro_batch():
    from train_throughput import SHIPPED, arm_settings

    assert arm_settings("B-b1-syncs") == dict(SHIPPED, batch=1, host_layout=False)
    assert arm_settings("B-b1-GC") == dict(SHIPPED, batch=1, gc=True) and arm_settings("A") is None


BENCH_LINES_LIMIT = 3000  # issue 67: the bench is a thin layer over the package; lower it as the bench shrinks


def test_the_bench_stays_within_its_line_limit():
    """Every file under bench/ but its results, counted as ``wc -l`` counts lines (from git's list, so a file
    left in the work tree by a run does not count)."""
    listed = subprocess.run(["git", "ls-files", "bench"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    files = [REPO / name for name in listed if not name.startswith("bench/results/") and (REPO / name).is_file()]
    counts = {str(f.relative_to(REPO)): f.read_bytes().count(b"\n") for f in files}
    total = sum(counts.values())
    largest = ", ".join(f"{name} {n}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1])[:3])
    assert len(files) > 5 and total <= BENCH_LINES_LIMIT, f"bench/ holds {total} lines, over {BENCH_LINES_LIMIT} ({largest}, ...)"


def test_a_launch_log_becomes_its_result(tmp_path):
    """readme_command's result: the exit, the last memory plan line and the Trainer's logged dicts, in order."""
    from common import launch_log_result

    log = tmp_path / "readme_command.log"
    log.write_text("INFO:x:memory plan: GPU, 2 sample(s) each\r 50%|{'loss': '12.49', 'epoch': '0.25'}\n"
                   "{'eval_loss': '11.98'}\n{'train_runtime': '112', 'epoch': '0.5'}\n")
    result = launch_log_result(str(log), 0, "NVIDIA H200", "accelerate launch\n    recipes/eo_gym_4b.py")
    assert (result["exit_code"], result["device"], result["command"]) == (0, "NVIDIA H200", "accelerate launch recipes/eo_gym_4b.py")
    assert result["memory_plan_line"] == "memory plan: GPU, 2 sample(s) each"
    assert result["logged"] == ["{'loss': '12.49', 'epoch': '0.25'}", "{'eval_loss': '11.98'}", "{'train_runtime': '112', 'epoch': '0.5'}"]


def test_the_defaults_runs_become_one_result(tmp_path):
    """defaults_80gb's result: per command its last memory plan line, whether it died, its largest sample."""
    from common import defaults_result

    (tmp_path / "rollout_smi.csv").write_text("1200, 81559\n70123, 81559\n65000, 81559\n")
    (tmp_path / "rollout_defaults.log").write_text("memory plan: H100, 12 slots\rprogress\n")
    (tmp_path / "validate_smi.csv").write_text("")
    (tmp_path / "validate_defaults.log").write_text("Traceback (most recent call last):\n")
    runs = defaults_result(str(tmp_path), "NVIDIA H100 80GB HBM3")["runs"]
    assert runs["rollout"] == {"memory_plan_line": "memory plan: H100, 12 slots", "traceback": False,
                               "peak_mib_used": 70123, "total_mib": 81559}
    assert runs["validate"] == {"memory_plan_line": None, "traceback": True, "peak_mib_used": None, "total_mib": None}


def test_results_keep_the_digits_they_cite():
    """bench/results' rounding: 4 decimals, but 4 significant digits below 1, so a 2e-6 difference stays one."""
    from common import results_json

    assert results_json({"diff": 1.90735e-06, "share": 0.11914, "gib": 82.93707418, "tok_s": 15371.6, "n": 3}) == (
        '{"diff":1.907e-06,"share":0.1191,"gib":82.9371,"tok_s":15371.6,"n":3}\n')


def test_arm_a_times_its_own_step_count_when_given(monkeypatch):
    """``--a-steps``: plain TRL's steps hold 4 samples, so its tok/s needs more of them than arm B's 64-sample steps."""
    import types

    import train_throughput

    seen = {}
    monkeypatch.setattr(train_throughput, "run_arm", lambda arm, *a: seen.setdefault(arm, a[6]) and {"arm": arm, "real_tokens_per_s": 1.0})
    args = types.SimpleNamespace(arms="A,B", steps=3, a_steps=24, warmup=1, grad_accum=32, json=None)
    state = types.SimpleNamespace(is_main_process=False)
    train_throughput.run_arms(args, state, None, None, None, None, None, Path("."))
    assert seen == {"A": 24, "B": 3}
    seen.clear()
    train_throughput.run_arms(types.SimpleNamespace(**{**vars(args), "a_steps": None}), state, None, None, None, None, None, Path("."))
    assert seen == {"A": 3, "B": 3}
