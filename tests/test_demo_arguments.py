"""The agent demo's argument figures (eogym_sft/demo_arguments.py): taken from the rollout and teacher-forced
summaries by arm, and their table."""

from __future__ import annotations

from eogym_sft.demo_arguments import argument_figures, argument_lines


def test_figures_come_from_both_summaries_by_arm():
    forced = {"arms": {"sft": {"gold_history": {"overall": {"arg_acc_aoi@0.5": {"mean": 0.75, "n": 8}, "arg_acc": {"mean": 0.5, "n": 8}}}}}}
    rollout = {"param_prefix": 0.25, "param_prefix_aoi@0.5": 0.5, "pass@1": 1.0}
    assert argument_figures("sft", rollout, forced) == {"param_prefix": 0.25, "param_prefix_aoi@0.5": 0.5, "arg_acc_aoi@0.5": 0.75}
    assert argument_figures("grpo", rollout, forced)["arg_acc_aoi@0.5"] is None  # no such arm teacher-forced
    assert argument_figures("sft", {}, None) == {"param_prefix": None, "param_prefix_aoi@0.5": None, "arg_acc_aoi@0.5": None}


def test_the_table_has_a_row_per_arm():
    arms = {"base": {"param_prefix": 0.0, "param_prefix_aoi@0.5": 0.0, "arg_acc_aoi@0.5": 0.0},
            "grpo": {"param_prefix": 0.5, "param_prefix_aoi@0.5": 0.875, "arg_acc_aoi@0.5": None}}
    assert argument_lines(arms) == [
        "  arguments against the gold calls (docs/evaluation.md, section 17):",
        "  arm             param_prefix  param_prefix_aoi@0.5       arg_acc_aoi@0.5",
        "  base                   0.000                 0.000                 0.000",
        "  grpo                   0.500                 0.875                     -",
    ]
