"""The turns ``eogym-sft evaluate`` scores: every assistant turn of every usable trace, its prompt the reference
history before it (images included) rendered by the chat template with the generation prompt, and its reference
(:class:`TurnPrompt`). :func:`read_traces` reads the rows, :func:`plan_turns` makes the prompts; a row or a turn
that cannot be used is one entry naming it (:func:`problem`)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from ..data.datasets import read_rows
from ..data.encoding import render
from ..data.images import ImageError, image_size, resolve_image_path
from ..data.prepare import resized_hw
from ..data.traces import Trace, TraceError, count_images, normalize_row
from ..metrics.scoring import Reference, extract_final_answer
from ..models.layout import image_factor, image_token_count
from .run_args import EvalConfig


@dataclass
class TurnPrompt:
    """One scored turn: its prompt, exactly as every arm sees it, and its reference."""

    trace_id: str
    turn: int  # index among the trace's assistant turns
    message_index: int
    source: str
    text: str
    images: list[Path]  # resolved paths, in prompt order
    prompt_sha256: str
    prompt_tokens: int
    reference: Reference
    meta: dict
    question: str


def read_traces(cfg: EvalConfig) -> tuple[list[tuple[str, Trace]], list[dict]]:
    """Normalised traces with their ``file:line``, and one failure entry for every row that is not usable."""
    traces, failures, seen = [], [], {}
    for source, row in read_rows(cfg.data, cfg.limit):
        row_id = str(row["id"]) if isinstance(row, dict) and isinstance(row.get("id"), (str, int)) else None
        try:
            if isinstance(row, TraceError):
                raise row
            trace = normalize_row(row, cfg.tool_images)
            if trace.id in seen:
                raise TraceError("duplicate_id", "id", f"id {trace.id!r} already used at {seen[trace.id]}")
        except TraceError as err:
            failures.append(problem("row", source, row_id, None, err.reason, err.field, err.detail))
            continue
        seen[trace.id] = source
        traces.append((source, trace))
    return traces, failures


def problem(level, source, trace_id, turn, reason, field_name, detail) -> dict:
    return {
        "level": level,
        "source": source,
        "trace_id": trace_id,
        "turn": turn,
        "reason": reason,
        "field": field_name,
        "detail": detail,
    }


def _image_table(trace: Trace, cfg: EvalConfig, factor: int) -> list:
    """Per image: ``(path, visual tokens, "relative/path:bytes")``, or the :class:`ImageError` that makes it
    unusable. Size, not content, identifies the file in the prompt hash: reading every image of a test split
    (many GB) only to hash it would cost more than the evaluation's own decoding."""
    out = []
    for rel in trace.images:
        try:
            path = resolve_image_path(rel, cfg.data_root)
            width, height = image_size(path)
            tokens = image_token_count(resized_hw(width, height, factor, cfg.min_pixels, cfg.max_pixels), factor)
            out.append((path, tokens, f"{rel}:{path.stat().st_size}"))
        except ImageError as err:
            out.append(ImageError(err.reason, rel, err.detail))  # name the row's path, not the resolved one
    return out


def _question(trace: Trace) -> str:
    user = next((m for m in trace.messages if m["role"] == "user"), None)
    return "".join(p.get("text", "") for p in user["content"] if p["type"] == "text") if user else ""


def _reference(trace: Trace, index: int) -> Reference:
    msg = trace.messages[index]
    calls = [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in msg.get("tool_calls", [])
    ]
    last = index == len(trace.messages) - 1  # normalize_row ends every trace at its last assistant turn
    return Reference(
        calls=calls,
        content=msg["content"],
        tool_names=[t["function"]["name"] for t in trace.tools],
        is_final=last and extract_final_answer(msg["content"]) is not None,
        gt_answer=trace.meta.get("gt_answer", ""),
        is_last=last,
    )


def plan_turns(processor, traces: list[tuple[str, Trace]], cfg: EvalConfig) -> tuple[list[TurnPrompt], list[dict]]:
    """Render every assistant turn's prompt and count its tokens as data prep does (image tokens
    included); turns over ``max_prompt_tokens`` or with an unusable image are skipped with a reason."""
    tokenizer = processor.tokenizer
    factor = image_factor(processor)
    prompts, skipped = [], []
    for source, trace in traces:
        layout = _image_table(trace, cfg, factor)
        turn = -1
        for index, msg in enumerate(trace.messages):
            if msg["role"] != "assistant":
                continue
            turn += 1
            history = trace.messages[:index]
            images = layout[: count_images(history)]
            bad = next((img for img in images if isinstance(img, ImageError)), None)
            if bad is not None:
                skipped.append(problem("turn", source, trace.id, turn, bad.reason, f"image {bad.path}", bad.detail))
                continue
            text = render(processor, history, trace.tools, add_generation_prompt=True)
            n_text = len(tokenizer(text, add_special_tokens=False)["input_ids"])
            n_tokens = n_text - len(images) + sum(tokens for _, tokens, _ in images)  # one <|image_pad|> each
            if n_tokens > cfg.max_prompt_tokens:
                detail = f"{n_tokens} prompt tokens, limit {cfg.max_prompt_tokens}"
                skipped.append(problem("turn", source, trace.id, turn, "prompt_too_long", "messages", detail))
                continue
            digest = hashlib.sha256(text.encode())
            for _, _, key in images:
                digest.update(f"\0{key}".encode())
            prompts.append(
                TurnPrompt(
                    trace.id,
                    turn,
                    index,
                    source,
                    text,
                    [p for p, _, _ in images],
                    digest.hexdigest(),
                    n_tokens,
                    _reference(trace, index),
                    dict(trace.meta),
                    _question(trace),
                )
            )
    return prompts, skipped
