"""Picking next tokens: sampling rules, the draw, the banned vision tokens (eogym_sft/agent/sampling.py)."""

from __future__ import annotations

import torch

from eogym_sft.agent.sampling import Sampling, draw, vision_token_ids
from eogym_sft.models.tiny import IMAGE_TOKEN_ID


def test_sampling_rules():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0], [3.0, 0.0, 0.0, 0.0]])
    assert Sampling().pick(logits, [5, 5], stop_ids=[1]) == [1, 0]
    assert Sampling(min_new_tokens=2).pick(logits, [0, 5], stop_ids=[1]) == [3, 0]  # the stop token held back
    generator = torch.Generator().manual_seed(0)
    picks = {tuple(Sampling(temperature=1.0, top_k=2).pick(logits, [5, 5], [1], generator)) for _ in range(50)}
    assert {p[0] for p in picks} == {1, 3}  # only the two best
    picks = {tuple(Sampling(temperature=1.0, top_p=0.5).pick(logits, [5, 5], [1], generator)) for _ in range(20)}
    assert picks == {(1, 0)}  # the top token alone holds more than half the mass
    assert Sampling().pick(logits, [5, 5], stop_ids=[1], banned_ids=[1, 0]) == [3, 2]  # never a banned token
    picks = {tuple(Sampling(temperature=1.0).pick(logits, [5, 5], [1], generator, banned_ids=[1])) for _ in range(50)}
    assert all(p[0] != 1 and p[1] != 1 for p in picks)


def test_draw_samples_in_proportion_to_the_weights_and_never_a_zero_weight():
    weights = torch.tensor([[0.0, 1.0, 0.0, 3.0, 0.0]]).repeat(40000, 1)  # zero weights first, between and last
    picks = torch.tensor(draw(weights, torch.Generator().manual_seed(0)))
    counts = torch.bincount(picks, minlength=5).tolist()
    assert counts[0] == counts[2] == counts[4] == 0
    assert abs(counts[1] / 40000 - 0.25) < 0.01 and abs(counts[3] / 40000 - 0.75) < 0.01
    assert draw(torch.tensor([[0.0, 0.0, 2.0]]), torch.Generator().manual_seed(1)) == [2]


def test_vision_token_ids_are_the_qwen3_vl_vision_specials(processor):
    tokenizer = processor.tokenizer
    ids = vision_token_ids(tokenizer)
    assert tokenizer.convert_ids_to_tokens(ids) == ["<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
    assert IMAGE_TOKEN_ID in ids
