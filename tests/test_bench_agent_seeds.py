"""bench/agent_seeds.py: the per-seed table's arithmetic and each seed's process environment."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import agent_seeds  # noqa: E402


def test_settings_parse_json_values_and_bare_strings():
    assert agent_seeds.parse_settings(["grpo_beta=0.04", "task=colour_count", "grpo_steps=120", "device=\"cuda\""]) == {
        "grpo_beta": 0.04, "task": "colour_count", "grpo_steps": 120, "device": "cuda"}


PLATEAU = [0.4] * 10 + [0.6, 0.2, 0.6, 0.2, 0.6] + [0.2, 0.6, 0.2, 0.6, 0.2]  # quarters 0.44 then 0.36


def _report(sft, grpo, delta, ci, sft4, grpo4, ci4, rewards):
    return {
        "arms": {"sft": {"pass@1": sft, "pass@4": sft4}, "grpo": {"pass@1": grpo, "pass@4": grpo4}},
        "paired": [{"a": "sft", "b": "grpo", "metric": "tool_any", "delta": 0.0, "ci95": [0, 0]},
                   {"a": "sft", "b": "grpo", "metric": "pass@1", "delta": delta, "ci95": ci, "ci_method": "paired t"},
                   {"a": "sft", "b": "grpo", "metric": "pass@4", "delta": grpo4 - sft4, "ci95": ci4}],
        "grpo_reward_per_step": rewards, "grpo_entropy_per_step": [0.05, 0.04], "wall_s": 9.0, "settings": {"samples": 4},
    }


def test_seed_row_reads_pass_at_1_and_pass_at_k_and_keeps_a_failed_seed():
    row = agent_seeds.seed_row(3, _report(0.25, 0.5, 0.25, [0.1, 0.4], 0.5, 0.625, [-0.05, 0.3], [0.1, 0.2]))
    assert row == {"seed": 3, "sft": 0.25, "grpo": 0.5, "delta": 0.25, "ci95": [0.1, 0.4], "k": 4, "sft_pass_k": 0.5,
                   "grpo_pass_k": 0.625, "pass_k_delta": 0.125, "pass_k_ci95": [-0.05, 0.3], "reward_by_part": [0.1, 0.2], "late_reward_ci95": None,
                   "entropy_by_part": [0.05, 0.04], "picked": None, "wall_s": 9.0, "grpo_param_prefix": None,
                   "grpo_param_prefix_aoi@0.5": None, "grpo_arg_acc_aoi@0.5": None}
    assert agent_seeds.seed_row(5, {"failed": 1, "wall_s": 2.0}) == {"seed": 5, "failed": 1, "wall_s": 2.0}
    with_base = _report(0.25, 0.5, 0.25, [0.1, 0.4], 0.5, 0.625, [-0.05, 0.3], [0.1, 0.2])
    with_base["arms"]["base"] = {"pass@1": 0.0}
    assert agent_seeds.seed_row(3, with_base) == row | {"base": 0.0}


def test_criteria_count_issue_64s_checks_and_a_failed_seed_fails_them():
    rising = [0.1] * 5 + [0.2] * 5 + [0.3] * 5 + [0.4] * 5
    falling = rising[:15] + [0.25] * 5
    good = agent_seeds.seed_row(0, _report(0.4, 0.6, 0.2, [0.1, 0.3], 0.6, 0.6, [-0.1, 0.1], rising))
    worse = agent_seeds.seed_row(1, _report(0.4, 0.35, -0.05, [-0.1, 0.0], 0.7, 0.4, [-0.4, -0.2], falling))
    c = agent_seeds.criteria([good, worse])
    assert c["mean_delta"] == pytest.approx(0.075, abs=1e-12)
    assert (c["grpo_ge_sft"], c["ci_above_0"], c["pass_k_held"], c["late_reward_held"], c["sft_range"]) == (1, 1, 1, 1, [0.4, 0.4])
    assert (good["late_reward_ci95"], worse["late_reward_ci95"], c["late_reward_rose"]) == (pytest.approx([0.1, 0.1]), pytest.approx([-0.05, -0.05]), 1)
    # a plateau whose last quarter drew harder questions: below the third's, within its CI, so held
    plateau = agent_seeds.seed_row(2, _report(0.4, 0.6, 0.2, [0.1, 0.3], 0.6, 0.6, [-0.1, 0.1], PLATEAU))
    assert plateau["reward_by_part"][3] < plateau["reward_by_part"][2] and plateau["late_reward_ci95"][1] > 0
    assert agent_seeds.criteria([plateau])["late_reward_held"] == 1 and agent_seeds.criteria([plateau])["late_reward_rose"] == 0
    assert c["checks"] == {"grpo_ge_sft_every_seed": False, "ci_above_0_in_2": False, "mean_ge_0.10": False,
                           "pass_k_held_in_2": False, "late_reward_held_every_seed": False}
    ten = agent_seeds.criteria([good | {"seed": s} for s in range(9)] + [agent_seeds.seed_row(9, {"failed": 1, "wall_s": 1.0})])
    assert (ten["seeds"], ten["failed"], ten["ci_above_0"], ten["meets_issue_64"]) == (10, 1, 9, False)
    assert ten["checks"]["ci_above_0_in_8"] and ten["checks"]["pass_k_held_in_8"] and not ten["checks"]["grpo_ge_sft_every_seed"]
    assert agent_seeds.criteria([good | {"seed": s} for s in range(10)])["meets_issue_64"]
    table = agent_seeds.format_table([good, worse, agent_seeds.seed_row(2, {"failed": 1, "wall_s": 1.0})]).splitlines()
    assert table[3] == "   2  failed (exit 1)"
    assert table[4].startswith("mean GRPO-SFT +0.075 over 2 seeds (1 failed); GRPO >= SFT in 1; CI lower bound > 0 in 1;")
    assert table[5].endswith("-> not met")


def test_against_compares_the_grpo_arms_of_two_runs_seed_by_seed():
    def row(seed, grpo, arg_acc):
        report = _report(0.25, grpo, grpo - 0.25, [0.0, 0.1], 0.5, 0.5, [0.0, 0.0], [0.1])
        report["arms"]["grpo"]["arg_acc_aoi@0.5"] = arg_acc
        return agent_seeds.seed_row(seed, report)

    baseline = [row(0, 0.5, 0.5), row(1, 0.25, None), row(2, 0.75, 0.5), row(3, 0.5, 0.5)]
    rows = [row(0, 0.75, 0.75), row(1, 0.5, 0.75), row(2, 0.75, 1.0), agent_seeds.seed_row(3, {"failed": 1, "wall_s": 1.0})]
    out = agent_seeds.against(rows, baseline)
    assert set(out) == {"grpo", "grpo_arg_acc_aoi@0.5"}  # a figure neither run has is left out
    assert {k: out["grpo"][k] for k in ("n", "mean_a", "mean_b", "delta", "wins", "losses", "ties")} == {
        "n": 3, "mean_a": 0.5, "mean_b": 2 / 3, "delta": pytest.approx(1 / 6), "wins": 2, "losses": 0, "ties": 1}
    assert out["grpo_arg_acc_aoi@0.5"]["n"] == 2 and out["grpo_arg_acc_aoi@0.5"]["delta"] == pytest.approx(0.375)
    assert out["grpo"]["ci95"][0] < 1 / 6 < out["grpo"]["ci95"][1]


def test_a_headline_takes_report_seeds_only_and_the_roles_are_written_before_any_seed_runs(tmp_path, monkeypatch):
    assert agent_seeds.protocol("colour_grid", list(range(30, 40)), True)["role"] == "report"
    assert agent_seeds.protocol("colour_grid", [0, 1], False)["role"] == "tuning"
    assert agent_seeds.protocol("colour_grid", [8, 32], False)["role"] == "mixed"
    for seeds in (list(range(29, 39)), list(range(30, 39)), list(range(10, 20))):
        with pytest.raises(ValueError, match="--headline needs at least 10 of colour_grid's report seeds"):
            agent_seeds.protocol("colour_grid", seeds, True)
    for roles in agent_seeds.SEED_ROLES.values():
        assert not set(roles["tuning"]) & set(roles["report"]) and len(roles["report"]) >= 10
    with pytest.raises(SystemExit):
        agent_seeds.main(["--seeds", "0", "--headline", "--json", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()
    seen = {}

    def fake_run(seeds, settings, workdir, parallel, on_done):
        seen["before"] = json.loads((tmp_path / "new" / "s.json").read_text())
        return {0: {"failed": 1, "wall_s": 1.0}}

    monkeypatch.setattr(agent_seeds, "run_seeds", fake_run)
    out = agent_seeds.main(["--seeds", "0", "--json", str(tmp_path / "new" / "s.json"), "--set", "task=colour_count"])
    assert seen["before"]["protocol"]["report_seeds"] == list(range(20, 30)) and seen["before"]["seeds"] == []
    assert out["protocol"]["role"] == "tuning" and out["seeds"] == [{"seed": 0, "failed": 1, "wall_s": 1.0}]


def test_each_seed_gets_its_share_of_the_cores_unless_threads_are_set():
    assert agent_seeds.child_env(5, {"PATH": "/bin"}, cpus=16) == {"PATH": "/bin", "OMP_NUM_THREADS": "3"}
    assert agent_seeds.child_env(32, {}, cpus=16)["OMP_NUM_THREADS"] == "1"
    assert agent_seeds.child_env(5, {"OMP_NUM_THREADS": "8"}, cpus=16)["OMP_NUM_THREADS"] == "8"


def test_a_run_stopped_from_outside_keeps_every_seeds_row(tmp_path, monkeypatch):
    # two seeds' processes run (sleeping), one waits; the stop comes as SIGTERM's SystemExit would, mid-wait
    monkeypatch.setattr(agent_seeds, "RUN_ONE", "import time; time.sleep(60)")

    def stop(seconds):
        raise SystemExit(143)

    monkeypatch.setattr(agent_seeds.time, "sleep", stop)
    written = []
    with pytest.raises(SystemExit):
        agent_seeds.run_seeds([7, 8, 9], {}, tmp_path, 2, lambda reports: written.append(dict(reports)))
    assert len(written) == 1 and sorted(written[0]) == [7, 8, 9]
    assert written[0][7]["failed"] == written[0][8]["failed"] == "stopped"
    assert written[0][9] == {"failed": "not started", "wall_s": 0.0}
    assert [agent_seeds.seed_row(s, written[0][s])["failed"] for s in (7, 8, 9)] == ["stopped", "stopped", "not started"]
