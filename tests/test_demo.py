"""``eogym-sft demo``: held-out validation, a model wide enough to learn, labelled output, no deprecated settings."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from test_recipe import load_recipe


def test_our_settings_raise_no_deprecation_warning(tmp_path):
    from eogym_sft.demo import demo_configs

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        load_recipe().parse_args(["--use_cpu", "true"])  # the recipe's YAML
        demo_configs(tmp_path / "model", tmp_path, steps=2, learning_rate=1e-2)


def test_demo_validates_on_the_traces_training_held_out(tmp_path):
    from eogym_sft.demo import EVAL_FRACTION, demo_configs
    from eogym_sft.models.tiny import DEMO_QWEN3_VL_CONFIG

    script, training, model = demo_configs(tmp_path / "model", tmp_path, steps=2, learning_rate=1e-2)
    assert script.eval_fraction == EVAL_FRACTION > 0 and training.seed == 42
    assert script.samples_per_step == 2 and training.per_device_train_batch_size == 2
    assert DEMO_QWEN3_VL_CONFIG["text_config"]["hidden_size"] == 128
    # the same traces: run_demo passes EVAL_FRACTION and the seed to validate's held_out_fraction
    import inspect

    from eogym_sft import demo

    source = inspect.getsource(demo.run_demo)
    assert "held_out_fraction=EVAL_FRACTION" in source and "seed=training.seed" in source


def test_demo_summary_names_both_arms_and_where_everything_is(tmp_path):
    from eogym_sft.demo import demo_summary

    scores = {"adapter": {"overall": {"loss": 3.5, "token_accuracy": 0.31, "tokens": 900}}, "base": {"overall": {"loss": 11.9, "token_accuracy": 0.02, "tokens": 900}}}
    text = demo_summary({"samples": 6, "models": scores}, tmp_path, str(tmp_path / "adapter"))
    lines = text.splitlines()
    assert "token accuracy  base 0.0200  ->  adapter 0.3100" in text and "Held-out traces (never trained on): 6 samples" in text
    assert [line.split(":")[0] for line in lines[-6:-2]] == ["adapter", "report", "manifest", "next"]
    assert "A first run on CPU" in lines[-3] and "on a GPU" in lines[-2] and "README.md" in lines[-1]
    assert f"--adapter {tmp_path / 'adapter'}" in text and str(Path(tmp_path) / "prepared" / "manifest.jsonl") in text


def test_demo_refuses_a_used_output_folder(tmp_path):
    from eogym_sft.demo import run_demo

    (tmp_path / "old.txt").write_text("x")
    with pytest.raises(FileExistsError, match="eogym-sft demo: .* --overwrite"):
        run_demo(tmp_path)


def test_the_demo_learns_what_it_holds_out(tmp_path):
    """The demo's model and recipe settings beat the base on traces never trained on (the full demo, with
    smaller images and fewer steps so that it runs in about half a minute)."""
    from eogym_sft.demo import run_demo

    report = run_demo(tmp_path / "demo", steps=12, max_pixels=65536)
    adapter, base = report["models"]["adapter"]["overall"], report["models"]["base"]["overall"]
    assert adapter["token_accuracy"] > base["token_accuracy"] + 0.05
    assert adapter["loss"] < base["loss"] - 1.0
