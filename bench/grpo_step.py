"""GRPO step time by rollout engine, side by side in one process: TRL's own generate loop and padded loss
forward (``trl``, the text tower on SDPA) and the slot decoder with the packed loss forward (``slots``, the
text tower on the recipe's ``attn_implementation``), on the same model, data and forced episodes; optionally
the recipe as it is (``recipe``: its YAML untouched but for the paths and one step, the random policy unforced).

Commands (from the repository root)::

    # CPU smoke run on the tiny model (what tests/test_bench_grpo.py runs)
    eogym-sft tiny-model --output /tmp/tiny && PYTHONPATH=. python bench/grpo_step.py --model /tmp/tiny \
        --questions 1 --generations 2 --images 1 --image-px 64 --calls 1 --call-tokens 72 --steps 1 --warmup 0

    # the seed's scale on one GPU, 4B architecture with random weights (bench/h200_session.sh grpo)
    PYTHONPATH=. python bench/grpo_step.py --model /tmp/qwen3vl4b-random --questions 2 --generations 8 \
        --images 4-7 --image-px 1000 --calls 2 --call-tokens 96 --steps 2 --warmup 1 --arms trl,slots,recipe --json grpo.json

The data: ``--questions`` questions a step (default the seed's 2, x ``--generations`` 8 episodes), each an
EO-Gym row whose question shows ``--images`` row images of ``--image-px`` squared pixels (at the recipe's
pixel cap a 1000 px image is about 980 visual tokens: 4-7 images give prompts of about 5-8k tokens) and
offers the crop tool. The policy is forced (a logits processor, the same on both engines) to write
``--calls`` turns of exactly ``--call-tokens`` tokens, each ending in a crop call of the row's first image
(computed by the crop backend: a crop image comes back into the context), then a final answer: both arms
do the same multi-turn work, which the JSON shows (tool calls and generated tokens per episode).

Times per optimizer step, after a CUDA synchronize: ``generation`` (the rollout minus tool calls),
``tools`` (the environment's calls), ``scoring`` (rewards, advantages, the batch for the loss),
``forward_backward`` (the loss forward and backward), ``optimizer`` (the optimizer step) and ``other`` (of
which ``other_dataloader`` is the dataloader's fetch of the step's examples and ``other_logging`` the Trainer's
logging);
generated tokens/s (the model's own tokens over ``generation``); peak GPU memory per arm. After its timed
steps the ``slots`` arm checks its packed loss forward against TRL's padded one on its first micro-batch
(``packed_vs_padded_logps``: largest and mean absolute difference of the trained tokens' log-probabilities), and
the slot decoder that sampled them against that packed forward (``decoder_vs_loss_logps``: a fresh decoder (CUDA
graphs on a GPU) over the same weights walks the first 4 episodes as the engine does, a prefill at each turn's start and one-token decodes
within it, and gives each trained token its log-probability; the gap between what the policy sampled from and
what the loss scores).

``--recipe-args`` adds recipe flags to every arm, e.g. ``--recipe-args "--rollout_cache_gib 20"``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from transformers import TrainerCallback

REPO = Path(__file__).resolve().parents[1]
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


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


################
# Data and the forced policy
################


def image_counts(spec: str) -> tuple[int, int]:
    low, _, high = spec.partition("-")
    return int(low), int(high or low)


def write_rows(folder: Path, questions: int, images: str, image_px: int, seed: int = 0) -> tuple[Path, Path]:
    """``questions`` EO-Gym rows (question-only, with ``gt_answer``) and their images under ``folder/data``."""
    import numpy as np
    from PIL import Image

    low, high = image_counts(images)
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


################
# Timing
################


class Phases(TrainerCallback):
    """Seconds per optimizer step in each phase; methods of the trainer and environment are wrapped."""

    def __init__(self):
        self.steps: list[dict] = []
        self.acc = defaultdict(float)
        self._start = self._opt = None
        self.tool_tokens = 0

    def timed(self, name, fn):
        def wrapper(*args, **kwargs):
            _sync()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _sync()
                self.acc[name] += time.perf_counter() - start

        return wrapper

    def on_train_begin(self, args, state, control, **kwargs):
        _sync()
        self._start = time.perf_counter()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        _sync()
        self._opt = time.perf_counter()

    def on_optimizer_step(self, args, state, control, **kwargs):
        _sync()
        self.acc["optimizer"] += time.perf_counter() - self._opt

    def on_step_end(self, args, state, control, **kwargs):
        _sync()
        now = time.perf_counter()
        a = self.acc
        step = {
            "step_s": now - self._start,
            "generation_s": a["rollout"] - a["tools"],
            "tools_s": a["tools"],
            "scoring_s": a["score"] - a["rollout"],
            "forward_backward_s": a["train_step"] - a["score"],
            "optimizer_s": a["optimizer"],
        }
        step["other_s"] = step["step_s"] - sum(v for k, v in step.items() if k != "step_s")
        # Two named parts of "other": the dataloader's fetch of the step's examples, and the Trainer's logging
        # (TRL's metrics, after the previous step's end: it falls in this step's window).
        step["other_dataloader_s"], step["other_logging_s"] = a["dataloader"], a["logging"]
        if torch.cuda.is_available():
            step["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
            step["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        self.steps.append(step)
        print(f"step {state.global_step}: " + json.dumps({k: round(v, 3) for k, v in step.items()}), flush=True)
        self._start, self.acc = now, defaultdict(float)


################
# Arms
################


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
    p.add_argument("--check-lora-b-std", type=float, default=0.02,
                   help="the decoder check also at every lora_B drawn from N(0, this): an adapter of an SFT's size (0: not)")
    p.add_argument("--recipe-args", default="", help="more recipe flags for every arm, e.g. \"--rollout_cache_gib 20\"")
    p.add_argument("--workdir", default=None)
    p.add_argument("--json", help="write the results here")
    return p.parse_args(argv)


def arm_settings(args, arm: str, data: str, root: str, output_dir: str):
    """The recipe's YAML through TrlParser, as ``recipes/eo_gym_4b_grpo.py`` reads it, plus this arm's overrides."""
    from trl import GRPOConfig, ModelConfig, TrlParser

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
    return TrlParser((GRPOScriptArguments, GRPOConfig, ModelConfig)).parse_args_and_config(argv)


class FirstLossBatch:
    """Wraps ``_compute_loss`` and keeps the first micro-batch it sees (for :func:`logps_agreement`)."""

    def __init__(self, compute_loss):
        self.compute_loss, self.inputs = compute_loss, None

    def __call__(self, model, inputs):
        if self.inputs is None:
            self.inputs = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in inputs.items()}
        return self.compute_loss(model, inputs)


def logps_agreement(trainer, inputs: dict) -> dict:
    """The packed loss forward's per-token log-probabilities against TRL's padded forward (the text tower on
    SDPA) on the same micro-batch, in eval mode (no LoRA dropout), over the trained completion tokens."""
    from trl import GRPOTrainer

    model, base = trainer.model, trainer.model.get_base_model()
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    width = inputs["completion_ids"].shape[1]
    vision = {k: inputs.get(k) for k in ("pixel_values", "image_grid_thw", "num_images", "mm_token_type_ids")}
    was_training, attention = model.training, base.config.text_config._attn_implementation
    model.eval()
    try:
        with torch.no_grad():
            packed = trainer._get_per_token_logps_and_entropies(model, ids, mask, width, **vision)[0]
            base.set_attn_implementation({"text_config": "sdpa"})
            padded = GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, ids, mask, width, **vision)[0]
    finally:
        base.set_attn_implementation({"text_config": attention})
        model.train(was_training)
    trained = (inputs["completion_mask"] * inputs.get("tool_mask", torch.ones_like(inputs["completion_mask"]))).bool()
    diff = (packed.float() - padded.float()).abs()[trained]
    return {
        "tokens": int(trained.sum()),
        "max_abs_diff": float(diff.max()) if diff.numel() else 0.0,
        "mean_abs_diff": float(diff.mean()) if diff.numel() else 0.0,
        "dtype": str(packed.dtype),
    }


def decoder_agreement(trainer, inputs: dict, rows: int = 4, decoder_class=None) -> dict:
    """The slot decoder's log-probability of each trained token of the first ``rows`` episodes of ``inputs`` (a
    micro-batch of the slots engine) against the packed loss forward's, same weights, eval mode. The decoder walks an
    episode as the engine samples it: a prefill at the start of each turn over what the conversation holds then
    (images included), then one token at a time while the turn is the policy's, one slot, replayed from CUDA graphs
    on a GPU as the engine's are (a step at a time: ``rows`` keeps the check to seconds). ``decoder_class``: the
    decoder to walk with (default :class:`~eogym_sft.agent.decoder.SlotDecoder`)."""
    from eogym_sft.agent.decoder import SlotDecoder
    from eogym_sft.agent.image_inputs import ImageInput

    decoder_class = decoder_class or SlotDecoder
    model = trainer.model
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    vision = {k: inputs.get(k) for k in ("pixel_values", "image_grid_thw", "num_images", "mm_token_type_ids")}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            loss = trainer._get_per_token_logps_and_entropies(model, ids, mask, inputs["completion_ids"].shape[1], **vision)[0]
        grids = [tuple(int(v) for v in g) for g in inputs["image_grid_thw"]]
        pixels = torch.split(inputs["pixel_values"], [g[0] * g[1] * g[2] for g in grids])
        merge = trainer.processing_class.image_processor.merge_size
        pictures = [ImageInput(p, g, merge) for p, g in zip(pixels, grids)]
        decoder = decoder_class(model, 1, ids.shape[1] + 1, cuda_graphs=ids.device.type == "cuda")
        diffs, first = [], 0
        for row, count in enumerate(inputs["num_images"]):
            if row == rows:
                break
            images, first = pictures[first : first + count], first + count
            prompt = inputs["prompt_ids"][row][inputs["prompt_mask"][row].bool()].tolist()
            length = int(inputs["completion_mask"][row].sum())
            completion = inputs["completion_ids"][row][:length].tolist()
            trained = inputs["tool_mask"][row][:length].tolist()
            walked = episode_logps(decoder, prompt, completion, trained, images, model.config.image_token_id, trainer.temperature)
            diffs += [abs(a - float(loss[row, j])) for j, a in walked]
        kinds = decoder.projection_kinds() if hasattr(decoder, "projection_kinds") else None
        del decoder
    finally:
        model.train(was_training)
    return {
        "tokens": len(diffs),
        "max_abs_diff": max(diffs, default=0.0),
        "mean_abs_diff": sum(diffs) / len(diffs) if diffs else 0.0,
        "dtype": str(loss.dtype),
        "projections": kinds,
    }


def unmerged_decoder_class():
    """A :class:`~eogym_sft.agent.decoder.SlotDecoder` whose LoRA projections run PEFT's own forward (the numerics
    the merged weights are compared with), or None where the decoder merges no adapter weights."""
    from eogym_sft.agent import decoder as generation

    if not hasattr(generation, "merge_plan"):
        return None

    class UnmergedDecoder(generation.SlotDecoder):
        def _projection(self, key, module):
            plan = generation.merge_plan(module)
            return module if plan is not None and plan[1] else super()._projection(key, module)

    return UnmergedDecoder


def decoder_checks(trainer, inputs: dict, lora_b_std: float) -> dict:
    """:func:`decoder_agreement` at the trained adapter and at an adapter of an SFT's size (every ``lora_B`` drawn
    from N(0, ``lora_b_std``), seed 0, restored after), each with the decoder as it is and, where it merges adapter
    weights, with PEFT's unmerged forward beside it."""
    unmerged = unmerged_decoder_class()
    variants = {"": None, "_unmerged": unmerged} if unmerged else {"": None}
    out = {f"trained{k}": decoder_agreement(trainer, inputs, decoder_class=cls) for k, cls in variants.items()}
    if lora_b_std > 0:
        params = [p for n, p in trainer.model.named_parameters() if "lora_B" in n]
        kept = [p.detach().clone() for p in params]
        generator = torch.Generator(device="cpu").manual_seed(0)
        with torch.no_grad():
            for p in params:
                p.copy_(torch.randn(p.shape, generator=generator) * lora_b_std)
        try:
            out.update((f"sft_scale{k}", decoder_agreement(trainer, inputs, decoder_class=cls)) for k, cls in variants.items())
        finally:
            with torch.no_grad():
                for p, k in zip(params, kept):
                    p.copy_(k)
    return out


def episode_logps(decoder, prompt: list[int], completion: list[int], trained: list[int], images: list, image_pad: int,
                  temperature: float = 1.0):
    """``[(j, log-probability)]`` of each trained token ``completion[j]`` under ``decoder`` (slot 0) at ``temperature``
    (the loss scores at the sampling temperature), walked as the engine samples: a prefill of everything before a
    turn's first token, then one decode a token."""
    def images_in(seq):
        return images[: sum(1 for i, t in enumerate(seq) if t == image_pad and (i == 0 or seq[i - 1] != image_pad))]

    decoder.release(0)
    logits, out = decoder.prefill(0, prompt, images_in(prompt)), []
    for j, token in enumerate(completion):
        if trained[j]:
            out.append((j, float(torch.log_softmax(logits.float() / temperature, -1)[token])))
        if j + 1 == len(completion) or not trained[j + 1]:
            continue  # the next token is context: no prediction needed
        if trained[j]:
            logits = decoder.decode({0: token})[1][0]
        else:  # a turn starts after the context: prefill what the conversation holds now
            seq = prompt + completion[: j + 1]
            logits = decoder.prefill(0, seq, images_in(seq))
    return out


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
        first_batch = trainer._compute_loss = FirstLossBatch(trainer._compute_loss)
        trainer.get_batch_samples = phases.timed("dataloader", trainer.get_batch_samples)
        trainer._maybe_log_save_evaluate = phases.timed("logging", trainer._maybe_log_save_evaluate)
        trainer.add_callback(phases)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
    finally:
        EOGymEnvironment.call = original_call
    warmup = 0 if arm == "recipe" else args.warmup
    timed = phases.steps[warmup:]
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h][warmup:]
    episodes_per_step = training.per_device_train_batch_size * training.gradient_accumulation_steps
    result = {
        "arm": arm,
        "episodes_per_step": episodes_per_step,
        "steps": timed,
        "tool_calls_per_episode": _mean([h.get("tools/call_frequency", 0.0) for h in logs]),
        "generated_tokens_per_episode": _mean([h["completions/mean_length"] for h in logs]),
        "clipped_ratio": _mean([h["completions/clipped_ratio"] for h in logs]),
        "rollout_slots": _mean([h["rollout/slots"] for h in logs if "rollout/slots" in h]),
        "text_attention": attention,
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
    if forced:
        result["forced_tokens_per_episode"] = forced[0].tokens_per_episode
    if arm == "slots" and first_batch.inputs is not None:  # after the timed steps: the check is not in them
        result["packed_vs_padded_logps"] = logps_agreement(trainer, first_batch.inputs)
        print("slots: packed vs padded log-probs: " + json.dumps(result["packed_vs_padded_logps"]), flush=True)
        checks = decoder_checks(trainer, first_batch.inputs, args.check_lora_b_std)
        result["decoder_vs_loss_logps"], result["decoder_vs_loss_logps_variants"] = checks["trained"], checks
        print("slots: decoder vs loss forward log-probs: " + json.dumps(checks), flush=True)
    del trainer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def format_table(result: dict) -> str:
    lines = [f"{'arm':8} {'step s':>8} {'gen':>6} {'tools':>6} {'score':>6} {'fwd+bwd':>8} {'optim':>6} {'gen tok/s':>10} {'peak GiB':>9}"]
    def share(r, k):
        return f"{100 * r[k]:.0f}%" if r.get(k) is not None else "-"

    for r in result["arms"]:
        peak = f"{r['peak_allocated_gib']:.1f}" if r.get("peak_allocated_gib") else "-"
        tps = f"{r['generated_tokens_per_s']:.0f}" if r.get("generated_tokens_per_s") else "-"
        lines.append(
            f"{r['arm']:8} {r['step_s']:8.2f} {share(r, 'generation_share'):>6} {share(r, 'tools_share'):>6} {share(r, 'scoring_share'):>6} "
            f"{share(r, 'forward_backward_share'):>8} {share(r, 'optimizer_share'):>6} {tps:>10} {peak:>9}"
        )
    if "speedup_slots_vs_trl" in result:
        lines.append(f"slots vs trl: {result['speedup_slots_vs_trl']:.2f}x per step")
    return "\n".join(lines)


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
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "versions": {m.__name__: m.__version__ for m in map(__import__, ("torch", "transformers", "trl", "peft"))},
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "workdir")},
        "arms": arms,
    }
    if "trl" in by_arm and "slots" in by_arm and by_arm["slots"]["step_s"]:
        result["speedup_slots_vs_trl"] = by_arm["trl"]["step_s"] / by_arm["slots"]["step_s"]
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)
