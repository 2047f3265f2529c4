"""Token accuracy with one definition, and the token classes it is broken down by.

Token accuracy is ``argmax(logits[t]) == labels[t + 1]`` over positions whose next label is not
``-100``, as *counts*: sum correct and total over the whole evaluation set (and across ranks) before
dividing. TRL's logged ``mean_token_accuracy`` divides per step and then averages the steps, which
weights a short batch like a long one; these numbers are token-weighted.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100
TOKEN_CLASSES = ("tool_call", "free_text", "final_answer", "end_of_turn")


def correct_predictions(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Per target: whether ``argmax(logits)`` is that token (``False`` where it is ``ignore_index``).

    ``logits[..., i, :]`` scores ``targets[..., i]``: already shifted. The trainer's logged accuracy and
    ``validate`` both count with this function.
    """
    return correct_argmax(logits.argmax(-1), targets, ignore_index)


def correct_argmax(predicted: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """:func:`correct_predictions` from the logits' argmax ``predicted`` already taken (the SFT loss takes it)."""
    return (predicted == targets) & (targets != ignore_index)


def token_accuracy_counts(logits: torch.Tensor, labels: torch.Tensor,
                          ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``tensor([correct, total])`` for next-token prediction: ``logits[..., t, :]`` predicts ``labels[..., t +
    1]``."""
    targets = labels[..., 1:]
    correct = correct_predictions(logits[..., :-1, :], targets, ignore_index).sum()
    return torch.stack([correct, (targets != ignore_index).sum()]).to(torch.long)


def sum_across_ranks(counts: torch.Tensor) -> torch.Tensor:
    """All-reduce (sum) counts when running distributed; unchanged otherwise."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        counts = counts.clone()
        torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.SUM)
    return counts


def accuracy(counts: torch.Tensor) -> float:
    """``correct / total`` from summed counts (0.0 when nothing was scored)."""
    correct, total = (int(x) for x in counts.tolist()[:2])
    return correct / total if total else 0.0


def token_classes(input_ids: list[int], trained: list[bool], tokenizer) -> list[str | None]:
    """Class of every trained token (``None`` for context): ``tool_call`` (the JSON and its tags),
    ``final_answer`` (from ``Final Answer`` to the end of that line), ``end_of_turn`` (``<|im_end|>``)
    or ``free_text``."""
    open_id = tokenizer.convert_tokens_to_ids("<tool_call>")
    close_id = tokenizer.convert_tokens_to_ids("</tool_call>")
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    out: list[str | None] = [None] * len(input_ids)
    in_call = False
    for t, (tok, is_trained) in enumerate(zip(input_ids, trained)):
        if not is_trained:
            in_call = False
            continue
        if tok == end_id:
            out[t] = "end_of_turn"
        elif tok == open_id or in_call:
            in_call = tok != close_id
            out[t] = "tool_call"
        else:
            out[t] = "free_text"
    _mark_final_answers(input_ids, out, tokenizer)
    return out


def _mark_final_answers(input_ids: list[int], classes: list[str | None], tokenizer) -> None:
    """Relabel free-text tokens from ``Final Answer`` to the end of its line."""
    starts, text = [], ""
    positions = [t for t, c in enumerate(classes) if c == "free_text"]
    for k, t in enumerate(positions):
        if k and t != positions[k - 1] + 1:
            text += "\n"  # a gap (the end of a turn, a tool call) ends the line: it never runs on into the next turn
        starts.append(len(text))
        text += tokenizer.decode([input_ids[t]])
    at = text.find("Final Answer")
    while at != -1:
        stop = text.find("\n", at)
        stop = len(text) if stop == -1 else stop
        for t, start in zip(positions, starts):
            if start < stop and start + len(tokenizer.decode([input_ids[t]])) > at:
                classes[t] = "final_answer"
        at = text.find("Final Answer", stop)
