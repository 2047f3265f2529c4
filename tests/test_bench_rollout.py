"""bench/rollout_throughput.py runs end to end on CPU with the tiny model and tiny settings."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_rollout_bench_runs_all_arms_on_the_same_episodes(tiny_model_dir, tmp_path, data_root, row_factory):
    sys.path.insert(0, str(BENCH))
    from rollout_throughput import format_table, main

    rows = [row_factory(row_id=f"r{k}", n_steps=2) for k in range(2)]  # two recorded crop steps each
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "rollout.json"
    result = main([
        "--model", str(tiny_model_dir), "--data", str(data), "--data-root", str(data_root), "--episodes", "2",
        "--serial-episodes", "1", "--concurrency", "2", "--turns", "2", "--new-tokens", "2", "--min-prompt-tokens", "0",
        "--max-context", "2048", "--json", str(out),
    ])
    assert json.loads(out.read_text()) == result
    serial, batched, slots = result["runs"]
    assert (serial["arm"], batched["arm"], slots["arm"]) == ("serial", "batched2", "slots2")
    # the same episodes (2 turns: a recorded crop result comes back), exactly --new-tokens per turn in every arm
    assert batched["turns"] == slots["turns"] == 4 and batched["new_tokens"] == slots["new_tokens"] == 8
    assert (serial["episodes"], serial["turns"], serial["new_tokens"]) == (1, 2, 4)
    assert 0 < slots["prefill_tokens"] and batched["speedup_vs_batched"] == 1.0
    assert 0 < slots["prefill_vision_s"] <= slots["prefill_s"]  # the vision tower runs inside the prefills
    assert slots["decode_attention"] == "masked_sdpa"  # the split-KV kernels run on CUDA only
    assert "gen tok/s" in format_table(result)


def test_rollout_bench_switches_from_the_base_to_an_adapter(tiny_model_dir, tmp_path, data_root, row_factory):
    sys.path.insert(0, str(BENCH))
    from helpers import perturb_lora_b
    from rollout_throughput import main

    from eogym_sft.models.loading import apply_lora, load_base_model

    adapter = tmp_path / "adapter"
    perturb_lora_b(apply_lora(load_base_model(str(tiny_model_dir), "float32", "sdpa")), seed=0).save_pretrained(adapter)
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(row_factory(row_id="r0", n_steps=2)) + "\n")
    result = main([
        "--model", str(tiny_model_dir), "--data", str(data), "--data-root", str(data_root), "--episodes", "1",
        "--concurrency", "1", "--turns", "2", "--new-tokens", "2", "--min-prompt-tokens", "0", "--max-context", "2048",
        "--arms", "slots", "--adapter", str(adapter), "--json", str(tmp_path / "rollout.json"),
    ])
    base, tuned = result["runs"]
    assert (base["arm"], tuned["arm"]) == ("slots1-base", "slots1-adapter")
    assert base["new_tokens"] == tuned["new_tokens"] == 4 and "error" not in tuned


def test_prefill_probe_times_each_part_and_its_attention_arms_agree(tiny_model_dir, tmp_path, data_root, row_factory):
    sys.path.insert(0, str(BENCH))
    from prefill_probe import main

    rows = [row_factory(row_id=f"r{k}", n_steps=2) for k in range(2)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "probe.json"
    result = main([
        "--model", str(tiny_model_dir), "--data", str(data), "--data-root", str(data_root), "--episodes", "2",
        "--min-prompt-tokens", "0", "--max-context", "4096", "--reps", "1", "--profile-rows", "3", "--json", str(out),
    ])
    assert json.loads(out.read_text()) == result
    first, second = result["episodes"]
    for row in (first, second):
        assert row["images"] >= 1 and row["next_new_images"] == 1  # the recorded crop comes back as an image
        assert 0 < row["next_tokens"] < row["first_tokens"] and row["vision_ms"] > 0 and row["first_ms"] > 0
    # on CPU every arm is SDPA's math over the same inputs: the same numbers
    arms = result["attention_one_layer"]
    assert set(arms) == {f"{shape}/{arm}" for shape in ("first", "next") for arm in ("repeat_kv_bool_mask", "gqa_bool_mask", "gqa_lower_right")}
    assert all(a["max_abs_diff"] < 1e-5 for a in arms.values())
    assert len(result["profile_one_first_and_next"]["by_host_time"]) == 3


def test_decode_probe_times_every_part_and_its_attention_arms_agree(tiny_model_dir, tmp_path):
    sys.path.insert(0, str(BENCH))
    from decode_probe import format_table, main

    out = tmp_path / "decode.json"
    result = main([
        "--model", str(tiny_model_dir), "--slots", "4", "--history", "200", "--span-bucket", "128", "--max-context", "512",
        "--repeats", "2", "--warmup", "1", "--profile", "1", "--profile-rows", "3", "--device", "cpu", "--json", str(out),
    ])
    assert json.loads(out.read_text()) == result
    assert result["machine"]["device"] == "cpu" and result["setup"]["cuda_graphs"] is False
    assert (result["setup"]["attended"], result["setup"]["span"]) == (201, 256)  # 200 held + the step's token, to a bucket
    parts = result["parts"]
    assert set(parts) == {"step", "decode", "pick/temperature1", "pick/greedy", "pick/greedy_held_stops",
                          "loop_step/temperature1", "loop_step/greedy_held_stops"}
    assert all(p["ms"] > 0 and p["min_ms"] > 0 and p["gpu_ms"] is None and p["repeats"] == 2 for p in parts.values())
    # every slot holds the same 200 tokens: the masked call over the span equals no mask over exactly 201 keys
    attention = result["attention_one_layer"]
    assert set(attention) == {"masked", "unmasked"}  # no flash arm on a CPU, and the result says why
    flash = result["setup"]["flash_arms"]
    assert (flash["absent"], flash["arms"]) == ("not on CPU", [])
    assert "_flash_attention_forward" in flash["aten_attention_ops"]
    assert result["setup"]["split_kv_arms"] == {"absent": "not on CPU"}  # nor the masked step beside it
    assert result["setup"]["decode_attention"] == "masked_sdpa" and "split_kv arms" in format_table(result)
    assert "flash arms" in format_table(result) and not any("flash" in k for k in result["derived"])
    assert all(a["ms"] > 0 and a["back_to_back"] for a in attention.values())
    assert attention["unmasked"]["max_abs_diff"] < 1e-5
    floor = result["floor"]
    assert floor["kv_bytes"] == 4 * 201 * floor["kv_bytes_per_token"] < floor["kv_bytes_span"] == 4 * 256 * floor["kv_bytes_per_token"]
    assert 0 < floor["weight_bytes"] <= floor["model_weight_bytes"] and floor["floor_ms"] <= floor["floor_span_ms"]
    assert set(result["derived"]) >= {"decode_minus_step_ms", "loop_minus_decode_ms", "step_over_floor"}
    profile = result["profile_eager_loop_steps"]
    assert profile["steps"] == 1 and len(profile["by_host_time"]) == 3


def _flash_by_math(q, k, v, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale=None,
                   seqused_k=None, **rest):
    """``aten._flash_attention_forward``'s variable-length forward as FlashAttention's API states it, by SDPA's math on a
    CPU: sequence ``b``'s queries are rows ``cum_seq_q[b]:cum_seq_q[b + 1]`` (at most ``max_q``), its keys the first
    ``seqused_k[b]`` rows from ``cum_seq_k[b]`` (at most ``max_k``, within the sequence's rows); query head ``h`` reads KV
    head ``h // groups`` (SDPA's ``enable_gqa``). It checks the kernel's argument types, and that the call keeps to the
    arguments torch 2.11's op takes too (``rest`` empty)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    assert not rest, rest
    assert cum_seq_q.dtype == cum_seq_k.dtype == seqused_k.dtype == torch.int32 and seqused_k.is_contiguous()
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    assert (dropout_p, is_causal, return_debug_mask) == (0.0, False, False)
    outs = []
    for b in range(len(cum_seq_q) - 1):
        rows = q[int(cum_seq_q[b]) : int(cum_seq_q[b + 1])]
        start, used = int(cum_seq_k[b]), int(seqused_k[b])
        assert len(rows) <= max_q and used <= min(max_k, int(cum_seq_k[b + 1]) - start)
        keys, values = (t[start : start + used].transpose(0, 1)[None] for t in (k, v))
        with sdpa_kernel([SDPBackend.MATH]):
            out = F.scaled_dot_product_attention(rows.transpose(0, 1)[None], keys, values, scale=scale, enable_gqa=True)
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs), None, None, None, None


def _efficient_by_math(q, k, v, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, custom_mask_type,
                       compute_log_sumexp=False, *, scale=None, seqlen_k=None, **rest):
    """``aten._efficient_attention_forward`` in its variable-length mode (one packed batch, BMHK, ``seqlen_k`` each
    sequence's keys from ``cu_seqlens_k``): as :func:`_flash_by_math`, with as many query heads as KV heads."""
    assert not rest and bias is None and (custom_mask_type, compute_log_sumexp) == (0, False)
    assert q.shape[0] == k.shape[0] == v.shape[0] == 1 and q.shape[2] == k.shape[2] == v.shape[2]
    out, *_ = _flash_by_math(q[0], k[0], v[0], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, False,
                             False, scale=scale, seqused_k=seqlen_k)
    return out[None], None, None, None, max_seqlen_q, max_seqlen_k


def _repeat_kv_attention(q, keys, values, lengths, scale):
    """Transformers' GQA, slot by slot in fp32: ``q`` ``(slots, heads, d)``, the caches ``(slots, kv_heads, max_len, d)``
    repeated by the model's own ``repeat_kv`` (query head ``j`` reads KV head ``j // groups``), each slot's first
    ``lengths[s]`` keys."""
    import torch
    from transformers.models.qwen3_vl.modeling_qwen3_vl import repeat_kv

    groups = q.shape[1] // keys.shape[1]
    outs = []
    for s, n in enumerate(lengths.tolist()):
        k, v = (repeat_kv(t[s : s + 1, :, :n], groups)[0] for t in (keys, values))  # (heads, n, d)
        weights = (torch.einsum("hd,hnd->hn", q[s], k) * scale).softmax(-1)
        outs.append(torch.einsum("hn,hnd->hd", weights, v))
    return torch.stack(outs)


def test_decode_probe_flash_arms_fold_the_gqa_heads_as_transformers_and_the_masked_call_do():
    """The flash arms' arguments and head order, on a CPU in fp32 with the private ops replaced by SDPA's math
    (:func:`_flash_by_math`, :func:`_efficient_by_math`): slots of different lengths over caches of noise (a key read
    past a slot's length, or another slot's, shows), 4 query heads a KV head. Each arm equals the decoder's masked call
    and transformers' ``repeat_kv`` attention; a fold that paired the heads otherwise, or a length not passed, is far
    off, so the comparison tells."""
    import itertools

    import torch

    sys.path.insert(0, str(BENCH))
    from decode_probe import flash_decode_calls, fold_gqa, masked_attention, unfold_gqa

    g = torch.Generator().manual_seed(0)
    S, kv, groups, d, max_len, span = 4, 2, 4, 16, 64, 48
    q = torch.randn(S, kv, groups, d, generator=g)  # as the masked call takes it: query head h * groups + gr at [:, h, gr]
    keys, values = (torch.randn(S, kv, max_len, d, generator=g) * 3 for _ in range(2))
    lengths = torch.tensor([5, 48, 1, 30])
    scale = d**-0.5
    heads = q.reshape(S, kv * groups, d)

    folded = fold_gqa(heads, kv)  # index by index: row s * groups + gr, head h = slot s's query head h * groups + gr
    assert folded.shape == (S * groups, kv, d)
    for s, gr, h in itertools.product(range(S), range(groups), range(kv)):
        assert torch.equal(folded[s * groups + gr, h], heads[s, h * groups + gr])
    assert torch.equal(unfold_gqa(folded, S), heads)

    visible = (torch.arange(span)[None] < lengths[:, None])[:, None, None]
    masked = masked_attention(q, keys, values, visible, span, scale).reshape(S, kv * groups, d)
    reference = _repeat_kv_attention(heads, keys, values, lengths, scale)
    exact = {"atol": 1e-6, "rtol": 1e-5}
    torch.testing.assert_close(masked, reference, **exact)
    calls = flash_decode_calls(q, keys, values, lengths, span, scale, flash=_flash_by_math, efficient=_efficient_by_math)
    assert set(calls) == {"flash_varlen", "flash_varlen_folded", "efficient_varlen_folded"}  # not dense: lengths differ
    for name in ("flash_varlen", "flash_varlen_folded", "efficient_varlen_folded"):
        out = calls[name]()
        assert out.shape == (S, kv * groups, d), name
        torch.testing.assert_close(out, masked, **exact, msg=name)

    # what the comparison would catch: query head j on KV head j % kv_heads (tiling, not repeat_interleave), every slot's
    # keys read to the span, the folded rows taken in order without unfolding
    def attend(kv_of, counts):  # query head j of slot s over KV head kv_of(j)'s first counts[s] keys, fp32
        out = torch.empty(S, kv * groups, d)
        for s, j in itertools.product(range(S), range(kv * groups)):
            k, v = keys[s, kv_of(j), : int(counts[s])], values[s, kv_of(j), : int(counts[s])]
            out[s, j] = (k @ heads[s, j] * scale).softmax(0) @ v
        return out

    torch.testing.assert_close(attend(lambda j: j // groups, lengths), masked, **exact)
    for wrong in (attend(lambda j: j % kv, lengths), attend(lambda j: j // groups, [span] * S)):
        assert (wrong - masked).abs().max() > 0.1
    assert not torch.equal(folded.reshape(S, kv * groups, d), heads)

    # the dense arm: every slot at one length, SDPA's GQA over exactly those keys
    same = torch.full((S,), 30)
    dense = flash_decode_calls(q, keys, values, same, span, scale, dense_length=30)["sdpa_flash_dense"]()
    equal = masked_attention(q, keys, values, (torch.arange(span)[None] < same[:, None])[:, None, None], span, scale)
    torch.testing.assert_close(dense, equal.reshape(S, kv * groups, d), **exact)


def test_decode_probe_flash_calls_bind_to_torchs_private_ops():
    """``aten._flash_attention_forward`` and ``aten._efficient_attention_forward`` are private: the arms' calls bind to
    this torch's ops, run on meta tensors in bf16 (the ops' fakes are torch's), with the positional arguments naming
    what the probe means by them and no keyword torch 2.11's schemas lack; where flash cannot run, the probe says why."""
    import torch

    sys.path.insert(0, str(BENCH))
    from decode_probe import flash_absent, flash_decode_calls, flash_ops_here

    flash, efficient = torch.ops.aten._flash_attention_forward, torch.ops.aten._efficient_attention_forward
    names = [a.name for a in flash.default._schema.arguments]
    assert names[:10] == ["query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal",
                          "return_debug_mask"] and {"scale", "seqused_k"} <= set(names)
    names = [a.name for a in efficient.default._schema.arguments]
    assert names[:11] == ["query", "key", "value", "bias", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                          "dropout_p", "custom_mask_type", "compute_log_sumexp"] and {"scale", "seqlen_k"} <= set(names)
    calls_seen = []

    def recording(op):
        def call(*args, **kwargs):
            calls_seen.append((op, len(args), set(kwargs)))
            return op(*args, **kwargs)
        return call

    S, kv, groups, d, max_len, span = 3, 2, 4, 32, 256, 64
    meta = {"device": "meta", "dtype": torch.bfloat16}
    q = torch.empty(S, kv, groups, d, **meta)
    keys, values = torch.empty(S, kv, max_len, d, **meta), torch.empty(S, kv, max_len, d, **meta)
    lengths = torch.empty(S, dtype=torch.long, device="meta")
    with torch.inference_mode():
        calls = flash_decode_calls(q, keys, values, lengths, span, 0.1, flash=recording(flash), efficient=recording(efficient))
        assert set(calls) == {"flash_varlen", "flash_varlen_folded", "efficient_varlen_folded"}
        for name in calls:
            out = calls[name]()
            assert (out.shape, out.dtype) == ((S, kv * groups, d), torch.bfloat16), name
    assert calls_seen == [(flash, 10, {"scale", "seqused_k"}), (flash, 10, {"scale", "seqused_k"}),
                          (efficient, 11, {"scale", "seqlen_k"})]
    for device, dtype, head_dim, why in (("cpu", torch.bfloat16, 128, "not on CPU"), ("cuda", torch.float32, 128, "float32"),
                                         ("cuda", torch.bfloat16, 4, "head_dim 4"), ("cuda", torch.float16, 264, "head_dim 264")):
        assert flash_absent(device, dtype, head_dim).startswith(why)
    here = flash_ops_here()
    assert {"_flash_attention_forward", "_efficient_attention_forward"} <= set(here["aten_attention_ops"])
    assert "seqused_k" in here["flash_forward_takes"] and isinstance(here["flash_kvcache"], str)
    assert "seqused_k" in here["ops_taking_key_lengths"]["_flash_attention_forward"]
    assert "seqlen_k" in here["ops_taking_key_lengths"]["_efficient_attention_forward"]
