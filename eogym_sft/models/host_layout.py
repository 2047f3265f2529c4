"""What a training forward would read back from the GPU, computed on the host beforehand: :class:`HostLayout`.

A Qwen3-VL training forward reads small values back from the GPU: the supervised positions the loss keeps
(``nonzero``), the packed samples' boundaries (``nonzero``, ``max``), the images' token counts
(``image_grid_thw.tolist()``) and the vision tower's metadata: the rotary position ids and the learned
position grid's interpolation (``.tolist()``, ``repeat_interleave``) and the attention's ``cu_seqlens``, read with
``.tolist()`` again in every vision block. Each read drains the GPU's queue, many times a micro-batch on the
4B model, most of them in the vision blocks (docs/benchmarks.md).

The collator has all of it on the host already (labels, position ids, ``image_grid_thw``), so with
``EOGymCollator(host_layout=True)`` it computes them in the DataLoader's workers and hands them over as one
``HostLayout`` in the batch. It is no tensor and has no ``to``: neither the Trainer's ``_prepare_inputs`` nor
accelerate's ``send_to_device`` moves it (``tests/data/test_collator.py``). The trainer feeds it in through
public routes (:func:`eogym_sft.training.trainer.EOGymSFTTrainer.compute_loss`): the text tower's boundaries
as transformers' packed-sequence arguments, the vision tower's metadata as the keywords that
``transformers.vision_utils``' helpers take precomputed (they pop ``cu_seqlens``, ``position_ids``,
``interp_indices``/``interp_weights`` and ``max_seqlen`` from the tower's keywords), added by a forward pre-hook
for one call. The values are computed by the same functions the model calls (transformers' helpers, and
:func:`~eogym_sft.models.attention.sample_boundaries`), so they are equal to the model's own, bit for bit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .attention import sample_boundaries, text_positions
from .vision_blocks import VISION_NAME, vision_tower

# The vision tower's keywords that go to its device (the rest is read on the host, or by flash on the device)
VISION_DEVICE_KEYS = ("interp_indices", "interp_weights", "position_ids")


def supervised_positions(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Positions of ``labels [batch, length]`` whose next-token label is set in some row: the logits the loss needs."""
    return (labels[:, 1:] != ignore_index).any(0).nonzero().flatten()


@dataclass(frozen=True)
class VisionGeometry:
    """The settings Qwen3-VL's vision tower derives its metadata from ``grid_thw`` with, read off the tower
    (:meth:`of`); small and picklable, so a collator can carry it into its workers."""

    num_grid_per_side: int
    spatial_merge_size: int
    interpolation_mode: str
    align_corners: bool
    config: object  # the tower's config: get_max_seqlen asks it whether flash attention is requested

    @classmethod
    def of(cls, model) -> VisionGeometry:
        """From ``model`` (a Qwen3-VL, PEFT-wrapped or not) or its vision tower."""
        tower = vision_tower(model)
        if tower is None:
            raise ValueError(f"{type(model).__name__} has no Qwen3-VL vision tower")
        return cls(tower.num_grid_per_side, tower.spatial_merge_size, tower.interpolation_mode,
                   tower.interpolation_align_corners, tower.config)


def vision_metadata(grid_thw: torch.Tensor, geometry: VisionGeometry) -> dict:
    """The vision tower's metadata for ``grid_thw``, by the calls ``Qwen3VLVisionModel.forward`` makes, under the
    keywords those calls take precomputed."""
    from transformers.vision_utils import (
        get_vision_attention_seqlens,
        get_vision_interpolation_indices_and_weights,
        get_vision_position_ids,
    )

    indices, weights = get_vision_interpolation_indices_and_weights(
        grid_thw, num_grid_per_side=geometry.num_grid_per_side, mode=geometry.interpolation_mode,
        align_corners=geometry.align_corners, spatial_merge_size=geometry.spatial_merge_size,
    )
    cu_seqlens, max_seqlen = get_vision_attention_seqlens(grid_thw, geometry.config)
    return {
        "interp_indices": indices, "interp_weights": weights,
        "position_ids": get_vision_position_ids(grid_thw, geometry.spatial_merge_size),
        "cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen,  # max_seqlen: None unless the tower runs flash
    }


@dataclass(frozen=True)
class HostLayout:
    """One micro-batch's layout, on the host (see the module docstring).

    Attributes:
        supervised: positions whose next-token label is set (:func:`supervised_positions`).
        cu_seq_lens, max_length: the samples' boundaries in the flattened batch and the longest sample
            (:func:`~eogym_sft.models.attention.sample_boundaries` of the text position row).
        image_grid_thw: the images' grid (`None` without images).
        vision: the vision tower's metadata (:func:`vision_metadata`; `None` without images or geometry).
    """

    supervised: torch.Tensor
    cu_seq_lens: torch.Tensor
    max_length: int
    image_grid_thw: torch.Tensor | None = None
    vision: dict | None = None

    @classmethod
    def of_batch(cls, labels, position_ids, image_grid_thw=None, geometry: VisionGeometry | None = None,
                 ignore_index: int = -100) -> HostLayout:
        """From a collated batch's host tensors (``position_ids`` 4-row, as the collator gives them)."""
        cu, max_length = sample_boundaries(text_positions(position_ids))
        vision = (
            vision_metadata(image_grid_thw, geometry) if image_grid_thw is not None and geometry is not None else None
        )
        return cls(supervised_positions(labels, ignore_index), cu, max_length, image_grid_thw, vision)

    def vision_keywords(self, device, attn_implementation: str) -> dict:
        """:attr:`vision` as the keywords the tower's helpers pop, for a tower on ``device`` running
        ``attn_implementation``: what its device reads moved there (non-blocking, from pinned memory). The images'
        boundaries stay on the host, where SDPA's per-image loop reads them (transformers' sdpa branch, or the
        compiled blocks' :data:`~eogym_sft.models.vision_blocks.VISION_NAME`), and move only for a flash kernel."""
        keywords = dict(self.vision)
        for key in VISION_DEVICE_KEYS:
            keywords[key] = keywords[key].to(device, non_blocking=True)
        if keywords["max_seqlen"] is None:
            del keywords["max_seqlen"]  # not flash: the tower asks for none
        elif attn_implementation != VISION_NAME:
            keywords["cu_seqlens"] = keywords["cu_seqlens"].to(device, non_blocking=True)
        return keywords

    def pin_memory(self) -> HostLayout:
        """The DataLoader's ``pin_memory`` calls this: the tensors in page-locked memory, so their copies to the GPU
        run asynchronously."""
        vision = None if self.vision is None else {k: v.pin_memory() if torch.is_tensor(v) else v
                                                   for k, v in self.vision.items()}
        return dataclasses.replace(self, supervised=self.supervised.pin_memory(),
                                   cu_seq_lens=self.cu_seq_lens.pin_memory(), vision=vision)
