"""Closed-loop rollout throughput: the slot decoder of ``eogym-sft rollout`` against two plain transformers
``generate`` loops, side by side in one run, on the same episodes (arms and figures: bench/README.md).

Episodes: rows of the sample of ``bench/common.py`` (or of ``--data``) whose question prompt has
``--min-prompt-tokens`` to ``--max-prompt-tokens`` tokens. Each turn generates exactly ``--new-tokens`` tokens, then
the row's own recorded tool results for that step come back, up to ``--turns`` turns or the row's last step. Figures
are over each arm's wall time (loading, data and a short warm-up excluded).

    python bench/rollout_throughput.py --model /tmp/qwen3vl4b-random --json rollout.json
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_run_args, command, machine_info, machine_line, peak_gib, run_data, runs_table, scratch_dir, sync, write_result  # noqa: E402

from eogym_sft.agent.episodes import Episode, canonical_prompt, question_messages  # noqa: E402

SPECIAL_TEXT_RE = re.compile(r"<\|[^|>]*\|>|</?tool_call>|</?tool_response>|</?think>")


class ReplayEpisode(Episode):
    """An episode whose tool results are the row's recorded ones, step by step, whatever the model wrote."""

    replies: list = []
    max_turns_here: int = 1

    def take_turn(self, text: str, truncated: bool, max_turns: int) -> bool:
        self.turns += 1
        # Random text may spell template markers; they would end the turn early when re-rendered.
        self.row["messages"].append({"role": "assistant", "content": SPECIAL_TEXT_RE.sub(" ", text)})
        if self.turns >= self.max_turns_here:
            return self.stop_with("max_turns")
        self.row["messages"].extend(self.replies[self.turns - 1])
        self.calls += 1
        return True


def recorded_replies(row: dict) -> list[list[dict]]:
    """The raw messages after each assistant turn of ``row`` but the last: one tool step each."""
    out, current = [], None
    for message in row["messages"]:
        if message.get("role") == "assistant":
            if current is not None:
                out.append(current)
            current = []
        elif current is not None:
            current.append(message)
    return out


def select_rows(rows: list[dict], processor, data_root: Path, lo: int, hi: int) -> list[tuple[dict, int]]:
    """Rows whose question prompt has ``lo``..``hi`` tokens (image tokens from headers, as prep counts)."""
    from eogym_sft.data.encoding import render
    from eogym_sft.data.images import image_size, resolve_image_path
    from eogym_sft.data.prepare import resized_hw
    from eogym_sft.models.layout import image_factor, image_token_count

    ip, factor = processor.image_processor, image_factor(processor)
    out = []
    for row in rows:
        trace = canonical_prompt({**row, "messages": question_messages(row)})
        text = render(processor, trace.messages, trace.tools, add_generation_prompt=True)
        n = len(processor.tokenizer(text, add_special_tokens=False)["input_ids"]) - len(trace.images)
        for rel in trace.images:
            w, h = image_size(resolve_image_path(rel, data_root))
            n += image_token_count(resized_hw(w, h, factor, ip.size["shortest_edge"], ip.size["longest_edge"]), factor)
        if lo <= n <= hi:
            out.append((row, n))
    return out


def make_episodes(selected, turns: int, arm: str) -> list[ReplayEpisode]:
    episodes = []
    for k, (row, _) in enumerate(selected):
        start = {key: v for key, v in row.items() if key != "messages"} | {"messages": [dict(m) for m in question_messages(row)]}
        ep = ReplayEpisode(f"bench:{k}", str(row["id"]), arm, 0, start, env=None)
        ep.replies = recorded_replies(row)
        ep.max_turns_here = min(turns, len(ep.replies) + 1)
        episodes.append(ep)
    return episodes


def _pictures(processor, ep, data_root, cache: dict):
    from eogym_sft.data.images import load_rgb, resolve_image_path

    trace = canonical_prompt(ep.row)
    text = processor.apply_chat_template(trace.messages, tools=trace.tools or None, tokenize=False, add_generation_prompt=True)
    for rel in trace.images:  # decoded once per episode, as any loop would keep them
        if rel not in cache:
            cache[rel] = load_rgb(resolve_image_path(rel, data_root))
    return text, [cache[rel] for rel in trace.images]


def run_generate(model, processor, episodes, data_root, new_tokens: int, batch: int) -> dict:
    """The plain arms: ``generate`` over ``batch`` episodes at a time, turn by turn, each turn re-encoded."""
    import torch
    from transformers import GenerationConfig

    from eogym_sft.metrics.scoring import END_MARKERS

    tok = processor.tokenizer
    stops = [tok.convert_tokens_to_ids(m) for m in END_MARKERS]
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=stops,
                              pad_token_id=tok.pad_token_id, use_cache=True)
    generated, decoded = 0, {}
    for start in range(0, len(episodes), batch):
        live = list(episodes[start : start + batch])
        while live:
            texts, pictures = [], []
            for ep in live:
                text, pics = _pictures(processor, ep, data_root, decoded.setdefault(id(ep), {}))
                texts.append(text)
                pictures += pics
            inputs = processor(text=texts, images=pictures or None, padding=True, padding_side="left", return_tensors="pt").to(model.device)
            if "pixel_values" in inputs:
                inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
            with torch.inference_mode():
                out = model.generate(**inputs, generation_config=config)
            new = out[:, inputs["input_ids"].shape[1] :].tolist()
            going = []
            for ep, ids in zip(live, new):
                generated += len(ids)
                ep.new_tokens += len(ids)
                if ep.take_turn(tok.decode(ids, skip_special_tokens=False), False, 10**9):
                    going.append(ep)
            live = going
    return {"new_tokens": generated}


def run_slots(decoder, processor, episodes, data_root, new_tokens: int) -> dict:
    from eogym_sft.agent.episodes import LoopConfig, run_episodes
    from eogym_sft.agent.sampling import Sampling

    for slot in range(decoder.slots):
        decoder.release(slot)
    stats = run_episodes(decoder, processor, iter(episodes), Sampling(min_new_tokens=new_tokens), LoopConfig(10**9, new_tokens),
                         data_root, lambda ep: None)
    errors = [ep.error for ep in episodes if ep.stop == "error"]
    if errors:
        raise RuntimeError(f"{len(errors)} episodes failed, first: {errors[0]}")
    phases = {name: round(stats[name], 2) for name in ("prefill_s", "decode_s", "tool_s", "other_s")}
    return {"new_tokens": stats["new_tokens"], "decode_steps": stats["decode_steps"], "prefill_tokens": stats["prefill_tokens"],
            "kv_cache_gib": round(decoder.memory_bytes() / 2**30, 2), "decode_attention": decoder.attention,
            "merged_weights_gib": round(decoder.merged_bytes() / 2**30, 2), **phases}


def run_arm(runs: list, name: str, fn, episodes, device) -> None:
    """Time one arm; a failure (out of memory, a compile error) is recorded by name and the other arms go on."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    try:
        sync(device)
        start = time.perf_counter()
        extra = fn(episodes)
        sync(device)
    except Exception as err:
        runs.append({"arm": name, "error": f"{type(err).__name__}: {err}"})
        print(f"{name} failed: {runs[-1]['error']}", flush=True)
        return
    wall = time.perf_counter() - start
    runs.append({
        "arm": name, "episodes": len(episodes), "turns": sum(ep.turns for ep in episodes), "wall_s": round(wall, 2),
        "episodes_per_min": round(len(episodes) / wall * 60, 2), "new_tokens_per_s": round(extra["new_tokens"] / wall, 1),
        "peak_gpu_mem_gib": peak_gib(device), **extra,
    })
    print(json.dumps(runs[-1]), flush=True)


def slot_runs(runs: list, mode, args, model, slot_arms, processor, selected, data_root, device) -> None:
    """The slot arm of ``mode`` (``cuda-graphs``: its graphs captured as the run first needs them, timed), once an
    arm of ``slot_arms`` (the base only when none), on one decoder reset between them as ``rollout`` does."""
    import torch

    from eogym_sft.agent.decoder import SlotDecoder
    from eogym_sft.models.loading import use_arm

    name = f"slots{args.concurrency}" + (f"-{mode}" if mode else "")
    # The previous arm's decoder (its whole KV cache) sits in a reference cycle (its step is a bound method).
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    try:
        decoder = SlotDecoder(model, args.concurrency, args.max_context, cuda_graphs=mode == "cuda-graphs")
    except Exception as err:  # a cache that does not fit must not lose the arms already timed
        runs.append({"arm": name, "error": f"{type(err).__name__}: {err}"})
        return
    for arm in slot_arms or [None]:
        arm_name = f"{name}-{arm.name}" if arm else name
        with use_arm(model, arm) if arm else nullcontext():
            run_arm(runs, arm_name, lambda e: run_slots(decoder, processor, e, data_root, args.new_tokens),
                    make_episodes(selected, args.turns, arm_name), device)
        decoder.reset()  # the next arm's adapter makes the caches and graphs stale


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model folder (e.g. written by eogym-sft tiny-model)")
    parser.add_argument("--episodes", type=int, default=64, help="episodes of the batched and slot arms")
    parser.add_argument("--serial-episodes", type=int, default=4, help="episodes of the one-at-a-time arm (0: skip it)")
    parser.add_argument("--concurrency", type=int, default=32, help="episodes at once: generate's batch, the decoder's slots")
    parser.add_argument("--turns", type=int, default=4, help="assistant turns per episode at most")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per turn, exactly")
    parser.add_argument("--min-prompt-tokens", type=int, default=5000)
    parser.add_argument("--max-prompt-tokens", type=int, default=8192)
    parser.add_argument("--max-context", type=int, default=14336, help="tokens per slot")
    parser.add_argument("--cuda-graphs", action="store_true", help="also time the slot arm with its decode step replayed from CUDA graphs")
    parser.add_argument("--rows", type=int, default=400, help="rows generated to select episodes from")
    add_run_args(parser, "rollout_throughput", "EO-Gym JSONL with recorded tool steps to use instead of the generated sample")
    parser.add_argument("--adapter", default=None, help="LoRA adapter folder: each slot arm runs the base, then this adapter")
    parser.add_argument("--arms", default="serial,batched,slots", help="comma-separated subset of serial,batched,slots")
    args = parser.parse_args(argv)

    from eogym_sft.models.loading import load_inference_model, parse_arms, resolve_device
    from eogym_sft.models.processor import load_processor

    with scratch_dir(args.workdir, "eogym_rollout_bench_") as workdir:
        jsonl, data_root = run_data(args, workdir)
        device, dtype = resolve_device(args.device, args.dtype)
        processor = load_processor(args.model)
        rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
        selected = select_rows(rows, processor, data_root, args.min_prompt_tokens, args.max_prompt_tokens)
        if len(selected) < args.episodes:
            raise SystemExit(f"only {len(selected)} of {len(rows)} rows have {args.min_prompt_tokens}-{args.max_prompt_tokens} prompt tokens: raise --rows")
        selected = selected[: args.episodes]
        t0 = time.perf_counter()
        slot_arms = parse_arms([f"adapter={args.adapter}"], args.model) if args.adapter else []
        model = load_inference_model(args.model, slot_arms, device, dtype)
        print(f"model loaded in {time.perf_counter() - t0:.1f}s, {dtype} on {device}; {len(selected)} episodes, "
              f"prompts {min(n for _, n in selected)}-{max(n for _, n in selected)} tokens", flush=True)
        arms = args.arms.split(",")
        # warm-up: CUDA context, kernels, one compile of the generate path
        run_generate(model, processor, make_episodes(selected[:1], 1, "warmup"), data_root, 2, 1)
        runs = []
        if "serial" in arms and args.serial_episodes:
            eps = make_episodes(selected[: args.serial_episodes], args.turns, "serial")
            run_arm(runs, "serial", lambda e: run_generate(model, processor, e, data_root, args.new_tokens, 1), eps, device)
        if "batched" in arms:
            eps = make_episodes(selected, args.turns, "batched")
            batch = args.concurrency
            run_arm(runs, f"batched{batch}", lambda e: run_generate(model, processor, e, data_root, args.new_tokens, batch), eps, device)
        for mode in ([None] if "slots" in arms else []) + (["cuda-graphs"] if args.cuda_graphs else []):
            slot_runs(runs, mode, args, model, slot_arms, processor, selected, data_root, device)
        base = next((r for r in runs if r["arm"].startswith("batched") and "error" not in r), None)
        for r in runs:
            if "error" in r:
                continue
            r["speedup_vs_batched"] = round(r["episodes_per_min"] / base["episodes_per_min"], 2) if base else None
        result = {
            "bench": "rollout_throughput", "command": command("rollout_throughput", argv), "model": args.model,
            "dtype": str(dtype).replace("torch.", ""), "episodes": len(selected),
            "mean_prompt_tokens": round(sum(n for _, n in selected) / len(selected), 1), "turns_max": args.turns,
            "new_tokens_per_turn": args.new_tokens, "concurrency": args.concurrency, "machine": machine_info(device), "runs": runs,
        }
        return write_result(result, args.json, format_table(result))


def format_table(result: dict) -> str:
    subtitle = (f"{result['episodes']} episodes, mean prompt {result['mean_prompt_tokens']} tokens, <= {result['turns_max']} turns of "
                f"{result['new_tokens_per_turn']} new tokens")
    speedup = lambda r: None if r["speedup_vs_batched"] is None else f"{r['speedup_vs_batched']}x"  # noqa: E731
    columns = [("arm", 22, "arm"), ("episodes", 8, "episodes"), ("turns", 6, "turns"), ("eps/min", 8, "episodes_per_min"),
               ("gen tok/s", 10, "new_tokens_per_s"), ("wall s", 8, "wall_s"), ("peak GiB", 9, "peak_gpu_mem_gib"), ("speedup", 8, speedup)]
    return runs_table(result["runs"], columns, machine_line(result), subtitle)


if __name__ == "__main__":
    main()
