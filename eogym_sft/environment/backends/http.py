"""The ``http`` backend: a client for a running tool server (EO-Gym's own FastAPI server, or any other).

EO-Gym's HTTP routes and payloads are not published, so the request and response shape is configurable:
each call is ``POST url`` with the JSON body ``{name_field: tool, arguments_field: arguments, **extra}``
(plus ``row_id_field: <row id>`` when set), and the result is read from the response JSON at the dotted
``result_field`` (empty: the whole body). A string result is the tool text as it is; anything else is
dumped as JSON. Timeouts, connection errors, replies cut short and 5xx answers are retried ``retries`` times with a
growing pause; 404 and 501 mean the server does not run this tool (the next backend may); any other
answer is an error message for the model. Stdlib only.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from ..results import CannotAnswer, ToolCallError


@dataclass
class HttpToolServer:
    """Where a tool server listens and how its requests and responses look."""

    url: str
    timeout_s: float = 60.0
    retries: int = 2
    backoff_s: float = 0.5  # pause before retry k is backoff_s * 2**k
    name_field: str = "tool_name"
    arguments_field: str = "arguments"
    result_field: str = "output"
    row_id_field: str | None = None
    extra: dict = field(default_factory=dict)
    headers: dict = field(default_factory=dict)


def _result_at(body: bytes, path: str) -> str:
    if not path:
        return body.decode("utf-8", errors="replace")
    try:
        value = json.loads(body)
        for key in path.split("."):
            value = value[int(key)] if isinstance(value, list) else value[key]
    except (ValueError, KeyError, IndexError, TypeError) as err:
        raise ToolCallError("http_error", f"the tool server's answer has no {path!r} ({type(err).__name__})") from None
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class HttpBackend:
    """Sends calls to :class:`HttpToolServer` ``server`` for one row."""

    name = "http"

    def __init__(self, server: HttpToolServer, row_id: str | None = None):
        self.server = server
        self.row_id = row_id

    def _request(self, tool: str, arguments: dict) -> urllib.request.Request:
        s = self.server
        payload = {s.name_field: tool, s.arguments_field: arguments, **s.extra}
        if s.row_id_field:
            payload[s.row_id_field] = self.row_id
        headers = {"Content-Type": "application/json", **s.headers}
        return urllib.request.Request(s.url, data=json.dumps(payload).encode(), headers=headers, method="POST")

    def answer(self, tool: str, arguments: dict) -> tuple[str, None]:
        s, last = self.server, ""
        for attempt in range(s.retries + 1):
            if attempt:
                time.sleep(s.backoff_s * 2 ** (attempt - 1))
            try:
                with urllib.request.urlopen(self._request(tool, arguments), timeout=s.timeout_s) as response:
                    return _result_at(response.read(), s.result_field), None
            except urllib.error.HTTPError as err:
                detail = err.read()[:300].decode("utf-8", errors="replace")
                if err.code in (404, 501):
                    raise CannotAnswer(f"the tool server does not run {tool} ({err.code})") from None
                if err.code < 500:
                    raise ToolCallError("http_error", f"the tool server refused the call ({err.code}): {detail}") from None
                last = f"{err.code}: {detail}"
            except (urllib.error.URLError, http.client.HTTPException, socket.timeout, TimeoutError, ConnectionError) as err:
                # HTTPException: a reply cut short or malformed (IncompleteRead, BadStatusLine)
                last = str(getattr(err, "reason", err))
        raise ToolCallError("http_error", f"the tool server did not answer after {s.retries + 1} attempts ({last})")
