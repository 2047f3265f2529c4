"""GRPO on the tiny Qwen3-VL, on CPU: TRL's GRPOTrainer drives real EO-Gym environments through a scripted
policy (real forward passes, forced tokens), and the conversation it builds is token for token the SFT
sample of the same trajectory; a step trains every LoRA weight and nothing else."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_row, save_image
from helpers import IM_END, ScriptedPolicy, gold_and_wrong_group, perturb_lora_b, scripted_trainer, trained_spans

from eogym_sft.data.traces import normalize_row
from eogym_sft.agent.sampling import vision_token_ids
from eogym_sft.models.loading import apply_lora, load_base_model
from eogym_sft.models.processor import load_processor
from eogym_sft.data.collator import EOGymCollator
from eogym_sft.training.grpo import (
    GRPOScriptArguments,
    build_trainer,
    check_chat_template,
    environment_class,
    load_episodes,
    show_row_tools,
)

MIN_PIXELS, MAX_PIXELS = 1024, 4096  # small images keep the CPU steps short
PAD = 151643


def write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_environment_class_runs_the_rows_tools_and_counts(data_root, row_factory):
    row = row_factory(n_steps=2)
    env = environment_class(["crop_optical_or_sar_image", "compute_index"], data_root, ["crop"])()
    env.reset(row=json.dumps(row), prompt=[], gt_answer="3")
    blocks = env.crop_optical_or_sar_image(image_url=row["images"][0], aoi=[0.25, 0.25, 0.75, 0.75])
    assert [b["type"] for b in blocks] == ["text", "image"]
    assert json.loads(blocks[0]["text"])["bbox_px"] == [160, 120, 480, 360]
    assert blocks[1]["image"].size == (320, 240)
    error = env.compute_index(dataset="x", index="ndvi")  # no backend can run it here
    assert [b["type"] for b in error] == ["text"] and error[0]["text"].startswith("Error:")
    assert (env.tool_calls, env.tool_errors) == (2, 1)


@pytest.fixture(scope="module", params=["trl", "slots"])
def policy_run(request, tmp_path_factory, tiny_model_dir):
    """One GRPO step on one row, on each rollout engine; the scripted policy writes the row's gold
    trajectory (a crop, the right answer) in one episode of the group and a wrong one-turn answer in the other."""
    tmp_path = tmp_path_factory.mktemp("grpo")
    group = gold_and_wrong_group(tmp_path, tiny_model_dir, MAX_PIXELS, MIN_PIXELS)
    row, data_root, processor, sft = group["row"], group["data_root"], group["processor"], group["sft"]
    policy = ScriptedPolicy(group["scripts"], group["header"])

    # A non-zero adapter: with LoRA B at zero (PEFT's start) one step could not move LoRA A. TRL's generate needs
    # SDPA; the slots engine's loss forward runs packed on the recipe's variable-length attention.
    attention = "sdpa" if request.param == "trl" else "eogym_varlen"
    model = perturb_lora_b(apply_lora(load_base_model(str(tiny_model_dir), "float32", attention)), seed=0)
    data = load_episodes(write_jsonl(tmp_path / "rows.jsonl", [row]), data_root)
    script_args = GRPOScriptArguments(
        dataset_path="unused", data_root=str(data_root), tool_backends="replay", max_pixels=MAX_PIXELS, min_pixels=MIN_PIXELS,
        rollout_engine=request.param, max_episode_tokens=4096,
    )
    from trl import GRPOConfig

    args = GRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, num_generations=2, max_steps=1,
        max_completion_length=1024, learning_rate=1e-2, beta=0.0, scale_rewards="group", mask_truncated_completions=True,
        use_cpu=True, bf16=False, report_to="none", logging_steps=1, save_strategy="no", seed=0,
        generation_kwargs={"do_sample": False},  # the policy forces every token; skip sampling over 152k logits
    )
    trainer = build_trainer(model, processor, data, script_args, args, logits_processors=[policy])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    return {"trainer": trainer, "policy": policy, "sft": sft, "before": before, "model": model, "data": data, "engine": request.param}


def test_the_episode_is_token_for_token_the_sft_sample(policy_run):
    """Prompt (system, # Tools block of the row's own schemas, question and image), the policy's turns
    and the replayed tool results with their crops: the same token ids as the SFT sample, image
    tokens included, so every image was resized under the same pixel cap."""
    sft_ids = policy_run["sft"]["input_ids"][0].tolist()
    seen = policy_run["policy"].longest[0]
    seen = seen[next(i for i, t in enumerate(seen) if t != PAD) :]  # left padding of the batch
    # The last forward pass sees everything but the final <|im_end|>; SFT adds it and a newline.
    assert seen == sft_ids[:-2]
    assert sft_ids[-2] == IM_END


def test_trl_renders_the_rows_own_tool_schemas(policy_run):
    """Pins TRL's private ``_env_tools``: the per-environment tools its prompts are rendered with."""
    trainer, data = policy_run["trainer"], policy_run["data"]
    assert trainer._env_tools == data.schemas
    with pytest.raises(RuntimeError, match="_env_tools"):
        show_row_tools(trainer, {"tools-other": []})


def test_a_step_trains_every_lora_weight_and_nothing_else(policy_run):
    model, before = policy_run["model"], policy_run["before"]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n and ".visual." not in n for n in trainable)
    changed = {n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())}
    assert changed == trainable


def test_the_seeds_diagnostics_are_logged(policy_run):
    logs = policy_run["trainer"].state.log_history[0]
    # One group per step: the gold episode (a crop, right: 1 x (1 - 1 x 0.1 x 0.2)) and a wrong answer (0).
    assert logs["rewards/eogym_episode/mean"] == pytest.approx(0.49)
    assert logs["reward/group_std"] == pytest.approx(0.49)
    assert logs["reward/score"] == pytest.approx(0.5)
    assert logs["reward/cost_penalty"] == pytest.approx(0.01)
    assert logs["episode/tool_calls"] == pytest.approx(0.5)
    assert logs["episode/turns"] == pytest.approx(1.5)
    assert logs["episode/invalid_calls"] == 0 and logs["episode/truncated"] == 0
    assert logs["grad_norm"] > 0 and logs["entropy"] > 0
    assert logs["tools/call_frequency"] == pytest.approx(0.5)
    assert logs["completions/clipped_ratio"] == 0


def test_generation_never_samples_a_vision_token(policy_run, processor):
    """TRL suppresses only <|image_pad|>; a sampled <|video_pad|> broke the training forward on a GPU."""
    suppressed = policy_run["trainer"].generation_config.suppress_tokens
    assert set(vision_token_ids(processor.tokenizer)) <= set(suppressed)


def test_only_trls_engine_has_the_dataloader_decode_row_images(policy_run):
    """The slots engine reads a row's images when its episode starts: its dataset decodes none (TRL's
    dataloader would decode them for every episode of the step, outside the rollout)."""
    example = policy_run["trainer"].train_dataset[0]
    if policy_run["engine"] == "trl":
        assert [im.size for im in example["images"]] == [(96, 64)]
    else:
        assert "images" not in example and json.loads(example["row"])["images"] == ["EO_GYM_DATA/aaaa0000/scene.jpg"]


def test_trls_engine_refuses_the_variable_length_attention(policy_run, tiny_model_dir):
    """TRL's padded generate cannot run eogym_varlen (no KV cache): refused when the trainer is built, not mid-step."""
    run = policy_run
    model = apply_lora(load_base_model(str(tiny_model_dir), "float32", "eogym_varlen"))
    script_args = GRPOScriptArguments(dataset_path="unused", data_root="unused", rollout_engine="trl")
    with pytest.raises(ValueError, match="rollout_engine=trl .* set --attn_implementation sdpa"):
        build_trainer(model, run["trainer"].processing_class, run["data"], script_args, run["trainer"].args)


def test_a_foreign_chat_template_is_refused(processor):
    class Other:
        chat_template = "{{ messages }}"

    check_chat_template(processor)
    with pytest.raises(ValueError, match="qwen3_vl.jinja"):
        check_chat_template(Other())


# ---------------------------------------------------------------- generation output settled before the loss


def _step_on_mixed_rows(tmp_path, tiny_model_dir, room_after_tool: int):
    """One GRPO step over a question with an image and the same question without one (EO-Gym's multispectral
    rows have none), two episodes each: a crop then the answer, or the right answer at once.
    ``room_after_tool`` is what ``max_completion_length`` leaves after the crop's tool result
    (negative: the result itself no longer fits)."""
    data_root = tmp_path / "data"
    for rel, width, height in [("EO_GYM_DATA/aaaa0000/scene.jpg", 96, 64), ("image_cache/crops/c1.png", 48, 32)]:
        save_image(data_root, rel, width, height)
    with_image = make_row(n_steps=1)
    without = json.loads(json.dumps(with_image))
    without.update(id="no_image", images=[])
    without["messages"][1]["content"] = "How many ships are in the harbour?"
    processor = load_processor(str(tiny_model_dir), MAX_PIXELS, MIN_PIXELS)
    collator = EOGymCollator(processor, data_root=str(data_root))
    trace = normalize_row(with_image)
    sft = collator([{"messages": trace.messages, "images": trace.images, "tools": trace.tools}])
    labels = sft["labels"][0].tolist()
    starts = [i for i in range(len(labels)) if labels[i] != -100 and labels[i - 1] == -100]
    before_answer = starts[1] - starts[0]  # the crop turn and its tool result, as TRL lays them out
    right = processor.tokenizer("Final Answer: 3", add_special_tokens=False)["input_ids"] + [IM_END]
    header = processor.tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    policy = ScriptedPolicy([trained_spans(sft["labels"][0]), [right]], header)
    model = perturb_lora_b(apply_lora(load_base_model(str(tiny_model_dir), "float32", "sdpa")), seed=0)
    data = load_episodes(write_jsonl(tmp_path / "rows.jsonl", [with_image, without]), data_root)
    script_args = GRPOScriptArguments(
        dataset_path="unused", data_root=str(data_root), tool_backends="replay", max_pixels=MAX_PIXELS,
        min_pixels=MIN_PIXELS, progress_seconds=1e-9, rollout_engine="trl",  # TRL's own tool loop and its cuts
    )
    from trl import GRPOConfig

    args = GRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=2, max_steps=1,
        max_completion_length=before_answer + room_after_tool, learning_rate=1e-2, beta=0.0, scale_rewards="group",
        mask_truncated_completions=True, use_cpu=True, bf16=False, report_to="none", logging_steps=1,
        save_strategy="no", seed=0, generation_kwargs={"do_sample": False},
    )
    trainer = build_trainer(model, processor, data, script_args, args, logits_processors=[policy])
    trainer.train()
    return trainer.state.log_history[0]


@pytest.mark.slow(12)
def test_a_mixed_batch_with_truncated_crops_trains(tmp_path, tiny_model_dir, caplog):
    """Images in one question and none in the other (crashed: ``NoneType`` in the processor), and the crop
    episodes cut 3 tokens after their crop (crashed: a shape mismatch in ``get_rope_index``). The cut
    episodes are left out of the loss and score 0; the right answers score 1."""
    with caplog.at_level("INFO", logger="eogym_sft.training.grpo"):
        logs = _step_on_mixed_rows(tmp_path, tiny_model_dir, room_after_tool=3)
    assert logs["episode/truncated"] == 0.5 and logs["completions/clipped_ratio"] == 0.5
    assert logs["reward/score"] == 0.5 and logs["episode/tool_calls"] == 0.5
    assert logs["grad_norm"] > 0
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("GRPO: generat")]
    assert progress[0] == "GRPO: generating 4 episodes"
    assert any(" tokens (batch rows) in " in line for line in progress)  # the rate while it generates
    assert progress[-1].startswith("GRPO: generated 4 episodes, ") and progress[-1].endswith("tokens/s)")


@pytest.mark.slow(9)
def test_an_episode_whose_tool_result_no_longer_fits_counts_as_truncated(tmp_path, tiny_model_dir):
    """TRL drops a tool result that does not fit and ends the episode on the call's <|im_end|>: that
    episode was cut, and like every cut episode it is left out of the loss."""
    logs = _step_on_mixed_rows(tmp_path, tiny_model_dir, room_after_tool=-1)
    assert logs["episode/truncated"] == 0.5 and logs["completions/clipped_ratio"] == 0.5
    assert logs["reward/score"] == 0.5


# ---------------------------------------------------------------- the reward of a truncated episode, on both engines


@pytest.mark.parametrize("engine", ["trl", "slots"])
def test_a_truncated_answer_does_not_cancel_the_correct_ones_advantage(tmp_path, tiny_model_dir, engine):
    """One group: the right answer, and the right answer followed by rambling until the token limit cuts it.
    The cut one scores 0 (docs/rl.md), so TRL's own advantages favour the episode that ended."""

    def scripts(group):
        tokenizer = group["processor"].tokenizer
        right = tokenizer("Final Answer: 3", add_special_tokens=False)["input_ids"] + [IM_END]
        ramble = tokenizer(" Final Answer: 3\n" + "and so on " * 20, add_special_tokens=False)["input_ids"]
        return [[right], [ramble]]

    trainer, _ = scripted_trainer(tmp_path, tiny_model_dir, engine, scripts, max_completion_length=16, mask_truncated_completions=False)
    with torch.no_grad():
        batch = trainer._generate_and_score_completions([trainer.train_dataset[0]] * 2)
    assert batch["completion_ids"][1, -1] != IM_END  # the second one was cut
    advantages = batch["advantages"].tolist()
    assert advantages[0] > 0.7 and advantages[1] < -0.7  # +-1/sqrt(2): rewards [1, 0], TRL's group std (unbiased)
    assert trainer._metrics["train"]["episode/truncated"] == [0.5]


# ---------------------------------------------------------------- levers: entropy, the demo's settings


def test_the_policys_entropy_is_logged_where_the_demo_reads_it(policy_run, tmp_path):
    """Both engines (the slots engine through its packed forward) log TRL's ``entropy`` each step, and it is
    in trainer_state.json's log_history, where ``demo_report.grpo_per_step(dir, "entropy")`` reads it."""
    from eogym_sft.demo_report import grpo_per_step

    trainer = policy_run["trainer"]
    entropy = trainer.state.log_history[0]["entropy"]
    assert entropy > 0
    (tmp_path / "checkpoint-1").mkdir()
    trainer.state.save_to_json(str(tmp_path / "checkpoint-1" / "trainer_state.json"))
    assert grpo_per_step(tmp_path, "entropy") == [entropy]


def test_the_agent_demos_grpo_levers_reach_the_configs(tmp_path):
    """Each lever of the seed study set on ``AgentDemoConfig`` arrives in GRPOConfig or the script arguments;
    the defaults are the demo's run as it was (no KL, constant LR, no warmup)."""
    from eogym_sft.demo import AgentDemoConfig, _grpo_configs

    def configs(**levers):
        return _grpo_configs(AgentDemoConfig(**levers), tmp_path, tmp_path / "t.jsonl", tmp_path, "sft", tmp_path / "out")

    script, training, _ = configs()
    assert (training.beta, training.lr_scheduler_type, training.warmup_steps, training.temperature) == (0.0, "constant", 0, 1.0)
    assert training.per_device_train_batch_size == 16  # 2 questions x a group of 8
    # group-scaled; four passes a batch under DAPO's clip-higher, dropout off so the first pass's ratio is 1
    assert (training.scale_rewards, training.num_iterations, training.epsilon_high, training.disable_dropout) == ("group", 4, 0.28, True)
    script, training, _ = configs(
        grpo_beta=0.04, grpo_lr_scheduler_type="cosine", grpo_warmup_steps=0.1, grpo_questions_per_step=4, grpo_temperature=1.3,
        grpo_scale_rewards="none", grpo_num_iterations=2, grpo_epsilon_high=0.28, grpo_disable_dropout=True,
    )
    assert (training.beta, training.lr_scheduler_type, training.warmup_steps, training.temperature) == (0.04, "cosine", 0.1, 1.3)
    assert training.per_device_train_batch_size == 32 and training.num_generations == 8
    assert (training.scale_rewards, training.num_iterations, training.epsilon_high, training.disable_dropout) == ("none", 2, 0.28, True)


@pytest.mark.parametrize("engine", [pytest.param("slots", marks=pytest.mark.slow(4)), pytest.param("trl", marks=pytest.mark.slow(9))])
def test_two_iterations_train_each_batch_twice_against_the_sampling_policy(tmp_path, tiny_model_dir, monkeypatch, engine):
    """``num_iterations=2`` (``AgentDemoConfig.grpo_num_iterations``) on both engines (slots: the packed loss forward,
    shared prompts under eogym_varlen): TRL generates once every 2 steps and scores the sampling policy's log-probs
    (``old_per_token_logps``) when it generates; a batch's first pass has ratio 1 (dropout off), its second, one
    optimizer step later, does not, and the clip binds there only."""

    def scripts(group):
        return group["scripts"]  # the gold crop-then-answer episode and a wrong answer: advantages of both signs

    trainer, _ = scripted_trainer(
        tmp_path, tiny_model_dir, engine, scripts, attention="eogym_varlen" if engine == "slots" else "sdpa",
        num_iterations=2, max_steps=3, learning_rate=1e-2, logging_steps=1, disable_dropout=True,
    )
    generate, compute_loss, logps = trainer.engine.generate, trainer._compute_loss, trainer._get_per_token_logps_and_entropies
    generated, passes, latest = [], [], {}

    def counted(tr, prompts, inputs):
        generated.append(tr.state.global_step)
        return generate(tr, prompts, inputs)

    def spied_logps(*args, **kwargs):
        out = logps(*args, **kwargs)
        latest["logps"] = out[0].detach()  # the last forward before the loss returns is the loss's own
        return out

    def spied_loss(model, inputs):
        assert inputs.get("old_per_token_logps") is not None  # computed when the batch was generated
        loss = compute_loss(model, inputs)
        mask = (inputs["completion_mask"] * inputs["tool_mask"]).bool()
        passes.append((torch.exp(latest["logps"] - inputs["old_per_token_logps"])[mask], loss.detach()))
        return loss

    monkeypatch.setattr(trainer.engine, "generate", counted)
    monkeypatch.setattr(trainer, "_get_per_token_logps_and_entropies", spied_logps)
    monkeypatch.setattr(trainer, "_compute_loss", spied_loss)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()

    assert generated == [0, 2]  # steps 1 and 3 generate, step 2 trains on step 1's batch again
    (first, *_), (second, *_), (third, *_) = passes
    assert all(torch.isfinite(loss) for _, loss in passes)
    torch.testing.assert_close(first, torch.ones_like(first), atol=1e-5, rtol=0)  # the old log-probs are the policy's own
    torch.testing.assert_close(third, torch.ones_like(third), atol=1e-5, rtol=0)
    assert (second - 1).abs().max() > 0.1  # the weights moved between the two passes over one batch
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["clip_ratio/region_mean"] > 0 for h in logs] == [False, True, False]
    assert [h["step"] for h in logs if "reward" in h] == [1, 3]  # the reward is logged where a batch was generated
    assert all(not torch.equal(before[n], p.detach()) for n, p in trainer.model.named_parameters() if p.requires_grad)


# ---------------------------------------------------------------- activation checkpointing of some layers


def _checkpointed_layers(model) -> list[bool]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m.gradient_checkpointing for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def test_trl_turns_checkpointing_back_on_in_every_layer(tiny_model_dir):
    """TRL 1.16's ``disable_gradient_checkpointing`` (around a step's scoring) re-enables checkpointing on every layer,
    not the ``every_n_layers`` it found, and hands that key to torch's checkpoint. When this fails, TRL keeps the
    layers' own settings: delete ``checkpointing_kept``."""
    from trl.models.utils import disable_gradient_checkpointing

    model = apply_lora(load_base_model(str(tiny_model_dir), "float32", "sdpa"))
    model.base_model.model.activation_checkpointing_enable(every_n_layers=2)
    assert _checkpointed_layers(model) == [True, False, True, False]
    with disable_gradient_checkpointing(model, {"use_reentrant": False, "every_n_layers": 2}):
        pass
    assert _checkpointed_layers(model) == [True, True, True, True]


@pytest.mark.parametrize("engine", ["trl", "slots"])
def test_every_n_layers_survives_the_steps_scoring(tmp_path, tiny_model_dir, engine):
    """``activation_checkpointing_kwargs: {every_n_layers: 2}`` (transformers' own setting) checkpoints every
    other layer through a GRPO step: the trainer restores what TRL's scoring switched (``checkpointing_kept``)."""
    from eogym_sft.training.grpo import checkpointing_kept

    def scripts(group):
        return [[group["processor"].tokenizer("Final Answer: 3", add_special_tokens=False)["input_ids"] + [IM_END]]] * 2

    trainer, _ = scripted_trainer(
        tmp_path, tiny_model_dir, engine, scripts, activation_checkpointing=True,
        activation_checkpointing_kwargs={"use_reentrant": False, "every_n_layers": 2},
    )
    trainer.train()
    assert _checkpointed_layers(trainer.model) == [True, False, True, False]
    funcs = {m._gradient_checkpointing_func for m in trainer.model.modules() if hasattr(m, "_gradient_checkpointing_func")}
    assert all("every_n_layers" not in getattr(f, "keywords", {}) for f in funcs)  # torch's checkpoint gets its own kwargs only
    with checkpointing_kept(trainer.model):
        trainer.model.base_model.model.activation_checkpointing_disable()
    assert _checkpointed_layers(trainer.model) == [True, False, True, False]
