"""Tool calls and their arguments compared as the EO tool-agent benchmarks compare them, plus this library's
box-tolerant comparison. Pure, no model; ``docs/evaluation.md``, section 17, maps each rule to its source.

The benchmarks (ThinkGeo/GTA, Earth-Agent, OpenEarthAgent) compare arguments with Python ``==`` on the parsed
JSON: exact strings, ``5 == 5.0`` and ``True == 1`` true, no tolerance. ``@0.5`` is ours, never theirs: a box
argument (:data:`BOX_ARGUMENTS`) is accepted at IoU >= 0.5 with every other argument still exact.
"""

from __future__ import annotations

import math

from ..data.traces import TraceError, normalize_row

# Argument names whose value is a box [x0, y0, x1, y1] for the IoU rule: EO-Gym's crop takes ``aoi``.
BOX_ARGUMENTS = ("aoi", "bbox", "box")
AOI_IOU = 0.5  # the threshold OpenEarthAgent's answer judge applies to boxes, borrowed for arguments


def call_of(call: dict | None) -> dict | None:
    """``{"name", "arguments"}`` of a flat call or an OpenAI ``{"function": {...}}`` one; ``None`` stays."""
    if call is None:
        return None
    return (
        {"name": call["function"]["name"], "arguments": call["function"]["arguments"]} if "function" in call else call
    )


def names_of(calls: list[dict]) -> list[str]:
    return [c["name"] for c in calls]


def same_call(pred: dict | None, gold: dict) -> bool:
    """Name and arguments equal under Python ``==`` (the benchmarks' rule)."""
    return pred is not None and pred["name"] == gold["name"] and pred["arguments"] == gold["arguments"]


def _box(value) -> list[float] | None:
    """``value`` as four finite numbers with x0 <= x1 and y0 <= y1, else ``None``."""
    if not isinstance(value, list) or len(value) != 4:
        return None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value):
        return None
    x0, y0, x1, y1 = value
    return [float(v) for v in value] if x0 <= x1 and y0 <= y1 else None


def box_iou(a: list[float], b: list[float]) -> float:
    """Intersection over union of two ``[x0, y0, x1, y1]`` boxes; 0 when the union has no area.

    >>> round(box_iou([0, 0, 0.5, 0.5], [0, 0, 0.5, 0.51]), 4)
    0.9804
    """
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    inter = max(w, 0.0) * max(h, 0.0)
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def arguments_match_aoi(pred: dict, gold: dict, iou: float = AOI_IOU) -> bool:
    """Same keys; a box argument (named in :data:`BOX_ARGUMENTS`, both values boxes) matches at IoU >= ``iou``,
    every other argument by ``==``."""
    if not isinstance(pred, dict) or pred.keys() != gold.keys():
        return False
    for key, want in gold.items():
        got = pred[key]
        a, b = (_box(got), _box(want)) if key.lower() in BOX_ARGUMENTS else (None, None)
        if a is not None and b is not None:
            if box_iou(a, b) < iou:
                return False
        elif got != want:
            return False
    return True


def same_call_aoi(pred: dict | None, gold: dict, iou: float = AOI_IOU) -> bool:
    """:func:`same_call` with the box rule of :func:`arguments_match_aoi`."""
    return (
        pred is not None
        and pred["name"] == gold["name"]
        and arguments_match_aoi(pred["arguments"], gold["arguments"], iou)
    )


def best_box_iou(pred: dict | None, gold: dict) -> float | None:
    """The IoU of the first box argument both calls hold (same tool name), or ``None`` when the gold call has no
    box; 0 when the prediction is another tool or its box is missing or malformed."""
    key = next((k for k, v in gold["arguments"].items() if k.lower() in BOX_ARGUMENTS and _box(v) is not None), None)
    if key is None:
        return None
    if pred is None or pred["name"] != gold["name"] or not isinstance(pred["arguments"], dict):
        return 0.0
    got = _box(pred["arguments"].get(key))
    return box_iou(got, _box(gold["arguments"][key])) if got is not None else 0.0


def gold_calls(row: dict) -> list[dict] | None:
    """The calls of an EO-Gym row's own trace, in order, ``{"name", "arguments"}`` each; ``None`` for a
    question-only row or a trace data prep cannot read."""
    try:
        trace = normalize_row(row)
    except TraceError:
        return None
    return [call_of(c) for m in trace.messages if m["role"] == "assistant" for c in m.get("tool_calls", [])]


def crop_iou(gold: list[dict], pred: list[dict]) -> float | None:
    """How well the predicted calls' boxes cover the gold ones: per gold call with a box argument, the best IoU
    of a predicted call to the same tool (0 when none has a usable box), averaged; ``None`` without gold boxes."""
    boxed = [g for g in gold if best_box_iou(g, g) is not None]
    if not boxed:
        return None
    return sum(max((best_box_iou(p, g) for p in pred), default=0.0) for g in boxed) / len(boxed)
