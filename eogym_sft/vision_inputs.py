"""The vision tower's per-image metadata computed on the host, once per forward, instead of on the GPU.

Qwen3-VL's vision tower derives from ``grid_thw`` (each image's patch grid) the images' boundaries, the
patches' rotary positions and their position-embedding interpolation taps, with ops whose output size
depends on the data (``repeat_interleave``, ``.tolist()``, ``.item()``): each a host sync when ``grid_thw``
is on the GPU, and the tower's SDPA path reads the boundaries on the host again in each of its 24 blocks.
On an H200 those syncs idled the GPU 26 ms in a window of two micro-batches of the 4B recipe
(``bench/idle_gaps.py``, docs/benchmarks.md). transformers lets a caller hand these tensors in precomputed
(``transformers.vision_utils``: each ``get_vision_*`` helper pops its value from the encoder's kwargs);
:func:`precompute_vision_inputs` computes them with those same helpers from a host copy of ``grid_thw``:
one sync a forward. The boundaries stay on the host where the tower's attention splits images there (SDPA,
eager); a flash-attention tower gets them on the GPU.

Opt-in, not installed by ``load_base_model``: the whole set made the 4B recipe's step 13% slower on an H200,
because the sync empties the GPU's queue and the GPU then waits while the host computes the interpolation taps
(~90 ms a micro-batch; docs/benchmarks.md, "Each change's share"). With ``boundaries_only`` the hook hands over
only the images' boundaries, a cumulative sum of a few integers, and the tower computes the rest as usual: its
blocks then split the images without a sync each. On an H200 that mode ran as fast as the tower alone (arm
``B-visionbounds``: 16,042 against 16,092 tokens/s; docs/benchmarks.md, "The levers").
"""

from __future__ import annotations

import torch


def vision_tower(model):
    """The model's Qwen3-VL vision tower, or ``None`` when it has none (another architecture)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    return next((m for m in model.modules() if isinstance(m, Qwen3VLVisionModel)), None)


def host_vision_inputs(tower, grid_thw: torch.Tensor, boundaries_only: bool = False) -> dict:
    """What the tower's forward would compute from ``grid_thw``, computed on the host (one sync) and put where
    the forward reads it, under the keys its helpers pop. With ``boundaries_only``, only the images' boundaries
    (a cumulative sum of a few integers, which the tower's blocks read back on the host in every block); the
    tower computes the rest on the GPU as usual."""
    from transformers.utils.generic import get_max_seqlen, is_flash_attention_requested
    from transformers.vision_utils import (
        get_vision_cu_seqlens, get_vision_interpolation_indices_and_weights, get_vision_position_ids,
    )

    host, device = grid_thw.cpu(), grid_thw.device
    cu_seqlens = get_vision_cu_seqlens(host)
    flash = is_flash_attention_requested(tower.config)  # flash takes them on the GPU; SDPA splits on the host
    boundaries = {
        "cu_seqlens": cu_seqlens.to(device) if flash else cu_seqlens,
        "max_seqlen": get_max_seqlen(cu_seqlens, tower.config),
    }
    if boundaries_only:
        return boundaries
    indices, weights = get_vision_interpolation_indices_and_weights(
        host, num_grid_per_side=tower.num_grid_per_side, mode=tower.interpolation_mode,
        align_corners=tower.interpolation_align_corners, spatial_merge_size=tower.config.spatial_merge_size,
    )
    on_device = {
        "position_ids": get_vision_position_ids(host, tower.spatial_merge_size),
        "interp_indices": indices,
        "interp_weights": weights,
    }
    return {**{key: t.to(device, non_blocking=True) for key, t in on_device.items()}, **boundaries}  # no sync each


def precompute_vision_inputs(model, boundaries_only: bool = False):
    """A forward pre-hook on the model's Qwen3-VL vision tower that hands it :func:`host_vision_inputs`.
    Returns the hook's handle (``None`` for a model without that tower); values a caller passes itself are kept."""
    tower = vision_tower(model)
    if tower is None:
        return None

    def add(module, args, kwargs):
        grid_thw = kwargs.get("grid_thw")
        if grid_thw is None or "cu_seqlens" in kwargs:
            return None
        return args, {**host_vision_inputs(module, grid_thw, boundaries_only), **kwargs}

    return tower.register_forward_pre_hook(add, with_kwargs=True)
