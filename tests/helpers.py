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
