"""What the slot decoder's prefill takes from the host: one image as the vision tower takes it
(:class:`ImageInput`), where each image's pads begin (:func:`image_starts`), host tensors queued to the GPU without
waiting for it (:func:`host_to`) and the vision tower's metadata computed on the host (:func:`vision_keywords`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.host_layout import VISION_DEVICE_KEYS, VisionGeometry, vision_metadata
from ..models.layout import grid_token_count


@dataclass
class ImageInput:
    """One image as the vision tower takes it (``image_processor`` output for that image alone)."""

    pixel_values: torch.Tensor  # (patches, channels * temporal * patch * patch)
    grid_thw: tuple[int, int, int]
    merge_size: int  # the image processor's: merge_size x merge_size patches make one visual token

    @property
    def tokens(self) -> int:
        return grid_token_count(self.grid_thw, self.merge_size)


def image_input(processor, image) -> ImageInput:
    """Pixel values and grid of one PIL image, resized by the processor's own rules (pixel cap included)."""
    out = processor.image_processor(images=[image], return_tensors="pt")
    return ImageInput(out["pixel_values"], tuple(int(v) for v in out["image_grid_thw"][0]),
                      processor.image_processor.merge_size)


def image_starts(ids: list[int], images: list[ImageInput], image_token_id: int) -> list[int]:
    """Where each image's ``<|image_pad|>`` run begins in ``ids`` (pads already expanded)."""
    starts, i = [], 0
    while len(starts) < len(images) and i < len(ids):
        if ids[i] == image_token_id:
            starts.append(i)
            i += images[len(starts) - 1].tokens
        else:
            i += 1
    if len(starts) != len(images):
        raise ValueError(f"the text holds {len(starts)} images' pads but {len(images)} images were given")
    return starts


def host_to(device, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (on the host) on ``device``, queued without waiting for the GPU: a copy from pageable memory first
    waits for every kernel already queued, so on CUDA the tensor travels through pinned memory, asynchronously (the
    pinned block is kept until the copy is done). A tensor already on a GPU is moved as it is."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def vision_keywords(visual, grid: torch.Tensor, device) -> dict:
    """Keyword arguments for Qwen3-VL's vision tower that carry what its forward would otherwise derive from
    ``grid`` on the GPU (a host synchronisation for each ``.tolist()``, one per block for the attention's image
    lengths): :func:`~eogym_sft.models.host_layout.vision_metadata` of the host's ``grid`` (the position embedding's
    interpolation taps, the rotary positions, the image boundaries), queued to ``device`` but the boundaries, left
    on the host where the attention only splits by them (moved for flash's variable-length kernel). ``visual`` is
    the model's ``Qwen3VLVisionModel``; the features equal the unassisted forward's
    (``tests/agent/test_image_inputs.py::test_the_vision_keywords_from_the_host_give_the_same_features``)."""
    from transformers.utils.generic import is_flash_attention_requested

    keywords = vision_metadata(grid, VisionGeometry.of(visual))
    for key in VISION_DEVICE_KEYS:
        keywords[key] = host_to(device, keywords[key])
    if is_flash_attention_requested(visual.config):
        keywords["cu_seqlens"] = host_to(device, keywords["cu_seqlens"])
    return keywords
