"""The GRPO recipe (``recipes/eo_gym_4b_grpo.py``) as a user runs it on CPU: its YAML parses into TRL's
GRPOConfig with the seed's settings, and a one-step run from an SFT adapter continues that adapter (not a
new one) and leaves it, the processor and ``eogym_run.json`` in the output folder."""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path

import pytest
from conftest import make_row, save_image

from eogym_sft.models.loading import apply_lora, load_base_model

REPO = Path(__file__).resolve().parents[1]


def load_recipe():
    spec = importlib.util.spec_from_file_location("eo_gym_4b_grpo_under_test", REPO / "recipes" / "eo_gym_4b_grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_yaml_opens_with_the_launch_command_and_holds_the_seeds_settings():
    yaml = (REPO / "recipes" / "eo_gym_4b_grpo.yaml").read_text()
    assert yaml.startswith("# accelerate launch recipes/eo_gym_4b_grpo.py --config recipes/eo_gym_4b_grpo.yaml")
    script, training, model = load_recipe().parse_args(["--output_dir", "unused", "--use_cpu", "true", "--bf16", "false"])
    assert (training.learning_rate, training.num_generations, training.beta, training.temperature) == (3e-5, 8, 0.0, 1.0)
    assert training.scale_rewards == "group" and training.mask_truncated_completions
    assert (training.max_completion_length, training.max_tool_calling_iterations, training.max_steps) == (6144, 11, 300)
    assert training.per_device_train_batch_size * training.gradient_accumulation_steps // training.num_generations == 2
    assert (script.action_cost_scale, script.max_cost_penalty, script.tool_call_cost) == (0.2, 0.2, 0.1)
    assert (script.max_pixels, script.tool_backends, script.sft_adapter, script.tool_images) == (1003520, "crop,replay", None, "produced")
    assert (model.lora_r, model.lora_alpha, model.lora_dropout) == (16, 32, 0.05)
    assert (script.rollout_engine, script.max_episode_tokens, script.rollout_cache_gib) == ("slots", 16384, None)  # sized to the GPU
    assert (script.rollout_turn_tokens, script.rollout_keep_cache, script.rollout_cuda_graphs) == (1024, True, True)
    assert model.attn_implementation == "eogym_varlen_cudnn"  # the packed loss forward of the slots engine


@pytest.mark.slow(15)
@pytest.mark.parametrize("engine", ["trl", "slots"])
def test_a_cpu_run_continues_the_sft_adapter(tmp_path, tiny_model_dir, engine):
    root = tmp_path / "data"
    save_image(root, "EO_GYM_DATA/aaaa0000/scene.jpg", 96, 64)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(make_row(n_steps=1)) + "\n")
    sft = tmp_path / "sft"  # an adapter of its own shape: the run must continue it, not start a new one
    apply_lora(load_base_model(str(tiny_model_dir), "float32", "sdpa"), r=4, alpha=8, targets=("q_proj",)).save_pretrained(sft)
    out = tmp_path / "grpo"
    recipe = load_recipe()
    args = recipe.parse_args(
        [
            "--model_name_or_path", str(tiny_model_dir), "--dataset_path", str(rows), "--data_root", str(root),
            "--output_dir", str(out), "--sft_adapter", str(sft), "--use_cpu", "true", "--bf16", "false",
            "--max_steps", "1", "--num_generations", "2", "--per_device_train_batch_size", "2",
            "--gradient_accumulation_steps", "1", "--max_completion_length", "4", "--max_pixels", "4096",
            "--min_pixels", "1024", "--activation_checkpointing", "true", "--save_strategy", "no",
            "--rollout_engine", engine, "--max_episode_tokens", "2048",
            *(["--attn_implementation", "sdpa"] if engine == "trl" else []),  # TRL's padded generate
        ]
    )
    assert args[1].activation_checkpointing is True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert recipe.train(*args) == str(out)
    # no notice about our own settings: TRL's experimental environment_factory, transformers' old checkpointing names
    noise = [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, UserWarning))
             and ("checkpointing" in str(w.message) or "environment_factory" in str(w.message))]
    assert not noise, noise
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8)
    assert (out / "adapter_model.safetensors").is_file() and (out / "processor_config.json").is_file()
    info = json.loads((out / "eogym_run.json").read_text())
    assert info["config"]["script"]["sft_adapter"] == str(sft)
    assert info["config"]["training"]["num_generations"] == 2
    assert info["config"]["script"]["rollout_engine"] == engine
    assert info["data"]["samples"] == 1 and info["data"]["rows_dropped"] == 0
    assert info["processor"]["size"] == {"longest_edge": 4096, "shortest_edge": 1024}


@pytest.mark.slow(5)
def test_grpo_resumes_only_its_own_run_and_refuses_a_used_output_dir(tmp_path, tiny_model_dir):
    """The SFT recipe's resume rules hold for GRPO: a finished run is a no-op on `last`, another run's
    checkpoint is refused with what differs, and a new run does not write into a used output_dir."""
    root = tmp_path / "data"
    save_image(root, "EO_GYM_DATA/aaaa0000/scene.jpg", 96, 64)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(make_row(n_steps=1)) + "\n")
    out = tmp_path / "grpo"
    recipe = load_recipe()

    def run(*extra):
        flags = [
            "--model_name_or_path", str(tiny_model_dir), "--dataset_path", str(rows), "--data_root", str(root),
            "--output_dir", str(out), "--use_cpu", "true", "--bf16", "false", "--max_steps", "1", "--num_generations", "2",
            "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1", "--max_completion_length", "4",
            "--max_pixels", "4096", "--min_pixels", "1024", "--activation_checkpointing", "false", "--save_steps", "1",
        ]
        return recipe.train(*recipe.parse_args([*flags, *extra]))

    run()
    assert (out / "checkpoint-1" / "eogym_checkpoint.json").is_file()
    with pytest.raises(FileExistsError, match="holds an earlier run"):
        run()
    assert run("--resume_from_checkpoint", "last") == str(out)  # finished: nothing to train
    with pytest.raises(ValueError, match="learning_rate"):
        run("--resume_from_checkpoint", "last", "--learning_rate", "1e-3")


def test_run_as_a_script_it_drops_deepspeeds_cpu_probe_before_training(tmp_path, monkeypatch):
    """``python recipes/eo_gym_4b_grpo.py ...`` (its ``__main__``): DeepSpeed's "Setting accelerator to CPU"
    filter is on the DeepSpeed logger before ``train`` runs (the run itself is the test above)."""
    import logging
    import runpy
    import sys

    from eogym_sft.training import grpo
    from eogym_sft.quiet import _DropDeepSpeedProbe

    logger = logging.getLogger("DeepSpeed")
    monkeypatch.setattr(logger, "filters", [])
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    seen = []
    monkeypatch.setattr(grpo, "train", lambda *args: seen.append([type(f) for f in logger.filters]))
    script = REPO / "recipes" / "eo_gym_4b_grpo.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--output_dir", str(tmp_path / "out"), "--use_cpu", "true", "--bf16", "false"])
    runpy.run_path(str(script), run_name="__main__")
    assert seen == [[_DropDeepSpeedProbe]]


def test_an_sft_adapter_of_another_base_is_refused_before_anything_loads(tmp_path, tiny_model_dir):
    sft = tmp_path / "sft"
    sft.mkdir()
    (sft / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "Qwen/Qwen3-VL-8B-Instruct"}))
    recipe = load_recipe()
    args = recipe.parse_args([
        "--model_name_or_path", str(tiny_model_dir), "--dataset_path", str(tmp_path / "missing.jsonl"),
        "--output_dir", str(tmp_path / "out"), "--sft_adapter", str(sft), "--use_cpu", "true", "--bf16", "false",
    ])
    with pytest.raises(ValueError, match=f"--sft_adapter {sft} was trained on 'Qwen/Qwen3-VL-8B-Instruct' but --model_name_or_path is"):
        recipe.train(*args)
    assert not (tmp_path / "out").exists()
