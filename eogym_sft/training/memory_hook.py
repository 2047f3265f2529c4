"""The memory plan in a run: which settings it may choose, the micro-batches it plans against, the GPU it
reads, the one line it prints, the refusal before the model loads, and the message of an OOM that still comes.

The settings of :data:`~eogym_sft.training.memory_plan.PLANNED` are the plan's unless given on the command line
or in the config file (:func:`settings_given`); given ones are kept, and refused before the model loads when
they cannot fit."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

from ..models.memory import MicroBatch, ModelShape, Setup, budget_bytes
from .memory_plan import (EVAL_BATCHES, PLANNED, Plan, choose, choose_eval, dealt_batches, eval_batches, plan_line,
                          run_steps, worst_case_batches)

logger = logging.getLogger(__name__)
PLAN_COMMAND = "eogym-sft plan --config CONFIG --gpu-memory SIZE"


# transformers' deprecated names of a planned setting, which set it too
OLD_NAMES = {"gradient_checkpointing": "activation_checkpointing"}


def settings_given(argv: list[str], config: dict | None = None) -> frozenset[str]:
    """The planned settings named in ``argv`` (``--name``, ``--name-with-dashes``, either with ``=value``) or in
    the config file's keys, under their names or transformers' old ones: the user's, which the plan keeps."""
    names = {**{name: name for name in PLANNED}, **OLD_NAMES}
    given = {planned for name, planned in names.items() if name in (config or {})}
    for word in argv:
        flag = word.split("=", 1)[0]
        given.update(planned
                     for name, planned in names.items() if flag in (f"--{name}", f"--{name.replace('_', '-')}"))
    return frozenset(given)


def config_file(argv: list[str]) -> dict:
    """The YAML that ``--config`` names in ``argv`` (TrlParser's flag), as a dict; ``{}`` without one."""
    import yaml

    for i, word in enumerate(argv):
        path = (word.split("=", 1)[1] if word.startswith("--config=")
                else argv[i + 1] if word == "--config" and i + 1 < len(argv) else None)
        if path:
            return yaml.safe_load(Path(path).read_text()) or {}
    return {}


def model_config(name_or_path: str, override: str | None = None) -> dict:
    """The architecture's ``config.json`` as a dict: ``override`` (a JSON file) if given, else the model's own."""
    if override:
        return json.loads(Path(override).read_text())
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(name_or_path).to_dict()


def zero_stage(training_args) -> int:
    """The ZeRO stage this process runs under: accelerate's DeepSpeed launch says it in the environment."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true"):
        return int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))
    ds = getattr(training_args, "deepspeed", None)
    if isinstance(ds, str) and Path(ds).is_file():
        ds = json.loads(Path(ds).read_text())
    return int(ds.get("zero_optimization", {}).get("stage", 0)) if isinstance(ds, dict) else 0


def fixed_settings(training_args, samples_per_step: int | None, given: frozenset[str],
                   processes: int) -> tuple[int | None, int | None]:
    """``(per_device_train_batch_size, checkpoint_every)`` the plan must keep (``None``: its to choose). Without
    ``samples_per_step`` the batch size sets the step's size, so it is never the plan's."""
    batch = None
    if "per_device_train_batch_size" in given or samples_per_step is None:
        batch = training_args.per_device_train_batch_size
    elif "gradient_accumulation_steps" in given:
        batch = max(1, samples_per_step // (training_args.gradient_accumulation_steps * processes))
    every = None
    if "activation_checkpointing" in given:
        every = checkpoint_every(training_args) if training_args.activation_checkpointing else 0
    return batch, every


def checkpoint_every(training_args) -> int:
    kwargs = training_args.activation_checkpointing_kwargs or {}
    return int(kwargs.get("every_n_layers", 1)) if training_args.activation_checkpointing else 0


def batches_from(dataset, samples_per_step: int, processes: int, steps: int, seed: int, drop_last: bool):
    """``b -> micro-batches`` of a prepared dataset, as the sampler deals them (per b, computed once)."""
    columns = [list(dataset[name]) for name in ("n_tokens", "n_trained_tokens", "n_image_tokens")]
    cache = {}

    def batches_for(b: int) -> list[MicroBatch]:
        if b not in cache:
            groups = samples_per_step // b
            cache[b] = dealt_batches(*columns, samples_per_step, groups, steps, seed, drop_last, processes)
        return cache[b]

    return batches_for


def plan_for(script_args, training_args, model_args, dataset, free_bytes: float, processes: int, zero: int,
             given: frozenset[str], architecture: dict, eval_dataset=None) -> Plan:
    """The plan for this run on a GPU with ``free_bytes`` free: the settings not ``given`` chosen, the given kept."""
    shape = ModelShape.of(architecture, model_args.lora_target_modules or (), model_args.lora_r)
    setup = Setup(processes, zero, model_args.lora_dropout)
    samples = script_args.samples_per_step or (training_args.per_device_train_batch_size * processes
                                               * training_args.gradient_accumulation_steps)
    max_length = training_args.max_length or 8192
    if dataset is None:
        batches_for = lambda b: worst_case_batches(b, max_length, math.ceil(samples / processes))  # noqa: E731
    else:
        steps = run_steps(len(dataset), samples, training_args.max_steps, training_args.num_train_epochs,
                          training_args.dataloader_drop_last)
        batches_for = batches_from(dataset, samples, processes, steps, training_args.seed,
                                   training_args.dataloader_drop_last)
    batch, every = fixed_settings(training_args, script_args.samples_per_step, given, processes)
    plan = choose(shape, setup, batches_for, budget_bytes(free_bytes), samples, batch_size=batch,
                  checkpoint_every=every)
    eval_given = training_args.per_device_eval_batch_size if "per_device_eval_batch_size" in given else None
    if eval_dataset is None:
        eval_for = lambda b: worst_case_batches(b, max_length)  # noqa: E731
    else:
        columns = [list(eval_dataset[name]) for name in ("n_tokens", "n_trained_tokens", "n_image_tokens")]
        eval_for = lambda b: eval_batches(*columns, b)  # noqa: E731
    return choose_eval(plan, shape, setup, eval_for, budget_bytes(free_bytes), eval_given)


def refusal(plan: Plan, auto: Plan, given: frozenset[str], device: str) -> str | None:
    """The one line that refuses a plan that cannot fit, naming the given settings and what would fit; ``None``
    when it fits."""
    if plan.fits:
        return None
    need = (f"its largest micro-batch ({plan.micro_batch_tokens:,} tokens) is predicted to need "
            f"{plan.predicted_reserved_gib:.1f} GiB")
    if plan.predicted_reserved_gib <= plan.budget_gib:  # training fits: the evaluation batch does not
        need = f"its largest evaluation batch is predicted to need {plan.predicted_eval_peak_gib:.1f} GiB allocated"
    budget = f"a budget of {plan.budget_gib:.1f} GiB on {device}"
    if not given or not auto.fits:
        return (f"no setting fits: even at one sample a micro-batch with every layer checkpointed {need} against "
                f"{budget}; lower max_length, use a larger GPU, or see `{PLAN_COMMAND}`")
    named = " with ".join(f"{name} {value}" for name, value in settings_of(plan).items() if name in given)
    would = ", ".join(f"{name} {value}" for name, value in settings_of(auto).items())
    return (f"{named} does not fit: {need} against {budget}; {would} fits ({auto.predicted_reserved_gib:.1f} GiB); "
            f"see `{PLAN_COMMAND}`")


def settings_of(plan: Plan) -> dict:
    return {
        "per_device_train_batch_size": plan.per_device_train_batch_size,
        "gradient_accumulation_steps": plan.gradient_accumulation_steps,
        "activation_checkpointing": str(plan.activation_checkpointing).lower(),
        "per_device_eval_batch_size": plan.per_device_eval_batch_size,
    }


def apply(plan: Plan, training_args, given: frozenset[str]) -> None:
    """Set the settings the plan chose (those not given) on ``training_args``."""
    if "per_device_train_batch_size" not in given:
        training_args.per_device_train_batch_size = plan.per_device_train_batch_size
    if "per_device_eval_batch_size" not in given and plan.per_device_eval_batch_size:
        training_args.per_device_eval_batch_size = plan.per_device_eval_batch_size
    if "activation_checkpointing" not in given:
        # transformers mirrors its old names (gradient_checkpointing*) only when the args are built; TRL reads them
        training_args.activation_checkpointing = training_args.gradient_checkpointing = plan.activation_checkpointing
        if plan.checkpoint_every > 1:
            kwargs = {**(training_args.activation_checkpointing_kwargs or {}), "every_n_layers": plan.checkpoint_every}
            training_args.activation_checkpointing_kwargs = training_args.gradient_checkpointing_kwargs = kwargs


def read_gpu() -> tuple[str, float] | None:
    """This process's GPU name and free bytes, the least over all processes (every rank must plan alike);
    ``None`` without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    free, _ = torch.cuda.mem_get_info()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        least = torch.tensor([free], dtype=torch.float64, device="cuda")
        torch.distributed.all_reduce(least, op=torch.distributed.ReduceOp.MIN)
        free = int(least.item())
    return torch.cuda.get_device_name(), float(free)


def plan_run(script_args, training_args, model_args, dataset, given: frozenset[str], eval_dataset=None) -> Plan | None:
    """At start, before the model loads: plan for this GPU's free memory, set the chosen settings, print the
    plan's line; refuse (``ValueError``, one line) what cannot fit. Without CUDA there is nothing to plan against:
    a batch size not given is one sample a micro-batch (it divides any step), the rest stays as set."""
    gpu = read_gpu()
    if gpu is None:
        batch, _ = fixed_settings(training_args, script_args.samples_per_step, given, training_args.world_size)
        training_args.per_device_train_batch_size = batch or 1
        if "per_device_eval_batch_size" not in given:
            training_args.per_device_eval_batch_size = EVAL_BATCHES[0]
        logger.info("memory plan: no CUDA device, %d sample(s) a micro-batch",
                    training_args.per_device_train_batch_size)
        return None
    device, free = gpu
    architecture = model_config(model_args.model_name_or_path)
    args = (script_args, training_args, model_args, dataset, free, training_args.world_size, zero_stage(training_args))
    plan = plan_for(*args, given, architecture, eval_dataset)
    message = refusal(plan, plan if plan.fits else plan_for(*args, frozenset(), architecture, eval_dataset), given,
                      device)
    if message:
        raise ValueError(message)
    apply(plan, training_args, given)
    logger.info(plan_line(plan, device, free, training_args.world_size))
    return plan


def lora_targets(model) -> tuple[list[str], int]:
    """The projection names LoRA wraps in ``model`` and its rank."""
    wrapped = [(name.rsplit(".", 1)[-1], m)
               for name, m in model.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]
    ranks = [a.weight.shape[0] for _, m in wrapped for a in m.lora_A.values()]
    return sorted({name for name, _ in wrapped}), max(ranks, default=0)


def grpo_loss_batch(args, rollout_args, shared_prompts: bool) -> MicroBatch:
    """GRPO's largest loss micro-batch: ``per_device_train_batch_size`` episodes of at most ``max_episode_tokens``
    each, of which ``max_completion_length`` are the model's; with shared prompts the prompt counts once. Nothing is
    counted for the loss's logits: TRL's fused LM head keeps no vocabulary-wide ones."""
    episodes, episode, completion = (args.per_device_train_batch_size, rollout_args.max_episode_tokens,
                                     args.max_completion_length)
    completion = min(completion, episode)
    tokens = (episode - completion) + episodes * completion if shared_prompts else episodes * episode
    return MicroBatch(tokens, 0, tokens, episodes)


def worst_loss_refusal(loss: float, room: float, tokens: int) -> str | None:
    """The one-line refusal of settings whose largest loss micro-batch (``tokens``, ``loss`` bytes) does not fit in
    ``room`` even with the KV cache freed; None when it fits."""
    if loss <= room:
        return None
    return (f"a loss micro-batch of {tokens:,} tokens ({loss / 2**30:.1f} GiB predicted) does not fit even with the "
            f"KV cache freed ({room / 2**30:.1f} GiB): lower per_device_train_batch_size or max_completion_length")


def check_worst_loss(loss: float, room: float, tokens: int) -> None:
    """Raise :func:`worst_loss_refusal`'s line, if any."""
    if (refusal := worst_loss_refusal(loss, room, tokens)) is not None:
        raise ValueError(refusal)


def longest_micro_batch(prompts: list[list[int]], completions: list[int], size: int, shared: bool) -> MicroBatch:
    """No loss micro-batch of a step is larger: the ``size`` longest completions, with the longest of the step's
    ``prompts`` (token ids, an episode's each) once per question they can come from when the loss shares a question's
    prompt, else each with its own. Every token is counted as an image's.

    >>> longest_micro_batch([[1] * 50, [1] * 50, [2] * 90], [10, 30, 20], 3, shared=True).tokens  # 90 + 50 + 60
    200
    >>> longest_micro_batch([[1] * 50, [1] * 50, [2] * 90], [10, 30, 20], 3, shared=False).tokens  # 110 + 80 + 60
    250
    """
    if shared:
        distinct = sorted({tuple(p): len(p) for p in prompts}.values(), reverse=True)
        tokens = sum(distinct[:size]) + sum(sorted(completions, reverse=True)[:size])
    else:
        tokens = sum(sorted((len(p) + c for p, c in zip(prompts, completions)), reverse=True)[:size])
    count = min(size, len(completions))
    return MicroBatch(tokens, 0, tokens, count)


def grpo_loss_reserve(model, args, rollout_args, processes: int, shared_prompts: bool,
                      batch: MicroBatch | None = None) -> float:
    """Bytes GRPO's loss forward and backward take beside the loaded weights for ``batch`` (by default the largest
    the settings allow, :func:`grpo_loss_batch`)."""
    from ..models.memory import peak_terms

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    targets, rank = lora_targets(model)
    shape = ModelShape.of(base.config.to_dict(), targets, rank)
    dropout = max((d.p for m in model.modules() if hasattr(m, "lora_dropout")
                   for d in m.lora_dropout.values() if hasattr(d, "p")), default=0.0)
    setup = Setup(processes, zero_stage(args), dropout, checkpoint_every(args))
    terms = peak_terms(shape, setup, batch or grpo_loss_batch(args, rollout_args, shared_prompts))
    return terms["reserved"] - terms["frozen_weights"]


def out_of_memory_message(training_args, step: int) -> str:
    """One line for a CUDA OOM that came mid-run despite the plan: the setting to lower, and the plan command."""
    batch, checkpointing = training_args.per_device_train_batch_size, training_args.activation_checkpointing
    if not checkpointing:
        fix = "set activation_checkpointing true" + (f" or lower per_device_train_batch_size {batch}"
                                                     if batch > 1 else "")
    else:
        fix = (f"lower per_device_train_batch_size {batch}" if batch > 1
               else f"lower max_length {training_args.max_length}")
    return (f"CUDA out of memory at step {step} with per_device_train_batch_size {batch} and activation_checkpointing "
            f"{str(bool(checkpointing)).lower()} (the GPU had less than planned, or another process took memory): "
            f"{fix}; `{PLAN_COMMAND}` shows what fits")
