"""Load a Qwen3-VL processor with the pixel cap set, save it so that it loads fast, and fingerprint it."""

from __future__ import annotations

import hashlib
import json
import os
from contextlib import contextmanager
from pathlib import Path

from ..config import ImageConfig
from ..guards import check_model_source


def load_processor(model_name_or_path: str, max_pixels: int = ImageConfig.max_pixels,
                   min_pixels: int = ImageConfig.min_pixels):
    """``AutoProcessor`` for a hub id or local folder, with images capped at ``max_pixels``.

    The cap is written into the image processor's ``size`` so that data prep, training and anything
    that loads the saved processor resize images the same way.
    """
    from transformers import AutoProcessor

    check_model_source(model_name_or_path)  # offline, a hub id fails now with a hint, not after minutes of retries
    processor = AutoProcessor.from_pretrained(model_name_or_path)
    processor.image_processor.size = {"longest_edge": max_pixels, "shortest_edge": min_pixels}
    return processor


def save_processor(processor, directory: str | os.PathLike) -> None:
    """``processor.save_pretrained(directory)``, with the tokenizer's added tokens kept in its
    ``tokenizer_config.json``.

    transformers 5.24 leaves ``added_tokens_decoder`` out of that file for tokenizers-backed tokenizers,
    and a load that does not find it reads the added tokens by parsing the whole ``tokenizer.json`` a second
    time, a slower load (docs/benchmarks.md). Hub folders of Qwen3-VL carry the field, so this saves what they
    hold."""
    from ..atomic import write_text_atomic

    processor.save_pretrained(directory)
    path = Path(directory) / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    if "added_tokens_decoder" in config:
        return
    config["added_tokens_decoder"] = {
        str(index): {"content": token.content, "single_word": token.single_word, "lstrip": token.lstrip,
                     "rstrip": token.rstrip, "normalized": token.normalized, "special": token.special}
        for index, token in sorted(processor.tokenizer.added_tokens_decoder.items())
    }
    write_text_atomic(path, json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def processor_fingerprint(processor) -> str:
    """A hash of everything in the processor that changes token ids or image sizes."""
    ip = processor.image_processor
    tok = processor.tokenizer
    payload = {
        "chat_template": processor.chat_template,
        "vocab": len(tok),
        "special": sorted(tok.get_added_vocab().items()),
        "image": [ip.patch_size, ip.merge_size, ip.temporal_patch_size, dict(ip.size)],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


class OncePerImage:
    """An image processor that processes each distinct image object of a call once, with the same output.

    A GRPO step hands TRL every episode's images, and the episodes of one question share their prompt's images
    (the slots engine decodes each path once a step, so they are the same objects): TRL's one call over all of them
    resized and patched each prompt image once per episode. Qwen's image processors patch each image on its own, so
    the result is the distinct images' patches repeated in the call's order, tensor for tensor. Other attributes
    are the wrapped processor's."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, images=None, return_tensors=None, **kwargs):
        import torch
        from PIL import Image

        def as_given():
            return self.inner(images=images, return_tensors=return_tensors, **kwargs)

        if (
            return_tensors != "pt"
            or not isinstance(images, (list, tuple))
            or not all(isinstance(im, Image.Image) for im in images)
        ):
            return as_given()
        distinct = {}
        for im in images:
            distinct.setdefault(id(im), im)
        if len(distinct) == len(images):
            return as_given()
        out = self.inner(images=list(distinct.values()), return_tensors=return_tensors, **kwargs)
        if set(out.keys()) != {"pixel_values", "image_grid_thw"}:  # not a Qwen-style result: let it do them all
            return as_given()
        position = {key: i for i, key in enumerate(distinct)}
        order = [position[id(im)] for im in images]
        pieces = out["pixel_values"].split(out["image_grid_thw"].prod(-1).tolist())
        out["pixel_values"] = torch.cat([pieces[i] for i in order])
        out["image_grid_thw"] = out["image_grid_thw"][order]
        return out

@contextmanager
def images_processed_once(processor):
    """``processor.image_processor`` is :class:`OncePerImage` inside the block (not saved with the processor)."""
    inner = processor.image_processor
    processor.image_processor = OncePerImage(inner)
    try:
        yield processor
    finally:
        processor.image_processor = inner
