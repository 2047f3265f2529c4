"""The vision tower's per-image metadata computed on the host (``eogym_sft.vision_inputs``, opt-in): the tower's
output unchanged, the tower reading what is handed to it, and (on a GPU) the boundaries staying on the host."""

from __future__ import annotations

import pytest
import torch

from helpers import chat_example

MIN_PIXELS, MAX_PIXELS = 1024, 16384


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from eogym_sft.modeling import load_base_model

    return load_base_model(str(tiny_model_dir), dtype="float32").eval()


def _images_batch(processor):
    from PIL import Image

    from eogym_sft.collator import EOGymCollator

    examples = [
        chat_example("Ships?", "Final Answer: 3", [Image.new("RGB", (64, 64), (200, 30, 30)), Image.new("RGB", (32, 96), "green")]),
        chat_example("Flooded?", "Final Answer: no", [Image.new("RGB", (96, 64), (10, 90, 200))]),
    ]
    return EOGymCollator(processor, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, padding_free=True)(examples)


def _tower_outputs(tower, batch, **kwargs):
    with torch.no_grad():
        out = tower(batch["pixel_values"], grid_thw=batch["image_grid_thw"], return_dict=True, **kwargs)
    return [out.pooler_output, *out.deepstack_features]


@pytest.mark.parametrize("boundaries_only", [False, True], ids=["all", "boundaries"])
def test_the_hook_leaves_the_towers_output_bit_for_bit(model, processor, boundaries_only):
    """``load_base_model`` leaves the tower to compute its metadata itself (measured faster on an H200); with the
    hook installed, the tower's output is bit for bit the one it computes itself."""
    from eogym_sft.vision_inputs import precompute_vision_inputs, vision_tower

    tower = vision_tower(model)
    batch = _images_batch(processor)
    assert len(batch["image_grid_thw"]) == 3 and len(tower._forward_pre_hooks) == 0
    own = _tower_outputs(tower, batch)
    handle = precompute_vision_inputs(model, boundaries_only)
    try:
        assert len(tower._forward_pre_hooks) == 1
        hooked = _tower_outputs(tower, batch)
    finally:
        handle.remove()
    for got, want in zip(hooked, own, strict=True):
        assert torch.equal(got, want)


def test_the_tower_reads_what_it_is_handed(model, processor):
    """transformers' Qwen3-VL tower takes the precomputed values from its kwargs (``transformers.vision_utils``):
    handed wrong rotary positions or interpolation weights, its output changes. If an upgrade stops reading
    them, this fails instead of the hook silently doing nothing."""
    from eogym_sft.vision_inputs import host_vision_inputs, vision_tower

    tower = vision_tower(model)
    batch = _images_batch(processor)
    right = host_vision_inputs(tower, batch["image_grid_thw"])
    want = _tower_outputs(tower, batch, **right)
    for key in ("position_ids", "interp_weights"):
        wrong = {**right, key: torch.zeros_like(right[key])}
        assert not torch.equal(_tower_outputs(tower, batch, **wrong)[0], want[0]), key
    assert right["cu_seqlens"].tolist() == [0, 16, 28, 52]  # 16-px patches: 64x64 -> 4x4, 32x96 -> 2x6, 96x64 -> 6x4
    assert right["max_seqlen"] is None  # SDPA splits the images itself; only flash takes a longest length
    moved = {**right, "cu_seqlens": torch.tensor([0, 12, 28, 52], dtype=torch.int32)}  # the first boundary 4 early
    assert not torch.equal(_tower_outputs(tower, batch, **moved)[0], want[0])
    only = host_vision_inputs(tower, batch["image_grid_thw"], boundaries_only=True)
    assert set(only) == {"cu_seqlens", "max_seqlen"} and torch.equal(only["cu_seqlens"], right["cu_seqlens"])


def test_a_model_without_the_tower_gets_no_hook():
    from eogym_sft.vision_inputs import precompute_vision_inputs

    assert precompute_vision_inputs(torch.nn.Linear(2, 2)) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("boundaries_only", [False, True], ids=["all", "boundaries"])
def test_on_a_gpu_the_boundaries_stay_on_the_host(tiny_model_dir, processor, boundaries_only):
    """On CUDA the tower's attention gets the images' boundaries as a host tensor (no sync in each block), the
    rest on the GPU, and the output is the tower's own up to float rounding (interpolation weights computed by the CPU)."""
    from eogym_sft.modeling import load_base_model
    from eogym_sft.vision_inputs import precompute_vision_inputs, vision_tower

    model = load_base_model(str(tiny_model_dir), dtype="float32").cuda().eval()
    tower = vision_tower(model)
    batch = {k: v.cuda() for k, v in _images_batch(processor).items()}
    own = _tower_outputs(tower, batch)
    seen = {}
    handles = [precompute_vision_inputs(model, boundaries_only),
               tower.blocks[0].attn.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)]
    hooked = _tower_outputs(tower, batch)
    for handle in handles:
        handle.remove()
    assert seen["cu_seqlens"].device.type == "cpu" and seen["position_embeddings"][0].is_cuda
    for got, want in zip(hooked, own, strict=True):
        torch.testing.assert_close(got, want)
