"""``validate`` on the training fast path: packed batches through the variable-length attention give
the padded SDPA path's numbers; arms by ``--adapter NAME=DIR`` and ``--no-base`` as in evaluate."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import chat_example, lean_towards_im_end, sharpen
from PIL import Image

from eogym_sft.evaluation.run_args import ValidateConfig
from eogym_sft.evaluation.validate import dataloader_workers, sample_spans, score_dataset
from eogym_sft.data.collator import EOGymCollator

PIXELS = {"min_pixels": 1024, "max_pixels": 4096}


@pytest.fixture(scope="module")
def arms_dir(tmp_path_factory, processor):
    """A sharpened tiny Qwen3-VL folder and one LoRA adapter with random (non-zero) weights on it."""
    from peft import LoraConfig, get_peft_model

    from eogym_sft.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("validate_models")
    sharpen(build_tiny_model(seed=3), seed=3).save_pretrained(root / "base")
    processor.save_pretrained(root / "base")
    model = sharpen(build_tiny_model(seed=3), seed=3)
    torch.manual_seed(1)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(model, lora).save_pretrained(root / "lora")
    return root


@pytest.fixture(scope="module")
def processor_at_cap(capped_processor):
    """The offline processor carrying this module's pixel cap, which the collator resizes with."""
    return capped_processor(**PIXELS)


def _examples():
    red, blue = Image.new("RGB", (64, 32), "red"), Image.new("RGB", (48, 48), "blue")
    return [
        chat_example("How many ships?", "I see boats.\nFinal Answer: 3", [red], EO_task="Counting", question_type="count"),
        chat_example("Is it flooded?", "Final Answer: yes", (), EO_task="Change"),
        chat_example("Which land cover?", '<tool_call>\n{"name": "crop", "arguments": {}}\n</tool_call>', [blue, red], EO_task="Counting"),
        chat_example("Which land cover dominates the scene?", "Forest.\nFinal Answer: forest", (), EO_task="Counting", question_type="classify"),
        chat_example("Any roads?", "Final Answer: no", [blue], EO_task="Change", question_type="count"),
    ]


def test_packed_varlen_scores_equal_the_padded_sdpa_path(arms_dir, processor_at_cap):
    from eogym_sft.models.loading import load_base_model

    sdpa = lean_towards_im_end(load_base_model(str(arms_dir / "base"), "float32", "sdpa")).eval()
    varlen = lean_towards_im_end(load_base_model(str(arms_dir / "base"), "float32", "eogym_varlen")).eval()
    examples = _examples()
    want = score_dataset(sdpa, EOGymCollator(processor_at_cap), examples, batch_size=2, progress=False)
    got = score_dataset(varlen, EOGymCollator(processor_at_cap, padding_free=True), examples, batch_size=3, progress=False)
    assert list(got) == list(want)
    assert {"token_class/tool_call", "token_class/final_answer", "EO_task/Change", "question_type/unknown"} <= set(want)
    assert 0 < want["overall"]["token_accuracy"] < 1
    for group, w in want.items():
        assert (got[group]["tokens"], got[group]["token_accuracy"]) == (w["tokens"], w["token_accuracy"]), group
        assert got[group]["loss"] == pytest.approx(w["loss"], rel=1e-5), group
    # a sample whose image fails leaves its packed batch, named, and the figures as they were
    broken = chat_example("Ships?", "Final Answer: 2", ["gone/scene.png"], sample_id="gone-1#w0", EO_task="Counting")
    skipped = []
    collator = EOGymCollator(processor_at_cap, padding_free=True, skip_bad_images=True)
    again = score_dataset(varlen, collator, [broken, *examples], batch_size=3, progress=False, skipped=skipped)
    assert [(r["sample_id"], r["reason"]) for r in skipped] == [("gone-1#w0", "missing_image")]
    assert {g: (v["tokens"], v["token_accuracy"]) for g, v in again.items()} == {g: (v["tokens"], v["token_accuracy"]) for g, v in got.items()}


def test_sample_spans_of_a_packed_batch(processor_at_cap):
    examples = _examples()[:3]
    packed = EOGymCollator(processor_at_cap, padding_free=True)(examples)
    lengths = [EOGymCollator(processor_at_cap)([ex])["input_ids"].shape[1] for ex in examples]
    starts = [0, lengths[0], lengths[0] + lengths[1]]
    assert sample_spans(packed, 3, packed=True) == [[(s, s + n) for s, n in zip(starts, lengths)]]
    with pytest.raises(ValueError, match="shows 3 position restarts"):
        sample_spans(packed, 2, packed=True)


def test_validate_arms_by_flags_on_either_path(arms_dir, data_root, row_factory, tmp_path, capsys):
    from eogym_sft.cli import main

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row_factory(row_id=f"r{i}")) + "\n" for i in range(3)))
    common = ["--model", str(arms_dir / "base"), "--data", str(data), "--data-root", str(data_root), "--batch-size", "2"]
    main(["validate", *common, "--adapter", f"one={arms_dir / 'lora'}", "--output", str(tmp_path / "fast.json")])
    fast = json.loads((tmp_path / "fast.json").read_text())
    assert list(fast["models"]) == ["base", "one"] and fast["adapters"] == {"one": str(arms_dir / "lora")}
    assert fast["attn_implementation"] == "eogym_varlen" and fast["samples"] == 3
    assert (fast["compiled_layers"], fast["dataloader_workers"]) == (False, dataloader_workers(8))  # CPU's defaults
    base, one = fast["models"]["base"]["overall"], fast["models"]["one"]["overall"]
    assert base["tokens"] == one["tokens"] > 0 and base["loss"] != one["loss"]  # the adapter is switched in
    # every token of both arms' forwards, context included (more than the supervised ones)
    assert fast["timing"]["tokens"] > 2 * one["tokens"] and fast["timing"]["tokens_per_s"] > 0
    main(["validate", *common, "--adapter", f"one={arms_dir / 'lora'}", "--no-base", "--attn-implementation", "sdpa",
          "--dataloader-workers", "0", "--no-compile-layers", "--output", str(tmp_path / "padded.json")])
    padded = json.loads((tmp_path / "padded.json").read_text())
    assert list(padded["models"]) == ["one"] and (padded["compiled_layers"], padded["dataloader_workers"]) == (False, 0)
    for group, w in padded["models"]["one"].items():
        got = fast["models"]["one"][group]
        assert (got["tokens"], got["token_accuracy"]) == (w["tokens"], w["token_accuracy"]), group
        assert got["loss"] == pytest.approx(w["loss"], rel=1e-5), group
    assert "token accuracy (one)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="nothing to score"):
        main(["validate", *common, "--no-base", "--output", str(tmp_path / "none.json")])
    with pytest.raises(SystemExit) as stop:  # refused as the flag is parsed (eogym_sft.config.number)
        main(["validate", *common, "--dataloader-workers", "-1", "--output", str(tmp_path / "none.json")])
    assert stop.value.code == 2 and "argument --dataloader-workers: must be at least 0, got -1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="dataloader_workers must be 0 or more"):
        ValidateConfig(model="m", data="d", output="o", dataloader_workers=-1)


def test_dataloader_workers_leave_a_cpu_to_the_model(monkeypatch):
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert [dataloader_workers(n) for n in (0, 2, 3, 8)] == [0, 2, 3, 3]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert dataloader_workers(8) == 0


# ---- the fast path's levers: each gives exactly the numbers of the path without it ----------------------------


@pytest.fixture(scope="module")
def varlen_arms(arms_dir):
    """The base with its LoRA adapter loaded as validate loads them (eval mode, the CPU varlen attention)."""
    from eogym_sft.models.loading import load_inference_model, parse_arms

    arms = parse_arms([f"one={arms_dir / 'lora'}"], str(arms_dir / "base"))
    return load_inference_model(str(arms_dir / "base"), arms, "cpu", torch.float32, attn_implementation="eogym_varlen"), arms


def test_supervised_positions_found_on_the_host_give_the_same_scores(varlen_arms, processor_at_cap):
    from eogym_sft.evaluation.validate import supervised_positions, supervised_scores

    model, _ = varlen_arms
    batch = EOGymCollator(processor_at_cap, padding_free=True)(_examples()[:3])
    where = supervised_positions(batch["labels"])
    assert torch.equal(where, (batch["labels"][:, 1:] != -100).nonzero()) and len(where) > 0
    on_device = supervised_scores(model, batch)
    on_host = supervised_scores(model, batch, where)
    for a, b in zip(on_device, on_host):
        assert torch.equal(a, b)


def test_dataloader_workers_give_the_numbers_of_the_main_process(varlen_arms, processor_at_cap):
    model, _ = varlen_arms
    broken = chat_example("Ships?", "Final Answer: 2", ["gone/scene.png"], sample_id="gone-1#w0", EO_task="Counting")
    examples = [*_examples(), broken]
    collator = EOGymCollator(processor_at_cap, padding_free=True, skip_bad_images=True)
    runs = {}
    for workers in (0, 2):
        skipped, stats = [], {}
        scores = score_dataset(model, collator, examples, batch_size=2, progress=False, skipped=skipped, stats=stats, workers=workers)
        runs[workers] = (scores, [r["sample_id"] for r in skipped], stats["tokens"])
    assert runs[2] == runs[0]  # exact: the same batches, scored and added up in the same order
    assert runs[0][1] == ["gone-1#w0"] and runs[0][2] > runs[0][0]["overall"]["tokens"] > 0


def test_arms_share_each_batch_and_score_as_one_arm_at_a_time(varlen_arms, processor_at_cap):
    from eogym_sft.evaluation.validate import score_arms
    from eogym_sft.models.loading import use_arm

    model, arms = varlen_arms
    collator = EOGymCollator(processor_at_cap, padding_free=True)
    examples = _examples()
    alone = {}
    for arm in arms:
        with use_arm(model, arm):
            alone[arm.name] = score_dataset(model, collator, examples, batch_size=2, progress=False)
    stats = {}
    together = score_arms(model, arms, collator, examples, batch_size=2, progress=False, stats=stats, workers=1)
    assert together == alone  # exact
    assert together["base"]["overall"]["loss"] != together["one"]["overall"]["loss"]  # the adapter was switched in
    one_pass = {}
    score_dataset(model, collator, examples, batch_size=2, progress=False, stats=one_pass)
    assert stats["tokens"] == 2 * one_pass["tokens"]  # every token counted once per arm


def test_compiled_layers_give_the_eager_numbers_on_every_arm(arms_dir, varlen_arms, processor_at_cap):
    """The decoder layers compiled as validate compiles them on CUDA (the recipe's regional compile), the
    arms switched batch by batch: the eager numbers exactly, one graph per arm for batches of any length.
    Dynamo traces the layers as on the GPU; the graphs then run as traced, without Inductor, whose fused
    kernels round float32 otherwise (and whose CPU compile would take a minute here)."""
    from eogym_sft.evaluation.validate import score_arms
    from eogym_sft.models.loading import compile_language_layers, load_inference_model

    eager, arms = varlen_arms
    collator = EOGymCollator(processor_at_cap, padding_free=True)
    examples = _examples()
    want = score_arms(eager, arms, collator, examples, batch_size=2, progress=False)
    graphs = []

    def as_traced(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    compiled = load_inference_model(str(arms_dir / "base"), arms, "cpu", torch.float32, attn_implementation="eogym_varlen")
    assert compile_language_layers(compiled, backend=as_traced) == 2
    got = score_arms(compiled, arms, collator, examples, batch_size=2, progress=False)
    assert got == want
    assert len(graphs) == len(arms)  # base (adapters off) and the adapter; 3 batches of other lengths each


def test_the_batch_is_the_most_samples_whose_largest_forward_fits(monkeypatch, capsys):
    """On a GPU (its free memory faked): the most of 32, 16, ... samples a forward whose largest batch fits; a
    --batch-size that does not fit is refused in one line."""
    from datasets import Dataset
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from eogym_sft.agent import rollout_config
    from eogym_sft.evaluation.validate import sized_batch
    from eogym_sft.models import memory as mm
    from eogym_sft.models.tiny import TINY_QWEN3_VL_CONFIG

    model = Qwen3VLForConditionalGeneration(Qwen3VLConfig.from_dict(TINY_QWEN3_VL_CONFIG))
    vocab = model.config.text_config.vocab_size
    monkeypatch.setattr(mm, "CALIBRATION", mm.Calibration(1000, 10, 1, 0, 1.0, 0))
    data = Dataset.from_dict({"n_tokens": [100] * 40, "n_trained_tokens": [1] * 40, "n_image_tokens": [0] * 40})
    per_sample = 100 * 1000 + vocab * 8  # a decoder layer's 1,000 bytes a token, the logits of 1 supervised position
    monkeypatch.setattr(rollout_config, "usable_bytes", lambda device: 10 * per_sample)
    assert sized_batch(model, data, None, "cuda") == 8  # 16 would need 16 samples' bytes
    assert capsys.readouterr().out.startswith("memory plan: 0.0 GiB free beside the model: 8 samples a forward")
    assert sized_batch(model, data, 2, "cuda") == 2
    with pytest.raises(ValueError, match=r"^--batch-size 16 does not fit: its largest batch is predicted to need 0.0 GiB of the "
                                         r"0.0 GiB free beside the model: lower --batch-size or --max-length$"):
        sized_batch(model, data, 16, "cuda")
    monkeypatch.setattr(rollout_config, "usable_bytes", lambda device: None)
    assert sized_batch(model, data, None, "cpu") == 8 and sized_batch(model, data, 3, "cpu") == 3
