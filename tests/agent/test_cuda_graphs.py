"""The decode step replayed from CUDA graphs: their pool, their weights check, equal to the eager step
(eogym_sft/agent/cuda_graphs.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import decode_side_by_side
from slot_decoding import graphed_on_cpu, two_pictures, two_turn_ids, varied_model

from eogym_sft.agent.cuda_graphs import GraphedStep, parameter_storage
from eogym_sft.agent.decoder import SlotDecoder
from eogym_sft.agent.image_inputs import image_input
from eogym_sft.agent.sampling import Sampling
from eogym_sft.models.loading import Arm, use_arm
from eogym_sft.models.tiny import TINY_QWEN3_VL_CONFIG, build_tiny_model


@pytest.fixture(scope="module")
def model():
    return varied_model()


def test_cuda_graphs_need_a_cuda_model(model):
    with pytest.raises(ValueError, match="CUDA device, not cpu"):
        SlotDecoder(model, slots=2, max_len=128, cuda_graphs=True)


def test_clearing_graphs_drops_their_pool():
    """Capturing into the pool of freed graphs trips the CUDA allocator's use_count assert: an arm switch
    (reset) must start a fresh pool."""
    step = GraphedStep(lambda *args: None, slots=2, device="cpu")
    step.graphs[64], step.pool = ("graph", "logits"), (0, 1)
    step.clear()
    assert step.graphs == {} and step.pool is None


def test_graphs_are_dropped_when_a_parameter_is_replaced_not_updated_in_place():
    layer = torch.nn.Linear(4, 3)
    graphed = graphed_on_cpu(lambda *args: None, (layer,))
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
    decoder._step = graphed_on_cpu(decoder._decode_step, (decoder.text, decoder.lm_head))
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_replay_the_eager_step_exactly(processor):
    config = copy.deepcopy(TINY_QWEN3_VL_CONFIG)
    config["text_config"]["initializer_range"] = 1.0
    model = build_tiny_model(0, config).eval().cuda()
    pictures = two_pictures()
    images = [image_input(processor, p) for p in pictures]
    first, second = two_turn_ids(processor, images)
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
    pictures = two_pictures()
    images = [image_input(processor, p) for p in pictures]
    _, second = two_turn_ids(processor, images)
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
