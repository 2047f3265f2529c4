"""Qwen3-VL's token layout against the processor (ids, visual-token counts) and ``get_rope_index`` (positions)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from PIL import Image

from eogym_sft.models.layout import (
    expand_image_pads,
    expand_image_pads_and_mask,
    grid_token_count,
    grid_token_counts,
    image_factor,
    image_token_count,
    mrope_position_ids,
)
from eogym_sft.models.tiny import IMAGE_TOKEN_ID, TINY_QWEN3_VL_CONFIG, build_offline_processor, build_tiny_model

# (width, height) px: small ones the pixel floor scales up, odd sides, a thin strip, one the cap scales down
SIZES = [(64, 48), (40, 72), (33, 97), (500, 20), (300, 260)]
CAP = {"max_pixels": 65536, "min_pixels": 4096}


def _picture(size: tuple[int, int], seed: int) -> Image.Image:
    width, height = size
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8))


def _text(images: int) -> str:
    parts = "".join("<|vision_start|><|image_pad|><|vision_end|>look " for _ in range(images))
    return f"<|im_start|>user\n{parts}how many ships?<|im_end|>\n<|im_start|>assistant\nThree.<|im_end|>\n"


def _setup(merge_size: int):
    processor = build_offline_processor(**CAP)
    processor.image_processor.merge_size = merge_size
    config = copy.deepcopy(TINY_QWEN3_VL_CONFIG)
    config["vision_config"]["spatial_merge_size"] = merge_size
    return processor, build_tiny_model(0, config).eval()


@pytest.fixture(scope="module", params=[2, 3], ids=["merge2", "merge3"])
def setup(request):
    return request.param, *_setup(request.param)


def test_counts_ids_and_positions_equal_the_processor_and_get_rope_index(setup):
    merge_size, processor, model = setup
    pictures = [_picture(size, seed) for seed, size in enumerate(SIZES)]
    text = _text(len(pictures))
    inputs = processor(text=[text], images=pictures, return_tensors="pt")
    grid = inputs["image_grid_thw"]
    # the processor's own count: its <|image_pad|> run for each image, taken one image at a time
    alone = [processor(text=[_text(1)], images=[p])["input_ids"][0].count(IMAGE_TOKEN_ID) for p in pictures]
    patch = processor.image_processor.patch_size
    assert grid_token_counts(grid, merge_size) == alone
    assert [grid_token_count(tuple(g), merge_size) for g in grid.tolist()] == alone
    assert image_factor(processor) == patch * merge_size
    assert [image_token_count((h * patch, w * patch), image_factor(processor)) for _, h, w in grid.tolist()] == alone

    ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    expanded = expand_image_pads(ids, alone, IMAGE_TOKEN_ID)
    assert expanded == inputs["input_ids"][0].tolist()

    positions = mrope_position_ids(torch.tensor(expanded), grid, IMAGE_TOKEN_ID, merge_size)
    expected, _ = model.model.get_rope_index(inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"], image_grid_thw=grid)
    assert torch.equal(positions[1:], expected[:, 0])
    assert positions[0].tolist() == list(range(len(expanded)))


def test_mask_expands_with_the_ids_and_is_zero_on_image_tokens():
    ids, mask = [1, IMAGE_TOKEN_ID, 2, 3, IMAGE_TOKEN_ID, 4], [1, 1, 0, 1, 0, 1]
    assert expand_image_pads_and_mask(ids, mask, [3, 2], IMAGE_TOKEN_ID) == (
        [1, IMAGE_TOKEN_ID, IMAGE_TOKEN_ID, IMAGE_TOKEN_ID, 2, 3, IMAGE_TOKEN_ID, IMAGE_TOKEN_ID, 4],
        [1, 0, 0, 0, 0, 1, 0, 0, 1],
    )
    assert expand_image_pads(ids, [3, 2], IMAGE_TOKEN_ID) == expand_image_pads_and_mask(ids, mask, [3, 2], IMAGE_TOKEN_ID)[0]
    assert expand_image_pads([5, 6], [], IMAGE_TOKEN_ID) == [5, 6]


@pytest.mark.parametrize("counts", [[3], [3, 2, 1]])
def test_pads_and_images_that_differ_in_number_are_refused(counts):
    with pytest.raises(ValueError, match=f"the text has 2 <\\|image_pad\\|> tokens but {len(counts)} images were given"):
        expand_image_pads([1, IMAGE_TOKEN_ID, IMAGE_TOKEN_ID], counts, IMAGE_TOKEN_ID)
    with pytest.raises(ValueError, match=f"but {len(counts)} images"):
        expand_image_pads_and_mask([1, IMAGE_TOKEN_ID, IMAGE_TOKEN_ID], [0, 0, 0], counts, IMAGE_TOKEN_ID)


def test_mrope_position_ids_by_hand():
    # two text tokens, a 1x4x4-patch image (2x2 visual tokens after the 2x2 merge), two text tokens
    ids = torch.tensor([5, 6, IMAGE_TOKEN_ID, IMAGE_TOKEN_ID, IMAGE_TOKEN_ID, IMAGE_TOKEN_ID, 7, 8])
    got = mrope_position_ids(ids, torch.tensor([[1, 4, 4]]), IMAGE_TOKEN_ID, 2)
    expected = torch.tensor(
        [
            [0, 1, 2, 3, 4, 5, 6, 7],  # plain token index
            [0, 1, 2, 2, 2, 2, 4, 5],  # t: the image sits at position 2, text resumes at 2 + max(2, 2)
            [0, 1, 2, 2, 3, 3, 4, 5],  # h
            [0, 1, 2, 3, 2, 3, 4, 5],  # w
        ]
    )
    assert torch.equal(got, expected)
    assert torch.equal(mrope_position_ids(ids[:2], torch.zeros(0, 3, dtype=torch.long), IMAGE_TOKEN_ID, 2), torch.arange(2).expand(4, -1))


@pytest.mark.parametrize(
    "ids",
    [
        [5, IMAGE_TOKEN_ID, IMAGE_TOKEN_ID, IMAGE_TOKEN_ID, 7],  # one pad short
        [5, IMAGE_TOKEN_ID, IMAGE_TOKEN_ID, 6, IMAGE_TOKEN_ID, IMAGE_TOKEN_ID],  # the run broken by text
    ],
)
def test_an_image_without_its_whole_pad_run_is_refused(ids):
    with pytest.raises(ValueError, match="image 0 needs 4 <\\|image_pad\\|> tokens in a row at position 1"):
        mrope_position_ids(torch.tensor(ids), torch.tensor([[1, 4, 4]]), IMAGE_TOKEN_ID, 2)
