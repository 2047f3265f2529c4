"""Picking each next token of the slot decoder's rows: greedy or temperature / top-k / top-p sampling
(:class:`Sampling`), drawn faster than ``torch.multinomial`` (:func:`draw`), never a vision special token
(:func:`vision_token_ids`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Qwen3-VL's vision special tokens. A sampled one would stand for image features that do not exist:
# the next prefill (or TRL's training forward) then fails on a mismatch between image tokens and images.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")


def vision_token_ids(tokenizer) -> list[int]:
    """Ids of :data:`VISION_TOKENS` in ``tokenizer`` (those it has): tokens a policy must never write."""
    ids = (tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS)
    return [i for i in ids if i is not None and i != tokenizer.unk_token_id]


@dataclass
class Sampling:
    """Greedy (``temperature`` 0) or temperature / top-k / top-p sampling, with the stop tokens held
    back until a turn has ``min_new_tokens`` tokens (benchmarks force a fixed length that way)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_new_tokens: int = 0

    def pick(self, logits: torch.Tensor, generated: list[int], stop_ids: list[int], generator=None,
             banned_ids=()) -> list[int]:
        """One next token per row of ``logits`` ``(rows, vocab)``; ``generated`` = tokens each row's turn has so far.
        ``banned_ids`` are never picked (the vision special tokens, :func:`vision_token_ids`)."""
        if len(banned_ids):
            logits = logits.index_fill(-1, torch.tensor(list(banned_ids), device=logits.device), float("-inf"))
        early = [i for i, n in enumerate(generated) if n < self.min_new_tokens]
        if early:
            logits = logits.clone()
            logits[torch.tensor(early, device=logits.device)[:, None],
                   torch.tensor(stop_ids, device=logits.device)] = float("-inf")
        if self.temperature <= 0:
            return logits.argmax(-1).tolist()
        logits = logits / self.temperature
        if self.top_k > 0:
            kth = torch.topk(logits, min(self.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            probs = torch.softmax(logits, dim=-1)
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= self.top_p  # the top token always stays
            weights = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
        else:
            weights = (logits - logits.amax(-1, keepdim=True)).exp_()  # unnormalised: the draw below scales by the sum
        return draw(weights, generator)


def draw(weights: torch.Tensor, generator=None) -> list[int]:
    """One index per row of ``weights`` ``(rows, n)``, drawn with probability proportional to its weight
    (zero weights are never drawn): the inverse of the cumulative sum at a uniform draw. Exactly what
    ``torch.multinomial(weights, 1)`` samples, and on a CPU several times faster over Qwen3's vocabulary
    (docs/benchmarks.md): that draw is the largest cost of a CPU rollout's decode step."""
    cdf = weights.cumsum(-1)
    u = torch.rand(cdf.shape[0], 1, generator=generator, device=cdf.device, dtype=cdf.dtype)
    picks = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)  # right: a zero weight after its cdf step is skipped
    return picks[:, 0].clamp_max(cdf.shape[-1] - 1).tolist()
