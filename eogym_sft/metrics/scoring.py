"""Pure scoring for ``eogym-sft evaluate``: parse a generated message, score it against the reference
turn, aggregate, and compare arms pairwise. No model, no I/O; ``docs/evaluation.md`` defines every metric.
"""

from __future__ import annotations

import math
import re
import unicodedata
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from functools import lru_cache
from statistics import NormalDist

from ..data.traces import TOOL_CALL_RE, TraceError, parse_tool_call_text

END_MARKERS = ("<|im_end|>", "<|endoftext|>")
CI_METHOD = "paired t"  # named in every report beside the interval: delta +/- t(0.975, n - 1) * SE
# A difference of two means of values in [0, 1] (a proportion, Pass@k, a score) lies in [-1, 1]; where the t
# interval passes a bound it is cut there, and the record says so.
CI_CLIPPED = f"{CI_METHOD}, clipped to [-1, 1]"
FINAL_ANSWER_RE = re.compile(r"final\s+answer\s*(?:\*\*)?\s*:\s*(?:\*\*)?", re.IGNORECASE)
NUMBER_RE = re.compile(r"(?<![\w.])[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?![\d.]*\d)")
THOUSANDS_RE = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
NUMBER_UNIT_GAP_RE = re.compile(r"(\d)\s+(?=[^\W\d_]|%|°)")
# Blanked out: characters other than word characters, whitespace, % ° . and -; underscores; a "." that
# is not between digits; a "-" that is not a minus sign (not before a digit, or right after a word character).
PUNCT_RE = re.compile(r"[^\w\s%°.\-]|_|(?<!\d)\.|\.(?!\d)|-(?!\d)|(?<=\w)-")

# Per-output metrics; ``None`` = not applicable to this turn. POSITIVE metrics also get an ``@k``.
POSITIVE_METRICS = (
    "turn_correct",
    "action_match",
    "name_match",
    "call_match",
    "answer_exact",
    "answer_normalized",
    "answer_judge",
)
RATE_METRICS = (
    "invalid_call",
    "unknown_tool",
    "answered_instead_of_call",
    "called_instead_of_answer",
    "no_answer",
    "truncated",
)
METRICS = POSITIVE_METRICS + RATE_METRICS


@dataclass
class ParsedOutput:
    """A generated assistant message split by the data-prep dialect rules.

    ``calls`` has one entry per ``<tool_call>`` block in order (plus one for an unclosed block):
    ``{"name", "arguments"}`` when the block parses, ``None`` when it does not.
    """

    content: str
    calls: list[dict | None] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    final_answer: str | None = None

    @property
    def has_call(self) -> bool:
        return bool(self.calls)

    def to_json(self) -> dict:
        return {"content": self.content, "calls": self.calls, "errors": self.errors, "final_answer": self.final_answer}


def strip_end_markers(text: str) -> str:
    """Drop trailing ``<|im_end|>`` / ``<|endoftext|>`` markers (and the whitespace around them)."""
    text = text.rstrip()
    while text.endswith(END_MARKERS):
        text = text[: -len(next(m for m in END_MARKERS if text.endswith(m)))].rstrip()
    return text


def _flat_call(call: dict) -> dict:
    return {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}


def parse_output(text: str) -> ParsedOutput:
    """Parse one generated message with :func:`eogym_sft.data.traces.parse_tool_call_text`.

    Each ``<tool_call>`` block is parsed on its own, so one bad block does not hide the others.

    Examples:

    >>> parse_output('<tool_call>{"name": "crop", "arguments": {"x": 1}}</tool_call><|im_end|>').calls
    [{'name': 'crop', 'arguments': {'x': 1}}]
    >>> parse_output("Final Answer: 5").final_answer
    '5'
    """
    text = strip_end_markers(text)
    calls, errors = [], []
    for k, match in enumerate(TOOL_CALL_RE.finditer(text)):
        try:
            calls.extend(_flat_call(c) for c in parse_tool_call_text(match.group(0), f"<tool_call {k}>")[1])
        except TraceError as err:
            calls.append(None)
            errors.append(str(err))
    content = TOOL_CALL_RE.sub("\n", text)
    if "<tool_call>" in content:
        calls.append(None)
        errors.append("invalid_tool_call: unclosed <tool_call> block")
        content = content[: content.index("<tool_call>")]
    content = content.strip()
    return ParsedOutput(content, calls, errors, extract_final_answer(content))


def extract_final_answer(text: str) -> str | None:
    """The answer after the last ``Final Answer:`` marker: the first non-empty line after it, stripped.

    The marker is matched case-insensitively and may be wrapped in ``**``. ``None`` when there is no
    marker or nothing follows it.
    """
    text = strip_end_markers(text)
    matches = list(FINAL_ANSWER_RE.finditer(text))
    if not matches:
        return None
    answer = text[matches[-1].end() :].strip().split("\n", 1)[0].strip()
    return answer or None


def _canonical_number(match: re.Match) -> str:
    try:
        value = Decimal(match.group(0))
    except InvalidOperation:
        return match.group(0)
    text = format(value.normalize(), "f")
    return "0" if text in ("-0", "+0") else text


def normalize_answer(text: str) -> str:
    """Answer text for the normalised comparison.

    Steps, in order: Unicode NFKC; lower case; thousands separators dropped (``1,000`` -> ``1000``);
    every number written canonically (``5.0`` and ``+5`` -> ``5``, ``0.50`` -> ``0.5``); punctuation
    becomes a space, except a decimal point between digits, a minus sign before a digit, ``%`` and ``°``;
    the space between a number and the unit after it is removed (``5 m`` -> ``5m``); whitespace collapsed.
    Number words stay words: ``five`` does not equal ``5``.

    Examples:

    >>> normalize_answer("  The Airport, 5.0 M. ")
    'the airport 5m'
    """
    text = unicodedata.normalize("NFKC", text).lower()
    text = THOUSANDS_RE.sub("", text)
    text = NUMBER_RE.sub(_canonical_number, text)
    text = PUNCT_RE.sub(" ", text)
    text = NUMBER_UNIT_GAP_RE.sub(r"\1", " ".join(text.split()))
    return " ".join(text.split())


def values_match(pred, ref, tol: float) -> bool:
    """JSON values equal under the argument rules.

    Dicts: same keys (order irrelevant), values matching. Lists: same length, matching in order.
    Numbers (int or float, not bool): ``|pred - ref| <= tol * max(1, |pred|, |ref|)``. Strings: equal
    after ``strip()``. Anything else (bool, null): equal with the same type.
    """
    if isinstance(pred, bool) or isinstance(ref, bool):
        return type(pred) is type(ref) and pred == ref
    if isinstance(pred, (int, float)) and isinstance(ref, (int, float)):
        return abs(pred - ref) <= tol * max(1.0, abs(pred), abs(ref))
    if isinstance(pred, str) and isinstance(ref, str):
        return pred.strip() == ref.strip()
    if isinstance(pred, dict) and isinstance(ref, dict):
        return pred.keys() == ref.keys() and all(values_match(pred[k], ref[k], tol) for k in ref)
    if isinstance(pred, list) and isinstance(ref, list):
        return len(pred) == len(ref) and all(values_match(p, r, tol) for p, r in zip(pred, ref))
    return type(pred) is type(ref) and pred == ref


@dataclass
class Reference:
    """What a scored turn is compared against."""

    calls: list[dict]  # [{"name", "arguments"}], in order
    content: str
    tool_names: list[str]
    is_final: bool = False  # the trace's last assistant turn, and it holds ``Final Answer:``
    gt_answer: str = ""
    is_last: bool = False  # the trace's last assistant turn, whatever it holds

    @property
    def scores_answer(self) -> bool:
        """Final-answer metrics apply: the final turn, without calls, with a non-empty ``gt_answer``."""
        return self.is_final and not self.calls and bool(self.gt_answer.strip())

    @property
    def action(self) -> str:
        """``call``, ``answer`` (a ``Final Answer:`` line) or ``message`` (text only)."""
        if self.calls:
            return "call"
        return "answer" if extract_final_answer(self.content) is not None else "message"

    def to_json(self) -> dict:
        return {"action": self.action, "content": self.content, "calls": self.calls, "is_final": self.is_final}


def score_output(
    parsed: ParsedOutput, ref: Reference, tol: float, truncated: bool = False, judged: bool | None = None
) -> dict:
    """Score one parsed output against its reference turn; ``None`` marks a metric that does not apply.

    Args:
        parsed (`ParsedOutput`): the model's message.
        ref (`Reference`): the reference turn.
        tol (`float`): numeric tolerance for arguments (see :func:`values_match`).
        truncated (`bool`, *optional*, defaults to `False`): generation hit ``max_new_tokens``.
        judged (`bool`, *optional*): the external judge's verdict on a final turn, if a judge ran.

    Returns:
        `dict`: metric name -> `bool` or `None`, for every name in ``METRICS``.
    """
    calls_ref = bool(ref.calls)
    names = [c["name"] if c else None for c in parsed.calls]
    name_match = names == [c["name"] for c in ref.calls] if calls_ref else None
    call_match = (
        name_match and all(values_match(p["arguments"], r["arguments"], tol) for p, r in zip(parsed.calls, ref.calls))
        if calls_ref
        else None
    )
    final = ref.scores_answer
    answer = parsed.final_answer
    exact = (answer is not None and answer.strip() == ref.gt_answer.strip()) if final else None
    normalized = (
        (answer is not None and normalize_answer(answer) == normalize_answer(ref.gt_answer)) if final else None
    )
    action_match = parsed.has_call == calls_ref
    return {
        "turn_correct": call_match if calls_ref else (normalized if final else action_match),
        "action_match": action_match,
        "name_match": name_match,
        "call_match": call_match,
        "answer_exact": exact,
        "answer_normalized": normalized,
        "answer_judge": bool(judged) if final and judged is not None else None,
        "invalid_call": None in parsed.calls,
        "unknown_tool": any(n is not None and n not in ref.tool_names for n in names),
        "answered_instead_of_call": (not parsed.has_call) if calls_ref else None,
        "called_instead_of_answer": parsed.has_call if not calls_ref else None,
        "no_answer": (answer is None) if final else None,
        "truncated": truncated,
    }


def combine_samples(sample_scores: list[dict], k: int) -> dict:
    """One turn's scores from its ``k`` outputs: the mean over outputs for every metric, and for
    positive metrics ``name@k`` = 1 if any output scores (pass@k). ``None`` where the metric does not apply."""
    out = {}
    for name in METRICS:
        values = [s[name] for s in sample_scores if s[name] is not None]
        out[name] = sum(values) / len(values) if values else None
        if k > 1 and name in POSITIVE_METRICS:
            out[f"{name}@{k}"] = float(any(values)) if values else None
    return out


def mean_scores(score_dicts: list[dict]) -> dict:
    """``{metric: {"mean", "n"}}`` over turns, skipping ``None`` (not applicable) values.

    Also ``args_match_given_name``: call matches among turns whose tool names match.
    """
    names = list(dict.fromkeys(name for s in score_dicts for name in s))
    out = {}
    for name in names:
        values = [s[name] for s in score_dicts if s.get(name) is not None]
        if values:
            out[name] = {"mean": sum(values) / len(values), "n": len(values)}
    hits = [(s["call_match"], s["name_match"]) for s in score_dicts if s.get("name_match") is not None]
    named = sum(n for _, n in hits)
    if named:
        out["args_match_given_name"] = {"mean": sum(c for c, _ in hits) / named, "n": len(hits)}
    return out


def t_two_sided_mass(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with ``df`` (integer) degrees of freedom, in closed form
    (Abramowitz & Stegun 26.7.3-4): with theta = atan(t / sqrt(df)), a finite sum in cos(theta)**2."""
    theta = math.atan(t / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    if df % 2:  # odd: 2/pi * (theta + sin cos (1 + 2/3 c2 + 2*4/(3*5) c2**2 + ... up to c2**((df-3)/2)))
        term, total = 1.0, 1.0 if df > 1 else 0.0
        for k in range(1, (df - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
        return 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * total)
    term = total = 1.0  # even: sin (1 + 1/2 c2 + 1*3/(2*4) c2**2 + ... up to c2**((df-2)/2))
    for k in range(1, df // 2):
        term *= c2 * (2 * k - 1) / (2 * k)
        total += term
    return math.sin(theta) * total


LARGE_DF = 10_000


@lru_cache(maxsize=256)
def t_quantile_975(df: int) -> float:
    """The 97.5% quantile of Student's t with ``df`` degrees of freedom (12.706 at 1, 4.303 at 2, 1.960 in
    the limit): bisection of :func:`t_two_sided_mass` to 1e-12, so no scipy is needed."""
    if df < 1:
        raise ValueError(f"Student's t needs at least one degree of freedom, got {df}")
    if df > LARGE_DF:  # Fisher's expansion in 1/df: within 1e-12 here, where the sum would take df/2 terms per step
        z = NormalDist().inv_cdf(0.975)
        return (
            z
            + (z**3 + z) / (4 * df)
            + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
        )
    lo, hi = 0.0, 20.0
    while t_two_sided_mass(hi, df) < 0.95:  # df = 1 needs 12.7; the loop only guards the bracket
        hi *= 2
    while hi - lo > 1e-12:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_two_sided_mass(mid, df) < 0.95 else (lo, mid)
    return (lo + hi) / 2


def paired_stats(a: list[float], b: list[float], clusters: list | None = None) -> dict:
    """Paired comparison of arm B against arm A on the same units (``delta = b - a`` per unit).

    Args:
        a (`list[float]`): arm A's score per unit.
        b (`list[float]`): arm B's score per unit, same order.
        clusters (`list`, *optional*): a group key per unit (the trace id) for the trace-clustered SE.

    Returns:
        `dict`: ``n``, ``mean_a``, ``mean_b``, ``delta`` (mean of the differences), ``se`` (sample
        standard deviation of the differences / sqrt(n)), ``ci95`` (delta ± t SE, t the 97.5% quantile of
        Student's t with n - 1 degrees of freedom: it holds at small n, where the normal's 1.96 is too
        narrow, e.g. 4.30 at n = 3; for values all in [0, 1] cut at -1 and 1) and ``ci_method`` (:data:`CI_METHOD`,
        or :data:`CI_CLIPPED` where the cut changed the interval),
        ``wins``/``losses``/``ties`` (units where B scores higher/lower/equal), and with clusters
        ``n_clusters`` and ``se_clustered`` (the cluster-robust SE of the same mean, CR1 correction).
        SEs are ``None`` when there are fewer than two units (or clusters).
    """
    if len(a) != len(b) or not a:
        raise ValueError(f"paired_stats needs two equal, non-empty lists, got {len(a)} and {len(b)}")
    n = len(a)
    diffs = [y - x for x, y in zip(a, b)]
    delta = sum(diffs) / n
    se = math.sqrt(sum((d - delta) ** 2 for d in diffs) / (n - 1) / n) if n > 1 else None
    ci = [delta - t_quantile_975(n - 1) * se, delta + t_quantile_975(n - 1) * se] if se is not None else None
    method = CI_METHOD
    if ci is not None and (ci[0] < -1 or ci[1] > 1) and all(0 <= v <= 1 for v in a + b):
        ci, method = [max(ci[0], -1.0), min(ci[1], 1.0)], CI_CLIPPED
    out = {
        "n": n,
        "mean_a": sum(a) / n,
        "mean_b": sum(b) / n,
        "delta": delta,
        "se": se,
        "ci95": ci,
        "ci_method": method,
        "wins": sum(d > 1e-12 for d in diffs),
        "losses": sum(d < -1e-12 for d in diffs),
        "ties": sum(abs(d) <= 1e-12 for d in diffs),
    }
    if clusters is not None:
        sums: dict = {}
        for key, d in zip(clusters, diffs):
            sums[key] = sums.get(key, 0.0) + (d - delta)
        g = len(sums)
        out["n_clusters"] = g
        out["se_clustered"] = math.sqrt(g / (g - 1) * sum(s * s for s in sums.values())) / n if g > 1 else None
    return out
