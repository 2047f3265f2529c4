"""GRPO's per-token log-probabilities on the SFT fast path: a micro-batch's episodes packed into one row.

TRL's loss forward pads every episode of a micro-batch to the longest (prompts on the left, completions on
the right) and runs the padded batch. :func:`packed_logps_and_entropies` takes the same tensors, drops the
padding (and the completions ``mask_truncated_completions`` masked out, with the images inside them), packs
the rest into one row whose position ids restart at 0 for each episode, as the SFT collator's
``padding_free`` mode does, and runs the model once on it. The text tower's variable-length attention
(``eogym_varlen*``, :mod:`eogym_sft.models.attention`) keeps the episodes apart by those position ids; under
SDPA transformers builds the block-diagonal mask from them (correct, but a dense mask). Log-probabilities are
computed by TRL's fused LM head (``fused_lm_head=True``, added by ``GRPOTrainer``) for the labelled tokens only,
on every device (:func:`labelled_rows_only`), so no vocabulary-wide logits of prompt tokens exist.

The result is laid out as TRL's padded path lays it out, ``(rows, logits_to_keep)`` with 0 where the
padded path's label is masked, so the rest of TRL's loss is unchanged; ``tests/training/test_packed_logps.py``
checks log-probabilities, entropies, the loss and its gradients against TRL's padded forward.

The loss forward scores only the tokens the loss counts (``completion_mask * tool_mask``): a tool result
and its crop's image tokens are context, never trained, and on a multi-turn episode they outnumber the
model's own tokens (a crop at the recipe's cap is up to 980 image tokens, a turn tens), so projecting them
through the vocabulary-wide head was most of the head's work.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..models.layout import grid_token_counts, mrope_position_ids

IGNORE = -100


@dataclass
class PackedRows:
    """A micro-batch packed into one row, and where each completion token's log-probability lands."""

    inputs: dict  # model inputs: input_ids, position_ids, labels, and the vision inputs of the kept images
    source: torch.Tensor  # packed positions (minus one: the fused head's output is shifted) of the scored tokens
    rows: torch.Tensor  # their row and column in TRL's (rows, logits_to_keep) layout
    cols: torch.Tensor


def _kept_images(ids: torch.Tensor, tokens: list[int], image_token_id: int, row: int) -> int:
    """How many of a row's images (``tokens`` each) lie in its kept ids; an image cut apart is an error."""
    have, kept, total = int((ids == image_token_id).sum()), 0, 0
    while kept < len(tokens) and total + tokens[kept] <= have:
        total += tokens[kept]
        kept += 1
    if total != have:
        raise ValueError(f"row {row}: {have} <|image_pad|> tokens do not cover whole images ({tokens} tokens each)")
    return kept


def pack_rows(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    image_token_id: int,
    merge_size: int,
    pixel_values: torch.Tensor | None = None,
    image_grid_thw: torch.Tensor | None = None,
    num_images: list[int] | None = None,
    mm_token_type_ids: torch.Tensor | None = None,
    score_mask: torch.Tensor | None = None,
) -> PackedRows:
    """Pack TRL's padded ``(rows, prompt + completion)`` batch into one row (module docstring).

    ``pixel_values``/``image_grid_thw`` are the batch's images in row order (``num_images`` a row), as TRL
    builds them for Qwen-style models; the images of a dropped (masked) completion are dropped with it.
    ``score_mask`` (``(rows, logits_to_keep)``, optional): the completion tokens to score; the others (tool
    results, their images) stay in the row as context but get no log-probability (0 in the result)."""
    device = input_ids.device
    batch, width = input_ids.shape
    prompt_width = width - logits_to_keep
    keep = attention_mask.bool()
    with_images = pixel_values is not None and image_grid_thw is not None
    if with_images and (num_images is None or sum(num_images) != image_grid_thw.shape[0]):
        raise ValueError(f"num_images {num_images} does not match image_grid_thw's {image_grid_thw.shape[0]} images")
    ids_parts, pos_parts, label_parts, type_parts, grids, pixel_rows = [], [], [], [], [], []
    src, rows, cols = [], [], []
    offset, first_image, first_pixel = 0, 0, 0
    for b in range(batch):
        ids = input_ids[b][keep[b]]
        n = ids.shape[0]
        grid = image_grid_thw[first_image:first_image + num_images[b]] if with_images else None
        if grid is not None and grid.shape[0]:
            tokens = grid_token_counts(grid, merge_size)
            kept = _kept_images(ids, tokens, image_token_id, b)
            pixels = grid.prod(-1).tolist()
            pixel_rows.append(torch.arange(first_pixel, first_pixel + sum(pixels[:kept]), device=device))
            first_pixel += sum(pixels)
            grid = grid[:kept]
            grids.append(grid)
        first_image += num_images[b] if with_images else 0
        empty_grid = torch.zeros((0, 3), dtype=torch.long)
        positions = mrope_position_ids(ids.cpu(), grid.cpu() if grid is not None else empty_grid, image_token_id, merge_size)
        ids_parts.append(ids)
        pos_parts.append(positions.to(device))
        if mm_token_type_ids is not None:
            type_parts.append(mm_token_type_ids[b][keep[b]])
        # Completion tokens kept: their index in the packed row, and their column in TRL's layout.
        index_in_row = keep[b].long().cumsum(0) - 1
        wanted = keep[b, prompt_width:] if score_mask is None else keep[b, prompt_width:] & score_mask[b].bool()
        completion = wanted.nonzero().flatten()
        packed = offset + index_in_row[prompt_width + completion]
        predictable = packed > offset  # a sample's first token has nothing before it to be predicted from
        labels = torch.full((n,), IGNORE, dtype=torch.long, device=device)
        labels[(packed - offset)[predictable]] = ids[(packed - offset)[predictable]]
        label_parts.append(labels)
        src.append(packed[predictable] - 1)
        rows.append(torch.full_like(completion[predictable], b))
        cols.append(completion[predictable])
        offset += n
    inputs = {
        "input_ids": torch.cat(ids_parts)[None],
        "position_ids": torch.cat(pos_parts, dim=1)[:, None],
        "labels": torch.cat(label_parts)[None],
    }
    if mm_token_type_ids is not None:
        inputs["mm_token_type_ids"] = torch.cat(type_parts)[None]
    if grids and sum(g.shape[0] for g in grids):
        index = torch.cat(pixel_rows)
        inputs["pixel_values"] = pixel_values if index.numel() == pixel_values.shape[0] else pixel_values[index]
        inputs["image_grid_thw"] = torch.cat(grids)
    return PackedRows(inputs, torch.cat(src), torch.cat(rows), torch.cat(cols))


def packed_logps_and_entropies(
    model, packed: PackedRows, batch: int, logits_to_keep: int, compute_entropy: bool, compute_aux_loss: bool, autocast
):
    """Per-token log-probabilities (and entropies, and the MoE aux loss) of a packed micro-batch, laid out as
    TRL's ``(rows, logits_to_keep)``: one forward through TRL's fused LM head."""
    kwargs = {"output_router_logits": True} if compute_aux_loss else {}
    with autocast(), labelled_rows_only():
        out = model(**packed.inputs, fused_lm_head=True, **kwargs)
    logps = _scatter(out.log_probs, packed, batch, logits_to_keep)
    entropies = _scatter(out.entropy, packed, batch, logits_to_keep) if compute_entropy else None
    return logps, entropies, out.aux_loss if compute_aux_loss else None


@contextmanager
def labelled_rows_only():
    """TRL's fused LM head projects only the labelled rows where Triton runs (CUDA, XPU) and every row
    elsewhere, so that compilers for those devices see one tile shape; on a CPU that is most of a GRPO
    step (a packed row's prompt tokens outnumber its completion tokens many times). Within this context
    it projects the labelled rows on every device: the same log-probabilities, on fewer rows. It swaps
    the name TRL's forward reads, ``trl.trainer.utils._use_triton`` (pinned by
    ``tests/training/test_packed_logps.py``), and never the kernels' own choice of Triton."""
    import trl.trainer.utils as trl_utils

    original = trl_utils._use_triton
    trl_utils._use_triton = lambda device: True
    try:
        yield
    finally:
        trl_utils._use_triton = original


def _scatter(per_token: torch.Tensor, packed: PackedRows, batch: int, logits_to_keep: int) -> torch.Tensor:
    out = per_token.new_zeros((batch, logits_to_keep))
    out[packed.rows, packed.cols] = per_token[0, packed.source]
    return out
