"""``eogym-sft demo``: held-out validation, a model wide enough to learn, labelled output, no deprecated settings."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from test_recipe import load_recipe


def test_our_settings_raise_no_deprecation_warning(tmp_path):
    from eogym_sft.demo import demo_configs

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        load_recipe().parse_args(["--use_cpu", "true"])  # the recipe's YAML
        demo_configs(tmp_path / "model", tmp_path, steps=2, learning_rate=1e-2)


def test_demo_validates_on_the_traces_training_held_out(tmp_path):
    from eogym_sft.demo import EVAL_FRACTION, demo_configs
    from eogym_sft.models.tiny import DEMO_QWEN3_VL_CONFIG

    script, training, model = demo_configs(tmp_path / "model", tmp_path, steps=2, learning_rate=1e-2)
    assert script.eval_fraction == EVAL_FRACTION > 0 and training.seed == 42
    assert script.samples_per_step == 2 and training.per_device_train_batch_size == 2
    assert DEMO_QWEN3_VL_CONFIG["text_config"]["hidden_size"] == 128
    # the same traces: run_demo passes EVAL_FRACTION and the seed to validate's held_out_fraction
    import inspect

    from eogym_sft import demo

    source = inspect.getsource(demo.run_demo)
    assert "held_out_fraction=EVAL_FRACTION" in source and "seed=training.seed" in source


def test_demo_summary_names_both_arms_and_where_everything_is(tmp_path):
    from eogym_sft.demo import demo_summary

    scores = {"adapter": {"overall": {"loss": 3.5, "token_accuracy": 0.31, "tokens": 900}}, "base": {"overall": {"loss": 11.9, "token_accuracy": 0.02, "tokens": 900}}}
    text = demo_summary({"samples": 6, "models": scores}, tmp_path, str(tmp_path / "adapter"))
    lines = text.splitlines()
    assert "token accuracy  base 0.0200  ->  adapter 0.3100" in text and "Held-out traces (never trained on): 6 samples" in text
    assert [line.split(":")[0] for line in lines[-6:-2]] == ["adapter", "report", "manifest", "next"]
    assert "A first run on CPU" in lines[-3] and "on a GPU" in lines[-2] and "README.md" in lines[-1]
    assert f"--adapter {tmp_path / 'adapter'}" in text and str(Path(tmp_path) / "prepared" / "manifest.jsonl") in text


def test_demo_refuses_a_used_output_folder(tmp_path):
    from eogym_sft.demo import run_agent_demo, run_demo

    (tmp_path / "old.txt").write_text("x")
    with pytest.raises(FileExistsError, match="eogym-sft demo: .* --overwrite"):
        run_demo(tmp_path)
    # the commands' one output rule: never a link, never a training run's folder, even with --overwrite
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(FileExistsError, match="eogym-sft demo: .*link is a symbolic link"):
        run_demo(tmp_path / "link")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "eogym_run.json").write_text("{}")
    with pytest.raises(FileExistsError, match="belongs to the training run"):
        run_demo(tmp_path / "run", overwrite=True)
    with pytest.raises(FileExistsError, match="eogym-sft demo --agent: .*belongs to the training run"):
        run_agent_demo(tmp_path / "run", overwrite=True)


@pytest.mark.slow(48)
def test_the_demo_learns_what_it_holds_out(tmp_path):
    """The demo's model and recipe settings beat the base on traces never trained on (the full demo, with
    smaller images and fewer steps so that it runs in about half a minute)."""
    from eogym_sft.demo import run_demo

    report = run_demo(tmp_path / "demo", steps=12, max_pixels=65536)
    adapter, base = report["models"]["adapter"]["overall"], report["models"]["base"]["overall"]
    assert adapter["token_accuracy"] > base["token_accuracy"] + 0.05
    assert adapter["loss"] < base["loss"] - 1.0


# ---------------------------------------------------------------- eogym-sft demo --agent


def test_agent_model_embeddings_are_drawn_wider(tmp_path):
    import torch
    from transformers import AutoModelForImageTextToText

    from eogym_sft.demo import AgentDemoConfig, save_agent_model
    from eogym_sft.models.tiny import TINY_QWEN3_VL_CONFIG

    path = save_agent_model(tmp_path / "m", AgentDemoConfig(model_config=TINY_QWEN3_VL_CONFIG, embedding_std=0.4))
    model = AutoModelForImageTextToText.from_pretrained(path)
    weight = model.get_input_embeddings().weight
    assert abs(float(weight.detach().std()) - 0.4) < 1e-3
    assert torch.equal(model.get_output_embeddings().weight, weight)  # tied: the head is the same rows
    assert (path / "chat_template.jinja").is_file() or (path / "processor_config.json").is_file()


def test_agent_sft_trains_on_every_training_row_and_never_on_held_out(tmp_path):
    from eogym_sft.demo import AgentDemoConfig, _sft_configs
    from eogym_sft.environment.tasks import write_task

    cfg = AgentDemoConfig(train_rows=3, held_out_rows=2, val_rows=1)
    train = write_task(tmp_path / "task", cfg.train_rows, cfg.seed, start=0, name="train.jsonl")
    held = write_task(tmp_path / "task", cfg.held_out_rows, cfg.seed, start=cfg.train_rows, name="held_out.jsonl")
    ids = lambda p: {line.split('"id": "')[1].split('"')[0] for line in p.read_text().splitlines()}
    assert len(ids(train)) == 3 and len(ids(held)) == 2 and not ids(train) & ids(held)
    script, training, _ = _sft_configs(cfg, tmp_path / "model", train, tmp_path / "task", tmp_path / "sft", 7)
    assert script.dataset_path == str(train) and script.eval_fraction == 0.0
    assert (script.max_pixels, script.min_pixels) == (128 * 128, 4096) and training.max_steps == 7 and training.use_cpu


def test_rejection_data_is_the_gold_plus_the_sft_arms_correct_episodes(tmp_path):
    import json

    from eogym_sft.demo import rejection_data

    gold = tmp_path / "gold.jsonl"
    gold.write_text('{"id": "g1"}\n{"id": "g2"}\n')
    episode = {"messages": [], "stop_reason": "final_answer", "correct": True, "arm": "sft"}
    lines = [episode | {"id": "e1"}, episode | {"id": "e2", "correct": False}, episode | {"id": "e3", "arm": "base"},
             episode | {"id": "e4", "stop_reason": "max_new_tokens"}, episode | {"id": "e5"}]
    (tmp_path / "episodes.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    union, info = rejection_data(tmp_path, gold, sampled=5)
    assert info == {"episodes_sampled": 5, "episodes_kept": 2, "rows_trained": 4}
    assert [json.loads(x)["id"] for x in union.read_text().splitlines()] == ["g1", "g2", "e1", "e5"]
    (tmp_path / "episodes.jsonl").write_text(json.dumps(lines[1]) + "\n")  # nothing right: nothing to train on
    assert rejection_data(tmp_path, gold, sampled=1) == (None, {"episodes_sampled": 1, "episodes_kept": 0, "rows_trained": None})


# The agent demo's loop as `eogym-sft demo --agent` runs it (the same code, model, questions and SFT), shortened
# where the assertions allow (16 held-out questions of 1 episode, 2 GRPO steps of one question and one pass each, picked
# on validation against the SFT adapter, no rejection-sampling round: its data is test_rejection_data_...'s), run once
# for the tests below: they assert what the demo shows.
LEARNING_RUN = dict(held_out_rows=16, samples=1, grpo_steps=2, grpo_pick_every=2, grpo_num_iterations=1, grpo_questions_per_step=1,
                    rft_steps=0)


@pytest.fixture(scope="module")
def learned(tmp_path_factory):
    from eogym_sft.demo import AgentDemoConfig, run_agent_demo

    output = tmp_path_factory.mktemp("agent") / "agent"
    return output, AgentDemoConfig(**LEARNING_RUN), run_agent_demo(output, cfg=AgentDemoConfig(**LEARNING_RUN))


def _paired(report, a, b, metric="pass@1"):
    return next(p for p in report["paired"] if (p["a"], p["b"], p["metric"]) == (a, b, metric))


@pytest.mark.slow(84)
def test_sft_teaches_the_tool_and_the_answer_on_held_out_questions(learned):
    _, _, report = learned
    base, sft = report["arms"]["base"], report["arms"]["sft"]
    assert base["pass@1"] == 0.0 and base["tool_any"] == 0.0  # a random model calls nothing and answers nothing
    assert sft["tool_any"] >= 0.8
    gain = _paired(report, "base", "sft")
    assert gain["delta"] >= 0.3 and gain["ci95"][0] > 0, gain


@pytest.mark.slow
def test_grpo_does_not_fall_below_sft(learned):
    _, cfg, report = learned
    assert len(report["grpo_reward_per_step"]) == cfg.grpo_steps
    paired = _paired(report, "sft", "grpo")
    assert paired["ci95"][1] >= 0, paired  # not significantly worse than SFT
    assert report["arms"]["grpo"]["tool_any"] >= 0.8
    assert set(report["picked"]["grpo"]["pass@1"]) == {0, 2} and report["picked"]["grpo"]["step"] in (0, 2)


@pytest.mark.slow
def test_the_report_covers_every_arm_and_stage_and_a_rerun_is_refused(learned):
    import json

    from eogym_sft.demo import run_agent_demo

    output, cfg, report = learned
    assert set(report["arms"]) == {"base", "sft", "grpo"} and report["rejection_sampling"] is None
    assert all(a["questions"] == cfg.held_out_rows and a["episodes"] == cfg.held_out_rows * cfg.samples for a in report["arms"].values())
    assert json.loads((output / "agent_report.json").read_text())["arms"] == report["arms"]
    assert set(report["seconds"]) == {"task and model", "sft", "grpo", "held-out rollouts", "held-out teacher-forced", "total"}
    assert all(a[f] is not None for a in report["arms"].values() for f in ("param_prefix", "param_prefix_aoi@0.5", "arg_acc_aoi@0.5"))
    assert report["arms"]["base"]["arg_acc_aoi@0.5"] == 0.0  # a random model calls nothing
    assert (output / "evaluation/summary.json").is_file()
    with pytest.raises(FileExistsError, match="--overwrite"):
        run_agent_demo(output, cfg=cfg)


def test_agent_grpo_settings_are_the_recipes_reward_shrunk(tmp_path):
    from eogym_sft.demo import AgentDemoConfig, _grpo_configs

    cfg = AgentDemoConfig()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        script, training, model = _grpo_configs(cfg, tmp_path / "m", tmp_path / "d.jsonl", tmp_path, str(tmp_path / "sft"), tmp_path / "g")
    assert (script.tool_call_cost, script.action_cost_scale, script.max_cost_penalty) == (0.1, 0.2, 0.2)  # the recipe's reward
    assert script.sft_adapter == str(tmp_path / "sft") and script.tool_backends == "crop"
    assert (training.beta, training.scale_rewards, training.temperature) == (0.0, "group", 1.0)
    # each batch trained on four times against the log-probabilities it was sampled with, DAPO's clip-higher, no dropout
    assert (training.num_iterations, training.epsilon_high, training.epsilon, training.disable_dropout) == (4, 0.28, 0.2, True)
    assert training.per_device_train_batch_size == cfg.num_generations * cfg.grpo_questions_per_step == 16
    assert (training.save_steps, training.max_steps) == (8, 24)  # checkpoints for the pick on validation
    assert model.attn_implementation == "eogym_varlen"  # the packed loss forward, as the recipe (cuDNN's is CUDA only)


def test_agent_grpo_levers_are_checked_and_reach_grpo_config(tmp_path):
    """``bench/agent_seeds.py --set`` values: the scaling, the passes over each batch and the upper clip arrive in
    TRL's GRPOConfig; a value TRL would refuse mid-run, or that means nothing, is refused when the config is made."""
    from eogym_sft.demo import AgentDemoConfig, _grpo_configs

    cfg = AgentDemoConfig(grpo_scale_rewards="none", grpo_num_iterations=2, grpo_epsilon_high=0.28, grpo_disable_dropout=True)
    _, training, _ = _grpo_configs(cfg, tmp_path / "m", tmp_path / "d.jsonl", tmp_path, str(tmp_path / "sft"), tmp_path / "g")
    assert (training.scale_rewards, training.num_iterations, training.epsilon_high, training.disable_dropout) == ("none", 2, 0.28, True)
    assert AgentDemoConfig(grpo_scale_rewards="batch").grpo_scale_rewards == "batch"
    with pytest.raises(ValueError, match="grpo_scale_rewards must be one of group, batch, none, got 'std'"):
        AgentDemoConfig(grpo_scale_rewards="std")
    with pytest.raises(ValueError, match="grpo_num_iterations must be at least 1, got 0"):
        AgentDemoConfig(grpo_num_iterations=0)
    with pytest.raises(ValueError, match="grpo_epsilon_high must be > 0"):
        AgentDemoConfig(grpo_epsilon_high=0.0)


def test_agent_loss_and_entropy_levers_reach_grpo_config(tmp_path):
    """The loss, the entropy bonus (static, or TRL's adaptive control when a target is set) and CISPO's weight cap
    arrive in TRL's GRPOConfig; a CISPO cap that would cut every weight is refused when the config is made."""
    from eogym_sft.demo import AgentDemoConfig, _grpo_configs

    def grpo(**levers):
        return _grpo_configs(AgentDemoConfig(**levers), tmp_path / "m", tmp_path / "d.jsonl", tmp_path, str(tmp_path / "s"), tmp_path / "g")[1]

    default = grpo()
    assert (default.loss_type, default.entropy_coef, default.use_adaptive_entropy) == ("dapo", 0.0, False)
    adaptive = grpo(grpo_entropy_target=0.05, grpo_loss_type="cispo", grpo_epsilon_high=5.0)
    assert (adaptive.loss_type, adaptive.epsilon_high, adaptive.use_adaptive_entropy, adaptive.entropy_target) == ("cispo", 5.0, True, 0.05)
    assert (grpo(grpo_entropy_coef=0.01).entropy_coef, grpo(grpo_entropy_coef=0.01).use_adaptive_entropy) == (0.01, False)
    with pytest.raises(ValueError, match="cispo caps the importance weight itself at grpo_epsilon_high: set it above 1"):
        AgentDemoConfig(grpo_loss_type="cispo", grpo_epsilon_high=0.28)
    with pytest.raises(ValueError, match="grpo_loss_type must be one of grpo, dr_grpo, dapo"):
        AgentDemoConfig(grpo_loss_type="ppo")
    with pytest.raises(ValueError, match="grpo_entropy_coef must be >= 0 and grpo_entropy_target > 0"):
        AgentDemoConfig(grpo_entropy_target=0.0)
    assert (default.top_entropy_quantile, grpo(grpo_top_entropy_quantile=0.2).top_entropy_quantile) == (1.0, 0.2)
    for share in (0.0, 1.5):
        with pytest.raises(ValueError, match=f"grpo_top_entropy_quantile must be in \\(0, 1\\], got {share}"):
            AgentDemoConfig(grpo_top_entropy_quantile=share)


def test_demo_agent_takes_steps_learning_rate_seed_and_task(tmp_path):
    from eogym_sft.cli import agent_demo_config, build_parser
    from eogym_sft.demo import AgentDemoConfig

    def config(*flags):
        argv = ["demo", "--agent", *flags]
        return agent_demo_config(build_parser(argv).parse_args(argv))

    cfg = config("--steps", "7", "--learning-rate", "0.001", "--seed", "3", "--task", "colour_count")
    assert (cfg.sft_steps, cfg.sft_learning_rate, cfg.seed, cfg.task) == (7, 0.001, 3, "colour_count")
    assert (cfg.max_new_tokens, cfg.completion_tokens) == (176, 768)  # the task's budgets
    assert config() == AgentDemoConfig()  # no flag: the agent demo's own defaults, not the SFT demo's 16 steps
    with pytest.raises(SystemExit) as stop:  # refused as the flag is parsed (eogym_sft.config.number)
        config("--steps", "0")
    assert stop.value.code == 2
    with pytest.raises(ValueError, match="must be at least 1"):
        AgentDemoConfig(sft_steps=0)


def test_demo_refuses_agent_only_flags_without_agent(tmp_path):
    from eogym_sft.cli import main

    with pytest.raises(SystemExit, match="eogym-sft demo: --seed and --task apply only to the agent demo: add --agent"):
        main(["demo", "--output", str(tmp_path / "d"), "--seed", "1", "--task", "colour_grid"])
    assert not (tmp_path / "d").exists()


def test_the_demo_flags_say_both_defaults(capsys):
    from eogym_sft.cli import main

    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "SFT optimizer steps (of 2 samples); default 16, with --agent 100" in text and "default 0.01, with --agent 0.005" in text
    assert "(default: None)" not in text


# The smallest agent demo that still runs every stage (SFT, GRPO, rejection sampling, held-out rollouts; no pick: the
# learning run above picks): run twice.
SMALLEST_RUN = dict(train_rows=4, held_out_rows=2, sft_steps=2, grpo_steps=1, num_generations=2, rft_steps=1, samples=1, val_rows=0,
                    grpo_pick_every=0)


@pytest.mark.slow(90)
def test_the_same_config_gives_the_same_agent_report(tmp_path):
    """Crop names, questions, weights and every sampled episode come from the seed: two runs in two folders
    write the same agent_report.json but for its timings."""
    import json

    from eogym_sft.demo import AgentDemoConfig, run_agent_demo

    reports = []
    for run in ("a", "b"):
        run_agent_demo(tmp_path / run, cfg=AgentDemoConfig(**SMALLEST_RUN))
        report = json.loads((tmp_path / run / "agent_report.json").read_text())
        assert set(report["seconds"]) == {"task and model", "sft", "grpo", "rejection sampling", "held-out rollouts", "held-out teacher-forced", "total"}
        reports.append({k: v for k, v in report.items() if k != "seconds"})
    assert reports[0] == reports[1]
    assert (tmp_path / "a" / "task" / "train.jsonl").read_bytes() == (tmp_path / "b" / "task" / "train.jsonl").read_bytes()
    episodes = [(tmp_path / run / "rollout" / "episodes.jsonl").read_text().splitlines() for run in ("a", "b")]
    # source: the folder's path; run_identity: digests of the run's files, whose configs name the folder
    strip = lambda lines: [{k: v for k, v in json.loads(x).items() if k not in ("source", "run_identity")} for x in lines]
    assert len(episodes[0]) == 6 and strip(episodes[0]) == strip(episodes[1])


@pytest.mark.slow(60)
def test_the_agent_demo_runs_the_count_task(tmp_path):
    """colour_count through every stage at the smallest size: four crops a turn fit its turn and episode budgets."""
    import json

    from eogym_sft.demo import AgentDemoConfig, run_agent_demo

    report = run_agent_demo(tmp_path / "cc", cfg=AgentDemoConfig(task="colour_count", **SMALLEST_RUN))
    assert (report["settings"]["task"], report["settings"]["max_new_tokens"], report["settings"]["completion_tokens"]) == ("colour_count", 176, 768)
    assert {"base", "sft", "grpo"} <= set(report["arms"]) and all(a["episodes"] == 2 for a in report["arms"].values())
    rows = [json.loads(x) for x in (tmp_path / "cc" / "task" / "train.jsonl").read_text().splitlines()]
    assert [r["EO_task"] for r in rows] == ["colour_count"] * 4 and len(report["grpo_reward_per_step"]) == 1
