"""DeepStack by index (``eogym_sft.deepstack``): the same loss and gradients bit for bit as transformers' boolean-mask
method it replaces, padded and packed, and that private method's signature pinned."""

from __future__ import annotations

import inspect

import pytest
import torch
from helpers import chat_example
from PIL import Image

from eogym_sft.collator import EOGymCollator

MIN_PIXELS, MAX_PIXELS = 1024, 16384


def _batch(processor, padding_free: bool) -> dict:
    examples = [
        chat_example("Ships?", "Final Answer: 3", [Image.new("RGB", (64, 64), (200, 30, 30)), Image.new("RGB", (32, 96))]),
        chat_example("Flooded?", "Final Answer: no", [Image.new("RGB", (96, 64), (10, 90, 200))]),
    ]
    return EOGymCollator(processor, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, padding_free=padding_free)(examples)


def _loss_and_grads(model, batch) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_upstream_deepstack_method_keeps_its_signature():
    """``index_deepstack`` replaces this private method; an upgrade that renames or reshapes it must fail here."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextModel

    params = list(inspect.signature(Qwen3VLTextModel._deepstack_process).parameters)
    assert params == ["self", "hidden_states", "visual_pos_masks", "visual_embeds"]


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "packed"])
def test_index_deepstack_gives_the_same_loss_and_gradients(tiny_model_dir, processor, padding_free):
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextModel

    from eogym_sft.deepstack import index_deepstack

    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.config.use_cache = False
    batch = _batch(processor, padding_free)
    want_loss, want_grads = _loss_and_grads(model, batch)
    handle = index_deepstack(model)
    tower = next(m for m in model.modules() if isinstance(m, Qwen3VLTextModel))
    assert handle.towers == [tower]
    calls = []
    by_index = tower._deepstack_process
    tower._deepstack_process = lambda *args: calls.append(args[1]) or by_index(*args)
    got_loss, got_grads = _loss_and_grads(model, batch)
    assert len(calls) == len(model.config.vision_config.deepstack_visual_indexes) == 1
    mask, index = tower._eogym_visual_index
    assert mask is calls[0] and torch.equal(index, calls[0].flatten().nonzero().squeeze(1)) and len(index) > 0
    assert torch.equal(got_loss, want_loss)
    assert got_grads.keys() == want_grads.keys() and len(got_grads) > 0
    for name, grad in want_grads.items():
        assert torch.equal(got_grads[name], grad), name
    handle.remove()
    assert tower._deepstack_process.__func__ is Qwen3VLTextModel._deepstack_process  # the boolean-mask method again


def test_a_model_without_qwen3_vls_text_tower_is_left_alone():
    from eogym_sft.deepstack import index_deepstack

    assert index_deepstack(torch.nn.Linear(2, 2)) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_index_deepstack_gives_the_same_loss_and_gradients(tiny_model_dir, processor):
    """On CUDA the boolean mask's backward and the index's may sum in another order, so this one compares closely."""
    from transformers import AutoModelForImageTextToText

    from eogym_sft.deepstack import index_deepstack

    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32).cuda()
    model.config.use_cache = False
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in _batch(processor, padding_free=True).items()}
    want_loss, want_grads = _loss_and_grads(model, batch)
    handle = index_deepstack(model)
    got_loss, got_grads = _loss_and_grads(model, batch)
    handle.remove()
    torch.testing.assert_close(got_loss, want_loss)
    assert got_grads.keys() == want_grads.keys() and len(got_grads) > 0
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, msg=name)
