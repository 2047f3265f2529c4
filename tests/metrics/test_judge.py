"""The judge's verdict parser reads the verdict the prompt asks for and fails closed; ChatJudge refuses
settings that would fail every request."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from eogym_sft.metrics.judge import ChatJudge, JudgeError, parse_verdict

VERDICTS = [
    ("CORRECT", True),
    ("INCORRECT", False),
    ("Correct,", True),
    ("correct", True),
    ("**CORRECT**", True),
    ("INCORRECT.", False),
    ("Verdict: CORRECT", True),
    ("NOT CORRECT", False),
    ("not correct.", False),
    ("The candidate is NOT CORRECT.", False),
    ("Correct answer would be 7; the candidate says 5, so INCORRECT.", False),
    ("Incorrect answer aside, the values agree: CORRECT", True),
    ("<think>The reference is 3 and so is the candidate.</think> CORRECT", True),
    ("<think>CORRECT? no: 5 is not 3</think>\nINCORRECT", False),
    ("<THINK>maybe INCORRECT</THINK>CORRECT.", True),
    ("Reply: CORRECT or INCORRECT? CORRECT", True),
    ("The answer is correct.", True),
    ("The answer isn't correct", False),
    ("CORRECT? Checking the units again... INCORRECT.", False),
]
UNCLEAR = [
    "",
    "   ",
    "Well, maybe.",
    "The correct answer is 7.",  # a lower-case 'correct' mid-sentence is no verdict
    "<think>CORRECT</think>",  # the verdict only inside the reasoning
    "<think>the units agree, so CORRECT",  # reasoning never closed
    "NOT INCORRECT",
    "CORRECT or INCORRECT",
    "Correctness: unclear",
    "INCORRECTLY phrased",
]


@pytest.mark.parametrize("reply,verdict", VERDICTS)
def test_parse_verdict_reads_the_verdict_the_prompt_asks_for(reply, verdict):
    assert parse_verdict(reply) is verdict


@pytest.mark.parametrize("reply", UNCLEAR)
def test_parse_verdict_fails_closed_on_an_unclear_reply(reply):
    with pytest.raises(JudgeError, match="not CORRECT or INCORRECT|never ends"):
        parse_verdict(reply)


PROSE = st.text(alphabet=st.sampled_from("abdefghijklmnopqsuvwxyz ,.;\n0123456789"), max_size=200)  # no verdict word can form


@given(PROSE, st.sampled_from([("CORRECT", True), ("INCORRECT", False), ("NOT CORRECT", False)]), PROSE)
def test_a_capital_verdict_in_prose_is_read(before, verdict, after):
    word, expected = verdict
    assert parse_verdict(f"{before} {word} {after}") is expected


@given(PROSE)
def test_prose_without_a_verdict_is_a_failed_request(text):
    with pytest.raises(JudgeError):
        parse_verdict(text)


@given(st.text(max_size=300))
def test_any_reply_gives_a_verdict_or_a_judge_error(text):
    try:
        assert parse_verdict(text) in (True, False)
    except JudgeError:
        pass


@pytest.mark.parametrize(
    "setting,message",
    [
        ({"timeout": 0}, "timeout must be a positive number of seconds, got 0"),
        ({"timeout": float("nan")}, "timeout must be a positive number of seconds, got nan"),
        ({"retries": -1}, "retries must be a whole number >= 0, got -1"),
        ({"retries": 1.5}, "retries must be a whole number >= 0, got 1.5"),
        ({"backoff": -1.0}, "backoff must be zero or a positive number of seconds, got -1.0"),
        ({"max_bytes": 0}, "max_bytes must be a whole number >= 1, got 0"),
    ],
)
def test_chat_judge_refuses_settings_that_fail_every_request(setting, message):
    with pytest.raises(ValueError) as err:
        ChatJudge("http://127.0.0.1:9/v1/chat/completions", "m", **setting)
    assert str(err.value) == f"the judge's {message}"
