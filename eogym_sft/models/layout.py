"""Qwen3-VL's token layout: how many visual tokens an image takes, its ``<|image_pad|>`` run, and the 3-D rotary
positions.

The processor writes one ``<|image_pad|>`` per visual token: an image of ``(t, h, w)`` patches is ``t * h * w /
merge_size**2`` tokens (the vision tower merges ``merge_size x merge_size`` patches into one). Data prep, the
collator, the slot decoder and GRPO's packed loss forward all lay sequences out with these functions, so they agree
with each other and with ``processor(text, images)`` and ``Qwen3VLModel.get_rope_index`` (pinned by
``tests/models/test_layout.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # data prep's plan (image_factor, image_token_count) runs before torch loads, keeping refusals fast
    import torch


def image_factor(processor) -> int:
    """Pixels per visual token along a side: patch size x spatial merge (32 for Qwen3-VL)."""
    ip = processor.image_processor
    return ip.patch_size * ip.merge_size


def image_token_count(hw: tuple[int, int], factor: int) -> int:
    """Visual tokens of an image resized to ``hw`` pixels: one per ``factor x factor`` block (:func:`image_factor`)."""
    return (hw[0] // factor) * (hw[1] // factor)


def grid_token_count(grid_thw: tuple[int, int, int], merge_size: int) -> int:
    """Visual tokens of one image of ``grid_thw`` patches (the processor's ``image_grid_thw`` row)."""
    t, h, w = grid_thw
    return t * h * w // merge_size**2


def grid_token_counts(image_grid_thw: torch.Tensor, merge_size: int) -> list[int]:
    """Visual tokens of each image of an ``(images, 3)`` ``image_grid_thw``."""
    return (image_grid_thw.prod(-1) // merge_size**2).tolist()


def _pad_positions(ids: list[int], images: int, image_token_id: int) -> list[int]:
    found = ids.count(image_token_id)
    if found != images:
        raise ValueError(f"the text has {found} <|image_pad|> tokens but {images} images were given")
    at, i = [], -1
    for _ in range(found):
        i = ids.index(image_token_id, i + 1)
        at.append(i)
    return at


def expand_image_pads(ids: list[int], counts: list[int], image_token_id: int) -> list[int]:
    """``ids`` with the k-th ``<|image_pad|>`` repeated ``counts[k]`` times (its image's visual tokens), as the
    processor does."""
    out, done = [], 0
    for at, n in zip(_pad_positions(ids, len(counts), image_token_id), counts):
        out += ids[done:at]
        out += [image_token_id] * n
        done = at + 1
    out += ids[done:]
    return out


def expand_image_pads_and_mask(ids: list[int], mask: list[int], counts: list[int],
                               image_token_id: int) -> tuple[list[int], list[int]]:
    """:func:`expand_image_pads`, and ``mask`` (one entry a token) expanded alike with 0 on the image tokens: never
    trained."""
    out_ids, out_mask, done = [], [], 0
    for at, n in zip(_pad_positions(ids, len(counts), image_token_id), counts):
        out_ids += ids[done:at]
        out_ids += [image_token_id] * n
        out_mask += mask[done:at]
        out_mask += [0] * n
        done = at + 1
    out_ids += ids[done:]
    out_mask += mask[done:]
    return out_ids, out_mask


def mrope_position_ids(input_ids: torch.Tensor, image_grid_thw: torch.Tensor, image_token_id: int,
                       merge_size: int) -> torch.Tensor:
    """Qwen3-VL's 4-row position ids ``[text; t; h; w]`` for one unpadded sample (pads expanded).

    Text tokens advance all three rotary rows by one. An image's tokens take ``t``/``h``/``w`` grid
    coordinates offset by the current position, after which the position jumps by the larger grid
    side: the rule of ``Qwen3VLModel.get_rope_index``. The first row is the plain token index, which
    attention uses to tell packed samples apart; the rotary rows alone are ``[1:]``.
    """
    import torch

    length = input_ids.shape[0]
    image_positions = (input_ids == image_token_id).nonzero().flatten().tolist()
    chunks, cursor, pos, k = [], 0, 0, 0
    for index, (t, h, w) in enumerate(image_grid_thw.tolist()):
        gh, gw = h // merge_size, w // merge_size
        n = t * gh * gw
        start = image_positions[k] if k < len(image_positions) else length
        if not 0 < n <= len(image_positions) - k or image_positions[k + n - 1] != start + n - 1:
            raise ValueError(f"image {index} needs {n} <|image_pad|> tokens in a row at position {start}")
        chunks.append(torch.arange(start - cursor).expand(3, -1) + pos)
        pos += start - cursor
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw),
                                          indexing="ij")).reshape(3, -1)
        chunks.append(grid + pos)
        pos += max(gh, gw)
        cursor = start + n
        k += n
    chunks.append(torch.arange(length - cursor).expand(3, -1) + pos)
    rope = torch.cat(chunks, dim=1)
    return torch.cat([torch.arange(length)[None], rope], dim=0)
