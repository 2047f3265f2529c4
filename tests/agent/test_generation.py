"""The slot decoder against the model's own forward: prefill, incremental turns with images, batched decode."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from eogym_sft.agent.generation import (
    GraphedStep,
    Sampling,
    common_prefix,
    draw,
    SlotDecoder,
    image_input,
    parameter_storage,
    vision_token_ids,
)
from eogym_sft.models.layout import expand_image_pads, mrope_position_ids
from eogym_sft.models.tiny import IMAGE_TOKEN_ID, TINY_QWEN3_VL_CONFIG, build_tiny_model


@pytest.fixture(scope="module")
def model():
    config = copy.deepcopy(TINY_QWEN3_VL_CONFIG)
    config["text_config"]["initializer_range"] = 1.0  # varied logits
    return build_tiny_model(0, config).eval()


def _noise(size: tuple[int, int], sigma: float, seed: int) -> Image.Image:
    """Seeded grey noise around 128 (``Image.effect_noise`` draws from an unseeded generator, which made the
    logit comparisons below pass or fail by the draw)."""
    width, height = size
    pixels = np.random.default_rng(seed).normal(128, sigma, (height, width)).clip(0, 255).astype(np.uint8)
    return Image.fromarray(pixels).convert("RGB")


# A slot decoder against one that computed more (or in another batch): the same numbers up to float32's order of
# summation, which the other shape changes (measured up to 2.9e-5 on logits of this model); a wrong cache is O(1) off.
ANOTHER_SHAPE = {"atol": 1e-4, "rtol": 1e-4}


def _pictures():
    return [_noise((64, 48), 60, 0), _noise((40, 72), 60, 1)]


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
    counts = [im.tokens for im in images]
    first = expand_image_pads(tok(_conversation(processor, 1), add_special_tokens=False)["input_ids"], counts[:1], IMAGE_TOKEN_ID)
    second = expand_image_pads(tok(_conversation(processor, 2), add_special_tokens=False)["input_ids"], counts, IMAGE_TOKEN_ID)
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
    ids = expand_image_pads(processor.tokenizer(text, add_special_tokens=False)["input_ids"], [im.tokens for im in images], IMAGE_TOKEN_ID)
    inputs = processor(text=[text], images=pictures, return_tensors="pt")
    assert ids == inputs["input_ids"][0].tolist()
    expected, _ = model.model.get_rope_index(
        inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"]
    )
    grids = torch.tensor([im.grid_thw for im in images])
    assert torch.equal(mrope_position_ids(torch.tensor(ids), grids, IMAGE_TOKEN_ID, 2)[1:], expected[:, 0])
    with pytest.raises(ValueError, match="2 images"):
        expand_image_pads(ids[:3], [im.tokens for im in images], IMAGE_TOKEN_ID)


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


# the GPU host's first examples are slow to generate (a process busy with CUDA tests): not what this test checks
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(st.integers(0, 2), max_size=40), st.lists(st.integers(0, 2), max_size=40))
def test_common_prefix_is_the_length_of_the_equal_start(a, b):
    limit = min(len(a), len(b))
    naive = next((i for i in range(limit) if a[i] != b[i]), limit)
    assert common_prefix(a, b, limit) == naive
    assert common_prefix(a, b, min(limit, 3)) == min(naive, 3)


def test_draw_samples_in_proportion_to_the_weights_and_never_a_zero_weight():
    weights = torch.tensor([[0.0, 1.0, 0.0, 3.0, 0.0]]).repeat(40000, 1)  # zero weights first, between and last
    picks = torch.tensor(draw(weights, torch.Generator().manual_seed(0)))
    counts = torch.bincount(picks, minlength=5).tolist()
    assert counts[0] == counts[2] == counts[4] == 0
    assert abs(counts[1] / 40000 - 0.25) < 0.01 and abs(counts[3] / 40000 - 0.75) < 0.01
    assert draw(torch.tensor([[0.0, 0.0, 2.0]]), torch.Generator().manual_seed(1)) == [2]


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


def test_a_refilled_slot_does_not_keep_the_previous_image(model, processor):
    """Two images of one size give the same token ids: the slot must recompute from the image, and its
    logits equal a fresh decoder's (before the fix they differed and the argmax changed)."""
    pictures = [_noise((64, 48), 60, 2), _noise((64, 48), 90, 3)]
    first, other = [image_input(processor, p) for p in pictures]
    text_ids = processor.tokenizer(_conversation(processor, 1), add_special_tokens=False)["input_ids"]
    ids = expand_image_pads(text_ids, [first.tokens], IMAGE_TOKEN_ID)
    assert ids == expand_image_pads(text_ids, [other.tokens], IMAGE_TOKEN_ID)
    refilled = SlotDecoder(model, slots=1, max_len=256, attn_bucket=64)
    stale = refilled.prefill(0, ids, [first])
    logits = refilled.prefill(0, ids, [other])
    image_at = ids.index(IMAGE_TOKEN_ID)
    assert refilled.last_prefill_tokens == len(ids) - image_at  # the text before the image is reused
    fresh = SlotDecoder(model, slots=1, max_len=256, attn_bucket=64).prefill(0, ids, [other])
    torch.testing.assert_close(logits, fresh, **ANOTHER_SHAPE)
    assert (stale - fresh).abs().max() > 0.1  # the images differ enough for a stale cache to show
    expected, _ = _reference_logits(model, processor, _conversation(processor, 1), pictures[1:])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    # the very same image object is reused: only the last token is recomputed
    refilled.prefill(0, ids, [other])
    assert refilled.last_prefill_tokens == 1


def test_a_refilled_slot_recomputes_from_the_first_image_that_differs(model, processor):
    pictures = _pictures()
    images = [image_input(processor, p) for p in pictures]
    _, second = _two_turns(processor, images)
    swapped = image_input(processor, _noise((40, 72), 30, 4))  # the tool image, same size
    decoder = SlotDecoder(model, slots=1, max_len=512, attn_bucket=64)
    decoder.prefill(0, second, images)
    logits = decoder.prefill(0, second, [images[0], swapped])
    second_image_at = len(second) - second[::-1].index(IMAGE_TOKEN_ID) - swapped.tokens
    assert decoder.last_prefill_tokens == len(second) - second_image_at
    fresh = SlotDecoder(model, slots=1, max_len=512, attn_bucket=64).prefill(0, second, [images[0], swapped])
    torch.testing.assert_close(logits, fresh, **ANOTHER_SHAPE)


def test_a_slot_copies_the_prompt_another_slot_holds_and_gives_its_own_logits(model, processor):
    """The samples of one question: the second slot copies the first's keys and values of the shared prompt
    and computes only what differs; its logits equal a decoder that computed everything. A prompt with
    another image object of the same size shares only the text before the image."""
    pictures = _pictures()
    images = [image_input(processor, p) for p in pictures]
    first, second = _two_turns(processor, images)
    decoder = SlotDecoder(model, slots=3, max_len=512, attn_bucket=64)
    decoder.prefill(0, second, images)
    logits = decoder.prefill(1, first, images[:1])  # a prefix of slot 0's sequence
    assert decoder.last_prefill_tokens == 1
    fresh = SlotDecoder(model, slots=1, max_len=512, attn_bucket=64).prefill(0, first, images[:1])
    torch.testing.assert_close(logits, fresh, **ANOTHER_SHAPE)
    order, stepped = decoder.decode({1: 7})  # the copied cache decodes as a computed one
    reference = SlotDecoder(model, slots=1, max_len=512, attn_bucket=64)
    reference.prefill(0, first, images[:1])
    torch.testing.assert_close(stepped, reference.decode({0: 7})[1], **ANOTHER_SHAPE)
    other = image_input(processor, _noise((64, 48), 30, 5))  # same size, other pixels
    logits = decoder.prefill(2, first, [other])
    assert decoder.last_prefill_tokens == len(first) - first.index(IMAGE_TOKEN_ID)
    fresh = SlotDecoder(model, slots=1, max_len=512, attn_bucket=64).prefill(0, first, [other])
    torch.testing.assert_close(logits, fresh, **ANOTHER_SHAPE)


def test_clearing_graphs_drops_their_pool():
    """Capturing into the pool of freed graphs trips the CUDA allocator's use_count assert: an arm switch
    (reset) must start a fresh pool."""
    step = GraphedStep(lambda *args: None, slots=2, device="cpu")
    step.graphs[64], step.pool = ("graph", "logits"), (0, 1)
    step.clear()
    assert step.graphs == {} and step.pool is None


class _StandInGraph:
    """What a captured graph does for the weights check (capture itself needs a GPU): it replays."""

    replays = 0

    def replay(self):
        self.replays += 1


def _graphed_on_cpu(step, watched) -> GraphedStep:
    graphed = GraphedStep(step, slots=2, device="cpu", watched=watched)
    graphed._capture = lambda span: (_StandInGraph(), f"logits {span}")
    return graphed


def test_graphs_are_dropped_when_a_parameter_is_replaced_not_updated_in_place():
    layer = torch.nn.Linear(4, 3)
    graphed = _graphed_on_cpu(lambda *args: None, (layer,))
    zeros = torch.zeros(2, dtype=torch.long)
    assert graphed(zeros, zeros, zeros, zeros, 64) == "logits 64"
    assert graphed.storage == parameter_storage([layer]) and [name for name, *_ in graphed.storage] == ["weight", "bias"]
    with torch.no_grad():
        layer.weight.add_(1.0)  # an optimizer step: same storage, the graph sees the new values
    assert graphed.check_weights() is False and list(graphed.graphs) == [64]
    graphed(zeros, zeros, zeros, zeros, 128)  # a second graph is checked against the first one's weights
    layer.weight = torch.nn.Parameter(layer.weight.detach().clone())  # replaced: the graphs would read the old one
    assert graphed.check_weights() is True and graphed.graphs == {} and graphed.storage is None
    graphed(zeros, zeros, zeros, zeros, 64)
    layer.bias.data = torch.zeros(3)  # storage swapped under the same Parameter
    assert graphed.check_weights() is True and graphed.graphs == {}
    assert graphed.check_weights() is False  # no graphs: nothing to check


def test_a_run_of_episodes_recaptures_after_the_weights_moved(processor, tmp_path):
    from eogym_sft.agent.episodes import LoopConfig, run_episodes

    decoder = SlotDecoder(build_tiny_model(0).eval(), slots=2, max_len=128, attn_bucket=64)
    decoder._step = _graphed_on_cpu(decoder._decode_step, (decoder.text, decoder.lm_head))
    zeros = torch.zeros(2, dtype=torch.long)
    decoder._step(zeros, zeros, zeros, zeros + 1, 64)

    def run() -> None:
        run_episodes(decoder, processor, iter([]), Sampling(), LoopConfig(2, 8), tmp_path, lambda episode: None)

    run()
    assert list(decoder._step.graphs) == [64]  # unchanged weights: the graphs stay
    decoder.lm_head.weight = torch.nn.Parameter(decoder.lm_head.weight.detach().clone())
    decoder.prefill(1, [4, 5], [])  # within a run the weights are not checked again (a walk over every parameter)
    assert list(decoder._step.graphs) == [64]
    run()
    assert decoder._step.graphs == {}


def test_reset_empties_every_slot(model):
    decoder = SlotDecoder(model, slots=2, max_len=128, attn_bucket=64)
    decoder.prefill(0, [1, 2, 3], [])
    decoder.prefill(1, [4, 5], [])
    decoder.reset()
    assert decoder.tokens == [[], []] and decoder.next_pos == [0, 0] and decoder.images == [[], []]


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
    assert graphed._step.graphs == {} and graphed._step.pool is None and graphed.tokens == [[], [], []]


def _greedy(decoder, ids, images, steps: int) -> list[int]:
    token = int(decoder.prefill(0, ids, images).argmax())
    out = [token]
    for _ in range(steps):
        _, logits = decoder.decode({0: token})
        token = int(logits[0].argmax())
        out.append(token)
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_across_the_base_and_two_adapters_equal_eager(processor):
    """The rollout's arm loop: base, then two adapters, the decoder reset between arms. Capturing the second
    arm's graphs crashed (use_count > 0 assert); each arm's greedy tokens must equal the eager step's."""
    from peft import LoraConfig, get_peft_model

    from eogym_sft.models.loading import Arm, use_arm

    config = copy.deepcopy(TINY_QWEN3_VL_CONFIG)
    config["text_config"]["initializer_range"] = 1.0
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    model = get_peft_model(build_tiny_model(0, config), lora, adapter_name="a")
    model.add_adapter("b", lora)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    model = model.eval().cuda()
    pictures = _pictures()
    images = [image_input(processor, p) for p in pictures]
    _, second = _two_turns(processor, images)
    arms = [Arm("base", None, None), Arm("a", "unused", "a"), Arm("b", "unused", "b")]
    runs = {}
    for graphs in (False, True):
        decoder = SlotDecoder(model, slots=2, max_len=512, attn_bucket=64, cuda_graphs=graphs)
        for arm in arms:
            with use_arm(model, arm):
                runs[graphs, arm.name] = _greedy(decoder, second, images, steps=90)
            decoder.reset()
    for arm in arms:
        assert runs[True, arm.name] == runs[False, arm.name]
    assert runs[False, "a"] != runs[False, "base"] and runs[False, "b"] != runs[False, "a"]  # the adapters act


def test_an_images_token_count_follows_the_processors_merge_size(processor):
    import copy as copying

    merged3 = copying.copy(processor)
    merged3.image_processor = copying.deepcopy(processor.image_processor)
    merged3.image_processor.merge_size = 3
    text = "<|vision_start|><|image_pad|><|vision_end|>"
    for proc in (processor, merged3):
        picture = _noise((200, 150), 30, 6)
        want = proc(text=[text], images=[picture])["input_ids"][0].count(IMAGE_TOKEN_ID)
        assert image_input(proc, picture).tokens == want
    assert want == 35  # 200x150 px scaled up to the 65,536 px floor at 48 px a side a token: 240x336 px, 15x21 patches, 5x7 tokens


def _rounds(decoder) -> list:
    """The slots of each forward ``decoder.prefill_many`` runs, recorded as it runs them."""
    rounds, forward = [], decoder._forward_chunks
    decoder._forward_chunks = lambda now, positions: rounds.append([p.slot for p in now]) or forward(now, positions)
    return rounds


def _fresh(model, slot, ids, images, held=None):
    """Logits of one prefill on a decoder of its own (``held``: what that slot holds beforehand)."""
    decoder = SlotDecoder(model, slots=3, max_len=512, attn_bucket=64)
    if held is not None:
        decoder.prefill(slot, *held)
    return decoder.prefill(slot, ids, images)


def test_prefill_many_equals_each_prefill_alone_and_computes_a_shared_prompt_once(model, processor):
    """One step's prefills: two samples of a question begin (one prompt, one image object) while a third slot
    starts its next turn. The first sample and the next turn go in one forward; the second sample then
    copies the first's prompt and computes one token."""
    images = [image_input(processor, p) for p in _pictures()]
    first, _ = _two_turns(processor, images)
    decoder = SlotDecoder(model, slots=3, max_len=512, attn_bucket=64)
    decoder.prefill(2, [5, 6, 7], [])
    rounds = _rounds(decoder)
    logits = decoder.prefill_many([(0, first, images[:1]), (1, first, images[:1]), (2, [5, 6, 7, 8, 9], [])])
    assert rounds == [[0, 2], [1]]
    assert decoder.last_prefill_tokens == len(first) + 1 + 2
    torch.testing.assert_close(logits[0], _fresh(model, 0, first, images[:1]), **ANOTHER_SHAPE)
    torch.testing.assert_close(logits[1], _fresh(model, 1, first, images[:1]), **ANOTHER_SHAPE)
    torch.testing.assert_close(logits[2], _fresh(model, 2, [5, 6, 7, 8, 9], [], held=([5, 6, 7], [])), **ANOTHER_SHAPE)
    assert decoder.tokens == [first, first, [5, 6, 7, 8, 9]] and decoder.images[1] == images[:1]
    # the caches decode as computed ones
    order, stepped = decoder.decode({0: 7, 1: 7, 2: 9})
    reference = SlotDecoder(model, slots=3, max_len=512, attn_bucket=64)
    reference.prefill(0, first, images[:1])
    reference.prefill(2, [5, 6, 7, 8, 9], [])
    torch.testing.assert_close(stepped[[0, 2]], reference.decode({0: 7, 2: 9})[1], **ANOTHER_SHAPE)
    torch.testing.assert_close(stepped[0], stepped[1], **ANOTHER_SHAPE)


def test_prefill_many_waits_rather_than_copy_from_a_slot_another_copy_fills(model, processor):
    """Slot 0 holds the two-turn conversation, slot 2 some text. Slot 0 takes slot 2's text (a copy into slot 0);
    slot 1 would copy its prompt from slot 0, which that copy overwrites first: it waits for the next forward."""
    images = [image_input(processor, p) for p in _pictures()]
    first, second = _two_turns(processor, images)
    decoder = SlotDecoder(model, slots=3, max_len=512, attn_bucket=64)
    decoder.prefill(0, second, images)
    decoder.prefill(2, [5, 6, 7, 8], [])
    rounds = _rounds(decoder)
    logits = decoder.prefill_many([(0, [5, 6, 7, 8, 9], []), (1, first, images[:1])])
    assert rounds == [[0], [1]]
    assert decoder.tokens[:2] == [[5, 6, 7, 8, 9], first]
    torch.testing.assert_close(logits[0], _fresh(model, 0, [5, 6, 7, 8, 9], []), **ANOTHER_SHAPE)
    torch.testing.assert_close(logits[1], _fresh(model, 1, first, images[:1]), **ANOTHER_SHAPE)


def test_a_prefill_that_fails_empties_the_slots_it_was_filling(model, processor):
    images = [image_input(processor, p) for p in _pictures()]
    first, _ = _two_turns(processor, images)
    decoder = SlotDecoder(model, slots=3, max_len=512, attn_bucket=64)
    decoder.prefill(2, [5, 6, 7], [])
    bad = list(images[:1])
    bad[0] = image_input(processor, _noise((40, 72), 60, 9))  # another size: its visual tokens do not fit the pads
    with pytest.raises(ValueError, match="visual tokens"):
        decoder.prefill_many([(0, [5, 6, 7, 8], []), (1, first, bad)])
    assert decoder.tokens[:2] == [[], []] and decoder.next_pos[:2] == [0, 0]
    assert decoder.tokens[2] == [5, 6, 7]  # a slot the call did not fill keeps its cache
    with pytest.raises(ValueError, match="each slot once"):
        decoder.prefill_many([(0, [1, 2], []), (0, [1, 3], [])])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_many_on_cuda_equals_each_prefill_alone(processor, dtype):
    """The rollout's dtype and kernels: one forward of three slots' chunks against each alone. In bf16 the
    batched matmuls round differently; a wrong cache or mask is off by the logits' own scale."""
    config = copy.deepcopy(TINY_QWEN3_VL_CONFIG)
    config["text_config"]["initializer_range"] = 1.0
    model = build_tiny_model(0, config).eval().to("cuda", dtype)
    images = [image_input(processor, p) for p in _pictures()]
    first, second = _two_turns(processor, images)
    requests = [(0, first, images[:1]), (1, second, images), (2, [5, 6, 7, 8, 9], [])]
    decoder = SlotDecoder(model, slots=3, max_len=512, attn_bucket=64)
    decoder.prefill(1, first, images[:1])
    together = decoder.prefill_many(requests)
    for (slot, ids, pics), got in zip(requests, together):
        alone = SlotDecoder(model, slots=3, max_len=512, attn_bucket=64)
        if slot == 1:
            alone.prefill(1, first, images[:1])
        want = alone.prefill(slot, ids, pics)
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, **ANOTHER_SHAPE)
        else:
            assert (got - want).abs().max() < 0.05 * want.std()


def test_prefill_many_keeps_a_forward_within_prefill_tokens_and_never_splits_a_request(model):
    requests = [(0, [1, 2, 3, 4, 5, 6], []), (1, [7, 8, 9], []), (2, [10, 11], [])]
    for budget, expected in ((4, [[0], [1], [2]]), (5, [[0], [1, 2]]), (11, [[0, 1, 2]])):
        decoder = SlotDecoder(model, slots=3, max_len=128, attn_bucket=64, prefill_tokens=budget)
        rounds = _rounds(decoder)
        logits = decoder.prefill_many(requests)
        assert rounds == expected
        assert decoder.new_tokens([1, 2, 3, 4, 5, 6, 7], []) == 1  # slot 0 serves all but the last
        for (slot, ids, images), got in zip(requests, logits):
            torch.testing.assert_close(got, _fresh(model, slot, ids, images), **ANOTHER_SHAPE)
