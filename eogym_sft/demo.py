"""``eogym-sft demo``: the whole path on the bundled sample, on CPU, in minutes.

Writes a small random Qwen3-VL (real processor, offline; 128 wide), trains a LoRA adapter on it with
:func:`eogym_sft.training.sft.train` (what ``recipes/eo_gym_4b.py`` runs; the bundled sample is prepared on the
way in), then validates the adapter and its base on the traces the run held out (never trained on),
and prints both token accuracies, where the adapter, the report and the manifest are, and what to run
next. Everything it needs ships with the package.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from .demo_arguments import teacher_forced
from .demo_report import agent_report, format_agent_report, grpo_per_step

SAMPLE_DIR = Path(__file__).resolve().with_name("sample")  # the bundled sample: data root and JSONL
SAMPLE_JSONL = SAMPLE_DIR / "eogym_sample.jsonl"


EVAL_FRACTION = 0.15  # share of the sample's traces held out: trained on never, validated on
MAX_PIXELS = 200704  # 196 visual tokens an image: a CPU run in minutes (the recipe's cap is 1,003,520)
STEPS = 16  # optimizer steps of 2 samples: held-out accuracy clearly above the base's, in under 2 minutes
LEARNING_RATE = 1e-2  # high, so that a few steps move a small random model
SCENE_CAP = 128 * 128  # the agent demo's pixel cap: a quarter of the colour_grid scene's pixels
SCALE_REWARDS = ("group", "batch", "none")  # TRL's scale_rewards values
LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")  # TRL 1.16's loss_type values


def demo_configs(
    model_dir: Path, output: Path, steps: int, learning_rate: float, overwrite: bool = False,
    max_pixels: int = MAX_PIXELS, min_pixels: int | None = None,
):
    """The recipe's ``(script, training, model)`` configs shrunk to a CPU smoke run: the published LoRA and
    the speed path (packed batches, variable-length attention, token-balanced micro-batches), few steps."""
    from trl import ModelConfig, SFTConfig

    from .config import EOGymScriptArguments, SampleConfig
    from .models.loading import LORA_TARGETS

    script = EOGymScriptArguments(
        dataset_path=str(SAMPLE_JSONL),
        data_root=str(SAMPLE_DIR),
        prepared_dir=str(output / "prepared"),
        eval_fraction=EVAL_FRACTION,
        prep_num_proc=1,
        max_pixels=max_pixels,
        **({} if min_pixels is None else {"min_pixels": min_pixels}),
        samples_per_step=2,
        overwrite_output_dir=overwrite,
    )
    training = SFTConfig(
        output_dir=str(output / "adapter"),
        max_steps=steps,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        train_sampling_strategy="batch_rebalance",
        length_column_name="n_tokens",
        learning_rate=learning_rate,
        lr_scheduler_type="constant",
        optim="adamw_torch",
        weight_decay=0.1,
        seed=42,
        max_length=SampleConfig.max_length,
        padding_free=True,
        eval_strategy="steps",
        eval_steps=steps,
        save_strategy="steps",
        save_steps=steps,
        logging_steps=5,
        use_cpu=True,
        bf16=False,
        activation_checkpointing=False,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        dataset_kwargs={"skip_prepare_dataset": True},
        report_to="none",
    )
    model = ModelConfig(
        model_name_or_path=str(model_dir),
        dtype="float32",
        attn_implementation="eogym_varlen",
        use_peft=True,
        lora_r=16,
        lora_alpha=32,
        lora_dropout=0.05,
        lora_target_modules=list(LORA_TARGETS),
    )
    return script, training, model


def run_demo(
    output: str | Path = "runs/demo",
    steps: int = STEPS,
    learning_rate: float = LEARNING_RATE,
    overwrite: bool = False,
    max_pixels: int = MAX_PIXELS,
) -> dict:
    """Small model, LoRA training on the bundled sample, validation on its held-out traces; returns the report."""
    from .evaluation.validate import ValidateConfig, validate
    from .guards import check_output
    from .models.tiny import DEMO_QWEN3_VL_CONFIG, save_tiny_model
    from .training.sft import train

    output = Path(output)
    check_output(output, "eogym-sft demo", overwrite, "demo")
    model_dir = save_tiny_model(output / "small-qwen3-vl", config=DEMO_QWEN3_VL_CONFIG)
    script, training, model = demo_configs(model_dir, output, steps, learning_rate, overwrite, max_pixels)
    adapter = train(script, training, model)
    report = validate(
        ValidateConfig(
            model=str(model_dir),
            adapters=[f"adapter={adapter}"],
            data=str(output / "prepared"),
            data_root=str(SAMPLE_DIR),
            output=str(output / "validation.json"),
            batch_size=4,
            max_pixels=max_pixels,
            held_out_fraction=EVAL_FRACTION,
            seed=training.seed,
            overwrite=overwrite,
        )
    )
    print(demo_summary(report, output, adapter))
    from .evaluation.view import write_report

    print(f"viewer:   {write_report([output], output / 'report.html')}  (in a browser: training curves, both arms' "
          "scores)")
    return report


def demo_summary(report: dict, output: Path, adapter: str) -> str:
    """The demo's last lines: held-out scores of both arms, where everything is, what to run next."""
    ours, base = report["models"]["adapter"]["overall"], report["models"]["base"]["overall"]
    return "\n".join(
        [
            "",
            f"demo done. Held-out traces (never trained on): {report['samples']} samples, {ours['tokens']} supervised "
            "tokens",
            f"  token accuracy  base {base['token_accuracy']:.4f}  ->  adapter {ours['token_accuracy']:.4f}",
            f"  loss            base {base['loss']:.4f}  ->  adapter {ours['loss']:.4f}",
            "  (a small random model trained a few steps: the path end to end, not an EO model)",
            f"adapter:  {adapter}  (eogym_run.json beside it: config, versions, data hash)",
            f"report:   {output / 'validation.json'}",
            f"manifest: {output / 'prepared' / 'manifest.jsonl'}  (every input line: kept, split or dropped, and why)",
            "next:     the recipe's own script on this sample, on CPU: docs/training.md, 'A first run on CPU'",
            "          on a GPU, score turn by turn (generates 512 tokens a turn: slow on a CPU): eogym-sft evaluate "
            f"--model {output / 'small-qwen3-vl'} --adapter {adapter} --data {SAMPLE_JSONL} --data-root {SAMPLE_DIR} "
            f"--output {output / 'evaluation'}",
            "          or train the real thing: see README.md, 'Train EO-Gym-4B'",
        ]
    )


# ---------------------------------------------------------------- the agent demo (eogym-sft demo --agent)


@dataclass
class AgentDemoConfig:
    """Settings of ``eogym-sft demo --agent``: a task only the crop tool solves, and the loop SFT ->
    closed-loop rollouts -> GRPO -> rejection sampling on it (docs/agent.md). The defaults are the
    CPU demo's; ``bench/h200_session.sh agent_1gpu`` runs the same loop larger."""

    # eogym_sft.environment.tasks.TASKS: colour_grid (one crop), colour_pair (two), colour_count (four)
    task: str = "colour_grid"
    train_rows: int = 112  # SFT gold traces, GRPO and rejection-sampling prompts (val_rows split off)
    held_out_rows: int = 32  # questions only ever rolled out on: never in any training stage
    seed: int = 0
    max_pixels: int = SCENE_CAP  # the full scene downscaled 2x (its checkerboards average to grey); crops native
    min_pixels: int = 4096
    # 60 learned the AOIs in one run and not in another (held-out Pass@1 0.68 vs 0.23); 100: 0.73-0.78 in three
    sft_steps: int = 100
    sft_learning_rate: float = 5e-3
    grpo_steps: int = 24  # 6 generated batches, each trained on 4 times (grpo_num_iterations), checkpoints every 8
    grpo_learning_rate: float = 1e-4
    num_generations: int = 8  # GRPO's group: episodes per question, the recipe's 8
    grpo_questions_per_step: int = 2
    # Levers of a GRPO seed study (issue 37); the defaults are the demo's measured run (docs/agent.md)
    grpo_beta: float = 0.0  # KL to the SFT policy (TRL keeps a frozen copy of the SFT adapter as the reference)
    grpo_lr_scheduler_type: str = "constant"  # TRL's lr_scheduler_type, e.g. "cosine" or "constant_with_warmup"
    grpo_warmup_steps: float = 0  # TRL's warmup_steps: a count of steps, or a float in [0, 1) for a share of them
    # GRPO's sampling temperature (TRL's, the recipe's 1.0); its loss scores at the same one
    grpo_temperature: float = 1.0
    # TRL's scale_rewards: "group" (by the group's std, the recipe's), "batch", or "none" (Dr. GRPO)
    grpo_scale_rewards: str = "group"
    # TRL's num_iterations: steps trained on each generated batch; above 1 its clipped ratio binds
    grpo_num_iterations: int = 4  # the demo's: four passes a batch move the policy on a CPU (docs/agent.md)
    # TRL's epsilon_high (DAPO's clip-higher, e.g. 0.28); None: TRL's epsilon, 0.2
    grpo_epsilon_high: float | None = 0.28
    # TRL's disable_dropout (LoRA's 0.05 off): with grpo_num_iterations > 1, first passes' ratio 1
    grpo_disable_dropout: bool = True
    # TRL's loss_type; "cispo" clips the importance weight at grpo_epsilon_high (ScaleRL: 5.0)
    grpo_loss_type: str = "dapo"
    grpo_crop_iou_weight: float = 0.0  # the GRPO recipe's crop_iou_weight: the reward's crop-IoU term (0: off)
    # TRL's entropy_coef: an entropy bonus in the loss (adaptive control's starting value)
    grpo_entropy_coef: float = 0.0
    # TRL's adaptive entropy control (Skywork-OR1) when set: the bonus applies while the policy's entropy (nats a
    # trained token) is at or below this, its coefficient growing by TRL's entropy_coef_delta a step there,
    # else shrinking
    grpo_entropy_target: float | None = None
    # TRL's top_entropy_quantile: the loss on each batch's highest-entropy tokens only, this share of them (1: all)
    grpo_top_entropy_quantile: float = 1.0
    rft_steps: int = 100
    samples: int = 2  # episodes per held-out question (Pass@1 is the mean over them, Pass@k any of them)
    rft_samples: int = 1  # episodes per training question for rejection sampling
    # validation questions, the last val_rows of the train_rows (trained on by no stage, never the held-out ones):
    # with sft_pick_every/grpo_pick_every N the stage saves every N steps and its checkpoint of best validation
    # Pass@1 goes on
    val_rows: int = 16
    sft_pick_every: int = 0
    grpo_pick_every: int = 8
    # roll the base model out on the held-out questions too (it scores 0: a study can skip it)
    held_out_base: bool = True
    temperature: float = 0.7  # the held-out and rejection-sampling rollouts' temperature (GRPO's: grpo_temperature)
    # per turn; None: the task's turn_tokens (colour_grid 48: its gold call is 40 tokens)
    max_new_tokens: int | None = None
    max_turns: int = 3
    # GRPO's max_completion_length: an episode's turns AND its tool results and their images (about 150
    # tokens here); an episode longer than this counts as truncated and trains on nothing
    completion_tokens: int | None = None  # None: the task's episode_tokens (colour_grid 512)
    model_config: dict | None = None  # the architecture (default: the demo's 128-wide tiny Qwen3-VL)
    device: str = "cpu"  # "cpu" for the demo; "cuda" for the GPU stage (training and rollouts)
    embedding_std: float = 0.4  # of the tied embeddings: room for confident logits (save_agent_model)

    def __post_init__(self):
        from .environment.tasks import TASKS

        if self.task not in TASKS:
            raise ValueError(f"no task {self.task!r}: choose one of {', '.join(TASKS)}")
        self.max_new_tokens = TASKS[self.task].turn_tokens if self.max_new_tokens is None else self.max_new_tokens
        self.completion_tokens = (TASKS[self.task].episode_tokens if self.completion_tokens is None
                                  else self.completion_tokens)
        if min(self.train_rows, self.held_out_rows, self.sft_steps, self.samples, self.rft_samples) < 1:
            raise ValueError("train_rows, held_out_rows, sft_steps, samples and rft_samples must be at least 1")
        if self.grpo_steps < 0 or self.rft_steps < 0:
            raise ValueError("grpo_steps and rft_steps must be >= 0")
        if self.grpo_scale_rewards not in SCALE_REWARDS:
            raise ValueError(f"grpo_scale_rewards must be one of {', '.join(SCALE_REWARDS)}, got "
                             f"{self.grpo_scale_rewards!r}")
        if self.grpo_num_iterations < 1:
            raise ValueError(f"grpo_num_iterations must be at least 1, got {self.grpo_num_iterations}")
        if self.grpo_epsilon_high is not None and self.grpo_epsilon_high <= 0:
            raise ValueError(f"grpo_epsilon_high must be > 0 (or None: TRL's epsilon), got {self.grpo_epsilon_high}")
        self._check_loss_levers()
        for stage, every, steps in (("sft", self.sft_pick_every, self.sft_steps),
                                    ("grpo", self.grpo_pick_every, self.grpo_steps)):
            if every and (not 0 < self.val_rows < self.train_rows or every < 0 or steps % every):
                raise ValueError(f"{stage}_pick_every {every} needs 0 < val_rows < train_rows (got {self.val_rows}, "
                                 f"{self.train_rows}) and to divide {stage}_steps ({steps}), so that the last step is "
                                 "a candidate")

    def _check_loss_levers(self):
        if self.grpo_loss_type not in LOSS_TYPES:
            raise ValueError(f"grpo_loss_type must be one of {', '.join(LOSS_TYPES)}, got {self.grpo_loss_type!r}")
        if self.grpo_loss_type == "cispo" and (self.grpo_epsilon_high or 0) <= 1:
            raise ValueError("grpo_loss_type cispo caps the importance weight itself at grpo_epsilon_high: set it "
                             f"above 1 (ScaleRL: 5.0), got {self.grpo_epsilon_high}")
        if self.grpo_entropy_coef < 0 or (self.grpo_entropy_target is not None and self.grpo_entropy_target <= 0):
            raise ValueError(f"grpo_entropy_coef must be >= 0 and grpo_entropy_target > 0 (or None), got "
                             f"{self.grpo_entropy_coef} and {self.grpo_entropy_target}")
        if not 0 < self.grpo_top_entropy_quantile <= 1:
            raise ValueError(f"grpo_top_entropy_quantile must be in (0, 1], got {self.grpo_top_entropy_quantile}")


def _sft_configs(
    cfg: AgentDemoConfig, model_dir: Path, dataset: Path, data_root: Path, output: Path, steps: int,
    overwrite: bool = False, pick_every: int = 0
):
    """The SFT demo's configs pointed at the task's JSONL: every row trained on (the held-out questions
    are a separate file), no evaluation pass, one save at the end (and a checkpoint every ``pick_every`` steps)."""
    script, training, model = demo_configs(model_dir, output, steps, cfg.sft_learning_rate, overwrite, cfg.max_pixels,
                                           cfg.min_pixels)
    script.dataset_path, script.data_root, script.eval_fraction = str(dataset), str(data_root), 0.0
    script.prepared_dir = str(output / "prepared")
    training.output_dir, training.eval_strategy, training.save_strategy = str(output / "adapter"), "no", "no"
    training.logging_steps = max(1, steps // 6)
    training.use_cpu = cfg.device == "cpu"
    if pick_every:
        training.save_strategy, training.save_steps, training.save_only_model = "steps", pick_every, True
    return script, training, model


def _grpo_configs(cfg: AgentDemoConfig, model_dir: Path, dataset: Path, data_root: Path, sft_adapter: str,
                  output: Path, overwrite: bool = False):
    """The GRPO recipe's settings (its reward, group-scaled advantages, no KL by default) shrunk to a CPU run from the
    SFT adapter; one checkpoint at the last step keeps ``trainer_state.json``, the reward per step (per generated
    batch: every ``grpo_num_iterations`` steps)."""
    from trl import GRPOConfig, ModelConfig

    from .models.loading import LORA_TARGETS
    from .training.grpo import GRPOScriptArguments

    script = GRPOScriptArguments(
        dataset_path=str(dataset), data_root=str(data_root), sft_adapter=sft_adapter, tool_backends="crop",
        rollout_turn_tokens=cfg.max_new_tokens, max_pixels=cfg.max_pixels, min_pixels=cfg.min_pixels,
        overwrite_output_dir=overwrite, crop_iou_weight=cfg.grpo_crop_iou_weight,
    )
    batch = cfg.num_generations * cfg.grpo_questions_per_step
    training = GRPOConfig(
        output_dir=str(output), max_steps=cfg.grpo_steps, learning_rate=cfg.grpo_learning_rate,
        lr_scheduler_type=cfg.grpo_lr_scheduler_type, warmup_steps=cfg.grpo_warmup_steps,
        num_generations=cfg.num_generations, per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        beta=cfg.grpo_beta, scale_rewards=cfg.grpo_scale_rewards, temperature=cfg.grpo_temperature,
        num_iterations=cfg.grpo_num_iterations, epsilon_high=cfg.grpo_epsilon_high,
        disable_dropout=cfg.grpo_disable_dropout, max_completion_length=cfg.completion_tokens,
        loss_type=cfg.grpo_loss_type, entropy_coef=cfg.grpo_entropy_coef,
        top_entropy_quantile=cfg.grpo_top_entropy_quantile,
        use_adaptive_entropy=cfg.grpo_entropy_target is not None,
        **({} if cfg.grpo_entropy_target is None else {"entropy_target": cfg.grpo_entropy_target}),
        max_tool_calling_iterations=cfg.max_turns - 1, mask_truncated_completions=True, seed=cfg.seed,
        use_cpu=cfg.device == "cpu", bf16=False, activation_checkpointing=False, logging_steps=1,
        save_strategy="steps", save_steps=cfg.grpo_pick_every or cfg.grpo_steps, save_only_model=True,
        report_to="none", dataloader_num_workers=0,
    )
    model = ModelConfig(
        model_name_or_path=str(model_dir), dtype="float32", use_peft=True,
        # the packed loss forward's attention; CUDA's varlen kernels take bf16 only, so in float32 there SDPA
        attn_implementation="eogym_varlen" if cfg.device == "cpu" else "sdpa",
        lora_r=16, lora_alpha=32, lora_dropout=0.05, lora_target_modules=list(LORA_TARGETS),
    )
    return script, training, model


def _rollout(
    cfg: AgentDemoConfig, model_dir: Path, data: Path, data_root: Path, adapters: list[str], output: Path,
    samples: int, base: bool,
    overwrite: bool = False,
):
    """Closed-loop episodes of the arms on ``data`` with the ``crop`` backend (real tool execution). One
    slot per episode of an arm, so that no slot is refilled within an arm."""
    from .evaluation.rollout import RolloutConfig, rollout

    rows = sum(1 for line in data.read_text().splitlines() if line.strip())
    return rollout(
        RolloutConfig(
            model=str(model_dir), data=[str(data)], output=str(output), adapters=adapters, data_root=str(data_root),
            include_base=base, samples=samples, temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
            max_turns=cfg.max_turns, tools=["crop"], slots=rows * samples,
            max_episode_tokens=cfg.completion_tokens + 512, seed=cfg.seed,
            max_pixels=cfg.max_pixels, min_pixels=cfg.min_pixels, device=cfg.device, dtype="float32",
            overwrite=overwrite,
        ),
        progress=False,
    )


def save_agent_model(output: Path, cfg: AgentDemoConfig) -> Path:
    """The demo's tiny Qwen3-VL with its (tied) token embeddings drawn at ``cfg.embedding_std``.

    Why: LoRA trains the decoder layers only, so a token's logit is the final-normed hidden state (norm
    about sqrt(width)) against a fixed embedding row. At the SFT demo's 0.1 the aligned logit cannot clear
    the log-sum-exp of 151,936 random ones, so no token gets above about half the probability and sampled
    episodes (GRPO samples at temperature 1) fall apart within a few tokens; at 0.4 the margin is ample.
    """
    import torch

    from .models.processor import save_processor
    from .models.tiny import DEMO_QWEN3_VL_CONFIG, build_offline_processor, build_tiny_model

    model = build_tiny_model(cfg.seed, cfg.model_config or DEMO_QWEN3_VL_CONFIG)
    embeddings = model.get_input_embeddings().weight
    with torch.no_grad():
        embeddings.mul_(cfg.embedding_std / embeddings.std())
    model.save_pretrained(output)
    save_processor(build_offline_processor(), output)
    return output


def run_agent_demo(output: str | Path = "runs/agent_demo", overwrite: bool = False,
                   cfg: AgentDemoConfig | None = None) -> dict:
    """The agent loop on ``cfg.task`` (``colour_grid`` by default); prints the table and writes
    ``agent_report.json``."""
    from .demo_pick import pick_checkpoint
    from .guards import check_output
    from .training import grpo
    from .training.sft import train

    cfg = cfg or AgentDemoConfig()
    output = Path(output)
    check_output(output, "eogym-sft demo --agent", overwrite, "demo")
    seconds: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(stage: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        seconds[stage] = round(now - clock, 1)
        clock = now
        print(f"[agent demo] {stage} done in {seconds[stage]:.1f} s", flush=True)

    root, train_rows, val, held_out, model_dir = _task_and_model(cfg, output)
    lap("task and model")

    sft = train(*_sft_configs(cfg, model_dir, train_rows, root, output / "sft", cfg.sft_steps, overwrite,
                              cfg.sft_pick_every))
    picked, on_val = {}, lambda arms, name: _rollout(cfg, model_dir, val, root, arms, output / name, cfg.samples,
                                                     False, overwrite)
    if cfg.sft_pick_every:
        sft, picked["sft"] = pick_checkpoint(sft, on_val)
    lap("sft")

    arms = [f"sft={sft}"]
    rewards: list[float] = []
    if cfg.grpo_steps:
        grpo_dir = grpo.train(*_grpo_configs(cfg, model_dir, train_rows, root, sft, output / "grpo", overwrite))
        rewards = grpo_per_step(grpo_dir)
        if cfg.grpo_pick_every:
            grpo_dir, picked["grpo"] = pick_checkpoint(grpo_dir, on_val, start=sft)
        arms.append(f"grpo={grpo_dir}")
        lap("grpo")

    if cfg.rft_steps:
        rft, rft_info = _rejection_sampling(cfg, model_dir, train_rows, root, sft, output, overwrite)
        if rft is not None:
            arms.append(f"rft={rft}")
        lap("rejection sampling")
    else:
        rft_info = None

    summary = _rollout(cfg, model_dir, held_out, root, arms, output / "rollout", cfg.samples, cfg.held_out_base,
                       overwrite)
    lap("held-out rollouts")
    forced = teacher_forced(cfg, model_dir, held_out, root, arms, output / "evaluation", overwrite)
    lap("held-out teacher-forced")
    report = agent_report(summary, rewards, rft_info, seconds, cfg, forced) | {"picked": picked or None}
    _write_agent_report(report, output)
    return report


def _write_agent_report(report: dict, output: Path) -> None:
    """``agent_report.json``, its table printed, and the run's page (``report.html``)."""
    from .atomic import write_text_atomic
    from .evaluation.view import write_report

    write_text_atomic(output / "agent_report.json", json.dumps(report, indent=2) + "\n")
    print(format_agent_report(report, output))
    print(f"viewer: {write_report([output], output / 'report.html')}  (in a browser: every episode turn by turn, "
          "GRPO's curves)")


def _task_and_model(cfg: AgentDemoConfig, output: Path) -> tuple[Path, Path, Path | None, Path, Path]:
    """The task's questions (``root``: training, validation when ``cfg.val_rows``, held out) and the small model."""
    from .environment.tasks import write_task

    root, fit = output / "task", cfg.train_rows - cfg.val_rows
    train_rows = write_task(root, fit, cfg.seed, start=0, name="train.jsonl", task=cfg.task)
    val = (write_task(root, cfg.val_rows, cfg.seed, start=fit, name="validation.jsonl", task=cfg.task)
           if cfg.val_rows else None)
    held_out = write_task(root, cfg.held_out_rows, cfg.seed, start=cfg.train_rows, name="held_out.jsonl",
                          task=cfg.task)
    return root, train_rows, val, held_out, save_agent_model(output / "small-qwen3-vl", cfg)


def _rejection_sampling(cfg: AgentDemoConfig, model_dir: Path, train_rows: Path, root: Path, sft: str | Path,
                        output: Path, overwrite: bool) -> tuple[str | None, dict]:
    """One round of rejection sampling: the SFT arm's correct episodes on the training questions, with the gold
    traces, train the ``rft`` adapter (None when no episode was correct); and the round's counts."""
    from .training.sft import train

    sampled = _rollout(cfg, model_dir, train_rows, root, [f"sft={sft}"], output / "rft_sampling", cfg.rft_samples,
                       False, overwrite)
    union, rft_info = rejection_data(output / "rft_sampling", train_rows, sampled["counts"]["episodes"])
    if union is None:  # nothing to train on: the arm is left out of the table, and the report says why
        print("[agent demo] rejection sampling kept no episode (SFT answered no training question right): no rft arm",
              flush=True)
        return None, rft_info
    return train(*_sft_configs(cfg, model_dir, union, root, output / "rft", cfg.rft_steps, overwrite)), rft_info


def rejection_data(sampling_dir: Path, gold: Path, sampled: int) -> tuple[Path | None, dict]:
    """One round's training data: the gold traces plus the SFT arm's correct episodes in ``sampling_dir``
    (``episodes --filter correct``), as ``train_plus_correct.jsonl``; None when no episode is correct."""
    from .evaluation.episodes_filter import filter_episodes

    correct = sampling_dir / "correct.jsonl"
    kept = filter_episodes(sampling_dir / "episodes.jsonl", correct, "correct", arm="sft")["kept"]
    info = {"episodes_sampled": sampled, "episodes_kept": kept, "rows_trained": None}
    if not kept:
        return None, info
    union = sampling_dir / "train_plus_correct.jsonl"
    gold_text = gold.read_text()
    union.write_text(gold_text + correct.read_text())
    info["rows_trained"] = sum(1 for line in gold_text.splitlines() if line.strip()) + kept
    return union, info
