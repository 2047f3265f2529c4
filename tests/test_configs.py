"""The shipped configs: every recipe YAML parses with the recipe's own parser and ``eo_gym_4b.yaml`` holds
the published EO-Gym-4B settings, with or without ``--config``; the accelerate configs are valid."""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
ACCELERATE = sorted((REPO / "recipes" / "accelerate").glob("*.yaml"))
# bf16 training arguments are refused on a machine without a GPU unless they are told it is a CPU run
CPU = [] if torch.cuda.is_available() else ["--use_cpu", "true"]
ADJUSTED_ON_CPU = {"dataloader_pin_memory"} if CPU else set()  # TrainingArguments turns it off without a GPU


def load_recipe(path: Path):
    spec = importlib.util.spec_from_file_location(f"{path.stem}_recipe_configs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def recipe():
    return load_recipe(REPO / "recipes" / "eo_gym_4b.py")


def published(script, training, model) -> None:
    """The EO-Gym-4B recipe as published."""
    assert model.model_name_or_path == "Qwen/Qwen3-VL-4B-Instruct"
    assert model.dtype == "bfloat16" and not getattr(model, "trust_remote_code", False)
    assert training.num_train_epochs == 3
    # 4 x 16 = 64 samples a step as published, dealt into token-balanced micro-batches as many as the memory plan
    # chooses: the same samples and token-mean loss each step (tests/training/test_trainer.py checks the split changes nothing)
    assert script.samples_per_step == 4 * 16  # the step's one home; the accumulation follows the world size and the plan
    assert training.train_sampling_strategy == "batch_rebalance" and training.length_column_name == "n_tokens"
    assert training.learning_rate == 1e-4
    assert str(training.lr_scheduler_type) in ("cosine", "SchedulerType.COSINE")
    assert training.weight_decay == 0.1
    assert str(training.optim) in ("adamw_torch_fused", "OptimizerNames.ADAMW_TORCH_FUSED")
    assert training.seed == 42
    assert training.bf16 is True and training.fp16 is False
    assert training.max_length == 8192
    assert training.remove_unused_columns is False
    assert training.dataset_kwargs == {"skip_prepare_dataset": True}
    assert training.max_steps == -1 and training.resume_from_checkpoint is None
    assert model.use_peft is True
    assert (model.lora_r, model.lora_alpha, model.lora_dropout) == (16, 32, 0.05)
    assert list(model.lora_target_modules) == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]
    assert script.max_pixels == 1003520 and script.min_pixels == 65536
    assert 0 < script.eval_fraction < 1 and script.overlong == "split"


def test_recipe_yamls_exist():
    assert REPO / "recipes" / "eo_gym_4b.yaml" in RECIPES


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_every_recipe_yaml_parses(path):
    raw = yaml.safe_load(path.read_text())
    script, training, model = load_recipe(path.with_suffix(".py")).parse_args(["--config", str(path), *CPU])
    for key, value in raw.items():  # every key lands in one of the three argument groups, unchanged
        holders = [args for args in (script, training, model) if hasattr(args, key)]
        assert holders, f"{path.name}: {key} is no recipe argument"
        got = getattr(holders[0], key)
        got = got.value if hasattr(got, "value") else got
        if key == "report_to" and value == "none":
            value = []  # TrainingArguments' spelling of "none"
        if isinstance(value, float) or isinstance(got, float):
            assert got == pytest.approx(value), key
        elif isinstance(value, list):
            assert list(got) == value, key
        elif key not in ADJUSTED_ON_CPU:
            assert got == value or str(got) == str(value), key


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_recipe_yamls_use_no_deprecated_training_argument(path):
    """transformers 5.24 renamed ``gradient_checkpointing*`` to ``activation_checkpointing*``: an old name in a
    YAML warns on every launch, and a flag spelled the new way would silently win over it."""
    import warnings

    assert not any(key.startswith("gradient_checkpointing") for key in yaml.safe_load(path.read_text()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, training, _ = load_recipe(path.with_suffix(".py")).parse_args(["--config", str(path), *CPU])
    assert [str(w.message) for w in caught if "deprecated" in str(w.message) and "checkpointing" in str(w.message)] == []
    assert training.gradient_checkpointing == training.activation_checkpointing  # the old name mirrors the new


def test_grpo_yaml_checkpoints_activations_and_a_flag_turns_it_off():
    grpo = REPO / "recipes" / "eo_gym_4b_grpo.yaml"
    recipe = load_recipe(grpo.with_suffix(".py"))
    _, training, _ = recipe.parse_args(["--config", str(grpo), *CPU])
    assert training.activation_checkpointing is True and training.activation_checkpointing_kwargs == {"use_reentrant": False}
    _, training, _ = recipe.parse_args(["--config", str(grpo), *CPU, "--activation_checkpointing", "false"])
    assert training.activation_checkpointing is False and training.gradient_checkpointing is False


def test_eo_gym_4b_yaml_holds_the_published_settings(recipe):
    published(*recipe.parse_args(["--config", str(REPO / "recipes" / "eo_gym_4b.yaml"), *CPU]))


def test_eo_gym_4b_yaml_leaves_the_micro_batches_and_checkpointing_to_the_memory_plan():
    from eogym_sft.training.memory_hook import config_file, settings_given

    argv = ["--config", str(REPO / "recipes" / "eo_gym_4b.yaml")]
    assert settings_given(argv, config_file(argv)) == frozenset()


def test_eo_gym_4b_yaml_ships_the_speed_path(recipe):
    script, training, model = recipe.parse_args(list(CPU))
    assert training.padding_free and script.compile_layers and model.attn_implementation == "eogym_varlen_cudnn"
    assert training.dataloader_num_workers == 8  # activation checkpointing: the memory plan's (no checkpointing where it fits)
    assert training.logging_nan_inf_filter is False  # transformers' default syncs the host after every micro-batch


def test_recipe_turns_on_expandable_segments_unless_the_user_set_the_allocator(monkeypatch):
    """Set before torch starts CUDA, so it must happen when the recipe script is loaded, before it imports
    anything that may start CUDA."""
    import ast
    import os

    source = (REPO / "recipes" / "eo_gym_4b.py").read_text()
    statements = ast.parse(source).body
    sets = next(i for i, node in enumerate(statements) if "PYTORCH_CUDA_ALLOC_CONF" in ast.unparse(node))
    third_party = [
        i for i, node in enumerate(statements)
        if isinstance(node, (ast.Import, ast.ImportFrom)) and (getattr(node, "module", None) or node.names[0].name).split(".")[0]
        not in ("os", "sys", "pathlib", "__future__")
    ]
    assert third_party and sets < min(third_party)
    for preset, expected in ((None, "expandable_segments:True"), ("max_split_size_mb:64", "max_split_size_mb:64")):
        if preset is None:
            monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
        else:
            monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", preset)
        spec = importlib.util.spec_from_file_location("eo_gym_4b_allocator", REPO / "recipes" / "eo_gym_4b.py")
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == expected


def test_no_config_reads_the_same_yaml(recipe):
    default = recipe.parse_args(list(CPU))
    explicit = recipe.parse_args(["--config", str(REPO / "recipes" / "eo_gym_4b.yaml"), *CPU])
    published(*default)
    for a, b in zip(default, explicit):
        as_dict = (lambda x: x.to_dict()) if hasattr(a, "to_dict") else dataclasses.asdict
        assert as_dict(a) == as_dict(b)


def test_flags_override_the_yaml(recipe):
    script, training, model = recipe.parse_args(
        [*CPU, "--learning_rate", "3e-4", "--lora_r", "8", "--max_pixels", "4096", "--min_pixels", "1024", "--max_steps", "5"]
    )
    assert (
        training.learning_rate == 3e-4 and model.lora_r == 8 and script.max_pixels == 4096 and training.max_steps == 5
    )
    assert script.samples_per_step == 64 and training.train_sampling_strategy == "batch_rebalance"  # the rest still comes from the file


def test_bad_eval_fraction_is_refused(recipe):
    with pytest.raises(ValueError, match="eval_fraction"):
        recipe.parse_args([*CPU, "--eval_fraction", "1.0"])
    with pytest.raises(ValueError, match="min_pixels <= max_pixels"):
        recipe.parse_args([*CPU, "--max_pixels", "4096"])  # under the 65,536 px floor


EXPECTED_DISTRIBUTED = {
    "deepspeed_zero2": ("DEEPSPEED", 2),
    "deepspeed_zero3": ("DEEPSPEED", 3),
    "ddp": ("MULTI_GPU", None),
    "multi_gpu": ("MULTI_GPU", None),
}


@pytest.mark.skipif(not ACCELERATE, reason="no accelerate configs under recipes/accelerate/")
@pytest.mark.parametrize("path", ACCELERATE, ids=[p.name for p in ACCELERATE])
def test_accelerate_configs(path):
    from accelerate.commands.config.config_args import ClusterConfig

    config = yaml.safe_load(path.read_text())
    assert isinstance(config, dict)
    loaded = ClusterConfig.from_yaml_file(str(path))  # accelerate's own reader: unknown keys are refused
    assert loaded.distributed_type.value == config["distributed_type"]
    expected = EXPECTED_DISTRIBUTED.get(path.stem)
    assert expected is not None, f"{path.name}: no expectation for this accelerate config"
    kind, stage = expected
    assert config["distributed_type"] == kind
    if stage is not None:
        assert config["deepspeed_config"]["zero_stage"] == stage
    assert config.get("mixed_precision", "bf16") == "bf16"
    assert config.get("num_processes", 1) >= 1


def test_accelerate_configs_for_zero2_zero3_and_ddp_are_shipped():
    names = {p.stem for p in ACCELERATE}
    if not names:
        pytest.skip("no accelerate configs under recipes/accelerate/ yet")
    assert {"deepspeed_zero2", "deepspeed_zero3"} <= names and names & {"ddp", "multi_gpu"}


def test_a_recipe_flag_is_never_taken_by_its_prefix(recipe):
    """``--max_step`` was taken as ``--max_steps`` (argparse's prefix matching): now it is refused by name."""
    with pytest.raises(ValueError, match=r"not used by the HfArgumentParser: \['--max_step', '5'\]"):
        recipe.parse_args([*CPU, "--max_step", "5"])


@pytest.mark.slow(40)  # two runs of the recipe script, each importing torch and TRL
def test_a_recipe_error_is_one_line_and_debug_shows_the_traceback():
    argv = [sys.executable, str(REPO / "recipes" / "eo_gym_4b.py"), *CPU, "--eval_fraction", "1.0"]
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines()[-1] == "eo_gym_4b.py: eval_fraction must be in [0, 1), got 1.0 (--debug or EOGYM_DEBUG=1 shows the traceback)"
    debug = subprocess.run([*argv, "--debug"], capture_output=True, text=True, timeout=300, env=env)
    assert debug.returncode == 1 and "Traceback" in debug.stderr
    assert debug.stderr.splitlines()[-1] == "ValueError: eval_fraction must be in [0, 1), got 1.0"


def test_the_tool_images_default_is_written_once():
    """``"produced"`` is :data:`eogym_sft.config.TOOL_IMAGES`, imported wherever a default is needed; the only other
    literal is the list of the modes."""
    import ast

    found = []
    for path in sorted((REPO / "eogym_sft").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value == "produced":
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    from eogym_sft.config import TOOL_IMAGES
    from eogym_sft.data.tool_images import TOOL_IMAGE_MODES

    assert TOOL_IMAGES == TOOL_IMAGE_MODES[0] == "produced"
    assert [place.split(":")[0] for place in found] == ["eogym_sft/config.py", "eogym_sft/data/tool_images.py"], found
