"""The agent demo's report (eogym_sft/demo_report.py): GRPO's reward read from the run, by quarter, and the
report and its table."""

from __future__ import annotations

import pytest


def test_grpo_per_step_reads_the_last_checkpoint(tmp_path):
    import json

    from eogym_sft.demo_report import grpo_per_step

    for step, rewards in ((2, [0.1, 0.2]), (10, [0.1, 0.2, 0.3])):
        (tmp_path / f"checkpoint-{step}").mkdir()
        history = [{"reward": r, "step": i + 1} for i, r in enumerate(rewards)] + [{"train_runtime": 1.0}]
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    assert grpo_per_step(tmp_path) == [0.1, 0.2, 0.3] and grpo_per_step(tmp_path, "step") == [1, 2, 3]
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        grpo_per_step(tmp_path / "checkpoint-2")


def test_agent_report_and_table(tmp_path):
    from eogym_sft.demo import AgentDemoConfig
    from eogym_sft.demo_report import agent_report, format_agent_report

    def overall(p1, tool):
        return {"pass@1": p1, "pass@2": min(1.0, 2 * p1), "mean_score": p1, "tool_any": tool, "calls_per_episode": tool,
                "answered": 1.0, "questions": 4, "episodes": 8, "stop_reasons": {"final_answer": 8}}

    summary = {
        "arms": {"base": {"overall": overall(0.0, 0.0)}, "sft": {"overall": overall(0.75, 1.0)}},
        "paired": [{"a": "base", "b": "sft", "metric": "pass@1", "delta": 0.75, "n": 4, "ci95": [0.3, 1.2], "ci_method": "paired t"}],
    }
    report = agent_report(summary, [0.2, 0.5], {"episodes_sampled": 8, "episodes_kept": 5, "rows_trained": 9}, {"sft": 1.5, "grpo": 2.0},
                          AgentDemoConfig(samples=2, grpo_num_iterations=1))
    assert report["arms"]["sft"]["pass@1"] == 0.75 and report["arms"]["base"]["tool_any"] == 0.0
    assert report["arms"]["sft"]["episodes"] == 8 and report["seconds"]["total"] == 3.5
    text = format_agent_report(report, tmp_path)
    assert "  sft      0.750   1.000   0.750     1.000     1.000" in text
    assert "paired over questions (B - A, 95% CI, paired t):" in text and "sft - base pass@1   +0.750 [+0.300, +1.200]  n=4" in text
    assert "GRPO training reward per step: 0.20 0.50" in text and "kept 5 correct of 8" in text
    assert report["grpo_reward_by_quarter"] is None and "by quarter" not in text  # too few steps for quarters
    twice = agent_report(summary, [0.2, 0.5], None, {}, AgentDemoConfig(samples=2, grpo_num_iterations=2))
    assert "GRPO training reward per generated batch (every 2 steps): 0.20 0.50" in format_agent_report(twice, tmp_path)


def test_the_reward_by_quarter_is_the_mean_of_consecutive_steps_when_each_quarter_has_five():
    from eogym_sft.demo_report import reward_by_part

    steps = [0.0] * 5 + [1.0] * 5 + [0.5] * 5 + [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]  # 21 steps: the last quarter takes the rest
    assert reward_by_part(steps) == [0.0, 1.0, 0.5, 0.5]
    assert reward_by_part([0.25] * 19) is None  # a quarter of 4 steps would follow the 4 questions drawn
    assert reward_by_part([0.0, 1.0, 1.0, 1.0, 1.0, 1.0]) is None  # the demo's 6 steps: quarters of 1, 1, 1 and 3
    assert reward_by_part([]) is None


def test_late_reward_change_is_the_last_quarter_minus_the_third_with_welchs_t():
    from eogym_sft.demo_report import late_reward_change

    third, last = [0.6, 0.2, 0.6, 0.2, 0.6], [0.2, 0.6, 0.2, 0.6, 0.2]  # means 0.44 and 0.36, each variance 0.048
    change = late_reward_change([0.4] * 10 + third + last)
    half = 2.306004135204 * (2 * 0.048 / 5) ** 0.5  # t(0.975) at Welch's 8 degrees of freedom
    assert change["delta"] == pytest.approx(-0.08) and change["ci95"] == pytest.approx([-0.08 - half, -0.08 + half])
    assert late_reward_change([0.1] * 15 + [0.3] * 6) == {"delta": pytest.approx(0.2), "ci95": [pytest.approx(0.2)] * 2}
    assert late_reward_change([0.25] * 19) is None
