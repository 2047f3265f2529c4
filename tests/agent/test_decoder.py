"""The slot decoder against the model's own forward: prefill, incremental turns with images, batched decode, shared
prefixes (eogym_sft/agent/decoder.py)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slot_decoding import ANOTHER_SHAPE, chat_text, model_logits, noise_image, two_pictures, two_turn_ids, varied_model

from eogym_sft.agent.decoder import SlotDecoder, _Prefill, common_prefix
from eogym_sft.agent.image_inputs import ImageInput, image_input, image_starts
from eogym_sft.models.layout import expand_image_pads, mrope_position_ids
from eogym_sft.models.tiny import IMAGE_TOKEN_ID, TINY_QWEN3_VL_CONFIG, build_tiny_model


@pytest.fixture(scope="module")
def model():
    return varied_model()


def test_ids_and_positions_equal_the_processor_and_get_rope_index(model, processor):
    text, pictures = chat_text(processor, 2), two_pictures()
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
    pictures = two_pictures()
    images = [image_input(processor, p) for p in pictures]
    first, second = two_turn_ids(processor, images)
    decoder = SlotDecoder(model, slots=3, max_len=512, attn_bucket=64)
    expected, _ = model_logits(model, processor, chat_text(processor, 1), pictures[:1])
    torch.testing.assert_close(decoder.prefill(1, first, images[:1]), expected, atol=1e-4, rtol=1e-4)
    for step, token in enumerate([5, 77, 1000]):  # decode after an image prompt
        order, logits = decoder.decode({1: token})
        expected, _ = model_logits(model, processor, chat_text(processor, 1), pictures[:1], [5, 77, 1000][: step + 1])
        assert order == [1]
        torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=1e-4)
    # the next turn (the tool's image included) reuses the cached prompt and recomputes only what differs
    expected, _ = model_logits(model, processor, chat_text(processor, 2), pictures)
    torch.testing.assert_close(decoder.prefill(1, second, images), expected, atol=1e-4, rtol=1e-4)
    assert decoder.tokens[1] == second
    # two slots at different lengths in one decode step
    decoder.prefill(0, first, images[:1])
    order, logits = decoder.decode({0: 5, 1: 9})
    one, _ = model_logits(model, processor, chat_text(processor, 1), pictures[:1], [5])
    two, _ = model_logits(model, processor, chat_text(processor, 2), pictures, [9])
    assert order == [0, 1]
    torch.testing.assert_close(logits, torch.stack([one, two]), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="do not fit"):
        decoder.prefill(2, [1] * 512, [])


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


def test_a_refilled_slot_does_not_keep_the_previous_image(model, processor):
    """Two images of one size give the same token ids: the slot must recompute from the image, and its
    logits equal a fresh decoder's (before the fix they differed and the argmax changed)."""
    pictures = [noise_image((64, 48), 60, 2), noise_image((64, 48), 90, 3)]
    first, other = [image_input(processor, p) for p in pictures]
    text_ids = processor.tokenizer(chat_text(processor, 1), add_special_tokens=False)["input_ids"]
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
    expected, _ = model_logits(model, processor, chat_text(processor, 1), pictures[1:])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    # the very same image object is reused: only the last token is recomputed
    refilled.prefill(0, ids, [other])
    assert refilled.last_prefill_tokens == 1


def test_a_refilled_slot_recomputes_from_the_first_image_that_differs(model, processor):
    pictures = two_pictures()
    images = [image_input(processor, p) for p in pictures]
    _, second = two_turn_ids(processor, images)
    swapped = image_input(processor, noise_image((40, 72), 30, 4))  # the tool image, same size
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
    pictures = two_pictures()
    images = [image_input(processor, p) for p in pictures]
    first, second = two_turn_ids(processor, images)
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
    other = image_input(processor, noise_image((64, 48), 30, 5))  # same size, other pixels
    logits = decoder.prefill(2, first, [other])
    assert decoder.last_prefill_tokens == len(first) - first.index(IMAGE_TOKEN_ID)
    fresh = SlotDecoder(model, slots=1, max_len=512, attn_bucket=64).prefill(0, first, [other])
    torch.testing.assert_close(logits, fresh, **ANOTHER_SHAPE)


def test_reset_empties_every_slot(model):
    decoder = SlotDecoder(model, slots=2, max_len=128, attn_bucket=64)
    decoder.prefill(0, [1, 2, 3], [])
    decoder.prefill(1, [4, 5], [])
    decoder.reset()
    assert decoder.tokens == [[], []] and decoder.next_pos == [0, 0] and decoder.images == [[], []]


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
    images = [image_input(processor, p) for p in two_pictures()]
    first, _ = two_turn_ids(processor, images)
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
    images = [image_input(processor, p) for p in two_pictures()]
    first, second = two_turn_ids(processor, images)
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
    images = [image_input(processor, p) for p in two_pictures()]
    first, _ = two_turn_ids(processor, images)
    decoder = SlotDecoder(model, slots=3, max_len=512, attn_bucket=64)
    decoder.prefill(2, [5, 6, 7], [])
    bad = list(images[:1])
    bad[0] = image_input(processor, noise_image((40, 72), 60, 9))  # another size: its visual tokens do not fit the pads
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
    images = [image_input(processor, p) for p in two_pictures()]
    first, second = two_turn_ids(processor, images)
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
