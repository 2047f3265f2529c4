"""eogym_sft.net against local servers the test starts: redirects, a trickling reply, a flood, 5xx, bad schemes, hostile JSON."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from eogym_sft import net


class Server:
    """A local server whose route (the URL path) picks the misbehaviour; it records every request."""

    def __init__(self):
        self.requests: list[dict] = []
        self.statuses: list[int] = []  # for /flaky: statuses to send before a 200
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, status, body: bytes, headers=()):
                self.send_response(status)
                for key, value in headers:
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                server.requests.append({"method": "POST", "path": self.path, "body": body, "auth": self.headers.get("Authorization")})
                route = self.path.split("?")[0]
                try:
                    if route == "/ok":
                        self._reply(200, json.dumps({"echo": json.loads(body)}).encode())
                    elif route == "/redirect":
                        self._reply(307, b"", [("Location", server.other + "/ok")])
                    elif route == "/trickle":  # headers at once, then a byte every 0.2 s for ever
                        self.send_response(200)
                        self.send_header("Content-Length", "1000")
                        self.end_headers()
                        for _ in range(1000):
                            self.wfile.write(b" ")
                            self.wfile.flush()
                            time.sleep(0.2)
                    elif route == "/flood":  # no length, a stream of 1 MiB blocks
                        self.send_response(200)
                        self.end_headers()
                        for _ in range(64):
                            self.wfile.write(b"x" * (1 << 20))
                    elif route == "/flaky":
                        status = server.statuses.pop(0) if server.statuses else 200
                        self._reply(status, json.dumps({"status": status}).encode())
                    elif route == "/echo401":  # a server that quotes the request's credentials back
                        self._reply(401, f"bad key {self.headers.get('Authorization')} for {self.path}".encode())
                    elif route == "/deep":
                        self._reply(200, b"[" * 100000 + b"]" * 100000)
                    elif route == "/bigint":
                        self._reply(200, b'{"n": ' + b"9" * 5000 + b"}")
                    else:
                        self._reply(404, b"no route")
                except (BrokenPipeError, ConnectionResetError):  # the client gave up, as it should
                    pass

            def do_GET(self):
                server.requests.append({"method": "GET", "path": self.path, "body": b"", "auth": self.headers.get("Authorization")})
                self._reply(200, b'{"echo": "a GET"}')

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.other = self.url
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def servers():
    first, second = Server(), Server()
    first.other = second.url  # /redirect on the first points at the second: another origin
    yield first, second
    first.close()
    second.close()


@pytest.fixture
def server(servers):
    for s in servers:
        s.requests.clear()
        s.statuses.clear()
    return servers


def test_ok_round_trip(server):
    first, _ = server
    assert net.post_json(first.url + "/ok", {"a": 1}, {"Authorization": "Bearer k"}) == {"echo": {"a": 1}}
    assert first.requests[-1]["auth"] == "Bearer k"


def test_a_redirect_is_refused_and_names_its_target(server):
    first, second = server
    with pytest.raises(net.RedirectRefused, match=f"redirected \\(307\\) to {second.url}/ok") as err:
        net.post_json(first.url + "/redirect", {"a": 1}, {"Authorization": "Bearer secret"})
    assert err.value.target == second.url + "/ok"
    assert second.requests == []  # nothing, and no key, went to the other origin


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://127.0.0.1/x", "127.0.0.1:8000/x", "http:///nohost", "gopher://h/"])
def test_only_http_and_https_urls(url):
    with pytest.raises(net.BadURL, match="not an http:// or https:// URL"):
        net.post_json(url, {})


def test_one_deadline_for_a_trickling_reply(server):
    first, _ = server
    start = time.monotonic()
    with pytest.raises(net.DeadlineExceeded, match="deadline of 1 s"):
        net.post_json(first.url + "/trickle", {}, deadline_s=1.0, retries=3, backoff_s=0.01)
    assert time.monotonic() - start < 2.5  # each byte came well inside any per-read timeout


def test_a_flood_is_cut_at_the_cap(server):
    first, _ = server
    with pytest.raises(net.ResponseTooLarge, match="over the cap of 1048576 bytes"):
        net.post(first.url + "/flood", b"{}", max_bytes=1 << 20)


def test_5xx_is_retried_then_named(server):
    first, _ = server
    first.statuses = [503, 502]
    assert net.post_json(first.url + "/flaky", {}, retries=2, backoff_s=0.01) == {"status": 200}
    assert len(first.requests) == 3
    first.statuses = [500, 500, 500]
    with pytest.raises(net.HTTPStatusError, match="answered 500 after 3 attempt") as err:
        net.post_json(first.url + "/flaky", {}, retries=2, backoff_s=0.01)
    assert err.value.status == 500


def test_4xx_is_not_retried(server):
    first, _ = server
    with pytest.raises(net.HTTPStatusError, match="answered 404: no route") as err:
        net.post_json(first.url + "/nothing", {}, retries=5, backoff_s=0.01)
    assert err.value.status == 404 and len(first.requests) == 1


def test_retries_stop_at_the_deadline(server):
    first, _ = server
    first.statuses = [503] * 100
    start = time.monotonic()
    with pytest.raises(net.DeadlineExceeded):
        net.post_json(first.url + "/flaky", {}, deadline_s=0.5, retries=100, backoff_s=0.1)
    assert time.monotonic() - start < 1.0


@pytest.mark.parametrize("route, reason", [("/deep", "json_too_deep"), ("/bigint", "json_number_too_long")])
def test_hostile_json_replies_are_named(server, route, reason):
    first, _ = server
    with pytest.raises(net.BadResponse, match=reason):
        net.post_json(first.url + route, {})


def test_nobody_listening():
    with pytest.raises(net.DeadlineExceeded):
        net.post_json("http://127.0.0.1:9/x", {}, deadline_s=0.3, retries=50, backoff_s=0.05)
    with pytest.raises(net.NetError, match="no reply after 1 attempt"):
        net.post_json("http://127.0.0.1:9/x", {}, deadline_s=5, retries=0)


def test_short_quotes_a_prefix():
    assert net.short("x" * 1000, 10) == "xxxxxxxxxx... (990 more characters)"
    assert net.short("abc") == "abc"


def test_a_key_echoed_in_an_error_is_redacted(server):
    first, _ = server
    url = first.url.replace("http://", "http://alice:pw-1234@") + "/echo401?api_key=qk-9876&x=1"
    with pytest.raises(net.HTTPStatusError) as err:
        net.post_json(url, {}, {"Authorization": "Bearer sk-live-5555"})
    assert first.requests[-1]["auth"] == "Bearer sk-live-5555"  # sent, never written down
    text = f"{err.value} {err.value.body}"
    assert "sk-live-5555" not in text and "pw-1234" not in text and "qk-9876" not in text
    redacted = f"{first.url.replace('http://', 'http://***@')}/echo401?api_key=***&x=1"
    assert str(err.value) == f"{redacted} answered 401: bad key *** for /echo401?api_key=***&x=1"


def test_redact():
    text = "k=1 http://u:p@h/a?token=t&key=z#f Basic dXNlcjpwdw== sk-abcd, a basic token count"
    assert net.redact(text, ["sk-abcd"]) == "k=1 http://***@h/a?token=***&key=***#f Basic *** ***, a basic token count"


def test_cancel_stops_a_call_in_flight_at_once(server):
    first, _ = server
    cancel = net.Cancel()
    threading.Timer(0.3, cancel.cancel).start()
    start = time.monotonic()
    with pytest.raises(net.Cancelled):
        net.post_json(first.url + "/trickle", {}, deadline_s=30, retries=3, cancel=cancel)
    assert time.monotonic() - start < 1.5
    with pytest.raises(net.Cancelled):  # and no new call starts
        net.post_json(first.url + "/ok", {}, cancel=cancel)
