"""The slot decoder against the model's own forward: prefill, incremental turns with images, batched decode."""

from __future__ import annotations

import copy

import pytest
import torch
from PIL import Image

from eogym_sft.models.generation import (
    Sampling,
    SlotDecoder,
    expand_image_pads,
    image_input,
    rope_positions,
    vision_token_ids,
)
from eogym_sft.models.tiny import IMAGE_TOKEN_ID, TINY_QWEN3_VL_CONFIG, build_tiny_model


@pytest.fixture(scope="module")
def model():
    config = copy.deepcopy(TINY_QWEN3_VL_CONFIG)
    config["text_config"]["initializer_range"] = 1.0  # varied logits
    return build_tiny_model(0, config).eval()


def _pictures():
    return [Image.effect_noise((64, 48), 60).convert("RGB"), Image.effect_noise((40, 72), 60).convert("RGB")]


def _conversation(processor, turns: int):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many ships?"}]}]
    if turns > 1:
        messages += [
            {"role": "assistant", "content": "I crop the harbour."},
            {"role": "tool", "content": [{"type": "text", "text": '{"cropped_path": "c.png"}'}, {"type": "image"}]},
        ]
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _two_turns(processor, images):
    """Token ids of the one-image first turn and of the two-image second turn, image pads expanded."""
    tok = processor.tokenizer
    first = expand_image_pads(tok(_conversation(processor, 1), add_special_tokens=False)["input_ids"], images[:1], IMAGE_TOKEN_ID)
    second = expand_image_pads(tok(_conversation(processor, 2), add_special_tokens=False)["input_ids"], images, IMAGE_TOKEN_ID)
    return first, second


def _reference_logits(model, processor, text, pictures, extra=()):
    inputs = processor(text=[text], images=pictures, return_tensors="pt")
    ids = inputs["input_ids"][0].tolist() + list(extra)
    inputs["input_ids"] = torch.tensor([ids])
    inputs["attention_mask"] = torch.ones(1, len(ids), dtype=torch.long)
    inputs["mm_token_type_ids"] = torch.tensor([[int(t == IMAGE_TOKEN_ID) for t in ids]])
    with torch.no_grad():
        return model(**inputs).logits[0, -1], inputs


def test_ids_and_positions_equal_the_processor_and_get_rope_index(model, processor):
    text, pictures = _conversation(processor, 2), _pictures()
    images = [image_input(processor, p) for p in pictures]
    ids = expand_image_pads(processor.tokenizer(text, add_special_tokens=False)["input_ids"], images, IMAGE_TOKEN_ID)
    inputs = processor(text=[text], images=pictures, return_tensors="pt")
    assert ids == inputs["input_ids"][0].tolist()
    expected, _ = model.model.get_rope_index(
        inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"]
    )
    assert torch.equal(rope_positions(ids, images, IMAGE_TOKEN_ID), expected[:, 0])
    with pytest.raises(ValueError, match="2 images"):
        expand_image_pads(ids[:3], images, IMAGE_TOKEN_ID)


def test_prefill_turns_and_batched_decode_match_the_model(model, processor):
    pictures = _pictures()
    images = [image_input(processor, p) for p in pictures]
    first, second = _two_turns(processor, images)
    decoder = SlotDecoder(model, slots=3, max_len=512, attn_bucket=64)
    expected, _ = _reference_logits(model, processor, _conversation(processor, 1), pictures[:1])
    torch.testing.assert_close(decoder.prefill(1, first, images[:1]), expected, atol=1e-4, rtol=1e-4)
    assert decoder.warm_up() == 8  # one decode step per 64-token span of the 512-token slots; caches untouched
    for step, token in enumerate([5, 77, 1000]):  # decode after an image prompt
        order, logits = decoder.decode({1: token})
        expected, _ = _reference_logits(model, processor, _conversation(processor, 1), pictures[:1], [5, 77, 1000][: step + 1])
        assert order == [1]
        torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=1e-4)
    # the next turn (the tool's image included) reuses the cached prompt and recomputes only what differs
    expected, _ = _reference_logits(model, processor, _conversation(processor, 2), pictures)
    torch.testing.assert_close(decoder.prefill(1, second, images), expected, atol=1e-4, rtol=1e-4)
    assert decoder.tokens[1] == second
    # two slots at different lengths in one decode step
    decoder.prefill(0, first, images[:1])
    order, logits = decoder.decode({0: 5, 1: 9})
    one, _ = _reference_logits(model, processor, _conversation(processor, 1), pictures[:1], [5])
    two, _ = _reference_logits(model, processor, _conversation(processor, 2), pictures, [9])
    assert order == [0, 1]
    torch.testing.assert_close(logits, torch.stack([one, two]), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="do not fit"):
        decoder.prefill(2, [1] * 512, [])


def test_sampling_rules():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0], [3.0, 0.0, 0.0, 0.0]])
    assert Sampling().pick(logits, [5, 5], stop_ids=[1]) == [1, 0]
    assert Sampling(min_new_tokens=2).pick(logits, [0, 5], stop_ids=[1]) == [3, 0]  # the stop token held back
    generator = torch.Generator().manual_seed(0)
    picks = {tuple(Sampling(temperature=1.0, top_k=2).pick(logits, [5, 5], [1], generator)) for _ in range(50)}
    assert {p[0] for p in picks} == {1, 3}  # only the two best
    picks = {tuple(Sampling(temperature=1.0, top_p=0.5).pick(logits, [5, 5], [1], generator)) for _ in range(20)}
    assert picks == {(1, 0)}  # the top token alone holds more than half the mass
    assert Sampling().pick(logits, [5, 5], stop_ids=[1], banned_ids=[1, 0]) == [3, 2]  # never a banned token
    picks = {tuple(Sampling(temperature=1.0).pick(logits, [5, 5], [1], generator, banned_ids=[1])) for _ in range(50)}
    assert all(p[0] != 1 and p[1] != 1 for p in picks)


def test_vision_token_ids_are_the_qwen3_vl_vision_specials(processor):
    tokenizer = processor.tokenizer
    ids = vision_token_ids(tokenizer)
    assert tokenizer.convert_ids_to_tokens(ids) == ["<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
    assert IMAGE_TOKEN_ID in ids


def test_cuda_graphs_need_a_cuda_model_and_exclude_compile(model):
    if next(model.parameters()).device.type != "cuda":
        with pytest.raises(ValueError, match="CUDA device, not cpu"):
            SlotDecoder(model, slots=2, max_len=128, cuda_graphs=True)
    with pytest.raises(ValueError, match="choose one"):
        SlotDecoder(model, slots=2, max_len=128, compile="default", cuda_graphs=True)


def test_reset_empties_every_slot(model):
    decoder = SlotDecoder(model, slots=2, max_len=128, attn_bucket=64)
    decoder.prefill(0, [1, 2, 3], [])
    decoder.prefill(1, [4, 5], [])
    decoder.reset()
    assert decoder.tokens == [[], []] and decoder.next_pos == [0, 0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_replay_the_eager_step_exactly(processor):
    config = copy.deepcopy(TINY_QWEN3_VL_CONFIG)
    config["text_config"]["initializer_range"] = 1.0
    model = build_tiny_model(0, config).eval().cuda()
    pictures = _pictures()
    images = [image_input(processor, p) for p in pictures]
    first, second = _two_turns(processor, images)
    eager = SlotDecoder(model, slots=3, max_len=512, attn_bucket=64)
    graphed = SlotDecoder(model, slots=3, max_len=512, attn_bucket=64, cuda_graphs=True)
    for decoder in (eager, graphed):
        decoder.prefill(0, first, images[:1])
        decoder.prefill(2, second, images)
    # slots at different lengths, one idle, spans crossing a 64-token bucket: several graphs, each replayed
    for step in range(80):
        feed = {0: 5 + step, 2: 900 + step} if step % 3 else {2: 900 + step}
        order_e, logits_e = eager.decode(feed)
        order_g, logits_g = graphed.decode(feed)
        assert order_e == order_g
        torch.testing.assert_close(logits_g, logits_e, atol=1e-5, rtol=1e-5)
    assert len(graphed._step.graphs) >= 2
    for index in range(len(model.model.language_model.layers)):
        torch.testing.assert_close(graphed.keys[index][[0, 2]], eager.keys[index][[0, 2]], atol=1e-5, rtol=1e-5)
    graphed.reset()
    assert graphed._step.graphs == {} and graphed.tokens == [[], [], []]
