"""Model setup: load Qwen3-VL, freeze the vision tower and aligner, put LoRA on the language model;
for evaluation and rollouts, load a base model once with every adapter to compare (one arm each)."""

from __future__ import annotations

import logging
import re
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from ..quiet import old_checkpointing_names_quietly
from .patch_embed import patch_embed_as_matmul

logger = logging.getLogger(__name__)

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The vision tower (blocks: qkv/proj/linear_fc1/2) and the aligner (visual.merger and
# visual.deepstack_merger_list) all live under `visual.`.
VISION_MARKER = ".visual."
DECODER_LAYER_RE = re.compile(r"(^|\.)language_model\.layers\.\d+$")


def load_base_model(name_or_path: str, dtype: str | torch.dtype = "bfloat16", attn_implementation: str | None = "sdpa",
                    trust_remote_code: bool = False):
    """``AutoModelForImageTextToText`` from a hub id or local folder, with the KV cache off for training, the
    text tower's sample boundaries found once a forward (the ``eogym_varlen`` attentions) and the vision tower's
    patch embedding run as a matmul (:mod:`.patch_embed`)."""
    from transformers import AutoModelForImageTextToText

    from .attention import NAMES as VARLEN_NAMES
    from .attention import add_sample_boundaries, register_varlen_attention

    varlen = attn_implementation in VARLEN_NAMES
    if varlen:
        # The vision tower has its own per-image varlen attention; only the text tower is switched.
        register_varlen_attention()
        attn_implementation = {"text_config": attn_implementation, "vision_config": "sdpa", "": "sdpa"}
    model = AutoModelForImageTextToText.from_pretrained(
        name_or_path, dtype=dtype, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code
    )
    patch_embed_as_matmul(model)
    # Packed (padding-free) batches are told apart by their position ids only when no cache is built.
    model.config.use_cache = False
    if varlen:
        add_sample_boundaries(model)
    return model


def peft_quietly():
    """PEFT's ``PeftModel`` reads transformers' deprecated ``is_gradient_checkpointing`` (transformers >= 5.24
    names it ``is_activation_checkpointing``): a FutureWarning on every adapter, about nothing our settings do."""
    return old_checkpointing_names_quietly(("is_gradient_checkpointing",))


def unwrap_peft(model):
    """The model under a PEFT wrapper (the ``...ForConditionalGeneration`` its LoRA layers are injected in), or
    ``model`` itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def lora_target_regex(targets=LORA_TARGETS) -> str:
    """A PEFT ``target_modules`` regex that matches only the language model's projections."""
    return rf".*\.language_model\..*\.({'|'.join(targets)})"


def apply_lora(model, r: int = 16, alpha: int = 32, dropout: float = 0.05, targets=LORA_TARGETS):
    """Freeze everything, then add LoRA adapters on the language model's projections only."""
    from peft import LoraConfig, get_peft_model

    for param in model.parameters():
        param.requires_grad_(False)
    config = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=lora_target_regex(targets), task_type="CAUSAL_LM"
    )
    with peft_quietly():
        peft_model = get_peft_model(model, config)
    check_trainable(peft_model)
    return peft_model


def continue_lora(model, adapter_dir: str):
    """Load a LoRA adapter (e.g. the SFT recipe's output) onto ``model`` to train it further."""
    from peft import PeftModel

    with peft_quietly():
        peft_model = PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)
    check_trainable(peft_model)
    return peft_model


def check_trainable(model) -> dict:
    """Fail if anything but language-model LoRA weights would train; return the parameter counts."""
    bad = [n
           for n, p in model.named_parameters() if p.requires_grad and (VISION_MARKER in f".{n}" or "lora_" not in n)]
    if bad:
        raise RuntimeError(f"only language-model LoRA weights may train, but these are trainable: {bad[:8]}")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    if trainable == 0:
        raise RuntimeError("no trainable parameters: the LoRA targets matched nothing")
    counts = {"trainable": trainable, "total": total, "share": trainable / total}
    logger.info("trainable parameters: %d of %d (%.3f%%)", trainable, total, 100 * counts["share"])
    return counts


def compile_language_layers(model, **compile_kwargs) -> int:
    """Regional ``torch.compile``: each language-model decoder layer in place, the rest eager.

    The 36 layers share one compiled graph, so it is compiled once rather than 36 times, and the
    modules stay where DDP, DeepSpeed, PEFT and gradient checkpointing expect them. It fuses LoRA's
    and the norms' small memory-bound kernels, which is where an eager LoRA step spends much of its time.
    The vision tower runs once per image without gradients; compiling it would gain little.

    Two settings keep it at one graph for a whole run (counted on the tiny model in
    tests/models/test_loading.py): ``dynamic=True``, because packed micro-batches change length every step
    and a static first graph is recompiled on the second length anyway; and inputs that require grad
    (``enable_input_require_grads``), because layer 0 otherwise gets the frozen embeddings (no grad)
    and the other layers a LoRA output, and Dynamo compiles a second graph for that difference.
    Training and evaluation still differ in grad mode: one more graph the first time eval runs.

    The layers' float attributes (LoRA's scaling and dropout, the norms' eps, the attention's scale) are
    compiled as constants: under ``dynamic=True`` alone Dynamo makes each an input, then specializes the
    ones the layer branches on and traces the whole layer again, which doubled tracing and AOTAutograd's
    time (docs/benchmarks.md). They are the same in every layer.

    A layer that runs checkpointed (activation checkpointing, every layer or every N-th) compiles with Inductor's
    random ops left as aten's (:func:`layer_call`): see there why.
    """
    layers = [module for name, module in model.named_modules() if DECODER_LAYER_RE.search(name)]
    if not layers:
        raise ValueError("compile_language_layers: the model has no `language_model.layers.N` modules")
    model.enable_input_require_grads()
    compile_kwargs.setdefault("dynamic", True)
    for layer in layers:
        layer.compile(**compile_kwargs)
        # Module.compile keeps the compiled call here; the settings apply while a layer runs (and compiles),
        # not to the rest of the process. tests/models/test_loading.py fails if a layer is traced twice, or if torch
        # stops calling this attribute or applying the settings.
        layer._compiled_call_impl = layer_call(layer, layer._compiled_call_impl)
    return len(layers)


def layer_call(layer, compiled):
    """``compiled`` (a decoder layer's compiled call) with float attributes as constants, and, while ``layer`` is
    checkpointed, Inductor's ``fallback_random``.

    Inside a checkpointed region Inductor replaces LoRA's dropout by a ``rand`` of the layer's symbolic token
    count, to be drawn again when the backward recomputes the layer; torch 2.11's partitioner then leaves that
    size out of the backward graph and fails (``BackendCompilerFailed: ... Node add_N was invalid, but is
    output``) on every step with checkpointing and dropout. Kept as aten's dropout, its size comes from its input,
    and AOTAutograd still saves the RNG state for the recompute, so the backward draws the forward's mask
    (tests/models/test_loading.py). A layer that is not checkpointed compiles as before, with Inductor's random
    numbers: its runs are unchanged. The layer's flag is read at each call (the Trainer sets it after compiling),
    and Dynamo guards on it, so both kinds of layer keep a graph of their own."""
    constant_floats = torch._dynamo.config.patch(specialize_float=True)(compiled)
    checkpointed = torch._inductor.config.patch(fallback_random=True)(constant_floats)

    def call(*args, **kwargs):
        return (checkpointed if layer.gradient_checkpointing else constant_floats)(*args, **kwargs)

    return call


@dataclass
class Arm:
    """One model to evaluate: the base (``adapter is None``) or the base with one LoRA adapter."""

    name: str
    adapter: str | None = None
    peft_name: str | None = None  # peft adapter names must be valid module keys, so they are internal
    trained_on: str | None = None  # the adapter's base_model_name_or_path, recorded to catch a wrong base


def parse_arms(adapters: list[str], model: str, include_base: bool = True,
               allow_other_base: bool = False) -> list[Arm]:
    """The base arm (unless excluded) then one arm per ``DIR`` or ``NAME=DIR`` in ``adapters``, each
    checked to be trained on ``model`` (:func:`eogym_sft.guards.check_adapter_base`)."""
    from ..guards import adapter_base, check_adapter_base

    arms = [Arm("base")] if include_base else []
    for k, spec in enumerate(adapters):
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = Path(spec.rstrip("/")).name, spec
        check_adapter_base(path, model, allow_other_base)
        arms.append(Arm(name, path, f"arm{k}", adapter_base(path)))
    names = [a.name for a in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"arm names must be unique, got {names}: name adapters with NAME=DIR")
    return arms


def resolve_device(device: str = "auto", dtype: str = "auto"):
    """``(torch.device, torch.dtype)``: ``auto`` is CUDA in bf16 when there is a GPU, else CPU in fp32."""
    resolved = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    if dtype != "auto":
        return resolved, getattr(torch, dtype)
    return resolved, torch.bfloat16 if resolved.type == "cuda" else torch.float32


def load_inference_model(name_or_path: str, arms: list[Arm], device, dtype, attn_implementation: str | None = None):
    """The base model, loaded once in eval mode, with every adapter of ``arms`` attached by peft
    (switch with :func:`use_arm`). ``attn_implementation`` (e.g. ``eogym_varlen``) loads it as
    :func:`load_base_model` does, for whole-sequence scoring without a KV cache."""
    from transformers import AutoModelForImageTextToText

    if attn_implementation is None:
        model = AutoModelForImageTextToText.from_pretrained(name_or_path, dtype=dtype, device_map={"": str(device)})
        patch_embed_as_matmul(model)
    else:
        model = load_base_model(name_or_path, dtype, attn_implementation).to(device)
    adapters = [a for a in arms if a.adapter]
    if adapters:
        from peft import PeftModel

        with peft_quietly():
            model = PeftModel.from_pretrained(model, adapters[0].adapter, adapter_name=adapters[0].peft_name)
        for arm in adapters[1:]:
            model.load_adapter(arm.adapter, adapter_name=arm.peft_name)
    return model.eval()


@contextmanager
def use_arm(model, arm: Arm):
    """Activate ``arm``'s adapter; for the base arm, disable the adapters of a peft model."""
    if arm.adapter:
        model.set_adapter(arm.peft_name)
        yield model
        return
    from peft import PeftModel

    with model.disable_adapter() if isinstance(model, PeftModel) else nullcontext():
        yield model
