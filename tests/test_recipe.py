"""The real recipe (``recipes/eo_gym_4b.py``) on the tiny Qwen3-VL and a tiny EO-Gym JSONL, on CPU: a few
steps change every LoRA weight and nothing else, the adapter reloads with ``PeftModel`` and gives the
same logits, the run leaves ``eogym_run.json``, and ``--resume_from_checkpoint`` continues from the
last checkpoint."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import eogym_sft

REPO = Path(__file__).resolve().parents[1]
MIN_PIXELS, MAX_PIXELS = 1024, 4096  # 32..64 px images stay 1..4 visual tokens
TOOL = {
    "type": "function",
    "function": {
        "name": "crop",
        "description": "Crop an image by a normalized AOI.",
        "parameters": {"type": "object", "properties": {"image_url": {"type": "string"}, "aoi": {"type": "array"}}},
    },
}
N_ROWS = 6  # train_0000002_tiny is the one held-out trace (eval_fraction 0.3, seed 42); 5 train samples


def load_recipe():
    spec = importlib.util.spec_from_file_location("eo_gym_4b_recipe_under_test", REPO / "recipes" / "eo_gym_4b.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _save_image(root: Path, rel: str, width: int, height: int, seed: int) -> str:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
    return rel


def write_rows(root: Path) -> Path:
    """Six short EO-Gym rows (OpenAI dialect): three with a crop call whose result names an image."""
    rows = []
    for i in range(N_ROWS):
        scene = _save_image(root, f"EO_GYM_DATA/s{i}/scene.png", 32 + 16 * (i % 3), 32 + 8 * (i % 2), i)
        messages = [
            {"role": "system", "content": "Answer as: Final Answer: <answer>"},
            {"role": "user", "content": f"<image>How many ships are in scene {i}?"},
        ]
        if i % 2 == 0:
            crop = _save_image(root, f"image_cache/crops/c{i}.png", 48, 32, 100 + i)
            args = json.dumps({"image_url": scene, "aoi": [0, 0, 0.5, 0.5]})
            messages += [
                {
                    "role": "assistant",
                    "content": "I crop the port.",
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "crop", "arguments": args}}],
                },
                {"role": "tool", "tool_call_id": "c", "content": json.dumps({"cropped_path": crop})},
            ]
        messages.append({"role": "assistant", "content": f"I count {i} hulls.\nFinal Answer: {i}"})
        rows.append(
            {
                "id": f"train_{i:07d}_tiny",
                "images": [scene],
                "tools": [TOOL],
                "messages": messages,
                "EO_task": "Object Counting",
                "question_type": "count",
            }
        )
    path = root / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def recipe_args(model_dir: Path, data: Path, output: Path, prepared: Path, steps: int) -> list[str]:
    """The published recipe shrunk to a CPU run; everything not named here comes from eo_gym_4b.yaml."""
    return [
        "--model_name_or_path",
        str(model_dir),
        "--dtype",
        "float32",
        "--dataset_path",
        str(data),
        "--data_root",
        str(data.parent),
        "--output_dir",
        str(output),
        "--prepared_dir",
        str(prepared),
        "--min_pixels",
        str(MIN_PIXELS),
        "--max_pixels",
        str(MAX_PIXELS),
        "--eval_fraction",
        "0.3",
        "--max_steps",
        str(steps),
        "--per_device_train_batch_size",
        "2",
        "--per_device_eval_batch_size",
        "2",
        "--samples_per_step",
        "2",  # one micro-batch of 2 a step
        "--learning_rate",
        "1e-2",
        "--lr_scheduler_type",
        "constant",
        "--weight_decay",
        "0",  # every change to a weight then comes from its gradient
        "--eval_steps",
        "2",
        "--save_steps",
        "1",
        "--logging_steps",
        "1",
        "--use_cpu",
        "true",
        "--bf16",
        "false",
        "--optim",
        "adamw_torch",
        "--activation_checkpointing",
        "false",
        "--dataloader_num_workers",
        "0",
        "--dataloader_persistent_workers",
        "false",
        "--dataloader_pin_memory",
        "false",
        "--prep_num_proc",
        "1",
        "--compile_layers",
        "false",
    ]


def lora_only(params: dict) -> dict:
    return {n: p for n, p in params.items() if "lora_" in n}


def run_recipe(recipe, argv: list[str]):
    """``train(*parse_args(argv))``, as the recipe script runs, with a trainer that records what the checks need."""
    import eogym_sft.training.sft as sft

    made = []

    class RecordingTrainer(sft.EOGymSFTTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)
            self.initial = {n: p.detach().clone() for n, p in self.model.named_parameters()}
            self.first_step_lora = None
            self.steps_run = 0
            self.resumed_from = "train() not called"

        def train(self, resume_from_checkpoint=None, **kwargs):
            self.resumed_from = resume_from_checkpoint
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

        def training_step(self, model, inputs, num_items_in_batch=None):
            if self.first_step_lora is None:
                self.first_step_lora = {
                    n: p.detach().clone() for n, p in lora_only(dict(self.model.named_parameters())).items()
                }
            self.steps_run += 1
            return super().training_step(model, inputs, num_items_in_batch)

    original = sft.EOGymSFTTrainer
    sft.EOGymSFTTrainer = RecordingTrainer
    try:
        output = recipe.main(argv)
    finally:
        sft.EOGymSFTTrainer = original
    (trainer,) = made
    return output, trainer


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipe")
    return {"root": root, "data": write_rows(root / "data"), "prepared": root / "prepared"}


@pytest.fixture(scope="module")
def first_run(tiny_model_dir, workspace):
    recipe = load_recipe()
    out = workspace["root"] / "run"
    output, trainer = run_recipe(
        recipe, recipe_args(tiny_model_dir, workspace["data"], out, workspace["prepared"], steps=2)
    )
    assert output == str(out)
    return {"recipe": recipe, "out": out, "trainer": trainer}


def test_every_lora_weight_changes_and_nothing_else(first_run, tiny_model_dir):
    from safetensors.torch import load_file

    trainer = first_run["trainer"]
    assert trainer.state.global_step == 2 and trainer.steps_run == 2
    final = {n: p.detach() for n, p in trainer.model.named_parameters()}
    assert final.keys() == trainer.initial.keys()
    lora = lora_only(final)
    assert len(lora) == 2 * 7 * 2 and all(".language_model.layers." in n for n in lora)
    for name, after in lora.items():
        before = trainer.initial[name]
        assert (after != before).all(), f"{name}: {(after == before).sum().item()} of {after.numel()} values unchanged"
    # nothing else moved, and it still is the base model on disk
    base = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    checked = 0
    for name, after in final.items():
        if name in lora:
            continue
        assert torch.equal(after, trainer.initial[name]), name
        key = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        key = "model.language_model.embed_tokens.weight" if key == "lm_head.weight" else key  # tied
        assert torch.equal(after, base[key]), name
        checked += 1
    assert checked == len(base)


def test_saved_adapter_reloads_with_peft_and_gives_the_same_logits(first_run, tiny_model_dir, capped_processor):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from eogym_sft.data.prepared import load_prepared
    from eogym_sft.data.collator import EOGymCollator

    out = first_run["out"]
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (16, 32, 0.05)
    saved = load_file(str(out / "adapter_model.safetensors"))
    trained = {
        n.replace(".default.", "."): p
        for n, p in lora_only(dict(first_run["trainer"].model.named_parameters())).items()
    }
    assert saved.keys() == trained.keys()
    assert all(torch.equal(saved[n], trained[n].detach()) for n in saved)

    reloaded = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(tiny_model_dir), str(out)).eval()
    model = first_run["trainer"].model.eval()
    dataset, _ = load_prepared(out.parent / "prepared")
    examples = [dataset[0], dataset[1]]
    for padding_free in (False, True):
        collator = EOGymCollator(
            capped_processor(MAX_PIXELS, MIN_PIXELS), data_root=str(out.parent / "data"), padding_free=padding_free
        )
        batch = collator(examples)
        assert "pixel_values" in batch
        # padding positions are nobody's prediction (and differ between attention kernels): compare real tokens
        real = (
            batch["attention_mask"].bool()
            if "attention_mask" in batch
            else torch.ones_like(batch["input_ids"], dtype=torch.bool)
        )
        with torch.no_grad():
            want = model(**batch, use_cache=False).logits[real]
            got = reloaded(**batch, use_cache=False).logits[real]
        assert got.shape == (int(real.sum()), 151936)
        assert (got - want).abs().max().item() < 1e-5
    with torch.no_grad(), reloaded.disable_adapter():
        base = reloaded(**batch, use_cache=False).logits[real]
    assert (got - base).abs().max().item() > 1e-4  # the adapter is what makes them equal


def test_run_info_is_written_next_to_the_adapter(first_run, workspace, tiny_model_dir):
    out = first_run["out"]
    info = json.loads((out / "eogym_run.json").read_text())
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    assert info["git_sha"] in (head, head + "-dirty")  # the tests run from the project's checkout
    assert info["versions"]["eogym_sft"] == eogym_sft.__version__
    config = info["config"]
    assert config["script"]["max_pixels"] == MAX_PIXELS and config["script"]["dataset_path"] == str(workspace["data"])
    assert config["training"]["max_steps"] == 2 and config["training"]["num_train_epochs"] == 3  # from the YAML
    assert config["training"]["per_device_train_batch_size"] == 2 and config["training"]["seed"] == 42
    assert config["model"]["lora_r"] == 16 and config["model"]["model_name_or_path"] == str(tiny_model_dir)
    assert config["script"]["prepared_dir"] == str(workspace["prepared"])
    stats = json.loads((workspace["prepared"] / "stats.json").read_text())
    file_hash = hashlib.sha256(workspace["data"].read_bytes()).hexdigest()
    assert info["data"] == {
        "content_hash": stats["content_hash"],
        "inputs": {str(workspace["data"]): file_hash},
        "samples": N_ROWS,
        "rows_in": N_ROWS,
        "rows_dropped": 0,
    }
    import peft
    import transformers
    import trl

    assert info["versions"]["torch"] == torch.__version__.split("+")[0]
    assert info["versions"]["transformers"] == transformers.__version__
    assert info["versions"]["trl"] == trl.__version__ and info["versions"]["peft"] == peft.__version__
    assert info["processor"] == {
        "size": {"longest_edge": MAX_PIXELS, "shortest_edge": MIN_PIXELS},
        "patch_size": 16,
        "merge_size": 2,
    }
    # the processor saved beside the adapter carries the same pixel cap
    saved = json.loads((out / "processor_config.json").read_text())
    assert saved["image_processor"]["size"] == {"longest_edge": MAX_PIXELS, "shortest_edge": MIN_PIXELS}


def test_training_logs_token_accuracy_and_evaluates(first_run):
    history = json.loads((first_run["out"] / "checkpoint-2" / "trainer_state.json").read_text())["log_history"]
    train = [h for h in history if "loss" in h]
    evals = [h for h in history if "eval_loss" in h]
    assert [h["step"] for h in train] == [1, 2]
    assert all(0.0 <= h["token_accuracy"] <= 1.0 and h["loss"] > 0 for h in train)
    assert [h["step"] for h in evals] == [2]
    assert 0.0 <= evals[0]["eval_token_accuracy"] <= 1.0


def _adapter(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


def _same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_the_same_seed_gives_a_bit_identical_adapter(first_run, tiny_model_dir, workspace):
    torch.manual_seed(1234)  # whatever ran before: the run seeds itself before the LoRA weights are drawn
    out = workspace["root"] / "again"
    _, trainer = run_recipe(first_run["recipe"], recipe_args(tiny_model_dir, workspace["data"], out, workspace["prepared"], steps=2))
    initial = lora_only(trainer.initial)
    assert _same_tensors(initial, lora_only(first_run["trainer"].initial))
    assert any(t.abs().sum() > 0 for t in initial.values())  # LoRA A is random, so the seed is what made them equal
    assert _same_tensors(_adapter(out), _adapter(first_run["out"]))


def test_resume_from_a_checkpoint_ends_where_the_uninterrupted_run_ends(first_run, tiny_model_dir, workspace):
    out = workspace["root"] / "resumed"
    shutil.copytree(first_run["out"], out)
    for name in ("adapter_model.safetensors", "eogym_run.json"):
        (out / name).unlink()
    shutil.rmtree(out / "checkpoint-2")
    (out / "checkpoint-2").mkdir()  # killed while saving: no marker, nothing in it
    argv = recipe_args(tiny_model_dir, workspace["data"], out, workspace["prepared"], steps=2)
    _, trainer = run_recipe(first_run["recipe"], argv + ["--resume_from_checkpoint", "last"])

    assert trainer.resumed_from == str(out / "checkpoint-1")  # the newest complete one
    assert trainer.state.global_step == 2 and trainer.steps_run == 1
    first = {n.replace(".default.", "."): p for n, p in trainer.first_step_lora.items()}
    assert _same_tensors(first, _adapter(out / "checkpoint-1"))
    assert _same_tensors(_adapter(out), _adapter(first_run["out"]))
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    before = json.loads((out / "checkpoint-1" / "trainer_state.json").read_text())["log_history"]
    assert state["log_history"][: len(before)] == before  # step 1 comes from checkpoint-1
    assert [h["step"] for h in state["log_history"][len(before) :] if "loss" in h] == [2]


def test_resume_refuses_another_runs_checkpoint_saying_what_differs(first_run, tiny_model_dir, workspace):
    argv = recipe_args(tiny_model_dir, workspace["data"], first_run["out"], workspace["prepared"], steps=2)
    argv[argv.index("--learning_rate") + 1] = "2e-2"
    with pytest.raises(ValueError, match=r"checkpoint-2 belongs to another run.*\n  training.learning_rate: 0.01 -> 0.02$"):
        first_run["recipe"].main(argv + ["--resume_from_checkpoint", "last"])


def test_last_on_a_finished_run_is_a_no_op(first_run, tiny_model_dir, workspace, caplog):
    before = _adapter(first_run["out"])
    argv = recipe_args(tiny_model_dir, workspace["data"], first_run["out"], workspace["prepared"], steps=2)
    with caplog.at_level("WARNING", logger="eogym_sft.training.sft"):
        assert first_run["recipe"].main(argv + ["--resume_from_checkpoint", "last"]) == str(first_run["out"])
    assert "checkpoint-2: this run already finished (step 2); nothing to train" in caplog.text
    assert _same_tensors(_adapter(first_run["out"]), before)
    assert sorted(p.name for p in first_run["out"].glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]


def test_a_new_run_refuses_an_output_dir_with_an_earlier_run(first_run, tiny_model_dir, workspace):
    argv = recipe_args(tiny_model_dir, workspace["data"], first_run["out"], workspace["prepared"], steps=2)
    with pytest.raises(FileExistsError, match=r"holds an earlier run \(checkpoint-2, checkpoint-1, adapter_model.safetensors\)"):
        first_run["recipe"].main(argv)


def test_samples_per_step_is_resolved_from_the_world_size(first_run):
    from eogym_sft.training.sft import set_samples_per_step

    script, training, _ = first_run["recipe"].parse_args(["--use_cpu", "true", "--per_device_train_batch_size", "2"])
    assert (script.samples_per_step, training.per_device_train_batch_size, training.world_size) == (64, 2, 1)
    set_samples_per_step(script, training)
    assert training.gradient_accumulation_steps == 32
    info = json.loads((first_run["out"] / "eogym_run.json").read_text())
    assert info["config"]["training"]["gradient_accumulation_steps"] == 1 and info["config"]["script"]["samples_per_step"] == 2


@pytest.mark.slow(25)
def test_kill_9_after_a_checkpoint_then_resume_equals_the_uninterrupted_run(tiny_model_dir, tmp_path, capped_processor):
    """A real training process killed with SIGKILL once checkpoint-2 is complete, then resumed with
    ``last``, ends bit-identical to a run that was never interrupted. One training image is cut short
    after prep (the file changed on disk): both runs skip its sample, name it and count it alike."""
    import os
    import signal
    import sys
    import time

    from eogym_sft.data.datasets import load_or_prepare
    from eogym_sft.data.prepare import PrepConfig

    data = write_rows(tmp_path / "data")
    prepared = tmp_path / "prepared"
    processor = capped_processor(MAX_PIXELS, MIN_PIXELS)
    prep = PrepConfig(data_root=str(data.parent))
    load_or_prepare(str(data), str(tiny_model_dir), processor, prep, prepared)
    broken = data.parent / "EO_GYM_DATA/s0/scene.png"  # train_0000000_tiny's scene
    broken.write_bytes(broken.read_bytes()[:100])
    steps = 6

    def argv(out):
        return recipe_args(tiny_model_dir, data, out, prepared, steps=steps) + ["--eval_steps", "3"]

    recipe = load_recipe()
    whole = tmp_path / "whole"
    run_recipe(recipe, argv(whole))

    killed = tmp_path / "killed"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, str(REPO / "recipes" / "eo_gym_4b.py"), *argv(killed)], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while not (killed / "checkpoint-2" / "eogym_checkpoint.json").is_file():
        assert proc.poll() is None and time.monotonic() < deadline, "the training process ended before checkpoint-2"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "adapter_model.safetensors").exists()  # it did not finish
    _, trainer = run_recipe(recipe, argv(killed) + ["--resume_from_checkpoint", "last"])
    assert 2 <= int(Path(trainer.resumed_from).name.split("-")[1]) < steps

    assert _same_tensors(_adapter(killed), _adapter(whole))
    info_whole, info_killed = (json.loads((d / "eogym_run.json").read_text()) for d in (whole, killed))
    assert info_killed["skipped_samples"] == info_whole["skipped_samples"] and info_whole["skipped_samples"]["train"] >= 1
    listed = [json.loads(line) for line in (whole / "skipped_samples.jsonl").read_text().splitlines()]
    assert {(r["sample_id"], r["file"], r["reason"]) for r in listed} == {("train_0000000_tiny#w0", str(broken.resolve()), "corrupt_image")}
    assert len(listed) == info_whole["skipped_samples"]["train"]


################
# Runs that would do nothing useful refuse loudly (issue 28)
################


def test_a_prepared_folder_with_the_wrong_data_root_refuses_to_train(first_run, tiny_model_dir, workspace):
    argv = recipe_args(tiny_model_dir, workspace["prepared"], workspace["root"] / "wrong_root", workspace["prepared"], steps=2)
    at = argv.index("--data_root")
    argv[at + 1] = str(workspace["root"] / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"of the first \d+ samples are not under --data_root .*nowhere .*pass the --data_root"):
        first_run["recipe"].main(argv)
    assert not (workspace["root"] / "wrong_root" / "adapter_model.safetensors").exists()


def test_zero_usable_samples_refuse_to_train(tmp_path):
    from datasets import Dataset

    from eogym_sft.data.prepared import features
    from eogym_sft.training.sft import refuse_unusable_data

    empty = Dataset.from_dict({name: [] for name in features()}, features=features())
    with pytest.raises(ValueError, match="data/x: no usable samples"):
        refuse_unusable_data(empty, str(tmp_path), "data/x")


def test_explicit_accumulation_that_disagrees_with_samples_per_step_is_an_error(first_run):
    from eogym_sft.training.sft import set_samples_per_step

    recipe = first_run["recipe"]
    script, training, _ = recipe.parse_args(["--use_cpu", "true", "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "2"])
    with pytest.raises(ValueError, match="samples_per_step 64 and gradient_accumulation_steps 2 disagree: .* is 64 micro-batches"):
        set_samples_per_step(script, training)
    script, training, _ = recipe.parse_args(["--use_cpu", "true", "--gradient_accumulation_steps", "2", "--samples_per_step", "None"])
    set_samples_per_step(script, training)
    assert training.gradient_accumulation_steps == 2  # honoured: no samples_per_step to derive it from
    script, training, _ = recipe.parse_args(["--use_cpu", "true", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "32"])
    set_samples_per_step(script, training)
    assert training.gradient_accumulation_steps == 32  # agrees with 64 samples at 2 a micro-batch


def test_the_recipes_drop_checks_refuse_by_default_and_allow_drops_goes_on(tmp_path, tiny_model_dir, processor, capped_processor):
    """Through the recipe's own prep settings: 4 of 6 rows whose images are gone stop data prep (naming the
    recipe's flag), and ``--allow_drops true`` prepares the other 2; the same for images gone after prep."""
    from eogym_sft.data.datasets import load_or_prepare
    from eogym_sft.data.prepare import TooManyDropped
    from eogym_sft.training.sft import ALLOW_FLAG, prep_config, refuse_unusable_data

    data = write_rows(tmp_path / "data")
    for i in range(4):
        (data.parent / f"EO_GYM_DATA/s{i}/scene.png").unlink()
    recipe = load_recipe()
    processor = capped_processor(MAX_PIXELS, MIN_PIXELS)

    def settings(*extra):
        script, training, _ = recipe.parse_args(
            ["--use_cpu", "true", "--data_root", str(data.parent), "--min_pixels", str(MIN_PIXELS), "--max_pixels", str(MAX_PIXELS), *extra]
        )
        return script, prep_config(script, script.sample_config(training.max_length))

    script, prep = settings()
    assert script.allow_drops is False
    with pytest.raises(TooManyDropped, match=r"4 of 6 rows dropped as missing_image .*likely cause: .*Pass --allow_drops true to go on"):
        load_or_prepare(str(data), str(tiny_model_dir), processor, prep, tmp_path / "refused", 1, ALLOW_FLAG)
    assert not (tmp_path / "refused" / "stats.json").exists()

    script, prep = settings("--allow_drops", "true")
    dataset, stats = load_or_prepare(str(data), str(tiny_model_dir), processor, prep, tmp_path / "allowed", 1, ALLOW_FLAG)
    assert sorted(dataset["source_id"]) == ["train_0000004_tiny", "train_0000005_tiny"] and stats["rows_dropped"] == 4

    (data.parent / "EO_GYM_DATA/s4/scene.png").unlink()  # gone after prep: train_0000004_tiny's scene and crop,
    (data.parent / "image_cache/crops/c4.png").unlink()  # 2 of the 3 images of the prepared samples
    with pytest.raises(FileNotFoundError, match=r"2 of the 3 images of the first 2 samples are not under --data_root .*or --allow_drops true to go on"):
        refuse_unusable_data(dataset, str(data.parent), str(data))
    refuse_unusable_data(dataset, str(data.parent), str(data), 1.0)  # what allow_drops passes: goes on


def test_skipped_samples_are_counted_and_listed_exactly_and_an_overwrite_starts_a_new_list(tiny_model_dir, tmp_path, capped_processor):
    """Two train samples whose scene changed on disk after prep are skipped when their batch is loaded:
    ``eogym_run.json`` counts exactly 2 and ``skipped_samples.jsonl`` lists both; a rerun with
    ``--overwrite_output_dir true`` starts a new list instead of appending to the old one."""
    from eogym_sft.data.datasets import load_or_prepare
    from eogym_sft.data.prepare import PrepConfig

    data = write_rows(tmp_path / "data")
    prepared = tmp_path / "prepared"
    processor = capped_processor(MAX_PIXELS, MIN_PIXELS)
    load_or_prepare(str(data), str(tiny_model_dir), processor, PrepConfig(data_root=str(data.parent)), prepared)
    broken = [data.parent / f"EO_GYM_DATA/s{i}/scene.png" for i in (0, 1)]  # two of the five train traces
    for path in broken:
        path.write_bytes(path.read_bytes()[:100])
    out = tmp_path / "run"
    # one step of all 5 train samples, so that each is loaded exactly once
    argv = recipe_args(tiny_model_dir, prepared, out, prepared, steps=1) + [
        "--per_device_train_batch_size", "5", "--samples_per_step", "5", "--eval_steps", "10", "--save_strategy", "no",
        "--data_root", str(data.parent),
    ]
    recipe = load_recipe()
    expected = {(f"train_000000{i}_tiny#w0", str(path.resolve()), "corrupt_image") for i, path in zip((0, 1), broken)}

    def skipped():
        info = json.loads((out / "eogym_run.json").read_text())
        listed = [json.loads(line) for line in (out / "skipped_samples.jsonl").read_text().splitlines()]
        return info["skipped_samples"], [(r["sample_id"], r["file"], r["reason"]) for r in listed]

    run_recipe(recipe, argv)
    counts, listed = skipped()
    assert counts == {"train": 2, "eval": 0} and len(listed) == 2 and set(listed) == expected
    run_recipe(recipe, argv + ["--overwrite_output_dir", "true"])
    counts, listed = skipped()
    assert counts == {"train": 2, "eval": 0} and len(listed) == 2 and set(listed) == expected


@pytest.mark.parametrize("flags, message", [
    (["--num_train_epochs", "0"], "max_steps -1 and num_train_epochs 0.0 train nothing: set num_train_epochs > 0 (or max_steps > 0)"),
    (["--max_steps", "0"], "max_steps 0 and num_train_epochs 3 train nothing: set num_train_epochs > 0 (or max_steps > 0)"),
])
def test_a_run_that_would_train_nothing_is_refused_before_it_writes(tmp_path, flags, message):
    """It would save the untrained adapter as its result."""
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=f"^{message}$".replace("(", r"\(").replace(")", r"\)")):
        load_recipe().main(["--use_cpu", "true", "--output_dir", str(out), *flags])
    assert not out.exists()


def test_an_eval_fraction_that_holds_out_no_trace_is_refused_before_data_prep(tmp_path, tiny_model_dir):
    from eogym_sft.data.datasets import is_held_out

    data = write_rows(tmp_path / "data")
    ids = [f"train_{i:07d}_tiny" for i in range(N_ROWS)]
    assert not any(is_held_out(i, 0.02, 42) for i in ids)  # what the refusal is about
    argv = recipe_args(tiny_model_dir, data, tmp_path / "run", tmp_path / "prepared", steps=1)
    argv[argv.index("--eval_fraction") + 1] = "0.02"
    message = (f"eval_fraction=0.02 holds out 0 of the {N_ROWS} traces of {data} (seed 42): raise eval_fraction, or set it to 0 "
               "to train on every trace with no eval set")
    with pytest.raises(ValueError) as refused:
        load_recipe().main(argv)
    assert str(refused.value) == message
    assert not (tmp_path / "prepared").exists() and not (tmp_path / "run").exists()


def test_data_prep_workers_are_capped_at_the_cpus(monkeypatch):
    """8 workers on 2 cores made 44 rows take 4 min 20 s."""
    from eogym_sft.training import sft

    monkeypatch.setattr(sft.os, "sched_getaffinity", lambda pid: {0, 1})
    assert [sft.prep_processes(n) for n in (8, 2, 1, 0)] == [2, 2, 1, 1]
