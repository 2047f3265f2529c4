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

The episodes of one question share their prompt (system text, question, images: most of an episode's tokens).
With ``share_prompts`` (the trainer sets it under the ``eogym_varlen*`` attentions) the row holds such a prompt once,
all but its last token, and each episode's tokens from that last one on, which attend to the prompt and to
themselves (:func:`eogym_sft.models.attention.shared_prefix_attention`, handed the layout as
``eogym_shared_prefixes``). Positions are each episode's own, so the arithmetic is the unshared row's; the prompt's
images are encoded once. Prompts are shared only when their tokens and pixels are equal.

The loss forward scores only the tokens the loss counts (``completion_mask * tool_mask``): a tool result
and its crop's image tokens are context, never trained, and on a multi-turn episode they outnumber the
model's own tokens (a crop at the recipe's cap is up to 980 image tokens, a turn tens), so projecting them
through the vocabulary-wide head was most of the head's work.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..models.attention import SharedPrefixes
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
    kept = _whole_images(ids, tokens, image_token_id)
    if sum(tokens[:kept]) != int((ids == image_token_id).sum()):
        raise ValueError(f"row {row}: {int((ids == image_token_id).sum())} <|image_pad|> tokens do not cover whole "
                         f"images ({tokens} tokens each)")
    return kept


def _whole_images(ids: torch.Tensor, tokens: list[int], image_token_id: int) -> int:
    """How many of the images (``tokens`` each) lie whole in ``ids``."""
    have, whole, total = int((ids == image_token_id).sum()), 0, 0
    while whole < len(tokens) and total + tokens[whole] <= have:
        total += tokens[whole]
        whole += 1
    return whole


@dataclass
class _Row:
    """One episode unpadded: its tokens, 4-row positions, labels, kept images and scored completion tokens."""

    ids: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor
    types: torch.Tensor | None
    prompt: int  # its kept prompt tokens (the first ``prompt`` of ``ids``)
    grid: torch.Tensor | None  # its kept images' grids, in order
    pixels: list[torch.Tensor]  # each kept image's rows of the batch's pixel_values
    prompt_images: int  # how many of them lie in the prompt
    scored: torch.Tensor  # the positions in ``ids`` whose token gets a log-probability (each > 0)
    cols: torch.Tensor  # their columns in TRL's (rows, logits_to_keep) layout


def _unpad_row(b, input_ids, keep, prompt_width, image_token_id, merge_size, grid, first_pixel, mm_token_type_ids,
               score_mask):
    """Row ``b`` of TRL's padded batch as a :class:`_Row`; ``grid`` its images' grids, their pixel rows from
    ``first_pixel``."""
    device = input_ids.device
    ids = input_ids[b][keep[b]]
    prompt = int(keep[b, :prompt_width].sum())
    pixels, prompt_images = [], 0
    if grid is not None and grid.shape[0]:
        tokens = grid_token_counts(grid, merge_size)
        kept = _kept_images(ids, tokens, image_token_id, b)
        prompt_images = _whole_images(ids[:prompt], tokens, image_token_id)
        sizes = grid.prod(-1).tolist()
        for size in sizes[:kept]:
            pixels.append(torch.arange(first_pixel, first_pixel + size, device=device))
            first_pixel += size
        grid = grid[:kept]
    empty_grid = torch.zeros((0, 3), dtype=torch.long)
    positions = mrope_position_ids(ids.cpu(), grid.cpu() if grid is not None else empty_grid, image_token_id,
                                   merge_size)
    # Completion tokens kept: their index in the unpadded row, and their column in TRL's layout.
    index_in_row = keep[b].long().cumsum(0) - 1
    wanted = keep[b, prompt_width:] if score_mask is None else keep[b, prompt_width:] & score_mask[b].bool()
    completion = wanted.nonzero().flatten()
    at = index_in_row[prompt_width + completion]
    predictable = at > 0  # a sample's first token has nothing before it to be predicted from
    labels = torch.full((ids.shape[0],), IGNORE, dtype=torch.long, device=device)
    labels[at[predictable]] = ids[at[predictable]]
    types = mm_token_type_ids[b][keep[b]] if mm_token_type_ids is not None else None
    return _Row(ids, positions.to(device), labels, types, prompt, grid, pixels, prompt_images, at[predictable],
                completion[predictable])


def _same_prompt(a: _Row, b: _Row, pixel_values: torch.Tensor | None) -> bool:
    """Whether two episodes' prompts are the same tokens and the same images, pixel for pixel."""
    if (
        a.prompt != b.prompt
        or a.prompt_images != b.prompt_images
        or not torch.equal(a.ids[: a.prompt], b.ids[: b.prompt])
    ):
        return False
    n = a.prompt_images
    return not n or (torch.equal(a.grid[:n], b.grid[:n]) and all(
        torch.equal(pixel_values[x], pixel_values[y]) for x, y in zip(a.pixels[:n], b.pixels[:n])))


def _prompt_groups(rows: list[_Row], pixel_values, image_token_id: int) -> list[list[int]]:
    """The rows in groups of one prompt, in order of first appearance. A prompt is shared without its last token
    (each episode keeps a copy, which predicts its first completion token), so one ending in an image is not."""
    groups: list[list[int]] = []
    for b, row in enumerate(rows):
        shareable = row.prompt > 1 and int(row.ids[row.prompt - 1]) != image_token_id
        group = next((g for g in groups if shareable and _same_prompt(rows[g[0]], row, pixel_values)), None)
        if group is None:
            groups.append([b])
        else:
            group.append(b)
    return groups


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
    share_prompts: bool = False,
) -> PackedRows:
    """Pack TRL's padded ``(rows, prompt + completion)`` batch into one row (module docstring).

    ``pixel_values``/``image_grid_thw`` are the batch's images in row order (``num_images`` a row), as TRL
    builds them for Qwen-style models; the images of a dropped (masked) completion are dropped with it.
    ``score_mask`` (``(rows, logits_to_keep)``, optional): the completion tokens to score; the others (tool
    results, their images) stay in the row as context but get no log-probability (0 in the result).
    ``share_prompts``: episodes with the same prompt (tokens and pixels) share one copy of it (module docstring);
    the model's attention must then be ``eogym_varlen*``, which reads the layout from ``eogym_shared_prefixes``."""
    batch, width = input_ids.shape
    prompt_width = width - logits_to_keep
    keep = attention_mask.bool()
    with_images = pixel_values is not None and image_grid_thw is not None
    if with_images and (num_images is None or sum(num_images) != image_grid_thw.shape[0]):
        raise ValueError(f"num_images {num_images} does not match image_grid_thw's {image_grid_thw.shape[0]} images")
    rows, first_image, first_pixel = [], 0, 0
    for b in range(batch):
        grid = image_grid_thw[first_image:first_image + num_images[b]] if with_images else None
        rows.append(_unpad_row(b, input_ids, keep, prompt_width, image_token_id, merge_size, grid, first_pixel,
                               mm_token_type_ids, score_mask))
        if with_images:
            first_image += num_images[b]
            first_pixel += int(grid.prod(-1).sum())
    groups = _prompt_groups(rows, pixel_values, image_token_id) if share_prompts else [[b] for b in range(batch)]
    return _pack(rows, groups, pixel_values)


def _pack(rows: list[_Row], groups: list[list[int]], pixel_values) -> PackedRows:
    """The packed row: each group of several rows as its prompt once (all but the last token) and each member's
    tokens from there; a group of one row whole. Where a prompt is shared, the row carries the layout for the
    attention (``eogym_shared_prefixes``); otherwise each row's positions restart at 0, which tells them apart."""
    pieces = []  # (row, first, end, prefix): rows[row]'s tokens first:end, after the piece at index prefix (or None)
    for group in groups:
        cut = rows[group[0]].prompt - 1 if len(group) > 1 else 0
        prefix = None
        if cut > 0:
            prefix = len(pieces)
            pieces.append((group[0], 0, cut, None))
        pieces += [(b, cut, rows[b].ids.shape[0], prefix) for b in group]
    parts = {"ids": [], "pos": [], "labels": [], "types": [], "grids": [], "pixels": []}
    src, out_rows, cols, spans, offset = [], [], [], [], 0
    for b, first, end, prefix in pieces:
        row = rows[b]
        parts["ids"].append(row.ids[first:end])
        parts["pos"].append(row.positions[:, first:end])
        parts["labels"].append(row.labels[first:end])
        if row.types is not None:
            parts["types"].append(row.types[first:end])
        if first:  # a member after its group's prompt: the completion's images
            images = range(row.prompt_images, len(row.pixels))
        else:  # a group's prompt, or a row whole
            images = range(row.prompt_images if end < row.ids.shape[0] else len(row.pixels))
        if row.grid is not None and len(images):
            parts["grids"].append(row.grid[images.start:images.stop])
            parts["pixels"] += [row.pixels[i] for i in images]
        scored = (row.scored >= first) & (row.scored < end)
        src.append(offset + row.scored[scored] - first - 1)
        out_rows.append(torch.full_like(row.cols[scored], b))
        cols.append(row.cols[scored])
        prefix_span = spans[prefix][:2] if prefix is not None else (0, 0)
        spans.append((offset, offset + end - first, *prefix_span))
        offset += end - first
    inputs = {
        "input_ids": torch.cat(parts["ids"])[None],
        "position_ids": torch.cat(parts["pos"], dim=1)[:, None],
        "labels": torch.cat(parts["labels"])[None],
    }
    if parts["types"]:
        inputs["mm_token_type_ids"] = torch.cat(parts["types"])[None]
    if parts["pixels"]:
        index = torch.cat(parts["pixels"])
        inputs["pixel_values"] = pixel_values if index.numel() == pixel_values.shape[0] else pixel_values[index]
        inputs["image_grid_thw"] = torch.cat(parts["grids"])
    if any(len(group) > 1 for group in groups):
        inputs["eogym_shared_prefixes"] = SharedPrefixes(tuple(spans))
    return PackedRows(inputs, torch.cat(src), torch.cat(out_rows), torch.cat(cols))


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


def loss_batch(inputs: dict) -> tuple[dict, torch.Tensor | None]:
    """The loss's batch and the completion tokens its forward scores, ``completion_mask * tool_mask``: only the
    tokens TRL's loss counts need a log-probability. Without the old policy's log-probs (``num_iterations=1``) TRL
    takes the current ones detached, so every other position is multiplied by 0 and never read. With them
    (``old_per_token_logps``) an unscored position's ratio ``exp(0 - old)`` may overflow to inf, and inf * 0 is NaN:
    the batch returned (a copy) holds 0 there, a ratio of 1 that the mask then drops. The reference's log-probs
    (``beta`` > 0) are at most 0, so ``exp(ref - 0)`` stays finite; the engines' sampled ones enter no ratio without
    vLLM (TRL's off-policy mask reads them as a difference, zeroed off the mask). None: every token scored."""
    if "tool_mask" not in inputs:
        return inputs, None
    mask = inputs["completion_mask"] * inputs["tool_mask"]
    old = inputs.get("old_per_token_logps")
    if old is not None:
        inputs = inputs | {"old_per_token_logps": old.masked_fill(mask == 0, 0.0)}
    return inputs, mask
