"""Micro-batches built to a token budget, with the published number of samples per optimizer step.

A fixed count of samples per micro-batch makes its token count (and so its activation memory and
step time) vary with the samples drawn: four samples of the bench's EO-Gym-shaped data reach 27k
tokens. Here each optimizer step draws its ``batch x grad_accum x ranks`` samples as usual, then deals
them into the step's micro-batches longest first, each to the cheapest so far. Every micro-batch then carries about
the step's mean token count, whatever the mix, and every rank about the same work. The step's
samples and its token-mean loss are unchanged: only their grouping into micro-batches differs.
"""

from __future__ import annotations

import heapq

from transformers.trainer_pt_utils import BatchRebalanceSampler

# Attention's per-token cost grows with the sample's length; by FLOP count at Qwen3-VL-4B's shape an
# 8k-token sample's attention is about 0.4x its matmuls, which is 5e-5 per token of length.
ATTENTION_COST_PER_TOKEN = 5e-5


def sample_cost(n_tokens: int) -> float:
    return n_tokens + ATTENTION_COST_PER_TOKEN * n_tokens * n_tokens


def deal_by_cost(indices: list[int], lengths: list[int], n_groups: int) -> list[list[int]]:
    """``n_groups`` groups of ``indices``, costliest first; longest samples first, each to the cheapest group."""
    heap = [(0.0, g, []) for g in range(n_groups)]
    for index, length in sorted(zip(indices, lengths), key=lambda pair: -pair[1]):
        cost, g, members = heapq.heappop(heap)
        members.append(index)
        heapq.heappush(heap, (cost + sample_cost(length), g, members))
    return [members for _, _, members in sorted(heap, key=lambda item: (-item[0], item[1]))]


class TokenBalancedSampler(BatchRebalanceSampler):
    """transformers' ``batch_rebalance`` sampler with packed-sequence costs and a greedy deal.

    The Trainer passes it to the DataLoader as a ``batch_sampler`` and leaves its rank split alone.
    transformers' own version prices a micro-batch as padded (``size x longest``) and splits the
    sorted samples into contiguous runs, which leaves its largest packed micro-batch further above the mean
    than dealing does (tests/training/test_sampler.py checks the order of the two; docs/benchmarks.md).

    >>> sampler = TokenBalancedSampler([8000, 500, 500, 3000, 4000, 2000, 1000, 1000], 8, 1, 2, shuffle=False)
    >>> [sorted(batch) for batch in sampler]
    [[1, 2, 3, 4, 5, 6], [0, 7]]
    """

    def _assign(self, indices, lengths):
        groups = deal_by_cost(indices, lengths, self.dp_size * self.grad_accum)
        # Costliest groups go to slot 0, one per rank, and so on: every slot costs the same on every rank.
        return [
            [groups[slot * self.dp_size + rank] for slot in range(self.grad_accum)] for rank in range(self.dp_size)
        ]


def accumulation_steps(samples_per_step: int, per_device: int, world_size: int) -> int:
    """Micro-batches per optimizer step on each rank, so that a step is ``samples_per_step`` samples on
    any number of GPUs and nodes; a split that does not divide is refused, naming what would.

    >>> [accumulation_steps(64, 2, n) for n in (1, 2, 8, 16)]
    [32, 16, 4, 2]
    """
    per_round = per_device * world_size
    if samples_per_step % per_round:
        raise ValueError(
            f"{samples_per_step} samples a step do not split over {world_size} ranks x {per_device} samples a "
            f"micro-batch ({per_round} a round): pick per_device_train_batch_size so that {samples_per_step} / "
            f"({world_size} x it) is whole"
        )
    return samples_per_step // per_round
