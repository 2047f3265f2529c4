"""LoRA adapters run from merged weights, equal to PEFT's forward, and what a merged weight cannot express run as
the module (eogym_sft/agent/merged_lora.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import perturb_lora_b
from slot_decoding import chat_text, graphed_on_cpu, model_logits, two_pictures, two_turn_ids

from eogym_sft.agent.decoder import SlotDecoder
from eogym_sft.agent.image_inputs import image_input
from eogym_sft.agent.merged_lora import merge_plan
from eogym_sft.models.loading import Arm, LORA_TARGETS, apply_lora, lora_target_regex, peft_quietly, use_arm
from eogym_sft.models.tiny import TINY_QWEN3_VL_CONFIG, build_tiny_model


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
    pictures = two_pictures()
    images = [image_input(processor, p) for p in pictures]
    first, _ = two_turn_ids(processor, images)
    decoder.release(1)
    expected, _ = model_logits(model, processor, chat_text(processor, 1), pictures[:1])
    torch.testing.assert_close(decoder.prefill(1, first, images[:1]), expected, atol=1e-4, rtol=1e-4)
    for step, token in enumerate(tokens):
        _, logits = decoder.decode({1: token})
        expected, _ = model_logits(model, processor, chat_text(processor, 1), pictures[:1], tokens[: step + 1])
        torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=1e-4)


def _base_logits(model, processor):
    with model.disable_adapter():
        return model_logits(model, processor, chat_text(processor, 1), two_pictures()[:1])[0]


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
    adapter = model_logits(model, processor, chat_text(processor, 1), two_pictures()[:1])[0]
    assert (adapter - _base_logits(model, processor)).abs().max() > 1.0  # a skipped merge would fail above


def test_check_weights_refills_the_merged_weights_after_an_in_place_update(processor):
    """GRPO's next generation: the optimizer changed the LoRA weights in place; the same buffers hold the new ones."""
    model = _adapter_model()
    decoder = SlotDecoder(model, slots=2, max_len=512, attn_bucket=64)
    _check_against_the_model(decoder, model, processor, tokens=(5,))
    read = decoder.weights_read()
    before = model_logits(model, processor, chat_text(processor, 1), two_pictures()[:1])[0]
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.2)
    after = model_logits(model, processor, chat_text(processor, 1), two_pictures()[:1])[0]
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
    decoder._step = graphed_on_cpu(decoder._decode_step, (decoder.text, decoder.lm_head), decoder.weights_read)
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
    images = [image_input(processor, p) for p in two_pictures()]
    _, second = two_turn_ids(processor, images)
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
