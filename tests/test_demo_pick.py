"""eogym_sft/demo_pick.py: the agent demo's checkpoint pick on validation questions, and its settings."""

import pytest


def test_the_checkpoint_of_best_validation_pass_at_1_goes_on_a_tie_to_the_later(tmp_path):
    from eogym_sft.demo_pick import best_step, pick_checkpoint

    for step in (40, 20, 60):
        (tmp_path / f"checkpoint-{step}").mkdir()
    seen = {}

    def score(arms, name):  # the seed-8 pattern: the format broke at the last step
        seen["arms"], seen["name"] = arms, name
        return {"arms": {"step20": {"overall": {"pass@1": 0.0}}, "step40": {"overall": {"pass@1": 0.34}},
                         "step60": {"overall": {"pass@1": 0.04}}}}

    path, info = pick_checkpoint(tmp_path, score)
    assert path == tmp_path / "checkpoint-40" and info == {"step": 40, "pass@1": {20: 0.0, 40: 0.34, 60: 0.04}}
    assert seen["arms"] == [f"step{s}={tmp_path}/checkpoint-{s}" for s in (20, 40, 60)]
    assert seen["name"] == f"validation_{tmp_path.name}"
    assert best_step({20: 0.5, 40: 0.5, 60: 0.25}) == 40
    sft = tmp_path / "sft"

    def worse(arms, name):  # no step beats where the stage began: it stops at step 0
        assert arms[0] == f"step0={sft}"
        return {"arms": {a.split("=")[0]: {"overall": {"pass@1": 0.5 if a.startswith("step0=") else 0.25}} for a in arms}}

    assert pick_checkpoint(tmp_path, worse, start=sft) == (sft, {"step": 0, "pass@1": {0: 0.5, 20: 0.25, 40: 0.25, 60: 0.25}})
    with pytest.raises(FileNotFoundError, match="no checkpoint-\\* under .*: the stage saved no checkpoint"):
        pick_checkpoint(tmp_path / "checkpoint-20", score)


def test_picking_needs_validation_rows_and_a_step_count_it_divides(tmp_path):
    from eogym_sft.demo import AgentDemoConfig, _grpo_configs, _sft_configs

    cfg = AgentDemoConfig(train_rows=96, val_rows=16, sft_steps=60, sft_pick_every=20, grpo_steps=6, grpo_pick_every=3)
    _, sft, _ = _sft_configs(cfg, tmp_path / "m", tmp_path / "t.jsonl", tmp_path, tmp_path / "sft", 60, pick_every=20)
    assert (sft.save_strategy, sft.save_steps, sft.save_only_model) == ("steps", 20, True)
    assert _sft_configs(cfg, tmp_path / "m", tmp_path / "t.jsonl", tmp_path, tmp_path / "rft", 60)[1].save_strategy == "no"
    assert _grpo_configs(cfg, tmp_path / "m", tmp_path / "t.jsonl", tmp_path, "s", tmp_path / "g")[1].save_steps == 3
    no_pick = AgentDemoConfig(val_rows=0, grpo_pick_every=0)
    assert _grpo_configs(no_pick, tmp_path / "m", tmp_path / "t.jsonl", tmp_path, "s", tmp_path / "g")[1].save_steps == 24
    for bad in ({"val_rows": 0, "sft_pick_every": 20}, {"val_rows": 112, "sft_pick_every": 20}, {"val_rows": 8, "sft_pick_every": 30},
                {"val_rows": 8, "grpo_pick_every": 5}):
        with pytest.raises(ValueError, match="_pick_every .* needs 0 < val_rows < train_rows"):
            AgentDemoConfig(**bad)
