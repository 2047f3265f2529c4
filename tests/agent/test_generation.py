"""The slot decoder against the model's own forward: prefill, incremental turns with images, batched decode."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from helpers import decode_side_by_side, perturb_lora_b

from eogym_sft.agent.generation import (
    GraphedStep,
    ImageInput,
    Sampling,
    _Prefill,
    common_prefix,
    draw,
    fused_rms_norm,
    host_to,
    merge_plan,
    module_norm,
    norms_fuse,
    SlotDecoder,
    image_input,
    image_starts,
    parameter_storage,
    vision_metadata,
    vision_token_ids,
)
from eogym_sft.models.layout import expand_image_pads, mrope_position_ids
from eogym_sft.models.loading import LORA_TARGETS, Arm, apply_lora, lora_target_regex, peft_quietly, use_arm
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_norm_equals_the_models_norm_to_the_last_bit_of_its_dtype(model, dtype):
    norm = copy.deepcopy(model.model.language_model.layers[0].input_layernorm).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, norm.weight.numel()))
    x = (torch.randn(3, 5, norm.weight.numel(), generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    fused, reference = fused_rms_norm(norm, x), norm(x)
    assert fused.dtype == reference.dtype == dtype
    # bf16: the module rounds x / rms(x) to bf16 before the weight's product, the fused kernel rounds once
    tolerance = {torch.float32: 1e-6, torch.bfloat16: 2 ** -7}[dtype]
    torch.testing.assert_close(fused, reference, atol=tolerance * 4, rtol=tolerance)


def test_the_decoder_fuses_its_norms_only_where_every_one_is_the_models_plain_norm(model):
    text = model.model.language_model
    assert norms_fuse(text, torch.float32)
    assert SlotDecoder(model, slots=1, max_len=64)._norm is fused_rms_norm
    assert not norms_fuse(text, torch.bfloat16)  # fp32 weights under bf16 activations: the module's own promotion
    odd = copy.deepcopy(model)
    odd.model.language_model.layers[1].self_attn.k_norm = torch.nn.LayerNorm(odd.model.language_model.layers[1].self_attn.k_norm.weight.shape)
    assert SlotDecoder(odd, slots=1, max_len=64)._norm is module_norm


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
    for first in (1, 2, 3, 64):  # small first blocks double and bisect within these short lists too
        assert common_prefix(a, b, limit, first) == naive
        assert common_prefix(a, b, min(limit, 3), first) == min(naive, 3)


def _naive_prefix(a: list, b: list, limit: int) -> int:
    return next((i for i in range(limit) if a[i] != b[i]), limit)


def test_common_prefix_equals_a_scan_on_long_lists_diverging_anywhere():
    """Prompt-sized lists (fresh int objects, as a new request's are) that part at every kind of place: the
    first item, the edges of the doubling blocks (64, 192, 448, ... for the default first block), inside one,
    not at all, or past ``limit``."""
    rng = np.random.default_rng(0)
    edges = [64 * (2**k - 1) + d for k in range(1, 8) for d in (-1, 0, 1)]
    for case in range(400):
        n = int(rng.integers(1, 9000))
        a = rng.integers(0, 151_000, n).tolist()
        b = [int(str(x)) for x in a]
        at = [0, n, int(rng.integers(0, n)), *edges][case % (3 + len(edges))]
        if at < n:
            b[at] += 1
        if case % 5 == 0:
            b = b[: int(rng.integers(0, n + 1))]  # one list shorter than the other
        for limit in (min(len(a), len(b)), int(rng.integers(0, min(len(a), len(b)) + 1))):
            for first in (1, 7, 64, 4096):
                assert common_prefix(a, b, limit, first) == _naive_prefix(a, b, limit), (n, at, limit, first)


def _fake_image(tokens: int) -> ImageInput:
    return ImageInput(torch.zeros(4 * tokens, 3), (1, 2, 2 * tokens), merge_size=2)


def _conversation_ids(rng, images: list[ImageInput]) -> list[int]:
    """Text runs with each image's pads between vision markers (never two images side by side), as Qwen3-VL lays a prompt out."""
    ids = []
    for image in images:
        ids += rng.integers(0, 50, int(rng.integers(0, 300))).tolist() + [151652] + [IMAGE_TOKEN_ID] * image.tokens + [151653]
    return ids + rng.integers(0, 50, int(rng.integers(1, 300))).tolist()


def _served_spec(held: list[int], held_images: list, ids: list[int], images: list) -> int:
    """What a cache holding ``held`` may serve of ``ids``, by its definition: the longest prefix short of the last
    token that ``held`` holds, ending inside no image's pads, and whose every image is the very object held."""
    starts = [i for i, t in enumerate(ids) if t == IMAGE_TOKEN_ID and (i == 0 or ids[i - 1] != IMAGE_TOKEN_ID)]
    for n in range(_naive_prefix(held, ids, min(len(held), len(ids) - 1)), 0, -1):
        splits = ids[n] == IMAGE_TOKEN_ID and ids[n - 1] == IMAGE_TOKEN_ID
        stale = any(k >= len(held_images) or held_images[k] is not images[k] for k, at in enumerate(starts) if at < n)
        if not splits and not stale:
            return n
    return 0


def test_reusable_prefixes_and_new_tokens_equal_their_definition_on_random_conversations(model):
    """Slots holding long random conversations that a request shares in part: cut in text, inside an image's
    pads, at its first pad, with an image of the same size but another object, or further on."""
    rng = np.random.default_rng(1)
    decoder = SlotDecoder(model, slots=3, max_len=16384, attn_bucket=64)
    for case in range(150):
        images = [_fake_image(int(rng.integers(1, 400))) for _ in range(int(rng.integers(0, 6)))]
        ids = _conversation_ids(rng, images)
        for slot in range(3):
            held = [int(str(t)) for t in ids[: int(rng.integers(0, len(ids) + 200))]]
            held += rng.integers(0, 50, max(0, len(ids) + 1 - len(held)) * int(rng.integers(0, 2))).tolist()
            if held and rng.random() < 0.5:
                held[int(rng.integers(0, len(held)))] = IMAGE_TOKEN_ID if rng.random() < 0.5 else 49
            swap = int(rng.integers(0, len(images) + 1))  # the images from here on are other objects of the same size
            decoder.tokens[slot] = held
            decoder.images[slot] = images[:swap] + [_fake_image(im.tokens) for im in images[swap:]]
        p = _Prefill(0, ids, images, image_starts(ids, images, IMAGE_TOKEN_ID))
        served = [_served_spec(decoder.tokens[s], decoder.images[s], ids, images) for s in range(3)]
        assert [decoder._reusable(s, p) for s in range(3)] == served, case
        assert decoder.new_tokens(ids, images) == len(ids) - max(served)


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


def _graphed_on_cpu(step, watched, reads=lambda: ()) -> GraphedStep:
    graphed = GraphedStep(step, slots=2, device="cpu", watched=watched, reads=reads)
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
    decode_side_by_side(graphed, eager, atol=1e-5)
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
                decoder.check_weights()  # as run_episodes does: this arm's weights, merged
                runs[graphs, arm.name] = _greedy(decoder, second, images, steps=90)
            decoder.reset()
    for arm in arms:
        assert runs[True, arm.name] == runs[False, arm.name]
    assert runs[False, "a"] != runs[False, "base"] and runs[False, "b"] != runs[False, "a"]  # the adapters act


def _adapter_model(dtype: str = "float32", targets=LORA_TARGETS, seed: int = 1, **lora):
    """The varied-logits tiny model under a LoRA adapter with non-zero B (PEFT starts it at zero: no delta to merge),
    eval mode: ``apply_lora``'s (dropout included) or, given ``lora`` options, a ``LoraConfig`` of them. Its attention
    projections have biases, seeded non-zero: a merged projection keeps its base layer's."""
    config = copy.deepcopy(TINY_QWEN3_VL_CONFIG)
    config["text_config"]["initializer_range"] = 1.0
    config["text_config"]["attention_bias"] = True
    base = build_tiny_model(0, config, dtype)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in base.model.language_model.named_parameters():
            if name.endswith("_proj.bias"):
                param.copy_(torch.randn(param.shape, generator=generator))
    if lora:
        from peft import LoraConfig, get_peft_model

        with peft_quietly():
            model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=lora_target_regex(targets), **lora))
    else:
        model = apply_lora(base, r=4, alpha=8, targets=targets)
    return perturb_lora_b(model, seed=seed, scale=0.3).eval()


def _check_against_the_model(decoder, model, processor, tokens=(5, 77, 1000)) -> None:
    """A first turn with its image, then decode steps in slot 1: each one's logits equal the model's own forward."""
    pictures = _pictures()
    images = [image_input(processor, p) for p in pictures]
    first, _ = _two_turns(processor, images)
    decoder.release(1)
    expected, _ = _reference_logits(model, processor, _conversation(processor, 1), pictures[:1])
    torch.testing.assert_close(decoder.prefill(1, first, images[:1]), expected, atol=1e-4, rtol=1e-4)
    for step, token in enumerate(tokens):
        _, logits = decoder.decode({1: token})
        expected, _ = _reference_logits(model, processor, _conversation(processor, 1), pictures[:1], tokens[: step + 1])
        torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=1e-4)


def _base_logits(model, processor):
    with model.disable_adapter():
        return _reference_logits(model, processor, _conversation(processor, 1), _pictures()[:1])[0]


def test_an_adapter_runs_from_merged_weights_and_equals_the_peft_forward(processor):
    model = _adapter_model()
    layers = len(model.get_base_model().model.language_model.layers)
    decoder = SlotDecoder(model, slots=2, max_len=512, attn_bucket=64)
    assert decoder.projection_kinds() == {"merged": 7 * layers, "weight": 0, "module": 0}
    lora = model.get_base_model().model.language_model.layers[1].mlp.down_proj
    merged = decoder.merged[1, "down_proj"].weight
    torch.testing.assert_close(merged, lora.base_layer.weight + lora.get_delta_weight("default"))
    assert merged.data_ptr() != lora.base_layer.weight.data_ptr()
    weights = [m.base_layer.weight for m in model.get_base_model().model.language_model.modules() if hasattr(m, "lora_A")]
    assert len(weights) == 7 * layers and decoder.merged_bytes() == sum(w.numel() * w.element_size() for w in weights)
    _check_against_the_model(decoder, model, processor)
    adapter = _reference_logits(model, processor, _conversation(processor, 1), _pictures()[:1])[0]
    assert (adapter - _base_logits(model, processor)).abs().max() > 1.0  # a skipped merge would fail above


def test_check_weights_refills_the_merged_weights_after_an_in_place_update(processor):
    """GRPO's next generation: the optimizer changed the LoRA weights in place; the same buffers hold the new ones."""
    model = _adapter_model()
    decoder = SlotDecoder(model, slots=2, max_len=512, attn_bucket=64)
    _check_against_the_model(decoder, model, processor, tokens=(5,))
    read = decoder.weights_read()
    before = _reference_logits(model, processor, _conversation(processor, 1), _pictures()[:1])[0]
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.2)
    after = _reference_logits(model, processor, _conversation(processor, 1), _pictures()[:1])[0]
    assert (after - before).abs().max() > 1.0  # stale buffers would fail the check below
    decoder.check_weights()
    assert decoder.weights_read() == read  # refilled in place: a captured graph reads the new weights
    _check_against_the_model(decoder, model, processor)


def test_base_then_adapter_then_base_in_one_decoder_give_each_arms_logits(processor):
    """``eogym-sft rollout``'s arm loop (use_arm, run_episodes' check_weights, reset after the arm): each arm's
    own forward. The base arm reads the base weights themselves; the adapter's buffers are kept and reused."""
    model = _adapter_model()
    layers = len(model.get_base_model().model.language_model.layers)
    decoder = SlotDecoder(model, slots=2, max_len=512, attn_bucket=64)
    arms = [Arm("base"), Arm("lora", "unused", "default"), Arm("base"), Arm("lora", "unused", "default")]
    kinds, reads = [], []
    for arm in arms:
        with use_arm(model, arm):
            decoder.check_weights()
            kinds.append(decoder.projection_kinds()["merged"])
            reads.append(decoder.weights_read())
            _check_against_the_model(decoder, model, processor, tokens=(5, 77))
        decoder.reset()
    assert kinds == [0, 7 * layers, 0, 7 * layers]
    assert reads[0] == reads[2] != reads[1] == reads[3]
    assert decoder.merged_bytes() > 0  # kept through the second base arm


@pytest.mark.parametrize("lora", [{"use_dora": True}, {"lora_bias": True}, {"modules_to_save": ["o_proj"]}], ids=lambda d: next(iter(d)))
def test_what_a_merged_weight_cannot_express_runs_as_the_module(processor, lora):
    """DoRA, a LoRA bias and a ``modules_to_save`` copy of o_proj: those projections call their module, the
    untargeted ones read their weight, the plain LoRA ones (q and v under modules_to_save) merge; all equal the model."""
    model = _adapter_model(targets=("q_proj", "v_proj"), **lora)
    layers = len(model.get_base_model().model.language_model.layers)
    decoder = SlotDecoder(model, slots=2, max_len=512, attn_bucket=64)
    want = {"merged": 0, "weight": 5 * layers, "module": 2 * layers}
    if "modules_to_save" in lora:
        want = {"merged": 2 * layers, "weight": 4 * layers, "module": layers}
    assert decoder.projection_kinds() == want
    _check_against_the_model(decoder, model, processor)


def test_merge_plan_follows_the_adapter_state():
    model = _adapter_model(targets=("q_proj",))
    lora = model.get_base_model().model.language_model.layers[0].self_attn.q_proj
    assert merge_plan(lora) == (lora.base_layer, ["default"])
    assert merge_plan(lora.base_layer) == (lora.base_layer, [])
    with model.disable_adapter():
        assert merge_plan(lora) == (lora.base_layer, [])
    lora.train()
    assert merge_plan(lora) is None  # dropout draws in training mode
    lora.eval()
    model.merge_adapter()
    assert merge_plan(lora) == (lora.base_layer, [])  # PEFT runs the merged base weight alone
    with model.disable_adapter():
        assert merge_plan(lora) is None  # PEFT's forward unmerges first
    assert merge_plan(torch.nn.LayerNorm(4)) is None


def test_graphs_are_dropped_when_a_projection_switches_weights_not_when_the_merged_ones_are_refilled():
    model = _adapter_model()
    decoder = SlotDecoder(model, slots=2, max_len=128, attn_bucket=64)
    decoder._step = _graphed_on_cpu(decoder._decode_step, (decoder.text, decoder.lm_head), decoder.weights_read)
    zeros = torch.zeros(2, dtype=torch.long)
    decoder._step(zeros, zeros, zeros, zeros + 1, 64)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_(0.1)  # an optimizer step
    decoder.check_weights()
    assert list(decoder._step.graphs) == [64]
    with model.disable_adapter():  # the base arm without a reset: the graphs read the buffers, not the base weights
        decoder.check_weights()
        assert decoder._step.graphs == {}
        decoder._step(zeros, zeros, zeros, zeros + 1, 64)
    decoder.check_weights()
    assert decoder._step.graphs == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_bf16_adapter_replayed_from_cuda_graphs_equals_eager_after_an_in_place_update(processor):
    """GRPO's decoder kept across steps: a bf16 model under fp32 LoRA weights (PEFT's autocast, as apply_lora on
    the recipe's model), graphs captured, the LoRA weights updated in place, check_weights (run_episodes' start):
    the graphs stay and replay the new merged weights exactly as the eager step computes them."""
    model = _adapter_model("bfloat16").cuda()
    images = [image_input(processor, p) for p in _pictures()]
    _, second = _two_turns(processor, images)
    eager = SlotDecoder(model, slots=2, max_len=512, attn_bucket=64)
    graphed = SlotDecoder(model, slots=2, max_len=512, attn_bucket=64, cuda_graphs=True)
    assert graphed.projection_kinds()["module"] == 0 and graphed.merged_bytes() > 0

    def rollout(decoder) -> list:
        for s in range(decoder.slots):
            decoder.release(s)
        decoder.check_weights()
        decoder.prefill(0, second, images)
        decoder.prefill(1, list(range(100, 140)), [])
        return [decoder.decode({0: 5 + step, 1: 900 + step})[1].clone() for step in range(80)]  # spans cross a bucket

    def same(got: list, want: list) -> None:
        # the same kernels over equal buffers; a bf16 tolerance in case a GEMM's split differs under capture
        for g, w in zip(got, want):
            assert (g - w).abs().max() <= 0.01 * w.abs().max()

    same(rollout(graphed), rollout(eager))
    captured = dict(graphed._step.graphs)
    before = rollout(eager)
    generator = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn(param.shape, generator=generator, device="cuda", dtype=param.dtype) * 0.2)
    after = rollout(eager)
    assert (after[0] - before[0]).abs().max() > 0.2 * before[0].abs().max()  # a stale merged weight would show
    same(rollout(graphed), after)
    assert graphed._step.graphs.keys() == captured.keys() and all(graphed._step.graphs[k] is captured[k] for k in captured)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_queries_and_keys_rotated_together_equal_transformers_rotary_embedding(model, dtype):
    """The decoder rotates a layer's queries and keys as one tensor (their heads side by side): to the bit what
    transformers' ``apply_rotary_pos_emb`` gives each of them, at Qwen3-VL's 3-D rotary positions."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb

    decoder = SlotDecoder(model, slots=1, max_len=64)
    g = torch.Generator().manual_seed(0)
    heads, kv, d = decoder.kv_heads * decoder.groups, decoder.kv_heads, decoder.head_dim
    q, k = torch.randn(2, 5, heads, d, generator=g).to(dtype), torch.randn(2, 5, kv, d, generator=g).to(dtype)
    positions = torch.randint(0, 50, (3, 2, 5), generator=g)
    cos, sin = model.model.language_model.rotary_emb(q, positions)
    want_q, want_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos.to(dtype), sin.to(dtype))
    got = decoder.rotate(torch.cat([q, k], dim=-2).transpose(1, 2), cos.to(dtype), sin.to(dtype))
    assert torch.equal(got[:, :heads], want_q) and torch.equal(got[:, heads:], want_k)


def test_the_vision_metadata_from_the_host_gives_the_same_features(model, processor):
    """transformers' Qwen3-VL vision forward takes its grid-derived metadata by keyword (``vision_utils``' helpers pop
    them): what the decoder computes on the host gives the unassisted forward's features to the bit, and each keyword
    is used, not ignored (one made wrong changes the features), so none is derived again on the GPU."""
    images = [image_input(processor, p) for p in _pictures()]
    pixels = torch.cat([im.pixel_values for im in images])
    grid = torch.tensor([im.grid_thw for im in images])
    visual = model.model.visual
    meta = vision_metadata(visual, grid, torch.device("cpu"))
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
    images = [image_input(processor, p) for p in _pictures()]
    first, second = _two_turns(processor, images)
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
    images = [image_input(processor, p) for p in _pictures()]
    first, _ = _two_turns(processor, images)
    on_gpu = [ImageInput(im.pixel_values.cuda(), im.grid_thw, im.merge_size) for im in images[:1]]
    want = SlotDecoder(model, slots=1, max_len=512, attn_bucket=64).prefill(0, first, images[:1])
    got = SlotDecoder(model, slots=1, max_len=512, attn_bucket=64).prefill(0, first, on_gpu)
    assert torch.equal(got, want)


def test_host_to_leaves_a_cpu_copy_alone_off_cuda():
    tensor = torch.arange(4)
    assert host_to(torch.device("cpu"), tensor) is tensor


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
