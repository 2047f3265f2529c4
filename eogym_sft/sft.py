"""One LoRA SFT run: processor, data, model, trainer, save. ``recipes/eo_gym_4b.py`` and ``eogym-sft demo``
call :func:`train` with TrlParser's three configs."""

from __future__ import annotations

import logging
from pathlib import Path

from transformers.trainer_utils import get_last_checkpoint
from trl import ModelConfig, SFTConfig

from .collator import EOGymCollator
from .config import EOGymScriptArguments
from .data import load_or_prepare, split_by_trace
from .modeling import apply_lora, compile_language_layers, load_base_model
from .prepare import PrepConfig
from .processor import load_processor
from .run_info import save_run
from .trainer import EOGymSFTTrainer

logger = logging.getLogger(__name__)


def resume_checkpoint(training_args: SFTConfig) -> str | None:
    """``--resume_from_checkpoint PATH``, or ``true``/``last`` for the newest checkpoint in ``output_dir``."""
    wanted = training_args.resume_from_checkpoint
    if wanted is None or str(wanted).lower() in ("false", "none", ""):
        return None
    if str(wanted).lower() in ("true", "last"):
        last = get_last_checkpoint(training_args.output_dir) if Path(training_args.output_dir).is_dir() else None
        if last is None:
            raise FileNotFoundError(f"--resume_from_checkpoint {wanted}: no checkpoint-* folder in {training_args.output_dir}")
        return last
    return wanted


def train(script_args: EOGymScriptArguments, training_args: SFTConfig, model_args: ModelConfig) -> str:
    """Train a LoRA adapter and save it, its processor and ``eogym_run.json`` to ``output_dir``; return that folder."""
    logging.basicConfig(level=logging.INFO if training_args.process_index == 0 else logging.WARNING)
    if not model_args.use_peft:
        raise ValueError("this recipe trains LoRA adapters: set use_peft: true")
    sample = script_args.sample_config(training_args.max_length)

    ################
    # Processor and data
    ################
    processor = load_processor(model_args.model_name_or_path, sample.max_pixels, sample.min_pixels)
    prep = PrepConfig(
        **sample.sample_kwargs(), data_root=script_args.data_root, overlong=script_args.overlong, tool_images=script_args.tool_images
    )
    script_args.prepared_dir = script_args.prepared_dir or str(Path(training_args.output_dir) / "prepared")
    with training_args.main_process_first(desc="data prep"):
        dataset, data_stats = load_or_prepare(
            script_args.dataset_path, model_args.model_name_or_path, processor, prep, script_args.prepared_dir,
            script_args.prep_num_proc,
        )
    train_dataset, eval_dataset = split_by_trace(dataset, script_args.eval_fraction, training_args.seed)
    if eval_dataset is None:
        training_args.eval_strategy = "no"
    logger.info("samples: %d train, %d eval", len(train_dataset), 0 if eval_dataset is None else len(eval_dataset))

    ################
    # Model
    ################
    model = load_base_model(model_args.model_name_or_path, model_args.dtype, model_args.attn_implementation)
    model = apply_lora(model, model_args.lora_r, model_args.lora_alpha, model_args.lora_dropout, model_args.lora_target_modules)
    if script_args.compile_layers:
        logger.info("compiled %d decoder layers", compile_language_layers(model))

    ################
    # Training
    ################
    collator = EOGymCollator(processor, **sample.sample_kwargs(), data_root=script_args.data_root, padding_free=training_args.padding_free)
    trainer = EOGymSFTTrainer(
        model=model,
        args=training_args,
        data_collator=collator,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=processor,
    )
    trainer.train(resume_from_checkpoint=resume_checkpoint(training_args))

    ################
    # Save: adapter, processor (with the pixel cap) and the run's evidence, side by side
    ################
    configs = {"script": script_args, "training": training_args, "model": model_args}
    output_dir = save_run(trainer, processor, configs, data_stats)
    logger.info("adapter saved to %s", output_dir)
    return output_dir
