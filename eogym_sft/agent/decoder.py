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
from ..models.layout import mrope_position_ids
from ..models.loading import unwrap_peft
from .cuda_graphs import GraphedStep
from .image_inputs import ImageInput, host_to, image_starts, vision_keywords
from .merged_lora import (ATTENTION_PROJECTIONS, MLP_PROJECTIONS, MergedLinear, merge_plan, plain_mlp, projection_kind,
                          reads)
from .text_norms import fused_rms_norm, module_norm, norms_fuse


@dataclass
class _Prefill:
    """One request of :meth:`SlotDecoder.prefill_many`, and how it is served: from ``source``'s cache up to
    ``start``."""

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


def _text_parts(model):
    """``(inner Qwen3VLModel, lm_head)`` of a plain or PEFT-wrapped Qwen3-VL."""
    base = unwrap_peft(model)
    return base.model, base.lm_head


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
        attn_bucket (`int`): decode attends over the cache up to the longest busy slot rounded up to a
            multiple of this: short episodes do not read the whole cache, and CUDA graphs are captured for few spans.
        cuda_graphs (`bool`): replay the eager decode step as CUDA graphs, one captured per attention span
            the first time that span is used. A 4B model's decode step is many small kernels (36 layers of a few
            dozen each), and launching them one by one from Python costs more than running them. Needs a CUDA model.
        prefill_tokens (`int`): the most new tokens one prefill forward computes when it serves several slots
            (:meth:`prefill_many`): its activations stay those of one long prompt. A single request is never split.

    The text tower's RMSNorms run as torch's fused ``F.rms_norm`` (:func:`fused_rms_norm`) when all of them are
    transformers' plain Qwen3-VL norm in the activations' dtype (:func:`norms_fuse`); otherwise as their modules.

    The decode step's attention (``attention``) is :func:`~eogym_sft.models.decode_attention.decode_attention` on a
    CUDA device with triton (``"split_kv"``: each (slot, KV head) split over the span, reading only the slot's own
    keys), and SDPA with an additive mask over the span elsewhere (``"masked_sdpa"``); setting the attribute switches
    a decoder's next step (graphs captured with the other one stay as they were: :meth:`reset` drops them).

    Each layer's projections (q, k, v, o and the MLP's gate, up and down) run over the weights the model's adapter
    state calls for, an active LoRA adapter merged into one weight kept in a buffer (:mod:`.merged_lora`).

    The weights are chosen, and the buffers filled in place from the current base and LoRA weights, when the decoder
    is built and at every :meth:`check_weights` and :meth:`reset`: call one of them after switching arms or
    changing weights (an optimizer step), as :func:`~eogym_sft.agent.episodes.run_episodes` does at its start.
    """

    def __init__(
        self,
        model,
        slots: int,
        max_len: int,
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
        self.kv_heads, self.head_dim = (cfg.num_key_value_heads,
                                        getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
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
        self.merged: dict[tuple[int, str], MergedLinear] = {}  # (layer, projection) -> its kept merged weight
        self.projections: list[dict] = []  # per layer: projection name -> what runs it
        self.refresh_weights()
        self._step = self._decode_step
        if cuda_graphs:
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
            held = self.merged[key] = MergedLinear(buffer, linear)
        held.linear = linear
        return held

    def weights_read(self) -> tuple:
        """``(layer, projection, what it reads)`` for every projection (:func:`reads`): what captured graphs rely
        on."""
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
        todo = [_Prefill(slot, list(ids), list(images), image_starts(ids, images, self.image_token_id))
                for slot, ids, images in requests]
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
            p.source, p.start = max(((s, self._reusable(s, p)) for s in self._by_preference(p.slot)),
                                    key=lambda x: x[1])
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
        (:func:`host_to`, :func:`vision_keywords`) and image tokens are found there, not by a mask on the GPU."""
        host_ids = torch.tensor(chunk)
        embeds = self.text.embed_tokens(host_to(self.device, host_ids))[None]
        if not images:
            return embeds, None, None
        at = (host_ids == self.image_token_id).nonzero()[:, 0]
        visual = self.inner.visual
        pixels = torch.cat([host_to(self.device, im.pixel_values) for im in images]).to(visual.dtype)
        grid = torch.tensor([im.grid_thw for im in images])
        out = self.inner.get_image_features(pixels, grid, return_dict=True,
                                            **vision_keywords(visual, grid, self.device))
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
                outs.append(F.scaled_dot_product_attention(q[:, :, first:last], keys, values, attn_mask=causal,
                                                           scale=attn.scaling, enable_gqa=True))
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
        """Qwen3-VL's rotary embedding of ``x`` ``(batch, heads, length, head_dim)`` at ``cos``/``sin`` ``(batch,
        length, head_dim)``: transformers' ``apply_rotary_pos_emb`` for one tensor."""
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
            # SDPA turns a boolean mask into an additive one at every call; turned once here for the 36 layers. The
            # value is the one its cuDNN path fills: a finite minimum, which gives a row with any visible key the
            # softmax -inf gives.
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
                    q, self.keys[index][:, :, :span], self.values[index][:, :, :span], attn_mask=bias,
                    scale=attn.scaling
                )
            hidden = hidden + proj["o_proj"](out.reshape(self.slots, 1, -1))
            hidden = hidden + self._mlp(layer, proj, self._norm(layer.post_attention_layernorm, hidden))
        return self.lm_head(self._norm(self.text.norm, hidden[:, 0])).float()
