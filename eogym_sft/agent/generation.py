"""Batched decoding for closed-loop episodes: a fixed set of slots over one preallocated KV cache.

Each slot holds one conversation. :meth:`SlotDecoder.prefill` brings a slot's cache up to a new token
sequence, computing only the tokens past the longest prefix it already holds (the next turn of an
episode recomputes its tool results, not its history); :meth:`SlotDecoder.decode` advances every busy
slot by one token in a single forward. A slot freed by a finished episode takes the next one at once
(continuous refill, driven by :mod:`eogym_sft.agent.episodes`), so no slot waits for the longest episode.

Why not ``model.generate``: it re-encodes the whole history at every turn, pads a batch to its longest
prompt, and its dynamic cache copies itself at every step; and transformers' continuous batching does
not take Qwen3-VL pixel inputs. The forward here is Qwen3-VL's text tower run layer by layer with the
model's own modules over the slot cache, each projection over the weight the model's adapter state calls for
(an active LoRA adapter merged into one: :class:`SlotDecoder`); tests pin it to the model's own forward.
Images (with their DeepStack features and 3-D rotary positions) enter through prefill only: generated
tokens are text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ..models import decode_attention as split_kv
from ..models.layout import grid_token_count, mrope_position_ids

# Qwen3-VL's vision special tokens. A sampled one would stand for image features that do not exist:
# the next prefill (or TRL's training forward) then fails on a mismatch between image tokens and images.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")


def vision_token_ids(tokenizer) -> list[int]:
    """Ids of :data:`VISION_TOKENS` in ``tokenizer`` (those it has): tokens a policy must never write."""
    ids = (tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS)
    return [i for i in ids if i is not None and i != tokenizer.unk_token_id]


@dataclass
class ImageInput:
    """One image as the vision tower takes it (``image_processor`` output for that image alone)."""

    pixel_values: torch.Tensor  # (patches, channels * temporal * patch * patch)
    grid_thw: tuple[int, int, int]
    merge_size: int  # the image processor's: merge_size x merge_size patches make one visual token

    @property
    def tokens(self) -> int:
        return grid_token_count(self.grid_thw, self.merge_size)


def image_input(processor, image) -> ImageInput:
    """Pixel values and grid of one PIL image, resized by the processor's own rules (pixel cap included)."""
    out = processor.image_processor(images=[image], return_tensors="pt")
    return ImageInput(out["pixel_values"], tuple(int(v) for v in out["image_grid_thw"][0]), processor.image_processor.merge_size)


def image_starts(ids: list[int], images: list[ImageInput], image_token_id: int) -> list[int]:
    """Where each image's ``<|image_pad|>`` run begins in ``ids`` (pads already expanded)."""
    starts, i = [], 0
    while len(starts) < len(images) and i < len(ids):
        if ids[i] == image_token_id:
            starts.append(i)
            i += images[len(starts) - 1].tokens
        else:
            i += 1
    if len(starts) != len(images):
        raise ValueError(f"the text holds {len(starts)} images' pads but {len(images)} images were given")
    return starts


@dataclass
class _Prefill:
    """One request of :meth:`SlotDecoder.prefill_many`, and how it is served: from ``source``'s cache up to ``start``."""

    slot: int
    ids: list[int]
    images: list[ImageInput]
    starts: list[int]  # where each image's pads begin in ids
    source: int = 0
    start: int = 0
    logits: torch.Tensor | None = None

    @property
    def copies(self) -> bool:
        """Whether it starts by copying another slot's cache."""
        return self.source != self.slot and self.start > 0


# A masked key's additive bias in the decode step (what SDPA's cuDNN path turns a boolean mask into).
MASKED = -65504.0

# The most new tokens of one batched prefill forward: about two first turns of EO-Gym's 5-8k-token prompts,
# or a step's next turns of 16-32 slots (a crop is a few hundred tokens each).
PREFILL_TOKENS = 16384


def host_to(device, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (on the host) on ``device``, queued without waiting for the GPU: a copy from pageable memory first
    waits for every kernel already queued, so on CUDA the tensor travels through pinned memory, asynchronously (the
    pinned block is kept until the copy is done). A tensor already on a GPU is moved as it is."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def vision_metadata(visual, grid: torch.Tensor, device) -> dict:
    """Keyword arguments for Qwen3-VL's vision tower that carry what its forward would otherwise derive from
    ``grid`` on the GPU (a host synchronisation for each ``.tolist()``, one per block for the attention's image
    lengths), computed here on the host from the host's ``grid`` by transformers' own helpers: the position
    embedding's interpolation taps, the rotary positions, and the image boundaries (left on the host where the
    attention only splits by them, on ``device`` for flash's variable-length kernel). ``visual`` is the model's
    ``Qwen3VLVisionModel``; the features equal the unassisted forward's
    (``tests/agent/test_generation.py::test_the_vision_metadata_from_the_host_gives_the_same_features``)."""
    from transformers.utils.generic import is_flash_attention_requested
    from transformers.vision_utils import (
        get_vision_attention_seqlens,
        get_vision_interpolation_indices_and_weights,
        get_vision_position_ids,
    )

    indices, weights = get_vision_interpolation_indices_and_weights(
        grid, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
        align_corners=visual.interpolation_align_corners, spatial_merge_size=visual.config.spatial_merge_size,
    )
    cu_seqlens, max_seqlen = get_vision_attention_seqlens(grid, visual.config)
    return {
        "interp_indices": host_to(device, indices),
        "interp_weights": host_to(device, weights),
        "position_ids": host_to(device, get_vision_position_ids(grid, visual.spatial_merge_size)),
        "cu_seqlens": host_to(device, cu_seqlens) if is_flash_attention_requested(visual.config) else cu_seqlens,
        "max_seqlen": max_seqlen,
    }


def _text_parts(model):
    """``(inner Qwen3VLModel, lm_head)`` of a plain or PEFT-wrapped Qwen3-VL."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model, base.lm_head


def norms_fuse(text, dtype) -> bool:
    """Whether every RMSNorm of the text tower ``text`` (each layer's four and the last) can run as torch's fused
    ``F.rms_norm``: each a plain ``weight * x / rms(x)`` (transformers' Qwen3-VL text norm: a ``weight`` and a
    ``variance_epsilon``, nothing else) whose weight has the activations' dtype ``dtype``."""
    norms = [text.norm] + [n for layer in text.layers for n in (layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn.q_norm, layer.self_attn.k_norm)]
    return all(type(n).__name__.endswith("TextRMSNorm") and hasattr(n, "variance_epsilon") and n.weight.dtype == dtype for n in norms)


def fused_rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` by torch's one-kernel RMSNorm, for a norm :func:`norms_fuse` accepted. transformers' forward runs
    about seven kernels (casts, square, mean, rsqrt, two products); a decode step runs 145 norms. The result can
    differ from it in the last bit of bf16: the product by the weight is rounded once, not twice."""
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


def module_norm(norm, x: torch.Tensor) -> torch.Tensor:
    return norm(x)


ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def plain_mlp(mlp) -> bool:
    """Whether ``mlp`` is transformers' Qwen3-VL text MLP, ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, which the
    decoder then computes itself over its projections' weights."""
    return type(mlp).__name__.endswith("TextMLP") and all(hasattr(mlp, name) for name in (*MLP_PROJECTIONS, "act_fn"))


def merge_plan(module):
    """How the decoder runs the projection ``module``: ``(linear, adapters)``, a plain ``nn.Linear`` whose weight and
    bias stand for it once the deltas of the LoRA ``adapters`` are added to that weight (none: the weight as it is),
    or None where only the module's own forward is right.

    A plain ``nn.Linear`` is itself. A PEFT LoRA ``Linear`` over one is its base layer when its adapters are disabled
    or already merged into the base weight, and its base layer plus the active adapters it holds otherwise. None
    (the module called as it is) for another layer type (a quantized or non-Linear LoRA layer, a ``modules_to_save``
    copy, another tuner) and for what ``get_delta_weight`` leaves out: an active adapter with DoRA, a LoRA bias or
    another PEFT variant, dropout in training mode, and adapters merged but disabled (PEFT's forward unmerges them)."""
    if type(module) is torch.nn.Linear:
        return module, []
    if not is_lora_linear(module) or type(module.base_layer) is not torch.nn.Linear:
        return None
    if module.merged:
        return None if module.disable_adapters else (module.base_layer, [])
    if module.disable_adapters:
        return module.base_layer, []
    adapters = [name for name in module.active_adapters if name in module.lora_A]
    if any(not mergeable(module, name) for name in adapters):
        return None
    return module.base_layer, adapters


def is_lora_linear(module) -> bool:
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:
        return False
    return type(module) is Linear


def mergeable(module, adapter: str) -> bool:
    """Whether LoRA ``adapter`` of ``module`` is, in its forward, exactly ``x @ get_delta_weight(adapter).T``."""
    dropout = module.lora_dropout[adapter]
    return not (
        module.use_dora.get(adapter, False)
        or module.lora_bias.get(adapter, False)
        or adapter in getattr(module, "lora_variant", {})
        or (module.training and not isinstance(dropout, torch.nn.Identity))
    )


class MergedLinear:
    """A projection as one matmul over ``weight``, a buffer holding its base layer's weight plus its active LoRA
    deltas, with the base layer's bias."""

    def __init__(self, weight: torch.Tensor, linear: torch.nn.Linear):
        self.weight, self.linear = weight, linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.linear.bias)


def projection_kind(projection) -> str:
    """``"merged"`` (a :class:`MergedLinear`), ``"weight"`` (a plain ``nn.Linear``) or ``"module"`` (anything else)."""
    if isinstance(projection, MergedLinear):
        return "merged"
    return "weight" if type(projection) is torch.nn.Linear else "module"


def reads(projection) -> tuple:
    """What a decode step captured with ``projection`` relies on: the address of the weight it reads, or for a module
    called as it is, the module and its adapter state (a graph replays the adapter it was captured with)."""
    kind = projection_kind(projection)
    if kind != "module":
        return kind, projection.weight.data_ptr()
    state = (getattr(projection, attr, None) for attr in ("active_adapters", "disable_adapters", "merged"))
    return kind, id(projection), *(tuple(v) if isinstance(v, list) else v for v in state)


def common_prefix(a: list, b: list, limit: int, first: int = 64) -> int:
    """How many leading items of ``a`` and ``b`` are equal, up to ``limit``: list-slice comparisons (C loops) over
    blocks that double from ``first`` items, then a bisection inside the first block that differs. A prefill
    compares its request with every slot's thousands of tokens, and most slots share only a prompt's first
    hundred or two (the system turn's opening): slicing whole lists for them copied thousands of items a slot."""
    lo, step = 0, first
    while True:  # a[:lo] == b[:lo]
        hi = min(lo + step, limit)
        if lo == hi:
            return limit
        if a[lo:hi] != b[lo:hi]:
            break
        lo, step = hi, 2 * step
    while hi - lo > 1:  # a[:lo] == b[:lo], a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class SlotDecoder:
    """``slots`` conversations of up to ``max_len`` tokens each, decoded together.

    Args:
        model: a Qwen3-VL ``...ForConditionalGeneration`` (optionally PEFT-wrapped), in eval mode.
        slots (`int`): conversations held at once (the decode batch).
        max_len (`int`): tokens per conversation, history and generation included.
        compile (`str`, *optional*): a ``torch.compile`` mode for the one-token decode step, e.g.
            ``"default"`` or ``"reduce-overhead"`` (CUDA graphs); ``None`` runs it eagerly.
        attn_bucket (`int`): decode attends over the cache up to the longest busy slot rounded up to a
            multiple of this: short episodes do not read the whole cache, and a compiled step sees few shapes.
        cuda_graphs (`bool`): replay the eager decode step as CUDA graphs, one captured per attention span
            the first time that span is used (no compiler). A 4B model's decode step is many small kernels (36
            layers of a few dozen each), and launching them one by one from Python costs more than running them.
            Needs a CUDA model; not with ``compile`` (whose ``"reduce-overhead"`` mode graphs the step itself).
        prefill_tokens (`int`): the most new tokens one prefill forward computes when it serves several slots
            (:meth:`prefill_many`): its activations stay those of one long prompt. A single request is never split.

    The text tower's RMSNorms run as torch's fused ``F.rms_norm`` (:func:`fused_rms_norm`) when all of them are
    transformers' plain Qwen3-VL norm in the activations' dtype (:func:`norms_fuse`); otherwise as their modules.

    The decode step's attention (``attention``) is :func:`~eogym_sft.models.decode_attention.decode_attention` on a
    CUDA device with triton (``"split_kv"``: each (slot, KV head) split over the span, reading only the slot's own
    keys), and SDPA with an additive mask over the span elsewhere (``"masked_sdpa"``); setting the attribute switches
    a decoder's next step (graphs captured with the other one stay as they were: :meth:`reset` drops them).

    Each layer's projections (q, k, v, o and the MLP's gate, up and down, which the decoder then combines itself as
    the MLP does: :func:`plain_mlp`) run over weights chosen by :func:`merge_plan` for the model's adapter state. A
    plain ``nn.Linear`` (the base model, a projection no adapter targets, adapters disabled or merged) is called as
    it is. A PEFT LoRA projection with active adapters runs as one matmul over a merged weight ``W + scaling * B @
    A`` (PEFT's ``get_delta_weight``: scaling, rsLoRA and ``fan_in_fan_out`` included) kept in a buffer: its unmerged
    forward is the base matmul, two small LoRA matmuls, a scale and an add, kernels that a decode step pays for even
    replayed from CUDA graphs. What a merged weight cannot express (DoRA, a LoRA bias, another PEFT variant, dropout
    in training mode, a quantized or non-Linear LoRA layer, ``modules_to_save`` over a projection) keeps that
    projection's module forward, one projection at a time; a layer whose MLP is not the plain one calls its MLP.

    The merged weight rounds ``W + delta`` once in the weight's dtype, so the logits differ from PEFT's unmerged
    forward at that dtype's rounding (bf16's on a GPU; in float32 they agree to about 1e-5). A buffer is allocated
    the first time a projection needs one (same dtype and device as its base weight) and kept, so that CUDA graphs
    read it at one address: while an adapter is active they hold one more copy of the projection weights (6.77 GiB
    in bf16 on the 4B), and stay allocated when the base arm runs next (:meth:`merged_bytes`).

    The weights are chosen, and the buffers filled in place from the current base and LoRA weights, when the decoder
    is built and at every :meth:`check_weights` and :meth:`reset`: call one of them after switching arms or
    changing weights (an optimizer step), as :func:`~eogym_sft.agent.episodes.run_episodes` does at its start.
    """

    def __init__(
        self,
        model,
        slots: int,
        max_len: int,
        compile: str | None = None,
        attn_bucket: int = 512,
        cuda_graphs: bool = False,
        prefill_tokens: int = PREFILL_TOKENS,
    ):
        self.model = model
        self.inner, self.lm_head = _text_parts(model)
        self.text = self.inner.language_model
        cfg = self.text.config
        self.image_token_id = model.config.image_token_id
        self.merge = model.config.vision_config.spatial_merge_size
        self.slots, self.max_len = slots, max_len
        self.device = self.lm_head.weight.device
        self.dtype = self.lm_head.weight.dtype
        self.kv_heads, self.head_dim = cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.groups = cfg.num_attention_heads // cfg.num_key_value_heads
        shape = (slots, self.kv_heads, max_len, self.head_dim)
        layers = len(self.text.layers)
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(layers)]
        self.tokens: list[list[int]] = [[] for _ in range(slots)]  # what each slot's cache holds
        self.images: list[list[ImageInput]] = [[] for _ in range(slots)]  # the images among those tokens
        self.last_prefill_tokens = 0
        self.next_pos = [0] * slots  # rotary position of each slot's next token
        self.attn_bucket = attn_bucket
        self.prefill_tokens = prefill_tokens
        self._norm = fused_rms_norm if norms_fuse(self.text, self.dtype) else module_norm
        # The decode step's attention: split-KV Triton kernels where they run (CUDA, triton importable), which read
        # each slot's own keys only; masked SDPA elsewhere, the reference they are tested against.
        self.attention = "split_kv" if split_kv.available(self.device) else "masked_sdpa"
        from transformers.models.qwen3_vl.modeling_qwen3_vl import rotate_half

        self._rotate_half = rotate_half
        self.compile = compile
        self.merged: dict[tuple[int, str], MergedLinear] = {}  # (layer, projection) -> its kept merged weight
        self.projections: list[dict] = []  # per layer: projection name -> what runs it
        self.refresh_weights()
        self._step = self._decode_step
        if compile:
            import torch._dynamo as dynamo

            for tensor in self.keys + self.values:  # fixed addresses: CUDA graphs can replay over them
                dynamo.mark_static_address(tensor)
            # one graph per attention span bucket
            dynamo.config.cache_size_limit = max(dynamo.config.cache_size_limit, max_len // attn_bucket + 8)
            self._step = torch.compile(self._decode_step, mode=compile, dynamic=False)
        if cuda_graphs:
            if compile:
                raise ValueError("cuda_graphs and compile both take over the decode step: choose one")
            if self.device.type != "cuda":
                raise ValueError(f"cuda_graphs needs the model on a CUDA device, not {self.device}")
            self._step = GraphedStep(
                self._decode_step, slots, self.device, watched=(self.text, self.lm_head), reads=self.weights_read
            )

    # ------------------------------------------------------------ weights

    @torch.no_grad()
    def refresh_weights(self) -> None:
        """Choose every projection's weight for the model's adapter state now (:func:`merge_plan`) and fill the merged
        buffers in place: the base weight, then each active adapter's delta."""
        self.projections = [self._layer_projections(index, layer) for index, layer in enumerate(self.text.layers)]

    def _layer_projections(self, index: int, layer) -> dict:
        modules = {name: getattr(layer.self_attn, name) for name in ATTENTION_PROJECTIONS}
        if plain_mlp(layer.mlp):
            modules.update((name, getattr(layer.mlp, name)) for name in MLP_PROJECTIONS)
        return {name: self._projection((index, name), module) for name, module in modules.items()}

    def _projection(self, key: tuple[int, str], module):
        plan = merge_plan(module)
        if plan is None:
            return module
        linear, adapters = plan
        if not adapters:
            return linear
        merged = self._merged_buffer(key, linear)
        merged.weight.copy_(linear.weight)
        for adapter in adapters:
            merged.weight.add_(module.get_delta_weight(adapter))
        return merged

    def _merged_buffer(self, key: tuple[int, str], linear) -> MergedLinear:
        """The kept buffer of projection ``key``, allocated at its first use (again only if the base weight's shape,
        dtype or device changed)."""
        held, weight = self.merged.get(key), linear.weight
        like = (weight.shape, weight.dtype, weight.device)
        if held is None or (held.weight.shape, held.weight.dtype, held.weight.device) != like:
            with torch.inference_mode(False):  # a plain tensor: refilled in place in and out of inference mode
                buffer = torch.empty_like(weight, requires_grad=False, memory_format=torch.contiguous_format)
            if self.compile:
                import torch._dynamo as dynamo

                dynamo.mark_static_address(buffer)  # read in place, as the caches are, not copied in a graph's inputs
            held = self.merged[key] = MergedLinear(buffer, linear)
        held.linear = linear
        return held

    def weights_read(self) -> tuple:
        """``(layer, projection, what it reads)`` for every projection (:func:`reads`): what captured graphs rely on."""
        return tuple((i, name, reads(p)) for i, layer in enumerate(self.projections) for name, p in layer.items())

    def projection_kinds(self) -> dict[str, int]:
        """How many projections run from a merged buffer, from their own weight and as their module."""
        kinds = [projection_kind(p) for layer in self.projections for p in layer.values()]
        return {kind: kinds.count(kind) for kind in ("merged", "weight", "module")}

    def merged_bytes(self) -> int:
        """Bytes of the merged-weight buffers, kept from their first use for the decoder's life."""
        return sum(m.weight.numel() * m.weight.element_size() for m in self.merged.values())

    # ------------------------------------------------------------ prefill

    def memory_bytes(self) -> int:
        """Bytes of the KV cache (the merged weights are :meth:`merged_bytes`)."""
        return 2 * sum(k.numel() * k.element_size() for k in self.keys)

    def release(self, slot: int) -> None:
        self.tokens[slot] = []
        self.images[slot] = []
        self.next_pos[slot] = 0

    def reset(self) -> None:
        """Empty every slot, forget captured graphs and choose the weights again (:meth:`refresh_weights`): call it
        after the model's weights or active adapter change (a graph replays the kernels, and so the adapter, it was
        captured with)."""
        for slot in range(self.slots):
            self.release(slot)
        if isinstance(self._step, GraphedStep):
            self._step.clear()
        self.refresh_weights()

    @torch.inference_mode()
    def prefill(self, slot: int, ids: list[int], images: list[ImageInput]) -> torch.Tensor:
        """Make slot ``slot`` hold ``ids`` (image pads expanded for ``images``, all images of the
        conversation in order) and return the logits ``(vocab,)`` for the token after them.

        Only the tokens past the longest prefix held by this slot or by any other are computed (another
        slot's keys and values are copied: the samples of one question share their prompt, so it is
        encoded once); a prefix never ends inside an image, and at least the last token is always
        recomputed for its logits. Every ``<|image_pad|>`` has the same id, so the prefix also ends at the
        first image that is not the very :class:`ImageInput` object the slot holds there (the episode's
        picture cache hands out one object per image: same object, same pixels); ``last_prefill_tokens``
        is what this call computed."""
        return self.prefill_many([(slot, ids, images)])[0]

    @torch.inference_mode()
    def prefill_many(self, requests: list[tuple[int, list[int], list[ImageInput]]]) -> list[torch.Tensor]:
        """:meth:`prefill` for several ``(slot, ids, images)`` at once (distinct slots), in one forward where
        their prefixes allow: the slots that end a turn together start their next one together, so a
        short next-turn prefill pays its kernel launches once for all of them. A request that an earlier
        one in ``requests`` would serve a longer prefix than any cache holds now waits for it (a question's
        first sample computes the prompt, its other samples then copy it, together). Returns each request's
        logits, in order; ``last_prefill_tokens`` is what the call computed in all. A forward that fails
        empties every slot it was filling (their caches are half written) and raises."""
        slots = [slot for slot, _, _ in requests]
        if len(set(slots)) != len(slots):
            raise ValueError(f"one prefill fills each slot once, not {slots}")
        for _, ids, _ in requests:
            if len(ids) >= self.max_len:
                raise ValueError(f"{len(ids)} tokens do not fit a slot of {self.max_len}")
        todo = [_Prefill(slot, list(ids), list(images), image_starts(ids, images, self.image_token_id)) for slot, ids, images in requests]
        self.last_prefill_tokens = 0
        waiting = todo
        while waiting:
            now, waiting = self._round(waiting)
            self._prefill_round(now)
        return [p.logits for p in todo]

    def _round(self, waiting: list[_Prefill]) -> tuple[list[_Prefill], list[_Prefill]]:
        """Split ``waiting`` into what one forward computes now and what waits for it: a request waits when an
        earlier one would give it a longer prefix than the caches hold, when it would copy from a slot that
        an earlier copy of this round fills, or when its new tokens would take the forward past
        ``prefill_tokens``. The first never waits."""
        now, later, budget = [], [], self.prefill_tokens
        for index, p in enumerate(waiting):
            p.source, p.start = max(((s, self._reusable(s, p)) for s in self._by_preference(p.slot)), key=lambda x: x[1])
            sooner = any(self._shared_prefix(q.ids, q.images, p) > p.start for q in waiting[:index])
            # copies run in order before the forward: an earlier copy into this one's source would change what it reads
            clash = p.copies and any(q.copies and q.slot == p.source for q in now)
            full = now and budget < len(p.ids) - p.start
            if sooner or clash or full:
                later.append(p)
            else:
                now.append(p)
                budget -= len(p.ids) - p.start
        return now, later

    def _prefill_round(self, now: list[_Prefill]) -> None:
        try:
            for p in now:
                if p.copies:
                    for keys, values in zip(self.keys, self.values):
                        keys[p.slot, :, : p.start] = keys[p.source, :, : p.start]
                        values[p.slot, :, : p.start] = values[p.source, :, : p.start]
            positions = []
            for p in now:
                grids = torch.tensor([im.grid_thw for im in p.images], dtype=torch.long).reshape(-1, 3)
                positions.append(mrope_position_ids(torch.tensor(p.ids), grids, self.image_token_id, self.merge)[1:])
            logits = self._forward_chunks(now, [pos[:, p.start :] for p, pos in zip(now, positions)])
        except BaseException:
            for p in now:
                self.release(p.slot)
            raise
        for p, pos, row in zip(now, positions, logits):
            p.logits = row
            self.tokens[p.slot] = p.ids
            self.images[p.slot] = p.images  # held so that an object's identity stands for its pixels
            self.next_pos[p.slot] = int(pos.max()) + 1
            self.last_prefill_tokens += len(p.ids) - p.start

    def _by_preference(self, slot: int) -> list[int]:
        """The slot itself first (no copy on a tie), then the others."""
        return [slot] + [s for s in range(self.slots) if s != slot]

    def new_tokens(self, ids: list[int], images: list[ImageInput]) -> int:
        """How many tokens a prefill of ``ids`` would compute now, served from the best cache."""
        p = _Prefill(-1, ids, images, image_starts(ids, images, self.image_token_id))
        return len(ids) - max(self._reusable(s, p) for s in range(self.slots))

    def _reusable(self, slot: int, p: _Prefill) -> int:
        """How many leading tokens of ``p.ids`` slot ``slot``'s cache holds as they would be computed now."""
        return self._shared_prefix(self.tokens[slot], self.images[slot], p)

    def _shared_prefix(self, held: list[int], held_images: list[ImageInput], p: _Prefill) -> int:
        """How many leading tokens of ``p.ids`` a cache holding ``held`` (with ``held_images``) would serve: the
        common prefix, cut back to before an image it would split or an image that is not the same object,
        and short of the last token (whose logits are wanted)."""
        ids = p.ids
        limit = min(len(held), len(ids) - 1)
        if not limit:
            return 0
        start = common_prefix(held, ids, limit)
        while start > 0 and ids[start] == self.image_token_id and ids[start - 1] == self.image_token_id:
            start -= 1  # never split an image: its tokens are encoded together
        for index, at in enumerate(p.starts):
            if at >= start:
                break
            if index >= len(held_images) or held_images[index] is not p.images[index]:
                return at  # same token ids, another image: recompute from here
        return start

    def _embed_chunk(self, chunk: list[int], images: list[ImageInput]):
        """The chunk's input embeddings with its images' features in place, where its image tokens are (an index
        tensor) and the DeepStack features, all queued without a host synchronisation: inputs come from the host
        (:func:`host_to`, :func:`vision_metadata`) and image tokens are found there, not by a mask on the GPU."""
        host_ids = torch.tensor(chunk)
        embeds = self.text.embed_tokens(host_to(self.device, host_ids))[None]
        if not images:
            return embeds, None, None
        at = (host_ids == self.image_token_id).nonzero()[:, 0]
        visual = self.inner.visual
        pixels = torch.cat([host_to(self.device, im.pixel_values) for im in images]).to(visual.dtype)
        grid = torch.tensor([im.grid_thw for im in images])
        out = self.inner.get_image_features(pixels, grid, return_dict=True, **vision_metadata(visual, grid, self.device))
        image_embeds = torch.cat(out.pooler_output).to(embeds.dtype)
        if image_embeds.shape[0] != len(at):
            raise ValueError(f"{image_embeds.shape[0]} visual tokens for {len(at)} <|image_pad|> tokens")
        at = host_to(self.device, at)
        embeds[0, at] = image_embeds
        deepstack = [torch.cat(feat).to(embeds.dtype) for feat in out.deepstack_features]
        return embeds, at, deepstack

    def _forward_chunks(self, now: list[_Prefill], positions: list[torch.Tensor]) -> list[torch.Tensor]:
        """One forward of every request's new tokens, side by side in one row: the norms, projections and MLPs
        run once over all of them; each request's attention reads its own slot. Returns each one's logits."""
        chunks = [p.ids[p.start :] for p in now]
        images = [im for p in now for im in p.images[sum(1 for at in p.starts if at < p.start) :]]
        hidden, image_at, deepstack = self._embed_chunk([t for chunk in chunks for t in chunk], images)
        cos, sin = self.text.rotary_emb(hidden, host_to(self.device, torch.cat(positions, dim=1)[:, None, :]))
        spans, offset = [], 0
        for p, chunk in zip(now, chunks):
            end = p.start + len(chunk)
            # The chunk sees the slot's history and itself causally: the diagonal aligned to the bottom right. SDPA
            # takes this bias and the unrepeated GQA heads to its flash kernel, with no mask and no copy of the heads.
            spans.append((p.slot, p.start, end, offset, offset + len(chunk), causal_lower_right(len(chunk), end)))
            offset += len(chunk)
        for index, layer in enumerate(self.text.layers):
            attn, proj = layer.self_attn, self.projections[index]
            x = self._norm(layer.input_layernorm, hidden)
            q, k, v = self._qkv(attn, proj, x, cos, sin)
            outs = []
            for slot, start, end, first, last, causal in spans:
                self.keys[index][slot, :, start:end] = k[0, :, first:last]
                self.values[index][slot, :, start:end] = v[0, :, first:last]
                keys, values = self.keys[index][slot : slot + 1, :, :end], self.values[index][slot : slot + 1, :, :end]
                outs.append(F.scaled_dot_product_attention(q[:, :, first:last], keys, values, attn_mask=causal, scale=attn.scaling, enable_gqa=True))
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
            hidden = hidden + proj["o_proj"](out.transpose(1, 2).reshape(1, offset, -1))
            hidden = hidden + self._mlp(layer, proj, self._norm(layer.post_attention_layernorm, hidden))
            if deepstack is not None and index < len(deepstack):
                hidden[0, image_at] = hidden[0, image_at] + deepstack[index]
        lasts = host_to(self.device, torch.tensor([last - 1 for *_, last, _ in spans]))
        return list(self.lm_head(self._norm(self.text.norm, hidden[0, lasts])).float())

    def _qkv(self, attn, proj, x, cos, sin):
        shape = (*x.shape[:-1], -1, self.head_dim)
        q = self._norm(attn.q_norm, proj["q_proj"](x).view(shape))
        k = self._norm(attn.k_norm, proj["k_proj"](x).view(shape))
        v = proj["v_proj"](x).view(shape).transpose(1, 2)
        # queries and keys rotated as one tensor: one set of elementwise kernels for both, each element's arithmetic
        # that of transformers' apply_rotary_pos_emb
        qk = self.rotate(torch.cat([q, k], dim=-2).transpose(1, 2), cos, sin)
        return qk[:, : q.shape[-2]], qk[:, q.shape[-2] :], v

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Qwen3-VL's rotary embedding of ``x`` ``(batch, heads, length, head_dim)`` at ``cos``/``sin`` ``(batch, length,
        head_dim)``: transformers' ``apply_rotary_pos_emb`` for one tensor."""
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return (x * cos) + (self._rotate_half(x) * sin)

    @staticmethod
    def _mlp(layer, proj, x):
        if "down_proj" not in proj:  # not the plain MLP: its own forward
            return layer.mlp(x)
        return proj["down_proj"](layer.mlp.act_fn(proj["gate_proj"](x)) * proj["up_proj"](x))

    # ------------------------------------------------------------ decode

    @torch.inference_mode()
    def check_weights(self) -> None:
        """Bring the decoder up to the model's weights and adapter state (:meth:`refresh_weights`: the merged buffers
        refilled in place), then drop the kept CUDA graphs if what they read moved since their capture: a parameter
        replaced (not updated in place) or a projection that now reads another weight (an arm switched between the
        base and an adapter); the next step captures them again. Weights only change between runs of episodes, so
        :func:`run_episodes` calls this once a run (a walk over every parameter and a pass over the merged
        projection weights), not once a turn."""
        self.refresh_weights()
        if isinstance(self._step, GraphedStep):
            self._step.check_weights()

    def warm_up(self) -> int:
        """Run the decode step once per attention span, so that a compiled step compiles (and captures its
        CUDA graphs) before a timed or long run rather than during it. Caches are untouched: every slot
        writes the scratch row. Returns the number of spans."""
        spans = sorted({min(self.max_len, b) for b in range(self.attn_bucket, self.max_len + self.attn_bucket, self.attn_bucket)})
        zeros = torch.zeros(self.slots, dtype=torch.long, device=self.device)
        scratch = torch.full((self.slots,), self.max_len - 1, dtype=torch.long, device=self.device)
        self.check_weights()
        for span in spans:
            self._step(zeros, scratch, zeros, zeros + 1, span)
        return len(spans)

    @torch.inference_mode()
    def decode(self, next_tokens: dict[int, int]) -> tuple[list[int], torch.Tensor]:
        """Append one token to each slot in ``next_tokens`` (slot -> token); return the busy slots in
        order and their logits ``(len(busy), vocab)`` for the token after. Slots not named stay as they are."""
        busy = sorted(next_tokens)
        for s in busy:
            if len(self.tokens[s]) + 1 >= self.max_len:
                raise ValueError(f"slot {s} is full ({self.max_len} tokens)")
        tokens = torch.zeros(self.slots, dtype=torch.long)
        write = torch.full((self.slots,), self.max_len - 1, dtype=torch.long)  # idle slots write a scratch row
        pos = torch.zeros(self.slots, dtype=torch.long)
        length = torch.zeros(self.slots, dtype=torch.long)
        for s in busy:
            tokens[s], write[s], pos[s] = next_tokens[s], len(self.tokens[s]), self.next_pos[s]
            length[s] = len(self.tokens[s]) + 1
        span = min(self.max_len, math.ceil(int(length.max()) / self.attn_bucket) * self.attn_bucket)
        args = [host_to(self.device, t) for t in (tokens, write, pos, length)]
        logits = self._step(*args, span)
        for s in busy:
            self.tokens[s].append(next_tokens[s])
            self.next_pos[s] += 1
        return busy, logits[busy]

    def _decode_step(self, tokens, write, pos, length, span: int):
        hidden = self.text.embed_tokens(tokens)[:, None]  # (slots, 1, hidden)
        cos, sin = self.text.rotary_emb(hidden, pos.view(1, -1, 1).expand(3, -1, 1))
        rows = torch.arange(self.slots, device=hidden.device)
        kernel = self.attention == "split_kv"
        if not kernel:
            visible = (torch.arange(span, device=hidden.device)[None] < length[:, None])[:, None, None]  # (S,1,1,span)
            # SDPA turns a boolean mask into an additive one at every call; turned once here for the 36 layers. The value
            # is the one its cuDNN path fills: a finite minimum, which gives a row with any visible key the softmax -inf gives.
            bias = torch.zeros(visible.shape, dtype=self.dtype, device=hidden.device).masked_fill_(~visible, MASKED)
        for index, layer in enumerate(self.text.layers):
            attn, proj = layer.self_attn, self.projections[index]
            x = self._norm(layer.input_layernorm, hidden)
            q, k, v = self._qkv(attn, proj, x, cos, sin)  # q (S, heads, 1, d), k/v (S, kv_heads, 1, d)
            self.keys[index][rows, :, write] = k[:, :, 0]
            self.values[index][rows, :, write] = v[:, :, 0]
            # The query heads of one KV head are folded into the query length: no KV copy per group.
            q = q.reshape(self.slots, self.kv_heads, self.groups, self.head_dim)
            if kernel:  # an idle slot (length 0) gets zeros here, the mean of the span's values from SDPA: never read
                out = split_kv.decode_attention(q, self.keys[index], self.values[index], length, span, attn.scaling)
            else:
                out = F.scaled_dot_product_attention(
                    q, self.keys[index][:, :, :span], self.values[index][:, :, :span], attn_mask=bias, scale=attn.scaling
                )
            hidden = hidden + proj["o_proj"](out.reshape(self.slots, 1, -1))
            hidden = hidden + self._mlp(layer, proj, self._norm(layer.post_attention_layernorm, hidden))
        return self.lm_head(self._norm(self.text.norm, hidden[:, 0])).float()


class GraphedStep:
    """A decode step ``step(tokens, write, pos, length, span)`` replayed from CUDA graphs, one per ``span``.

    The four ``(slots,)`` inputs are copied into fixed buffers that the graphs read; the returned logits are
    the graph's own output tensor, overwritten by the next replay (callers index it, which copies). All
    graphs share one memory pool: they never run at the same time.

    :meth:`clear` drops the graphs *and* their pool. Capturing into a pool whose graphs were all freed trips
    the CUDA caching allocator (``use_count > 0 INTERNAL ASSERT FAILED``: the freed pool's count is 0
    but its id is still known), which is how an adapter arm after the base arm crashed.

    A graph reads each weight at the address it was captured with: a parameter *replaced* (a new tensor,
    ``.data`` swapped, FSDP-style resharding) rather than updated in place would leave it reading the old one.
    :meth:`check_weights` compares the ``watched`` modules' parameter storage, and what ``reads()`` says the step
    reads (the slot decoder's projections: a merged buffer, a weight or a module), with those recorded at the
    first capture and drops the graphs when either changed (the next step captures them again)."""

    def __init__(self, step, slots: int, device, watched=(), reads=lambda: ()):
        self.step = step
        self.inputs = [torch.zeros(slots, dtype=torch.long, device=device) for _ in range(4)]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.watched = tuple(watched)
        self.reads = reads
        self.storage = None  # parameter_storage(watched) when the first graph of the pool was captured
        self.read = None  # reads() then

    def __call__(self, tokens, write, pos, length, span: int) -> torch.Tensor:
        for buffer, value in zip(self.inputs, (tokens, write, pos, length)):
            buffer.copy_(value, non_blocking=True)
        if span not in self.graphs:
            if not self.graphs:  # later graphs are checked against the first one's weights
                self.storage, self.read = parameter_storage(self.watched), self.reads()
            self.graphs[span] = self._capture(span)
        graph, logits = self.graphs[span]
        graph.replay()
        return logits

    def _capture(self, span: int):
        # One eager run first, on a side stream as capture requires: kernels and cuBLAS workspaces get
        # set up outside the capture. It writes this step's keys and values, which the replay writes again.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.step(*self.inputs, span)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):  # image threads run meanwhile
            logits = self.step(*self.inputs, span)
        self.pool = graph.pool()
        return graph, logits

    def clear(self) -> None:
        """Forget every graph and the pool they shared; the next call captures into a fresh pool."""
        self.graphs.clear()
        self.pool = None
        self.storage = self.read = None

    def check_weights(self) -> bool:
        """Drop every graph if a watched parameter has moved, or the step reads other weights, since they were
        captured; True when dropped."""
        if self.graphs and (parameter_storage(self.watched) != self.storage or self.reads() != self.read):
            self.clear()
            return True
        return False


def parameter_storage(modules) -> tuple:
    """``(name, data_ptr, shape)`` of every parameter of ``modules``: what a captured CUDA graph relies on."""
    return tuple((name, p.data_ptr(), tuple(p.shape)) for m in modules for name, p in m.named_parameters())


@dataclass
class Sampling:
    """Greedy (``temperature`` 0) or temperature / top-k / top-p sampling, with the stop tokens held
    back until a turn has ``min_new_tokens`` tokens (benchmarks force a fixed length that way)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_new_tokens: int = 0

    def pick(self, logits: torch.Tensor, generated: list[int], stop_ids: list[int], generator=None, banned_ids=()) -> list[int]:
        """One next token per row of ``logits`` ``(rows, vocab)``; ``generated`` = tokens each row's turn has so far.
        ``banned_ids`` are never picked (the vision special tokens, :func:`vision_token_ids`)."""
        if len(banned_ids):
            logits = logits.index_fill(-1, torch.tensor(list(banned_ids), device=logits.device), float("-inf"))
        early = [i for i, n in enumerate(generated) if n < self.min_new_tokens]
        if early:
            logits = logits.clone()
            logits[torch.tensor(early, device=logits.device)[:, None], torch.tensor(stop_ids, device=logits.device)] = float("-inf")
        if self.temperature <= 0:
            return logits.argmax(-1).tolist()
        logits = logits / self.temperature
        if self.top_k > 0:
            kth = torch.topk(logits, min(self.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            probs = torch.softmax(logits, dim=-1)
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= self.top_p  # the top token always stays
            weights = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
        else:
            weights = (logits - logits.amax(-1, keepdim=True)).exp_()  # unnormalised: the draw below scales by the sum
        return draw(weights, generator)


def draw(weights: torch.Tensor, generator=None) -> list[int]:
    """One index per row of ``weights`` ``(rows, n)``, drawn with probability proportional to its weight
    (zero weights are never drawn): the inverse of the cumulative sum at a uniform draw. Exactly what
    ``torch.multinomial(weights, 1)`` samples, and on a CPU about six times faster over a 151,936-token
    vocabulary (measured: 64 rows, 0.13 s against 0.75 s), the largest cost of a CPU rollout's decode step."""
    cdf = weights.cumsum(-1)
    u = torch.rand(cdf.shape[0], 1, generator=generator, device=cdf.device, dtype=cdf.dtype)
    picks = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)  # right: a zero weight after its cdf step is skipped
    return picks[:, 0].clamp_max(cdf.shape[-1] - 1).tolist()
