"""The episode reward: score x (1 - min(calls x cost x scale, cap)), its counts and diagnostics."""

from __future__ import annotations

import json

import pytest

from eogym_sft.training.rewards import (
    EpisodeReward,
    final_answer,
    group_spread,
    question_text,
)

END = 151645
CROP = {"type": "function", "function": {"name": "crop", "arguments": {"aoi": [0, 0, 1, 1]}}}


def call_turn(n: int = 1) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [CROP] * n}


def tool_turn(text: str = "{}") -> dict:
    return {"role": "tool", "name": "crop", "content": [{"type": "text", "text": text}]}


def answer(text: str) -> dict:
    return {"role": "assistant", "content": text}


class Env:
    def __init__(self, calls: int, errors: int = 0):
        self.tool_calls, self.tool_errors = calls, errors


@pytest.mark.parametrize(
    "messages, executed, expected_reward, expected_calls",
    [
        ([answer("Final Answer: 3")], 0, 1.0, 0),  # right, no tools
        ([call_turn(), tool_turn(), answer("Final Answer: 3")], 1, 0.98, 1),  # 1 x 0.1 x 0.2 = 0.02 taken
        ([call_turn(3), tool_turn(), tool_turn(), tool_turn(), answer("Final Answer: 3.0")], 3, 0.94, 3),
        ([call_turn(20), answer("Final Answer: 3")], 20, 0.8, 20),  # the cost is capped at 0.2
        ([call_turn(), tool_turn(), answer("Final Answer: 4")], 1, 0.0, 1),  # wrong
        ([call_turn(), tool_turn()], 1, 0.0, 1),  # never answered
    ],
)
def test_reward_is_the_score_less_the_capped_action_cost(messages, executed, expected_reward, expected_calls):
    reward = EpisodeReward(num_generations=2)
    (correct,) = reward.verdicts(["How many?"], [final_answer(messages)], ["3"])
    out = reward.outcome(messages, [1, END], correct, executed)
    assert out.reward == pytest.approx(expected_reward)
    assert out.tool_calls == expected_calls
    assert out.invalid_calls == 0
    assert out.turns == sum(m["role"] == "assistant" for m in messages)


def test_invalid_calls_are_counted_and_cost_like_any_call():
    messages = [
        call_turn(2),  # the environment ran one and refused it; TRL refused the other (unknown to it)
        tool_turn("Error: bad arguments"),
        tool_turn("{'error': 'Tool nope not found.'}"),
        answer('<tool_call>\n{"name": broken\n</tool_call>'),  # did not parse: TRL keeps the text
        answer("Final Answer: 3"),
    ]
    out = EpisodeReward(num_generations=2).outcome(messages, [END], True, executed=1, failed=1)
    assert (out.tool_calls, out.invalid_calls) == (3, 3)
    assert out.reward == pytest.approx(1 - 3 * 0.1 * 0.2)


def test_a_truncated_episode_is_flagged():
    out = EpisodeReward(num_generations=2).outcome([answer("I think")], [5, 6], False)
    assert out.truncated and out.answer is None and out.reward == 0.0


def test_a_failing_judge_leaves_the_episode_unscored_and_counts():
    def judge(question, prediction, reference):
        if prediction == "boom":
            raise TimeoutError("judge down")
        return prediction.lower() == "three" and reference == "3" and question == "How many?"

    reward = EpisodeReward(num_generations=2, judge=judge)
    verdicts = reward.verdicts(["How many?"] * 3, ["three", "boom", None], ["3"] * 3)
    assert verdicts == [True, None, False]  # no answer: wrong without asking the judge
    assert reward.judge_errors == 1
    assert reward.outcome([answer("Final Answer: boom")], [END], None).reward is None


def test_call_logs_components_and_group_spread():
    metrics, extra = {}, {}
    reward = EpisodeReward(num_generations=2)
    completions = [
        [call_turn(), tool_turn(), answer("Final Answer: 3")],
        [answer("Final Answer: 2")],
        [answer("Final Answer: 7")],
        [answer("Final Answer: 7")],
    ]
    prompts = [[{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "How many?"}]}]] * 4
    rewards = reward(
        prompts, completions, [[END]] * 4, ["3", "3", "7", "7"], environments=[Env(1), Env(0), Env(0), Env(0)],
        log_metric=metrics.__setitem__, log_extra=extra.__setitem__,
    )
    assert rewards == pytest.approx([0.98, 0.0, 1.0, 1.0])
    assert metrics["reward/group_std"] == pytest.approx((0.49 + 0.0) / 2)
    assert metrics["reward/score"] == pytest.approx(0.75)
    assert metrics["reward/cost_penalty"] == pytest.approx(0.005)
    assert metrics["episode/tool_calls"] == pytest.approx(0.25)
    assert metrics["episode/turns"] == pytest.approx(1.25)
    assert metrics["episode/answered"] == 1.0 and metrics["episode/truncated"] == 0.0
    assert json.loads(extra["episode"][0])["penalty"] == pytest.approx(0.02)


def test_group_spread():
    assert group_spread([1.0, 0.0, 0.5, 0.5], 2) == 0.25
    assert group_spread([1.0, None, 0.0, 1.0], 2) == 0.5  # a group with one scored episode is skipped
    assert group_spread([1.0, 0.0, 1.0], 2) is None  # not whole groups
    assert final_answer([answer("x\nFinal Answer: 5")]) == "5" and final_answer([call_turn()]) is None
    assert question_text([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]) == "a"


def test_the_judge_settings_name_one_judge():
    from eogym_sft.metrics.judge import ChatJudge
    from eogym_sft.training.grpo import GRPOScriptArguments

    assert GRPOScriptArguments().load_judge() is None
    chat = GRPOScriptArguments(judge_url="http://127.0.0.1:9/v1/chat/completions").load_judge()
    assert isinstance(chat, ChatJudge) and chat.model == "gpt-4.1-mini"
    assert GRPOScriptArguments(judge="eogym_sft.metrics.scoring:normalize_answer").load_judge().__name__ == "normalize_answer"
    with pytest.raises(ValueError, match="not both"):
        GRPOScriptArguments(judge="a:b", judge_url="http://x")


def test_a_truncated_episode_scores_zero_even_with_a_final_answer():
    """docs/rl.md: truncated episodes score as unanswered. Its cut text holds the right answer; it must not
    take the group's reward (and so the advantage) from the correct episode beside it."""
    asked = []

    def judge(question, prediction, reference):
        asked.append(prediction)
        return prediction == reference

    reward = EpisodeReward(num_generations=2, judge=judge)
    prompts = [[{"role": "user", "content": "How many?"}]] * 2
    completions = [[answer("Final Answer: 3")], [answer("Final Answer: 3\nand then some more words and")]]
    rewards = reward(prompts, completions, [[7, END], [7, 8, 9]], ["3", "3"])
    assert rewards == [1.0, 0.0]
    assert asked == ["3"]  # the cut episode is not judged
    out = reward.outcome(completions[1], [7, 8, 9], True)
    assert out.truncated and out.answer == "3" and (out.score, out.reward) == (0.0, 0.0)


def _gold_row(aoi) -> str:
    """An EO-Gym row whose trace crops ``aoi`` once, then answers 3 (the ``row`` column TRL hands the reward)."""
    call = {"type": "function", "function": {"name": "crop", "arguments": json.dumps({"aoi": aoi})}}
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "How many?"},
                {"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": "{}"},
                {"role": "assistant", "content": "Final Answer: 3"}]
    return json.dumps({"id": "r", "messages": messages, "gt_answer": "3"})


def crop_turn(aoi, name="crop") -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {"aoi": aoi}}}]}


def test_the_crop_term_is_off_by_default_and_adds_the_weighted_iou():
    """Gold box [0, 0, 0.5, 0.5]. Episode 1 crops it exactly and answers right: 0.98 + 0.5 x 1. Episode 2 crops half
    of it (IoU 0.5) and answers wrong: 0 + 0.5 x 0.5. Episode 3 crops with another tool: IoU 0. Episode 4 is cut."""
    completions = [
        [crop_turn([0, 0, 0.5, 0.5]), tool_turn(), answer("Final Answer: 3")],
        [crop_turn([0, 0, 0.5, 0.25]), tool_turn(), answer("Final Answer: 4")],
        [crop_turn([0, 0, 0.5, 0.5], name="zoom"), tool_turn(), answer("Final Answer: 3")],
        [crop_turn([0, 0, 0.5, 0.5]), tool_turn(), answer("Final Answer: 3 and")],
    ]
    ids = [[END], [END], [END], [5]]
    prompts = [[{"role": "user", "content": "How many?"}]] * 4
    rows = [_gold_row([0, 0, 0.5, 0.5])] * 4
    envs = [Env(1)] * 4
    off = EpisodeReward(num_generations=2)(prompts, completions, ids, ["3"] * 4, environments=envs, row=rows)
    assert off == pytest.approx([0.98, 0.0, 0.98, 0.0])
    metrics = {}
    on = EpisodeReward(num_generations=2, crop_iou_weight=0.5)(
        prompts, completions, ids, ["3"] * 4, environments=envs, row=rows, log_metric=metrics.__setitem__
    )
    assert on == pytest.approx([0.98 + 0.5, 0.25, 0.98, 0.0])
    assert metrics["reward/crop_iou"] == pytest.approx((1 + 0.5 + 0 + 1) / 4)  # logged for the cut episode too
    no_box = json.dumps({"id": "q", "messages": [{"role": "user", "content": "How many?"}], "gt_answer": "3"})
    out = EpisodeReward(num_generations=2, crop_iou_weight=0.5)(prompts[:1], completions[:1], ids[:1], ["3"], row=[no_box])
    assert out == pytest.approx([0.98])  # a question-only row has no gold box: no term


def test_the_crop_weight_is_a_recipe_setting_checked_at_start():
    from eogym_sft.training.grpo import GRPOScriptArguments

    assert GRPOScriptArguments().crop_iou_weight == 0.0
    with pytest.raises(ValueError, match="crop_iou_weight must be >= 0"):
        GRPOScriptArguments(crop_iou_weight=-1)
