"""``eogym-sft plan``: the recipe's plan for a GPU size, without a GPU, as a line or one JSON object."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eogym_sft import cli
from eogym_sft.models import memory as mm
from eogym_sft.training import memory_plan as mp
from eogym_sft.training import plan_command

REPO = Path(__file__).resolve().parents[2]
ARCH = str(REPO / "recipes/configs/qwen3_vl_4b_instruct.json")
CAL = mm.Calibration(100_000, 5_000, 50_000, 1 * mm.GIB, 1.0, 0)


def plan(capsys, *argv) -> str:
    cli.main(["plan", "--model-config", ARCH, *argv])
    return capsys.readouterr().out.strip()


def test_sizes_read_as_their_units():
    assert plan_command.parse_size("80GB") == 80e9 and plan_command.parse_size("79.5GiB") == 79.5 * 2**30
    assert plan_command.parse_size("24576MiB") == 24 * 2**30 and plan_command.parse_size("48") == 48e9
    for bad in ("80TB", "GB", "-3GB", "0"):
        with pytest.raises(ValueError, match=f"--gpu-memory '{bad}': give a size such as 80GB"):
            plan_command.parse_size(bad)


def test_without_data_the_plan_is_for_max_length_samples(capsys, monkeypatch):
    monkeypatch.setattr(mm, "CALIBRATION", CAL)
    out = json.loads(plan(capsys, "--gpu-memory", "80GiB", "--json"))
    # 8,192 tokens a sample, half supervised: one sample 9.76 + 42.09 decoder + 4.64 loss GiB, and the step's pixel
    # values, 64 x 8,192 image tokens x 4 patches x 1,536 bf16 values (6.0 GiB); two do not fit
    assert (out["per_device_train_batch_size"], out["gradient_accumulation_steps"], out["activation_checkpointing"]) == (1, 64, False)
    assert out["micro_batch_tokens"] == 8192 and out["predicted_peak_gib"] == 62.49 and out["refused"] is None
    assert (out["recipe"], out["gpus"], out["zero_stage"], out["given"]) == ("sft", 1, 2, [])
    assert out["data"] == "worst case: every sample max_length tokens"
    assert out["terms_gib"]["frozen_weights"] == 8.266 and out["terms_gib"]["loss"] == 4.637
    line = plan(capsys, "--gpu-memory", "80GiB")
    assert line == out["line"] and line.startswith("memory plan: a 80GiB GPU, 80.0 GiB free, budget 80.0 GiB: 64 micro-batches")


def test_the_recipes_flags_are_kept_and_refused_when_they_cannot_fit(capsys, monkeypatch):
    monkeypatch.setattr(mm, "CALIBRATION", CAL)
    out = json.loads(plan(capsys, "--gpu-memory", "80GiB", "--json", "--per_device_train_batch_size", "4", "--gpus", "2"))
    assert out["given"] == ["per_device_train_batch_size"] and out["gpus"] == 2
    assert (out["per_device_train_batch_size"], out["gradient_accumulation_steps"], out["activation_checkpointing"]) == (4, 8, True)
    refused = plan(capsys, "--gpu-memory", "24GB", "--per_device_train_batch_size", "4", "--activation_checkpointing", "false")
    assert refused.startswith("refused at launch: per_device_train_batch_size 4 with activation_checkpointing false does not fit")


def test_with_data_the_plan_reads_the_samples_the_sampler_will_deal(capsys, monkeypatch, tmp_path):
    from datasets import Dataset

    monkeypatch.setattr(mm, "CALIBRATION", CAL)
    data = Dataset.from_dict({"n_tokens": [4000] * 64, "n_trained_tokens": [400] * 64, "n_image_tokens": [2000] * 64})
    monkeypatch.setattr(plan_command, "train_dataset", lambda script, training: (data, data.select(range(8)), str(tmp_path)))
    out = json.loads(plan(capsys, "--gpu-memory", "80GiB", "--json", "--dataset_path", str(tmp_path)))
    # the step's pixel values: 64 x 2,000 image tokens x 4 patches x 1,536 bf16 values (1.46 GiB) of 53.23
    assert (out["per_device_train_batch_size"], out["micro_batch_tokens"], out["predicted_peak_gib"], out["data"]) == (2, 8000, 53.23, str(tmp_path))


def test_a_dataset_that_is_not_prepared_is_refused(tmp_path):
    with pytest.raises(SystemExit, match=r"eogym-sft plan: --dataset_path .*train.jsonl: neither a prepared folder nor prepared at"):
        cli.main(["plan", "--gpu-memory", "80GB", "--model-config", ARCH, "--dataset_path", str(tmp_path / "train.jsonl"),
                  "--output_dir", str(tmp_path / "run")])


def test_other_commands_still_refuse_flags_they_do_not_know(capsys):
    with pytest.raises(SystemExit):
        cli.main(["make-task", "--output", "x", "--rows", "1", "--dataset_path", "y"])
    assert "unrecognized arguments: --dataset_path y" in capsys.readouterr().err


def plan_table() -> str:
    """docs/training.md's table: ``plan`` for the recipe on one GPU of each size, in the worst case."""
    rows = ["| GPU memory | micro-batches a step | samples a micro-batch | activation checkpointing | largest micro-batch | "
            "predicted peak, GiB allocated / reserved | evaluation batch |", "|---|---|---|---|---|---|---|"]
    line = None
    for size in ("24GB", "48GB", "80GB", "141GB"):
        out = plan_command.run_plan(plan_command.PlanConfig(gpu_memory=size, model_config=ARCH), [])
        every = out["checkpoint_every"]
        checkpointing = "off" if not every else "every layer" if every == 1 else f"every {mp.ordinal(every)} layer"
        checkpointing += " (does not fit: refused)" if out["refused"] else ""
        rows.append(f"| {size[:-2]} GB | {out['gradient_accumulation_steps']} | {out['per_device_train_batch_size']} | {checkpointing} | "
                    f"{out['micro_batch_tokens']:,} tokens | {out['predicted_peak_gib']:.1f} / {out['predicted_reserved_gib']:.1f} | "
                    f"{out['per_device_eval_batch_size']} |")
        line = out["line"] if size == "80GB" else line
    command = f"eogym-sft plan --gpu-memory 80GB --model-config {Path(ARCH).relative_to(REPO)}"
    return "\n".join([*rows, "", f"`{command}` prints:", "", f"    {line}"])


def test_the_docs_table_is_the_plans_output():
    text = (REPO / "docs" / "training.md").read_text()
    block = text.split("<!-- plan-table -->\n", 1)[1].split("\n<!-- /plan-table -->", 1)[0]
    assert block.strip() == plan_table(), "regenerate docs/training.md's plan table:\n" + plan_table()


def test_the_grpo_plan_sizes_the_kv_cache_for_generation_and_frees_it_for_a_loss_that_needs_it(capsys, monkeypatch):
    monkeypatch.setattr(mm, "CALIBRATION", CAL)
    grpo = str(REPO / "recipes" / "eo_gym_4b_grpo.yaml")
    out = json.loads(plan(capsys, "--config", grpo, "--gpu-memory", "80GiB", "--json"))
    # 8 episodes, the prompt once: 10,240 + 8 x 6,144 tokens, every layer recomputed -> 20.83 GiB beside the weights,
    # and their pixel values, every token an image's (0.68 GiB);
    # beside them too the merged LoRA copies (6.77 GiB); 16 episodes need 16 slots of 2.25 GiB, and the largest loss
    # micro-batch fits beside them
    assert out["recipe"] == "grpo" and out["micro_batch_tokens"] == 59392 and out["activation_checkpointing"] is True
    assert (out["slots"], out["kv_cache_gib"], out["episodes_per_generation"], out["prefill_tokens"]) == (16, 36.0, 16, 16384)
    assert (out["loss_gib"], out["merged_lora_gib"], out["predicted_peak_gib"], out["refused"]) == (21.51, 6.77, 72.54, None)
    assert out["loss_beside_cache"] is True
    # 48 GB: 11 slots beside a prefill of 16,384 tokens; the largest loss micro-batch frees them first
    smaller = json.loads(plan(capsys, "--config", grpo, "--gpu-memory", "48GB", "--json"))
    assert (smaller["slots"], smaller["loss_beside_cache"], smaller["predicted_peak_gib"]) == (11, False, 42.84)
    refused = plan(capsys, "--config", grpo, "--gpu-memory", "24GB")
    assert refused.startswith("refused at launch: a loss micro-batch of 59,392 tokens (21.5 GiB predicted) does not "
                              "fit even with the KV cache freed")
    fixed = json.loads(plan(capsys, "--config", grpo, "--gpu-memory", "80GiB", "--json", "--rollout_cache_gib", "20"))
    assert fixed["slots"] == 8  # 20 GiB // 2.25
