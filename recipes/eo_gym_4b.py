"""EO-Gym-4B: LoRA SFT of Qwen3-VL-4B-Instruct on EO-Gym tool-use traces.

    accelerate launch --config_file recipes/accelerate/deepspeed_zero2.yaml recipes/eo_gym_4b.py --config recipes/eo_gym_4b.yaml

Without ``--config`` the recipe reads ``eo_gym_4b.yaml`` beside this file, so a plain
``accelerate launch recipes/eo_gym_4b.py`` runs the published settings; any flag overrides the file,
e.g. ``--dataset_path data/eo_gym/train.jsonl --data_root data/eo_gym --output_dir runs/mine``.
The run itself (processor, data, model, trainer, save) is :func:`eogym_sft.training.sft.train`; copy this file
and its YAML to make a recipe of your own.
"""

import os
import sys
from pathlib import Path

# Micro-batch shapes change every step; without expandable segments the CUDA caching allocator
# fragments and reserves far more than it allocates (139 GiB reserved for 91 GiB allocated, measured).
# Set before torch starts CUDA; a value the user exported wins.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

from eogym_sft.guards import run_recipe  # noqa: E402 (neither imports torch nor TRL: a broken install is one line)
from eogym_sft.quiet import quiet_deepspeed_probe  # noqa: E402


def with_config(argv: list[str]) -> list[str]:
    return argv if "--config" in argv else ["--config", str(Path(__file__).with_suffix(".yaml")), *argv]


def parse_args(argv: list[str]):
    from eogym_sft.training.sft import recipe_parser

    return recipe_parser().parse_args_and_config(with_config(argv))  # the YAML read strictly


def main(argv: list[str]) -> str:
    """Train as the flags (and the YAML) say; return the folder the adapter was saved to. The memory plan chooses
    what neither sets of per_device_train_batch_size, gradient_accumulation_steps and activation_checkpointing."""
    from eogym_sft.training.memory_hook import config_file, settings_given
    from eogym_sft.training.sft import train

    argv = with_config(argv)
    return train(*parse_args(argv), given=settings_given(argv, config_file(argv)))


if __name__ == "__main__":
    quiet_deepspeed_probe()
    run_recipe(Path(__file__).name, main, sys.argv[1:])
