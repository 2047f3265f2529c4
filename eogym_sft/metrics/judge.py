"""Judges of a final answer against ``gt_answer``: a Python function, or an OpenAI-compatible
chat-completions endpoint (the paper's setting is GPT-4.1-mini).

A judge is ``judge(question, prediction, reference) -> bool``. :func:`judge_all` runs one over many
answers and keeps failures apart: a request that still fails after its retries gives ``None`` and an
error, never a silent "wrong".
"""

from __future__ import annotations

import importlib
import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..net import short

JUDGE_SYSTEM_PROMPT = (
    "You grade answers to Earth-observation questions. Given the question, the reference answer and a "
    "candidate answer, decide whether the candidate means the same as the reference: numbers must agree "
    "(units may differ if the values are equal), names and categories must refer to the same thing, and "
    "extra explanation is fine if the answer itself is right. Reply with exactly one word: CORRECT or INCORRECT."
)
JUDGE_USER_TEMPLATE = "Question:\n{question}\n\nReference answer:\n{reference}\n\nCandidate answer:\n{prediction}"


DEFAULT_JUDGE_MODEL = "gpt-4.1-mini"  # the paper's judge


def _positive_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


class JudgeError(RuntimeError):
    """A judge request that failed (HTTP error, timeout, a reply that is neither CORRECT nor INCORRECT)."""


def load_judge(spec: str):
    """``module:function`` -> the callable ``judge(question, prediction, reference) -> bool``."""
    module, sep, name = spec.partition(":")
    if not sep:
        raise ValueError(f"--judge must be module:function, got {spec!r}")
    judge = getattr(importlib.import_module(module), name)
    if not callable(judge):
        raise TypeError(f"--judge {spec} is not callable")
    return judge


@dataclass
class ChatJudge:
    """An OpenAI-compatible ``/chat/completions`` judge, over :func:`eogym_sft.net.post_json` (http(s) only,
    no redirects: the API key never goes to another origin; one deadline per answer judged; a reply cap).

    Args:
        url (`str`): the endpoint, e.g. ``https://api.openai.com/v1/chat/completions``.
        model (`str`): e.g. ``gpt-4.1-mini``.
        api_key_env (`str`): the environment variable holding the bearer token (none sent when unset).
        timeout (`float`): seconds for judging one answer, retries and pauses included.
        retries (`int`): further attempts after a failed request (connection, 429, 5xx), with exponential
            back-off from ``backoff`` s, within ``timeout``. A reply that is neither CORRECT nor INCORRECT is
            not retried (at temperature 0 it would come again).
        max_bytes (`int`): the longest reply read.
    """

    url: str
    model: str
    api_key_env: str = "OPENAI_API_KEY"
    timeout: float = 60.0
    retries: int = 3
    backoff: float = 1.0
    max_bytes: int = 1 << 20

    def __post_init__(self):
        from ..net import check_url

        check_url(self.url)
        # each of these would fail every request of a long run; refused here, before anything is written
        if not _positive_number(self.timeout):
            raise ValueError(f"the judge's timeout must be a positive number of seconds, got {self.timeout!r}")
        if not (_positive_number(self.backoff) or self.backoff == 0):
            raise ValueError(f"the judge's backoff must be zero or a positive number of seconds, got {self.backoff!r}")
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise ValueError(f"the judge's retries must be a whole number >= 0, got {self.retries!r}")
        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int) or self.max_bytes < 1:
            raise ValueError(f"the judge's max_bytes must be a whole number >= 1, got {self.max_bytes!r}")

    def __call__(self, question: str, prediction: str, reference: str) -> bool:
        from .. import net

        body = {
            "model": self.model,
            "temperature": 0,
            "messages": [
                {"role": "system", "content": JUDGE_SYSTEM_PROMPT},
                {"role": "user",
                 "content": JUDGE_USER_TEMPLATE.format(question=question, reference=reference, prediction=prediction)},
            ],
        }
        key = os.environ.get(self.api_key_env)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            payload = net.post_json(self.url, body, headers, self.timeout, self.max_bytes, self.retries, self.backoff)
            reply = payload["choices"][0]["message"]["content"]
        except net.NetError as err:
            raise JudgeError(f"{type(err).__name__}: {err}") from None
        except (KeyError, IndexError, TypeError) as err:
            raise JudgeError(f"the reply has no choices[0].message.content ({type(err).__name__})") from None
        if not isinstance(reply, str):
            raise JudgeError(f"the reply's content is {type(reply).__name__}, not text")
        return parse_verdict(reply)


THINK_RE = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
# The two verdict words as the prompt asks for them, in capitals, with a negation just before ("NOT CORRECT").
VERDICT_RE = re.compile(r"(?:\b(not|never|isn't|is\s+not)\s+)?\b(INCORRECT|CORRECT)\b", re.IGNORECASE)
ECHO_RE = re.compile(r"\bCORRECT\s*(?:or|/|\|)\s*INCORRECT\b", re.IGNORECASE)  # the instruction repeated
PUNCTUATION = ".,;:!?*_`\"'()[]{}<>#-"


def _verdict(match: re.Match) -> bool | None:
    """True/False for one verdict match; None for a negated INCORRECT ("not incorrect" is no clear verdict)."""
    negated, word = match.group(1), match.group(2).upper()
    if negated:
        return None if word == "INCORRECT" else False
    return word == "CORRECT"


def parse_verdict(reply: str) -> bool:
    """The verdict the prompt asks for: ``CORRECT`` -> True, ``INCORRECT`` or ``NOT CORRECT`` -> False; else
    :class:`JudgeError` (an unclear reply is a failed request, never a guess).

    ``<think>`` blocks are left out. The verdict is the last verdict word written in capitals, as the prompt
    asks (``Correct answer would be 7; so INCORRECT.`` is incorrect); in a reply with none, the reply's own
    last word in any case (``the answer is correct.``). Punctuation and markdown around it are ignored.
    """
    text = THINK_RE.sub(" ", reply or "")
    if "<think>" in text.lower():  # a reasoning block never closed: whatever follows is not the verdict
        raise JudgeError(f"the judge replied {short(reply, 80)!r}: its <think> block never ends")
    text = ECHO_RE.sub(" ", text)
    capitals = [m for m in VERDICT_RE.finditer(text) if m.group(2).isupper()]
    words = text.split()
    last = words[-1].strip(PUNCTUATION) if words else ""
    if capitals:
        verdict = _verdict(capitals[-1])
    elif last.upper() in ("CORRECT", "INCORRECT"):
        verdict = _verdict(list(VERDICT_RE.finditer(text))[-1])
    else:
        verdict = None
    if verdict is None:
        raise JudgeError(f"the judge replied {short(reply, 80)!r}, not CORRECT or INCORRECT")
    return verdict


def judge_all(judge, items: list[tuple[str, str, str]], workers: int = 8) -> list[tuple[bool | None, str | None]]:
    """``(verdict, error)`` for each ``(question, prediction, reference)``, requests ``workers`` at a time.

    A judge that raises gives ``(None, "Type: message")`` for that item and the others go on."""

    def one(item):
        try:
            return bool(judge(*item)), None
        except Exception as err:  # an external judge (often a web API) must not sink a finished run
            return None, f"{type(err).__name__}: {err}"

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(one, items))
