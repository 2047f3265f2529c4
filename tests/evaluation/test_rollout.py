"""Closed-loop rollouts: the prompt equals SFT's, a scripted policy through the real decoder and tools,
the chat-completions judge against a local server, the CLI end to end on the tiny model, and episodes
back through data prep. Pass@k and the summary are in test_report.py."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from PIL import Image

from eogym_sft.data.encoding import encode_conversation
from eogym_sft.data.prepare import PrepConfig, prepare_line
from eogym_sft.environment.env import EOGymEnvironment
from eogym_sft.agent.episodes import (
    LoopConfig,
    canonical_prompt,
    new_episode,
    run_episodes,
)
from eogym_sft.metrics.judge import ChatJudge, JudgeError, judge_all, parse_verdict
from eogym_sft.agent.decoder import SlotDecoder
from eogym_sft.agent.sampling import Sampling
from eogym_sft.models.tiny import IMAGE_TOKEN_ID, build_tiny_model

CROP_CALL = {"name": "crop_optical_or_sar_image", "arguments": {"image_url": "EO_GYM_DATA/aaaa0000/scene.jpg", "aoi": [0.25, 0.25, 0.75, 0.75]}}


def _collapse(ids: list[int]) -> list[int]:
    """One <|image_pad|> per image, as SFT's encoding keeps them."""
    return [t for i, t in enumerate(ids) if t != IMAGE_TOKEN_ID or i == 0 or ids[i - 1] != IMAGE_TOKEN_ID]


class Scripted(Sampling):
    """A policy that writes a fixed text per turn (random weights never call a tool), through the decoder."""

    def __init__(self, tokenizer, turns: list[str]):
        super().__init__()
        self.script = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in turns]
        self.turn, self.pos = -1, 0

    def pick(self, logits, generated, stop_ids, generator=None, banned_ids=()):
        out = []
        for n in generated:
            if n == 0:
                self.turn += 1
            tokens = self.script[self.turn % len(self.script)]
            out.append(tokens[n])
        return out


def test_prompt_equals_the_sft_rendering_prefix(processor, data_root, row_factory):
    row = row_factory()
    episode = new_episode(row, "f:1", "base", 0, EOGymEnvironment(row, data_root))
    ids, images = episode.prompt(processor, data_root)
    encoded = encode_conversation(processor, canonical_prompt(row).messages + [row_assistant(row)], canonical_prompt(row).tools)
    header_end = encoded.assistant_starts[0] + len(processor.tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"])
    assert _collapse(ids) == encoded.input_ids[:header_end]
    assert len(images) == 1 and ids.count(IMAGE_TOKEN_ID) == images[0].tokens == 300  # 640x480 -> 480x640 px
    full = encode_conversation(processor, *_normalized(row))  # the gold trace: the same prefix
    assert full.input_ids[:header_end] == encoded.input_ids[:header_end]


def test_episodes_of_one_question_share_its_preprocessed_images(processor, data_root, row_factory):
    from eogym_sft.agent.episodes import picture_cache

    row = row_factory()
    pictures = picture_cache(processor)
    first, second = (new_episode(row, "f:1", "base", k, EOGymEnvironment(row, data_root)) for k in (0, 1))
    _, images_first = first.prompt(processor, data_root, pictures=pictures)
    _, images_second = second.prompt(processor, data_root, pictures=pictures)
    assert len(images_first) == 1 and images_second[0] is images_first[0]  # decoded and resized once


def row_assistant(row):
    return {"role": "assistant", "content": "x"}


def _normalized(row):
    from eogym_sft.data.traces import normalize_row

    trace = normalize_row(row)
    return trace.messages, trace.tools


def test_question_only_rows_render(processor, data_root, row_factory):
    row = row_factory()
    row["messages"] = row["messages"][:2]
    ids, _ = new_episode(row, "f:1", "base", 0, EOGymEnvironment(row, data_root)).prompt(processor, data_root)
    assert processor.tokenizer.decode(ids[-5:]).endswith("<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model(0).eval()


def _turn_texts():
    call = json.dumps(CROP_CALL)
    return [f"I crop the harbour.\n<tool_call>\n{call}\n</tool_call><|im_end|>", "I count the hulls.\nFinal Answer: 3<|im_end|>"]


def test_scripted_policy_runs_tools_reuses_the_cache_and_round_trips_through_prepare(processor, data_root, row_factory, tiny):
    row = row_factory()
    envs = [EOGymEnvironment(row, data_root), EOGymEnvironment(row, data_root)]
    episodes = [new_episode(row, "f:1", "base", k, envs[k]) for k in range(2)]
    decoder = SlotDecoder(tiny, slots=1, max_len=2048)
    done = []
    stats = run_episodes(decoder, processor, iter(episodes), Scripted(processor.tokenizer, _turn_texts()), LoopConfig(4, 128), data_root, done.append)
    assert [e.stop for e in done] == ["final_answer", "final_answer"]
    assert (envs[0].counts["calls"], envs[0].counts["backend:crop"], envs[0].counts["errors"]) == (1, 1, 0)
    first = done[0].record()
    assert [m["role"] for m in first["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert first["messages"][2]["tool_calls"][0]["function"]["name"] == CROP_CALL["name"]
    assert (first["final_answer"], first["turns"], first["tool_calls"], first["tool_errors"]) == ("3", 2, 1, 0)
    scene, crop = first["images_seen"]
    assert scene == "EO_GYM_DATA/aaaa0000/scene.jpg" and crop.startswith("image_cache/crops/")
    assert json.loads(first["messages"][3]["content"])["bbox_px"] == [160, 120, 480, 360]  # 640x480, the middle half
    assert Image.open(data_root / crop).size == (320, 240)
    # the second episode starts from the first one's cached prompt; each turn recomputes only its new tokens
    assert stats["prefill_tokens"] < 2 * len(decoder.tokens[0])
    # where the run's seconds went: disjoint phases that add up to its wall time
    phases = [stats[name] for name in ("prefill_s", "decode_s", "tool_s", "other_s")]
    assert min(phases) >= 0 and stats["prefill_s"] > 0 and stats["decode_s"] > 0 and stats["tool_s"] > 0
    assert sum(phases) == pytest.approx(stats["seconds"])
    # data prep reads the episode as it is, and trains on exactly the tokens the model was given
    result = prepare_line(processor, PrepConfig(data_root=str(data_root), strict=True), "episodes.jsonl", 1, json.dumps(first).encode())
    assert result.status == "kept" and len(result.samples) == 1
    sample = result.samples[0]
    held = _collapse(decoder.tokens[0])  # the slot: the whole episode but the final <|im_end|>
    assert sample["input_ids"][: len(held)] == held
    assert processor.tokenizer.decode(sample["input_ids"][len(held) :]) == "<|im_end|>\n"
    assert len(sample["images"]) == 2


def test_samples_in_parallel_slots_encode_their_prompt_once(processor, data_root, row_factory, tiny):
    """Two samples of one question start together in two slots: the second slot copies the first's prompt
    (same token ids, the same image objects from the shared picture cache) and computes one token."""
    row = row_factory()
    fresh = new_episode(row, "f:1", "base", 0, EOGymEnvironment(row, data_root))
    prompt = len(fresh.prompt(processor, data_root)[0])
    # the slots' first turns in one call; past prefill_tokens, each slot's turn starts as soon as it is settled
    for budget, first_calls in ((16384, [([(0, prompt), (1, prompt)], prompt + 1)]), (1, [([(0, prompt)], prompt), ([(1, prompt)], 1)])):
        episodes = [new_episode(row, "f:1", "base", k, EOGymEnvironment(row, data_root)) for k in range(2)]
        decoder = SlotDecoder(tiny, slots=2, max_len=2048, prefill_tokens=budget)
        computed, prefill_many = [], decoder.prefill_many

        def counted(requests):
            logits = prefill_many(requests)
            computed.append(([(slot, len(ids)) for slot, ids, _ in requests], decoder.last_prefill_tokens))
            return logits

        decoder.prefill_many = counted
        run_episodes(decoder, processor, iter(episodes), Scripted(processor.tokenizer, _turn_texts()), LoopConfig(4, 128), data_root, lambda ep: None)
        assert computed[: len(first_calls)] == first_calls


def test_a_batched_prefill_that_fails_ends_only_the_episode_that_fails_alone(processor, data_root, row_factory, tiny):
    """Two episodes begin together; a forward holding slot 1's tokens fails. The batch is retried slot by slot
    (warned and counted): slot 0's episode runs on, slot 1's ends as ``error``, named."""
    row = row_factory()
    episodes = [new_episode(row, "f:1", "base", k, EOGymEnvironment(row, data_root)) for k in range(2)]
    decoder = SlotDecoder(tiny, slots=2, max_len=2048)
    forward = decoder._forward_chunks

    def failing(now, positions):
        if any(p.slot == 1 for p in now):
            raise ValueError("3 visual tokens for 4 <|image_pad|> tokens")
        return forward(now, positions)

    decoder._forward_chunks = failing
    done = []
    with pytest.warns(UserWarning, match="a prefill of 2 slots failed .ValueError: 3 visual tokens.*retried alone"):
        stats = run_episodes(decoder, processor, iter(episodes), Scripted(processor.tokenizer, _turn_texts()), LoopConfig(4, 128), data_root, done.append)
    assert stats["prefill_retries"] == 1
    by_sample = {ep.sample: ep for ep in done}
    assert by_sample[1].stop == "error" and by_sample[1].error == "ValueError: 3 visual tokens for 4 <|image_pad|> tokens"
    assert by_sample[0].stop != "error" and by_sample[0].turns >= 1


class _JudgeHandler(BaseHTTPRequestHandler):
    """A local chat-completions server: CORRECT when the candidate contains the reference; the first
    request for a candidate "flaky" fails with 500, "broken" always does, "chatty" gets an unusable reply."""

    seen: list = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        user = body["messages"][1]["content"]
        candidate = user.rsplit("Candidate answer:\n", 1)[1]
        reference = user.split("Reference answer:\n", 1)[1].split("\n\n", 1)[0]
        type(self).seen.append((body["model"], candidate, self.headers.get("Authorization")))
        if candidate == "broken" or (candidate == "flaky" and sum(c == "flaky" for _, c, _ in type(self).seen) == 1):
            self.send_response(500)
            self.end_headers()
            return
        reply = "Well, maybe." if candidate == "chatty" else ("CORRECT" if reference in candidate else "INCORRECT.")
        data = json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def judge_server():
    _JudgeHandler.seen = []
    server = HTTPServer(("127.0.0.1", 0), _JudgeHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1/chat/completions"
    server.shutdown()


def test_chat_judge_against_a_local_server(judge_server, monkeypatch):
    monkeypatch.setenv("TEST_JUDGE_KEY", "sk-test")
    judge = ChatJudge(judge_server, "gpt-4.1-mini", api_key_env="TEST_JUDGE_KEY", retries=1, backoff=0.0, timeout=5)
    items = [("How many?", "3 ships", "3"), ("How many?", "5", "3"), ("q", "flaky", "flaky"), ("q", "broken", "x"), ("q", "chatty", "x")]
    verdicts = judge_all(judge, items, workers=1)
    assert [v for v, _ in verdicts] == [True, False, True, None, None]
    assert "HTTPStatusError" in verdicts[3][1] and "answered 500 after 2 attempt(s)" in verdicts[3][1]
    assert "not CORRECT or INCORRECT" in verdicts[4][1]
    assert _JudgeHandler.seen[0] == ("gpt-4.1-mini", "3 ships", "Bearer sk-test")
    assert sum(c == "flaky" for _, c, _ in _JudgeHandler.seen) == 2  # retried once, then right
    assert parse_verdict("**Correct**") is True
    with pytest.raises(JudgeError):
        parse_verdict("")


def test_rollout_end_to_end_on_the_tiny_model(tmp_path, data_root, row_factory, tiny_model_dir, judge_server, capsys):
    from eogym_sft.cli import main

    question_only = row_factory(row_id="q2")
    question_only["messages"] = question_only["messages"][:2]
    question_only["gt_answer"] = "Final"
    data = tmp_path / "test.jsonl"
    data.write_text("\n".join([json.dumps(row_factory(row_id="q1")), json.dumps(question_only), "{broken"]) + "\n")
    out = tmp_path / "out"
    main([
        "rollout", "--model", str(tiny_model_dir), "--data", str(data), "--data-root", str(data_root), "--output", str(out),
        "--samples", "2", "--temperature", "1.0", "--max-turns", "2", "--max-new-tokens", "3", "--slots", "3",
        "--max-episode-tokens", "1024", "--judge-url", judge_server, "--judge-retries", "0", "--no-progress",
    ])
    episodes = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    assert sorted((e["source_id"], e["sample"]) for e in episodes) == [("q1", 0), ("q1", 1), ("q2", 0), ("q2", 1)]
    assert all(e["arm"] == "base" and e["turns"] == 1 for e in episodes)
    assert {e["stop_reason"] for e in episodes} <= {"max_new_tokens", "no_call", "final_answer", "invalid_call"}
    assert all(e["new_tokens"] <= 3 and e["gt_answer"] in ("3", "Final") for e in episodes)
    overall = summary["arms"]["base"]["overall"]
    assert (overall["questions"], overall["episodes"]) == (2, 4)
    assert set(overall) >= {"pass@1", "pass@2", "mean_score", "tool_any", "tool_error_rate", "stop_reasons", "turns_per_episode"}
    assert summary["counts"]["rows_failed"] == 1 and summary["settings"]["ks"] == [1, 2]
    assert summary["settings"]["cuda_graphs"] is False  # asked for by default, replayed only on a GPU
    skipped = [json.loads(line) for line in (out / "skipped.jsonl").read_text().splitlines()]
    assert skipped[0]["reason"] == "malformed_json" and skipped[0]["source"].endswith(":3")
    assert "pass@2" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="holds a run with other settings"):  # one line, no traceback
        main(["rollout", "--model", str(tiny_model_dir), "--data", str(data), "--data-root", str(data_root), "--output", str(out), "--no-progress"])


def test_an_environment_that_fails_ends_its_episodes_only(tmp_path, data_root, row_factory, tiny_model_dir):
    from eogym_sft.environment.env import EOGymEnvironment
    from eogym_sft.evaluation.rollout import RolloutConfig, rollout

    data = tmp_path / "test.jsonl"
    data.write_text("\n".join(json.dumps(row_factory(row_id=i)) for i in ("ok", "refused")) + "\n")

    def factory(row):
        if row["id"] == "refused":
            raise ValueError("this row's tools cannot be served")
        return EOGymEnvironment(row, data_root)

    cfg = RolloutConfig(model=str(tiny_model_dir), data=[str(data)], data_root=str(data_root), output=str(tmp_path / "out"),
                        max_new_tokens=2, max_turns=1, slots=2, max_episode_tokens=1024)
    summary = rollout(cfg, progress=False, env_factory=factory)
    episodes = {e["source_id"]: e for e in map(json.loads, (tmp_path / "out" / "episodes.jsonl").read_text().splitlines())}
    assert episodes["refused"]["stop_reason"] == "error" and "cannot be served" in episodes["refused"]["error"]
    assert episodes["ok"]["stop_reason"] != "error" and summary["counts"]["episode_errors"] == 1
    skipped = [json.loads(line) for line in (tmp_path / "out" / "skipped.jsonl").read_text().splitlines()]
    assert [(s["episode"], s["reason"]) for s in skipped] == [("refused:base:0", "episode_error")]


def test_cuda_graphs_flag():
    import argparse

    from eogym_sft.evaluation.run_args import add_rollout_args

    parser = argparse.ArgumentParser()
    add_rollout_args(parser)
    base = ["--model", "m", "--data", "d.jsonl", "--output", "o"]
    assert parser.parse_args(base).cuda_graphs is True
    assert parser.parse_args([*base, "--no-cuda-graphs"]).cuda_graphs is False


def test_rollout_with_a_wrong_data_root_stops_with_the_likely_cause(tmp_path, row_factory, tiny_model_dir):
    from eogym_sft.cli import main

    data = tmp_path / "test.jsonl"
    data.write_text("\n".join(json.dumps(row_factory(row_id=f"q{k}")) for k in range(3)) + "\n\n")
    argv = ["rollout", "--model", str(tiny_model_dir), "--data", str(data), "--data-root", str(tmp_path), "--output", str(tmp_path / "out"), "--no-progress"]
    with pytest.raises(SystemExit, match=r"^eogym-sft rollout: 3 of 3 rows dropped as missing_image .*likely cause: the images are not under --data-root"):
        main(argv)
    assert not (tmp_path / "out").exists()
