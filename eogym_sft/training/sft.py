"""One LoRA SFT run: processor, data, model, trainer, save. ``recipes/eo_gym_4b.py`` and ``eogym-sft demo``
call :func:`train` with TrlParser's three configs; its pieces (:func:`build_datasets`, :func:`build_model`,
:func:`build_collator`, :func:`build_trainer`) are what ``bench/train_throughput.py`` measures."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from transformers.trainer_utils import enable_full_determinism, set_seed
from trl import ModelConfig, SFTConfig

from ..config import EOGymScriptArguments
from ..data.datasets import is_held_out, load_or_prepare, read_rows, split_by_trace
from ..data.prepare import DROP_SHARE, PrepConfig
from ..models.loading import apply_lora, compile_language_layers, load_base_model
from ..models.host_layout import VisionGeometry
from ..models.processor import load_processor
from ..models.vision_blocks import compile_vision_blocks
from ..data.collator import EOGymCollator
from .resume import CheckpointIdentity, claim_output_dir, finished, resume_point
from .run_info import save_run
from .memory_hook import plan_run
from .memory_plan import PLANNED
from .sampler import accumulation_steps
from .trainer import EOGymSFTTrainer

logger = logging.getLogger(__name__)


def recipe_parser():
    """The SFT recipe's parser: its YAML read strictly, TRL's three configs. TRL's ``SFTConfig`` defaults
    transformers' old name ``gradient_checkpointing`` to true, which would turn checkpointing on (with a deprecation
    warning) wherever nothing sets it; unset here, it is the memory plan's (:func:`.memory_hook.plan_run`)."""
    from ..strict_yaml import RecipeParser

    # allow_abbrev=False: a mistyped flag (--max_step) is refused, not taken as the flag it begins (--max_steps)
    parser = RecipeParser((EOGymScriptArguments, SFTConfig, ModelConfig), allow_abbrev=False)
    parser.set_defaults(gradient_checkpointing=None)
    return parser


def set_samples_per_step(script_args: EOGymScriptArguments, training_args: SFTConfig) -> None:
    """Derive ``gradient_accumulation_steps`` so that a step is ``samples_per_step`` samples on this world size.

    A ``gradient_accumulation_steps`` other than 1 (TRL's default) was chosen by the user: one that differs from
    what ``samples_per_step`` derives is refused, naming both, never replaced silently."""
    if script_args.samples_per_step is not None:
        derived = accumulation_steps(script_args.samples_per_step, training_args.per_device_train_batch_size,
                                     training_args.world_size)
        given = training_args.gradient_accumulation_steps
        if given != 1 and given != derived:
            raise ValueError(
                f"samples_per_step {script_args.samples_per_step} and gradient_accumulation_steps {given} disagree: "
                f"{script_args.samples_per_step} samples a step at per_device_train_batch_size "
                f"{training_args.per_device_train_batch_size} on {training_args.world_size} process(es) is {derived} "
                "micro-batches a step. Set one of them: --samples_per_step None keeps gradient_accumulation_steps as "
                "given"
            )
        training_args.gradient_accumulation_steps = derived
    logger.info(
        "samples per optimizer step: %d = %d per micro-batch x %d micro-batches x %d processes",
        training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps
        * training_args.world_size,
        training_args.per_device_train_batch_size, training_args.gradient_accumulation_steps, training_args.world_size,
    )


IMAGE_CHECK_SAMPLES = 64  # samples whose image files are looked for before training: a wrong data root shows at once
ALLOW_FLAG = "--allow_drops true"  # the recipe's spelling of the setting that goes on past a drop-share check


def drop_share(script_args: EOGymScriptArguments) -> float:
    """The share of rows (or images) that may be lost for one reason before the run refuses (1.0: never)."""
    return 1.0 if script_args.allow_drops else DROP_SHARE


def prep_config(script_args: EOGymScriptArguments, sample) -> PrepConfig:
    """Data prep's settings for this run: the sample budget ``sample`` and the recipe's data settings."""
    return PrepConfig(
        max_length=sample.max_length, data_root=script_args.data_root, overlong=script_args.overlong,
        tool_images=script_args.tool_images, max_drop_share=drop_share(script_args),
    )


def refuse_unusable_data(dataset, data_root: str, source: str, max_missing_share: float = DROP_SHARE) -> None:
    """Refuse to train on zero samples, or when more than ``max_missing_share`` of the first samples' images are
    not under ``data_root`` (the collator would skip them one by one: a run that trains on nothing and saves an
    adapter anyway). ``max_missing_share`` 1.0 skips the image check; zero samples are refused always."""
    import os

    if len(dataset) == 0:
        raise ValueError(f"{source}: no usable samples (every row was dropped in data prep): nothing to train on")
    head = dataset.select(range(min(IMAGE_CHECK_SAMPLES, len(dataset))))
    images = [(sid, p) for sid, paths in zip(head["sample_id"], head["images"]) for p in paths]
    missing = [(sid, p) for sid, p in images if not os.path.isfile(os.path.join(data_root, p))]
    if images and max_missing_share < 1 and len(missing) > max_missing_share * len(images):
        sid, path = missing[0]
        raise FileNotFoundError(
            f"{len(missing)} of the {len(images)} images of the first {len(head)} samples are not under --data_root "
            f"{data_root} (e.g. {path} of {sid}): pass the --data_root the data was prepared with, or {ALLOW_FLAG} to "
            "go on"
        )


def refuse_no_training(training_args: SFTConfig) -> None:
    """``max_steps`` 0, or ``num_train_epochs`` 0 without ``max_steps``, would save the untrained adapter as the
    result."""
    if training_args.max_steps == 0 or (training_args.max_steps < 0 and training_args.num_train_epochs <= 0):
        raise ValueError(
            f"max_steps {training_args.max_steps} and num_train_epochs {training_args.num_train_epochs} train "
            "nothing: set num_train_epochs > 0 (or max_steps > 0)"
        )


def refuse_empty_split(script_args: EOGymScriptArguments, seed: int) -> None:
    """Before data prep: an ``eval_fraction`` that holds out none (or all) of the traces of JSONL input is refused
    now, from the rows' ids, rather than after prep (:func:`split_by_trace` checks the prepared samples again)."""
    if script_args.eval_fraction <= 0 or Path(script_args.dataset_path).is_dir():
        return
    files = [p for p in script_args.dataset_path.split(",") if p]
    ids = {str(row["id"])
           for _, row in read_rows(files) if isinstance(row, dict) and isinstance(row.get("id"), (str, int))}
    held_out = sum(is_held_out(trace_id, script_args.eval_fraction, seed) for trace_id in ids)
    if ids and held_out in (0, len(ids)):
        raise ValueError(
            f"eval_fraction={script_args.eval_fraction} holds out {held_out} of the {len(ids)} traces of "
            f"{script_args.dataset_path} (seed {seed}): raise eval_fraction, or set it to 0 to train on every trace "
            "with no eval set"
        )


def prep_processes(requested: int) -> int:
    """``requested`` data-prep workers, at most the CPUs this process may use: more only wait for the same cores."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(requested, cpus))


def build_datasets(script_args: EOGymScriptArguments, training_args: SFTConfig, model_args: ModelConfig, processor):
    """The run's ``(train_dataset, eval_dataset, data_stats)``: ``dataset_path`` prepared (or reused from
    ``prepared_dir``), checked for usable samples and split by trace; no eval set turns evaluation off."""
    sample = script_args.sample_config(training_args.max_length)
    script_args.prepared_dir = script_args.prepared_dir or str(Path(training_args.output_dir) / "prepared")
    with training_args.main_process_first(desc="data prep"):
        dataset, data_stats = load_or_prepare(
            script_args.dataset_path, model_args.model_name_or_path, processor, prep_config(script_args, sample),
            script_args.prepared_dir, prep_processes(script_args.prep_num_proc), ALLOW_FLAG,
        )
    refuse_unusable_data(dataset, script_args.data_root, script_args.dataset_path, drop_share(script_args))
    train_dataset, eval_dataset = split_by_trace(dataset, script_args.eval_fraction, training_args.seed)
    if eval_dataset is None:
        training_args.eval_strategy = "no"
    logger.info("samples: %d train, %d eval", len(train_dataset), 0 if eval_dataset is None else len(eval_dataset))
    return train_dataset, eval_dataset, data_stats


def build_model(script_args: EOGymScriptArguments, training_args: SFTConfig, model_args: ModelConfig, base=None):
    """The model the run trains: ``base`` (loaded from ``model_name_or_path`` when not given) with LoRA adapters,
    its decoder layers and vision blocks compiled under ``compile_layers``."""
    # LoRA's A matrices are drawn when the adapters are added, before the Trainer seeds anything.
    (enable_full_determinism if training_args.full_determinism else set_seed)(training_args.seed)
    if base is None:
        base = load_base_model(model_args.model_name_or_path, model_args.dtype, model_args.attn_implementation)
    model = apply_lora(base, model_args.lora_r, model_args.lora_alpha, model_args.lora_dropout,
                       model_args.lora_target_modules)
    if script_args.compile_layers:
        # Before the collator reads the vision tower's settings: compiling switches its attention
        # (models/vision_blocks.py).
        logger.info("compiled %d decoder layers and %d vision modules", compile_language_layers(model),
                    compile_vision_blocks(model))
    return model


def build_collator(script_args: EOGymScriptArguments, training_args: SFTConfig, processor, model) -> EOGymCollator:
    """The run's collator, built after :func:`build_model` (it reads the vision tower's settings). Which samples
    form a micro-batch is the trainer's sampler's choice (``train_sampling_strategy``, :mod:`.sampler`)."""
    # An image that fails after prep (changed on disk) skips its sample, logged and counted by the trainer.
    # Pixels leave the workers in the model's dtype, which the vision tower casts them to anyway:
    # half of float32's bytes. The workers also compute what the forward would read back from the GPU (host_layout).
    return EOGymCollator(
        processor, max_length=script_args.sample_config(training_args.max_length).max_length,
        data_root=script_args.data_root, padding_free=training_args.padding_free, skip_bad_images=True,
        pixel_dtype=model.dtype, host_layout=True, vision=VisionGeometry.of(model),
    )


def build_trainer(training_args: SFTConfig, model, collator, processor, train_dataset, eval_dataset=None,
                  callbacks=()):
    """The run's :class:`EOGymSFTTrainer` over the pieces above."""
    return EOGymSFTTrainer(
        model=model, args=training_args, data_collator=collator, train_dataset=train_dataset,
        eval_dataset=eval_dataset, processing_class=processor, callbacks=list(callbacks),
    )


def train(script_args: EOGymScriptArguments, training_args: SFTConfig, model_args: ModelConfig,
          given: frozenset[str] | None = None) -> str:
    """Train a LoRA adapter and save it, its processor and ``eogym_run.json`` to ``output_dir``; return that folder.

    ``given``: which of the memory plan's settings (:data:`~.memory_plan.PLANNED`) the user set; the plan chooses
    the others for the GPU (:func:`~.memory_hook.plan_run`). ``None``: all given, the plan only checks they fit."""
    logging.basicConfig(level=logging.INFO if training_args.process_index == 0 else logging.WARNING)
    if not model_args.use_peft:
        raise ValueError("this recipe trains LoRA adapters: set use_peft: true")
    refuse_no_training(training_args)
    sample = script_args.sample_config(training_args.max_length)
    refuse_empty_split(script_args, training_args.seed)
    claim_output_dir(training_args, script_args.overwrite_output_dir)
    given = frozenset(PLANNED) if given is None else given
    batch_given = "per_device_train_batch_size" in given or script_args.samples_per_step is None
    if batch_given:  # a split that does not divide is refused before data prep
        set_samples_per_step(script_args, training_args)

    processor = load_processor(model_args.model_name_or_path, sample.max_pixels, sample.min_pixels)
    train_dataset, eval_dataset, data_stats = build_datasets(script_args, training_args, model_args, processor)
    configs = {"script": script_args, "training": training_args, "model": model_args}
    identity, checkpoint = resume_point(training_args, configs, data_stats.get("content_hash"))
    if checkpoint is not None and finished(checkpoint):
        return training_args.output_dir
    # before the model loads: sized or refused
    plan_run(script_args, training_args, model_args, train_dataset, given, eval_dataset)
    if not batch_given:
        set_samples_per_step(script_args, training_args)

    model = build_model(script_args, training_args, model_args)
    collator = build_collator(script_args, training_args, processor, model)
    trainer = build_trainer(
        training_args, model, collator, processor, train_dataset, eval_dataset, [CheckpointIdentity(identity)]
    )
    trainer.train(resume_from_checkpoint=None if checkpoint is None else str(checkpoint))

    # The adapter, the processor (with the pixel cap) and the run's evidence, side by side.
    output_dir = save_run(trainer, processor, configs, data_stats)
    logger.info("adapter saved to %s", output_dir)
    return output_dir
