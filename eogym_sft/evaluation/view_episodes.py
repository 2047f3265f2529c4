"""The episodes of a rollout or an evaluation as ``eogym-sft view``'s page shows them: one JSON record each, its
messages' texts interned and images stored once (:class:`~eogym_sft.evaluation.view_data.Texts`,
:class:`~eogym_sft.evaluation.view_data.ImageStore`), a rollout episode's gold calls beside the model's; and the
summary of a rollout that has none (:func:`summarize_records`)."""

from __future__ import annotations

import json
from pathlib import Path

from ..metrics.free_running import common_prefix
from ..safe_json import UntrustedJSONError, loads
from ..metrics.tool_args import same_call, same_call_aoi
from .tool_report import executed_calls
from .view_data import ATTACH_ALL, EPISODE_TYPES, ImageStore, Texts, is_number


def _content(content) -> tuple[str, list]:
    """A message's text and its image parts in order (a path, or None for an ``<image>`` tag)."""
    if content is None:
        return "", []
    if isinstance(content, str):
        return content.replace("<image>", "").strip("\n"), [None] * content.count("<image>")
    if not isinstance(content, list):
        return json.dumps(content, ensure_ascii=False), []
    texts, images = [], []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and ("text" in part or part.get("type") == "text"):
            texts.append(str(part.get("text") or ""))
        elif isinstance(part, dict):
            ref = part.get("image") or part.get("image_url") or part.get("path") or part.get("url")
            ref = ref.get("url") or ref.get("path") if isinstance(ref, dict) else ref
            images.append(ref.removeprefix("file://") if isinstance(ref, str) and ref else None)
    return "".join(texts), images


def _call(call) -> dict:
    function = call.get("function", call) if isinstance(call, dict) else {}
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"n": str(function.get("name") if isinstance(function, dict) else None), "a": arguments}


def _aoi(value) -> list[float] | None:
    if isinstance(value, list) and len(value) == 4 and all(map(is_number, value)):
        x0, y0, x1, y1 = (float(v) for v in value)
        if 0 <= x0 < x1 <= 1 and 0 <= y0 < y1 <= 1:
            return [x0, y0, x1, y1]
    return None


def _json_object(text: str) -> dict:
    try:
        value = loads(text)
    except UntrustedJSONError:
        return {}
    return value if isinstance(value, dict) else {}


def page_messages(messages, row_images: list, data_root: Path | None, store: ImageStore, texts: Texts) -> list[dict]:
    """The messages of one conversation for the page: role, text (an index into ``texts``), images; an
    assistant's tool calls; a tool result's images and, for a crop, its box on the source image."""
    rows = iter(row_images)
    first_image = row_images[0] if row_images else None
    pending: list[dict] = []
    out = []
    for message in messages if isinstance(messages, list) else []:
        if not isinstance(message, dict):
            out.append({"r": "?", "t": texts.add(json.dumps(message, ensure_ascii=False))})
            continue
        role = str(message.get("role"))
        text, parts = _content(message.get("content"))
        item = {"r": role, "t": texts.add(text)}
        images = [store.ref(p if p else next(rows, None), data_root) for p in parts]
        if role == "assistant":
            pending = [_call(c) for c in message.get("tool_calls") or [] if isinstance(c, dict)]
            if pending:
                item["calls"] = pending[:]
            if message.get("truncated"):
                item["trunc"] = True
        elif role == "tool":
            call = pending.pop(0) if pending else {"n": None, "a": "{}"}
            name = str(message.get("name") or call["n"])
            item["name"] = name
            images += [store.ref(p, data_root) for p in ATTACH_ALL.images(name, text) if p not in parts]
            result, arguments = _json_object(text), _json_object(call["a"])
            aoi = _aoi(result.get("aoi_norm")) or _aoi(arguments.get("aoi"))
            source = arguments.get("image_url") or first_image
            if aoi and source:
                item["box"] = {"img": store.ref(source, data_root), "aoi": aoi}
        if images:
            item["img"] = images
        out.append(item)
    leftover = [store.ref(p, data_root) for p in rows]  # row images no tag placed: shown with the question
    user = next((m for m in out if m["r"] == "user"), None)
    if leftover and user is not None:
        user["img"] = user.get("img", []) + leftover
    return out


def _verdict(value) -> bool | None:
    return value if isinstance(value, bool) else None


def rollout_episode(record: dict, data_root: Path | None, store: ImageStore, texts: Texts) -> dict:
    """One ``episodes.jsonl`` record as the page's episode."""
    row_images = record.get("images") if isinstance(record.get("images"), list) else []
    answer = record.get("final_answer")
    return {
        "id": str(record.get("id")),
        "arm": str(record.get("arm")),
        "q": str(record.get("source_id")),
        "sample": record.get("sample"),
        "task": str(record.get("EO_task") or "(none)"),
        "qtype": str(record.get("question_type") or ""),
        "stop": str(record.get("stop_reason")),
        "correct": _verdict(record.get("correct")),
        "rule": _verdict(record.get("rule_correct")),
        "judged": record.get("rule_correct") is not None and record.get("correct") is not record.get("rule_correct"),
        "answer": None if answer is None else str(answer),
        "gt": None if record.get("gt_answer") is None else str(record.get("gt_answer")),
        "meta": {
            k: record.get(k)
            for k in ("source", "turns", "tool_calls", "tool_errors", "new_tokens")
            if record.get(k) is not None
        },
        "codes": record.get("tool_error_codes") if isinstance(record.get("tool_error_codes"), dict) else {},
        "error": record.get("error"),
        "judge_error": record.get("judge_error"),
        "msgs": page_messages(record.get("messages"), row_images, data_root, store, texts),
        "gold": gold_view(record.get("gold_calls"), record.get("messages")),
    }


def gold_view(gold, messages) -> dict | None:
    """The episode's gold calls (its row's trace) beside the calls the tools ran, and how many leading calls
    match: by name (``tool_exact_match``), name and arguments (``param_prefix``), with a box within IoU 0.5
    (``param_prefix_aoi@0.5``). ``None`` without a well-formed gold list (a question-only row, an older run)."""
    if not isinstance(gold, list) or not all(
        isinstance(c, dict) and isinstance(c.get("arguments"), dict) for c in gold
    ):
        return None
    ran = executed_calls(messages)
    return {
        "gold": _flat_calls(gold),
        "ran": _flat_calls(ran),
        "names": common_prefix([c.get("name") for c in gold], [c["name"] for c in ran], lambda p, g: p == g),
        "exact": common_prefix(gold, ran, same_call),
        "aoi": common_prefix(gold, ran, same_call_aoi),
    }


def _flat_calls(calls) -> list[dict]:
    """Scoring's parsed calls (``{"name", "arguments"}``) as the page's."""
    return [{"n": str(c.get("name")),
             "a": json.dumps(c.get("arguments"), ensure_ascii=False)} for c in calls or [] if isinstance(c, dict)]


def evaluation_turn(record: dict, texts: Texts) -> dict:
    """One ``results.jsonl`` record (a reference turn and each arm's outputs for it) as the page's episode."""
    scores = record.get("scores") if isinstance(record.get("scores"), dict) else {}
    turn_correct = scores.get("turn_correct")
    reference = record.get("reference") if isinstance(record.get("reference"), dict) else {}
    ref_calls = _flat_calls(reference.get("calls"))
    msgs = [{"r": "reference", "t": texts.add(str(reference.get("content") or "")),
             **({"calls": ref_calls} if ref_calls else {})}]
    parsed = record.get("parsed") if isinstance(record.get("parsed"), list) else []
    for i, output in enumerate(record.get("outputs") or []):
        calls = parsed[i].get("calls") if i < len(parsed) and isinstance(parsed[i], dict) else None
        item = {"r": "assistant", "t": texts.add(str(output))}
        if calls:
            item["calls"] = _flat_calls(calls)
        msgs.append(item)
    final = next((p.get("final_answer") for p in parsed if isinstance(p, dict) and p.get("final_answer") is not None),
                 None)
    key = f"{record.get('trace_id')}:{record.get('turn')}"
    return {
        "id": f"{key}:{record.get('arm')}",
        "arm": str(record.get("arm")),
        "q": key,
        "task": str(record.get("EO_task") or "(none)"),
        "qtype": str(record.get("question_type") or ""),
        "stop": str(reference.get("action") or "turn"),
        "correct": None if turn_correct is None else turn_correct == 1,
        "answer": None if final is None else str(final),
        "gt": None if record.get("gt_answer") is None else str(record.get("gt_answer")),
        "meta": {"source": record.get("source"), "scores": {k: v for k, v in scores.items() if v is not None}},
        "codes": {},
        "error": None,
        "judge_error": "; ".join(e for e in record.get("judge_errors") or [] if e) or None,
        "msgs": msgs,
    }


def well_typed(record: dict) -> bool:
    """Whether an episode record has every field of :data:`EPISODE_TYPES`, of its type (counts never booleans)."""
    return all(
        k in record and isinstance(record[k], t) and not (t is int and isinstance(record[k], bool))
        for k, t in EPISODE_TYPES.items()
    ) and all(is_number(n) for n in record["tool_error_codes"].values())


def summarize_records(records: list[dict]) -> dict:
    """A summary for a rollout without ``summary.json`` (interrupted), from its episodes: Pass@1 and
    Pass@n for n the fewest samples any question has."""
    from .report import summarize_rollouts

    arms = list(dict.fromkeys(r["arm"] for r in records))
    per_question: dict = {}
    for r in records:
        per_question[(r["arm"], r["source_id"])] = per_question.get((r["arm"], r["source_id"]), 0) + 1
    ks = sorted({1, min(per_question.values())})
    return summarize_rollouts(records, arms, ks, {"ks": ks}, {}, {})
