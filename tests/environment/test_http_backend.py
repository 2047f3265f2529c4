"""The http backend against a real local tool server started by the test: request and response shape,
retries on 5xx and timeouts, refusals, and a server that is not there."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from eogym_sft.environment.backends.http import HttpBackend, HttpToolServer
from eogym_sft.environment.results import CannotAnswer, ToolCallError


class ToolServer:
    """A local tool server whose answers the test scripts: a list of (status, body, delay_s) per call."""

    def __init__(self):
        self.requests: list[dict] = []
        self.script: list[tuple[int, str, float]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append({"path": self.path, "body": body, "auth": self.headers.get("Authorization")})
                status, text, delay = server.script.pop(0) if server.script else (200, json.dumps({"output": body}), 0)
                time.sleep(delay)
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    if status == 299:  # a reply cut short: it promises more bytes than it sends
                        self.send_header("Content-Length", str(len(text) + 100))
                        self.close_connection = True
                    self.end_headers()
                    self.wfile.write(text.encode())
                except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
                    pass

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/execute"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def tool_server():
    server = ToolServer()
    yield server
    server.close()


def _backend(server, **kw):
    return HttpBackend(HttpToolServer(server.url, backoff_s=0.01, **kw), row_id="row-7")


def test_request_and_response_shapes(tool_server):
    result = {"cropped_path": "image_cache/crops/x.png", "width": 8}
    tool_server.script = [(200, json.dumps({"output": result}), 0)]
    text, images = _backend(tool_server).answer("crop_optical_or_sar_image", {"aoi": [0, 0, 1, 1]})
    assert json.loads(text) == result and images is None
    assert tool_server.requests[-1] == {
        "path": "/execute",
        "body": {"tool_name": "crop_optical_or_sar_image", "arguments": {"aoi": [0, 0, 1, 1]}},
        "auth": None,
    }
    # another server's shape: other field names, a nested string result, the row id, fixed extras, a header
    tool_server.script = [(200, json.dumps({"data": {"items": [{"text": "plain words"}]}}), 0)]
    backend = _backend(
        tool_server, name_field="tool", arguments_field="args", result_field="data.items.0.text",
        row_id_field="task", extra={"split": "test"}, headers={"Authorization": "Bearer k"},
    )
    assert backend.answer("get_image_metadata", {"image_url": "EO_GYM_DATA/a/b.jpg"}) == ("plain words", None)
    assert tool_server.requests[-1]["body"] == {"tool": "get_image_metadata", "args": {"image_url": "EO_GYM_DATA/a/b.jpg"}, "split": "test", "task": "row-7"}
    assert tool_server.requests[-1]["auth"] == "Bearer k"
    tool_server.script = [(200, "not json at all", 0)]
    assert _backend(tool_server, result_field="").answer("t", {}) == ("not json at all", None)
    tool_server.script = [(200, json.dumps({"other": 1}), 0)]
    with pytest.raises(ToolCallError, match="no 'output'") as err:
        _backend(tool_server).answer("t", {})
    assert err.value.code == "http_error"


def test_server_errors_and_timeouts_are_retried(tool_server):
    tool_server.script = [(503, "busy", 0), (500, "oops", 0), (200, json.dumps({"output": "third time"}), 0)]
    assert _backend(tool_server, retries=2).answer("t", {}) == ("third time", None)
    assert len(tool_server.requests) == 3
    tool_server.script = [(200, json.dumps({"output": "late"}), 1.0)]
    with pytest.raises(ToolCallError, match="within the deadline of 0.3 s"):  # one deadline for the call, retries included
        _backend(tool_server, retries=5, timeout_s=0.3).answer("t", {})
    tool_server.script = [(299, '{"output": "cut', 0), (200, json.dumps({"output": "whole"}), 0)]
    assert _backend(tool_server, retries=1).answer("t", {}) == ("whole", None)
    tool_server.script = [(500, "down", 0)] * 3
    with pytest.raises(ToolCallError, match="after 3 attempts") as err:
        _backend(tool_server, retries=2).answer("t", {})
    assert err.value.code == "http_error"


def test_refusals_are_not_retried(tool_server):
    tool_server.script = [(422, '{"detail": "aoi must be normalised"}', 0)]
    with pytest.raises(ToolCallError, match="refused the call \\(422\\).*aoi must be normalised"):
        _backend(tool_server).answer("t", {})
    tool_server.script = [(404, "no such tool", 0)]
    with pytest.raises(CannotAnswer):  # the server does not run this tool: the next backend may
        _backend(tool_server).answer("t", {})
    assert len(tool_server.requests) == 2


def test_no_server_listening():
    with socket.socket() as sock:  # a port that was free a moment ago
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    backend = HttpBackend(HttpToolServer(f"http://127.0.0.1:{port}/execute", retries=1, backoff_s=0.01, timeout_s=1))
    with pytest.raises(ToolCallError, match="did not answer.*after 2 attempt") as err:
        backend.answer("t", {})
    assert err.value.code == "http_error"


def test_the_environment_over_http_attaches_the_served_crop(tool_server, tmp_path):
    from PIL import Image

    from eogym_sft.environment.env import EOGymEnvironment

    (tmp_path / "image_cache" / "srv").mkdir(parents=True)
    Image.new("RGB", (8, 6)).save(tmp_path / "image_cache" / "srv" / "c.png")
    served = {"cropped_path": "/remote/cache/image_cache/srv/c.png", "width": 8, "height": 6}
    tool_server.script = [(200, json.dumps({"output": served}), 0)]
    row = {"id": "r", "tools": [{"type": "function", "function": {"name": "crop_optical_or_sar_image", "parameters": {}}}], "messages": []}
    env = EOGymEnvironment(row, tmp_path, backends=("http",), http=HttpToolServer(tool_server.url, backoff_s=0.01))
    result = env.call("crop_optical_or_sar_image", {"image_url": "EO_GYM_DATA/a.jpg", "aoi": [0, 0, 1, 1]})
    assert (result.ok, result.backend, result.images) == (True, "http", [str(tmp_path / "image_cache" / "srv" / "c.png")])
    tool_server.script = [(500, "down", 0)] * 3
    failed = env.call("crop_optical_or_sar_image", {"image_url": "EO_GYM_DATA/a.jpg", "aoi": [0, 0, 1, 1]})
    assert (failed.ok, failed.error, failed.backend) == (False, "http_error", "http")
    assert env.counts == {"calls": 2, "backend:http": 1, "errors": 1, "error:http_error": 1}


def test_tool_call_command_over_http(tool_server, tmp_path, capsys):
    from eogym_sft.cli import main

    tool_server.script = [(200, json.dumps({"data": {"sensor": "S2"}}), 0)]
    config = json.dumps({"result_field": "data", "name_field": "tool", "retries": 0})
    main(["tool-call", "--data-root", str(tmp_path), "--tools", "http", "--http-url", tool_server.url, "--http-config", config,
          "get_image_metadata", '{"image_url": "EO_GYM_DATA/a/b.jpg"}'])
    out = json.loads(capsys.readouterr().out)
    assert (out["ok"], out["backend"], out["text"], out["images"]) == (True, "http", '{"sensor": "S2"}', [])
    assert tool_server.requests[-1]["body"] == {"tool": "get_image_metadata", "arguments": {"image_url": "EO_GYM_DATA/a/b.jpg"}}


################
# A hostile network (issue 28): the rules of eogym_sft.net, as the backend and the judge meet them
################


class Hostile:
    """A server that redirects to another origin, floods or answers with hostile JSON; the other origin records what reaches it."""

    def __init__(self):
        self.reached: list[dict] = []
        server = self

        class Other(BaseHTTPRequestHandler):
            def _any(self):
                server.reached.append({"method": self.command, "auth": self.headers.get("Authorization")})
                body = json.dumps({"output": "from the other origin", "choices": [{"message": {"content": "CORRECT"}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _any

            def log_message(self, *args):
                pass

        class Main(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                if self.path.startswith("/redirect"):
                    self.send_response(302)
                    self.send_header("Location", server.other_url + "/steal")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif self.path == "/flood":
                    self.send_response(200)
                    self.end_headers()
                    try:
                        for _ in range(32):
                            self.wfile.write(b'{"output": "' + b"z" * (1 << 20))
                    except (BrokenPipeError, ConnectionResetError):
                        pass
                else:  # hostile JSON
                    body = b'{"output": ' + b"[" * 100000 + b"]" * 100000 + b"}"
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.servers = [ThreadingHTTPServer(("127.0.0.1", 0), h) for h in (Main, Other)]
        for s in self.servers:
            s.daemon_threads = True
            threading.Thread(target=s.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.servers[0].server_address[1]}"
        self.other_url = f"http://127.0.0.1:{self.servers[1].server_address[1]}"

    def close(self):
        for s in self.servers:
            s.shutdown()
            s.server_close()


@pytest.fixture(scope="module")
def hostile():
    server = Hostile()
    yield server
    server.close()


def test_a_redirect_is_an_error_and_nothing_reaches_the_other_origin(hostile):
    backend = HttpBackend(HttpToolServer(hostile.url + "/redirect", headers={"Authorization": "Bearer k"}, backoff_s=0.01))
    with pytest.raises(ToolCallError, match=f"redirected \\(302\\) to {hostile.other_url}/steal") as err:
        backend.answer("t", {})
    assert err.value.code == "http_error" and hostile.reached == []


def test_the_judge_never_follows_a_redirect(hostile, monkeypatch):
    from eogym_sft.metrics.judge import ChatJudge, judge_all

    monkeypatch.setenv("TEST_JUDGE_KEY", "sk-secret")
    judge = ChatJudge(hostile.url + "/redirect/v1/chat/completions", "m", api_key_env="TEST_JUDGE_KEY", backoff=0.01)
    [(verdict, error)] = judge_all(judge, [("q", "a wrong answer", "3")])
    assert verdict is None and "RedirectRefused" in error and hostile.reached == []  # never scored correct


def test_a_flood_and_hostile_json_are_errors_for_the_model(hostile):
    flood = HttpBackend(HttpToolServer(hostile.url + "/flood", max_response_bytes=1 << 20, retries=0))
    with pytest.raises(ToolCallError, match="over the cap of 1048576 bytes"):
        flood.answer("t", {})
    deep = HttpBackend(HttpToolServer(hostile.url + "/deep", retries=0))
    with pytest.raises(ToolCallError, match="not usable JSON \\(json_too_deep\\)"):
        deep.answer("t", {})


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://127.0.0.1/x"])
def test_tool_call_refuses_a_url_that_is_not_http(url, tmp_path):
    from eogym_sft.cli import main

    with pytest.raises(SystemExit, match=r"^eogym-sft tool-call: .* is not an http:// or https:// URL with a host"):
        main(["tool-call", "--data-root", str(tmp_path), "--tools", "http", "--http-url", url, "get_image_metadata", "{}"])


def test_rollout_and_grpo_set_the_judges_deadline_and_retries():
    from eogym_sft.evaluation.rollout import RolloutConfig, make_judge
    from eogym_sft.training.grpo import GRPOScriptArguments

    url = "http://127.0.0.1:9/v1/chat/completions"
    judge = make_judge(RolloutConfig(model="m", data=["d"], output="o", judge_url=url, judge_timeout=7.5, judge_retries=1))
    assert (judge.timeout, judge.retries) == (7.5, 1)
    judge = GRPOScriptArguments(judge_url=url, judge_timeout=3.0, judge_retries=0).load_judge()
    assert (judge.timeout, judge.retries) == (3.0, 0)


URL = "http://127.0.0.1:9/tool"


@pytest.mark.parametrize(
    "config,message",
    [
        ('{"timeout_s": -1}', "http tool server setting timeout_s must be a positive number of seconds, got -1"),
        ('{"timeout_s": 0}', "http tool server setting timeout_s must be a positive number of seconds, got 0"),
        ('{"retries": -2}', "http tool server setting retries must be a whole number >= 0, got -2"),
        ('{"retries": true}', "http tool server setting retries must be a whole number >= 0, got True"),
        ('{"backoff_s": "1"}', "http tool server setting backoff_s must be a number of seconds >= 0, got '1'"),
        ('{"max_response_bytes": 0}', "http tool server setting max_response_bytes must be a whole number >= 1, got 0"),
        ('{"result_field": 3}', "http tool server setting result_field must be a string, got 3"),
        ('{"headers": {"X-Key": 1}}', "http tool server setting headers must be an object of strings"),
        ('{"extra": []}', "http tool server setting extra must be an object, got list"),
        ("[1]", "the http tool server settings must be a JSON object, got list"),
        ("{oops", "the http tool server settings are not JSON"),
        ('{"timeout": 5}', "unknown http tool server setting 'timeout': the settings are timeout_s, retries, backoff_s,"),
    ],
)
def test_settings_that_would_fail_every_call_are_refused_at_start(config, message):
    with pytest.raises(ValueError) as err:
        HttpToolServer.from_config(URL, config)
    assert str(err.value).startswith(message)


def test_good_settings_are_kept():
    server = HttpToolServer.from_config(URL, '{"timeout_s": 2.5, "retries": 0, "row_id_field": "row", "headers": {"X-Key": "k"}}')
    assert (server.timeout_s, server.retries, server.row_id_field, server.headers) == (2.5, 0, "row", {"X-Key": "k"})
    assert HttpToolServer.from_config(URL, {}) == HttpToolServer(URL)
    with pytest.raises(ValueError, match="timeout_s must be a positive number of seconds, got nan"):
        HttpToolServer(URL, timeout_s=float("nan"))
