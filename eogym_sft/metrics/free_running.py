"""Free-running (closed-loop) tool metrics of Earth-Agent and OpenEarthAgent, per episode, and the per-category
F1 of OpenEarthAgent and GTA/ThinkGeo pooled over a set of episodes.

``gold`` is the reference call list of the question's own trace; ``executed`` the calls the model made that the
environment ran (Earth-Agent keeps only calls that received a tool output), both ``[{"name", "arguments"}]`` in
order. Per episode (Earth-Agent ``evaluate/step_by_step.py``, ``evaluate/end_to_end.py``):

* ``tool_any_order``: ``|set(G) & set(P)| / |set(G)|`` (``contains_all_tool_calls_any_order``);
* ``tool_in_order``: one pass over P, each gold name in turn searched for further on; the matches before the
  first gold name not found, over ``|G|`` (``contains_all_tool_calls_in_order``);
* ``tool_exact_match``: the common prefix of the name lists over ``|G|`` (``trajectory_step_wise_score``);
* ``param_prefix``: the common prefix where name and arguments are ``==``, over ``|G|`` (``check_parameter_accuracy``);
* ``param_prefix_aoi@0.5`` (**this library's**, no benchmark's): ``param_prefix`` with a box argument accepted
  at IoU >= 0.5 (:mod:`eogym_sft.metrics.tool_args`);
* ``efficiency``: ``|P| / |G|`` (``calculate_efficiency_with_tool_calls``).

An empty gold list scores 1 on all but ``tool_exact_match`` (0), and ``efficiency`` is 1 without calls and
infinite with some: the benchmark's mean of ratios would be infinite, so an infinite ratio is counted apart and
left out of the mean. OpenEarthAgent's three booleans (``rsagent/task.py`` ``compare_tool_sequences``):
``all_tools_called_any_order`` (every gold name called at least as often), ``all_tools_called_same_order``
(that, and G a subsequence of P) and ``all_tools_called_unique`` (every gold name called).
"""

from __future__ import annotations

import math
import re
from collections import Counter

from .tool_args import names_of, same_call, same_call_aoi

FREE_RUNNING_METRICS = (
    "tool_any_order",
    "tool_in_order",
    "tool_exact_match",
    "param_prefix",
    "param_prefix_aoi@0.5",
    "efficiency",
    "all_tools_called_any_order",
    "all_tools_called_same_order",
    "all_tools_called_unique",
)
# Tool categories of the per-category F1. The benchmarks' tools as OpenEarthAgent's ``gettype`` files them
# (GTA files CountGivenObject and MathOCR under logic); EO-Gym's are this library's filing. A tool in none is "other".
TOOL_CATEGORIES = {
    **dict.fromkeys(
        ("OCR", "ImageDescription", "RegionAttributeDescription", "TextToBbox", "ChangeDetection", "ObjectDetection",
         "SegmentObjectPixels", "CountGivenObject", "get_object_bbox_by_optical_image", "get_water_mask"),
        "perception",
    ),
    **dict.fromkeys(("DrawBox", "AddText", "GoogleSearch", "crop_optical_or_sar_image"), "operation"),
    **dict.fromkeys(("Calculator", "Solver", "Plot"), "logic"),
    **dict.fromkeys(
        ("GetAreaBoundary", "AddPoisLayer", "ComputeDistance", "DisplayOnMap", "AddIndexLayer", "ComputeIndexChange",
         "ShowIndexLayer", "GetBboxFromGeotiff", "DisplayOnGeotiff", "get_optical_image_list", "get_sar_image",
         "get_multispectral_list", "get_image_metadata", "compute_index"),
        "gis",
    ),
}
F1_EPS = 1e-5  # both benchmarks add it to their denominators; kept so that their figures come out to the digit


def tool_any_order(gold: list[str], pred: list[str]) -> float:
    return len(set(gold) & set(pred)) / len(set(gold)) if gold else 1.0


def tool_in_order(gold: list[str], pred: list[str]) -> float:
    if not gold:
        return 1.0
    rest, found = iter(pred), 0
    for name in gold:
        if not any(p == name for p in rest):  # consumes P up to the match, or to its end
            break
        found += 1
    return found / len(gold)


def common_prefix(gold: list, pred: list, same) -> int:
    """How many leading calls of ``pred`` match ``gold`` position by position under ``same(pred, gold)``."""
    n = 0
    while n < min(len(gold), len(pred)) and same(pred[n], gold[n]):
        n += 1
    return n


def tool_exact_match(gold: list[str], pred: list[str]) -> float:
    return common_prefix(gold, pred, str.__eq__) / len(gold) if gold else 0.0


def param_prefix(gold: list[dict], pred: list[dict], same=same_call) -> float:
    return common_prefix(gold, pred, same) / len(gold) if gold else 1.0


def efficiency(gold: list, pred: list) -> float:
    if not gold:
        return 1.0 if not pred else math.inf
    return len(pred) / len(gold)


def oea_booleans(gold: list[str], pred: list[str]) -> dict[str, bool]:
    """OpenEarthAgent's ``compare_tool_sequences``."""
    have = Counter(pred)
    any_order = all(have[name] >= n for name, n in Counter(gold).items())
    i = 0
    for name in pred:
        if i < len(gold) and name == gold[i]:
            i += 1
    return {
        "all_tools_called_any_order": any_order,
        "all_tools_called_same_order": any_order and i == len(gold),
        "all_tools_called_unique": set(gold) <= set(pred),
    }


def category_counts(gold: list[str], pred: list[str]) -> dict[str, list[int]]:
    """Per category ``[gold calls, predicted calls, matched (OpenEarthAgent), matched (GTA)]``. OpenEarthAgent
    matches a gold name to a predicted call it then removes (a multiset); GTA counts a gold name present anywhere
    in P, so repeated gold calls can match one predicted call, and its precision can pass 1."""
    out: dict[str, list[int]] = {}

    def row(name: str) -> list[int]:
        return out.setdefault(TOOL_CATEGORIES.get(name, "other"), [0, 0, 0, 0])

    left = list(pred)
    for name in pred:
        row(name)[1] += 1
    for name in gold:
        counts = row(name)
        counts[0] += 1
        counts[3] += name in pred
        if name in left:
            left.remove(name)
            counts[2] += 1
    return out


def category_f1(counts: list[int], gta: bool = False) -> float | None:
    """F1 from pooled ``[gold, pred, matched_oea, matched_gta]``: OpenEarthAgent's ``P = m / (pred + eps)``,
    ``R = m / (gold + eps)``; GTA's (``gta``) the same with ``R = m / gold`` (``None`` without gold calls);
    ``F1 = 2PR / (P + R + eps)``. A fraction; the benchmarks print it times 100."""
    gold, pred, matched = counts[0], counts[1], counts[3 if gta else 2]
    if gta and not gold:
        return None
    precision = matched / (pred + F1_EPS)
    recall = matched / gold if gta else matched / (gold + F1_EPS)
    return 2 * precision * recall / (precision + recall + F1_EPS)


def pooled(per_unit: list[dict[str, list[int]]]) -> dict[str, list[int]]:
    """Category counts summed over units."""
    out: dict[str, list[int]] = {}
    for counts in per_unit:
        for cat, row in counts.items():
            total = out.setdefault(cat, [0, 0, 0, 0])
            for i, v in enumerate(row):
                total[i] += v
    return dict(sorted(out.items()))


def f1_pseudo_values(per_unit: list[dict[str, list[int]]], cat: str, gta: bool = False) -> list[float] | None:
    """Jackknife pseudo-values ``n F1 - (n - 1) F1_without_unit`` of one category's pooled F1: their mean is the
    jackknife estimate and their spread gives its SE, so that :func:`~eogym_sft.metrics.scoring.paired_stats`
    compares arms' F1 on the same units. ``None`` when the F1 or a leave-one-out F1 is undefined."""
    total = pooled(per_unit).get(cat)
    whole = category_f1(total, gta) if total else None
    if whole is None or len(per_unit) < 2:
        return None
    out = []
    n = len(per_unit)
    for counts in per_unit:
        own = counts.get(cat, [0, 0, 0, 0])
        rest = category_f1([t - o for t, o in zip(total, own)], gta)
        if rest is None:
            return None
        out.append(n * whole - (n - 1) * rest)
    return out


def episode_scores(gold: list[dict], executed: list[dict]) -> dict:
    """Every per-episode metric of the module docstring, and the episode's :func:`category_counts`."""
    g, p = names_of(gold), names_of(executed)
    return {
        "tool_any_order": tool_any_order(g, p),
        "tool_in_order": tool_in_order(g, p),
        "tool_exact_match": tool_exact_match(g, p),
        "param_prefix": param_prefix(gold, executed),
        "param_prefix_aoi@0.5": param_prefix(gold, executed, same_call_aoi),
        "efficiency": efficiency(gold, executed),
        **oea_booleans(g, p),
        "categories": category_counts(g, p),
    }


EARTH_AGENT_ANSWER_RE = re.compile(r"<Answer>\s*([A-Fa-f])\s*</?Answer>")
LETTER_RE = re.compile(r"\b[A-F]\b")


def earth_agent_answer(text: str) -> str:
    """Earth-Agent's ``extract_answer_from_text``: ``FAIL`` when the text contains ``FAIL``; else the letter of
    ``<Answer>X<Answer>`` (or ``</Answer>``), upper-cased; else the last standalone capital A-F; else ``UNKNOWN``.
    Its accuracy is this string equal to the gold answer, so a gold answer that is no letter never matches.

    >>> earth_agent_answer("<Answer>b<Answer>"), earth_agent_answer("The answer is C. A larger area")
    ('B', 'A')
    """
    if "FAIL" in text:
        return "FAIL"
    tagged = EARTH_AGENT_ANSWER_RE.search(text)
    if tagged:
        return tagged.group(1).upper()
    letters = LETTER_RE.findall(text)
    return letters[-1] if letters else "UNKNOWN"
