"""bench/agent_seeds.py: the per-seed table's arithmetic and each seed's process environment."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import agent_seeds  # noqa: E402


def test_settings_parse_json_values_and_bare_strings():
    assert agent_seeds.parse_settings(["grpo_beta=0.04", "task=colour_count", "grpo_steps=120", "device=\"cuda\""]) == {
        "grpo_beta": 0.04, "task": "colour_count", "grpo_steps": 120, "device": "cuda"}


def test_by_part_averages_equal_runs_and_keeps_short_curves_whole():
    assert agent_seeds.by_part([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    values = [float(v) for v in range(22)]  # 4 parts of 5, the last takes the remainder
    assert agent_seeds.by_part(values) == [2.0, 7.0, 12.0, 18.0]


def test_seed_row_reads_the_paired_pass_at_1_and_the_table_counts_seeds():
    report = {
        "arms": {"sft": {"pass@1": 0.25}, "grpo": {"pass@1": 0.5}},
        "paired": [{"a": "sft", "b": "grpo", "metric": "tool_any", "delta": 0.0, "ci95": [0, 0]},
                   {"a": "sft", "b": "grpo", "metric": "pass@1", "delta": 0.25, "ci95": [0.1, 0.4], "ci_method": "paired t"}],
        "grpo_reward_per_step": [0.1, 0.2], "grpo_entropy_per_step": [0.05, 0.04], "wall_s": 9.0,
    }
    row = agent_seeds.seed_row(3, report)
    assert row == {"seed": 3, "sft": 0.25, "grpo": 0.5, "delta": 0.25, "ci95": [0.1, 0.4], "ci_method": "paired t",
                   "reward_by_part": [0.1, 0.2], "entropy_by_part": [0.05, 0.04], "wall_s": 9.0}
    worse = row | {"seed": 4, "delta": -0.1, "ci95": [-0.3, 0.1]}
    assert agent_seeds.format_table([row, worse]).splitlines()[-1] == (
        "mean GRPO-SFT +0.075 over 2 seeds; GRPO >= SFT in 1; CI lower bound > 0 in 1")


def test_each_seed_gets_its_share_of_the_cores_unless_threads_are_set():
    assert agent_seeds.child_env(5, {"PATH": "/bin"}, cpus=16) == {"PATH": "/bin", "OMP_NUM_THREADS": "3"}
    assert agent_seeds.child_env(32, {}, cpus=16)["OMP_NUM_THREADS"] == "1"
    assert agent_seeds.child_env(5, {"OMP_NUM_THREADS": "8"}, cpus=16)["OMP_NUM_THREADS"] == "8"
