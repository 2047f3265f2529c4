"""The rejection-sampling filter on rollout episodes: which episodes each rule keeps, bad lines named and
counted, and the command's refusals."""

from __future__ import annotations

import json
import os

import pytest

from eogym_sft.cli import main
from eogym_sft.evaluation.episodes_filter import filter_episodes, keeps


def episode(i, correct, stop="final_answer", arm="sft"):
    return {"id": f"q{i}:{arm}:0", "arm": arm, "messages": [{"role": "user", "content": "q"}], "stop_reason": stop, "correct": correct}


EPISODES = [
    episode(0, True),
    episode(1, False),
    episode(2, None),  # unscored
    episode(3, True, stop="max_turns"),  # right answer field but no final answer of its own: not kept as correct
    episode(4, False, stop="error"),
    episode(5, True, arm="base"),
]


@pytest.mark.parametrize(
    "rule, kept", [("correct", ["q0:sft:0", "q5:base:0"]), ("incorrect", ["q1:sft:0"]), ("all", ["q0:sft:0", "q1:sft:0", "q2:sft:0", "q3:sft:0", "q5:base:0"])]
)
def test_each_rule_keeps_what_the_docs_say(tmp_path, rule, kept):
    src, dst = tmp_path / "episodes.jsonl", tmp_path / "kept.jsonl"
    src.write_text("".join(json.dumps(e) + "\n" for e in EPISODES))
    stats = filter_episodes(src, dst, rule)
    assert [json.loads(line)["id"] for line in dst.read_text().splitlines()] == kept
    assert (stats["read"], stats["kept"], stats["skipped"]) == (6, len(kept), 0)


def test_arm_and_bad_lines(tmp_path):
    src, dst = tmp_path / "episodes.jsonl", tmp_path / "kept.jsonl"
    src.write_text(json.dumps(EPISODES[0]) + "\n{not json\n" + json.dumps({"id": "x"}) + "\n\n" + json.dumps(EPISODES[5]) + "\n")
    stats = filter_episodes(src, dst, "correct", arm="sft")
    assert stats["kept"] == 1 and stats["skipped"] == 2
    assert stats["skipped_lines"][0].startswith(f"{src}:2: ") and stats["skipped_lines"][1].startswith(f"{src}:3: not a rollout episode")
    with pytest.raises(ValueError, match="unknown filter"):
        keeps(EPISODES[0], "best")


def test_the_command(tmp_path, capsys):
    src, dst = tmp_path / "episodes.jsonl", tmp_path / "kept.jsonl"
    src.write_text("".join(json.dumps(e) + "\n" for e in EPISODES))
    main(["episodes", "--filter", "incorrect", "--input", str(src), "--output", str(dst)])
    assert "kept 1 of 6 episodes (incorrect)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="exists"):
        main(["episodes", "--input", str(src), "--output", str(dst)])
    with pytest.raises(SystemExit, match=r"no episode of 6 passed --filter correct .*: nothing to train on, .*none.jsonl not written"):
        main(["episodes", "--input", str(src), "--output", str(tmp_path / "none.jsonl"), "--arm", "rft"])
    assert not (tmp_path / "none.jsonl").exists()  # no 0-byte file to block the next run
    with pytest.raises(SystemExit, match="no such input file"):
        main(["episodes", "--input", str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "o.jsonl")])


def test_the_output_is_never_the_input(tmp_path):
    src = tmp_path / "episodes.jsonl"
    src.write_text("".join(json.dumps(e) + "\n" for e in EPISODES))
    (tmp_path / "link.jsonl").symlink_to(src)
    os.link(src, tmp_path / "hard.jsonl")
    for output in (src, tmp_path / "link.jsonl", tmp_path / "hard.jsonl"):
        refused = f"eogym-sft episodes: the output {output} is the input {src}: writing it would destroy the input"
        with pytest.raises(SystemExit, match=refused):
            main(["episodes", "--filter", "all", "--input", str(src), "--output", str(output), "--overwrite"])
    assert len(src.read_text().splitlines()) == 6


def test_hostile_lines_are_skipped_one_by_one(tmp_path):
    src, dst = tmp_path / "episodes.jsonl", tmp_path / "kept.jsonl"
    good = json.dumps(EPISODES[0]).encode()
    deep = b"[" * 100000 + b"]" * 100000
    bigint = b'{"n": ' + b"9" * 5000 + b"}"
    src.write_bytes(b"\n".join([good, b'{"id": "\xff"}', deep, bigint, good.replace(b"q0", b"q9")]) + b"\n")
    stats = filter_episodes(src, dst, "correct")
    assert (stats["read"], stats["kept"], stats["skipped"]) == (5, 2, 3)
    assert [w.split(": ")[1] for w in stats["skipped_lines"]] == ["malformed_json", "json_too_deep", "json_number_too_long"]
    assert [json.loads(line)["id"] for line in dst.read_text().splitlines()] == ["q0:sft:0", "q9:sft:0"]


def test_any_text_reads_back_the_same(tmp_path):
    odd = {**EPISODES[0], "messages": [{"role": "tool", "content": "a\ud800b\u2028c\u2029d\x85e\u00e9"}]}
    src, dst = tmp_path / "episodes.jsonl", tmp_path / "kept.jsonl"
    src.write_text(json.dumps(odd) + "\n")
    assert filter_episodes(src, dst, "correct")["kept"] == 1
    assert dst.read_bytes().isascii() and len(dst.read_bytes().split(b"\n")) == 2
    assert json.loads(dst.read_bytes()) == odd
