"""Where a slot-decoder prefill's time goes: the host's work, the vision tower, the text tower, and attention alone.

The rollout bench's prefills cost about 8x their FLOP floor (docs/benchmarks.md, "Closed loop and GRPO").
This probe takes the same episodes (rows of the generated sample with 5,000-8,192 prompt tokens, and their
recorded second turn: a tool result, often a crop), and times, each synchronised on the GPU:

* ``prompt``: the prompt rendered and tokenised (``Episode.prompt``; images already decoded);
* ``layout``: image starts and the 3-D rotary positions (host);
* ``pixels``: the images' pixels concatenated and copied to the GPU; ``vision``: that, the vision tower and merger (``SlotDecoder._embed_chunk``);
* ``first``: a whole first-turn prefill into an empty slot, and ``next``: the second turn's prefill over it
  (only the new tokens, attending to the history through a boolean mask);
* attention alone, one layer at both shapes: the GQA heads copied by ``repeat_interleave`` with a boolean mask
  past a first turn (the decoder until 2026-12-02), SDPA's ``enable_gqa`` with that mask, SDPA with
  ``causal_lower_right`` and ``enable_gqa`` (the decoder now), and flash's kernel called directly.

Then a torch profiler table of one first and one next prefill: the top ops by GPU time and by host time.

    eogym-sft tiny-model --config recipes/configs/qwen3_vl_4b_instruct.json --dtype bfloat16 --device cuda --output /tmp/m4b
    python bench/prefill_probe.py --model /tmp/m4b --episodes 8 --json prefill_probe.json

CPU smoke run: ``--model /tmp/tiny --min-prompt-tokens 0`` (attention variants other than the decoder's skip).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eval_throughput import add_run_args, machine_info, run_data  # noqa: E402 (the bench folder)
from prep_throughput import scratch_dir, write_result  # noqa: E402
from rollout_throughput import make_episodes, select_rows  # noqa: E402


def timed(fn, device, reps: int = 1):
    """``(result, seconds)`` of ``fn()``, the mean of ``reps`` runs, synchronised before and after."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        out = fn()
    sync(device)
    return out, (time.perf_counter() - start) / reps


def attention_arms(device):
    """name -> fn(q, k, v, start, scale): causal attention of a chunk at ``start`` over the slot's history."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    def bool_mask(n, end, start, device):
        return torch.ones(n, end, dtype=torch.bool, device=device).tril(diagonal=start) if start else None

    def repeat_kv_bool_mask(q, k, v, start, scale):  # the decoder's until 2026-12-02
        mask, groups = bool_mask(q.shape[2], k.shape[2], start, q.device), q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)

    def gqa_bool_mask(q, k, v, start, scale):
        mask = bool_mask(q.shape[2], k.shape[2], start, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)

    def gqa_lower_right(q, k, v, start, scale):  # the decoder's: SDPA picks the kernel for the bias
        bias = causal_lower_right(q.shape[2], k.shape[2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=True)

    def flash_lower_right(q, k, v, start, scale):  # flash called directly: its is_causal is bottom-right
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal=True, scale=scale)[0]

    arms = {"repeat_kv_bool_mask": repeat_kv_bool_mask, "gqa_bool_mask": gqa_bool_mask, "gqa_lower_right": gqa_lower_right}
    if device.type == "cuda":
        arms["flash_lower_right"] = flash_lower_right
    return arms


def probe_attention(text_config, first: int, history: int, chunk: int, device, dtype, reps: int) -> dict:
    """Each arm at the first turn's shape (``first`` tokens from 0) and a next turn's (``chunk`` after
    ``history``), one layer's heads; seconds per call and the largest difference from the decoder's output."""
    import torch

    heads, kv, d = text_config.num_attention_heads, text_config.num_key_value_heads, text_config.head_dim
    g = torch.Generator(device=device).manual_seed(0)
    out = {}
    for shape, (n, start) in {"first": (first, 0), "next": (chunk, history)}.items():
        q = torch.randn(1, heads, n, d, device=device, dtype=dtype, generator=g)
        k = torch.randn(1, kv, start + n, d, device=device, dtype=dtype, generator=g)
        v = torch.randn(1, kv, start + n, d, device=device, dtype=dtype, generator=g)
        scale = d**-0.5
        ref = None
        for name, fn in attention_arms(device).items():
            try:
                fn(q, k, v, start, scale)  # warm-up
                res, seconds = timed(lambda fn=fn: fn(q, k, v, start, scale), device, reps)
            except Exception as err:  # an arm the kernel refuses is named, the rest go on
                out[f"{shape}/{name}"] = {"error": f"{type(err).__name__}: {err}"}
                continue
            ref = res if ref is None else ref
            out[f"{shape}/{name}"] = {"ms": round(seconds * 1e3, 3), "max_abs_diff": float((res.float() - ref.float()).abs().max())}
    return out


def second_prompt(ep, processor, data_root, pictures, tokens: int):
    """The episode's second prompt: ``tokens`` of plain text written, then its recorded tool result."""
    ep.take_turn(" ".join(["word"] * tokens), False, 10**9)
    return ep.prompt(processor, data_root, pictures=pictures)


def profile_table(decoder, slot: int, ids, images, ids2, images2, device, rows: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for s in range(decoder.slots):  # nothing to copy from: the first prefill computes every token
        decoder.release(s)
    with profile(activities=activities) as prof:
        decoder.prefill(slot, ids, images)
        decoder.prefill(slot, ids2, images2)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    averages = prof.key_averages()
    gpu_key = "self_device_time_total"

    def top(key):
        ranked = sorted(averages, key=lambda e: getattr(e, key, 0), reverse=True)[:rows]
        return [{"op": e.key, "calls": e.count, "self_ms": round(getattr(e, key, 0) / 1e3, 3)} for e in ranked]

    return {
        "gpu_busy_ms": round(sum(getattr(e, gpu_key, 0) for e in averages) / 1e3, 2),
        "by_gpu_time": top(gpu_key) if device.type == "cuda" else [],
        "by_host_time": top("self_cpu_time_total"),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model folder (e.g. written by eogym-sft tiny-model)")
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--written-tokens", type=int, default=128, help="text the first turn writes before its tool result")
    parser.add_argument("--min-prompt-tokens", type=int, default=5000)
    parser.add_argument("--max-prompt-tokens", type=int, default=8192)
    parser.add_argument("--max-context", type=int, default=14336, help="tokens per slot")
    parser.add_argument("--rows", type=int, default=400, help="rows generated to select episodes from")
    parser.add_argument("--reps", type=int, default=10, help="repetitions of each attention arm")
    parser.add_argument("--profile-rows", type=int, default=25)
    add_run_args(parser, "prefill_probe", "EO-Gym JSONL with recorded tool steps to use instead of the generated sample")
    args = parser.parse_args(argv)

    import torch

    from eogym_sft.agent.episodes import picture_cache
    from eogym_sft.agent.decoder import SlotDecoder
    from eogym_sft.agent.image_inputs import image_starts
    from eogym_sft.models.layout import mrope_position_ids
    from eogym_sft.models.loading import load_inference_model, resolve_device
    from eogym_sft.models.processor import load_processor

    with scratch_dir(args.workdir, "eogym_prefill_probe_") as workdir:
        jsonl, data_root = run_data(args, workdir)
        device, dtype = resolve_device(args.device, args.dtype)
        processor = load_processor(args.model)
        rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
        selected = select_rows(rows, processor, data_root, args.min_prompt_tokens, args.max_prompt_tokens)[: args.episodes]
        if len(selected) < args.episodes:
            raise SystemExit(f"only {len(selected)} rows have {args.min_prompt_tokens}-{args.max_prompt_tokens} prompt tokens: raise --rows")
        model = load_inference_model(args.model, [], device, dtype)
        decoder = SlotDecoder(model, 2, args.max_context)
        pad = model.config.image_token_id
        pictures = picture_cache(processor)
        per_episode = []
        for k, ep in enumerate(make_episodes(selected, 2, "probe")):
            ep.preload(pictures, data_root)
            (ids, images), prompt_s = timed(lambda ep=ep: ep.prompt(processor, data_root, pictures=pictures), device)

            def layout(ids=ids, images=images):
                image_starts(ids, images, pad)
                grids = torch.tensor([im.grid_thw for im in images], dtype=torch.long).reshape(-1, 3)
                return mrope_position_ids(torch.tensor(ids), grids, pad, decoder.merge)

            _, layout_s = timed(layout, device)
            _, pixels_s = timed(lambda images=images: torch.cat([im.pixel_values for im in images]).to(device, decoder.inner.visual.dtype), device)
            with torch.inference_mode():
                _, vision_s = timed(lambda ids=ids, images=images: decoder._embed_chunk(ids, images), device)
            decoder.release(0)
            _, first_s = timed(lambda ids=ids, images=images: decoder.prefill(0, ids, images), device)
            ep.preload(pictures, data_root)
            ids2, images2 = second_prompt(ep, processor, data_root, pictures, args.written_tokens)
            ep.preload(pictures, data_root)
            _, next_s = timed(lambda: decoder.prefill(0, ids2, images2), device)
            row = {"episode": k, "first_tokens": len(ids), "images": len(images), "image_tokens": sum(im.tokens for im in images),
                   "next_tokens": decoder.last_prefill_tokens, "next_new_images": len(images2) - len(images),
                   "prompt_ms": round(prompt_s * 1e3, 2), "layout_ms": round(layout_s * 1e3, 2), "pixels_ms": round(pixels_s * 1e3, 2), "vision_ms": round(vision_s * 1e3, 2),
                   "first_ms": round(first_s * 1e3, 2), "next_ms": round(next_s * 1e3, 2)}
            print(json.dumps(row), flush=True)
            per_episode.append((row, (ids, images, ids2, images2)))
        rows_out = [r for r, _ in per_episode[1:]] or [per_episode[0][0]]  # the first episode warms the kernels up
        means = {key: round(sum(r[key] for r in rows_out) / len(rows_out), 2) for key in rows_out[0] if key != "episode"}
        ids, images, ids2, images2 = per_episode[-1][1]
        text_cfg = model.config.get_text_config()
        attention = probe_attention(text_cfg, len(ids), len(ids2) - next_chunk(ids, ids2), next_chunk(ids, ids2), device, dtype, args.reps)
        for name, res in attention.items():
            print(name, res, flush=True)
        with torch.inference_mode():
            profiled = profile_table(decoder, 1, ids, images, ids2, images2, device, args.profile_rows)
        for key in ("by_gpu_time", "by_host_time"):
            print(key, *(f"  {r['self_ms']:9.3f} ms {r['calls']:6d}x {r['op'][:90]}" for r in profiled[key]), sep="\n", flush=True)
        result = {
            "bench": "prefill_probe",
            "command": " ".join(["python", "bench/prefill_probe.py", *(argv if argv is not None else sys.argv[1:])]),
            "model": args.model,
            "dtype": str(dtype).replace("torch.", ""),
            "machine": machine_info(device),
            "episodes": [r for r, _ in per_episode],
            "mean_after_the_first": means,
            "attention_one_layer": attention,
            "profile_one_first_and_next": profiled,
        }
        return write_result(result, args.json, json.dumps(means))


def next_chunk(ids: list[int], ids2: list[int]) -> int:
    """Tokens of the second prompt past the first: what its prefill computes."""
    return len(ids2) - len(ids) + 1


if __name__ == "__main__":
    main()
