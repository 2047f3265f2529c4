"""The text tower's norms fused where every one is the model's plain norm (eogym_sft/agent/text_norms.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from slot_decoding import varied_model

from eogym_sft.agent.decoder import SlotDecoder
from eogym_sft.agent.text_norms import fused_rms_norm, module_norm, norms_fuse


@pytest.fixture(scope="module")
def model():
    return varied_model()


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
