"""What the slot decoder's tests share (tests/agent/test_decoder.py and its neighbours): the tiny model with varied
logits, seeded pictures, a one- and two-turn conversation, the model's own logits, a graph stand-in on the CPU."""

from __future__ import annotations

import copy

import numpy as np
import torch
from PIL import Image

from eogym_sft.agent.cuda_graphs import GraphedStep
from eogym_sft.models.layout import expand_image_pads
from eogym_sft.models.tiny import IMAGE_TOKEN_ID, TINY_QWEN3_VL_CONFIG, build_tiny_model


def varied_model():
    """The tiny Qwen3-VL with varied logits, in eval mode."""
    config = copy.deepcopy(TINY_QWEN3_VL_CONFIG)
    config["text_config"]["initializer_range"] = 1.0  # varied logits
    return build_tiny_model(0, config).eval()


def noise_image(size: tuple[int, int], sigma: float, seed: int) -> Image.Image:
    """Seeded grey noise around 128 (``Image.effect_noise`` draws from an unseeded generator, which made the
    logit comparisons of the decoder's tests pass or fail by the draw)."""
    width, height = size
    pixels = np.random.default_rng(seed).normal(128, sigma, (height, width)).clip(0, 255).astype(np.uint8)
    return Image.fromarray(pixels).convert("RGB")


# A slot decoder against one that computed more (or in another batch): the same numbers up to float32's order of
# summation, which the other shape changes (measured up to 2.9e-5 on logits of this model); a wrong cache is O(1) off.
ANOTHER_SHAPE = {"atol": 1e-4, "rtol": 1e-4}


def two_pictures():
    return [noise_image((64, 48), 60, 0), noise_image((40, 72), 60, 1)]


def chat_text(processor, turns: int):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many ships?"}]}]
    if turns > 1:
        messages += [
            {"role": "assistant", "content": "I crop the harbour."},
            {"role": "tool", "content": [{"type": "text", "text": '{"cropped_path": "c.png"}'}, {"type": "image"}]},
        ]
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def two_turn_ids(processor, images):
    """Token ids of the one-image first turn and of the two-image second turn, image pads expanded."""
    tok = processor.tokenizer
    counts = [im.tokens for im in images]
    first = expand_image_pads(tok(chat_text(processor, 1), add_special_tokens=False)["input_ids"], counts[:1], IMAGE_TOKEN_ID)
    second = expand_image_pads(tok(chat_text(processor, 2), add_special_tokens=False)["input_ids"], counts, IMAGE_TOKEN_ID)
    return first, second


def model_logits(model, processor, text, pictures, extra=()):
    inputs = processor(text=[text], images=pictures, return_tensors="pt")
    ids = inputs["input_ids"][0].tolist() + list(extra)
    inputs["input_ids"] = torch.tensor([ids])
    inputs["attention_mask"] = torch.ones(1, len(ids), dtype=torch.long)
    inputs["mm_token_type_ids"] = torch.tensor([[int(t == IMAGE_TOKEN_ID) for t in ids]])
    with torch.no_grad():
        return model(**inputs).logits[0, -1], inputs


class StandInGraph:
    """What a captured graph does for the weights check (capture itself needs a GPU): it replays."""

    replays = 0

    def replay(self):
        self.replays += 1


def graphed_on_cpu(step, watched, reads=lambda: ()) -> GraphedStep:
    graphed = GraphedStep(step, slots=2, device="cpu", watched=watched, reads=reads)
    graphed._capture = lambda span: (StandInGraph(), f"logits {span}")
    return graphed
