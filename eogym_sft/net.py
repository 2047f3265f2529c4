"""The one way this library talks to a server: a JSON POST with rules that a hostile network cannot bend.

* Only ``http`` and ``https`` URLs (a ``file://`` URL would read a local file and hand it on).
* Redirects are never followed: a 3xx reply is :class:`RedirectRefused`, naming the target. (Following
  one would resend the body and the ``Authorization`` header to whatever origin the server names.)
* One deadline per call, ``deadline_s``, covering connecting, every retry, every pause and every byte
  read: a server that trickles its reply is cut off at the deadline, not after each slow read.
* Replies are read up to ``max_bytes``; a longer one is :class:`ResponseTooLarge`.
* Connection failures, timeouts, replies cut short, 429 and 5xx are retried up to ``retries`` times with a
  pause of ``backoff_s * 2**k``, as long as the deadline allows; other 4xx are :class:`HTTPStatusError` at once.
* No credential in an error: every message (and a status error's ``body``) has the call's secrets, a URL's
  ``user:password@`` and query tokens (``key=``, ``api_key=``, ``token=``...) replaced by ``***``
  (:func:`redact`), so a server that echoes the key in its 401 body cannot put it in a log.
* A :class:`Cancel` given to the call stops it at once from another thread (Ctrl-C): its socket is shut
  and the call raises :class:`Cancelled`.

:func:`post` returns the reply's bytes, :func:`post_json` its parsed JSON (:mod:`eogym_sft.safe_json`). Stdlib only.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import ssl
import threading
import time
import urllib.parse

from .safe_json import UntrustedJSONError, loads

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
READ_CHUNK = 1 << 16
SECRET_HEADERS = frozenset({"authorization", "proxy-authorization", "x-api-key", "api-key"})
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/?#@\s]*@")
_QUERY_TOKEN = re.compile(
    r"(?i)([?&;](?:[a-z0-9_-]*(?:key|token|secret|password|passwd|signature|sig|auth))=)[^&#\s\"']*"
)
_AUTH_VALUE = re.compile(r"\b([Bb]earer|BEARER|Basic)\s+[A-Za-z0-9._~+/=-]{8,}")  # an Authorization value quoted back


class NetError(RuntimeError):
    """A call that did not give a usable reply; subclasses say why."""


class BadURL(NetError):
    """Not an ``http(s)://host...`` URL."""


class RedirectRefused(NetError):
    """The server answered with a redirect; ``target`` is where it pointed."""

    def __init__(self, message: str, target: str | None):
        super().__init__(message)
        self.target = target


class DeadlineExceeded(NetError):
    """The call's deadline passed (retries included)."""


class ResponseTooLarge(NetError):
    """The reply is longer than ``max_bytes``."""


class HTTPStatusError(NetError):
    """A non-2xx reply that is not retried (or still failing after the retries); ``status`` and a short ``body``."""

    def __init__(self, message: str, status: int, body: str):
        super().__init__(message)
        self.status = status
        self.body = body


class BadResponse(NetError):
    """A 2xx reply whose body is not acceptable JSON."""


class Cancelled(NetError):
    """The call was stopped by its :class:`Cancel` (the run is being interrupted)."""


class Cancel:
    """A switch shared by calls in flight: :meth:`cancel` shuts their sockets (waking blocked reads) and makes
    every call, running or new, raise :class:`Cancelled`."""

    def __init__(self):
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._sockets = set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, seconds: float) -> bool:
        return self._event.wait(seconds)

    def cancel(self) -> None:
        self._event.set()
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            _shut(sock)

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.add(sock)
        if self.is_set():
            _shut(sock)

    def forget(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.discard(sock)


def redact(text: str, secrets=()) -> str:
    """``text`` with each of ``secrets``, any ``Bearer``/``Basic`` value, URL userinfo and query tokens as ``***``."""
    for secret in sorted((s for s in secrets if s and len(s) >= 4), key=len, reverse=True):
        text = text.replace(secret, "***")
    text = _USERINFO.sub(r"\1***@", text)
    text = _QUERY_TOKEN.sub(r"\1***", text)
    return _AUTH_VALUE.sub(r"\1 ***", text)


def call_secrets(url: str, headers: dict | None) -> list[str]:
    """What a call must never write down: its credential headers' values (and their tokens), the URL's userinfo."""
    secrets = []
    for name, value in (headers or {}).items():
        if name.lower() in SECRET_HEADERS and value:
            secrets += [str(value), *str(value).split()[1:]]
    parts = urllib.parse.urlsplit(str(url))
    secrets += [p for p in (parts.username, parts.password) if p]
    return secrets


def _redacted(err: NetError, secrets) -> NetError:
    err.args = tuple(redact(a, secrets) if isinstance(a, str) else a for a in err.args)
    for name in ("body", "target"):
        if isinstance(getattr(err, name, None), str):
            setattr(err, name, redact(getattr(err, name), secrets))
    return err


class _Retryable(Exception):
    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def check_url(url: str) -> urllib.parse.SplitResult:
    """The parts of an ``http(s)`` URL with a host, or :class:`BadURL`."""
    parts = urllib.parse.urlsplit(str(url))
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadURL(f"{str(url)[:200]!r} is not an http:// or https:// URL with a host")
    return parts


def short(text: str | bytes, limit: int = 200) -> str:
    """At most ``limit`` characters of ``text`` for a message, with how much was left out."""
    if isinstance(text, bytes):
        text = text[: limit * 4].decode("utf-8", errors="replace")
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def quoted(value, limit: int = 80) -> str:
    """A value a model or a server sent, as a short prefix of its JSON, for a message (never all 10 MB of it)."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        text = type(value).__name__
    return short(text, limit)


def _connection(parts: urllib.parse.SplitResult, timeout: float) -> http.client.HTTPConnection:
    if parts.scheme == "https":
        return http.client.HTTPSConnection(parts.hostname, parts.port, timeout=timeout,
                                           context=ssl.create_default_context())
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)


def _read_capped(response: http.client.HTTPResponse, max_bytes: int, url: str) -> bytes:
    length = response.getheader("Content-Length")
    if length and length.isdigit() and int(length) > max_bytes:
        raise ResponseTooLarge(f"{url}: the reply is {int(length)} bytes, over the cap of {max_bytes}")
    chunks, size = [], 0
    while True:
        chunk = response.read1(READ_CHUNK)  # what has arrived, not a full buffer: the deadline watchdog can cut in
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > max_bytes:
            raise ResponseTooLarge(f"{url}: the reply is over the cap of {max_bytes} bytes")
        chunks.append(chunk)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked read; close() alone does not on Linux
    except OSError:
        pass


def _cut_off(sock: socket.socket, fired: threading.Event) -> None:
    fired.set()
    _shut(sock)


def _attempt(parts, url: str, data: bytes, headers: dict, deadline: float, max_bytes: int,
             cancel: Cancel | None = None) -> bytes:
    """One request that ends by the monotonic ``deadline``: a watchdog shuts the socket at the deadline, since socket
    timeouts only bound each read."""
    conn = _connection(parts, max(0.001, deadline - time.monotonic()))
    fired = threading.Event()
    watchdog = sock = None
    try:
        conn.connect()  # bounded by the socket timeout; the response keeps this socket after conn lets go of it
        sock = conn.sock
        if cancel is not None:
            cancel.watch(sock)
        watchdog = threading.Timer(max(0.0, deadline - time.monotonic()), _cut_off, (conn.sock, fired))
        watchdog.daemon = True
        watchdog.start()
        path = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
        conn.request("POST", path, body=data, headers={"Content-Length": str(len(data)), **headers})
        response = conn.getresponse()
        status = response.status
        if 300 <= status < 400:
            target = response.getheader("Location")
            raise RedirectRefused(f"{url} redirected ({status}) to {short(target or '<no Location>')}: redirects are "
                                  "not followed", target)
        body = _read_capped(response, max_bytes, url)
        if fired.is_set() or (response.length or 0) > 0:  # cut off by the watchdog, or closed early
            raise _Retryable("the reply was cut short")
        if status in RETRY_STATUSES:
            raise _Retryable(f"{status}: {short(body)}", status)
        if not 200 <= status < 300:
            raise HTTPStatusError(f"{url} answered {status}: {short(body)}", status, short(body))
        return body
    except (OSError, http.client.HTTPException) as err:  # refused, reset, timed out, cut short, shut by the watchdog
        if cancel is not None and cancel.is_set():
            raise Cancelled(f"{url}: cancelled") from None
        raise _Retryable(f"{type(err).__name__}: {err}") from None
    finally:
        if watchdog is not None:
            watchdog.cancel()
        if cancel is not None and sock is not None:
            cancel.forget(sock)
        conn.close()


def post(
    url: str, data: bytes, headers: dict | None = None, deadline_s: float = 60.0, max_bytes: int = 16 << 20,
    retries: int = 2, backoff_s: float = 0.5, cancel: Cancel | None = None,
) -> bytes:
    """POST ``data`` to ``url`` under the module's rules; the reply's body, or a :class:`NetError` (secrets
    redacted)."""
    try:
        return _post(url, data, dict(headers or {}), deadline_s, max_bytes, retries, backoff_s, cancel)
    except NetError as err:
        raise _redacted(err, call_secrets(url, headers)) from None


def _post(url, data, headers, deadline_s, max_bytes, retries, backoff_s, cancel) -> bytes:
    parts = check_url(url)
    deadline = time.monotonic() + deadline_s
    last, attempts = None, 0
    for attempt in range(retries + 1):
        pause = backoff_s * 2 ** (attempt - 1) if attempt else 0.0
        if time.monotonic() + pause >= deadline:
            break
        if cancel is None:
            time.sleep(pause)
        elif cancel.wait(pause) or cancel.is_set():
            raise Cancelled(f"{url}: cancelled")
        attempts += 1
        try:
            return _attempt(parts, url, data, headers, deadline, max_bytes, cancel)
        except _Retryable as err:
            last = err
    detail = f"after {attempts} attempt(s) (last: {last})"
    if attempts < retries + 1 or time.monotonic() >= deadline:
        raise DeadlineExceeded(f"{url}: no reply within the deadline of {deadline_s:g} s {detail}")
    if last.status is not None:
        raise HTTPStatusError(f"{url} answered {last.status} {detail}", last.status, str(last))
    raise NetError(f"{url}: no reply {detail}")


def post_json(
    url: str, body, headers: dict | None = None, deadline_s: float = 60.0, max_bytes: int = 16 << 20,
    retries: int = 2, backoff_s: float = 0.5, cancel: Cancel | None = None,
):
    """POST ``body`` as JSON; the reply parsed as JSON (any depth or number refused by name: :class:`BadResponse`)."""
    headers = {"Content-Type": "application/json", "Accept": "application/json", **(headers or {})}
    reply = post(url, json.dumps(body).encode(), headers, deadline_s, max_bytes, retries, backoff_s, cancel)
    try:
        return loads(reply)
    except UntrustedJSONError as err:
        raise BadResponse(redact(f"{url}: the reply is not usable JSON ({err})", call_secrets(url, headers))) from None
