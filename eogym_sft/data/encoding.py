"""Render canonical conversations with the model's chat template and find the tokens to train on.

The text is always ``processor.apply_chat_template(messages, tools=tools)``, the exact string the model
sees at inference. Trained tokens are each assistant message's content, tool calls and closing
``<|im_end|>``; everything else (system, tools block, user, tool results, image placeholders, the
``<|im_start|>assistant\\n`` header, the newline after ``<|im_end|>``) is context.

Trained spans are found by rendering prefixes of the conversation: the text an assistant turn adds
after ``render(messages[:i], add_generation_prompt=True)`` up to ``render(messages[:i + 1])``. A
template for which these are not prefixes of the full text is refused rather than guessed at.

Token ids here carry one ``<|image_pad|>`` per image; the collator expands each to the image's token
count once the image is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

from .traces import TraceError


@dataclass
class Encoded:
    """A rendered conversation and the token layout that windowing and the collator need."""

    text: str
    input_ids: list[int]
    assistant_mask: list[int]
    assistant_starts: list[int]  # token index where each assistant message begins (its header)
    assistant_ends: list[int]  # token index just past each assistant message (after the "\n")
    assistant_message_index: list[int]  # index in ``messages`` of each assistant message


def render(processor, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool = False) -> str:
    """The chat template's text for ``messages``, with the ``# Tools`` block when there are tools."""
    return processor.apply_chat_template(
        messages, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def _tokenizer(processor):
    return getattr(processor, "tokenizer", processor)


def _char_to_token(starts: list[int], text_len: int, char: int, where: str) -> int:
    """Index of the token that starts exactly at ``char`` (len(tokens) for the end of the text)."""
    if char == text_len:
        return len(starts)
    lo, hi = 0, len(starts)
    while lo < hi:
        mid = (lo + hi) // 2
        if starts[mid] < char:
            lo = mid + 1
        else:
            hi = mid
    if lo == len(starts) or starts[lo] != char:
        raise TraceError("template_mismatch", where, f"no token boundary at character {char}")
    return lo


def encode_conversation(processor, messages: list[dict], tools: list[dict] | None) -> Encoded:
    """Render and tokenise ``messages``; mark the assistant tokens to train on.

    Raises :class:`TraceError` (``template_mismatch``) if the chat template does not render
    conversations prefix by prefix, or if a trained span does not fall on token boundaries.
    """
    text = render(processor, messages, tools)
    tok = _tokenizer(processor)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    starts = [s for s, _ in enc["offset_mapping"]]
    mask = [0] * len(enc["input_ids"])
    a_starts, a_ends, a_index = [], [], []
    prefixes = {len(messages): text}  # consecutive assistant turns share a prefix: render it once

    def prefix(k: int) -> str:
        if k not in prefixes:
            prefixes[k] = render(processor, messages[:k], tools) if k else ""
        return prefixes[k]

    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        where = f"messages[{i}]"
        before = prefix(i)
        header_end = render(processor, messages[:i], tools, add_generation_prompt=True)
        after = prefix(i + 1)
        if not (text.startswith(after) and after.startswith(header_end) and header_end.startswith(before)):
            raise TraceError("template_mismatch", where,
                             "the chat template does not render this conversation prefix by prefix")
        if not after.endswith("\n"):
            raise TraceError("template_mismatch", where, "an assistant turn does not end with '<|im_end|>\\n'")
        first = _char_to_token(starts, len(text), len(header_end), where)
        last = _char_to_token(starts, len(text), len(after) - 1, where)  # the closing "\n" stays context
        for t in range(first, last):
            mask[t] = 1
        a_starts.append(_char_to_token(starts, len(text), len(before), where))
        a_ends.append(_char_to_token(starts, len(text), len(after), where))
        a_index.append(i)
    return Encoded(text, list(enc["input_ids"]), mask, a_starts, a_ends, a_index)
