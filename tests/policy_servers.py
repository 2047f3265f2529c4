"""Real local chat-completions servers for the policy-server tests (http.server on 127.0.0.1 in a thread)."""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SCENE = "EO_GYM_DATA/aaaa0000/scene.jpg"
CROP_ARGS = {"image_url": SCENE, "aoi": [0.25, 0.25, 0.75, 0.75]}


def reply(message: dict, finish: str = "stop", tokens: int = 5) -> dict:
    return {"choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish}],
            "usage": {"completion_tokens": tokens}}


def scripted_policy(body: dict) -> dict:
    """Crop through ``tool_calls`` on the first turn, then answer 3 as text once the tool has answered."""
    if not any(m["role"] == "tool" for m in body["messages"]):
        call = {"id": "c0", "type": "function", "function": {"name": "crop_optical_or_sar_image", "arguments": json.dumps(CROP_ARGS)}}
        return reply({"content": "I crop the harbour.", "tool_calls": [call]}, "tool_calls", 7)
    return reply({"content": "I count the hulls.\nFinal Answer: 3"}, "stop", 9)


@contextmanager
def serve(answer, delay_s: float = 0.0):
    """A server whose ``POST`` replies ``answer(body, handler)`` (a dict: sent as JSON; None: the
    function wrote the reply itself). Yields ``(url, requests)``; ``requests`` holds
    ``(path, body, headers)`` of every request."""
    requests = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            requests.append((self.path, body, dict(self.headers)))
            time.sleep(delay_s)
            payload = answer(body, self)
            if payload is not None:
                send(self, 200, json.dumps(payload).encode())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/chat/completions", requests
    finally:
        server.shutdown()
        server.server_close()


def send(handler, status: int, data: bytes, headers: dict | None = None) -> None:
    handler.send_response(status)
    for k, v in {"Content-Type": "application/json", "Content-Length": str(len(data)), **(headers or {})}.items():
        handler.send_header(k, v)
    handler.end_headers()
    handler.wfile.write(data)


ODD_TEXT = "I see \ud800, \u2028, \u2029 and \x85 here.\nFinal Answer: 3"  # valid JSON; not encodable, or line breaks to splitlines


def misbehaving(body: dict, handler):
    """One failure per model name: fail (500), refuse (400), trickle (the body), trickle_headers, garbage, redirect, huge,
    no_choices, echo_key (a 401 quoting the request's Authorization), odd_text (:data:`ODD_TEXT`), huge_usage (1e30
    tokens), deep_args and long_args (hostile tool-call arguments), slow (20 s a reply); any other name plays the
    scripted policy."""
    model = body["model"]
    if model == "echo_key":
        return send(handler, 401, f'{{"error": "invalid key {handler.headers.get("Authorization")}"}}'.encode())
    if model == "odd_text":
        return reply({"content": ODD_TEXT})
    if model == "huge_usage":
        return {**scripted_policy(body), "usage": {"completion_tokens": 1e30}}
    if model in ("deep_args", "long_args"):
        arguments = "[" * 100000 + "]" * 100000 if model == "deep_args" else '{"n": ' + "9" * 5000 + "}"
        call = {"id": "c0", "type": "function", "function": {"name": "crop_optical_or_sar_image", "arguments": arguments}}
        return reply({"content": "", "tool_calls": [call]}, "tool_calls")
    if model == "slow":
        time.sleep(20)
        return scripted_policy(body)
    if model == "fail":
        return send(handler, 500, b'{"error": "overloaded"}')
    if model == "refuse":
        return send(handler, 400, b'{"error": "context too long"}')
    if model == "trickle":
        handler.send_response(200)
        handler.send_header("Content-Length", "1000")
        handler.end_headers()
        for _ in range(40):
            try:
                handler.wfile.write(b" ")
                handler.wfile.flush()
            except OSError:
                return None
            time.sleep(0.05)
        return None
    if model == "trickle_headers":
        handler.wfile.write(b"HTTP/1.1 200 OK\r\n")
        for k in range(40):
            try:
                handler.wfile.write(f"X-Pad-{k}: x\r\n".encode())
                handler.wfile.flush()
            except OSError:
                return None
            time.sleep(0.05)
        handler.close_connection = True
        return None
    if model == "garbage":
        return send(handler, 200, b"<html>Bad gateway</html>")
    if model == "redirect":
        return send(handler, 302, b"", {"Location": "http://elsewhere.example/v1/chat/completions"})
    if model == "huge":
        return send(handler, 200, b'{"pad": "' + b"x" * 5000 + b'"}')
    if model == "no_choices":
        return {"id": "x", "choices": []}
    return scripted_policy(body)
