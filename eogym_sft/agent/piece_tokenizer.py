"""Texts tokenised piece by piece, the pieces between added tokens encoded once while recently used
(:class:`PieceTokenizer`): an episode's next prompt is its last one and a turn."""

from __future__ import annotations

import re
from collections import OrderedDict


class PieceTokenizer:
    """``tokenizer(text, add_special_tokens=False)["input_ids"]``, the pieces of text between added tokens encoded
    once while they are among the ``size`` last used.

    A tokenizers-backed tokenizer cuts its input at its unnormalised added tokens before it normalises or
    pre-tokenises anything, and encodes each piece alone: a text's ids are its pieces' ids end to end. An
    episode's next prompt is its last one and a turn, so all its pieces but the turn's are encoded already (and
    the samples of one question share a whole first prompt). Where the tokenizer is not such a one, every text
    is encoded whole."""

    def __init__(self, tokenizer, size: int = 4096):
        self.tokenizer, self.size = tokenizer, size
        self.held: OrderedDict[str, list[int]] = OrderedDict()
        cuts = cut_tokens(tokenizer)
        self.added = {t: [tokenizer.convert_tokens_to_ids(t)] for t in cuts}
        self.split = (
            re.compile("(" + "|".join(re.escape(t) for t in sorted(cuts, key=len, reverse=True)) + ")").split
            if cuts
            else None
        )

    def __call__(self, text: str) -> list[int]:
        if self.split is None:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        pieces = [p for p in self.split(text) if p]
        ids = self._ids(dict.fromkeys(pieces))
        out = []
        for piece in pieces:
            out += ids[piece]
        return out

    def _ids(self, pieces) -> dict[str, list[int]]:
        """Each distinct piece's ids: an added token's own, a held piece's (now the most recently used), and
        the others encoded in one call, then held."""
        out = {p: self.added[p] for p in pieces if p in self.added}
        for p in pieces:
            if p in self.held:
                self.held.move_to_end(p)
                out[p] = self.held[p]
        new = [p for p in pieces if p not in out]
        if new:
            out.update(zip(new, self.tokenizer(new, add_special_tokens=False)["input_ids"]))
            self.held.update((p, out[p]) for p in new)
            while len(self.held) > self.size:
                self.held.popitem(last=False)
        return out


def cut_tokens(tokenizer) -> list[str]:
    """The added tokens a :class:`PieceTokenizer` may cut texts at: matched before normalisation, taking no
    whitespace around them, and overlapped by no other added token (the tokenizer's leftmost match could take
    that one instead). None for a tokenizer without a ``tokenizers`` backend, or one told to split special tokens."""
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if not added or not getattr(tokenizer, "is_fast", False) or getattr(tokenizer, "split_special_tokens", True):
        return []
    contents = [t.content for t in added.values()]
    plain = [t.content for t in added.values() if not (t.normalized or t.lstrip or t.rstrip or t.single_word)]
    return [c for c in plain if c and not any(o != c and _may_take(o, c) for o in contents)]


def _may_take(other: str, token: str) -> bool:
    """Whether a match of ``other`` could cover part of an occurrence of ``token``: it holds ``token``, or it ends
    with ``token``'s beginning (starting earlier, it would be matched first)."""
    return token in other or any(other.endswith(token[:k]) for k in range(1, len(token)))
