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
from dataclasses import dataclass, field

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
            body = net.post(s.url, json.dumps(payload).encode(), headers, s.timeout_s, s.max_response_bytes, s.retries, s.backoff_s)
        except net.HTTPStatusError as err:
            if err.status in (404, 501):
                raise CannotAnswer(f"the tool server does not run {tool} ({err.status})") from None
            if err.status < 500 and err.status != 429:
                raise ToolCallError("http_error", f"the tool server refused the call ({err.status}): {err.body}") from None
            raise ToolCallError("http_error", f"the tool server did not answer after {s.retries + 1} attempts ({err.body})") from None
        except net.NetError as err:
            raise ToolCallError("http_error", f"the tool server did not answer: {err}") from None
        return _result_at(body, s.result_field), None
