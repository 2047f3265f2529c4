"""The recipes' YAML read strictly (``eogym_sft/strict_yaml.py``), through both recipe scripts' own parsers:
duplicate keys, tags, alias bombs, deep nesting and values of the wrong type are each one ``ValueError``
naming the file, the line and the key, raised while parsing (before data prep or a model load)."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import fields
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
CPU = [] if torch.cuda.is_available() else ["--use_cpu", "true"]
RECIPES = ["eo_gym_4b", "eo_gym_4b_grpo"]


def load_recipe(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_strict_yaml", REPO / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module", params=RECIPES)
def recipe(request):
    return load_recipe(request.param)


def refusal(recipe, tmp_path: Path, text: str) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as caught:
        recipe.parse_args(["--config", str(path), *CPU])
    message = str(caught.value)
    assert "\n" not in message
    return message.replace(str(path), "FILE")


@pytest.mark.parametrize("text, message", [
    ("seed: 1\nlearning_rate: 1.0e-4\nseed: 2\n", "FILE:3: seed: given twice (first on line 1)"),
    ("seed: 1\nactivation_checkpointing_kwargs: {use_reentrant: false, use_reentrant: true}\n",
     "FILE:2: use_reentrant: given twice (first on line 2)"),
    ("seed: 1\n'seed': 2\n", "FILE:2: seed: given twice (first on line 1)"),
])
def test_a_key_given_twice_is_refused_with_both_lines(recipe, tmp_path, text, message):
    assert refusal(recipe, tmp_path, text) == message


@pytest.mark.parametrize("tagged, tag", [
    ("!!str 3", "tag:yaml.org,2002:str"),
    ("!!float 1", "tag:yaml.org,2002:float"),
    ("!!python/object/apply:os.system [ls]", "tag:yaml.org,2002:python/object/apply:os.system"),
    ("!custom 3", "!custom"),
    ("!!binary aGk=", "tag:yaml.org,2002:binary"),
    ("!!set {a, b}", "tag:yaml.org,2002:set"),
])
def test_every_explicit_tag_is_refused(recipe, tmp_path, tagged, tag):
    assert refusal(recipe, tmp_path, f"logging_steps: 1\nseed: {tagged}\n") == f"FILE:2: seed: the tag {tag} is refused (plain values only)"


def test_an_alias_bomb_and_an_endless_alias_are_refused_before_they_expand(recipe, tmp_path):
    levels = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for i, name in enumerate("bcdefghi"):
        levels.append(f"{name}: &{name} [{', '.join([f'*{levels[-1][0]}'] * 10)}]")
    assert refusal(recipe, tmp_path, "\n".join(levels) + "\n") == "FILE:4: d: expands to more than 10000 values through aliases (*name)"
    assert refusal(recipe, tmp_path, "seed: 1\nlora_target_modules: &m [q_proj, *m]\n") == (
        "FILE:2: lora_target_modules: an alias refers to a value that holds it (an endless value)")


def test_aliases_within_the_bound_still_work(recipe, tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("model_name_or_path: &m Qwen/Qwen3-VL-4B-Instruct\nrun_name: *m\nlora_target_modules: [q_proj, v_proj]\n")
    _, training, model = recipe.parse_args(["--config", str(path), *CPU])
    assert training.run_name == model.model_name_or_path == "Qwen/Qwen3-VL-4B-Instruct" and model.lora_target_modules == ["q_proj", "v_proj"]


@pytest.mark.parametrize("text, message", [
    ("a: " + "[" * 40 + "]" * 40 + "\n", "FILE:1: a: nested more than 16 levels deep"),
    ("seed: [\n", "FILE:2: not valid YAML (expected the node content, but found '<stream end>')"),
    ("seed: 1\n---\nseed: 2\n", "FILE:2: not valid YAML (but found another document)"),
    ("- seed\n", "FILE: must hold a YAML mapping of settings (name: value)"),
    ("", "FILE: must hold a YAML mapping of settings (name: value)"),
    ("learnin_rate: 1.0e-4\n", "FILE:1: learnin_rate: not a setting of this recipe (a misspelt name?)"),
    ("env: [A]\n", "FILE:1: env: expected a mapping of environment variables to plain values"),
])
def test_malformed_yaml_is_one_line_naming_the_line(recipe, tmp_path, text, message):
    assert refusal(recipe, tmp_path, text) == message


@pytest.mark.parametrize("text, message", [
    ("learning_rate: [1, 2]", "learning_rate: expected a finite number, got list [1, 2]"),
    ("learning_rate: abc", "learning_rate: expected a finite number, got str 'abc'"),
    ("learning_rate: .nan", "learning_rate: expected a finite number, got float nan"),
    ("learning_rate: .inf", "learning_rate: expected a finite number, got float inf"),
    ("learning_rate: '1e999'", "learning_rate: expected a finite number, got str '1e999'"),
    ("seed: 4.5", "seed: expected a whole number, got float 4.5"),
    ("seed: true", "seed: expected a whole number, got bool True"),
    ("bf16: {a: 1}", "bf16: expected true or false or null, got dict {'a': 1}"),
    ("bf16: maybe", "bf16: expected true or false or null, got str 'maybe'"),
    ("output_dir: 123", "output_dir: expected a string or null, got int 123"),
    ("run_name: no", "run_name: expected a string or null, got bool False"),
    ("run_name: 2020-01-01", "run_name: expected a string or null, got date datetime.date(2020, 1, 1)"),
    ("lora_target_modules: [q_proj, 3]", "lora_target_modules: expected a list of a string or null, got list ['q_proj', 3]"),
    ("lora_target_modules: {q: 1}", "lora_target_modules: expected a list of a string or null, got dict {'q': 1}"),
    ("dataset_path: [a.jsonl]", "dataset_path: expected a string, got list ['a.jsonl']"),
    ("lr_scheduler_type: [cosine]", "lr_scheduler_type: expected one of"),
])
def test_every_value_is_checked_against_its_fields_type(recipe, tmp_path, text, message):
    assert refusal(recipe, tmp_path, f"logging_steps: 1\n{text}\n").startswith(f"FILE:2: {message}")


def test_a_string_the_flag_would_convert_is_taken_as_the_flag_takes_it(recipe, tmp_path):
    """``1e-4`` is a string to YAML 1.1 and a float on the command line: the file and the flag agree."""
    path = tmp_path / "ok.yaml"
    path.write_text("learning_rate: 1e-4\nbf16: 'false'\nseed: '7'\n")
    _, training, _ = recipe.parse_args(["--config", str(path), *CPU])
    assert (training.learning_rate, training.bf16, training.seed) == (1e-4, False, 7)


@pytest.mark.parametrize("flag, value", [("--learning_rate", "nan"), ("--learning_rate", "inf"), ("--weight_decay", "-inf")])
def test_a_nan_or_infinite_flag_is_refused(recipe, flag, value):
    with pytest.raises(ValueError, match=f"^{flag}: must be a finite number, got {value}$"):
        recipe.parse_args([*CPU, f"{flag}={value}"])


@pytest.mark.parametrize("flag, value, why", [
    ("--learning_rate", "-1e-4", "must be above 0, got -0.0001"),
    ("--learning_rate", "0", "must be above 0, got 0.0"),
    ("--per_device_train_batch_size", "-2", "must be at least 1, got -2"),
    ("--gradient_accumulation_steps", "0", "must be at least 1, got 0"),
    ("--lora_r", "-8", "must be at least 1, got -8"),
    ("--lora_dropout", "1.0", "must be at least 0 and below 1, got 1.0"),
    ("--max_length", "-10", "must be at least 1, got -10"),
    ("--seed", "-1", "must be at least 0, got -1"),
    ("--max_grad_norm", "-1", "must be at least 0, got -1.0"),
    ("--temperature", "0", "must be above 0, got 0.0"),
])
def test_a_setting_outside_its_range_is_refused_from_a_flag_and_from_the_file(recipe, tmp_path, flag, value, why):
    """TRL and transformers accept these and fail deep in a run (or train nothing); a setting the recipe lacks
    (``temperature`` in SFT) is not this check's to refuse."""
    name = flag.removeprefix("--")
    from trl import GRPOConfig, SFTConfig

    if name not in {f.name for f in fields(GRPOConfig if "grpo" in recipe.__name__ else SFTConfig)} | {"lora_r", "lora_dropout"}:
        pytest.skip(f"{name} is not a setting of this recipe")
    with pytest.raises(ValueError, match=f"^{flag}: {why}$"):
        recipe.parse_args([*CPU, f"{flag}={value}"])
    from_file = refusal(recipe, tmp_path, f"logging_steps: 1\n{name}: {value}\n")
    assert float(from_file.rsplit(", got ", 1)[1]) == float(value)  # YAML's 0 is an int where the flag's is a float
    assert from_file.startswith(f"FILE:2: {name}: {why.rsplit(', got ', 1)[0]}, got ")


def test_settings_within_their_ranges_pass(recipe):
    _, training, model = recipe.parse_args([*CPU, "--learning_rate=2e-4", "--lora_dropout=0", "--seed=0"])
    assert (training.learning_rate, model.lora_dropout, training.seed) == (2e-4, 0.0, 0)


def test_the_strict_read_comes_before_any_data_or_model(tmp_path, monkeypatch):
    """``main`` parses first: a refused YAML never reaches ``train`` (data prep, the model load)."""
    import eogym_sft.training.sft as sft

    monkeypatch.setattr(sft, "train", lambda *a: pytest.fail("train was reached"))
    path = tmp_path / "bad.yaml"
    path.write_text("learning_rate: [1, 2]\n")
    with pytest.raises(ValueError, match=r":1: learning_rate: expected a finite number, got list \[1, 2\]$"):
        load_recipe("eo_gym_4b").main(["--config", str(path), *CPU])


@pytest.mark.parametrize("name, flags, message", [
    ("eo_gym_4b", ["--prep_num_proc=0"], "prep_num_proc must be at least 1, got 0"),
    ("eo_gym_4b_grpo", ["--judge_timeout=0"], "need progress_seconds, judge_timeout > 0, judge_retries >= 0, limit >= 1 "
                                              "(or None); got 30.0, 0.0, 3, None"),
    ("eo_gym_4b_grpo", ["--judge_retries=-1"], "got 30.0, 60.0, -1, None"),
    ("eo_gym_4b_grpo", ["--limit=0"], "got 30.0, 60.0, 3, 0"),
])
def test_our_own_settings_check_their_ranges(name, flags, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_recipe(name).parse_args([*CPU, *flags])
