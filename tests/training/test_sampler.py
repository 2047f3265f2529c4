"""``TokenBalancedSampler``: each optimizer step trains the samples transformers' sampler would draw,
dealt into micro-batches of near-equal token cost, split evenly across ranks."""

from __future__ import annotations

import random

import pytest
import torch
from transformers.trainer_pt_utils import BatchRebalanceSampler

from eogym_sft.training.sampler import TokenBalancedSampler, deal_by_cost, sample_cost


def eo_gym_lengths(n: int = 640, seed: int = 0) -> list[int]:
    """Lengths shaped like EO-Gym samples: ~3.4k tokens on average, at most 8,192."""
    rng = random.Random(seed)
    return [min(8192, max(600, int(rng.lognormvariate(8.0, 0.55)))) for _ in range(n)]


def test_deal_by_cost_exact_groups():
    # 8,000 tokens cost 11,200 with attention, so the three shorter samples share the other group
    # (cost 11,700, listed first as the costlier)
    assert deal_by_cost([0, 1, 2, 3], [8000, 4000, 3000, 3000], 2) == [[1, 2, 3], [0]]
    assert deal_by_cost([5, 6, 7, 8], [1000, 1000, 1000, 1000], 2) == [[5, 7], [6, 8]]
    assert sample_cost(8192) == pytest.approx(8192 + 5e-5 * 8192**2)


@pytest.mark.parametrize("dp_size", [1, 2])
def test_each_step_trains_the_samples_transformers_draws(dp_size):
    lengths = eo_gym_lengths()
    batch, grad_accum = 4, 8
    step = batch * grad_accum * dp_size
    ours = [list(TokenBalancedSampler(lengths, step, dp_size, grad_accum, seed=7, rank=r)) for r in range(dp_size)]
    theirs = [list(BatchRebalanceSampler(lengths, step, dp_size, grad_accum, seed=7, rank=r)) for r in range(dp_size)]
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(7)).tolist()
    for k in range(len(lengths) // step):
        slots = slice(k * grad_accum, (k + 1) * grad_accum)
        drawn = sorted(i for rank in ours for micro in rank[slots] for i in micro)
        assert drawn == sorted(order[k * step : (k + 1) * step])  # every sample once, none from another step
        assert drawn == sorted(i for rank in theirs for micro in rank[slots] for i in micro)


def test_micro_batches_carry_near_equal_tokens():
    lengths = eo_gym_lengths()
    sampler = TokenBalancedSampler(lengths, 64, 1, 16, seed=42)
    tokens = [sum(lengths[i] for i in micro) for micro in sampler]
    mean = sum(tokens) / len(tokens)
    assert max(tokens) < 1.25 * mean and min(tokens) > 0.75 * mean
    # transformers' padded-cost split of the same samples leaves the largest micro-batch far heavier
    padded = [sum(lengths[i] for i in micro) for micro in BatchRebalanceSampler(lengths, 64, 1, 16, seed=42)]
    assert max(padded) > max(tokens)


def test_ranks_get_the_same_work_slot_by_slot():
    lengths = eo_gym_lengths()
    per_rank = [list(TokenBalancedSampler(lengths, 64, 2, 8, seed=1, rank=r)) for r in range(2)]
    for a, b in zip(*per_rank):
        cost_a, cost_b = (sum(sample_cost(lengths[i]) for i in micro) for micro in (a, b))
        assert abs(cost_a - cost_b) < 0.2 * max(cost_a, cost_b)


def test_64_samples_a_step_on_any_world_size():
    from eogym_sft.training.sampler import accumulation_steps

    # (per-device micro-batch, GPUs) as docs/training.md lists them: 1 GPU, 8 GPUs, 2 nodes x 8, 80 GB GPUs
    cases = {(2, 1): 32, (2, 2): 16, (2, 8): 4, (2, 16): 2, (1, 1): 64, (1, 8): 8, (1, 16): 4, (4, 16): 1}
    for (per_device, world), accum in cases.items():
        assert accumulation_steps(64, per_device, world) == accum
        assert per_device * world * accum == 64
    with pytest.raises(ValueError, match=r"64 samples a step do not split over 3 ranks x 2 samples"):
        accumulation_steps(64, 2, 3)
    with pytest.raises(ValueError, match="over 64 ranks x 2"):
        accumulation_steps(64, 2, 64)
