"""What ``eogym-sft view`` gathers from run folders (eogym_sft/evaluation/view_data.py); the page built from
it is tested in test_view.py."""

from __future__ import annotations

import json

import pytest

from eogym_sft.evaluation.view_data import ViewError, find_runs, plot_keys, trainer_state


def test_plot_keys_order_known_first_then_the_rest():
    history = [{"grad_norm": 1.0, "zeta": 2, "loss": 3.0, "epoch": 1.0, "flag": True}, {"mean_token_accuracy": 0.5, "eval_runtime": 2}]
    assert plot_keys(history) == ["loss", "mean_token_accuracy", "grad_norm", "zeta"]


def test_a_demo_folder_is_searched_and_a_folder_without_runs_refused(tmp_path):
    demo = tmp_path / "demo"
    (demo / "rollout").mkdir(parents=True)
    (demo / "rollout/episodes.jsonl").write_text("{}\n")
    for step in (1, 3):
        (demo / f"grpo/checkpoint-{step}").mkdir(parents=True)
        (demo / f"grpo/checkpoint-{step}/trainer_state.json").write_text(json.dumps({"global_step": step}))
    (demo / "validation.json").write_text(json.dumps({"samples": 3, "models": {}}))
    (demo / "task").mkdir()
    (demo / "task/notes.json").write_text("[]")
    runs = find_runs([demo])
    assert [(r.kind, r.name) for r in runs] == [
        ("training", "demo/grpo"), ("rollout", "demo/rollout"), ("validation", "demo/validation.json")
    ]
    assert trainer_state(demo / "grpo") == demo / "grpo/checkpoint-3/trainer_state.json"
    assert [(r.kind, r.name) for r in find_runs([demo / "rollout/episodes.jsonl"])] == [("rollout", "rollout")]
    with pytest.raises(ViewError, match="task: no run found"):
        find_runs([demo / "task"])
    with pytest.raises(ViewError, match="gone: no such file or folder"):
        find_runs([demo / "gone"])
