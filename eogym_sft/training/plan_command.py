"""``eogym-sft plan``: the memory plan a recipe would choose on a GPU of a given size, without a GPU.

The recipe's own flags (``--dataset_path``, ``--per_device_train_batch_size``, ...) are read by the recipe's parser
over its YAML, as at launch; a flag that sets a planned setting is kept, as at launch, and shown refused when it
cannot fit. Without ``--dataset_path`` the plan is for the worst case: every sample ``max_length`` tokens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ..models.memory import GIB
from .memory_plan import ordinal, plan_line

UNITS = {"gb": 10**9, "gib": GIB, "mb": 10**6, "mib": 2**20}
DEFAULT_CONFIG = "recipes/eo_gym_4b.yaml"


@dataclass
class PlanConfig:
    """The ``eogym-sft plan`` flags (the recipe's own flags follow them, as on the recipe's command line)."""

    gpu_memory: str = field(
        metadata={"help": "the GPU's free memory: 80GB (10^9 bytes), 79.2GiB; a plain number is GB"}
    )
    config: str = field(default=DEFAULT_CONFIG,
                        metadata={"help": "the recipe's YAML: SFT, or GRPO (a YAML that sets num_generations)"})
    gpus: int = field(default=1,
                      metadata={"min": 1, "help": "processes (one a GPU), as accelerate launch --num_processes"})
    zero_stage: int = field(default=2,
                            metadata={"max": 3, "help": "DeepSpeed ZeRO stage of the launch (0: one process or DDP)"})
    model_config: str | None = field(
        default=None,
        metadata={"help": "architecture config.json to plan for (default: model_name_or_path's own; offline, e.g. "
                          "recipes/configs/qwen3_vl_4b_instruct.json)"},
    )
    json: bool = field(default=False, metadata={"help": "print one JSON object instead of the plan's line"})

    def __post_init__(self):
        self.gpu_bytes = parse_size(self.gpu_memory)
        if self.gpus < 1 or self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"--gpus must be at least 1 and --zero-stage 0-3, got {self.gpus} and {self.zero_stage}")


def parse_size(text: str) -> float:
    """``80GB`` (10^9 bytes), ``79.2GiB``, ``24576MiB``; a bare number is GB.

    >>> parse_size("80GB"), parse_size("1GiB"), parse_size("24")
    (80000000000.0, 1073741824.0, 24000000000.0)
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match and (match[2].lower() or "gb")
    if not match or unit not in UNITS or float(match[1]) <= 0:
        raise ValueError(f"--gpu-memory {text!r}: give a size such as 80GB, 79.2GiB or 24576MiB")
    return float(match[1]) * UNITS[unit]


def recipe_configs(config: str, recipe_argv: list[str]):
    """The SFT recipe's three configs from ``config`` and its flags, as its own parser reads them (on a CPU)."""
    from .sft import recipe_parser

    return recipe_parser().parse_args_and_config(["--config", config, *recipe_argv, "--use_cpu", "true"])


def train_dataset(script_args, training_args):
    """The train and evaluation splits the recipe would use, from a prepared folder (or the recipe's prepared
    cache)."""
    from ..data.datasets import split_by_trace
    from ..data.prepared import load_prepared

    path = Path(script_args.dataset_path)
    folder = path if path.is_dir() else Path(script_args.prepared_dir or Path(training_args.output_dir) / "prepared")
    if not (folder / "stats.json").is_file():
        raise FileNotFoundError(
            f"--dataset_path {path}: neither a prepared folder nor prepared at {folder}: prepare it first "
            "(eogym-sft prepare) and pass that folder"
        )
    dataset, _ = load_prepared(folder)
    train, held_out = split_by_trace(dataset, script_args.eval_fraction, training_args.seed)
    return train, held_out, str(folder)


def run_plan(cfg: PlanConfig, recipe_argv: list[str]) -> dict:
    """The plan as one dict (printed as JSON with ``--json``, else as the recipe's line)."""
    from .memory_hook import config_file, model_config, plan_for, refusal, settings_given

    argv = ["--config", cfg.config, *recipe_argv]
    if "num_generations" in config_file(argv):
        return grpo_plan(cfg, recipe_argv)
    given = settings_given(argv, config_file(argv))
    script, training, model = recipe_configs(cfg.config, recipe_argv)
    with_data = any(word.split("=", 1)[0] in ("--dataset_path", "--dataset-path") for word in recipe_argv)
    dataset, held_out, source = (train_dataset(script, training) if with_data
                                 else (None, None, "worst case: every sample max_length tokens"))
    architecture = model_config(model.model_name_or_path, cfg.model_config)
    args = (script, training, model, dataset, cfg.gpu_bytes, cfg.gpus, cfg.zero_stage)
    plan = plan_for(*args, given, architecture, held_out)
    device = f"a {cfg.gpu_memory} GPU"
    auto = plan if plan.fits else plan_for(*args, frozenset(), architecture, held_out)
    result = {
        "recipe": "sft", "gpu_memory_gib": round(cfg.gpu_bytes / GIB, 2), "gpus": cfg.gpus,
        "zero_stage": cfg.zero_stage,
        "data": source, "given": sorted(given), **plan.to_json(), "refused": refusal(plan, auto, given, device),
        "line": plan_line(plan, device, cfg.gpu_bytes, cfg.gpus),
    }
    return result


def grpo_configs(config: str, recipe_argv: list[str]):
    """The GRPO recipe's three configs, as its own parser reads them (on a CPU)."""
    from trl import GRPOConfig, ModelConfig

    from ..strict_yaml import RecipeParser
    from .grpo import GRPOScriptArguments

    parser = RecipeParser((GRPOScriptArguments, GRPOConfig, ModelConfig), allow_abbrev=False)
    return parser.parse_args_and_config(["--config", config, *recipe_argv, "--use_cpu", "true"])


def grpo_plan(cfg: PlanConfig, recipe_argv: list[str]) -> dict:
    """GRPO on a GPU of ``cfg.gpu_bytes``: the slot decoder's KV cache sized as the recipe sizes it at its first step
    (beside the weights, a prefill and the merged LoRA weights), and the largest loss micro-batch the settings allow,
    beside the kept cache if it fits there, else after the cache is freed (as the recipe does for such a step)."""
    from ..agent.decoder import PREFILL_TOKENS
    from ..agent.rollout_config import fitting_slots, kv_bytes, slots_for
    from ..models.attention import NAMES as VARLEN_NAMES
    from ..models.memory import ModelShape, Setup, budget_bytes, generation_reserve, peak_terms
    from .grpo_slots import KEEP_OR_LOWER
    from .memory_hook import checkpoint_every, grpo_loss_batch, model_config, worst_loss_refusal

    script, training, model = grpo_configs(cfg.config, recipe_argv)
    architecture = model_config(model.model_name_or_path, cfg.model_config)
    shape = ModelShape.of(architecture, model.lora_target_modules or (), model.lora_r)
    per_token = kv_bytes(architecture["text_config"], shape.weight_bytes)
    batch = grpo_loss_batch(training, script, model.attn_implementation in VARLEN_NAMES)
    terms = peak_terms(shape, Setup(cfg.gpus, cfg.zero_stage, model.lora_dropout, checkpoint_every(training)), batch)
    loss = terms["reserved"] - terms["frozen_weights"]
    generation = generation_reserve(shape.patches_per_token, PREFILL_TOKENS,
                                    shape.targeted_weights * shape.weight_bytes, widths=shape.widths)
    usable = cfg.gpu_bytes - terms["frozen_weights"]
    episodes = training.per_device_train_batch_size * (training.steps_per_generation
                                                       or training.gradient_accumulation_steps)
    refused, slots = None, 0
    try:
        if script.rollout_cache_gib is None:
            slots = fitting_slots(episodes, script.max_episode_tokens, per_token, usable,
                                  sum(generation.values()), KEEP_OR_LOWER)
        else:
            slots = slots_for(episodes, script.max_episode_tokens, per_token, script.rollout_cache_gib)
    except ValueError as err:
        refused = str(err)
    cache = slots * script.max_episode_tokens * per_token
    beside = usable - generation["merged_weights"] - generation["margin"]  # room for the loss, the cache freed
    kept = script.rollout_keep_cache and loss <= beside - cache
    refused = refused or worst_loss_refusal(loss, beside, batch.tokens)
    peak = (terms["frozen_weights"] + generation["merged_weights"]
            + max(cache + generation["prefill"], loss + (cache if kept else 0.0)))
    every = checkpoint_every(training)
    line = (f"memory plan (GRPO): a {cfg.gpu_memory} GPU: KV cache {slots} slots of {script.max_episode_tokens:,} "
            f"tokens ({cache / GIB:.1f} GiB) for {episodes} episodes a generation, loss micro-batches of "
            f"{training.per_device_train_batch_size} episodes (at most {batch.tokens:,} tokens, "
            f"{'beside the kept cache' if kept else 'the cache freed first'}), activation checkpointing "
            f"{'off' if not every else 'every layer' if every == 1 else f'every {ordinal(every)} layer'}, "
            f"predicted peak {peak / GIB:.1f} GiB")
    return {
        "recipe": "grpo", "gpu_memory_gib": round(cfg.gpu_bytes / GIB, 2), "gpus": cfg.gpus,
        "zero_stage": cfg.zero_stage,
        "slots": slots, "kv_cache_gib": round(cache / GIB, 2), "prefill_tokens": PREFILL_TOKENS,
        "episodes_per_generation": episodes,
        "per_device_train_batch_size": training.per_device_train_batch_size,
        "gradient_accumulation_steps": training.gradient_accumulation_steps, "activation_checkpointing": bool(every),
        "checkpoint_every": every, "micro_batch_tokens": batch.tokens, "predicted_peak_gib": round(peak / GIB, 2),
        "loss_gib": round(loss / GIB, 2), "loss_beside_cache": kept,
        "merged_lora_gib": round(generation["merged_weights"] / GIB, 2),
        "budget_gib": round(budget_bytes(cfg.gpu_bytes) / GIB, 2), "fits": refused is None, "refused": refused,
        "line": line,
    }
