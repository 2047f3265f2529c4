"""``EOGymCollator``: exact labels for a multi-turn tool-use sample, Qwen3-VL position ids, padded and
padding-free giving the same loss, TRL-shaped and prepared inputs agreeing, and the errors it raises."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import sharpen, trained_spans
from PIL import Image

from eogym_sft.data.collator import EOGymCollator

# Small pixel caps keep images at a few visual tokens: a side that is already a multiple of 32 px and
# a pixel count inside [MIN_PIXELS, MAX_PIXELS] is not resized.
MIN_PIXELS, MAX_PIXELS = 1024, 16384
IMAGE_PAD = 151655
SYSTEM = "You are an EO analyst."
TOOL = {
    "type": "function",
    "function": {
        "name": "crop",
        "description": "Crop an image.",
        "parameters": {
            "type": "object",
            "properties": {"aoi": {"type": "array", "items": {"type": "number"}}},
            "required": ["aoi"],
        },
    },
}
TOOL_RESULT = '{"path": "image_cache/crops/c1.png"}'
ANSWER_1 = (
    "I crop the harbour.\n"
    '<tool_call>\n{"name": "crop", "arguments": {"aoi": [0.1, 0.2, 0.5, 0.6]}}\n</tool_call><|im_end|>'
)
ANSWER_2 = "I count the hulls.\nFinal Answer: 3<|im_end|>"


def _image(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8))


def tool_use_messages() -> list[dict]:
    """system, user with an image, assistant tool call, tool result with an image, final answer (TRL shape)."""
    return [
        {"role": "system", "content": SYSTEM},
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "How many ships are in the harbour?"}],
        },
        {
            "role": "assistant",
            "content": "I crop the harbour.",
            "tool_calls": [
                {"type": "function", "function": {"name": "crop", "arguments": {"aoi": [0.1, 0.2, 0.5, 0.6]}}}
            ],
        },
        {"role": "tool", "content": [{"type": "text", "text": TOOL_RESULT}, {"type": "image"}]},
        {"role": "assistant", "content": "I count the hulls.\nFinal Answer: 3"},
    ]


def tool_use_example() -> dict:
    # 64x64 -> grid (1, 4, 4) -> 4 visual tokens; 96 wide x 64 high -> grid (1, 4, 6) -> 6 visual tokens
    return {"messages": tool_use_messages(), "images": [_image(64, 64, 1), _image(96, 64, 2)], "tools": [TOOL]}


def short_example(n: int, images: list) -> dict:
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": "Where is the port? " * n}]
    return {
        "messages": [
            {"role": "user", "content": content},
            {"role": "assistant", "content": "Final Answer: " + "north " * n},
        ],
        "images": images,
    }


def three_examples() -> list[dict]:
    """Three different lengths, with two images, none, and one image."""
    return [tool_use_example(), short_example(4, []), short_example(1, [_image(32, 96, 3)])]


@pytest.fixture(scope="module")
def processor_at_cap(capped_processor):
    """The offline processor carrying this module's pixel cap: data prep and the collator read it from there."""
    return capped_processor(MAX_PIXELS, MIN_PIXELS)


@pytest.fixture(scope="module")
def collator(processor_at_cap):
    return EOGymCollator(processor_at_cap)


@pytest.fixture(scope="module")
def packing_collator(processor_at_cap):
    return EOGymCollator(processor_at_cap, padding_free=True)


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    model.config.use_cache = False
    return model


@pytest.fixture(scope="module")
def sharp_model():
    """The tiny Qwen3-VL with larger random weights: its logits are far from uniform, so that a token
    attending across samples changes the loss by much more than the tolerance (checked below)."""
    from eogym_sft.models.tiny import build_tiny_model

    return sharpen(build_tiny_model(seed=1), seed=1)


# ---- exact labels --------------------------------------------------------------------------------


def expected_layout(tokenizer, image_tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The sample's input ids and labels, built from hand-written text segments of the Qwen3-VL template."""
    tools_block = (
        "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(TOOL)
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
    segments = [  # (kind, text): context, trained, or an image's placeholder run
        ("context", "<|im_start|>system\n" + SYSTEM + tools_block + "<|im_end|>\n<|im_start|>user\n<|vision_start|>"),
        ("image", image_tokens[0]),
        ("context", "<|vision_end|>How many ships are in the harbour?<|im_end|>\n<|im_start|>assistant\n"),
        ("trained", ANSWER_1),
        ("context", "\n<|im_start|>user\n<tool_response>\n" + TOOL_RESULT + "<|vision_start|>"),
        ("image", image_tokens[1]),
        ("context", "<|vision_end|>\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
        ("trained", ANSWER_2),
        ("context", "\n"),
    ]
    ids, labels = [], []
    for kind, value in segments:
        if kind == "image":
            ids += [IMAGE_PAD] * value
            labels += [-100] * value
            continue
        piece = tokenizer(value, add_special_tokens=False)["input_ids"]
        ids += piece
        labels += piece if kind == "trained" else [-100] * len(piece)
    return torch.tensor([ids]), torch.tensor([labels])


def test_exact_labels_of_a_multi_turn_tool_use_sample(collator, processor):
    batch = collator([tool_use_example()])
    grid = batch["image_grid_thw"]
    assert grid.tolist() == [[1, 4, 4], [1, 4, 6]]
    image_tokens = (grid.prod(-1) // 4).tolist()
    assert image_tokens == [4, 6]
    expected_ids, expected_labels = expected_layout(processor.tokenizer, image_tokens)
    assert torch.equal(batch["input_ids"], expected_ids), processor.tokenizer.decode(batch["input_ids"][0])
    assert torch.equal(batch["labels"], expected_labels)
    assert torch.equal(batch["attention_mask"], torch.ones_like(expected_ids))
    assert torch.equal(batch["mm_token_type_ids"], (expected_ids == IMAGE_PAD).int())
    assert batch["pixel_values"].shape == (16 + 24, 3 * 2 * 16 * 16)  # patches x (channels * temporal * 16 * 16)
    spans = [processor.tokenizer.decode(span) for span in trained_spans(batch["labels"][0])]
    assert spans == [ANSWER_1, ANSWER_2]


def test_padding_free_labels_match_padded(collator, packing_collator):
    examples = three_examples()
    padded, packed = collator(examples), packing_collator(examples)
    lengths = padded["attention_mask"].sum(1).tolist()
    assert packed["input_ids"].shape == (1, sum(lengths))
    assert "attention_mask" not in packed
    rows = [padded["labels"][b, :n] for b, n in enumerate(lengths)]
    assert torch.equal(packed["labels"][0], torch.cat(rows))
    assert torch.equal(packed["input_ids"][0], torch.cat([padded["input_ids"][b, :n] for b, n in enumerate(lengths)]))
    assert torch.equal(packed["pixel_values"], padded["pixel_values"])
    assert torch.equal(packed["image_grid_thw"], padded["image_grid_thw"])
    # right padding: pad id, label -100, mask 0, position 0
    b = lengths.index(min(lengths))
    n = lengths[b]
    assert (padded["input_ids"][b, n:] == collator.pad_token_id).all()
    assert (padded["labels"][b, n:] == -100).all() and (padded["attention_mask"][b, n:] == 0).all()
    assert (padded["position_ids"][:, b, n:] == 0).all()


def test_first_token_of_each_packed_sample_is_not_trained(processor):
    # prepared-shaped samples trained from their very first token: packing must not predict a sample's
    # first token from the previous sample's last one
    examples = [
        {"input_ids": [11, 12, 13], "assistant_masks": [1, 1, 1]},
        {"input_ids": [14, 15], "assistant_masks": [1, 1]},
        {"input_ids": [16, 17, 18, 19], "assistant_masks": [1, 0, 1, 1]},
    ]
    packed = EOGymCollator(processor, padding_free=True)(examples)
    assert torch.equal(packed["labels"], torch.tensor([[-100, 12, 13, -100, 15, -100, -100, 18, 19]]))
    assert torch.equal(packed["input_ids"], torch.tensor([[11, 12, 13, 14, 15, 16, 17, 18, 19]]))
    assert packed["position_ids"][0, 0].tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert torch.equal(packed["position_ids"][1:], packed["position_ids"][:1].expand(3, -1, -1))
    padded = EOGymCollator(processor, pad_to_multiple_of=8)(examples)
    assert torch.equal(
        padded["labels"],
        torch.tensor([[11, 12, 13] + [-100] * 5, [14, 15] + [-100] * 6, [16, -100, 18, 19] + [-100] * 4]),
    )
    assert padded["attention_mask"].sum(1).tolist() == [3, 2, 4]


# ---- position ids --------------------------------------------------------------------------------


def test_position_ids_equal_get_rope_index(collator, packing_collator, tiny_model):
    examples = three_examples()
    padded = collator(examples)
    expected, _ = tiny_model.model.get_rope_index(
        padded["input_ids"],
        padded["mm_token_type_ids"],
        padded["image_grid_thw"],
        attention_mask=padded["attention_mask"],
    )
    assert torch.equal(padded["position_ids"][1:], expected)
    lengths = padded["attention_mask"].sum(1)
    text_rows = torch.arange(padded["input_ids"].shape[1])[None] * padded["attention_mask"]
    assert torch.equal(padded["position_ids"][0], text_rows)

    packed = packing_collator(examples)
    start = 0
    for example, n in zip(examples, lengths.tolist()):
        alone = collator([example])
        want, _ = tiny_model.model.get_rope_index(
            alone["input_ids"], alone["mm_token_type_ids"], alone.get("image_grid_thw")
        )
        assert torch.equal(packed["position_ids"][1:, :, start : start + n], want)
        assert packed["position_ids"][0, 0, start : start + n].tolist() == list(range(n))
        start += n


# ---- padded and padding-free give the same loss -----------------------------------------------


@pytest.mark.parametrize("which", ["tiny_model", "sharp_model"])
def test_padded_and_padding_free_give_the_same_loss(collator, packing_collator, request, which):
    model = request.getfixturevalue(which)
    examples = three_examples()
    padded, packed = collator(examples), packing_collator(examples)
    with torch.no_grad():
        loss_padded = model(**padded, use_cache=False).loss
        loss_packed = model(**packed, use_cache=False).loss
    assert abs(loss_padded.item() - loss_packed.item()) < 1e-5
    # the padded loss is the token mean over the very same supervised tokens
    assert int((padded["labels"][:, 1:] != -100).sum()) == int((packed["labels"][:, 1:] != -100).sum())
    if which == "sharp_model":
        # the check is sensitive: positions that do not restart per sample let tokens attend across samples
        leaky = dict(packed, position_ids=packed["position_ids"].clone())
        leaky["position_ids"][0, 0] = torch.arange(packed["input_ids"].shape[1])
        with torch.no_grad():
            loss_leaky = model(**leaky, use_cache=False).loss
        assert abs(loss_leaky.item() - loss_packed.item()) > 1e-3


def test_pixels_in_the_models_dtype_give_the_model_the_same_values(packing_collator, processor_at_cap, tiny_model_dir):
    """``pixel_dtype``: the processor's float32 pixels cast per sample, bit for bit; a bf16 Qwen3-VL gives the same
    loss for them as for float32 pixels, which its vision tower casts to bf16 first thing."""
    from transformers import AutoModelForImageTextToText

    examples = three_examples()
    f32 = packing_collator(examples)
    bf16_collator = EOGymCollator(processor_at_cap, padding_free=True, pixel_dtype=torch.bfloat16)
    bf16 = bf16_collator(examples)
    assert f32["pixel_values"].dtype == torch.float32 and bf16["pixel_values"].dtype == torch.bfloat16
    assert torch.equal(bf16["pixel_values"], f32["pixel_values"].to(torch.bfloat16))
    assert not torch.equal(bf16["pixel_values"].float(), f32["pixel_values"])  # the cast does round these pixels
    assert all(torch.equal(bf16[k], f32[k]) for k in f32 if k != "pixel_values")
    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        assert torch.equal(model(**bf16, use_cache=False).loss, model(**f32, use_cache=False).loss)


# ---- TRL-shaped and prepared inputs ------------------------------------------------------------------


def _save(root: Path, rel: str, image: Image.Image) -> str:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return rel


def test_trl_shaped_examples_match_prepared_samples(processor, processor_at_cap, tmp_path):
    from eogym_sft.data.prepare import PrepConfig, prepare_line

    scene = _save(tmp_path, "EO_GYM_DATA/s1/scene.png", _image(64, 64, 1))
    crop = _save(tmp_path, "image_cache/crops/c1.png", _image(96, 64, 2))
    row = {  # the EO-Gym (OpenAI) dialect: <image> tag, JSON-string arguments, an image path in the tool result
        "id": "row-1",
        "images": [scene],
        "tools": [TOOL],
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "<image>How many ships are in the harbour?"},
            {
                "role": "assistant",
                "content": "I crop the harbour.",
                "tool_calls": [
                    {
                        "id": "c0",
                        "type": "function",
                        "function": {"name": "crop", "arguments": json.dumps({"aoi": [0.1, 0.2, 0.5, 0.6]})},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c0", "content": TOOL_RESULT},
            {"role": "assistant", "content": "I count the hulls.\nFinal Answer: 3"},
        ],
    }
    cfg = PrepConfig(data_root=str(tmp_path))
    result = prepare_line(processor_at_cap, cfg, "rows.jsonl", 1, json.dumps(row).encode())
    assert result.status == "kept", result
    (prepared,) = result.samples
    assert prepared["images"] == [scene, crop] and prepared["image_hw"] == [[64, 64], [64, 96]]

    collator = EOGymCollator(processor_at_cap, data_root=str(tmp_path))
    from_prepared = collator([prepared])
    pil = [Image.open(tmp_path / scene), Image.open(tmp_path / crop)]
    as_list = {"messages": tool_use_messages(), "images": pil, "tools": [TOOL]}
    as_strings = {"messages": json.dumps(tool_use_messages()), "images": [scene, crop], "tools": json.dumps([TOOL])}
    for example in (as_list, as_strings):
        batch = collator([example])
        assert batch.keys() == from_prepared.keys()
        for key in batch:
            assert torch.equal(batch[key], from_prepared[key]), key
    # and both are the hand-built layout
    expected_ids, expected_labels = expected_layout(processor.tokenizer, [4, 6])
    assert torch.equal(from_prepared["input_ids"], expected_ids)
    assert torch.equal(from_prepared["labels"], expected_labels)


def test_trl_example_without_tools_or_images(collator, processor):
    batch = collator(
        [
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                    {"role": "assistant", "content": "Hello."},
                ]
            }
        ]
    )
    assert "pixel_values" not in batch and "image_grid_thw" not in batch
    text = processor.tokenizer.decode(batch["input_ids"][0])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
    assert processor.tokenizer.decode(batch["labels"][batch["labels"] != -100]) == "Hello.<|im_end|>"


# ---- errors ---------------------------------------------------------------------------------------


def test_image_count_mismatch_names_the_sample(collator):
    one_image_short = dict(tool_use_example(), sample_id="trace-7#w0")
    one_image_short["images"] = one_image_short["images"][:1]
    with pytest.raises(ValueError, match=r"trace-7#w0: 2 image placeholders in the text but 1 images"):
        collator([short_example(1, []), one_image_short])
    unnamed = dict(short_example(1, []), images=[_image(32, 32)])
    with pytest.raises(ValueError, match=r"example 1 of the batch: 0 image placeholders"):
        collator([short_example(1, []), unnamed])


def test_over_max_length_is_an_error_that_points_to_data_prep(processor_at_cap):
    collator = EOGymCollator(processor_at_cap, max_length=64)
    length = EOGymCollator(processor_at_cap)([tool_use_example()])["input_ids"].shape[1]
    assert length > 64
    with pytest.raises(ValueError, match=rf"long-1: {length} tokens is over max_length=64.*eogym-sft prepare"):
        collator([dict(tool_use_example(), id="long-1")])
    exact = EOGymCollator(processor_at_cap, max_length=length)
    assert exact([tool_use_example()])["input_ids"].shape[1] == length  # the limit itself is allowed


def test_prepared_image_sizes_must_match_the_processors_pixel_cap(processor_at_cap, capped_processor, tmp_path):
    from eogym_sft.data.prepare import PrepConfig, prepare_line

    scene = _save(tmp_path, "EO_GYM_DATA/s1/big.png", _image(128, 128, 4))
    row = {
        "id": "big-1",
        "images": [scene],
        "messages": [
            {"role": "user", "content": "<image>Ships?"},
            {"role": "assistant", "content": "Final Answer: 2"},
        ],
    }
    cfg = PrepConfig(data_root=str(tmp_path))
    (sample,) = prepare_line(processor_at_cap, cfg, "rows.jsonl", 1, json.dumps(row).encode()).samples
    assert sample["image_hw"] == [[128, 128]]
    same = EOGymCollator(processor_at_cap, data_root=str(tmp_path))
    assert same([sample])["image_grid_thw"].tolist() == [[1, 8, 8]]
    smaller_cap = EOGymCollator(capped_processor(4096, MIN_PIXELS), data_root=str(tmp_path))
    with pytest.raises(
        ValueError,
        match=r"big-1#w0: images resize to \[\[64, 64\]\] but data prep planned \[\[128, 128\]\]: the processor's "
        r"pixel cap \(max_pixels=4096, min_pixels=1024\) differs from prep's.*load_processor\(model, max_pixels=",
    ):
        smaller_cap([sample])


def test_images_are_resized_to_the_processors_cap_and_the_collator_takes_none_of_its_own(capped_processor):
    """The processor carries the cap: its ``longest_edge`` bounds an image's pixels, its ``shortest_edge`` lifts a
    small one; a cap handed to the collator is refused, not quietly preferred or ignored."""
    large, small = short_example(1, [_image(320, 256)]), short_example(1, [_image(16, 16)])
    grids = {
        cap: [EOGymCollator(capped_processor(*cap))([ex])["image_grid_thw"].tolist() for ex in (large, small)]
        for cap in [(16384, 1024), (4096, 1024), (16384, 4096)]
    }
    assert grids == {  # smart_resize at 32 px: 320x256 scaled by 1/sqrt(5) or 1/sqrt(20); 16x16 up to 32 or 64 px
        (16384, 1024): [[[1, 6, 8]], [[1, 2, 2]]],
        (4096, 1024): [[[1, 2, 4]], [[1, 2, 2]]],
        (16384, 4096): [[[1, 6, 8]], [[1, 4, 4]]],
    }
    for field in ("max_pixels", "min_pixels"):
        with pytest.raises(TypeError, match=field):
            EOGymCollator(capped_processor(4096, 1024), **{field: 4096})


# ---- images that fail after data prep ---------------------------------------------------------------


def _prepared_with_images(processor, root: Path) -> list[dict]:
    """Three prepared samples, each with its own 64x64 scene."""
    from eogym_sft.data.prepare import PrepConfig, prepare_line

    samples = []
    for i in range(3):
        scene = _save(root, f"EO_GYM_DATA/s{i}/scene.png", _image(64, 64, i))
        row = {"id": f"scene-{i}", "images": [scene], "messages": [{"role": "user", "content": "<image>Ships?"}, {"role": "assistant", "content": f"Final Answer: {i}"}]}
        cfg = PrepConfig(data_root=str(root))
        samples += prepare_line(processor, cfg, "rows.jsonl", i + 1, json.dumps(row).encode()).samples
    return samples


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "packed"])
def test_an_image_broken_after_prep_names_the_sample_or_is_skipped(processor_at_cap, tmp_path, padding_free):
    from eogym_sft.data.images import ImageError

    samples = _prepared_with_images(processor_at_cap, tmp_path)
    strict = EOGymCollator(processor_at_cap, data_root=str(tmp_path), padding_free=padding_free)
    skipping = EOGymCollator(processor_at_cap, data_root=str(tmp_path), padding_free=padding_free, skip_bad_images=True)
    want = strict([samples[1]])
    cut = tmp_path / "EO_GYM_DATA/s0/scene.png"
    cut.write_bytes(cut.read_bytes()[:200])  # cut short after prep
    _save(tmp_path, "EO_GYM_DATA/s2/scene.png", _image(128, 64, 2))  # replaced by a larger image after prep
    with pytest.raises(ImageError, match=r"corrupt_image: .*s0/scene.png: .*\(sample scene-0#w0\)"):
        strict(samples)
    got = skipping(samples)
    assert [(r["index"], r["sample_id"], r["reason"]) for r in got.pop("skipped_samples")] == [
        (0, "scene-0#w0", "corrupt_image"),
        (2, "scene-2#w0", "image_changed"),
    ]
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    # every sample skipped: one untrained padding token, so that the step still runs on every rank
    empty = skipping([samples[0], samples[2]])
    assert len(empty.pop("skipped_samples")) == 2
    pad = processor_at_cap.tokenizer.pad_token_id
    assert empty["input_ids"].tolist() == [[pad]] and empty["labels"].tolist() == [[-100]]
    assert empty["position_ids"].tolist() == [[[0]]] * 4 and "pixel_values" not in empty


# ---- host layout ---------------------------------------------------------------------------------


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "packed"])
def test_the_host_layout_holds_what_the_forward_reads_back(processor_at_cap, tiny_model, padding_free):
    """``host_layout=True`` adds a :class:`HostLayout`: the supervised positions, the samples' boundaries from the text
    position row (a padded row's pads are samples of their own, as the text tower's hook finds them), the images' grid
    and the vision tower's metadata, with which the tower's output is the one it computes by itself, bit for bit."""
    from eogym_sft.models.attention import sample_boundaries
    from eogym_sft.models.host_layout import HostLayout, VisionGeometry, supervised_positions

    examples = [
        {"messages": tool_use_messages(), "images": [_image(64, 64), _image(32, 96, seed=1)]},
        {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Sea?"}]},
                      {"role": "assistant", "content": "Final Answer: yes"}], "images": [_image(96, 32, seed=2)]},
    ]
    collator = EOGymCollator(processor_at_cap, padding_free=padding_free, host_layout=True, vision=VisionGeometry.of(tiny_model))
    batch = collator(examples)
    layout = batch["host_layout"]
    assert isinstance(layout, HostLayout) and not torch.is_tensor(layout)
    assert torch.equal(layout.supervised, supervised_positions(batch["labels"])) and layout.supervised.numel() > 0
    cu, longest = sample_boundaries(batch["position_ids"][0])
    assert torch.equal(layout.cu_seq_lens, cu) and layout.max_length == longest
    assert layout.image_grid_thw is batch["image_grid_thw"]
    tower = tiny_model.model.visual
    with torch.no_grad():
        own = tower(batch["pixel_values"], grid_thw=batch["image_grid_thw"])
        fed = tower(batch["pixel_values"], grid_thw=batch["image_grid_thw"], **{k: v for k, v in layout.vision.items() if v is not None})
    assert torch.equal(fed.pooler_output, own.pooler_output)
    assert all(torch.equal(a, b) for a, b in zip(fed.deepstack_features, own.deepstack_features))
    assert "host_layout" not in EOGymCollator(processor_at_cap, padding_free=padding_free)(examples)  # off by default


def test_the_host_layout_is_left_on_the_host_by_the_trainer_and_accelerate(processor_at_cap):
    """It is no tensor and has no ``to``: accelerate's ``send_to_device`` and the Trainer's ``_prepare_input`` hand
    back the same object, and it pickles (DataLoader workers send batches to the training process that way)."""
    import pickle

    from accelerate.utils import send_to_device
    from transformers import Trainer

    batch = EOGymCollator(processor_at_cap, padding_free=True, host_layout=True)([{"messages": tool_use_messages(), "images": [_image(64, 64), _image(32, 96, seed=1)]}])
    layout = batch["host_layout"]
    assert not hasattr(layout, "to")
    assert send_to_device(batch, "cpu")["host_layout"] is layout
    assert send_to_device(batch, "meta")["host_layout"] is layout and send_to_device(batch, "meta")["input_ids"].is_meta
    trainer = Trainer.__new__(Trainer)
    trainer.args = type("Args", (), {"device": torch.device("meta")})()
    trainer.is_deepspeed_enabled = False
    assert trainer._prepare_input(batch)["host_layout"] is layout
    back = pickle.loads(pickle.dumps(layout))
    assert torch.equal(back.supervised, layout.supervised) and torch.equal(back.cu_seq_lens, layout.cu_seq_lens)
