"""The ``replay`` backend: a call that matches a call recorded in the row's own trace gets the recorded
result and its images.

The row is read by :func:`eogym_sft.data.traces.normalize_row` (every dialect data prep accepts), with the
same tool-image rule, so a replayed result attaches exactly the images prep attaches to that tool turn.
A call matches a recorded one with the same tool name and the same arguments, numbers within
``tolerance`` (absolute; AOIs are written with two decimals in EO-Gym); among several matches the
closest wins, the earliest on ties. A question-only row, or one prep would drop, records nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...data.tool_images import ToolImageRule
from ...data.traces import TraceError, normalize_row
from ..results import CannotAnswer


@dataclass
class Recorded:
    name: str
    arguments: dict
    text: str
    images: list[str]  # relative to the data root


def recorded_calls(row: dict, rule: ToolImageRule) -> list[Recorded]:
    """Each tool turn of ``row`` whose call is known, with its text and the images prep attaches to it."""
    try:
        trace = normalize_row(row, rule)
    except TraceError:
        return []
    out, results, k = [], iter(trace.tool_results), 0
    for msg in trace.messages:
        if not isinstance(msg["content"], list):
            continue
        n_images = sum(1 for p in msg["content"] if p["type"] == "image")
        if msg["role"] == "tool":
            call = next(results)
            if call["name"] and call["arguments"] is not None:
                text = "".join(p["text"] for p in msg["content"] if p["type"] == "text")
                out.append(Recorded(call["name"], call["arguments"], text, trace.images[k : k + n_images]))
        k += n_images
    return out


def distance(a, b) -> float:
    """Largest numeric difference between two argument values of the same shape; ``inf`` if they differ otherwise."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return math.inf
        return max((distance(a[k], b[k]) for k in a), default=0.0)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return math.inf
        return max((distance(x, y) for x, y in zip(a, b)), default=0.0)
    if any(isinstance(v, bool) for v in (a, b)):  # True == 1 in Python, not in a tool's arguments
        return 0.0 if a is b else math.inf
    if all(isinstance(v, (int, float)) for v in (a, b)):
        return abs(float(a) - float(b))
    return 0.0 if a == b else math.inf


class ReplayBackend:
    """Answers calls recorded in one row's trace."""

    name = "replay"

    def __init__(self, row: dict, rule: ToolImageRule, tolerance: float = 0.01):
        self.recorded = recorded_calls(row, rule)
        self.tolerance = tolerance

    def answer(self, tool: str, arguments: dict) -> tuple[str, list[str]]:
        best, best_d = None, math.inf
        for rec in self.recorded:
            if rec.name == tool:
                d = distance(arguments, rec.arguments)
                if d <= self.tolerance and d < best_d:
                    best, best_d = rec, d
        if best is None:
            raise CannotAnswer(f"the row's trace records no {tool} call with these arguments")
        return best.text, list(best.images)
