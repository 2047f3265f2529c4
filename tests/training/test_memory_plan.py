"""The plan's choice of micro-batches and checkpointing, and the micro-batches it plans against: those
TokenBalancedSampler deals, over every rank, step and epoch."""

from __future__ import annotations

import random

import pytest

from eogym_sft.models import memory as mm
from eogym_sft.training import memory_plan as mp
from eogym_sft.training.sampler import TokenBalancedSampler

SHAPE = mm.ModelShape(parameters=1000, layers=4, hidden=8, vocab=10, attention_width=16, lora_parameters=100, lora_inputs=20,
                      patches_per_token=4, patch_elements=0)  # no pixel values: the plan's choices alone
CAL = mm.Calibration(layer_bytes_per_token=100, checkpointed_layer_bytes_per_token=10, vision_bytes_per_patch=5, fixed_bytes=1000,
                     reserved_over_allocated=1.5, budget_margin_bytes=300, dropped_input_bytes_per_element=2, loss_bytes_per_logit=8)


def per_b(b: int) -> list[mm.MicroBatch]:
    return [mm.MicroBatch(50 * b, 10 * b, 20 * b, b)]


def test_the_plan_takes_the_fewest_micro_batches_that_fit_and_checkpoints_only_when_one_sample_does_not():
    setup = mm.Setup()
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
    plan = mp.choose(SHAPE, mm.Setup(), per_b, 40_000, 8, batch_size=4, cal=CAL)
    assert (plan.per_device_train_batch_size, plan.checkpoint_every, plan.fits) == (4, 1, False)
    # every layer recomputed: 8 samples (400 tokens) 153,300 reserved, 4 samples 80,100
    plan = mp.choose(SHAPE, mm.Setup(), per_b, 150_000, 8, checkpoint_every=1, cal=CAL)
    assert (plan.per_device_train_batch_size, plan.checkpoint_every, plan.fits) == (4, 1, True)


def test_batch_sizes_divide_the_step_over_the_processes():
    assert mp.batch_sizes(64, 2) == [32, 16, 8, 4, 2, 1]
    assert mp.batch_sizes(48, 1) == [48, 24, 16, 12, 8, 6, 4, 3, 2, 1]
    with pytest.raises(ValueError, match="64 samples a step do not split over 3 processes"):
        mp.batch_sizes(64, 3)
    plan = mp.choose(SHAPE, mm.Setup(processes=4), per_b, 10**9, 64, cal=CAL)
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


def test_a_planned_micro_batch_carries_the_most_image_tokens_a_process_holds_in_its_step():
    rng = random.Random(1)
    lengths = [rng.randint(500, 8192) for _ in range(64)]
    images = [rng.randint(0, length) for length in lengths]
    sampler = TokenBalancedSampler(lengths, 16, 1, 8, seed=42)
    sampler.set_epoch(0)
    first = sorted((sum(images[i] for i in group) for group in list(sampler)[:8]), reverse=True)
    for processes, held in ((1, sum(first)), (2, sum(first[:4])), (3, sum(first[:3]))):
        planned = mp.dealt_batches(lengths, [0] * 64, images, 16, 8, 1, seed=42, processes=processes)
        assert len(planned) == 8 and {b.step_image_tokens for b in planned} == {held}


def test_max_steps_decides_the_steps_planned_for():
    assert mp.run_steps(200, 64, 5, 3.0) == 5
    assert mp.run_steps(256, 64, -1, 3.0) == 12 and mp.run_steps(200, 64, -1, 1.5) == 6
    assert mp.run_steps(200, 64, -1, 1.0, drop_last=True) == 3


def test_without_data_the_plan_is_for_max_length_samples():
    assert mp.worst_case_batches(2, 8192) == [mm.MicroBatch(16384, 8192, 16384, 2)]
    assert mp.worst_case_batches(2, 8192, 64) == [mm.MicroBatch(16384, 8192, 16384, 2, 64 * 8192)]


def test_the_plan_line():
    plan = mp.choose(SHAPE, mm.Setup(), per_b, 40_000, 8, cal=CAL)
    line = mp.plan_line(plan, "NVIDIA H100 80GB HBM3", 79.5 * mm.GIB, 1)
    assert line == (
        "memory plan: NVIDIA H100 80GB HBM3, 79.5 GiB free, budget 0.0 GiB: 8 micro-batches a step on each of 1 process(es), "
        "1 sample(s) each (largest 50 tokens), activation checkpointing every layer, predicted peak 0.0 GiB allocated, "
        "0.0 GiB reserved"
    )
    assert mm.budget_bytes(79.5 * mm.GIB, CAL) == 79.5 * mm.GIB - 300 and mm.budget_bytes(100, CAL) == 0.0



def test_the_evaluation_batch_is_the_most_samples_whose_forward_fits_beside_the_training_state():
    assert mp.eval_batches([10, 20, 30, 40, 50], [1, 2, 3, 4, 5], [0, 0, 0, 0, 9], 2) == [
        mm.MicroBatch(30, 3, 0, 2), mm.MicroBatch(70, 7, 0, 2), mm.MicroBatch(50, 5, 9, 1)]
    plan = mp.choose(SHAPE, mm.Setup(), per_b, 150_000, 8, cal=CAL)
    # beside the training state (4,600 - the margin 300): b x (50 x 100 + 10 x 10 x 8) + the margin, x 1.5 reserved
    for budget, chosen in ((150_000, 4), (40_000, 2), (20_000, 1)):
        plan = mp.choose_eval(plan, SHAPE, mm.Setup(), per_b, budget, cal=CAL)
        assert (plan.per_device_eval_batch_size, plan.fits) == (chosen, True), budget
    assert plan.predicted_eval_peak_gib == round((4300 + 5800 + 300) / mm.GIB, 2)
    refused = mp.choose_eval(plan, SHAPE, mm.Setup(), per_b, 40_000, batch_size=4, cal=CAL)
    assert (refused.per_device_eval_batch_size, refused.fits) == (4, False)  # given, kept, and it does not fit
