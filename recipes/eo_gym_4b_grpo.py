"""EO-Gym-4B GRPO: the SFT adapter trained further with TRL's GRPOTrainer on closed-loop EO-Gym episodes.

    accelerate launch recipes/eo_gym_4b_grpo.py --config recipes/eo_gym_4b_grpo.yaml --sft_adapter runs/eo_gym_4b

Without ``--config`` the recipe reads ``eo_gym_4b_grpo.yaml`` beside this file. Without ``--sft_adapter``
it puts a new LoRA adapter on the base model. On CPU: ``python recipes/eo_gym_4b_grpo.py
--model_name_or_path M --dataset_path F.jsonl --data_root D --output_dir O --use_cpu true --bf16 false``.
docs/rl.md explains every setting.
"""

import logging
import os
import sys
from pathlib import Path

# Episode lengths change every step: without expandable segments the CUDA allocator fragments.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

from trl import GRPOConfig, ModelConfig, TrlParser

from eogym_sft.data import file_sha256
from eogym_sft.evaluation import load_judge
from eogym_sft.grpo import GRPOScriptArguments, build_trainer, load_episodes
from eogym_sft.modeling import apply_lora, continue_lora, load_base_model
from eogym_sft.processor import load_processor
from eogym_sft.run_info import write_run_info

logger = logging.getLogger(__name__)


def main(script_args: GRPOScriptArguments, training_args: GRPOConfig, model_args: ModelConfig) -> str:
    logging.basicConfig(level=logging.INFO if training_args.process_index == 0 else logging.WARNING)

    ################
    # Processor, episodes, policy
    ################
    processor = load_processor(model_args.model_name_or_path, script_args.max_pixels, script_args.min_pixels)
    data = load_episodes(script_args.dataset_path, script_args.data_root, script_args.limit)
    model = load_base_model(model_args.model_name_or_path, model_args.dtype, model_args.attn_implementation)
    if script_args.sft_adapter:
        model = continue_lora(model, script_args.sft_adapter)
    else:
        model = apply_lora(model, model_args.lora_r, model_args.lora_alpha, model_args.lora_dropout, model_args.lora_target_modules)

    ################
    # Training
    ################
    judge = load_judge(script_args.judge) if script_args.judge else None
    trainer = build_trainer(model, processor, data, script_args, training_args, judge)
    trainer.train()

    ################
    # Save: adapter, processor and the run's evidence, side by side
    ################
    trainer.save_model(training_args.output_dir)
    if trainer.accelerator.is_main_process:
        processor.save_pretrained(training_args.output_dir)
        stats = {"content_hash": file_sha256(script_args.dataset_path), **data.stats()}
        stats.update(samples_out=stats["episodes"], rows_dropped=sum(data.skipped.values()))
        configs = {"script": script_args, "training": training_args, "model": model_args}
        write_run_info(training_args.output_dir, configs, stats, processor)
    logger.info("adapter saved to %s", training_args.output_dir)
    return training_args.output_dir


def parse_args(argv: list[str]):
    if "--config" not in argv:
        argv = ["--config", str(Path(__file__).with_suffix(".yaml")), *argv]
    parser = TrlParser((GRPOScriptArguments, GRPOConfig, ModelConfig))
    return parser.parse_args_and_config(argv)


if __name__ == "__main__":
    main(*parse_args(sys.argv[1:]))
