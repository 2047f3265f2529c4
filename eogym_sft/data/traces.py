"""Normalise EO-Gym tool-use traces from any accepted dialect into one canonical conversation.

The canonical form is what Qwen3-VL's chat template consumes:

* ``{"role": "system", "content": str}``
* ``{"role": "user" | "tool", "content": [{"type": "text", "text": str} | {"type": "image"}]}``
* ``{"role": "assistant", "content": str, "tool_calls": [{"type": "function",
  "function": {"name": str, "arguments": dict}}]}`` (``tool_calls`` only when there are some)

plus ``images``: the image paths, relative to the data root, in the order of the ``{"type": "image"}``
parts. Everything here is pure Python: no I/O, no model. ``docs/data.md`` lists the accepted dialects.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..config import TOOL_IMAGES
from ..safe_json import UntrustedJSONError, loads
from .tool_images import ToolImageRule

ROLES = ("system", "user", "assistant", "tool", "function")
TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
TOOL_RESPONSE_RE = re.compile(r"<tool_response>\n?(.*?)\n?</tool_response>", re.DOTALL)
IMAGE_TAG = "<image>"


class TraceError(ValueError):
    """A row that cannot become a training sample: ``reason`` is a stable code, ``field`` says where."""

    def __init__(self, reason: str, field: str, detail: str):
        super().__init__(f"{reason} at {field}: {detail}")
        self.reason = reason
        self.field = field
        self.detail = detail


@dataclass
class Trace:
    """One EO-Gym row in canonical form."""

    id: str
    messages: list[dict]
    images: list[str]
    tools: list[dict]
    meta: dict = field(default_factory=dict)
    trimmed_messages: int = 0
    # One entry per tool turn, in order: the call it answers, {"name": str | None, "arguments": dict | None}
    # (paired by tool_call_id, else by position after the assistant turn that made the calls).
    tool_results: list[dict] = field(default_factory=list)
    tool_images: dict[str, int] = field(default_factory=dict)  # images attached to tool turns, per tool name


def strip_none(value):
    """Drop ``None`` values from nested dicts (Arrow-style loaders pad every dict with them)."""
    if isinstance(value, dict):
        return {k: strip_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [strip_none(v) for v in value]
    return value


def normalize_tools(tools, where: str = "tools") -> list[dict]:
    """Return OpenAI function schemas from a list or a JSON string of them."""
    if tools is None:
        return []
    if isinstance(tools, str):
        try:
            tools = loads(tools)
        except UntrustedJSONError as err:
            raise TraceError("bad_field_type", where, f"tools is a string but not usable JSON ({err})") from None
    if not isinstance(tools, list):
        raise TraceError("bad_field_type", where, f"expected a list of tool schemas, got {type(tools).__name__}")
    out = []
    for i, tool in enumerate(strip_none(tools)):
        if not isinstance(tool, dict):
            raise TraceError("bad_field_type", f"{where}[{i}]", "a tool schema must be an object")
        if "function" not in tool:  # a bare {"name", "parameters"} schema
            tool = {"type": "function", "function": tool}
        if not isinstance(tool["function"], dict) or "name" not in tool["function"]:
            raise TraceError("bad_field_type", f"{where}[{i}].function", "a tool schema needs a name")
        out.append(tool)
    return out


def parse_arguments(arguments, where: str) -> dict:
    """Tool-call arguments as a dict; a JSON string is parsed, anything else is an error."""
    if arguments is None:
        return {}
    if isinstance(arguments, str):
        try:
            arguments = loads(arguments) if arguments.strip() else {}
        except UntrustedJSONError as err:
            raise TraceError("invalid_tool_arguments", where, f"not valid JSON ({err})") from None
    if not isinstance(arguments, dict):
        raise TraceError("invalid_tool_arguments", where, f"expected an object, got {type(arguments).__name__}")
    return arguments


def _tool_call(name, arguments, where: str) -> dict:
    if not isinstance(name, str) or not name:
        raise TraceError("invalid_tool_call", where, "a tool call needs a non-empty string name")
    args = parse_arguments(arguments, f"{where}.arguments")
    return {"type": "function", "function": {"name": name, "arguments": args}}


def parse_tool_call_text(text: str, where: str) -> tuple[str, list[dict]]:
    """Split Qwen/Hermes ``<tool_call>{json}</tool_call>`` blocks out of assistant text."""
    calls = []
    for k, match in enumerate(TOOL_CALL_RE.finditer(text)):
        try:
            payload = loads(match.group(1))
        except UntrustedJSONError as err:
            raise TraceError("invalid_tool_call", f"{where}<tool_call {k}>", f"not valid JSON ({err})") from None
        if not isinstance(payload, dict):
            raise TraceError("invalid_tool_call", f"{where}<tool_call {k}>", "expected a JSON object")
        calls.append(_tool_call(payload.get("name"), payload.get("arguments"), f"{where}<tool_call {k}>"))
    if "<tool_call>" in TOOL_CALL_RE.sub("", text):
        raise TraceError("invalid_tool_call", where, "unclosed <tool_call> block")
    rest = [part.strip() for part in TOOL_CALL_RE.split(text)[::2]]
    return "\n".join(part for part in rest if part), calls


def _text_parts(content, where: str) -> list[dict]:
    """Content (string, null or a list of parts) as a list of text/image parts; image parts keep their path."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise TraceError("bad_field_type", where,
                         f"content must be a string, null or a list, not {type(content).__name__}")
    parts = []
    for i, part in enumerate(content):
        if isinstance(part, str):
            parts.append({"type": "text", "text": part})
            continue
        if not isinstance(part, dict):
            raise TraceError("bad_field_type", f"{where}[{i}]", "a content part must be an object or a string")
        kind = part.get("type")
        if kind == "text" or (kind is None and "text" in part):
            parts.append({"type": "text", "text": str(part.get("text") or "")})
        elif kind in ("image", "image_url") or "image" in part or "image_url" in part:
            parts.append({"type": "image", "path": _image_part_path(part)})
        else:
            raise TraceError("bad_field_type", f"{where}[{i}].type", f"unsupported content part type {kind!r}")
    return parts


def _image_part_path(part: dict):
    """The path an image part names, or None for a bare placeholder that takes the next row image."""
    ref = part.get("image") or part.get("image_url") or part.get("path") or part.get("url")
    if isinstance(ref, dict):
        ref = ref.get("url") or ref.get("path")
    if isinstance(ref, str) and ref.startswith("file://"):
        ref = ref[len("file://"):]
    return ref if isinstance(ref, str) and ref else None


def _expand_image_tags(parts: list[dict]) -> list[dict]:
    """Turn ``<image>`` tags inside text parts into bare image placeholders, keeping their order."""
    out = []
    for part in parts:
        if part["type"] != "text" or IMAGE_TAG not in part["text"]:
            out.append(part)
            continue
        pieces = part["text"].split(IMAGE_TAG)
        for k, piece in enumerate(pieces):
            if k:
                out.append({"type": "image", "path": None})
            if piece:
                out.append({"type": "text", "text": piece})
    return out


def _attach_tool_images(parts: list[dict], call: dict, rule: ToolImageRule) -> list[dict]:
    """Append an image part for each path the rule attaches from a tool result's text (the text stays)."""
    text = "".join(p["text"] for p in parts if p["type"] == "text")
    return parts + [{"type": "image", "path": path} for path in rule.images(call["name"], text)]


def _answered_call(msg: dict, pending: list[dict], by_id: dict) -> dict:
    """The call a tool result answers: by ``tool_call_id``, else the oldest unanswered call; a ``name``
    on the result wins over the call's own."""
    call = by_id.get(msg.get("tool_call_id"))
    if call in pending:
        pending.remove(call)
    elif call is None and pending:
        call = pending.pop(0)
    name = msg.get("name") if isinstance(msg.get("name"), str) and msg.get("name") else None
    return {"name": name or (call and call["name"]), "arguments": call and call["arguments"]}


def _split_tool_responses(text: str, where: str) -> list[str] | None:
    """The payloads of a user turn made only of ``<tool_response>`` blocks; None if it has none."""
    if "<tool_response>" not in text:
        return None
    blocks = TOOL_RESPONSE_RE.findall(text)
    if TOOL_RESPONSE_RE.sub("", text).strip():
        raise TraceError("mixed_tool_response", where, "a user turn mixes <tool_response> blocks with other text")
    return blocks


def _assistant_message(msg: dict, where: str) -> dict:
    parts = _text_parts(msg.get("content"), f"{where}.content")
    if any(p["type"] == "image" for p in parts):
        raise TraceError("bad_field_type", f"{where}.content", "an assistant turn cannot contain images")
    text, calls = parse_tool_call_text("".join(p["text"] for p in parts), f"{where}.content")
    raw_calls = msg.get("tool_calls") or []
    if msg.get("function_call"):  # legacy OpenAI single call
        raw_calls = list(raw_calls) + [{"function": msg["function_call"]}]
    if raw_calls and calls:
        raise TraceError("invalid_tool_call", where, "tool calls given both as tool_calls and as <tool_call> text")
    if not isinstance(raw_calls, list):
        raise TraceError("bad_field_type", f"{where}.tool_calls", "tool_calls must be a list")
    for k, call in enumerate(raw_calls):
        if not isinstance(call, dict):
            raise TraceError("invalid_tool_call", f"{where}.tool_calls[{k}]", "a tool call must be an object")
        fn = call.get("function", call)
        if not isinstance(fn, dict):
            raise TraceError("invalid_tool_call", f"{where}.tool_calls[{k}].function", "must be an object")
        calls.append(_tool_call(fn.get("name"), fn.get("arguments"), f"{where}.tool_calls[{k}].function"))
    out = {"role": "assistant", "content": text.strip() if calls else text}
    if calls:
        out["tool_calls"] = calls
    return out


def _generated_message(generated, message: dict, where: str) -> dict:
    """An assistant turn as the model wrote it (``generated``: its text before ``<|im_end|>``, tool calls in
    their own spacing), checked against the turn's parsed ``content``/``tool_calls``. Rendered verbatim, the
    turn's trained tokens are the generated ones, not the chat template's re-rendering of the calls."""
    if not isinstance(generated, str):
        raise TraceError("bad_field_type", f"{where}.generated", "generated must be a string")
    _, calls = parse_tool_call_text(generated, f"{where}.generated")
    if calls != message.get("tool_calls", []):
        raise TraceError("generated_mismatch", f"{where}.generated",
                         "its <tool_call> blocks differ from the turn's tool_calls")
    return {"role": "assistant", "content": generated}


def _messages(raw_messages, rule: ToolImageRule) -> tuple[list[dict], list[dict]]:
    """Canonical messages whose image parts still carry a path (None = next row image), and the call
    each tool turn answers."""
    if not isinstance(raw_messages, list) or not raw_messages:
        raise TraceError("bad_field_type", "messages", "messages must be a non-empty list")
    out, answered, pending, by_id = [], [], [], {}
    for i, msg in enumerate(raw_messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise TraceError("bad_field_type", where, "a message must be an object")
        role = msg.get("role")
        if role not in ROLES:
            raise TraceError("unknown_role", f"{where}.role", f"role {role!r} is not one of {', '.join(ROLES)}")
        if role == "assistant":
            if msg.get("truncated") is True:
                break  # a turn cut at its token limit is never trained, nor is anything after it
            out.append(_assistant_message(msg, where))
            pending = [c["function"] for c in out[-1].get("tool_calls", [])]
            if "generated" in msg:
                out[-1] = _generated_message(msg["generated"], out[-1], where)
            raw_ids = [c.get("id") if isinstance(c, dict) else None for c in msg.get("tool_calls") or []]
            by_id = {cid: call for cid, call in zip(raw_ids, pending) if isinstance(cid, str)}
            continue
        raw_parts = _text_parts(msg.get("content"), f"{where}.content")
        parts = _expand_image_tags(raw_parts)
        if role == "system" and i != 0:
            # Qwen3-VL's template renders only a leading system prompt; a later one would vanish silently.
            raise TraceError("misplaced_system", f"{where}.role", "a system message is only allowed first")
        if role == "system":
            if any(p["type"] == "image" for p in parts):
                raise TraceError("bad_field_type", f"{where}.content", "a system prompt cannot contain images")
            out.append({"role": "system", "content": "".join(p["text"] for p in parts)})
            continue
        text = "".join(p["text"] for p in raw_parts if p["type"] == "text")  # <image> tags still in place
        blocks = _split_tool_responses(text, f"{where}.content") if role == "user" else None
        if blocks is not None:
            if any(p["type"] == "image" for p in raw_parts):
                raise TraceError("mixed_tool_response", f"{where}.content", "images beside <tool_response> blocks")
            for block in blocks:
                answered.append(_answered_call({}, pending, by_id))
                tool_parts = _expand_image_tags([{"type": "text", "text": block}])
                out.append({"role": "tool", "content": _attach_tool_images(tool_parts, answered[-1], rule)})
            continue
        if role in ("tool", "function"):
            answered.append(_answered_call(msg, pending, by_id))
            out.append({"role": "tool", "content": _attach_tool_images(parts, answered[-1], rule)})
        else:
            out.append({"role": "user", "content": parts})
    return out, answered


def _bind_images(messages: list[dict], row_images: list[str]) -> list[str]:
    """Give every image part its path, in document order; return the ordered path list.

    Bare placeholders (``<image>`` tags, pathless image parts) take the row's ``images`` in order. With
    no placeholders at all, the row images go at the start of the first user turn. Row images that an
    image part of a user turn already names by path are bound there and not placed a second time.
    """
    user_parts = [p for m in messages if m["role"] == "user" for p in m["content"]]
    named = {p["path"] for p in user_parts if p["type"] == "image" and p["path"]}
    row_images = [p for p in row_images if p not in named]
    slots = [
        p
        for m in messages
        if isinstance(m["content"], list)
        for p in m["content"]
        if p["type"] == "image" and p["path"] is None
    ]
    if row_images and not slots:
        first_user = next((m for m in messages if m["role"] == "user"), None)
        if first_user is None:
            raise TraceError("image_placeholder_mismatch", "images", "row images but no user turn to put them in")
        first_user["content"] = [{"type": "image", "path": p} for p in row_images] + first_user["content"]
    elif len(slots) != len(row_images):
        raise TraceError(
            "image_placeholder_mismatch", "images",
            f"{len(slots)} <image> placeholders but {len(row_images)} row images"
        )
    else:
        for slot, path in zip(slots, row_images):
            slot["path"] = path
    ordered = []
    for m in messages:
        if isinstance(m["content"], list):
            for p in m["content"]:
                if p["type"] == "image":
                    ordered.append(p.pop("path"))
    return ordered


def normalize_row(row: dict, tool_images: str | ToolImageRule = TOOL_IMAGES) -> Trace:
    """Turn one parsed EO-Gym JSONL row into a canonical :class:`Trace`.

    ``tool_images`` says which image paths named in tool results become image parts
    (:mod:`eogym_sft.data.tool_images`). Raises :class:`TraceError` with a stable reason code and the field at fault.
    """
    if not isinstance(row, dict):
        raise TraceError("not_an_object", "<row>", f"a row must be a JSON object, got {type(row).__name__}")
    for key in ("id", "messages"):
        if key not in row:
            raise TraceError("missing_field", key, f"the row has no {key!r}")
    if not isinstance(row["id"], (str, int)) or row["id"] == "":
        raise TraceError("bad_field_type", "id", "id must be a non-empty string")
    row_images = row.get("images") or []
    if not isinstance(row_images, list) or not all(isinstance(p, str) and p for p in row_images):
        raise TraceError("bad_field_type", "images", "images must be a list of path strings")
    rule = ToolImageRule.parse(tool_images)
    messages, answered = _messages(row["messages"], rule)
    tool_images = _images_per_tool(messages, answered)
    images = _bind_images(messages, row_images)
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None:
        raise TraceError("no_assistant_turn", "messages", "the trace has no assistant turn to train on")
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    if not any(m["role"] == "user" for m in messages[:first]):
        raise TraceError("assistant_before_user", f"messages[{first}]", "an assistant turn comes before any user turn")
    meta = {
        k: "" if row.get(k) is None else str(row.get(k))
        for k in ("EO_task", "question_type", "data_source", "gt_answer")
    }
    return Trace(
        id=str(row["id"]),
        messages=messages[: last + 1],
        images=images[: _images_before(messages, last + 1)],
        tools=normalize_tools(row.get("tools")),
        meta=meta,
        trimmed_messages=len(messages) - last - 1,
        tool_results=answered[: sum(1 for m in messages[: last + 1] if m["role"] == "tool")],
        tool_images=tool_images,
    )


def _images_per_tool(messages: list[dict], answered: list[dict]) -> dict[str, int]:
    """Images that name a file in tool turns (attached by the rule or given as parts), per tool name.

    Called before binding, while placeholders still have no path; trailing tool turns are cut later,
    so only turns up to the last assistant turn count."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    tool_turns = [m for m in messages[: last + 1] if m["role"] == "tool"]
    counts: dict[str, int] = {}
    for msg, call in zip(tool_turns, answered):
        n = sum(1 for p in msg["content"] if p["type"] == "image" and p["path"] is not None)
        if n:
            name = call["name"] or "<unknown>"
            counts[name] = counts.get(name, 0) + n
    return counts


def _images_before(messages: list[dict], end: int) -> int:
    return sum(
        1 for m in messages[:end] if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image"
    )


def count_images(messages: list[dict]) -> int:
    """Number of image parts in canonical messages."""
    return _images_before(messages, len(messages))
