"""Judges of a final answer against ``gt_answer``: a Python function, or an OpenAI-compatible
chat-completions endpoint (the paper's setting is GPT-4.1-mini).

A judge is ``judge(question, prediction, reference) -> bool``. :func:`judge_all` runs one over many
answers and keeps failures apart: a request that still fails after its retries gives ``None`` and an
error, never a silent "wrong".
"""

from __future__ import annotations

import importlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

JUDGE_SYSTEM_PROMPT = (
    "You grade answers to Earth-observation questions. Given the question, the reference answer and a "
    "candidate answer, decide whether the candidate means the same as the reference: numbers must agree "
    "(units may differ if the values are equal), names and categories must refer to the same thing, and "
    "extra explanation is fine if the answer itself is right. Reply with exactly one word: CORRECT or INCORRECT."
)
JUDGE_USER_TEMPLATE = "Question:\n{question}\n\nReference answer:\n{reference}\n\nCandidate answer:\n{prediction}"


DEFAULT_JUDGE_MODEL = "gpt-4.1-mini"  # the paper's judge


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
        if not self.timeout > 0:
            raise ValueError(f"the judge's timeout must be > 0 seconds, got {self.timeout}")
        if self.retries < 0:
            raise ValueError(f"the judge's retries must be 0 or more, got {self.retries}")

    def __call__(self, question: str, prediction: str, reference: str) -> bool:
        from .. import net

        body = {
            "model": self.model,
            "temperature": 0,
            "messages": [
                {"role": "system", "content": JUDGE_SYSTEM_PROMPT},
                {"role": "user", "content": JUDGE_USER_TEMPLATE.format(question=question, reference=reference, prediction=prediction)},
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


def parse_verdict(reply: str) -> bool:
    """``CORRECT`` -> True, ``INCORRECT`` -> False (first word, any case, punctuation ignored); else :class:`JudgeError`."""
    words = (reply or "").strip().split()
    word = words[0].strip(".:*!\"'").upper() if words else ""
    if word in ("CORRECT", "INCORRECT"):
        return word == "CORRECT"
    raise JudgeError(f"the judge replied {reply[:80]!r}, not CORRECT or INCORRECT")


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
