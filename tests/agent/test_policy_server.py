"""Policy arms behind chat-completions servers: requests and replies against real local servers, a
scripted policy through the crop tool with a known Pass@1 and paired with a local arm, and servers that
fail, trickle, redirect or send garbage (each named and counted, the run goes on)."""

from __future__ import annotations

import base64
import io
import json
import time

import pytest
from PIL import Image
from policy_servers import (
    CROP_ARGS,
    ODD_TEXT,
    SCENE,
    misbehaving,
    reply,
    scripted_policy,
    send,
    serve,
)

from eogym_sft.agent.policy_server import (
    PolicyError,
    PolicyServer,
    api_messages,
    capped_size,
    data_url,
    policy_servers,
    post_json,
    reply_turn,
)


def _png_size(url: str) -> tuple[int, int]:
    assert url.startswith("data:image/png;base64,")
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).size


def _rows(tmp_path, row_factory, wrong: bool = True):
    rows = [row_factory(row_id="q1")]
    if wrong:
        other = row_factory(row_id="q2")
        other["gt_answer"] = "7"  # the scripted policy answers 3: wrong here
        rows.append(other)
    path = tmp_path / "test.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_images_go_at_the_processor_size(processor, data_root):
    from eogym_sft.agent.image_inputs import image_input

    for rel in ("EO_GYM_DATA/aaaa0000/scene.jpg", "image_cache/crops/c1.png", "image_cache/crops/c2.png"):
        path = data_root / rel
        url = data_url(processor, path)
        grid = image_input(processor, Image.open(path).convert("RGB")).grid_thw
        patch = processor.image_processor.patch_size
        assert _png_size(url) == (grid[2] * patch, grid[1] * patch) == capped_size(processor, *Image.open(path).size)
    assert _png_size(data_url(processor, data_root / "image_cache/crops/c1.png")) == (320, 224)  # 128x96 up to the pixel floor


def test_api_messages_pair_tool_results_with_their_calls():
    from eogym_sft.agent.episodes import canonical_prompt

    row = {
        "id": "r", "images": ["a.png"], "tools": [],
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "<image>How many?"},
            {"role": "assistant", "content": "crop", "tool_calls": [{"type": "function", "function": {"name": "crop", "arguments": '{"x": 1}'}}]},
            {"role": "tool", "content": json.dumps({"cropped_path": "image_cache/b.png"})},
        ],
    }
    trace = canonical_prompt(row)
    as_tool = api_messages(trace, ["URL_A", "URL_B"], "tool")
    assert [m["role"] for m in as_tool] == ["system", "user", "assistant", "tool"]
    assert as_tool[1]["content"] == [{"type": "image_url", "image_url": {"url": "URL_A"}}, {"type": "text", "text": "How many?"}]
    call = as_tool[2]["tool_calls"][0]
    assert call == {"id": "call_2_0", "type": "function", "function": {"name": "crop", "arguments": '{"x": 1}'}}
    assert as_tool[3]["tool_call_id"] == "call_2_0"
    assert as_tool[3]["content"][-1] == {"type": "image_url", "image_url": {"url": "URL_B"}}
    as_user = api_messages(trace, ["URL_A", "URL_B"], "user")
    assert [m["role"] for m in as_user] == ["system", "user", "assistant", "tool", "user"]
    assert isinstance(as_user[3]["content"], str) and "image_cache/b.png" in as_user[3]["content"]
    assert as_user[4]["content"] == [{"type": "image_url", "image_url": {"url": "URL_B"}}]


def test_reply_turn_reads_tool_calls_text_and_truncation():
    call = {"type": "function", "function": {"name": "crop", "arguments": '{"aoi": [0, 0, 1, 1]}'}}
    text, truncated, tokens = reply_turn(reply({"content": "Looking.", "tool_calls": [call]}, "tool_calls", 4))
    assert text == 'Looking.\n<tool_call>\n{"name": "crop", "arguments": {"aoi": [0, 0, 1, 1]}}\n</tool_call>'
    assert (truncated, tokens) == (False, 4)
    assert reply_turn(reply({"content": "Final Answer: 5"}, "length"))[:2] == ("Final Answer: 5", True)
    bad_args = reply_turn(reply({"content": None, "tool_calls": [{"function": {"name": "crop", "arguments": "{oops"}}]}))[0]
    assert bad_args == '<tool_call>\n{"name": "crop", "arguments": "{oops"}\n</tool_call>'
    for payload in ({}, {"choices": []}, {"choices": [{"message": "text"}]}):
        with pytest.raises(PolicyError, match="bad_reply"):
            reply_turn(payload)


def test_policy_config_flags(tmp_path):
    config = tmp_path / "p.json"
    config.write_text('{"api_key_env": "MY_KEY", "concurrency": 2}')
    a, b = policy_servers(["http://h:1/v1/chat/completions", "https://api.x/v1/chat/completions"], ["eogym=lora", "gpt-4.1"], [str(config)])
    assert (a.name, a.model, a.concurrency, a.api_key_env) == ("eogym", "lora", 2, "MY_KEY")
    assert (b.name, b.model, b.concurrency) == ("gpt-4.1", "gpt-4.1", 2)
    with pytest.raises(ValueError, match="unknown key.*'api_key'"):
        policy_servers(["http://h/v1"], ["m"], ['{"api_key": "sk-..."}'])
    with pytest.raises(ValueError, match="http"):
        policy_servers(["file:///etc/passwd"], ["m"], [])
    with pytest.raises(ValueError, match="one --policy-model per --policy-url"):
        policy_servers(["http://h/v1"], [], [])


def test_post_json_names_each_failure_and_retries_only_what_may_pass(monkeypatch):
    with serve(misbehaving) as (url, requests):
        def call(model, **settings):
            server = PolicyServer(url=url, model=model, backoff_s=0.0, **{"retries": 1, "deadline_s": 5.0, **settings})
            with pytest.raises(PolicyError) as info:
                post_json(server, {"model": model, "messages": []})
            return info.value

        cases = {
            "fail": ("http_status", 2), "refuse": ("http_status", 1), "garbage": ("bad_json", 1),
            "redirect": ("redirect", 1), "huge": ("too_large", 1),
        }
        for model, (code, attempts) in cases.items():
            before = len(requests)
            err = call(model, max_response_bytes=1000)
            assert (err.code, len(requests) - before) == (code, attempts), model
        assert "http://elsewhere.example/v1/chat/completions" in str(call("redirect"))
        assert "500" in str(call("fail")) and "400" in str(call("refuse"))
        # a server trickling one byte per 50 ms meets the call's single deadline, retries included
        before = len(requests)
        err = call("trickle", deadline_s=0.6, retries=3)
        assert err.code == "timeout" and len(requests) - before == 1
        before, start = len(requests), time.monotonic()
        err = call("trickle_headers", deadline_s=0.6, retries=3)
        assert err.code == "timeout" and len(requests) - before == 1 and time.monotonic() - start < 1.5
        assert post_json(PolicyServer(url=url, model="ok"), {"model": "ok", "messages": [{"role": "user", "content": "hi"}]})["choices"]


def test_a_flaky_server_is_retried_and_the_key_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("TEST_POLICY_KEY", "sk-secret")
    calls = []

    def flaky(body, handler):
        calls.append(handler.headers.get("Authorization"))
        if len(calls) == 1:
            return send(handler, 503, b"busy")
        return reply({"content": "Final Answer: 1"})

    with serve(flaky) as (url, _):
        server = PolicyServer(url=url, model="m", api_key_env="TEST_POLICY_KEY", retries=1, backoff_s=0.0)
        assert reply_turn(post_json(server, {"model": "m", "messages": []}))[0] == "Final Answer: 1"
    assert calls == ["Bearer sk-secret", "Bearer sk-secret"]


def test_scripted_policy_runs_the_crop_tool_and_pairs_with_a_local_arm(tmp_path, data_root, row_factory, tiny_model_dir, processor, monkeypatch):
    from eogym_sft.cli import main

    monkeypatch.setenv("TEST_POLICY_KEY", "sk-never-written")
    data = _rows(tmp_path, row_factory)
    out = tmp_path / "out"
    with serve(lambda body, handler: scripted_policy(body)) as (url, requests):
        main([
            "rollout", "--model", str(tiny_model_dir), "--data", str(data), "--data-root", str(data_root), "--output", str(out),
            "--max-turns", "3", "--max-new-tokens", "3", "--max-length", "1024", "--no-progress",
            "--policy-url", url, "--policy-model", "scripted=served-name", "--policy-config", '{"api_key_env": "TEST_POLICY_KEY", "concurrency": 2}',
        ])
    episodes = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    scripted = {e["source_id"]: e for e in episodes if e["arm"] == "scripted"}
    assert sorted(scripted) == ["q1", "q2"] and {e["arm"] for e in episodes} == {"base", "scripted"}
    for e in scripted.values():
        assert (e["stop_reason"], e["final_answer"], e["turns"], e["tool_calls"], e["tool_errors"], e["new_tokens"]) == ("final_answer", "3", 2, 1, 0, 16)
        assert [m["role"] for m in e["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
        assert json.loads(e["messages"][3]["content"])["bbox_px"] == [160, 120, 480, 360]  # the crop really ran
        assert e["images_seen"][0] == SCENE and e["images_seen"][1].startswith("image_cache/crops/")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["arms"]["scripted"]["overall"]["pass@1"] == 0.5  # q1 right (3), q2 wrong (gt 7)
    assert summary["counts"]["policy_errors"] == 0 and summary["counts"]["episodes"] == 4
    assert summary["paired"], "the local base arm and the policy arm are compared question by question"
    # what the server was sent: the row's tools, the images at the processor's size, the crop as a tool image
    first = next(b for _, b, _ in requests if len(b["messages"]) == 2)
    second = next(b for _, b, _ in requests if len(b["messages"]) == 4)
    assert first["model"] == "served-name" and first["tools"] == row_factory()["tools"] and first["temperature"] == 0.0
    assert first["max_tokens"] == 3
    assert _png_size(first["messages"][1]["content"][0]["image_url"]["url"]) == capped_size(processor, 640, 480)
    assert second["messages"][2]["tool_calls"][0]["function"] == {"name": "crop_optical_or_sar_image", "arguments": json.dumps(CROP_ARGS)}
    assert second["messages"][3]["tool_call_id"] == second["messages"][2]["tool_calls"][0]["id"]
    assert _png_size(second["messages"][3]["content"][-1]["image_url"]["url"]) == capped_size(processor, 320, 240)
    assert all(h.get("Authorization") == "Bearer sk-never-written" for _, _, h in requests)
    for path in out.iterdir():
        assert "sk-never-written" not in path.read_text(), path.name
    assert "scripted" in (out / "report.txt").read_text()


def test_bad_servers_are_named_and_counted_and_the_run_goes_on(tmp_path, data_root, row_factory, tiny_model_dir):
    from eogym_sft.evaluation.rollout import RolloutConfig, rollout

    data = _rows(tmp_path, row_factory, wrong=False)
    bad = ("fail", "trickle", "garbage", "redirect", "huge", "no_choices")
    with serve(misbehaving) as (url, _):
        policies = policy_servers([url] * (len(bad) + 1), [*bad, "good"], ['{"deadline_s": 0.6, "retries": 1, "backoff_s": 0, "max_response_bytes": 1000}'])
        cfg = RolloutConfig(model=str(tiny_model_dir), data=[str(data)], data_root=str(data_root), output=str(tmp_path / "out"),
                            include_base=False, policies=policies, max_turns=3, max_episode_tokens=1024)
        summary = rollout(cfg, progress=False)
    episodes = {e["arm"]: e for e in map(json.loads, (tmp_path / "out" / "episodes.jsonl").read_text().splitlines())}
    codes = {"fail": "http_status", "trickle": "timeout", "garbage": "bad_json", "redirect": "redirect", "huge": "too_large", "no_choices": "bad_reply"}
    for arm, code in codes.items():
        assert episodes[arm]["stop_reason"] == "error" and episodes[arm]["error"].startswith(f"PolicyError: {code}"), arm
    assert episodes["good"]["stop_reason"] == "final_answer" and summary["arms"]["good"]["overall"]["pass@1"] == 1.0
    assert summary["counts"]["policy_errors"] == len(bad) == summary["counts"]["episode_errors"]
    skipped = [json.loads(line) for line in (tmp_path / "out" / "skipped.jsonl").read_text().splitlines()]
    assert sorted(s["episode"] for s in skipped) == sorted(f"q1:{arm}:0" for arm in bad)


def test_hostile_replies_are_recorded_read_back_and_leak_no_key(tmp_path, data_root, row_factory, tiny_model_dir, monkeypatch):
    from eogym_sft.evaluation.resume import read_log
    from eogym_sft.evaluation.rollout import RolloutConfig, rollout

    monkeypatch.setenv("TEST_POLICY_KEY", "sk-echoed-4242")
    data = _rows(tmp_path, row_factory, wrong=False)
    arms = ("echo_key", "odd_text", "huge_usage", "deep_args", "long_args", "fail", "good")
    with serve(misbehaving) as (url, _):
        url = url.replace("http://", "http://alice:pw-in-url@")
        config = '{"api_key_env": "TEST_POLICY_KEY", "deadline_s": 2, "retries": 1, "backoff_s": 0}'
        cfg = RolloutConfig(model=str(tiny_model_dir), data=[str(data)], data_root=str(data_root), output=str(tmp_path / "out"),
                            include_base=False, policies=policy_servers([url] * len(arms), list(arms), [config]), max_turns=3,
                            max_episode_tokens=1024)
        summary = rollout(cfg, progress=False)
        again = rollout(cfg, progress=False)  # the log reads back whole: every episode resumed
    out = tmp_path / "out"
    for path in out.iterdir():
        text = path.read_text()
        assert "sk-echoed-4242" not in text and "pw-in-url" not in text, path.name
    log = (out / "episodes.jsonl").read_bytes()
    assert log.isascii() and log.count(b"\n") == len(arms)
    episodes = {e["arm"]: e for e in read_log(out / "episodes.jsonl")}
    assert episodes["echo_key"]["error"].startswith("PolicyError: http_status: http://***@127.0.0.1:")
    assert "invalid key ***" in episodes["echo_key"]["error"]
    assert episodes["odd_text"]["messages"][-1]["content"] == ODD_TEXT and episodes["odd_text"]["final_answer"] == "3"
    assert (episodes["huge_usage"]["stop_reason"], episodes["huge_usage"]["new_tokens"]) == ("final_answer", 0)
    assert summary["arms"]["huge_usage"]["timing"]["usage_dropped"] == 2  # both turns' counts dropped
    for arm in ("deep_args", "long_args"):
        assert (episodes[arm]["stop_reason"], episodes[arm]["tool_error_codes"]) == ("invalid_call", {"invalid_call": 1}), arm
    assert summary["counts"]["policy_errors_by_code"] == {"http_status": 2}
    assert again["counts"]["episodes_resumed"] == len(arms)
    assert json.loads((out / "run.json").read_text())["policies"][0]["url"].startswith("http://***@127.0.0.1:")


def test_policy_errors_are_left_out_of_pass_at_k_and_the_deltas(tmp_path, data_root, row_factory, tiny_model_dir):
    from eogym_sft.evaluation.rollout import RolloutConfig, rollout

    data = _rows(tmp_path, row_factory)
    with serve(misbehaving) as (url, _):
        policies = policy_servers([url] * 2, ["good", "fail"], ['{"retries": 0}'])
        cfg = RolloutConfig(model=str(tiny_model_dir), data=[str(data)], data_root=str(data_root), output=str(tmp_path / "out"),
                            include_base=False, policies=policies, max_turns=3, max_episode_tokens=1024)
        summary = rollout(cfg, progress=False)
    failed = summary["arms"]["fail"]["overall"]
    figures = (failed["pass@1"], failed["pass@1_questions"], failed["mean_score"], failed["policy_errors"])
    assert figures == (None, 0, None, {"http_status": 2})
    assert summary["arms"]["good"]["overall"]["pass@1"] == 0.5
    assert summary["paired"] == []  # no question where both arms were scored
    assert "policy errors 2: http_status 2; left out of Pass@k" in (tmp_path / "out" / "report.txt").read_text()


def test_ctrl_c_stops_at_once_and_keeps_the_log_whole(tmp_path, data_root, row_factory, tiny_model_dir):
    import os
    import signal
    import threading

    from eogym_sft.evaluation.resume import read_log
    from eogym_sft.evaluation.rollout import RolloutConfig, rollout

    data = _rows(tmp_path, row_factory)
    with serve(misbehaving) as (url, _):
        policies = policy_servers([url] * 2, ["good", "slow"], ['{"deadline_s": 120, "concurrency": 2}'])
        cfg = RolloutConfig(model=str(tiny_model_dir), data=[str(data)], data_root=str(data_root), output=str(tmp_path / "out"),
                            include_base=False, policies=policies, max_turns=3, max_episode_tokens=1024)
        out = tmp_path / "out" / "episodes.jsonl"

        sent = threading.Event()

        def lines() -> int:
            try:
                return out.read_bytes().count(b"\n")
            except OSError:  # not written yet: the watcher must not die of it
                return 0

        def interrupt_when_slow_runs():
            while lines() != 2:  # the good arm's two episodes
                time.sleep(0.05)
            time.sleep(0.5)  # the slow arm's calls are in flight
            sent.set()
            os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C sends

        # Python's own Ctrl-C handler, whatever an earlier test in this worker left installed
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        threading.Thread(target=interrupt_when_slow_runs, daemon=True).start()
        start = time.monotonic()
        interrupted = False
        try:
            rollout(cfg, progress=False)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            signal.signal(signal.SIGINT, previous)
        stopped = time.monotonic() - start
        assert (sent.is_set(), interrupted) == (True, True)  # which half failed, if one does
    assert stopped < 10  # not 20 s per reply x 3 turns
    assert [e["arm"] for e in read_log(out)] == ["good", "good"]  # whole records, none of the interrupted ones
    assert out.read_bytes().endswith(b"\n")


def test_a_policy_config_that_is_no_json_object_is_named(tmp_path):
    from eogym_sft.agent.policy_server import policy_servers

    (tmp_path / "policy.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=rf"^{tmp_path}/policy.json: not a policy server's settings \(a JSON object expected, got list\)$"):
        policy_servers(["http://127.0.0.1:1/v1"], ["m"], [str(tmp_path / "policy.json")])
    with pytest.raises(ValueError, match=r"^--policy-config: not a policy server's settings \(malformed_json: "):
        policy_servers(["http://127.0.0.1:1/v1"], ["m"], ['{"concurrency": }'])
