"""EO-Gym-4B GRPO: the SFT adapter trained further with TRL's GRPOTrainer on closed-loop EO-Gym episodes.

    accelerate launch recipes/eo_gym_4b_grpo.py --config recipes/eo_gym_4b_grpo.yaml --sft_adapter runs/eo_gym_4b

Without ``--config`` the recipe reads ``eo_gym_4b_grpo.yaml`` beside this file. Without ``--sft_adapter``
it puts a new LoRA adapter on the base model. On CPU: ``python recipes/eo_gym_4b_grpo.py
--model_name_or_path M --dataset_path F.jsonl --data_root D --output_dir O --use_cpu true --bf16 false``.
The run itself (episodes, policy, environment, reward, trainer, save) is :func:`eogym_sft.training.grpo.train`;
docs/rl.md explains every setting.
"""

import os
import sys
from pathlib import Path

# Episode lengths change every step: without expandable segments the CUDA allocator fragments.
# Set before torch starts CUDA; a value the user exported wins.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

from trl import GRPOConfig, ModelConfig  # noqa: E402

from eogym_sft.guards import run_recipe  # noqa: E402
from eogym_sft.quiet import quiet_deepspeed_probe  # noqa: E402
from eogym_sft.strict_yaml import RecipeParser  # noqa: E402
from eogym_sft.training.grpo import GRPOScriptArguments, train  # noqa: E402


def parse_args(argv: list[str]):
    if "--config" not in argv:
        argv = ["--config", str(Path(__file__).with_suffix(".yaml")), *argv]
    # allow_abbrev=False: a mistyped flag is refused, not taken as the flag it begins
    parser = RecipeParser((GRPOScriptArguments, GRPOConfig, ModelConfig), allow_abbrev=False)  # the YAML read strictly
    return parser.parse_args_and_config(argv)


def main(argv: list[str]) -> str:
    return train(*parse_args(argv))


if __name__ == "__main__":
    quiet_deepspeed_probe()
    run_recipe(Path(__file__).name, main, sys.argv[1:])  # a user error: one line (--debug: the traceback)
