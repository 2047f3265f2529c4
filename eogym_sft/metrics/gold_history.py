"""Gold-history (teacher-forced) tool metrics of ThinkGeo/GTA and OpenEarthAgent, micro over calls.

Each reference assistant turn is one or more **steps**: a turn with ``n`` calls is ``n`` consecutive call steps
(the model's ``j``-th call is compared with the reference's ``j``-th), a turn without calls one answer step.
Every metric is ``hits / steps`` summed over all turns (micro), each with its benchmark's denominator:

* ``inst_acc`` (GTA/ThinkGeo InstAcc, ``GTABenchEvaluator.score``): steps whose type (call or answer) is the
  reference's and whose call has no error (a block that does not parse, or a tool the row does not offer),
  over call steps plus samples with a reference answer. As in GTA, the answer step of a sample without a
  reference counts above the line and not below it.
* ``inst_acc_oea`` (OpenEarthAgent ``inst_acc``, ``rsagent/task.py``): call steps the model answers with a
  parseable call, over call steps.
* ``tool_acc`` (all three): the call names the reference tool (an erroring call still counts), over call steps.
* ``arg_keys_acc`` (OpenEarthAgent ``arg_acc1``): ``tool_acc`` and the same argument keys, over call steps.
* ``arg_acc`` (GTA/ThinkGeo ArgAcc, OpenEarthAgent ``arg_acc2``): ``tool_acc`` and arguments ``==``, over call steps.
* ``arg_acc_aoi@0.5`` (**this library's**, no benchmark's): ``arg_acc`` with a box argument accepted at IoU >= 0.5.
* ``summ_acc`` (GTA/ThinkGeo SummAcc): on answer steps answered with an answer, the answer score, over samples
  with a reference answer. A GTA whitelist reference (``{"whitelist": [[aliases]], "blacklist": ...}``, as JSON)
  is scored by GTA's ``iscorrect`` on the message; any other reference by the normalised ``Final Answer:``
  match of :mod:`eogym_sft.metrics.scoring`.
"""

from __future__ import annotations

import re

from ..safe_json import UntrustedJSONError, loads
from .scoring import ParsedOutput, Reference, normalize_answer
from .tool_args import same_call, same_call_aoi

GOLD_HISTORY_METRICS = ("inst_acc", "inst_acc_oea", "tool_acc", "arg_keys_acc", "arg_acc", "arg_acc_aoi@0.5",
                        "summ_acc")


def gta_iscorrect(text: str, reference: dict) -> bool:
    """GTA's ``iscorrect``: every whitelist entry (a list of aliases) found as a whole word, case-insensitive,
    anywhere in ``text``, and no blacklist alias found.

    >>> gta_iscorrect("There are 5 cars.", {"whitelist": [["5", "five"]], "blacklist": None})
    True
    >>> gta_iscorrect("15 cars", {"whitelist": [["5", "five"]], "blacklist": None})
    False
    """

    def found(aliases) -> bool:
        return re.search(r"\b(?:" + "|".join(re.escape(str(a)) for a in aliases) + r")\b", text,
                         re.IGNORECASE) is not None

    if not all(found(aliases) for aliases in reference.get("whitelist") or []):
        return False
    blacklist = [a for aliases in reference.get("blacklist") or [] for a in aliases]
    return not (blacklist and found(blacklist))


def whitelist_reference(gt_answer: str) -> dict | None:
    """``gt_answer`` as a GTA whitelist reference when it is one written as JSON, else ``None``."""
    if not gt_answer.lstrip().startswith("{"):
        return None
    try:
        value = loads(gt_answer)
    except UntrustedJSONError:
        return None
    return value if isinstance(value, dict) and isinstance(value.get("whitelist"), list) else None


def answer_score(parsed: ParsedOutput, gt_answer: str) -> float:
    """``summ_acc``'s score of one answer: GTA's whitelist rule, or the normalised final-answer match."""
    whitelist = whitelist_reference(gt_answer)
    if whitelist is not None:
        return float(gta_iscorrect(parsed.content, whitelist))
    answer = parsed.final_answer
    return float(answer is not None and normalize_answer(answer) == normalize_answer(gt_answer))


def _call_steps(parsed: ParsedOutput, ref: Reference) -> dict[str, float]:
    hits = dict.fromkeys(("inst_acc", "inst_acc_oea", "tool_acc", "arg_keys_acc", "arg_acc", "arg_acc_aoi@0.5"), 0.0)
    for j, gold in enumerate(ref.calls):
        pred = parsed.calls[j] if j < len(parsed.calls) else None
        if pred is None:  # no j-th call, or a block that does not parse
            continue
        hits["inst_acc_oea"] += 1
        hits["inst_acc"] += pred["name"] in ref.tool_names
        if pred["name"] != gold["name"]:
            continue
        hits["tool_acc"] += 1
        hits["arg_keys_acc"] += (
            isinstance(pred["arguments"], dict) and pred["arguments"].keys() == gold["arguments"].keys()
        )
        hits["arg_acc"] += same_call(pred, gold)
        hits["arg_acc_aoi@0.5"] += same_call_aoi(pred, gold)
    return hits


def step_counts(parsed: ParsedOutput, ref: Reference) -> dict[str, list[float]]:
    """``{metric: [hits, steps]}`` of one model message against its reference turn (module docstring)."""
    n = len(ref.calls)
    with_reference = ref.is_last and bool(ref.gt_answer.strip())
    if n:
        hits = _call_steps(parsed, ref) if parsed.has_call else dict.fromkeys(GOLD_HISTORY_METRICS, 0.0)
        hits["summ_acc"] = 0.0
    else:
        answered = not parsed.has_call
        hits = dict.fromkeys(GOLD_HISTORY_METRICS, 0.0)
        hits["inst_acc"] = float(answered)
        hits["summ_acc"] = answer_score(parsed, ref.gt_answer) if answered and ref.gt_answer.strip() else 0.0
    steps = {m: n for m in GOLD_HISTORY_METRICS}
    steps["inst_acc"] = n + with_reference
    steps["summ_acc"] = int(with_reference)
    return {m: [hits[m], steps[m]] for m in GOLD_HISTORY_METRICS}


def combine_step_counts(per_output: list[dict]) -> dict[str, list[float]]:
    """One turn's counts from its outputs: the mean of the hits (the steps are the reference's, equal in all)."""
    return {m: [sum(c[m][0] for c in per_output) / len(per_output), per_output[0][m][1]] for m in GOLD_HISTORY_METRICS}


def micro(counts: list[dict]) -> dict:
    """``{metric: {"mean": sum(hits) / sum(steps), "n": sum(steps)}}`` over turns; a metric without steps is left
    out."""
    out = {}
    for m in GOLD_HISTORY_METRICS:
        steps = sum(c[m][1] for c in counts)
        if steps:
            out[m] = {"mean": sum(c[m][0] for c in counts) / steps, "n": steps}
    return out


def paired_units(counts_a: dict, counts_b: dict, metric: str) -> tuple[list, list[float], list[float]] | None:
    """Per-unit values whose plain mean is each arm's micro ratio, for :func:`~eogym_sft.metrics.scoring.paired_stats`.

    ``counts_a``/``counts_b`` map a unit (a turn) to its ``{metric: [hits, steps]}``. On the units both hold
    that count for ``metric`` (steps or hits in either arm), with ``D`` their steps (the reference's, equal in
    both arms) and ``n`` their number, unit ``u`` gets ``hits_u * n / D``: the mean is ``sum(hits) / D``, the
    delta the micro delta, and the SE that of a sum over units with a fixed denominator. ``None`` when ``D`` is 0.
    """
    keys = [
        k
        for k in sorted(counts_a.keys() & counts_b.keys())
        if counts_a[k][metric][1] or counts_a[k][metric][0] or counts_b[k][metric][0]
    ]
    total = sum(counts_a[k][metric][1] for k in keys)
    if not total:
        return None
    scale = len(keys) / total
    return keys, [counts_a[k][metric][0] * scale for k in keys], [counts_b[k][metric][0] * scale for k in keys]
