"""The ``http`` backend: a client for a running tool server (EO-Gym's own FastAPI server, or any other).

EO-Gym's HTTP routes and payloads are not published, so the request and response shape is configurable:
each call is ``POST url`` with the JSON body ``{name_field: tool, arguments_field: arguments, **extra}``
(plus ``row_id_field: <row id>`` when set), and the result is read from the response JSON at the dotted
``result_field`` (empty: the whole body). A string result is the tool text as it is; anything else is
dumped as JSON. The network rules are :mod:`eogym_sft.net`'s: http(s) only, no redirects, one deadline
``timeout_s`` per call (retries included), replies up to ``max_response_bytes``. Connection errors,
replies cut short and 5xx answers are retried ``retries`` times with a growing pause; 404 and 501 mean
the server does not run this tool (the next backend may); any other answer is an error message for the model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields

from ... import net
from ...safe_json import UntrustedJSONError, loads
from ..results import CannotAnswer, ToolCallError


@dataclass
class HttpToolServer:
    """Where a tool server listens and how its requests and responses look."""

    url: str
    timeout_s: float = 60.0  # the whole call, retries and pauses included
    retries: int = 2
    backoff_s: float = 0.5  # pause before retry k is backoff_s * 2**k
    name_field: str = "tool_name"
    arguments_field: str = "arguments"
    result_field: str = "output"
    row_id_field: str | None = None
    extra: dict = field(default_factory=dict)
    headers: dict = field(default_factory=dict)
    max_response_bytes: int = 8 << 20

    def __post_init__(self):
        net.check_url(self.url)  # a file:// or schemeless URL is refused before any call
        # each of these would fail every call of a run: refused here, before the run starts
        problem = _setting_problem(self)
        if problem:
            raise ValueError(f"http tool server setting {problem}")

    @classmethod
    def from_config(cls, url: str, config: str | dict) -> HttpToolServer:
        """A server from ``url`` and its settings, a JSON object (text or dict) of this class's fields
        (``eogym-sft tool-call --http-config``); anything else is one line naming the problem."""
        if isinstance(config, str):
            try:
                config = loads(config)
            except UntrustedJSONError as err:
                raise ValueError(f"the http tool server settings are not JSON ({err.reason})") from None
        if not isinstance(config, dict):
            raise ValueError(f"the http tool server settings must be a JSON object, got {type(config).__name__}")
        known = [f.name for f in fields(cls) if f.name != "url"]
        unknown = sorted(set(config) - set(known))
        if unknown:
            raise ValueError(f"unknown http tool server setting {unknown[0]!r}: the settings are {', '.join(known)}")
        return cls(url, **config)


def _number(value, low_open: bool) -> bool:
    """A finite int or float above 0 (``low_open``) or at least 0, never a bool."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return value > 0 if low_open else value >= 0


def _setting_problem(s: HttpToolServer) -> str | None:
    if not _number(s.timeout_s, True):
        return f"timeout_s must be a positive number of seconds, got {s.timeout_s!r}"
    if not _number(s.backoff_s, False):
        return f"backoff_s must be a number of seconds >= 0, got {s.backoff_s!r}"
    for name in ("retries", "max_response_bytes"):
        value, low = getattr(s, name), 0 if name == "retries" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            return f"{name} must be a whole number >= {low}, got {value!r}"
    for name in ("name_field", "arguments_field", "result_field"):
        if not isinstance(getattr(s, name), str):
            return f"{name} must be a string, got {getattr(s, name)!r}"
    if s.row_id_field is not None and not (isinstance(s.row_id_field, str) and s.row_id_field):
        return f"row_id_field must be a non-empty string or null, got {s.row_id_field!r}"
    if not isinstance(s.extra, dict):
        return f"extra must be an object, got {type(s.extra).__name__}"
    if not (
        isinstance(s.headers, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in s.headers.items())
    ):
        return "headers must be an object of strings"
    return None


def _result_at(body: bytes, path: str) -> str:
    if not path:
        return body.decode("utf-8", errors="replace")
    try:
        value = loads(body)
        for key in path.split("."):
            value = value[int(key)] if isinstance(value, list) else value[key]
    except UntrustedJSONError as err:
        raise ToolCallError("http_error", f"the tool server's answer is not usable JSON ({err.reason})") from None
    except (ValueError, KeyError, IndexError, TypeError) as err:
        raise ToolCallError("http_error", f"the tool server's answer has no {path!r} ({type(err).__name__})") from None
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class HttpBackend:
    """Sends calls to :class:`HttpToolServer` ``server`` for one row."""

    name = "http"

    def __init__(self, server: HttpToolServer, row_id: str | None = None):
        self.server = server
        self.row_id = row_id

    def answer(self, tool: str, arguments: dict) -> tuple[str, None]:
        s = self.server
        payload = {s.name_field: tool, s.arguments_field: arguments, **s.extra}
        if s.row_id_field:
            payload[s.row_id_field] = self.row_id
        headers = {"Content-Type": "application/json", **s.headers}
        try:
            body = net.post(s.url, json.dumps(payload).encode(), headers, s.timeout_s, s.max_response_bytes, s.retries,
                            s.backoff_s)
        except net.HTTPStatusError as err:
            if err.status in (404, 501):
                raise CannotAnswer(f"the tool server does not run {tool} ({err.status})") from None
            if err.status < 500 and err.status != 429:
                raise ToolCallError("http_error",
                                    f"the tool server refused the call ({err.status}): {err.body}") from None
            raise ToolCallError("http_error", f"the tool server did not answer after {s.retries + 1} attempts "
                                              f"({err.body})") from None
        except net.NetError as err:
            raise ToolCallError("http_error", f"the tool server did not answer: {err}") from None
        return _result_at(body, s.result_field), None
