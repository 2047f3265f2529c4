"""Where a slot-decoder decode step's time goes: the step itself, what ``decode()`` adds, sampling, and attention alone.

``run_episodes`` advances every busy slot by one token a loop step: ``SlotDecoder.decode`` (host tensors, their
copies to the GPU, the step, ``logits[busy]``), then ``Sampling.pick`` (the vision ids banned, a draw, ``.tolist()``,
which waits for the GPU). This probe holds ``--slots`` slots at ``--history`` tokens each and times, each call
synchronised before and after (CUDA events beside the host clock on a GPU), means over ``--repeats`` calls after
``--warmup``:

* ``step``: the decode step alone on inputs already on the device: the captured CUDA graph's replay (``--cuda-graphs``)
  or the eager ``_decode_step`` (``--no-cuda-graphs``); with graphs, ``step_eager`` too;
* ``decode``: ``SlotDecoder.decode()`` as a whole, every slot busy;
* ``pick/...``: ``Sampling.pick`` on those ``(slots, vocab)`` logits as ``run_episodes`` calls it (banned vision ids):
  temperature 1.0, greedy, and greedy with the stop tokens held back (the rollout bench's ``min_new_tokens``);
* ``loop_step/...``: one step of ``run_episodes``'s loop: decode, pick (its ``.tolist()`` included), the picks appended;
* attention of one layer alone at the step's shapes, ``--repeats`` calls back to back: ``masked`` as ``_decode_step``
  calls it (q folded to ``(slots, kv_heads, groups, head_dim)``, the boolean ``visible`` mask over the attention span,
  the cache's own strided views) against ``unmasked`` (no mask over exactly the ``history + 1`` keys: the best case when
  every slot has the same length); on a GPU each also under every SDPA backend alone (``masked/efficient``, ...);
  and where FlashAttention-2 runs (CUDA, fp16/bf16, head_dim a multiple of 8 up to 256, compute capability 8.0+),
  candidate decode attentions over a copy of the layer's keys and values laid out ``(slots, max_len, kv_heads,
  head_dim)`` (made once, outside the timing; the decoder itself is unchanged), each reading only the first
  ``history + 1`` keys of every slot:

  - ``flash_varlen``: ``aten._flash_attention_forward``, FlashAttention-2's variable-length forward, one query token of
    all heads a slot (``(slots, heads, head_dim)``), the flat cache as packed sequences from ``slot * max_len``,
    ``seqused_k`` each slot's length, launched for the span (the call branch ``flashdecode`` put in the decoder);
  - ``flash_varlen_folded``: the same op with the query heads of one KV head folded into the query length as the
    masked SDPA call folds them (:func:`fold_gqa`: ``(slots * groups, kv_heads, head_dim)``, ``cum_seq_q = slot *
    groups``, ``max_q = groups``), the output unfolded back (:func:`unfold_gqa`), the fold and unfold timed with it;
  - ``efficient_varlen_folded``: ``aten._efficient_attention_forward`` on that folded query, in its variable-length
    mode with ``seqlen_k`` each slot's length: torch has no FlashAttention kv-cache decode op
    (``setup.flash_arms.flash_kvcache`` says what this torch has);
  - ``sdpa_flash_dense``: SDPA's flash backend over exactly ``history + 1`` keys of every slot (a strided view of the
    copy, no mask), q ``(slots, heads, 1, head_dim)``, ``enable_gqa=True``: the unmasked best case through flash.

  Elsewhere ``setup.flash_arms.absent`` says why they are not there (``"not on CPU"``, ...);
* where the decoder runs the split-KV Triton kernels (CUDA with triton: ``setup.decode_attention`` is ``"split_kv"``),
  ``step/masked_sdpa`` (with graphs) and ``step_eager/masked_sdpa``: the same step with masked SDPA, its attention
  before them; and the attention arms ``split_kv`` (every slot at ``history + 1`` keys), ``split_kv_ragged`` (the slots'
  lengths spread evenly from 1 to ``history + 1``) and ``masked_ragged`` (masked SDPA at those lengths, the ragged
  arm's reference); elsewhere ``setup.split_kv_arms.absent`` says why not;
* ``floor``: the bytes a step must read (the text tower's and head's weights; the keys and values of ``history + 1``
  tokens, and of the span the masked call reads) over ``--bandwidth``: an estimate, not a measurement.

How the caches are filled: one prompt of ``--history`` random text token ids is prefilled into slot 0 by
``SlotDecoder.prefill``; every other slot is prefilled with the same ids, which copies slot 0's keys and values (the
decoder's shared-prefix copy) and computes its last token. Every slot then holds ``--history`` tokens at rotary
positions ``0..history-1``: equal lengths, so span = ``history + 1`` rounded up to ``--span-bucket``. A timed
``decode()`` appends a token; the probe takes it back from the slot's bookkeeping (``tokens``, ``next_pos``) after the
timing, so every call writes row ``history`` and attends over the same span.

With ``--profile N``: a torch profiler table of N loop steps (temperature 1.0) with the decode step run eagerly (the
decoder's ``_step`` swapped for ``_decode_step`` for those steps only): the top kernels and copies by GPU time, the top
ops by host time, and the CUDA runtime's synchronising and copying calls per step.

    bash bench/h200_session.sh decode_probe    # the 4B architecture with random weights, graphs and eager
    python bench/decode_probe.py --model /tmp/tiny --slots 4 --history 300 --repeats 3 --json /tmp/decode_probe.json  # CPU
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eval_throughput import machine_info  # noqa: E402 (the bench folder)
from prep_throughput import write_result  # noqa: E402

BACKENDS = ("flash", "efficient", "cudnn", "math")


def measure(fn, device, repeats: int, warmup: int, after=None, back_to_back: bool = False) -> tuple[dict, object]:
    """``({"ms", "min_ms", "gpu_ms"}, last result)`` of ``fn()`` over ``repeats`` calls after ``warmup``.

    Each call on its own (default): synchronised before and after, ``after()`` (bookkeeping) run outside the timing;
    ``ms`` the mean host time, ``gpu_ms`` the mean time the stream spent between CUDA events recorded right around
    the call (idle gaps while the host works included; None on a CPU). ``back_to_back``: the calls one after another
    between one pair of synchronisations, per call (a kernel's own time, its launches hidden behind the previous one)."""
    import torch

    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    out = None
    for _ in range(warmup):
        out = fn()
        if after is not None:
            after()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else None
    walls, gpus = [], []
    if back_to_back:
        sync()
        start = time.perf_counter()
        if cuda:
            events[0].record()
        for _ in range(repeats):
            out = fn()
        if cuda:
            events[1].record()
        sync()
        walls.append((time.perf_counter() - start) / repeats)
        if cuda:
            gpus.append(events[0].elapsed_time(events[1]) / 1e3 / repeats)
    else:
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            if cuda:
                events[0].record()
            out = fn()
            if cuda:
                events[1].record()
            sync()
            walls.append(time.perf_counter() - start)
            if cuda:
                gpus.append(events[0].elapsed_time(events[1]) / 1e3)
            if after is not None:
                after()
    stats = {
        "ms": round(sum(walls) / len(walls) * 1e3, 4),
        "min_ms": round(min(walls) * 1e3, 4),
        "gpu_ms": round(sum(gpus) / len(gpus) * 1e3, 4) if gpus else None,
        "repeats": repeats,
        "back_to_back": back_to_back,
    }
    return stats, out


def fill_slots(decoder, tokenizer, history: int, seed: int) -> tuple[list[int], float]:
    """Every slot holding the same ``history`` random text ids: slot 0 prefilled, the others copying it. Seconds."""
    import torch

    g = torch.Generator().manual_seed(seed)
    top = min(tokenizer.vocab_size, decoder.lm_head.weight.shape[0])  # ordinary tokens: no special or vision one
    ids = torch.randint(0, top, (history,), generator=g).tolist()
    start = time.perf_counter()
    for s in range(decoder.slots):
        decoder.release(s)
        decoder.prefill(s, ids, [])
    if decoder.device.type == "cuda":
        torch.cuda.synchronize(decoder.device)
    assert all(len(t) == history for t in decoder.tokens) and set(decoder.next_pos) == {history}
    return ids, time.perf_counter() - start


def rewind(decoder) -> None:
    """Take back the token the last ``decode()`` appended to every slot (its cache row is written again next time)."""
    for s in range(decoder.slots):
        decoder.tokens[s].pop()
        decoder.next_pos[s] -= 1


def flash_absent(device, dtype, head_dim: int) -> str | None:
    """Why FlashAttention-2's forward cannot run here (``"not on CPU"``, ...), or None where it can: a CUDA device of
    compute capability 8.0 or more, fp16 or bf16, ``head_dim`` a multiple of 8 up to 256, a torch built with it."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return f"not on {device.type.upper()}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"{str(dtype).replace('torch.', '')}: flash takes float16 or bfloat16"
    if head_dim % 8 or head_dim > 256:
        return f"head_dim {head_dim}: flash takes a multiple of 8 up to 256"
    if not torch.backends.cuda.is_flash_attention_available():
        return "this torch is built without flash attention"
    major, minor = torch.cuda.get_device_capability(device)
    return None if (major, minor) >= (8, 0) else f"compute capability {major}.{minor}: flash takes 8.0 or more"


def flash_ops_here() -> dict:
    """What this torch has for a decode step's attention over a KV cache: the schemas of the two private ops the arms
    call; the aten attention ops; those of them that take each sequence's key count or a block table (``seqused_k``,
    ``seqlen_k``, ``block_table``, ...), with those arguments; and ``flash_kvcache``: whether any aten op is a kv-cache
    decode by name (FlashAttention-2's ``mha_fwd_kvcache`` is compiled into torch 2.14 but registered as no op)."""
    import torch

    try:
        registered = torch._C._dispatch_get_all_op_names()
        names = sorted({n.split("::", 1)[1].split(".")[0] for n in registered if n.startswith("aten::")})
    except AttributeError:  # a torch without the registry's listing: the namespace's own
        names = sorted(dir(torch.ops.aten))
    words = ("kvcache", "kv_cache", "paged")
    attention = [n for n in names if "attention" in n.lower() or any(w in n.lower() for w in words)]
    lengths_args = ("seqused_k", "seqlen_k", "seqlens_k", "cache_seqlens", "block_table", "num_splits")
    takes = {}
    for name in attention:
        packet = getattr(torch.ops.aten, name)
        for overload in packet.overloads():
            args = [a.name for a in getattr(packet, overload)._schema.arguments if a.name in lengths_args]
            if args:
                takes[name if overload == "default" else f"{name}.{overload}"] = args
    kvcache = [n for n in attention if any(w in n.lower() for w in words)]
    flash = torch.ops.aten._flash_attention_forward.default._schema
    return {
        "flash_kvcache": f"aten ops: {', '.join(kvcache)} (not timed)" if kvcache else "no kv-cache decode op in torch.ops.aten",
        "ops_taking_key_lengths": takes,
        "flash_forward_takes": [a.name for a in flash.arguments],
        "flash_forward_schema": str(flash),
        "efficient_forward_schema": str(torch.ops.aten._efficient_attention_forward.default._schema),
        "aten_attention_ops": attention,
    }


def fold_gqa(q, kv_heads: int):
    """One query token a slot, ``(slots, heads, head_dim)``, query head ``j`` reading KV head ``j // groups`` (transformers'
    GQA, ``heads = kv_heads * groups``), as ``(slots * groups, kv_heads, head_dim)``: row ``s * groups + g``, head
    ``h`` holds slot ``s``'s query head ``h * groups + g``, so each KV head's queries are one sequence of ``groups``
    rows per slot. A copy."""
    slots, heads, d = q.shape
    groups = heads // kv_heads
    return q.reshape(slots, kv_heads, groups, d).transpose(1, 2).reshape(slots * groups, kv_heads, d)


def unfold_gqa(out, slots: int):
    """:func:`fold_gqa`'s inverse: ``(slots * groups, kv_heads, head_dim)`` back to ``(slots, heads, head_dim)``."""
    rows, kv_heads, d = out.shape
    groups = rows // slots
    return out.reshape(slots, groups, kv_heads, d).transpose(1, 2).reshape(slots, kv_heads * groups, d)


def masked_attention(q, keys, values, visible, span: int, scale: float):
    """The decoder's decode attention: ``q`` ``(slots, kv_heads, groups, head_dim)`` over the first ``span`` keys of the
    caches ``(slots, kv_heads, max_len, head_dim)``, ``visible`` ``(slots, 1, 1, span)`` masking those past each slot's
    length, by SDPA. ``(slots, kv_heads, groups, head_dim)``."""
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q, keys[:, :, :span], values[:, :, :span], attn_mask=visible, scale=scale)


def flash_decode_calls(q, keys, values, lengths, span: int, scale: float, dense_length: int | None = None, flash=None,
                       efficient=None) -> dict:
    """The candidate decode attentions over one layer's caches, each a call of no arguments returning ``(slots, heads,
    head_dim)`` (query head ``j`` at ``j``, as ``masked_attention``'s output reshaped). ``q`` ``(slots, kv_heads,
    groups, head_dim)`` as the masked call takes it; ``keys``/``values`` the decoder's ``(slots, kv_heads, max_len,
    head_dim)``, copied here once into ``(slots, max_len, kv_heads, head_dim)``; ``lengths`` ``(slots,)`` each slot's
    keys (at most ``span``). ``sdpa_flash_dense`` only with ``dense_length``, every slot's length (no mask: it reads that
    many keys of every slot). ``flash`` and ``efficient`` stand for ``aten._flash_attention_forward`` and
    ``aten._efficient_attention_forward`` (the tests hand in references). Every call keeps to the arguments torch 2.11's
    ops take as well as 2.14's, and none waits for the device."""
    import torch

    flash = torch.ops.aten._flash_attention_forward if flash is None else flash
    efficient = torch.ops.aten._efficient_attention_forward if efficient is None else efficient
    slots, kv_heads, groups, d = q.shape
    max_len = keys.shape[2]
    relaid = [t.transpose(1, 2).contiguous() for t in (keys, values)]  # (slots, max_len, kv_heads, d), outside the timing
    flat_k, flat_v = (t.view(slots * max_len, kv_heads, d) for t in relaid)
    starts = torch.arange(slots + 1, dtype=torch.int32, device=q.device)
    cum_k = starts * max_len  # slot s's keys from row s * max_len of the flat cache
    cum_folded = starts * groups  # slot s's folded queries from row s * groups
    used = lengths.to(torch.int32).contiguous()
    heads = q.reshape(slots, kv_heads * groups, d)  # a view: query head h * groups + g at q[:, h, g]

    def flash_varlen():
        out, *_ = flash(heads, flat_k, flat_v, starts, cum_k, 1, span, 0.0, False, False, scale=scale, seqused_k=used)
        return out

    def flash_varlen_folded():
        out, *_ = flash(fold_gqa(heads, kv_heads), flat_k, flat_v, cum_folded, cum_k, groups, span, 0.0, False, False,
                        scale=scale, seqused_k=used)
        return unfold_gqa(out, slots)

    def efficient_varlen_folded():
        # BMHK with one packed batch: the folded queries and the flat cache; custom_mask_type 0 (none), no log-sum-exp
        out, *_ = efficient(fold_gqa(heads, kv_heads)[None], flat_k[None], flat_v[None], None, cum_folded, cum_k, groups,
                            span, 0.0, 0, False, scale=scale, seqlen_k=used)
        return unfold_gqa(out[0], slots)

    calls = {"flash_varlen": flash_varlen, "flash_varlen_folded": flash_varlen_folded,
             "efficient_varlen_folded": efficient_varlen_folded}
    if dense_length is not None:
        dense_k, dense_v = (t[:, :dense_length].transpose(1, 2) for t in relaid)  # (slots, kv_heads, n, d) strided views

        def sdpa_flash_dense():
            return torch.nn.functional.scaled_dot_product_attention(heads[:, :, None], dense_k, dense_v, scale=scale,
                                                                    enable_gqa=True)[:, :, 0]

        calls["sdpa_flash_dense"] = sdpa_flash_dense
    return calls


def split_kv_calls(q, keys, values, length: int, span: int, scale: float) -> tuple[dict, dict]:
    """The split-KV Triton kernels (:func:`eogym_sft.models.decode_attention.decode_attention`, the decoder's attention
    on CUDA) over one layer's caches, each a call of no arguments: ``split_kv`` with every slot at ``length`` keys;
    ``split_kv_ragged`` with the slots' lengths spread evenly from 1 to ``length`` (the kernels stop at each slot's
    length, masked SDPA reads the span whatever they are), and ``masked_ragged``, masked SDPA at those lengths, which
    it is checked against. Also the notes: splits, keys a split, the ragged lengths."""
    import torch

    from eogym_sft.models.decode_attention import decode_attention, split_size, splits_for

    slots = q.shape[0]
    lengths = torch.full((slots,), length, device=q.device)
    ragged = torch.linspace(1, length, slots, device=q.device).round().long()
    visible = (torch.arange(span, device=q.device)[None] < ragged[:, None])[:, None, None]
    calls = {
        "split_kv": lambda: decode_attention(q, keys, values, lengths, span, scale),
        "masked_ragged": lambda: masked_attention(q, keys, values, visible, span, scale),
        "split_kv_ragged": lambda: decode_attention(q, keys, values, ragged, span, scale),
    }
    notes = {"splits": splits_for(span), "split_keys": split_size(span, splits_for(span)), "ragged_lengths": ragged.tolist()}
    return calls, notes


# what a ragged arm's output is checked against (the others: ``masked``); None: not checked (other lengths)
REFERENCE = {"masked_ragged": None, "split_kv_ragged": "masked_ragged"}


def attention_arms(decoder, layer: int, length: int, span: int, seed: int, device, repeats: int, warmup: int) -> tuple[dict, dict]:
    """One layer's decode attention at the step's shapes: ``masked`` as ``_decode_step`` calls it (over ``span`` keys,
    ``length`` visible in every slot) and ``unmasked`` over exactly ``length`` keys; on CUDA each also under every SDPA
    backend alone; where flash runs, :func:`flash_decode_calls`'s candidates (``sdpa_flash_dense`` under SDPA's flash
    backend alone); where the decoder's split-KV kernels run (CUDA with triton), :func:`split_kv_calls`'s arms. ms per
    call (back to back) and the largest difference from ``masked`` (a ragged arm's from ``masked_ragged``); and what
    the flash arms were (``arms``, or ``absent``: why not) beside :func:`flash_ops_here`, and the split-KV arms'
    notes."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    S, kv, groups, d = decoder.slots, decoder.kv_heads, decoder.groups, decoder.head_dim
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(S, kv, groups, d, device=device, dtype=decoder.dtype, generator=g)
    keys, values = decoder.keys[layer], decoder.values[layer]
    lengths = torch.full((S,), length, device=device)
    visible = (torch.arange(span, device=device)[None] < lengths[:, None])[:, None, None]  # (S,1,1,span) as the decoder's
    scale = decoder.text.layers[layer].self_attn.scaling

    def masked():
        return masked_attention(q, keys, values, visible, span, scale)

    def unmasked():
        return F.scaled_dot_product_attention(q, keys[:, :, :length], values[:, :, :length], scale=scale)

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    arms = {"masked": (masked, None), "unmasked": (unmasked, None)}
    if device.type == "cuda":
        for name in BACKENDS:
            arms[f"masked/{name}"] = (masked, backends[name])
            arms[f"unmasked/{name}"] = (unmasked, backends[name])
    absent = flash_absent(device, decoder.dtype, d)
    notes = {"absent": absent, "arms": [], **flash_ops_here()}
    if absent is None:
        try:
            calls = flash_decode_calls(q, keys, values, lengths, span, scale, dense_length=length)
        except Exception as err:  # the copies did not fit: named, the other arms go on
            notes["absent"] = f"the cache's copy failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
        else:
            for name, fn in calls.items():
                arms[name] = (fn, backends["flash"] if name == "sdpa_flash_dense" else None)
            notes["arms"] = list(calls)
    from eogym_sft.models.decode_attention import available

    why = "triton is not installed" if device.type == "cuda" else f"not on {device.type.upper()}"
    split_notes = {"absent": None if available(device) else why}
    if available(device):
        calls, more = split_kv_calls(q, keys, values, length, span, scale)
        arms.update({name: (fn, None) for name, fn in calls.items()})
        split_notes.update(more, arms=list(calls))
    notes["split_kv_arms"] = split_notes
    out, ref, results = {}, None, {}
    for name, (fn, backend) in arms.items():
        def call(fn=fn, backend=backend):
            if backend is None:
                return fn()
            with sdpa_kernel([backend]), warnings.catch_warnings():  # a refusing backend warns why, then raises
                warnings.simplefilter("ignore")
                return fn()
        try:
            stats, res = measure(call, device, repeats, warmup, back_to_back=True)
        except Exception as err:  # a backend that refuses these inputs is named, the rest go on
            out[name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
            continue
        res = res.reshape(S, -1).float()  # SDPA's (S, kv, groups, d) and flash's (S, heads, d) hold the heads in one order
        ref = res if ref is None else ref
        results[name] = res
        against = results.get(REFERENCE[name]) if name in REFERENCE else ref
        out[name] = stats if against is None else {**stats, "max_abs_diff": float((res - against).abs().max())}
    return out, notes


def masked_sdpa_step(decoder, inputs, span: int, graphs: bool, device, repeats: int, warmup: int) -> dict:
    """The decode step with the decoder's masked SDPA attention in place of the split-KV kernels it runs on CUDA:
    ``step/masked_sdpa``, a graph of its own replayed (with ``graphs``), and ``step_eager/masked_sdpa``."""
    from eogym_sft.agent.cuda_graphs import GraphedStep

    parts = {}
    decoder.attention = "masked_sdpa"
    try:
        if graphs:
            other = GraphedStep(decoder._decode_step, decoder.slots, device)
            other(*inputs, span)  # captures with masked SDPA: the replay keeps it after the attribute is back
            parts["step/masked_sdpa"], _ = measure(other.graphs[span][0].replay, device, repeats, warmup)
        parts["step_eager/masked_sdpa"], _ = measure(lambda: decoder._decode_step(*inputs, span), device, repeats, warmup)
    finally:
        decoder.attention = "split_kv"
    return parts


def floor_estimate(decoder, model, length: int, span: int, bandwidth: float) -> dict:
    """Bytes a decode step reads at the least (weights once, the keys and values of ``length`` tokens a slot) and
    with the span the masked attention reads, over ``bandwidth``; the embedding rows looked up and the writes left out."""
    params = {}
    for module in (decoder.text.layers, decoder.text.norm, decoder.lm_head):  # a tied head is the embedding: once
        for p in module.parameters():
            params[p.data_ptr()] = p.numel() * p.element_size()
    weights = sum(params.values())
    element = decoder.keys[0].element_size()
    per_token = 2 * len(decoder.keys) * decoder.kv_heads * decoder.head_dim * element  # keys and values, every layer
    kv_exact, kv_span = decoder.slots * length * per_token, decoder.slots * span * per_token
    all_weights = sum(p.numel() * p.element_size() for p in {p.data_ptr(): p for p in model.parameters()}.values())
    return {
        "weight_bytes": weights, "model_weight_bytes": all_weights, "kv_bytes": kv_exact, "kv_bytes_span": kv_span,
        "kv_bytes_per_token": per_token, "bandwidth_bytes_per_s": bandwidth,
        "floor_ms": round((weights + kv_exact) / bandwidth * 1e3, 4),
        "floor_span_ms": round((weights + kv_span) / bandwidth * 1e3, 4),
        "weights_ms": round(weights / bandwidth * 1e3, 4), "kv_ms": round(kv_exact / bandwidth * 1e3, 4),
        "attention_one_layer_floor_ms": round(kv_exact / len(decoder.keys) / bandwidth * 1e3, 4),
    }


def profile_loop(decoder, loop_step, after, steps: int, device, rows: int) -> dict:
    """Torch profiler over ``steps`` loop steps with the decode step run eagerly: the top GPU kernels and copies by GPU
    time and ops by host time, and the CUDA runtime calls that synchronise or copy, per step. Nothing is synchronised
    but by the steps themselves (each ends in the pick's ``.tolist()``)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    saved, decoder._step = decoder._step, decoder._decode_step  # eager for these steps only
    try:
        loop_step()  # warm-up outside the profile
        after()
        with profile(activities=activities) as prof:
            for _ in range(steps):
                loop_step()
                after()
    finally:
        decoder._step = saved
    averages = prof.key_averages()
    gpu_key = "self_device_time_total"
    on_gpu = [e for e in averages if e.device_type == DeviceType.CUDA]  # kernels and copies: ops would count them twice
    on_host = [e for e in averages if e.device_type == DeviceType.CPU]

    def top(events, key):
        ranked = sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)[:rows]
        return [{"op": e.key, "calls_per_step": round(e.count / steps, 2), "self_ms_per_step": round(getattr(e, key, 0) / 1e3 / steps, 4)}
                for e in ranked]

    runtime = {e.key: round(e.count / steps, 2) for e in averages
               if "Synchronize" in e.key or "Memcpy" in e.key or e.key in ("aten::item", "aten::_local_scalar_dense")}
    return {
        "steps": steps,
        "gpu_busy_ms_per_step": round(sum(getattr(e, gpu_key, 0) for e in on_gpu) / 1e3 / steps, 4),
        "host_syncs_per_step": round(sum(n for k, n in runtime.items() if "Synchronize" in k), 2),
        "runtime_calls_per_step": runtime,
        "by_gpu_time": top(on_gpu, gpu_key),
        "by_host_time": top(on_host, "self_cpu_time_total"),
    }


def format_table(result: dict) -> str:
    m, setup, parts, attn, floor = result["machine"], result["setup"], result["parts"], result["attention_one_layer"], result["floor"]
    lines = [
        f"{m['device_name']} | {result['dtype']} | torch {m['torch']} | {m['date']}",
        f"{setup['slots']} slots x {setup['history']} tokens, span {setup['span']}, {setup['layers']} layers, "
        f"cuda graphs {setup['cuda_graphs']}, means of {setup['repeats']} after {setup['warmup']}",
        f"{'part':<34} {'ms':>9} {'gpu ms':>9}",
    ]

    def row(name, stats):
        if "error" in stats:
            return f"{name:<34} {stats['error'][:80]}"
        gpu = "-" if stats.get("gpu_ms") is None else f"{stats['gpu_ms']:.3f}"
        diff = f"   max diff from masked {stats['max_abs_diff']:.2e}" if "max_abs_diff" in stats else ""
        return f"{name:<34} {stats['ms']:9.3f} {gpu:>9}{diff}"

    lines += [row(name, stats) for name, stats in parts.items()]
    lines += [row(f"attention, 1 layer: {name}", stats) for name, stats in attn.items()]
    flash = setup["flash_arms"]
    if flash["absent"]:
        lines.append(f"{'attention, 1 layer: flash arms':<34} absent: {flash['absent']}")
    lines.append(f"{'flash kv-cache decode op':<34} {flash['flash_kvcache']}")
    split = setup["split_kv_arms"]
    if split["absent"]:
        lines.append(f"{'attention, 1 layer: split_kv arms':<34} absent: {split['absent']}")
    else:
        lines.append(f"{'split_kv':<34} {split['splits']} splits of {split['split_keys']} keys; the step's attention: "
                     f"{setup['decode_attention']}")
    lines.append(f"{'floor estimate (weights + kv)':<34} {floor['floor_ms']:9.3f}   ({floor['weight_bytes'] / 1e9:.2f} GB + "
                 f"{floor['kv_bytes'] / 1e9:.2f} GB at {floor['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s; span: {floor['floor_span_ms']:.3f})")
    lines += [f"{k:<34} {v}" for k, v in result["derived"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model folder (e.g. written by eogym-sft tiny-model)")
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--history", type=int, default=6000, help="tokens every slot holds before the step")
    parser.add_argument("--max-context", type=int, default=14336, help="tokens per slot (the cache's stride; the rollout bench's)")
    parser.add_argument("--span-bucket", type=int, default=None, help="the decoder's attn_bucket (default: SlotDecoder's)")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                        help="replay the decode step from CUDA graphs (default: on CUDA)")
    parser.add_argument("--repeats", type=int, default=30, help="timed calls of each part")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls of each part first")
    parser.add_argument("--bandwidth", type=float, default=4.8e12, help="bytes/s for the floor estimate (H200 HBM3e: 4.8e12)")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="profile N eager loop steps (0: no profile)")
    parser.add_argument("--profile-rows", type=int, default=25)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="decode_probe.json", help="where to write the result")
    args = parser.parse_args(argv)

    import torch

    from eogym_sft.agent.decoder import SlotDecoder
    from eogym_sft.agent.sampling import Sampling, vision_token_ids
    from eogym_sft.metrics.scoring import END_MARKERS
    from eogym_sft.models.loading import load_inference_model, resolve_device
    from eogym_sft.models.processor import load_processor

    device, dtype = resolve_device(args.device, args.dtype)
    graphs = device.type == "cuda" if args.cuda_graphs is None else args.cuda_graphs
    bucket = args.span_bucket or inspect.signature(SlotDecoder.__init__).parameters["attn_bucket"].default
    if args.history + 2 > args.max_context:
        raise SystemExit(f"--history {args.history} does not fit --max-context {args.max_context} (a token and the scratch row)")
    tokenizer = load_processor(args.model).tokenizer
    stop_ids = [tokenizer.convert_tokens_to_ids(m) for m in END_MARKERS]
    banned = vision_token_ids(tokenizer)
    start = time.perf_counter()
    model = load_inference_model(args.model, [], device, dtype)
    load_s = time.perf_counter() - start
    decoder = SlotDecoder(model, args.slots, args.max_context, attn_bucket=bucket, cuda_graphs=graphs)
    S, L = args.slots, args.history
    length = L + 1  # the step's own token is attended to as well
    span = min(decoder.max_len, -(-length // bucket) * bucket)  # as decode() rounds it
    generator = torch.Generator(device=device).manual_seed(args.seed)
    reps, warm = args.repeats, args.warmup
    parts = {}

    with torch.inference_mode():
        ids, prefill_s = fill_slots(decoder, tokenizer, L, args.seed)
        first = ids[-1]
        inputs = [torch.full((S,), v, dtype=torch.long, device=device) for v in (first, L, L, length)]  # tokens, write, pos, length

        # (a) the step alone, on inputs already on the device
        if graphs:
            decoder._step(*inputs, span)  # captures this span's graph (and replays it once)
            graph = decoder._step.graphs[span][0]
            parts["step"], _ = measure(graph.replay, device, reps, warm)
            parts["step_eager"], _ = measure(lambda: decoder._decode_step(*inputs, span), device, reps, warm)
        else:
            parts["step"], _ = measure(lambda: decoder._decode_step(*inputs, span), device, reps, warm)

        # (b) decode() as a whole
        every = {s: first for s in range(S)}
        parts["decode"], (order, logits) = measure(lambda: decoder.decode(every), device, reps, warm, after=lambda: rewind(decoder))
        assert order == list(range(S)) and tuple(logits.shape) == (S, decoder.lm_head.weight.shape[0])
        if graphs:
            assert set(decoder._step.graphs) == {span}, "decode() replayed another span's graph than the one timed"

        # (c) the pick on those logits, as run_episodes calls it
        samplings = {
            "temperature1": Sampling(temperature=1.0),
            "greedy": Sampling(),
            "greedy_held_stops": Sampling(min_new_tokens=10**9),  # the rollout bench's: stop tokens held back every step
        }
        for name, sampling in samplings.items():
            parts[f"pick/{name}"], _ = measure(
                lambda sampling=sampling: sampling.pick(logits, [1] * S, stop_ids, generator, banned), device, reps, warm)

        # (d) one step of run_episodes's loop
        turn = {s: [first] for s in range(S)}

        def loop_step(sampling):
            busy = list(range(S))  # every slot busy
            order, logits = decoder.decode({s: turn[s][-1] for s in busy})
            picks = sampling.pick(logits, [len(turn[s]) for s in order], stop_ids, generator, banned)
            for s, tok in zip(order, picks):
                turn[s].append(tok)

        def take_back():
            rewind(decoder)
            for s in range(S):
                del turn[s][:-1]  # the last pick feeds the next step; the turn stays one token long

        for name in ("temperature1", "greedy_held_stops"):
            parts[f"loop_step/{name}"], _ = measure(lambda name=name: loop_step(samplings[name]), device, reps, warm, after=take_back)

        # (e) one layer's attention alone
        attention, flash_arms = attention_arms(decoder, 0, length, span, args.seed, device, reps, warm)
        split_arms = flash_arms.pop("split_kv_arms")

        # (f) the step with masked SDPA, where the decoder runs the split-KV kernels: before and after in one call
        if decoder.attention == "split_kv":
            parts.update(masked_sdpa_step(decoder, inputs, span, graphs, device, reps, warm))

    # (g) the floor
    floor = floor_estimate(decoder, model, length, span, args.bandwidth)
    layers = len(decoder.keys)
    step_ms = parts["step"]["gpu_ms"] or parts["step"]["ms"]

    def per_call(stats):
        return None if "error" in stats else (stats["gpu_ms"] or stats["ms"])

    derived = {
        "decode_minus_step_ms": round(parts["decode"]["ms"] - parts["step"]["ms"], 4),
        "loop_minus_decode_ms": round(parts["loop_step/temperature1"]["ms"] - parts["decode"]["ms"], 4),
        "attention_masked_x_layers_ms": round(per_call(attention["masked"]) * layers, 4),
        "attention_unmasked_x_layers_ms": round(per_call(attention["unmasked"]) * layers, 4),
        **{f"attention_{name}_x_layers_ms": round(per_call(attention[name]) * layers, 4)
           for name in flash_arms["arms"] + split_arms.get("arms", []) if "error" not in attention[name]},
        "step_over_floor": round(step_ms / floor["floor_ms"], 3),
    }
    result = {
        "bench": "decode_probe",
        "command": " ".join(["python", "bench/decode_probe.py", *(argv if argv is not None else sys.argv[1:])]),
        "model": args.model,
        "dtype": str(dtype).replace("torch.", ""),
        "machine": machine_info(device),
        "setup": {
            "slots": S, "history": L, "attended": length, "span": span, "span_bucket": bucket, "max_context": args.max_context,
            "cuda_graphs": graphs, "repeats": reps, "warmup": warm, "layers": layers, "kv_heads": decoder.kv_heads,
            "groups": decoder.groups, "head_dim": decoder.head_dim, "vocab": int(decoder.lm_head.weight.shape[0]),
            "banned_ids": len(banned), "load_s": round(load_s, 2), "fill_s": round(prefill_s, 3),
            "fill": "slot 0 prefilled with --history random text ids; every other slot prefilled with the same ids "
                    "(the decoder's prefix copy, its last token computed); each timed decode() taken back after its timing",
            "timing": "parts: each call synchronised before and after, mean host ms and mean CUDA-event ms; "
                      "attention: calls back to back, per call",
            "flash_arms": flash_arms,
            "decode_attention": decoder.attention,
            "split_kv_arms": split_arms,
        },
        "parts": parts,
        "attention_one_layer": attention,
        "floor": floor,
        "derived": derived,
    }
    if args.profile:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")  # kept should the profiler fail
        with torch.inference_mode():
            result["profile_eager_loop_steps"] = profile_loop(
                decoder, lambda: loop_step(samplings["temperature1"]), take_back, args.profile, device, args.profile_rows)
        prof = result["profile_eager_loop_steps"]
        print(f"profile of {prof['steps']} eager loop steps: GPU busy {prof['gpu_busy_ms_per_step']} ms a step, "
              f"host syncs a step {prof['host_syncs_per_step']}, runtime calls a step {prof['runtime_calls_per_step']}")
        for key in ("by_gpu_time", "by_host_time"):
            print(key, *(f"  {r['self_ms_per_step']:9.4f} ms {r['calls_per_step']:8.2f}x {r['op'][:90]}" for r in prof[key]),
                  sep="\n", flush=True)
    return write_result(result, args.json, format_table(result))


if __name__ == "__main__":
    main()
