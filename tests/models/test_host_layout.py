"""``HostLayout.vision_keywords``: which of the vision tower's precomputed values move to its device, by the
tower's attention (``meta`` stands in for the GPU: a tensor moved there is seen to move)."""

from __future__ import annotations

import pytest
import torch

from eogym_sft.models.host_layout import VISION_DEVICE_KEYS, HostLayout, VisionGeometry
from eogym_sft.models.vision_blocks import VISION_NAME


def _layout(vision_attention: str) -> HostLayout:
    """A micro-batch of one 3-token sample and two images (4 x 6 and 2 x 2 patches), for a tiny tower running
    ``vision_attention``."""
    from eogym_sft.models.tiny import build_tiny_model
    from eogym_sft.models.vision_blocks import use_vision_block_attention

    model = build_tiny_model(seed=0)
    if vision_attention == VISION_NAME:
        use_vision_block_attention(model)
    positions = torch.arange(3).expand(4, 1, 3)
    return HostLayout.of_batch(torch.tensor([[-100, 5, 6]]), positions, torch.tensor([[1, 4, 6], [1, 2, 2]]), VisionGeometry.of(model))


@pytest.mark.parametrize(("vision_attention", "kernel", "longest", "boundaries_move"), [
    ("sdpa", "sdpa", None, False),  # transformers' sdpa loop reads them on the host
    (VISION_NAME, VISION_NAME, 24, False),  # the compiled blocks' per-image op does too
    (VISION_NAME, "flash_attention_2", 24, True),  # a flash kernel reads them on the device
])
def test_the_boundaries_stay_on_the_host_unless_a_flash_kernel_reads_them(vision_attention, kernel, longest, boundaries_move):
    layout = _layout(vision_attention)
    keywords = layout.vision_keywords(torch.device("meta"), kernel)
    for key in VISION_DEVICE_KEYS:
        assert keywords[key].is_meta and layout.vision[key].device.type == "cpu"  # moved; the layout keeps its own
    assert keywords["cu_seqlens"].is_meta is boundaries_move
    if not boundaries_move:
        assert keywords["cu_seqlens"] is layout.vision["cu_seqlens"]
    assert layout.vision["cu_seqlens"].tolist() == [0, 24, 28]
    assert keywords.get("max_seqlen") == longest and ("max_seqlen" in keywords) is (longest is not None)
