"""Offline next-action evaluation of a base Qwen3-VL and LoRA adapters on EO-Gym test traces.

For every assistant turn of every trace the prompt is the reference history before that turn
(images included), rendered by the chat template with the generation prompt. Each arm (the base,
then each adapter) generates the next message for the same prompts; :mod:`eogym_sft.metrics.scoring` scores
the messages, and arms are compared pairwise on identical turns. ``docs/evaluation.md`` has the metrics.

:func:`evaluate` runs everything and writes ``results.jsonl``, ``skipped.jsonl``, ``summary.json`` and
``report.txt``; the steps (:func:`~.turn_prompts.read_traces`, :func:`~.turn_prompts.plan_turns`, :func:`load_model`,
:func:`generate_turns`, :func:`score_turns`) are public for benchmarks and notebooks; the summary and the
report are :func:`eogym_sft.evaluation.report.summarize_turns` and
:func:`eogym_sft.evaluation.report.format_turn_report`.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from copy import copy
from pathlib import Path

from ..data.prepare import DROP_SHARE, check_reason_share
from ..data.images import ImageCache, ImageError
from ..atomic import write_lines_atomic, write_text_atomic
from ..guards import check_output
from ..models.layout import expand_image_pads
from ..safe_json import record_line
from ..metrics.judge import judge_all, load_judge
from ..metrics.gold_history import combine_step_counts, step_counts
from ..metrics.scoring import END_MARKERS, combine_samples, parse_output, score_output
from ..models import loading
from ..models.loading import Arm, use_arm
from .report import format_turn_report, summarize_turns
from .run_args import EvalConfig, arm_inputs, recorded_settings
from .turn_prompts import TurnPrompt, plan_turns, problem, read_traces


# ---------------------------------------------------------------- model


def parse_arms(cfg: EvalConfig) -> list[Arm]:
    """The base arm (unless excluded) then one arm per ``--adapter DIR`` or ``--adapter NAME=DIR``."""
    return loading.parse_arms(cfg.adapters, cfg.model, cfg.include_base, cfg.allow_other_base)


def resolve_device(cfg: EvalConfig):
    """``(device, dtype)`` of ``cfg``: ``auto`` is CUDA in bf16 when there is a GPU, else CPU in fp32."""
    return loading.resolve_device(cfg.device, cfg.dtype)


def load_model(cfg: EvalConfig, arms: list[Arm]):
    """The base model, loaded once, with every adapter of ``arms`` attached by peft (switch with :func:`use_arm`)."""
    return loading.load_inference_model(cfg.model, arms, *resolve_device(cfg))


def generation_config(cfg: EvalConfig, tokenizer):
    """Greedy, or sampling with every setting explicit: ``generate`` fills unset (``None``) settings from
    the model's ``generation_config.json`` (Qwen3-VL-Instruct ships temperature 0.7, top_k 20, top_p 0.8)."""
    from transformers import GenerationConfig

    sampling = {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k} if cfg.temperature > 0 else {}
    return GenerationConfig(
        max_new_tokens=cfg.max_new_tokens,
        do_sample=bool(sampling),
        **sampling,
        repetition_penalty=1.0,
        num_return_sequences=cfg.samples,
        eos_token_id=[tokenizer.convert_tokens_to_ids(m) for m in END_MARKERS],
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
    )


def _generate_batch(model, processor, batch: list[TurnPrompt], pictures: list, gen_config, seed: int) -> list[dict]:
    import torch

    texts = [t.text for t in batch]
    inputs = processor(text=texts, images=pictures or None, padding=True, padding_side="left", return_tensors="pt")
    inputs = inputs.to(model.device)
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
    torch.manual_seed(seed)  # the same seed per batch in every arm: common random numbers for sampling
    with torch.inference_mode():
        out = model.generate(**inputs, generation_config=gen_config)
    new = out[:, inputs["input_ids"].shape[1] :].tolist()
    stops = set(gen_config.eos_token_id)
    k = gen_config.num_return_sequences
    results = []
    for i in range(len(batch)):
        gen = {"outputs": [], "finished": [], "new_tokens": []}
        for ids in new[i * k : (i + 1) * k]:
            end = next((j + 1 for j, tok in enumerate(ids) if tok in stops), None)
            kept = ids[:end] if end else ids
            gen["outputs"].append(processor.tokenizer.decode(kept, skip_special_tokens=False))
            gen["finished"].append(end is not None)
            gen["new_tokens"].append(len(kept))
        results.append(gen)
    return results


def generate_turns(
    model, processor, prompts: list[TurnPrompt], cfg: EvalConfig, images: ImageCache | None = None, bar=None
) -> list[dict]:
    """Generate for every prompt with the active arm, in batches of similar length (longest first, so a
    batch that does not fit in memory fails at once).

    Returns, in the order of ``prompts``, ``{"outputs", "finished", "new_tokens"}`` per prompt, or
    ``{"error": problem}`` for a prompt with an image that passed the header check but does not decode
    (the same prompts fail in every arm, so pairing is unaffected).
    """
    from ..agent.rollout_config import CPU_BATCH

    images = images or ImageCache()
    gen_config = generation_config(cfg, processor.tokenizer)
    order = sorted(range(len(prompts)), key=lambda i: -prompts[i].prompt_tokens)
    results: list = [None] * len(prompts)
    size = cfg.batch_size or CPU_BATCH  # run_arms sizes it to the GPU; called directly, the former default
    for b, start in enumerate(range(0, len(order), size)):
        ready, pictures = [], []
        for i in order[start : start + size]:
            p = prompts[i]
            try:
                pictures += [images.get(path) for path in p.images]
                ready.append(i)
            except ImageError as err:
                results[i] = {
                    "error": problem(
                        "turn", p.source, p.trace_id, p.turn, err.reason, f"image {err.path}", err.detail
                    )
                }
        if ready:
            gens = _generate_batch(model, processor, [prompts[i] for i in ready], pictures, gen_config, cfg.seed + b)
            for i, gen in zip(ready, gens):
                results[i] = gen
        if bar is not None:
            bar.update(len(order[start : start + size]))
    return results


def greedy(cfg: EvalConfig) -> bool:
    """Whether a run generates one greedy output per turn: the turns :func:`decode_turns` generates."""
    return cfg.temperature <= 0 and cfg.samples == 1


def turn_length(prompts: list[TurnPrompt], cfg: EvalConfig) -> int:
    """Tokens a slot holds: the longest prompt and its turn."""
    return max((p.prompt_tokens for p in prompts), default=1) + cfg.max_new_tokens + 2


def sized_batch(model, prompts: list[TurnPrompt], arms: list[Arm], cfg: EvalConfig) -> int:
    """Prompts decoded at once: ``batch_size`` if given (refused if it does not fit), else as many as the GPU holds."""
    from ..agent.rollout_config import CPU_BATCH, sized_slots

    adapters = any(arm.adapter for arm in arms)
    return sized_slots(model, len(prompts), turn_length(prompts, cfg), cfg.batch_size, adapters, "--batch-size",
                       CPU_BATCH)


def turn_decoder(model, prompts: list[TurnPrompt], cfg: EvalConfig):
    """A :class:`~eogym_sft.agent.decoder.SlotDecoder` for ``prompts``: ``batch_size`` slots, each
    long enough for the longest prompt and its turn; its decode step replayed from CUDA graphs on a GPU."""
    from ..agent.decoder import SlotDecoder
    from ..agent.rollout_config import CPU_BATCH

    device = next(model.parameters()).device
    slots = max(1, min(cfg.batch_size or CPU_BATCH, len(prompts)))
    return SlotDecoder(model, slots, turn_length(prompts, cfg), cuda_graphs=device.type == "cuda")


def decode_turns(decoder, processor, prompts: list[TurnPrompt], cfg: EvalConfig, bar=None) -> list[dict]:
    """Greedy outputs for every prompt with the active arm on ``decoder`` (the same tokens as :func:`generate_turns`
    gives; the test pins it): ``decoder.slots`` prompts at a time, a finished turn's slot refilled at once, and the
    next turn of the same trace reusing the slot's cached prefix. Returns what :func:`generate_turns` returns."""
    from ..agent.sampling import Sampling
    from ..agent.episodes import picture_cache

    decoder.check_weights()  # the decoder runs the weights of the arm active when it last looked: this one's
    tokenizer = processor.tokenizer
    stops = [tokenizer.convert_tokens_to_ids(m) for m in END_MARKERS]
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    pick, pictures = Sampling(), picture_cache(processor)
    pending = iter(sorted(range(len(prompts)), key=lambda i: (prompts[i].trace_id, prompts[i].turn)))
    results: list = [None] * len(prompts)
    current: list = [None] * decoder.slots  # the prompt each slot is generating for, None when idle
    cached: list = [None] * decoder.slots  # the trace whose prompt each slot's cache holds
    turn: dict[int, list[int]] = {}

    def begin(s: int) -> bool:
        """Start the next decodable prompt in slot ``s``; False when none is left."""
        for i in pending:
            p = prompts[i]
            try:
                images = [pictures.get(path) for path in p.images]
            except ImageError as err:
                results[i] = _image_problem(p, err)
                if bar is not None:
                    bar.update(1)
                continue
            if cached[s] != p.trace_id:
                decoder.release(s)  # another trace's cache is no prefix of this prompt, images included
            ids = expand_image_pads(tokenizer(p.text, add_special_tokens=False)["input_ids"],
                                    [im.tokens for im in images], pad)
            current[s], cached[s] = i, p.trace_id
            turn[s] = pick.pick(decoder.prefill(s, ids, images)[None], [0], stops)
            return True
        return False

    def settle(s: int) -> None:
        """Leave slot ``s`` mid-turn, or idle when no prompt is left."""
        while current[s] is not None or begin(s):
            tokens = turn[s]
            if tokens[-1] not in stops and len(tokens) < cfg.max_new_tokens:
                return
            text = tokenizer.decode(tokens, skip_special_tokens=False)
            results[current[s]] = {"outputs": [text], "finished": [tokens[-1] in stops], "new_tokens": [len(tokens)]}
            if bar is not None:
                bar.update(1)
            del turn[s]
            current[s] = None

    for s in range(decoder.slots):
        settle(s)
    while turn:
        order, logits = decoder.decode({s: tokens[-1] for s, tokens in turn.items()})
        for s, tok in zip(order, pick.pick(logits, [len(turn[s]) for s in order], stops)):
            turn[s].append(tok)
        for s in list(order):
            settle(s)
    return results


def _image_problem(p: TurnPrompt, err: ImageError) -> dict:
    """The result of a turn whose image cannot be read: its ``skipped.jsonl`` entry."""
    return {"error": problem("turn", p.source, p.trace_id, p.turn, err.reason, f"image {err.path}", err.detail)}


# ---------------------------------------------------------------- scoring and reports


def _judge_outputs(judge, prompt: TurnPrompt, parsed: list) -> list[tuple[bool | None, str | None]]:
    """The judge's ``(verdict, error)`` per output of a final turn; no request for an output without an answer."""
    if judge is None or not prompt.reference.scores_answer:
        return [(None, None)] * len(parsed)
    asks = [p for p in parsed if p.final_answer is not None]
    verdicts = iter(judge_all(judge, [(prompt.question, p.final_answer, prompt.reference.gt_answer) for p in asks],
                              workers=1))
    return [next(verdicts) if p.final_answer is not None else (False, None) for p in parsed]


def score_turns(
    arm: str, prompts: list[TurnPrompt], generations: list[dict], cfg: EvalConfig, judge=None
) -> list[dict]:
    """One ``results.jsonl`` record per turn: ids, prompt hash, raw outputs, parsed calls and scores."""
    records = []
    for prompt, gen in zip(prompts, generations):
        if "error" in gen:
            continue
        parsed = [parse_output(text) for text in gen["outputs"]]
        verdicts = _judge_outputs(judge, prompt, parsed)
        sample_scores = [
            score_output(p, prompt.reference, cfg.num_tolerance, truncated=not done, judged=v)
            for p, done, (v, _) in zip(parsed, gen["finished"], verdicts)
        ]
        record = {
            "arm": arm,
            "trace_id": prompt.trace_id,
            "turn": prompt.turn,
            "message_index": prompt.message_index,
            "source": prompt.source,
            "prompt_sha256": prompt.prompt_sha256,
            "prompt_tokens": prompt.prompt_tokens,
            "n_images": len(prompt.images),
            **{k: prompt.meta.get(k, "") for k in ("EO_task", "question_type", "data_source")},
            "reference": prompt.reference.to_json(),
            "gt_answer": prompt.reference.gt_answer if prompt.reference.scores_answer else None,
            **gen,
            "parsed": [p.to_json() for p in parsed],
            "sample_scores": sample_scores,
            "scores": combine_samples(sample_scores, cfg.samples),
            "steps": combine_step_counts([step_counts(p, prompt.reference) for p in parsed]),
        }
        if any(err for _, err in verdicts):
            record["judge_errors"] = [err for _, err in verdicts]
        records.append(record)
    return records


def _write_jsonl(path: Path, items: list[dict], mode: str = "w") -> None:
    if mode == "w":
        write_lines_atomic(path, (record_line(item) for item in items))
        return
    with open(path, mode, encoding="ascii") as fh:
        fh.write("".join(record_line(item) for item in items))


def run_arms(
    model,
    processor,
    prompts: list[TurnPrompt],
    arms: list[Arm],
    cfg: EvalConfig,
    judge=None,
    progress: bool = True,
    results_path: Path | None = None,
):
    """Generate and score every prompt in every arm: ``(records, timing per arm, undecodable turns)``.

    With ``results_path``, each arm's records are appended there as soon as the arm is done, so that a
    crash in a later arm keeps the earlier arms' results.
    """
    from tqdm.auto import tqdm

    cfg = copy(cfg)  # the caller's config stays as given; the run records the batch it chose
    cfg.batch_size = sized_batch(model, prompts, arms, cfg)
    records, timing, images, failed, decoder = [], {}, ImageCache(), {}, None
    bar = tqdm(total=len(prompts) * len(arms), unit="turn", desc="evaluate", disable=not progress)
    for arm in arms:
        bar.set_postfix_str(arm.name)
        start = time.perf_counter()
        with use_arm(model, arm):
            if greedy(cfg):
                decoder = decoder or turn_decoder(model, prompts, cfg)
                generations = decode_turns(decoder, processor, prompts, cfg, bar)
                decoder.reset()  # the next arm's weights make these caches and graphs stale
            else:
                generations = generate_turns(model, processor, prompts, cfg, images, bar)
        seconds = time.perf_counter() - start
        mine = score_turns(arm.name, prompts, generations, cfg, judge)
        new_tokens = sum(sum(r["new_tokens"]) for r in mine)
        timing[arm.name] = {
            "seconds": seconds,
            "turns_per_s": len(mine) / seconds,
            "new_tokens_per_s": new_tokens / seconds,
        }
        failed.update({(g["error"]["trace_id"], g["error"]["turn"]): g["error"] for g in generations if "error" in g})
        records += mine
        if results_path is not None:
            _write_jsonl(results_path, mine, mode="a")
    bar.close()
    return records, timing, list(failed.values())


def evaluate(cfg: EvalConfig, progress: bool = True) -> dict:
    """Run a whole evaluation and write its files to ``cfg.output``; return the summary."""
    from ..models.processor import load_processor

    out = Path(cfg.output)
    check_output(out, "eogym-sft evaluate", cfg.overwrite, "evaluation", inputs=arm_inputs(cfg.data, cfg.adapters))
    judge = load_judge(cfg.judge) if cfg.judge else None
    arms = parse_arms(cfg)
    processor = load_processor(cfg.model, cfg.max_pixels, cfg.min_pixels)
    traces, failures = read_traces(cfg)
    prompts, skipped = plan_turns(processor, traces, cfg)
    share = 1.0 if cfg.allow_drops else DROP_SHARE
    check_reason_share(failures, len(traces) + len(failures), share)
    check_reason_share(skipped, len(prompts) + len(skipped), share, "turns")
    model = load_model(cfg, arms)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.jsonl").write_text("")
    records, timing, undecodable = run_arms(
        model, processor, prompts, arms, cfg, judge, progress, out / "results.jsonl"
    )
    skipped += undecodable
    scored = {(r["trace_id"], r["turn"]) for r in records}
    counts = {
        "rows_in": len(traces) + len(failures),
        "rows_failed": len(failures),
        "rows_failed_by_reason": _count(failures),
        "turns_total": len(scored) + len(skipped),
        "turns_scored": len(scored),
        "turns_skipped": len(skipped),
        "turns_skipped_by_reason": _count(skipped),
        "traces_scored": len({trace for trace, _ in scored}),
    }
    device, dtype = resolve_device(cfg)
    settings = recorded_settings(cfg, arms, device, dtype)
    summary = summarize_turns(records, arms, settings, counts, timing)
    _write_jsonl(out / "skipped.jsonl", failures + skipped)
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=2, ensure_ascii=True) + "\n")
    report = format_turn_report(summary)
    write_text_atomic(out / "report.txt", report + "\n")
    print(report)
    return summary


def _count(problems: list[dict]) -> dict:
    return dict(sorted(Counter(p["reason"] for p in problems).items()))
