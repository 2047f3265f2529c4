"""The memory model's arithmetic (exact, on round numbers), the plan's choice, and the micro-batches it plans
against: those TokenBalancedSampler deals, over every rank, step and epoch."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from eogym_sft.training import memory_plan as mp
from eogym_sft.training.sampler import TokenBalancedSampler

REPO = Path(__file__).resolve().parents[2]
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHAPE = mp.ModelShape(parameters=1000, layers=4, hidden=8, vocab=10, attention_width=16, lora_parameters=100, lora_inputs=20,
                      patches_per_token=4)
CAL = mp.Calibration(layer_bytes_per_token=100, checkpointed_layer_bytes_per_token=10, vision_bytes_per_patch=5, fixed_bytes=1000,
                     reserved_over_allocated=1.5, budget_margin_bytes=300, dropped_input_bytes_per_element=2, loss_bytes_per_logit=8)
BATCH = mp.MicroBatch(tokens=50, supervised=10, image_tokens=20)


def test_the_4b_architecture_and_its_lora_are_counted_as_transformers_builds_them():
    """The counts of transformers' Qwen3VLForConditionalGeneration built on the meta device from this config (4,437,815,808
    weights, 415,347,712 of them the vision tower's), and PEFT's r16 adapter on the 7 projections of 36 layers."""
    config = json.loads((REPO / "recipes/configs/qwen3_vl_4b_instruct.json").read_text())
    shape = mp.ModelShape.of(config, TARGETS, 16)
    assert shape.parameters == 4_437_815_808 and mp.vision_parameters(config["vision_config"]) == 415_347_712
    assert shape.lora_parameters == 33_030_144 and shape.lora_inputs == 5 * 2560 + 4096 + 9728
    assert (shape.layers, shape.vocab, shape.attention_width, shape.patches_per_token) == (36, 151936, 4096, 4)
    assert mp.ModelShape.of(config, ("q_proj", "v_proj"), 8).lora_parameters == 36 * 8 * ((2560 + 4096) + (2560 + 1024))
    with pytest.raises(ValueError, match=r"lora_target_modules \['qkv'\] are not language-model projections"):
        mp.ModelShape.of(config, ("q_proj", "qkv"), 16)


def test_the_tiny_architecture_is_counted_as_transformers_builds_it():
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from eogym_sft.models.tiny import TINY_QWEN3_VL_CONFIG

    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(Qwen3VLConfig.from_dict(TINY_QWEN3_VL_CONFIG))
    assert mp.ModelShape.of(TINY_QWEN3_VL_CONFIG, TARGETS, 16).parameters == sum(p.numel() for p in model.parameters())


def test_static_terms_split_lora_state_by_zero_stage():
    one = mp.static_terms(SHAPE, mp.Setup(processes=1), CAL)
    assert one == {"frozen_weights": 2000, "lora_weights": 400, "lora_gradients": 400, "optimizer_state": 800, "fixed": 1000}
    zero1 = mp.static_terms(SHAPE, mp.Setup(processes=4, zero_stage=1), CAL)
    zero2 = mp.static_terms(SHAPE, mp.Setup(processes=4, zero_stage=2), CAL)
    assert (zero1["lora_gradients"], zero1["optimizer_state"]) == (400, 200)
    assert (zero2["lora_gradients"], zero2["optimizer_state"]) == (100, 200)
    assert mp.static_terms(SHAPE, mp.Setup(processes=4, zero_stage=0), CAL) == one  # DDP keeps everything on every GPU


def test_peak_terms_without_checkpointing():
    terms = mp.peak_terms(SHAPE, mp.Setup(processes=2, zero_stage=2), BATCH, CAL)
    # per token and layer 100 + 2 bytes x 20 dropped inputs; 4 layers; 50 tokens
    assert terms["decoder_activations"] == 50 * 4 * 140 == 28_000
    assert (terms["loss"], terms["vision_tower"], terms["attention_workspace"], terms["recomputed_layer"]) == (800, 400, 3200, 0)
    static = 2000 + 400 + 200 + 400 + 1000
    assert terms["allocated"] == static + 28_000 + 3200 and terms["reserved"] == 1.5 * terms["allocated"]
    undropped = mp.peak_terms(SHAPE, mp.Setup(lora_dropout=0.0), BATCH, CAL)
    assert undropped["decoder_activations"] == 50 * 4 * 100


def test_peak_terms_with_layers_recomputed():
    every2 = mp.peak_terms(SHAPE, mp.Setup(checkpoint_every=2), BATCH, CAL)
    assert mp.checkpointed_layers(4, 2) == 2 and mp.checkpointed_layers(36, 2) == 18 and mp.checkpointed_layers(5, 2) == 3
    assert every2["decoder_activations"] == 50 * (2 * 140 + 2 * 10) and every2["recomputed_layer"] == 50 * 140
    assert every2["allocated"] == 4600 + 15_000 + 7000 + 3200
    every1 = mp.peak_terms(SHAPE, mp.Setup(checkpoint_every=1), BATCH, CAL)
    assert every1["decoder_activations"] == 50 * 4 * 10 and every1["allocated"] == 4600 + 2000 + 10_200
    # the tower's phase is the peak when its patches outweigh the decoder's activations
    images = mp.peak_terms(SHAPE, mp.Setup(checkpoint_every=1), mp.MicroBatch(50, 10, 5000), CAL)
    assert images["allocated"] == 4600 + 5000 * 4 * 5


def per_b(b: int) -> list[mp.MicroBatch]:
    return [mp.MicroBatch(50 * b, 10 * b, 20 * b, b)]


def test_the_plan_takes_the_fewest_micro_batches_that_fit_and_checkpoints_only_when_one_sample_does_not():
    setup = mp.Setup()
    # reserved without checkpointing: (4600 + 31,200 b) x 1.5 -> b=2: 100,500, b=4: 194,100
    plan = mp.choose(SHAPE, setup, per_b, 150_000, 8, cal=CAL)
    assert (plan.per_device_train_batch_size, plan.gradient_accumulation_steps, plan.checkpoint_every, plan.fits) == (2, 4, 0, True)
    assert plan.micro_batch_tokens == 100 and not plan.activation_checkpointing
    # one sample without checkpointing 53,700, every 2nd layer 44,700, every layer 25,200 (two samples 43,500)
    plan = mp.choose(SHAPE, setup, per_b, 40_000, 8, cal=CAL)
    assert (plan.per_device_train_batch_size, plan.gradient_accumulation_steps, plan.checkpoint_every) == (1, 8, 1)
    assert plan.activation_checkpointing and plan.to_json()["activation_checkpointing"] is True
    nothing = mp.choose(SHAPE, setup, per_b, 1000, 8, cal=CAL)
    assert (nothing.fits, nothing.per_device_train_batch_size, nothing.checkpoint_every) == (False, 1, 1)  # the smallest peak


def test_given_settings_are_kept_even_when_they_do_not_fit():
    plan = mp.choose(SHAPE, mp.Setup(), per_b, 40_000, 8, batch_size=4, cal=CAL)
    assert (plan.per_device_train_batch_size, plan.checkpoint_every, plan.fits) == (4, 1, False)
    # every layer recomputed: 8 samples (400 tokens) 153,300 reserved, 4 samples 80,100
    plan = mp.choose(SHAPE, mp.Setup(), per_b, 150_000, 8, checkpoint_every=1, cal=CAL)
    assert (plan.per_device_train_batch_size, plan.checkpoint_every, plan.fits) == (4, 1, True)


def test_batch_sizes_divide_the_step_over_the_processes():
    assert mp.batch_sizes(64, 2) == [32, 16, 8, 4, 2, 1]
    assert mp.batch_sizes(48, 1) == [48, 24, 16, 12, 8, 6, 4, 3, 2, 1]
    with pytest.raises(ValueError, match="64 samples a step do not split over 3 processes"):
        mp.batch_sizes(64, 3)
    plan = mp.choose(SHAPE, mp.Setup(processes=4), per_b, 10**9, 64, cal=CAL)
    assert (plan.per_device_train_batch_size, plan.gradient_accumulation_steps) == (16, 1)


def test_the_planned_micro_batches_are_the_samplers_on_every_rank_step_and_epoch():
    rng = random.Random(0)
    n = 200
    lengths = [rng.randint(500, 8192) for _ in range(n)]
    supervised = [rng.randint(1, 900) for _ in range(n)]
    images = [rng.randint(0, length) for length in lengths]
    steps = mp.run_steps(n, 16, -1, 2.0)
    assert steps == 2 * 13  # 12 full steps and the tail of 8 samples, each epoch
    planned = mp.dealt_batches(lengths, supervised, images, 16, 8, steps, seed=42)
    dealt = set()
    for rank in range(2):  # 2 processes x 4 micro-batches a step
        sampler = TokenBalancedSampler(lengths, 16, 2, 4, seed=42, rank=rank, drop_last=False)
        for epoch in range(2):
            sampler.set_epoch(epoch)
            for group in sampler:
                dealt.add((sum(lengths[i] for i in group), sum(supervised[i] for i in group), sum(images[i] for i in group), len(group)))
    assert {(b.tokens, b.supervised, b.image_tokens, b.samples) for b in planned} == dealt
    assert len(mp.dealt_batches(lengths, supervised, images, 16, 8, 3, seed=42)) == 3 * 8  # the run's first 3 steps only


def test_max_steps_decides_the_steps_planned_for():
    assert mp.run_steps(200, 64, 5, 3.0) == 5
    assert mp.run_steps(256, 64, -1, 3.0) == 12 and mp.run_steps(200, 64, -1, 1.5) == 6
    assert mp.run_steps(200, 64, -1, 1.0, drop_last=True) == 3


def test_without_data_the_plan_is_for_max_length_samples():
    assert mp.worst_case_batches(2, 8192) == [mp.MicroBatch(16384, 8192, 16384, 2)]


def test_the_plan_line():
    plan = mp.choose(SHAPE, mp.Setup(), per_b, 40_000, 8, cal=CAL)
    line = mp.plan_line(plan, "NVIDIA H100 80GB HBM3", 79.5 * mp.GIB, 1)
    assert line == (
        "memory plan: NVIDIA H100 80GB HBM3, 79.5 GiB free, budget 0.0 GiB: 8 micro-batches a step on each of 1 process(es), "
        "1 sample(s) each (largest 50 tokens), activation checkpointing every layer, predicted peak 0.0 GiB allocated, "
        "0.0 GiB reserved"
    )
    assert mp.budget_bytes(79.5 * mp.GIB, CAL) == 79.5 * mp.GIB - 300 and mp.budget_bytes(100, CAL) == 0.0
