"""The memory model's arithmetic, exact on round numbers, and the architecture counted as transformers builds it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eogym_sft.models import memory as mm

REPO = Path(__file__).resolve().parents[2]
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHAPE = mm.ModelShape(parameters=1000, layers=4, hidden=8, vocab=10, attention_width=16, lora_parameters=100, lora_inputs=20,
                      patches_per_token=4, patch_elements=3, targeted_weights=600)
CAL = mm.Calibration(layer_bytes_per_token=100, checkpointed_layer_bytes_per_token=10, vision_bytes_per_patch=5, fixed_bytes=1000,
                     reserved_over_allocated=1.5, budget_margin_bytes=300, dropped_input_bytes_per_element=2, loss_bytes_per_logit=8)
BATCH = mm.MicroBatch(tokens=50, supervised=10, image_tokens=20)


def test_the_4b_architecture_and_its_lora_are_counted_as_transformers_builds_them():
    """The counts of transformers' Qwen3VLForConditionalGeneration built on the meta device from this config (4,437,815,808
    weights, 415,347,712 of them the vision tower's), and PEFT's r16 adapter on the 7 projections of 36 layers."""
    config = json.loads((REPO / "recipes/configs/qwen3_vl_4b_instruct.json").read_text())
    shape = mm.ModelShape.of(config, TARGETS, 16)
    assert shape.parameters == 4_437_815_808 and mm.vision_parameters(config["vision_config"]) == 415_347_712
    assert shape.lora_parameters == 33_030_144 and shape.lora_inputs == 5 * 2560 + 4096 + 9728
    assert shape.targeted_weights * shape.weight_bytes / mm.GIB == pytest.approx(6.768, abs=1e-3)  # the slot decoder's merged copies
    assert (shape.layers, shape.vocab, shape.attention_width, shape.patches_per_token) == (36, 151936, 4096, 4)
    assert mm.ModelShape.of(config, ("q_proj", "v_proj"), 8).lora_parameters == 36 * 8 * ((2560 + 4096) + (2560 + 1024))
    with pytest.raises(ValueError, match=r"lora_target_modules \['qkv'\] are not language-model projections"):
        mm.ModelShape.of(config, ("q_proj", "qkv"), 16)


def test_the_tiny_architecture_is_counted_as_transformers_builds_it():
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from eogym_sft.models.tiny import TINY_QWEN3_VL_CONFIG

    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(Qwen3VLConfig.from_dict(TINY_QWEN3_VL_CONFIG))
    assert mm.ModelShape.of(TINY_QWEN3_VL_CONFIG, TARGETS, 16).parameters == sum(p.numel() for p in model.parameters())


def test_static_terms_split_lora_state_by_zero_stage():
    one = mm.static_terms(SHAPE, mm.Setup(processes=1), CAL)
    assert one == {"frozen_weights": 2000, "lora_weights": 400, "lora_gradients": 400, "optimizer_state": 800, "fixed": 1000}
    zero1 = mm.static_terms(SHAPE, mm.Setup(processes=4, zero_stage=1), CAL)
    zero2 = mm.static_terms(SHAPE, mm.Setup(processes=4, zero_stage=2), CAL)
    assert (zero1["lora_gradients"], zero1["optimizer_state"]) == (400, 200)
    assert (zero2["lora_gradients"], zero2["optimizer_state"]) == (100, 200)
    assert mm.static_terms(SHAPE, mm.Setup(processes=4, zero_stage=0), CAL) == one  # DDP keeps everything on every GPU


def test_peak_terms_without_checkpointing():
    terms = mm.peak_terms(SHAPE, mm.Setup(processes=2, zero_stage=2), BATCH, CAL)
    # per token and layer 100 + 2 bytes x 20 dropped inputs; 4 layers; 50 tokens
    assert terms["decoder_activations"] == 50 * 4 * 140 == 28_000
    assert (terms["loss"], terms["vision_tower"], terms["attention_workspace"], terms["recomputed_layer"]) == (800, 400, 3200, 0)
    static = 2000 + 400 + 200 + 400 + 1000
    # its own pixel values (no step given): 20 image tokens x 4 patches x 3 values x 2 bytes
    assert terms["step_inputs"] == 20 * 4 * 3 * 2 == 480
    assert terms["allocated"] == static + 480 + 28_000 + 3200 and terms["reserved"] == 1.5 * terms["allocated"]
    undropped = mm.peak_terms(SHAPE, mm.Setup(lora_dropout=0.0), BATCH, CAL)
    assert undropped["decoder_activations"] == 50 * 4 * 100


def test_peak_terms_with_layers_recomputed():
    every2 = mm.peak_terms(SHAPE, mm.Setup(checkpoint_every=2), BATCH, CAL)
    assert mm.checkpointed_layers(4, 2) == 2 and mm.checkpointed_layers(36, 2) == 18 and mm.checkpointed_layers(5, 2) == 3
    assert every2["decoder_activations"] == 50 * (2 * 140 + 2 * 10) and every2["recomputed_layer"] == 50 * 140
    assert every2["allocated"] == 4600 + 480 + 15_000 + 7000 + 3200
    every1 = mm.peak_terms(SHAPE, mm.Setup(checkpoint_every=1), BATCH, CAL)
    assert every1["decoder_activations"] == 50 * 4 * 10 and every1["allocated"] == 4600 + 480 + 2000 + 10_200
    # the tower's phase is the peak when its patches outweigh the decoder's activations
    images = mm.peak_terms(SHAPE, mm.Setup(checkpoint_every=1), mm.MicroBatch(50, 10, 5000), CAL)
    assert images["allocated"] == 4600 + 5000 * 4 * 3 * 2 + 5000 * 4 * 5


def test_the_pixel_values_of_the_whole_step_stay_on_the_gpu():
    step = mm.peak_terms(SHAPE, mm.Setup(), mm.MicroBatch(50, 10, 20, 1, step_image_tokens=300), CAL)
    assert step["step_inputs"] == 300 * 4 * 3 * 2 == 7200
    assert step["allocated"] == 4600 + 7200 + 28_000 + 3200
    assert mm.step_input_bytes(mm.ModelShape.of(json.loads((REPO / "recipes/configs/qwen3_vl_4b_instruct.json").read_text()), TARGETS, 16),
                               mm.MicroBatch(8192, 0, 5000)) == 5000 * 4 * (3 * 2 * 16 * 16) * 2  # bf16 patches of 3x2x16x16



def test_generation_reserves_the_merged_weights_a_prefill_and_the_margin():
    assert mm.generation_reserve(4, 50, 1200, CAL) == {"merged_weights": 1200, "prefill": 5000, "margin": 300}
    # a prefill of image tokens only: the tower's 4 patches a token x 5 bytes outweighs a layer's 1 byte a token
    assert mm.generation_reserve(4, 50, 0, mm.Calibration(1, 1, 5, 0, 1, 0))["prefill"] == 50 * 4 * 5


def test_a_forward_without_gradients_keeps_one_layer_and_the_supervised_logits():
    # 50 tokens x 100 + 10 supervised x 10 vocab x 8 against the tower's 20 x 4 x 5, and the margin
    assert mm.forward_bytes(BATCH, 10, 4, CAL) == 50 * 100 + 10 * 10 * 8 + 300
    assert mm.forward_bytes(mm.MicroBatch(1, 0, 1000), 10, 4, CAL) == 1000 * 4 * 5 + 300


def test_the_calibrated_architecture_keeps_its_constants_and_others_scale_by_width():
    import json
    from pathlib import Path

    from eogym_sft.models.memory import CALIBRATED_WIDTHS, CALIBRATION, calibration_for, widths_of
    from eogym_sft.models.tiny import DEMO_QWEN3_VL_CONFIG

    four_b = json.loads((Path(__file__).parents[2] / "recipes/configs/qwen3_vl_4b_instruct.json").read_text())
    assert widths_of(four_b) == CALIBRATED_WIDTHS
    assert calibration_for(CALIBRATED_WIDTHS) == CALIBRATION
    # the demo's model: 128 wide, intermediate 256, 4 heads and 2 KV heads of 32, a 16-wide vision tower, intermediate 32
    assert widths_of(DEMO_QWEN3_VL_CONFIG) == (7 * 128 + 2 * 128 + 2 * 64 + 3 * 256, 8 * 16 + 2 * 32, 128)
    demo = calibration_for(widths_of(DEMO_QWEN3_VL_CONFIG))
    assert demo.layer_bytes_per_token == CALIBRATION.layer_bytes_per_token * 2048 / 57_344
    assert demo.checkpointed_layer_bytes_per_token == CALIBRATION.checkpointed_layer_bytes_per_token * 128 / 2560
    assert demo.vision_bytes_per_patch == CALIBRATION.vision_bytes_per_patch * 192 / 16_384
    assert demo.budget_margin_bytes == CALIBRATION.budget_margin_bytes


def test_a_small_models_grpo_loss_is_not_planned_at_the_4b_size():
    # sixteen episodes of 16,384 tokens on the demo's model: sized by its widths, a few GiB, not the 4B's tens
    from eogym_sft.models.memory import GIB, MicroBatch, ModelShape, Setup, peak_terms
    from eogym_sft.models.tiny import DEMO_QWEN3_VL_CONFIG

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    shape = ModelShape.of(DEMO_QWEN3_VL_CONFIG, targets, 16)
    tokens = 16 * 16_384
    terms = peak_terms(shape, Setup(1, 0, 0.05, 0), MicroBatch(tokens, 0, tokens, 16))
    assert terms["decoder_activations"] < 3 * GIB
    assert terms["reserved"] < 8 * GIB
