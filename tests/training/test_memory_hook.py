"""The memory plan in a run: the settings the user gave, the plan applied and printed as one line, the refusal
before the model loads, and an OOM told as the setting to lower (a GPU is faked: the plan only reads its memory)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from eogym_sft.guards import GPUOutOfMemory, user_errors
from eogym_sft.training import memory_hook as hook
from eogym_sft.models import memory as mm
from eogym_sft.training import memory_plan as mp

REPO = Path(__file__).resolve().parents[2]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PLAN_HINT = "see `eogym-sft plan --config CONFIG --gpu-memory SIZE`"


def test_settings_given_on_the_command_line_or_in_the_config_are_the_users():
    argv = ["--config", "x.yaml", "--per_device_train_batch_size", "2", "--activation-checkpointing=true", "--per_device_eval_batch_size", "8"]
    assert hook.settings_given(argv) == {"per_device_train_batch_size", "activation_checkpointing", "per_device_eval_batch_size"}
    assert hook.settings_given(["--gradient_accumulation_steps=4"], {"activation_checkpointing": False}) == {
        "gradient_accumulation_steps", "activation_checkpointing"}
    assert hook.settings_given(["--per_device_train_batch_sizes", "2"], {"learning_rate": 1e-4}) == frozenset()
    assert hook.settings_given(["--gradient-checkpointing", "false"]) == {"activation_checkpointing"}  # transformers' old name
    assert hook.settings_given([], {"gradient_checkpointing": True}) == {"activation_checkpointing"}


def test_the_shipped_recipe_leaves_the_planned_settings_to_the_plan():
    argv = ["--config", str(REPO / "recipes/eo_gym_4b.yaml")]
    assert hook.config_file(argv)["samples_per_step"] == 64
    assert hook.settings_given(argv, hook.config_file(argv)) == frozenset()
    assert hook.config_file(["--learning_rate", "1"]) == {}


def test_the_zero_stage_comes_from_accelerates_launch(monkeypatch):
    args = SimpleNamespace(deepspeed=None)
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    assert hook.zero_stage(args) == 0
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    assert hook.zero_stage(args) == 3
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    assert hook.zero_stage(SimpleNamespace(deepspeed={"zero_optimization": {"stage": 1}})) == 1


@pytest.fixture
def fake_gpu(monkeypatch):
    """An 80 GiB GPU, the 4B architecture, a round calibration, and 64 samples of 4,000 tokens (400 supervised)."""
    from datasets import Dataset

    config = json.loads((REPO / "recipes/configs/qwen3_vl_4b_instruct.json").read_text())
    monkeypatch.setattr(mm, "CALIBRATION", mm.Calibration(100_000, 5_000, 50_000, 1 * mm.GIB, 1.0, 0))
    monkeypatch.setattr(hook, "read_gpu", lambda: ("Fake GPU", 80 * mm.GIB))
    monkeypatch.setattr(hook, "model_config", lambda name, override=None: config)
    return Dataset.from_dict({"n_tokens": [4000] * 64, "n_trained_tokens": [400] * 64, "n_image_tokens": [2000] * 64})


def run_args(**given):
    training = dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, activation_checkpointing=True,
                    gradient_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": False}, world_size=1, max_length=8192, max_steps=-1,
                    num_train_epochs=1, seed=42, dataloader_drop_last=False, deepspeed=None)
    script = SimpleNamespace(samples_per_step=64)
    model = SimpleNamespace(model_name_or_path="m", lora_target_modules=TARGETS, lora_r=16, lora_dropout=0.05)
    return script, SimpleNamespace(**{**training, **given}), model


def test_the_plan_sets_what_was_not_given_and_prints_one_line(fake_gpu, caplog):
    script, training, model = run_args()
    with caplog.at_level(logging.INFO, logger="eogym_sft.training.memory_hook"):
        plan = hook.plan_run(script, training, model, fake_gpu, frozenset())
    # per token: 36 layers x (100,000 + 2 x 26,624 dropped inputs), and the step's pixel values (64 x 2,000 image
    # tokens x 4 patches x 1,536 bf16 values: 1.46 GiB); two samples fit, four (95.2 GiB) do not
    assert (plan.per_device_train_batch_size, plan.gradient_accumulation_steps, plan.checkpoint_every) == (2, 32, 0)
    assert (training.per_device_train_batch_size, training.activation_checkpointing, training.gradient_checkpointing) == (2, False, False)
    assert [r.getMessage() for r in caplog.records] == [
        "memory plan: Fake GPU, 80.0 GiB free, budget 80.0 GiB: 32 micro-batches a step on each of 1 process(es), 2 sample(s) "
        "each (largest 8,000 tokens), activation checkpointing off, predicted peak 53.2 GiB allocated, 53.2 GiB reserved; "
        "evaluation batches of 4 sample(s)"
    ]


def test_a_given_batch_keeps_and_the_plan_recomputes_layers_to_fit_it(fake_gpu):
    script, training, model = run_args(per_device_train_batch_size=4)
    plan = hook.plan_run(script, training, model, fake_gpu, frozenset({"per_device_train_batch_size"}))
    assert (plan.per_device_train_batch_size, plan.checkpoint_every) == (4, 2)
    assert training.activation_checkpointing and training.activation_checkpointing_kwargs == {"use_reentrant": False, "every_n_layers": 2}
    assert training.gradient_checkpointing_kwargs == training.activation_checkpointing_kwargs
    script, training, model = run_args(gradient_accumulation_steps=16)  # 64 / 16: four samples a micro-batch
    plan = hook.plan_run(script, training, model, fake_gpu, frozenset({"gradient_accumulation_steps"}))
    assert (plan.per_device_train_batch_size, training.per_device_train_batch_size, plan.checkpoint_every) == (4, 4, 2)


def test_a_request_that_cannot_fit_is_refused_before_the_model_loads(fake_gpu, monkeypatch):
    fits = ("per_device_train_batch_size 2, gradient_accumulation_steps 32, activation_checkpointing false, "
            "per_device_eval_batch_size 4 fits (53.2 GiB)")
    script, training, model = run_args(per_device_train_batch_size=4, activation_checkpointing=False)
    with pytest.raises(ValueError) as refused:
        hook.plan_run(script, training, model, fake_gpu, frozenset({"per_device_train_batch_size", "activation_checkpointing"}))
    assert str(refused.value) == (
        "per_device_train_batch_size 4 with activation_checkpointing false does not fit: its largest micro-batch (16,000 tokens) "
        f"is predicted to need 95.2 GiB against a budget of 80.0 GiB on Fake GPU; {fits}; {PLAN_HINT}"
    )
    assert training.per_device_train_batch_size == 4  # nothing was changed
    monkeypatch.setattr(hook, "read_gpu", lambda: ("Fake GPU", 5 * mm.GIB))
    with pytest.raises(ValueError) as refused:
        hook.plan_run(*run_args(), fake_gpu, frozenset())
    assert str(refused.value) == (
        "no setting fits: even at one sample a micro-batch with every layer checkpointed its largest micro-batch (4,000 tokens) "
        "is predicted to need 12.5 GiB against a budget of 5.0 GiB on Fake GPU; lower max_length, use a larger GPU, or "
        "see `eogym-sft plan --config CONFIG --gpu-memory SIZE`"
    )


def test_without_cuda_nothing_is_planned(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    script, training, model = run_args()
    assert hook.plan_run(script, training, model, None, frozenset()) is None
    assert (training.per_device_train_batch_size, training.activation_checkpointing) == (1, True)  # one sample; as set
    script, training, model = run_args(per_device_train_batch_size=4)
    hook.plan_run(script, training, model, None, frozenset({"per_device_train_batch_size"}))
    assert training.per_device_train_batch_size == 4


def test_an_oom_names_the_setting_to_lower():
    def message(batch, checkpointing):
        return hook.out_of_memory_message(SimpleNamespace(per_device_train_batch_size=batch, activation_checkpointing=checkpointing,
                                                          max_length=8192), 7)

    assert message(2, False) == (
        "CUDA out of memory at step 7 with per_device_train_batch_size 2 and activation_checkpointing false (the GPU had less "
        "than planned, or another process took memory): set activation_checkpointing true or lower per_device_train_batch_size 2; "
        "`eogym-sft plan --config CONFIG --gpu-memory SIZE` shows what fits"
    )
    assert "): set activation_checkpointing true; `" in message(1, False)
    assert "): lower per_device_train_batch_size 4; `" in message(4, True)
    assert "): lower max_length 8192; `" in message(1, True)


def test_an_oom_in_training_leaves_the_trainer_as_one_line(monkeypatch):
    from trl import SFTTrainer

    from eogym_sft.training.trainer import EOGymSFTTrainer

    def out_of_memory(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(SFTTrainer, "train", out_of_memory)
    trainer = EOGymSFTTrainer.__new__(EOGymSFTTrainer)  # train() reads only these
    trainer.args = SimpleNamespace(per_device_train_batch_size=1, activation_checkpointing=False, max_length=8192)
    trainer.state = SimpleNamespace(global_step=3)
    trainer.callback_handler = SimpleNamespace(train_dataloader=None)
    with pytest.raises(GPUOutOfMemory) as raised:
        trainer.train()
    assert isinstance(raised.value.__cause__, torch.OutOfMemoryError)
    assert str(raised.value).startswith("CUDA out of memory at step 3 with per_device_train_batch_size 1 ")
    with pytest.raises(SystemExit) as exited:
        with user_errors("eo_gym_4b.py"):
            raise raised.value
    assert str(exited.value) == f"eo_gym_4b.py: {raised.value} (--debug or EOGYM_DEBUG=1 shows the traceback)"


def test_upstream_checkpointing_names_keep_their_shape():
    """What the plan relies on upstream (docs/architecture.md): TRL's SFTConfig turns checkpointing on through the old
    name unless told otherwise; the old names mirror the new ones only when the args are built; accelerate's launcher
    names the ZeRO stage in the environment."""
    import inspect
    import warnings

    from accelerate.utils import launch
    from trl import SFTConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        args = SFTConfig(output_dir="unused", use_cpu=True)
    assert args.activation_checkpointing is True and args.gradient_checkpointing is True
    args.activation_checkpointing = False
    assert args.gradient_checkpointing is True  # not mirrored after __post_init__: apply() sets both
    source = inspect.getsource(launch.prepare_deepspeed_cmd_env)
    assert 'current_env["ACCELERATE_USE_DEEPSPEED"] = "true"' in source and '"ACCELERATE_DEEPSPEED_ZERO_STAGE"' in source


def test_grpo_plans_its_loss_micro_batch_with_the_prompt_shared_once():
    args = SimpleNamespace(per_device_train_batch_size=8, max_completion_length=6144)
    rollout = SimpleNamespace(max_episode_tokens=16384)
    assert hook.grpo_loss_batch(args, rollout, shared_prompts=True) == mm.MicroBatch(10240 + 8 * 6144, 0, 10240 + 8 * 6144, 8)
    assert hook.grpo_loss_batch(args, rollout, shared_prompts=False).tokens == 8 * 16384
    assert hook.grpo_loss_batch(SimpleNamespace(per_device_train_batch_size=2, max_completion_length=99999), rollout, True).tokens == 2 * 16384


def test_a_steps_largest_loss_micro_batch_is_its_longest_episodes():
    from eogym_sft.models.memory import MicroBatch
    from eogym_sft.training.memory_hook import longest_micro_batch

    prompts = [[1] * 50, [1] * 50, [2] * 90, [3] * 20]  # three questions, the first asked twice
    completions = [10, 40, 30, 20]
    # shared: the two longest distinct prompts (90 + 50) and the two longest completions (40 + 30)
    assert longest_micro_batch(prompts, completions, 2, shared=True) == MicroBatch(210, 0, 210, 2)
    # apart: the two longest episodes, 90 + 30 and 50 + 40
    assert longest_micro_batch(prompts, completions, 2, shared=False) == MicroBatch(210, 0, 210, 2)
    assert longest_micro_batch(prompts, completions, 3, shared=True) == MicroBatch(160 + 90, 0, 250, 3)
    assert longest_micro_batch(prompts, completions, 3, shared=False) == MicroBatch(120 + 90 + 60, 0, 270, 3)
    assert longest_micro_batch([[1] * 10], [5], 8, shared=False) == MicroBatch(15, 0, 15, 1)


def test_a_loss_that_cannot_fit_with_the_cache_freed_is_refused_in_one_line():
    from eogym_sft.training.memory_hook import check_worst_loss

    check_worst_loss(10 * 2**30, 10 * 2**30, 59_392)
    with pytest.raises(ValueError) as refused:
        check_worst_loss(30.2 * 2**30, 27.7 * 2**30, 59_392)
    assert str(refused.value) == ("a loss micro-batch of 59,392 tokens (30.2 GiB predicted) does not fit even with the "
                                  "KV cache freed (27.7 GiB): lower per_device_train_batch_size or max_completion_length")
