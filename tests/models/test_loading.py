"""Model setup: LoRA on the language model's seven projections only, a frozen vision tower and aligner,
and a loud failure when anything else would train."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from eogym_sft.models.loading import (
    LORA_TARGETS,
    apply_lora,
    check_trainable,
    load_base_model,
    lora_target_regex,
)

REPO = Path(__file__).resolve().parents[2]
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def language_projections(n_layers: int, prefix: str = "model.") -> set[str]:
    """Module names of the seven projections of every language-model layer, written out by hand."""
    names = set()
    for layer in range(n_layers):
        base = f"{prefix}language_model.layers.{layer}"
        names |= {f"{base}.self_attn.{p}" for p in ATTENTION} | {f"{base}.mlp.{p}" for p in MLP}
    return names


@pytest.fixture(scope="module")
def lora_model():
    from eogym_sft.models.tiny import build_tiny_model

    return apply_lora(build_tiny_model())


def test_lora_targets_are_the_seven_projections():
    assert set(LORA_TARGETS) == set(ATTENTION + MLP) and len(LORA_TARGETS) == 7


def test_apply_lora_trains_exactly_the_language_model_lora_weights(lora_model):
    trainable = {n for n, p in lora_model.named_parameters() if p.requires_grad}
    modules = {f"base_model.model.{m}" for m in language_projections(2)}
    expected = {f"{m}.lora_{ab}.default.weight" for m in modules for ab in "AB"}
    assert len(expected) == 2 * 7 * 2
    assert trainable == expected
    assert not any("visual" in n for n in trainable)
    # every vision, aligner and base weight is frozen
    frozen = {n for n, p in lora_model.named_parameters() if not p.requires_grad}
    assert any(".visual.merger." in n for n in frozen) and any(".visual.deepstack_merger_list." in n for n in frozen)
    assert any(".visual.blocks." in n for n in frozen)
    # r=16, alpha=32, dropout 0.05 by default
    q = lora_model.get_submodule("base_model.model.model.language_model.layers.1.self_attn.q_proj")
    assert q.r["default"] == 16 and q.scaling["default"] == 2.0 and q.lora_dropout["default"].p == 0.05
    down = lora_model.get_submodule("base_model.model.model.language_model.layers.0.mlp.down_proj")
    assert down.lora_A["default"].weight.shape == (16, 32) and down.lora_B["default"].weight.shape == (16, 16)
    counts = check_trainable(lora_model)
    # per layer: q 256+256, k 256+128, v 256+128, o 256+256, gate 256+512, up 256+512, down 512+256
    assert counts["trainable"] == 2 * 4096
    assert counts["total"] == sum(p.numel() for p in lora_model.parameters())


@pytest.mark.parametrize(
    "name",
    [
        "base_model.model.model.visual.blocks.0.attn.qkv.weight",  # vision tower
        "base_model.model.model.visual.merger.linear_fc1.weight",  # aligner
        "base_model.model.model.visual.deepstack_merger_list.0.linear_fc2.bias",  # deepstack aligner
        "base_model.model.model.language_model.embed_tokens.weight",  # not LoRA
        "base_model.model.model.language_model.layers.0.self_attn.q_proj.base_layer.weight",  # the frozen base
    ],
)
def test_check_trainable_fails_loudly(lora_model, name):
    param = dict(lora_model.named_parameters())[name]
    param.requires_grad_(True)
    try:
        with pytest.raises(RuntimeError, match=re.escape(name)):
            check_trainable(lora_model)
    finally:
        param.requires_grad_(False)
    check_trainable(lora_model)  # back to a valid setup


def test_check_trainable_fails_on_vision_lora_weights():
    from peft import LoraConfig, get_peft_model

    from eogym_sft.models.tiny import build_tiny_model

    model = build_tiny_model()
    for p in model.parameters():
        p.requires_grad_(False)
    on_vision = get_peft_model(model, LoraConfig(r=4, target_modules=["qkv"]))  # the vision tower's attention
    with pytest.raises(RuntimeError, match=r"visual\.blocks\.0\.attn\.qkv\.lora_A"):
        check_trainable(on_vision)


def test_check_trainable_fails_when_nothing_trains():
    from eogym_sft.models.tiny import build_tiny_model

    with pytest.raises(ValueError, match=r"no_such_proj\) not found"):  # PEFT refuses before check_trainable
        apply_lora(build_tiny_model(), targets=("no_such_proj",))
    frozen = build_tiny_model()
    for p in frozen.parameters():
        p.requires_grad_(False)
    with pytest.raises(RuntimeError, match="no trainable parameters"):
        check_trainable(frozen)


def test_target_regex_matches_no_vision_module():
    from eogym_sft.models.tiny import build_tiny_model

    pattern = lora_target_regex()
    names = [n for n, _ in build_tiny_model().named_modules()]
    matched = {n for n in names if re.fullmatch(pattern, n)}
    assert matched == language_projections(2)
    assert not any(re.fullmatch(pattern, n) for n in names if "visual" in n)
    # the vision tower has its own projections and MLPs; none of them may match
    assert any(n.endswith("attn.proj") for n in names if "visual" in n)
    assert any(n.endswith("linear_fc1") for n in names if "visual" in n)


def test_target_regex_on_the_4b_architecture():
    """The module names of the real Qwen3-VL-4B (built on the meta device: no memory, no weights)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    config = Qwen3VLConfig.from_dict(
        json.loads((REPO / "recipes" / "configs" / "qwen3_vl_4b_instruct.json").read_text())
    )
    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(config)
    names = [n for n, _ in model.named_modules()]
    pattern = lora_target_regex()
    matched = {n for n in names if re.fullmatch(pattern, n)}
    assert matched == language_projections(36)
    assert len(matched) == 36 * 7
    assert sum("visual" in n for n in names) > 100 and not any("visual" in n for n in matched)


def test_load_base_model(tiny_model_dir):
    model = load_base_model(str(tiny_model_dir))
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config.use_cache is False
    assert model.config._attn_implementation == "sdpa"
    import inspect

    assert inspect.signature(load_base_model).parameters["trust_remote_code"].default is False


@pytest.fixture(scope="module")
def processor_at_cap(capped_processor):
    """The offline processor with a cap that keeps the packed batches' images at a few visual tokens."""
    return capped_processor(16384, 1024)


def _packed_batch(processor):
    from helpers import chat_example
    from PIL import Image

    from eogym_sft.data.collator import EOGymCollator

    examples = [chat_example("Flooded?", "Final Answer: no"), chat_example("Land cover?", "Forest.", [Image.new("RGB", (96, 32), "green")])]
    return EOGymCollator(processor, padding_free=True)(examples)


def _varlen(model):
    """What ``load_base_model(..., attn_implementation="eogym_varlen")`` does, on a built model."""
    from eogym_sft.models.attention import (
        add_sample_boundaries,
        register_varlen_attention,
    )

    register_varlen_attention()
    model.set_attn_implementation({"text_config": "eogym_varlen", "vision_config": "sdpa"})
    add_sample_boundaries(model)
    return model


def _tiny_lora_model(compiled: bool):
    from helpers import perturb_lora_b

    from eogym_sft.models.loading import compile_language_layers
    from eogym_sft.models.tiny import build_tiny_model

    model = _varlen(build_tiny_model(seed=3))
    model = perturb_lora_b(apply_lora(model, dropout=0.0), seed=3).train()
    if compiled:
        # aot_eager: Dynamo's capture and AOTAutograd's joint graph as on the GPU, without Inductor's
        # C++ compile time on CPU. Inductor's numerics are checked on the 4B architecture by bench/.
        assert compile_language_layers(model, backend="aot_eager") == 2
    return model


def _loss_and_grads(model, batch):
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    return loss.detach(), grads


@pytest.fixture(scope="module")
def compiled_run(processor_at_cap):
    """One compiled model (compiling is most of these tests' time) and its eager twin: the loss and gradients
    of both on a packed batch, the compiled model's cache entries after micro-batches of other lengths, then
    after rounds of a training step and an evaluation (no grad, eval mode) on other lengths again."""
    from helpers import chat_example
    from PIL import Image
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import compile_times, counters

    from eogym_sft.models.loading import DECODER_LAYER_RE
    from eogym_sft.data.collator import EOGymCollator

    torch._dynamo.reset()
    counters.clear()
    batch = _packed_batch(processor_at_cap)
    eager, compiled = _tiny_lora_model(compiled=False), _tiny_lora_model(compiled=True)
    run = {"eager": _loss_and_grads(eager, batch), "compiled": _loss_and_grads(compiled, batch)}
    # Packed micro-batches change length every step, and layer 0's input is the frozen embeddings.
    layer = next(m for n, m in compiled.named_modules() if DECODER_LAYER_RE.search(n))
    entries = lambda: len(_debug_get_cache_entry_list(type(layer).forward.__code__))  # noqa: E731
    collator = EOGymCollator(processor_at_cap, padding_free=True)
    run["lengths"], run["entries"] = [batch["input_ids"].shape[1]], [entries()]
    run["later_losses"] = []  # (eager, compiled) on micro-batches of other lengths, run by the same graph
    for k in range(2):
        micro = collator([chat_example("Ships?" * (1 + 3 * k), "Final Answer: 2", [Image.new("RGB", (32 + 32 * k, 64))])])
        loss = compiled(**micro, use_cache=False).loss
        loss.backward()
        with torch.no_grad():
            run["later_losses"].append((eager(**micro, use_cache=False).loss.item(), loss.item()))
        run["lengths"].append(micro["input_ids"].shape[1])
        run["entries"].append(entries())
    run["graph_breaks"], run["graphs"] = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
    run["attempts"] = [name for name in compile_times(repr="csv", aggregate=True)[0] if name.startswith("compile_attempt_")]
    run["entries_with_evaluation"] = []
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for n in (2, 4, 6):
            compiled.train()
            compiled(**collator([chat_example("Ships?" * n, "Final Answer: 2", [Image.new("RGB", (32 * n, 64))])]), use_cache=False).loss.backward()
            compiled.eval()
            with torch.no_grad():
                compiled(**collator([chat_example("Ships?" * (n + 1), "Final Answer: 2", [Image.new("RGB", (32 * n + 32, 64))])]), use_cache=False)
            run["entries_with_evaluation"].append(entries())
    yield run
    torch._dynamo.reset()


def test_compiled_layers_give_the_eager_loss_and_gradients(compiled_run):
    eager_loss, eager_grads = compiled_run["eager"]
    compiled_loss, compiled_grads = compiled_run["compiled"]
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-6, atol=1e-6)
    assert eager_grads.keys() == compiled_grads.keys()
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_compiled_graph_gives_the_eager_loss_at_other_lengths(compiled_run):
    """The one graph, compiled on the first micro-batch, computes the eager loss on the later ones too
    (other lengths, other sample boundaries): nothing of the first batch was baked into it."""
    for eager_loss, compiled_loss in compiled_run["later_losses"]:
        assert compiled_loss == pytest.approx(eager_loss, rel=1e-6, abs=1e-6)


def test_compiled_layers_compile_once_for_every_micro_batch_length(compiled_run):
    """Packed micro-batches change length every step, and layer 0's input is the frozen embeddings:
    still one compiled entry for all layers and lengths (without the fix: 2 after the first
    micro-batch, 3 after the second)."""
    assert compiled_run["entries"] == [1, 1, 1]
    assert len(set(compiled_run["lengths"])) == 3


def test_compiled_layer_is_one_graph_attention_included(compiled_run):
    """The sample boundaries are found before the layers (``add_sample_boundaries``) and the attention kernel
    is one custom op, so nothing splits a layer: one graph for all layers and micro-batches. (Found inside
    the attention, as before, they broke every layer in two, and Dynamo compiled each half apart.)"""
    assert compiled_run["graph_breaks"] == 0
    assert compiled_run["graphs"] == 1


def test_compiled_layer_is_traced_once(compiled_run):
    """The layer's float attributes (LoRA's scaling and dropout, the norms' eps, the attention's scale and
    dropout) are constants to the compiler: with ``dynamic=True`` alone Dynamo made each an input, then
    specialized the ones the layer branches on and traced the whole layer a second time (a restart of
    its analysis: ``compile_attempt_1``), which doubled tracing and AOTAutograd's time (bench/compile_probe.py)."""
    assert compiled_run["attempts"] == ["compile_attempt_0"]


def test_compile_language_layers_sets_constant_floats_only_inside_the_layers(processor_at_cap):
    """The private torch behaviour the constant floats rely on: ``Module.compile`` keeps its compiled call in
    ``_compiled_call_impl``, which ``Module.__call__`` runs, so Dynamo's ``specialize_float`` is on while each
    layer compiles, and back to what it was outside them. A torch that moves either fails here."""
    from eogym_sft.models.loading import compile_language_layers
    from eogym_sft.models.tiny import build_tiny_model

    seen = []

    def recording_backend(graph, example_inputs):
        seen.append(torch._dynamo.config.specialize_float)
        return graph.forward

    before = torch._dynamo.config.specialize_float
    model = build_tiny_model(seed=3)
    torch._dynamo.reset()
    compile_language_layers(model, backend=recording_backend)
    with torch.no_grad():
        model(**_packed_batch(processor_at_cap), use_cache=False)
    torch._dynamo.reset()
    assert seen and all(seen)
    assert torch._dynamo.config.specialize_float == before


def test_checkpointed_layers_compile_with_atens_dropout_and_the_others_as_before(processor_at_cap):
    """With every 2nd layer checkpointed (transformers counts the vision blocks first: the tiny tower's 2, then
    decoder layer 0 checkpointed, layer 1 not), each layer's graph compiles with ``fallback_random`` on exactly
    when it holds a checkpointed region, and it is back off outside the layers: a run without checkpointing
    compiles as it did before, with Inductor's random numbers."""
    from eogym_sft.models.loading import compile_language_layers
    from eogym_sft.models.tiny import build_tiny_model

    seen = []

    def recording_backend(graph, example_inputs):
        checkpointed = any(node.target is torch.ops.higher_order.tag_activation_checkpoint for node in graph.graph.nodes)
        seen.append((checkpointed, torch._inductor.config.fallback_random))
        return graph.forward

    before = torch._inductor.config.fallback_random
    model = apply_lora(_varlen(build_tiny_model(seed=3)), dropout=0.1).train()
    torch._dynamo.reset()
    compile_language_layers(model, backend=recording_backend)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=2)
    model(**_packed_batch(processor_at_cap), use_cache=False).loss.backward()
    torch._dynamo.reset()
    assert sorted(seen) == [(False, False), (True, True)]
    assert torch._inductor.config.fallback_random == before


@pytest.mark.slow(25)
def test_checkpointed_inductor_layers_with_dropout_give_eager_checkpointings_loss_and_gradients(processor_at_cap):
    """Activation checkpointing with LoRA dropout through Inductor: the masks are eager's (aten's dropout on the
    same generator), and the backward, which recomputes each layer, draws the forward's masks again, so the loss
    and LoRA gradients are eager checkpointing's. With Inductor's own random ops the masks differ, and torch 2.11
    failed to compile the layer at all (models/loading.py, ``layer_call``)."""
    from helpers import perturb_lora_b

    from eogym_sft.models.loading import compile_language_layers
    from eogym_sft.models.tiny import build_tiny_model

    batch = _packed_batch(processor_at_cap)
    runs = []
    torch._dynamo.reset()
    for compiled in (False, True):
        model = perturb_lora_b(apply_lora(_varlen(build_tiny_model(seed=3)), dropout=0.5), seed=3).train()
        if compiled:
            compile_language_layers(model)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        torch.manual_seed(7)
        runs.append(_loss_and_grads(model, batch))
    torch._dynamo.reset()
    (eager_loss, eager_grads), (loss, grads) = runs
    torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=1e-6)
    assert eager_grads.keys() == grads.keys() and len(grads) == 2 * 7 * 2  # 2 layers, 7 projections, A and B
    for name, grad in eager_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_compile_language_layers_needs_decoder_layers():
    from eogym_sft.models.loading import compile_language_layers

    with pytest.raises(ValueError, match="language_model.layers"):
        compile_language_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_vision_tower_runs_without_autograd(processor_at_cap):
    """The frozen tower builds no graph even with input gradients on (gradient checkpointing): nothing
    of it is stored for, or recomputed in, the backward pass."""
    from eogym_sft.models.tiny import build_tiny_model

    model = apply_lora(build_tiny_model(seed=3))
    model.enable_input_require_grads()
    seen = []
    model.get_base_model().model.visual.register_forward_hook(lambda module, args, out: seen.append(out))
    model.train()
    loss = model(**_packed_batch(processor_at_cap), use_cache=False).loss
    assert loss.requires_grad and len(seen) == 1
    outputs = [t for t in torch.utils._pytree.tree_leaves(seen[0]) if isinstance(t, torch.Tensor)]
    assert outputs and not any(t.requires_grad for t in outputs)


def test_compiled_layers_do_not_recompile_between_training_and_evaluation(compiled_run):
    """The recipe evaluates (no grad, eval mode) between training steps, on other lengths: evaluation
    adds one compiled entry the first time and none after, so rounds of training and evaluation never
    approach Dynamo's recompile limit (made an error here)."""
    assert compiled_run["entries_with_evaluation"] == [2, 2, 2]


def test_apply_lora_warns_about_nothing_we_set():
    """PEFT reads transformers' deprecated ``is_gradient_checkpointing`` while wrapping a model; ``apply_lora``
    keeps that FutureWarning (about no setting of ours) out of every training run, and lets others through."""
    import warnings

    from eogym_sft.models.loading import peft_quietly
    from eogym_sft.models.tiny import build_tiny_model

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_lora(build_tiny_model())
        with peft_quietly():
            warnings.warn("another FutureWarning", FutureWarning)
    assert [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))] == ["another FutureWarning"]
