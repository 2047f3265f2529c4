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


def parse_args(argv: list[str]):
    from trl import ModelConfig, SFTConfig

    from eogym_sft.config import EOGymScriptArguments
    from eogym_sft.strict_yaml import RecipeParser

    if "--config" not in argv:
        argv = ["--config", str(Path(__file__).with_suffix(".yaml")), *argv]
    # allow_abbrev=False: a mistyped flag (--max_step) is refused, not taken as the flag it begins (--max_steps)
    parser = RecipeParser((EOGymScriptArguments, SFTConfig, ModelConfig), allow_abbrev=False)  # the YAML read strictly
    return parser.parse_args_and_config(argv)


def main(argv: list[str]) -> str:
    """Train as the flags (and the YAML) say; return the folder the adapter was saved to."""
    from eogym_sft.training.sft import train

    return train(*parse_args(argv))


if __name__ == "__main__":
    quiet_deepspeed_probe()
    run_recipe(Path(__file__).name, main, sys.argv[1:])
