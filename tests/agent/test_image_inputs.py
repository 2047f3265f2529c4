"""The prefill's inputs from the host: an image's token count, the vision metadata, host-to-device copies
(eogym_sft/agent/image_inputs.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from slot_decoding import noise_image, two_pictures, two_turn_ids, varied_model

from eogym_sft.agent.decoder import SlotDecoder
from eogym_sft.agent.image_inputs import ImageInput, host_to, image_input, vision_keywords
from eogym_sft.models.tiny import IMAGE_TOKEN_ID, TINY_QWEN3_VL_CONFIG, build_tiny_model


@pytest.fixture(scope="module")
def model():
    return varied_model()


def test_an_images_token_count_follows_the_processors_merge_size(processor):
    import copy as copying

    merged3 = copying.copy(processor)
    merged3.image_processor = copying.deepcopy(processor.image_processor)
    merged3.image_processor.merge_size = 3
    text = "<|vision_start|><|image_pad|><|vision_end|>"
    for proc in (processor, merged3):
        picture = noise_image((200, 150), 30, 6)
        want = proc(text=[text], images=[picture])["input_ids"][0].count(IMAGE_TOKEN_ID)
        assert image_input(proc, picture).tokens == want
    assert want == 35  # 200x150 px scaled up to the 65,536 px floor at 48 px a side a token: 240x336 px, 15x21 patches, 5x7 tokens


def test_the_vision_keywords_from_the_host_give_the_same_features(model, processor):
    """transformers' Qwen3-VL vision forward takes its grid-derived metadata by keyword (``vision_utils``' helpers pop
    them): what the decoder computes on the host gives the unassisted forward's features to the bit, and each keyword
    is used, not ignored (one made wrong changes the features), so none is derived again on the GPU."""
    images = [image_input(processor, p) for p in two_pictures()]
    pixels = torch.cat([im.pixel_values for im in images])
    grid = torch.tensor([im.grid_thw for im in images])
    visual = model.model.visual
    meta = vision_keywords(visual, grid, torch.device("cpu"))
    assert set(meta) == {"interp_indices", "interp_weights", "position_ids", "cu_seqlens", "max_seqlen"}

    def features(**kwargs):
        with torch.no_grad():
            out = model.model.get_image_features(pixels, grid, return_dict=True, **kwargs)
        return torch.cat(out.pooler_output), [torch.cat(f) for f in out.deepstack_features]

    (want, want_deep), (got, got_deep) = features(), features(**meta)
    assert torch.equal(got, want) and len(got_deep) == len(want_deep) > 0
    assert all(torch.equal(a, b) for a, b in zip(got_deep, want_deep))
    one_image = torch.tensor([0, int(meta["cu_seqlens"][-1])], dtype=meta["cu_seqlens"].dtype)  # both images attend together
    for key, wrong in (("interp_weights", meta["interp_weights"].flip(0)), ("position_ids", meta["position_ids"].flip(0)),
                       ("interp_indices", meta["interp_indices"].flip(0)), ("cu_seqlens", one_image)):
        assert not torch.equal(features(**{**meta, key: wrong})[0], want), key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_prefill_with_images_queues_without_a_host_synchronisation(processor):
    """A prefill's inputs travel from the host through pinned memory, the vision tower's metadata comes from the host
    and image tokens are placed by an index found there: no CUDA call of a prefill waits for the GPU (torch's sync debug
    mode raises at the first that would). The same requests run once before, so cuDNN's plans and the pinned blocks exist."""
    config = copy.deepcopy(TINY_QWEN3_VL_CONFIG)
    model = build_tiny_model(0, config).eval().to("cuda", torch.bfloat16)
    images = [image_input(processor, p) for p in two_pictures()]
    first, second = two_turn_ids(processor, images)
    requests = [(0, second, images), (1, first, images[:1])]
    decoder = SlotDecoder(model, slots=2, max_len=512, attn_bucket=64)
    want = decoder.prefill_many(requests)
    decoder.reset()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = decoder.prefill_many(requests)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_image_already_on_the_gpu_is_prefilled_as_it_is(processor):
    """Pixels a caller already moved to the GPU (bench/grpo_step.py's decoder check hands over the loss batch's) are
    not pinned (only host tensors can be): they go in as they are, and give the same logits as from the host."""
    assert torch.equal(host_to(torch.device("cuda"), torch.arange(3, device="cuda")).cpu(), torch.arange(3))
    model = build_tiny_model(0, copy.deepcopy(TINY_QWEN3_VL_CONFIG)).eval().to("cuda", torch.bfloat16)
    images = [image_input(processor, p) for p in two_pictures()]
    first, _ = two_turn_ids(processor, images)
    on_gpu = [ImageInput(im.pixel_values.cuda(), im.grid_thw, im.merge_size) for im in images[:1]]
    want = SlotDecoder(model, slots=1, max_len=512, attn_bucket=64).prefill(0, first, images[:1])
    got = SlotDecoder(model, slots=1, max_len=512, attn_bucket=64).prefill(0, first, on_gpu)
    assert torch.equal(got, want)


def test_host_to_leaves_a_cpu_copy_alone_off_cuda():
    tensor = torch.arange(4)
    assert host_to(torch.device("cpu"), tensor) is tensor
