"""The slot decoder's cache sized to the GPU: slots that fit beside the model, a prefill and the merged LoRA weights,
a requested count kept or refused, and off CUDA the settings as they were."""

from __future__ import annotations

import pytest
import torch

from eogym_sft.agent import rollout_config as rc
from eogym_sft.models import memory as mm

GIB = 2**30


def test_slots_fit_beside_the_reserve_at_most_one_per_episode():
    per_token, length = 147456, 16384  # the 4B's keys and values: 2.25 GiB a slot
    assert rc.fitting_slots(40, length, per_token, 70 * GIB, 10 * GIB, "--slots") == 26
    assert rc.fitting_slots(8, length, per_token, 70 * GIB, 10 * GIB, "--slots") == 8
    assert rc.fitting_slots(40, length, per_token, 70 * GIB, 10 * GIB, "--slots", requested=26) == 26
    with pytest.raises(ValueError) as refused:
        rc.fitting_slots(40, length, per_token, 70 * GIB, 10 * GIB, "--slots", requested=32)
    assert str(refused.value) == (
        "--slots 32 of 16,384 tokens (2.25 GiB each) does not fit: 70.0 GiB free beside the model, 10.0 GiB of it kept "
        "for the rest; 26 fit: lower --slots or the episode's token budget"
    )
    with pytest.raises(ValueError, match=r"^one slot of 16,384 tokens \(2.25 GiB each\) does not fit: 12.0 GiB free .*; 0 fit: lower "
                                         r"per_device_train_batch_size or the episode's token budget$"):
        rc.fitting_slots(16, length, per_token, 12 * GIB, 10 * GIB, "per_device_train_batch_size")


@pytest.fixture(scope="module")
def lora_model():
    from eogym_sft.models.loading import apply_lora
    from eogym_sft.models.tiny import TINY_QWEN3_VL_CONFIG
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    torch.manual_seed(0)
    return apply_lora(Qwen3VLForConditionalGeneration(Qwen3VLConfig.from_dict(TINY_QWEN3_VL_CONFIG)), 4, 8, 0.05)


def test_the_merged_weights_are_the_lora_wrapped_projections(lora_model):
    wrapped = [m.base_layer.weight for m in lora_model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]
    text = lora_model.get_base_model().config.text_config
    assert len(wrapped) == 7 * text.num_hidden_layers  # q, k, v, o, gate, up, down of each layer; none of the tower
    assert rc.merged_bytes(lora_model) == sum(w.numel() * w.element_size() for w in wrapped) > 0
    merge = lora_model.get_base_model().config.vision_config.spatial_merge_size ** 2
    widths = mm.widths_of(lora_model.get_base_model().config.to_dict())
    parts = mm.generation_reserve(merge, 100, rc.merged_bytes(lora_model), widths=widths)
    assert rc.decoder_reserve(lora_model, 100, adapters=True) == sum(parts.values())
    assert rc.decoder_reserve(lora_model, 100, adapters=False) == sum(mm.generation_reserve(merge, 100, 0, widths=widths).values())


def test_off_cuda_the_slots_are_as_requested_or_the_former_default(lora_model, capsys):
    assert rc.usable_bytes(torch.device("cpu")) is None
    assert rc.sized_slots(lora_model, 100, 1024, None, True, "--slots", rc.CPU_SLOTS) == 32
    assert rc.sized_slots(lora_model, 5, 1024, None, True, "--slots", rc.CPU_SLOTS) == 5
    assert rc.sized_slots(lora_model, 100, 1024, 3, True, "--batch-size", rc.CPU_BATCH) == 3
    assert capsys.readouterr().out == ""  # nothing was sized, nothing is said
