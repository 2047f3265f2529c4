"""Texts tokenised piece by piece equal the tokenizer's ids (eogym_sft/agent/piece_tokenizer.py); an episode's
prompts through it are in test_episodes.py."""

from __future__ import annotations

import pytest

from eogym_sft.agent.piece_tokenizer import PieceTokenizer, cut_tokens

FRAGMENTS = [
    " ", "  ", "\n", "\n\n", " \n", "\t", "a", "ab", "Ab", "e", "\u0301", "é", "금", "１２", "12", "3.5", "'s", "'S",
    '{"x": [1, 2]}', "<", "|>", "<|", "<|im", "_end|>", "<tool", "call>", "Final Answer:", "🛰️", "\r\n",
]


def _random_texts(tokenizer, rng, n: int) -> list[str]:
    """Texts of fragments and added tokens side by side: whitespace, a combining accent or half a marker next to a cut."""
    pieces = FRAGMENTS + [t.content for t in tokenizer.added_tokens_decoder.values()]
    return ["".join(rng.choice(pieces, int(rng.integers(0, 40)))) for _ in range(n)]


def test_piece_tokenizer_equals_the_tokenizer_on_texts_cut_anywhere(processor):
    import numpy as np

    tokenizer = processor.tokenizer
    assert len(cut_tokens(tokenizer)) == len(tokenizer.added_tokens_decoder)  # Qwen3's 26 added tokens: all cuts
    texts = _random_texts(tokenizer, np.random.default_rng(0), 400)
    texts += texts[::7]  # again, from held pieces
    for size in (4096, 1):  # a held piece dropped and encoded again
        pieces = PieceTokenizer(tokenizer, size)
        for text in texts:
            assert pieces(text) == tokenizer(text, add_special_tokens=False)["input_ids"], repr(text)
        assert len(pieces.held) <= size


@pytest.mark.parametrize(
    "token, options, cut, not_cut",
    [
        ("<|strip|>", {"lstrip": True, "rstrip": True, "normalized": False}, False, set()),  # "x  <|strip|>  y": x, <|strip|>, y
        ("<|norm|>", {"normalized": True}, False, set()),  # matched after normalisation
        ("ab<|", {"normalized": False}, True, {"<|im_end|>", "<|image_pad|>"}),  # "ab<|im_end|>": ab<|, im, _end, |>
        ("<|im_end|>z", {"normalized": False}, False, {"<|im_end|>"}),  # the longer match wins where both start
    ],
)
def test_piece_tokenizer_cuts_only_where_the_tokenizer_does(processor, token, options, cut, not_cut):
    """Added tokens that the tokenizer may not cut a text at are not cut at here either; the ids equal the tokenizer's."""
    import copy

    import numpy as np
    from tokenizers import AddedToken

    tokenizer = copy.deepcopy(processor.tokenizer)
    tokenizer.add_tokens([AddedToken(token, **options)])
    cuts = set(cut_tokens(tokenizer))
    assert (token in cuts) == cut and not not_cut & cuts and "<tool_call>" in cuts
    pieces = PieceTokenizer(tokenizer)
    for text in _random_texts(tokenizer, np.random.default_rng(1), 300) + [f"x  {token}  y ab<|im_end|>\n{token}\u0301 z"]:
        assert pieces(text) == tokenizer(text, add_special_tokens=False)["input_ids"], repr(text)


def test_piece_tokenizer_encodes_whole_texts_where_special_tokens_are_text(processor):
    import copy

    tokenizer = copy.deepcopy(processor.tokenizer)
    tokenizer.split_special_tokens = True
    assert cut_tokens(tokenizer) == [] and PieceTokenizer(tokenizer).split is None
    text = "<|im_start|>user\nhi<|im_end|>"
    assert PieceTokenizer(tokenizer)(text) == tokenizer(text, add_special_tokens=False)["input_ids"]
