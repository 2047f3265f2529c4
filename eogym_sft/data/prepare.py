"""EO-Gym JSONL rows -> Qwen3-VL training samples, with a manifest line for every input line.

:func:`prepare_line` turns one input line into a manifest entry and zero or more samples; it takes
image sizes from headers and checks that every image file decodes to its end (once per distinct
file). :func:`prepare_files` runs it over files in parallel and :func:`write_prepared` saves the dataset,
``manifest.jsonl`` and ``stats.json``.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass
from dataclasses import field as dataclass_field

from ..config import TOOL_IMAGES, TOOL_IMAGES_HELP, TokenBudget
from ..models.layout import image_factor, image_token_count
from ..safe_json import UntrustedJSONError, loads
from .encoding import Encoded, encode_conversation, render
from .images import ImageError, checked_image_size, resolve_image_path
from .tool_images import ToolImageRule
from .traces import Trace, TraceError, normalize_row

OVERLONG_MODES = ("split", "drop")
UTF8_BOM = b"\xef\xbb\xbf"
# Bounds on one row's cost. Rendering prefix by prefix makes a row's prep time grow faster than its turn
# count (a 500-turn row takes seconds, a 5,000-turn row minutes), and a row's bytes bound its memory.
# EO-Gym rows have tens of messages and tens of kilobytes; these leave wide room.
MAX_ROW_BYTES = 4 << 20
MAX_MESSAGES = 256
DROP_SHARE = 0.5  # more than this share of rows dropped for one reason stops a command (--allow-drops goes on)


@dataclass
class PrepConfig(TokenBudget):
    """Settings of a data-prep run (the flags of ``eogym-sft prepare``): the token budget, and the rest. The pixel
    cap is not one of them: the processor carries it (:func:`pixel_cap`), so prep and training cannot disagree."""

    data_root: str = dataclass_field(default=".", metadata={"help": "folder holding EO_GYM_DATA/ and image_cache/"})
    overlong: str = dataclass_field(
        default="split", metadata={"choices": OVERLONG_MODES, "help": "what to do with traces over the budget"}
    )
    # a ToolImageRule spec
    tool_images: str = dataclass_field(default=TOOL_IMAGES, metadata={"help": TOOL_IMAGES_HELP})
    strict: bool = dataclass_field(default=False,
                                   metadata={"help": "stop at the first bad line with file, line and field"})
    # a longer line is dropped as row_too_large before it is parsed
    max_row_bytes: int = dataclass_field(default=MAX_ROW_BYTES, metadata={"flag": False})
    # a row with more messages is dropped as too_many_messages before it is rendered
    max_messages: int = dataclass_field(default=MAX_MESSAGES, metadata={"flag": False})
    # more rows than this share dropped for one reason stops the run (1.0: never; the CLI's --allow-drops)
    max_drop_share: float = dataclass_field(default=DROP_SHARE, metadata={"flag": False})

    def __post_init__(self):
        super().__post_init__()
        if self.overlong not in OVERLONG_MODES:
            raise ValueError(f"overlong must be one of {OVERLONG_MODES}, got {self.overlong!r}")
        ToolImageRule.parse(self.tool_images)  # raises ValueError on a bad spec


@dataclass
class LineResult:
    """What became of one input line."""

    file: str
    line: int
    id: str | None
    status: str  # kept | split | dropped
    reason: str | None = None
    field: str | None = None
    detail: str | None = None
    samples: list[dict] = dataclass_field(default_factory=list)
    tool_images: dict[str, int] = dataclass_field(default_factory=dict)  # images attached per tool name

    def manifest_entry(self) -> dict:
        entry = {k: v for k, v in asdict(self).items() if k not in ("samples", "tool_images")}
        entry["sample_ids"] = [s["sample_id"] for s in self.samples]
        return entry


class PrepError(ValueError):
    """A bad input line under ``--strict``: names the file, line and field."""


class EmptyInputError(ValueError):
    """An input file with no lines at all."""


class TooManyDropped(ValueError):
    """More than ``max_drop_share`` of the rows dropped for one reason: the inputs or the data root are likely
    wrong."""


LIKELY_CAUSE = {
    "missing_image": "the images are not under --data-root (it must hold EO_GYM_DATA/ and image_cache/)",
    "unsafe_image_path": "the rows' image paths are absolute or leave --data-root",
    "malformed_json": "the input is not JSONL (one JSON object a line)",
    "non_utf8": "the input is not UTF-8 text",
    "overlong": "--max-length is too small for these rows (or use --overlong split)",
    "turn_exceeds_budget": "--max-length is too small for these rows",
}


def check_reason_share(problems: list[dict], total: int, max_share: float, what: str = "rows",
                       allow_flag: str = "--allow-drops") -> None:
    """Refuse a run that lost more than ``max_share`` of its ``total`` rows (or turns) for one reason, naming
    the reason, two examples and the likely cause: a run that silently loses most of its data is never what was
    meant. ``problems`` are dicts with ``reason``, ``source`` (``file:line``), ``field`` and ``detail``."""
    blank = sum(p["reason"] == "blank_line" for p in problems)  # a trailing empty line is not a lost row
    total -= blank
    if total <= 0 or max_share >= 1:
        return
    by_reason: dict[str, list[dict]] = {}
    for p in problems:
        if p["reason"] != "blank_line":
            by_reason.setdefault(p["reason"], []).append(p)
    for reason, lost in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
        if len(lost) > max_share * total:
            examples = "; ".join(f"{p['source']} {p['field']}: {p['detail']}" for p in lost[:2])
            cause = LIKELY_CAUSE.get(reason, "the inputs do not fit these settings")
            raise TooManyDropped(
                f"{len(lost)} of {total} {what} dropped as {reason} (e.g. {examples}); likely cause: {cause}. "
                f"Pass {allow_flag} to go on anyway"
            )


def check_drop_share(results: list[LineResult], max_share: float, allow_flag: str = "--allow-drops") -> None:
    """:func:`check_reason_share` over data prep's lines (blank lines aside)."""
    dropped = [{"reason": r.reason, "source": f"{r.file}:{r.line}", "field": r.field,
                "detail": r.detail} for r in results if r.status == "dropped"]
    check_reason_share(dropped, len(results), max_share, "rows", allow_flag)


def pixel_cap(processor) -> tuple[int, int]:
    """``(min_pixels, max_pixels)`` of ``processor``: its image processor's ``size``, where
    :func:`eogym_sft.models.processor.load_processor` puts the cap."""
    size = processor.image_processor.size
    return size["shortest_edge"], size["longest_edge"]


def resized_hw(width: int, height: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """``(height, width)`` after Qwen-VL's resize, by qwen-vl-utils' ``smart_resize`` (the reference).

    qwen-vl-utils 0.0.14 can return a zero side for extreme aspect ratios (its downscale branch lost
    the ``max(factor, ...)`` floor), and refuses ratios above 200: both become ``image_aspect_ratio``.
    """
    from qwen_vl_utils import smart_resize

    try:
        h, w = smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    except ValueError as err:
        raise ImageError("image_aspect_ratio", f"{width}x{height}", str(err)) from None
    if h < factor or w < factor:
        raise ImageError("image_aspect_ratio", f"{width}x{height}", f"resizes to {w}x{h}")
    return h, w


def _decode_line(raw: bytes, max_bytes: int = MAX_ROW_BYTES):
    """One JSONL line's value; any line that is too long, not UTF-8 or not acceptable JSON is a :class:`TraceError`."""
    if len(raw) > max_bytes:
        raise TraceError("row_too_large", "<line>", f"{len(raw)} bytes, over the bound of {max_bytes}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise TraceError("non_utf8", "<line>", f"invalid UTF-8 at byte {err.start}") from None
    try:
        return loads(text)
    except UntrustedJSONError as err:
        raise TraceError(err.reason, "<line>", err.detail) from None


def _check_row_size(row, max_messages: int) -> None:
    messages = row.get("messages") if isinstance(row, dict) else None
    if isinstance(messages, list) and len(messages) > max_messages:
        raise TraceError("too_many_messages", "messages",
                         f"{len(messages)} messages, over the bound of {max_messages}")


def _image_layout(processor, trace: Trace, data_root: str) -> list[tuple[int, int]]:
    factor, (min_pixels, max_pixels) = image_factor(processor), pixel_cap(processor)
    out = []
    for k, rel in enumerate(trace.images):
        try:
            width, height = checked_image_size(resolve_image_path(rel, data_root))
            out.append(resized_hw(width, height, factor, min_pixels, max_pixels))
        except ImageError as err:
            raise TraceError(err.reason, f"image {k} ({rel})", err.detail) from None
    return out


def _costs(enc: Encoded, image_tokens: list[int], image_token_id: int) -> list[int]:
    """Per-token cost: 1, or an image's visual-token count at its placeholder."""
    costs, k = [], 0
    for tok in enc.input_ids:
        if tok == image_token_id:
            costs.append(image_tokens[k])
            k += 1
        else:
            costs.append(1)
    if k != len(image_tokens):
        raise TraceError("template_mismatch", "messages",
                         f"{k} image placeholders rendered for {len(image_tokens)} images")
    return costs


def plan_windows(enc: Encoded, costs: list[int], budget: int) -> list[tuple[int, int, int]]:
    """Cut a trace at assistant turns into windows ``(context_start, first_trained, last_trained)``.

    Indices count assistant turns. Every window holds the head (system, tools block and the question
    with its images), then the turns ``context_start..last_trained`` whole, and trains only
    ``first_trained..last_trained``; a window after the first always keeps the turn whose tool result
    it answers. Each assistant turn is trained in exactly one window.
    """
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def span(a: int, b: int) -> int:
        return prefix[b] - prefix[a]

    head, starts, ends = span(0, enc.assistant_starts[0]), enc.assistant_starts, enc.assistant_ends
    windows, s, n = [], 0, len(starts)
    while s < n:
        c = s - 1 if s else 0
        if head + span(starts[c], ends[s]) > budget:
            where = f"messages[{enc.assistant_message_index[s]}]"
            need = head + span(starts[c], ends[s])
            raise TraceError("turn_exceeds_budget", where,
                             f"this turn needs {need} tokens with its context, budget {budget}")
        e = s
        while e + 1 < n and head + span(starts[c], ends[e + 1]) <= budget:
            e += 1
        while c > 0 and head + span(starts[c - 1], ends[e]) <= budget:
            c -= 1
        windows.append((c, s, e))
        s = e + 1
    return windows


def _window_sample(trace: Trace, enc: Encoded, hws, image_pos: list[int], window, factor: int) -> dict:
    c, s, e = window
    head_end, lo, hi = enc.assistant_starts[0], enc.assistant_starts[c], enc.assistant_ends[e]
    trained_lo = enc.assistant_starts[s]
    ids = enc.input_ids[:head_end] + enc.input_ids[lo:hi]
    mask = enc.assistant_mask[:head_end] + [m if i >= trained_lo else 0 for i,
                                            m in enumerate(enc.assistant_mask[lo:hi], lo)]
    first_msg, last_msg = enc.assistant_message_index[c], enc.assistant_message_index[e]
    messages = trace.messages[: enc.assistant_message_index[0]] + trace.messages[first_msg : last_msg + 1]
    keep = [k for k, pos in enumerate(image_pos) if pos < head_end or lo <= pos < hi]
    sizes = [list(hws[k]) for k in keep]
    n_image_tokens = sum(image_token_count(hw, factor) for hw in sizes)
    return {
        "messages": messages,
        "images": [trace.images[k] for k in keep],
        "image_hw": sizes,
        "input_ids": ids,
        "assistant_masks": mask,
        "n_tokens": len(ids) - len(keep) + n_image_tokens,
        "n_trained_tokens": sum(mask),
        "n_image_tokens": n_image_tokens,
    }


def _check_window_render(processor, sample: dict, tools: list[dict]) -> None:
    """A window's token slices must be exactly what the template renders for its messages."""
    text = render(processor, sample["messages"], tools)
    if processor.tokenizer(text, add_special_tokens=False)["input_ids"] != sample["input_ids"]:
        raise TraceError("template_mismatch", "messages", "a split window does not re-render to the same tokens")


def trace_samples(processor, trace: Trace, hws: list[tuple[int, int]], cfg: PrepConfig) -> tuple[str, list[dict]]:
    """Render one canonical trace into samples: ``("kept", [one])`` or ``("split", [windows])``.

    Raises :class:`TraceError` when the trace cannot fit (``overlong`` under ``drop``,
    ``turn_exceeds_budget`` under ``split``).
    """
    factor = image_factor(processor)
    image_token_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    enc = encode_conversation(processor, trace.messages, trace.tools)
    image_tokens = [image_token_count(hw, factor) for hw in hws]
    costs = _costs(enc, image_tokens, image_token_id)
    total = sum(costs)
    if total > cfg.max_length and cfg.overlong == "drop":
        raise TraceError("overlong", "messages", f"{total} tokens, budget {cfg.max_length}")
    n_turns = len(enc.assistant_starts)
    windows = [(0, 0, n_turns - 1)] if total <= cfg.max_length else plan_windows(enc, costs, cfg.max_length)
    image_pos = [i for i, tok in enumerate(enc.input_ids) if tok == image_token_id]
    samples = [_window_sample(trace, enc, hws, image_pos, w, factor) for w in windows]
    if len(samples) > 1:
        for sample in samples:
            _check_window_render(processor, sample, trace.tools)
    tools_json = json.dumps(trace.tools, ensure_ascii=False)
    for k, (sample, (c, s, e)) in enumerate(zip(samples, windows)):
        sample.update(
            sample_id=f"{trace.id}#w{k}",
            source_id=trace.id,
            window=k,
            n_windows=len(samples),
            trained_turns=[s, e],
            messages=json.dumps(sample["messages"], ensure_ascii=False),
            tools=tools_json,
            **trace.meta,
        )
    return ("kept" if len(samples) == 1 else "split"), samples


def prepare_line(processor, cfg: PrepConfig, file: str, line: int, raw: bytes) -> LineResult:
    """One input line -> its manifest entry and samples. Never raises for bad input, unless strict."""
    if not raw.strip():
        return _dropped(cfg, file, line, None, TraceError("blank_line", "<line>", "empty line"))
    row_id = None
    try:
        row = _decode_line(raw, cfg.max_row_bytes)
        row_id = str(row["id"]) if isinstance(row, dict) and isinstance(row.get("id"), (str, int)) else None
        _check_row_size(row, cfg.max_messages)
        trace = normalize_row(row, cfg.tool_images)
        hws = _image_layout(processor, trace, cfg.data_root)
        status, samples = trace_samples(processor, trace, hws, cfg)
    except TraceError as err:
        return _dropped(cfg, file, line, row_id, err)
    for sample in samples:
        sample.update(source_file=file, source_line=line)
    return LineResult(file, line, row_id, status, samples=samples, tool_images=trace.tool_images)


def _dropped(cfg: PrepConfig, file: str, line: int, row_id, err: TraceError) -> LineResult:
    if cfg.strict and err.reason != "blank_line":  # a trailing empty line is no reason to stop
        raise PrepError(f"{file}:{line}: field {err.field}: {err.reason}: {err.detail}") from err
    return LineResult(file, line, row_id, "dropped", err.reason, err.field, err.detail)


def read_lines(path: str | os.PathLike):
    """``(line_number, raw_bytes)`` for every line of a JSONL file, 1-based, bytes undecoded (a UTF-8 BOM
    that opens the file is not part of its first line). An empty file is an error: it is never what was meant."""
    with open(path, "rb") as fh:
        empty = True
        for number, raw in enumerate(fh, 1):
            if number == 1 and raw.startswith(UTF8_BOM):
                raw = raw[len(UTF8_BOM):]
            empty = False
            yield number, raw.rstrip(b"\r\n")
    if empty:
        raise EmptyInputError(f"{path} is empty: no rows to read")


def _prepare_chunk(processor, cfg: PrepConfig, chunk) -> list[LineResult]:
    return [prepare_line(processor, cfg, file, line, raw) for file, line, raw in chunk]


@functools.lru_cache(maxsize=1)
def _worker_processor(model: str, cap: tuple[int, int]):
    """A worker process's processor, with the parent's pixel ``cap``: loaded by the pool's initializer, then
    reused for every chunk."""
    from ..models.processor import load_processor

    min_pixels, max_pixels = cap
    return load_processor(model, max_pixels, min_pixels)


def _prepare_chunk_in_worker(model: str, cap: tuple[int, int], cfg: PrepConfig, chunk) -> list[LineResult]:
    return _prepare_chunk(_worker_processor(model, cap), cfg, chunk)


def _chunks(files: list[str], size: int):
    chunk = []
    for file in files:
        for line, raw in read_lines(file):
            chunk.append((str(file), line, raw))
            if len(chunk) == size:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


def _count_lines(files: list[str]) -> int:
    return sum(sum(1 for _ in read_lines(f)) for f in files)


def prepare_files(
    files: list[str], model: str, cfg: PrepConfig, num_proc: int = 1, progress: bool = True, processor=None
) -> list[LineResult]:
    """Run :func:`prepare_line` over every line of ``files``, in order, on ``num_proc`` processes.

    ``processor`` (by default ``model``'s, at the default pixel cap) carries the pixel cap; in-process
    (``num_proc=1``) it is used as given, and worker processes load ``model``'s processor with its cap.
    """
    from tqdm.auto import tqdm

    if processor is None:
        from ..models.processor import load_processor

        processor = load_processor(model)
    bar = tqdm(total=_count_lines(files), unit="row", desc="prepare", disable=not progress)
    results: list[LineResult] = []
    if num_proc <= 1:
        chunk_results = map(functools.partial(_prepare_chunk, processor, cfg), _chunks(files, 16))
    else:
        import multiprocessing as mp

        cap = pixel_cap(processor)
        pool = mp.get_context("spawn").Pool(num_proc, initializer=_worker_processor, initargs=(model, cap))
        chunk_results = pool.imap(functools.partial(_prepare_chunk_in_worker, model, cap, cfg), _chunks(files, 16))
    try:
        for chunk in chunk_results:
            results.extend(chunk)
            bar.update(len(chunk))
    finally:
        bar.close()
        if num_proc > 1:
            pool.terminate()
    return mark_duplicates(results, cfg.strict)


def mark_duplicates(results: list[LineResult], strict: bool = False) -> list[LineResult]:
    """Drop every row whose id an earlier row already used (windows and eval splits key on ids)."""
    seen: dict[str, str] = {}
    for res in results:
        if res.status == "dropped" or res.id is None:
            continue
        if res.id in seen:
            err = TraceError("duplicate_id", "id", f"id {res.id!r} already used at {seen[res.id]}")
            if strict:
                raise PrepError(f"{res.file}:{res.line}: field id: duplicate_id: {err.detail}")
            res.status, res.reason, res.field, res.detail, res.samples = ("dropped", err.reason, err.field,
                                                                          err.detail, [])
        else:
            seen[res.id] = f"{res.file}:{res.line}"
    return results
