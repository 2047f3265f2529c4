"""GRPO step time by rollout engine, side by side in one process on the same model, data and forced episodes:
TRL's own generate loop and padded loss forward (``trl``, the text tower on SDPA), the slot decoder with the packed
loss forward (``slots``, the recipe's ``attn_implementation``), and optionally the recipe as it is (``recipe``: its
YAML untouched but for the paths and one step, the random policy unforced). More: bench/README.md.

    PYTHONPATH=. python bench/grpo_step.py --model /tmp/qwen3vl4b-random --questions 2 --generations 8 \
        --images 4-7 --image-px 1000 --calls 2 --call-tokens 96 --steps 2 --warmup 1 --arms trl,slots,recipe --json grpo.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, command, machine_info, now, runs_table, write_result  # noqa: E402

SYSTEM = "You are an expert remote-sensing analyst. Look at the images, crop where needed, then reply as: Final Answer: <answer>"
CROP_TOOL = {
    "type": "function",
    "function": {
        "name": "crop_optical_or_sar_image",
        "description": "Crop an optical or SAR image by a normalized AOI [x0, y0, x1, y1] and return the crop.",
        "parameters": {
            "type": "object",
            "properties": {"image_url": {"type": "string"}, "aoi": {"type": "array", "items": {"type": "number"}}},
            "required": ["image_url", "aoi"],
        },
    },
}


def write_rows(folder: Path, questions: int, images: str, image_px: int, seed: int = 0) -> tuple[Path, Path]:
    """``questions`` EO-Gym rows (question-only, with ``gt_answer``) and their images under ``folder/data``."""
    import numpy as np
    from PIL import Image

    low, _, high = images.partition("-")
    low, high = int(low), int(high or low)
    root = folder / "data"
    (root / "EO_GYM_DATA" / "bench").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for k in range(high + questions):
        rel = f"EO_GYM_DATA/bench/scene_{k}.png"
        if not (root / rel).exists():  # smooth noise: compresses, still an image
            small = rng.integers(0, 255, (max(image_px // 16, 2), max(image_px // 16, 2), 3), dtype=np.uint8)
            Image.fromarray(small).resize((image_px, image_px), Image.BILINEAR).save(root / rel)
        paths.append(rel)
    path = folder / "rows.jsonl"
    with open(path, "w") as f:
        for q in range(questions):
            n = low + q % (high - low + 1)
            row_images = [paths[0]] + paths[1 + q : n + q]  # the first image is every row's: the forced crop names it
            question = "<image>" * n + f"Question {q}: how many ships are in the harbour? Count them tile by tile."
            f.write(json.dumps({
                "id": f"bench_{q}", "images": row_images, "tools": [CROP_TOOL], "gt_answer": "3",
                "EO_task": "Object Counting", "question_type": "object counting", "data_source": "bench",
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            }) + "\n")
    return path, root


class FixedEpisodes:
    """A logits processor that makes any policy write ``calls`` turns of exactly ``call_tokens`` tokens, each
    a filler text and one crop call of ``image_url`` closed by ``<|im_end|>``, then a final answer turn.

    The turn is the number of ``<|im_start|>assistant\\n`` headers in a row, less the prompt's one; the
    position is the distance from the last header. Tensor operations only (the rows stay on the device)."""

    def __init__(self, tokenizer, image_url: str, calls: int, call_tokens: int):
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.header = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
        call = json.dumps({"name": CROP_TOOL["function"]["name"], "arguments": {"image_url": image_url, "aoi": [0.25, 0.25, 0.75, 0.75]}})
        call_ids = tokenizer(f"\n<tool_call>\n{call}\n</tool_call>", add_special_tokens=False)["input_ids"] + [im_end]
        answer_ids = tokenizer("\nFinal Answer: 3", add_special_tokens=False)["input_ids"] + [im_end]
        filler = tokenizer(" step", add_special_tokens=False)["input_ids"]
        if call_tokens < len(call_ids) + 1:
            raise ValueError(f"--call-tokens must be at least {len(call_ids) + 1} (the crop call itself)")
        turns = [filler * (call_tokens - len(call_ids)) + call_ids] * calls + [filler + answer_ids]
        width = max(map(len, turns)) + 1
        self.table = torch.full((len(turns), width), im_end, dtype=torch.long)
        for k, turn in enumerate(turns):
            self.table[k, : len(turn)] = torch.tensor(turn)
        self.tokens_per_episode = sum(map(len, turns))

    def __call__(self, input_ids, scores):
        first, second, third = self.header
        hits = (input_ids[:, :-2] == first) & (input_ids[:, 1:-1] == second) & (input_ids[:, 2:] == third)
        turn = (hits.sum(1) - 1).clamp(0, self.table.shape[0] - 1)
        where = torch.arange(hits.shape[1], device=input_ids.device)
        last = torch.where(hits, where, torch.full_like(where, -1)).max(1).values
        pos = (input_ids.shape[1] - (last + len(self.header))).clamp(0, self.table.shape[1] - 1)
        table = self.table.to(input_ids.device)
        forced = table[turn, pos]
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(1, forced[:, None], 0.0)


class Phases(TrainerCallback):
    """Seconds per optimizer step in each phase; methods of the trainer and environment are wrapped."""

    def __init__(self):
        self.steps: list[dict] = []
        self.acc = defaultdict(float)
        self._start = self._opt = None

    def timed(self, name, fn):
        def wrapper(*args, **kwargs):
            start = now()
            try:
                return fn(*args, **kwargs)
            finally:
                self.acc[name] += now() - start

        return wrapper

    def on_train_begin(self, args, state, control, **kwargs):
        self._start = now()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._opt = now()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.acc["optimizer"] += now() - self._opt

    def on_step_end(self, args, state, control, **kwargs):
        end, a = now(), self.acc
        step = {"step_s": end - self._start, "generation_s": a["rollout"] - a["tools"], "tools_s": a["tools"],
                "scoring_s": a["score"] - a["rollout"], "forward_backward_s": a["train_step"] - a["score"],
                "optimizer_s": a["optimizer"]}
        step["other_s"] = step["step_s"] - sum(v for k, v in step.items() if k != "step_s")
        # Two named parts of "other": the dataloader's fetch of the step's examples, and the Trainer's logging
        # (TRL's metrics, after the previous step's end: it falls in this step's window).
        step["other_dataloader_s"], step["other_logging_s"] = a["dataloader"], a["logging"]
        if torch.cuda.is_available():
            step["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
            step["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        self.steps.append(step)
        print(f"step {state.global_step}: " + json.dumps({k: round(v, 3) for k, v in step.items()}), flush=True)
        self._start, self.acc = end, defaultdict(float)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--arms", default="trl,slots", help="comma-separated: trl, slots, recipe")
    p.add_argument("--questions", type=int, default=2, help="questions per optimizer step")
    p.add_argument("--generations", type=int, default=8, help="episodes per question")
    p.add_argument("--images", default="4-7", help="row images per question: N or LOW-HIGH")
    p.add_argument("--image-px", type=int, default=1000, help="side of each (square) row image")
    p.add_argument("--calls", type=int, default=2, help="forced tool-call turns per episode (K)")
    p.add_argument("--call-tokens", type=int, default=96, help="tokens of each tool-call turn (L)")
    p.add_argument("--steps", type=int, default=2, help="timed optimizer steps per arm")
    p.add_argument("--warmup", type=int, default=1, help="untimed optimizer steps first")
    p.add_argument("--max-completion-length", type=int, default=6144)
    p.add_argument("--max-pixels", type=int, default=None, help="default: the recipe's")
    p.add_argument("--max-episode-tokens", type=int, default=None, help="default: the recipe's")
    p.add_argument("--recipe-args", default="", help="more recipe flags for every arm, e.g. \"--rollout_cache_gib 20\"")
    p.add_argument("--workdir", default=None)
    p.add_argument("--json", help="write the results here")
    return p.parse_args(argv)


def arm_settings(args, arm: str, data: str, root: str, output_dir: str):
    """The recipe's YAML through its parser, as ``recipes/eo_gym_4b_grpo.py`` reads it, plus this arm's overrides."""
    from trl import GRPOConfig, ModelConfig

    from eogym_sft.strict_yaml import RecipeParser
    from eogym_sft.training.grpo import GRPOScriptArguments

    cpu = not torch.cuda.is_available()
    argv = [
        "--config", str(REPO / "recipes" / "eo_gym_4b_grpo.yaml"), "--model_name_or_path", args.model,
        "--dataset_path", data, "--data_root", root, "--output_dir", output_dir, "--save_strategy", "no",
        "--use_cpu", str(cpu).lower(), "--bf16", str(not cpu).lower(), "--dtype", "float32" if cpu else "bfloat16",
        "--report_to", "none",
    ]
    if arm == "recipe":
        argv += ["--max_steps", "1"]
    else:
        episodes = args.questions * args.generations
        argv += [
            "--rollout_engine", arm, "--max_steps", str(args.warmup + args.steps), "--num_generations", str(args.generations),
            "--per_device_train_batch_size", str(min(8, episodes)), "--gradient_accumulation_steps", str(max(1, episodes // 8)),
            "--max_completion_length", str(args.max_completion_length), "--max_tool_calling_iterations", str(args.calls + 1),
        ]
    if args.max_pixels:
        argv += ["--max_pixels", str(args.max_pixels), "--min_pixels", str(min(args.max_pixels, 65536))]
    if args.max_episode_tokens:
        argv += ["--max_episode_tokens", str(args.max_episode_tokens)]
    argv += args.recipe_args.split()
    return RecipeParser((GRPOScriptArguments, GRPOConfig, ModelConfig), allow_abbrev=False).parse_args_and_config(argv)


def run_arm(args, arm: str, model, lora_start: dict, data, root, workdir: Path) -> dict:
    from eogym_sft.environment.env import EOGymEnvironment
    from eogym_sft.models.processor import load_processor
    from eogym_sft.training.grpo import build_trainer, load_episodes

    script, training, model_args = arm_settings(args, arm, str(data), str(root), str(workdir / arm))
    # One model for every arm: TRL's padded generate needs SDPA; the slots engine's packed loss forward runs the
    # recipe's variable-length attention.
    attention = "sdpa" if arm == "trl" else model_args.attn_implementation
    model.get_base_model().set_attn_implementation({"text_config": attention})
    with torch.no_grad():  # every arm starts from the same adapter
        for name, param in model.named_parameters():
            if name in lora_start:
                param.copy_(lora_start[name])
    processor = load_processor(args.model, script.max_pixels, script.min_pixels)
    episodes = load_episodes(data, root)
    forced = [] if arm == "recipe" else [FixedEpisodes(processor.tokenizer, json.loads(episodes.records[0]["row"])["images"][0], args.calls, args.call_tokens)]
    phases = Phases()
    original_call = EOGymEnvironment.call
    EOGymEnvironment.call = phases.timed("tools", original_call)
    try:
        trainer = build_trainer(model, processor, episodes, script, training, logits_processors=forced)
        trainer._generate = phases.timed("rollout", trainer._generate)
        trainer._generate_and_score_completions = phases.timed("score", trainer._generate_and_score_completions)
        trainer.training_step = phases.timed("train_step", trainer.training_step)
        trainer.get_batch_samples = phases.timed("dataloader", trainer.get_batch_samples)
        trainer._maybe_log_save_evaluate = phases.timed("logging", trainer._maybe_log_save_evaluate)
        trainer.add_callback(phases)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
    finally:
        EOGymEnvironment.call = original_call
    result = summary(arm, phases.steps, trainer.state.log_history, 0 if arm == "recipe" else args.warmup,
                     training.per_device_train_batch_size * training.gradient_accumulation_steps)
    result["text_attention"] = attention
    if forced:
        result["forced_tokens_per_episode"] = forced[0].tokens_per_episode
    del trainer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def summary(arm: str, steps: list[dict], log_history: list[dict], warmup: int, episodes_per_step: int) -> dict:
    """An arm's means over its timed steps: each phase's seconds and share, the episodes' tokens and calls, peaks."""
    timed = steps[warmup:]
    logs = [h for h in log_history if "completions/mean_length" in h][warmup:]
    result = {
        "arm": arm, "episodes_per_step": episodes_per_step, "steps": timed,
        "tool_calls_per_episode": _mean([h.get("tools/call_frequency", 0.0) for h in logs]),
        "generated_tokens_per_episode": _mean([h["completions/mean_length"] for h in logs]),
        "clipped_ratio": _mean([h["completions/clipped_ratio"] for h in logs]),
        "rollout_slots": _mean([h["rollout/slots"] for h in logs if "rollout/slots" in h]),
    }
    for key in ("step_s", "generation_s", "tools_s", "scoring_s", "forward_backward_s", "optimizer_s", "other_s",
                "other_dataloader_s", "other_logging_s"):
        result[key] = _mean([s[key] for s in timed])
    for key in ("generation_s", "tools_s", "scoring_s", "forward_backward_s", "optimizer_s", "other_s"):
        result[key.replace("_s", "_share")] = result[key] / result["step_s"] if result["step_s"] else None
    tokens = (result["generated_tokens_per_episode"] or 0) * episodes_per_step
    result["generated_tokens_per_s"] = tokens / result["generation_s"] if result["generation_s"] else None
    result["peak_allocated_gib"] = max((s.get("peak_allocated_gib", 0) for s in timed), default=None)
    result["peak_reserved_gib"] = max((s.get("peak_reserved_gib", 0) for s in timed), default=None)
    return result


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def format_table(result: dict) -> str:
    columns = [("arm", 8, "arm"), ("step s", 8, "step_s", ".2f"), ("gen", 6, "generation_share", ".0%"), ("tools", 6, "tools_share", ".0%"),
               ("score", 6, "scoring_share", ".0%"), ("fwd+bwd", 8, "forward_backward_share", ".0%"),
               ("optim", 6, "optimizer_share", ".0%"), ("gen tok/s", 10, "generated_tokens_per_s", ".0f"),
               ("peak GiB", 9, "peak_allocated_gib", ".1f")]
    speedup = [f"slots vs trl: {result['speedup_slots_vs_trl']:.2f}x per step"] if "speedup_slots_vs_trl" in result else []
    return "\n".join([runs_table(result["arms"], columns), *speedup])


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="grpo_bench_"))
    data, root = write_rows(workdir, args.questions, args.images, args.image_px)

    from eogym_sft.models.loading import apply_lora, load_base_model

    _, _, model_args = arm_settings(args, "trl", str(data), str(root), str(workdir / "unused"))
    model = load_base_model(args.model, model_args.dtype, model_args.attn_implementation)
    model = apply_lora(model, model_args.lora_r, model_args.lora_alpha, model_args.lora_dropout, model_args.lora_target_modules)
    if torch.cuda.is_available():
        model.to("cuda")
    lora_start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    arms = [run_arm(args, arm, model, lora_start, data, root, workdir) for arm in args.arms.split(",")]
    by_arm = {r["arm"]: r for r in arms}
    result = {
        "command": command("grpo_step", argv), "machine": machine_info("cuda" if torch.cuda.is_available() else None),
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "workdir")}, "arms": arms,
    }
    if "trl" in by_arm and "slots" in by_arm and by_arm["slots"]["step_s"]:
        result["speedup_slots_vs_trl"] = by_arm["trl"]["step_s"] / by_arm["slots"]["step_s"]
    return write_result(result, args.json, format_table(result))


if __name__ == "__main__":
    sys.exit(main() and 0)
