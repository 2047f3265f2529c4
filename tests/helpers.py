"""Plain helpers the tests share (fixtures live in conftest.py): conversation examples and tiny models
whose outputs are far from uniform."""

from __future__ import annotations

import torch

IM_END = 151645


def chat_example(question: str, answer: str, images=(), **fields) -> dict:
    """A TRL-shaped one-turn example: the images first in the user turn, then the question."""
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
    return {
        "messages": [{"role": "user", "content": content}, {"role": "assistant", "content": answer}],
        "images": list(images),
        **fields,
    }


def sharpen(model, seed: int, scale: float = 0.3):
    """Larger random weights (matrices only): logits far from uniform, so that a token attending
    outside its sample, or any other small error, moves the loss visibly. Returns the model in eval mode."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim >= 2:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    model.config.use_cache = False
    return model.eval()


def perturb_lora_b(model, seed: int, scale: float = 0.1):
    """A non-zero adapter (PEFT starts LoRA B at zero), so that the LoRA path is part of a comparison."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    return model


def lean_towards_im_end(model, bias: float = 8.0):
    """Give the LM head a bias towards ``<|im_end|>``: some predictions are right, most are not."""
    head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[IM_END] = bias
    model.lm_head = head
    return model


def trained_spans(labels: torch.Tensor) -> list[list[int]]:
    """The runs of trained (not -100) label ids: one per assistant turn, ``<|im_end|>`` included."""
    spans, current = [], []
    for tok in labels.tolist():
        if tok == -100:
            if current:
                spans.append(current)
            current = []
        else:
            current.append(tok)
    return spans + ([current] if current else [])


class ScriptedPolicy:
    """A ``LogitsProcessor`` that makes ``generate`` write fixed assistant turns: a stand-in for a trained
    policy, with the real model's forward passes, KV cache and images.

    ``scripts`` are alternative episodes, each a list of turns (token ids, ``<|im_end|>`` included). A
    sequence's turn is the number of ``<|im_start|>assistant\\n`` headers in it; its episode is the one
    whose first turn starts with the same token (episodes must differ in their first token), and a fresh
    sequence takes episode ``row % len(scripts)``. ``longest`` keeps the longest sequence written per
    episode: the whole conversation the model saw, with its own turns.
    """

    def __init__(self, scripts: list[list[list[int]]], header: list[int]):
        self.scripts = scripts
        self.header = header
        self.longest: dict[int, list[int]] = {}

    def _turn_starts(self, seq: list[int]) -> list[int]:
        n = len(self.header)
        return [i + n for i in range(len(seq) - n + 1) if seq[i : i + n] == self.header]

    def __call__(self, input_ids, scores):
        forced = torch.full_like(scores, -float("inf"))
        for row, seq in enumerate(input_ids.tolist()):
            starts = self._turn_starts(seq)
            first = seq[starts[0] :]
            # by the first token only: the slot engine re-renders earlier turns, so a split it sampled may read back canonical
            episode = row % len(self.scripts) if not first else next(k for k, s in enumerate(self.scripts) if s[0][0] == first[0])
            turns = self.scripts[episode]
            turn = turns[min(len(starts) - 1, len(turns) - 1)]
            pos = len(seq) - starts[-1]
            forced[row, turn[pos] if pos < len(turn) else IM_END] = 0
            if len(seq) > len(self.longest.get(episode, [])):
                self.longest[episode] = seq
        return forced


def gold_and_wrong_group(folder, model_dir, max_pixels: int, min_pixels: int) -> dict:
    """A GRPO group of two on one row with a crop (its scene and crops saved under ``folder / "data"``): what
    the row's SFT sample trains (its gold trajectory) and a wrong one-turn answer, as scripts and header for
    :class:`ScriptedPolicy`, with the row, its SFT sample, the processor and the data root."""
    from conftest import make_row, save_image

    from eogym_sft.data.traces import normalize_row
    from eogym_sft.models.processor import load_processor
    from eogym_sft.data.collator import EOGymCollator

    data_root = folder / "data"
    for rel, width, height in [("EO_GYM_DATA/aaaa0000/scene.jpg", 96, 64), ("image_cache/crops/c1.png", 48, 32), ("image_cache/crops/c2.png", 40, 40)]:
        save_image(data_root, rel, width, height)
    row = make_row(n_steps=1)
    processor = load_processor(str(model_dir), max_pixels, min_pixels)
    trace = normalize_row(row)
    sft = EOGymCollator(processor, data_root=str(data_root))([{"messages": trace.messages, "images": trace.images, "tools": trace.tools}])
    wrong = processor.tokenizer("Final Answer: 5", add_special_tokens=False)["input_ids"] + [IM_END]
    header = processor.tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    return {"row": row, "data_root": data_root, "processor": processor, "sft": sft,
            "scripts": [trained_spans(sft["labels"][0]), [wrong]], "header": header}


def scripted_trainer(tmp_path, tiny_model_dir, engine: str, scripts, rows: int = 1, attention: str = "sdpa", **config):
    """A GRPO trainer on ``engine`` over the tiny row with a crop (``rows`` copies of it, each its own question),
    its episodes written by ``scripts(group)`` (:class:`ScriptedPolicy` scripts, one per episode of a group;
    ``group`` is :func:`gold_and_wrong_group`'s), the model on ``attention``;
    ``config`` sets GRPOScriptArguments and GRPOConfig fields alike. Returns the trainer (model in train mode)
    and the policy."""
    import json

    from trl import GRPOConfig

    from eogym_sft.models.loading import apply_lora, load_base_model
    from eogym_sft.training.grpo import GRPOScriptArguments, build_trainer, load_episodes

    min_pixels, max_pixels = 1024, 4096
    group = gold_and_wrong_group(tmp_path, tiny_model_dir, max_pixels, min_pixels)
    model = perturb_lora_b(apply_lora(load_base_model(str(tiny_model_dir), "float32", attention)), seed=0)
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({**group["row"], "id": f"q{k}"}) + "\n" for k in range(rows)))
    data = load_episodes(path, group["data_root"])
    script_fields = {k: config.pop(k) for k in list(config) if k in GRPOScriptArguments.__dataclass_fields__}
    script_args = GRPOScriptArguments(**{
        "dataset_path": "unused", "data_root": str(group["data_root"]), "tool_backends": "replay", "max_pixels": max_pixels,
        "min_pixels": min_pixels, "rollout_engine": engine, "max_episode_tokens": 2048, **script_fields,
    })
    args = GRPOConfig(**{
        "output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 2, "num_generations": 2, "max_steps": 1,
        "max_completion_length": 1024, "beta": 0.0, "scale_rewards": "group", "use_cpu": True, "bf16": False,
        "report_to": "none", "save_strategy": "no", "seed": 0, "generation_kwargs": {"do_sample": False}, **config,
    })
    policy = ScriptedPolicy(scripts(group), group["header"])
    trainer = build_trainer(model, group["processor"], data, script_args, args, logits_processors=[policy])
    model.train()
    return trainer, policy


def decode_side_by_side(got, want, atol: float, steps: int = 80) -> None:
    """Decode slot decoders ``got`` and ``want`` (the same prefills in slots 0 and 2) step by step: slot 2 every step,
    slot 0 two steps in three, slot 1 idle, so the slots' lengths part and their spans cross attention buckets. Each
    step's slot order must be equal and its logits close within ``atol`` (absolute and relative)."""
    for step in range(steps):
        feed = {0: 5 + step, 2: 900 + step} if step % 3 else {2: 900 + step}
        order_got, logits_got = got.decode(feed)
        order_want, logits_want = want.decode(feed)
        assert order_got == order_want
        torch.testing.assert_close(logits_got, logits_want, atol=atol, rtol=atol)
