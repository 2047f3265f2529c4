"""Load a Qwen3-VL processor with the pixel cap set, and fingerprint it."""

from __future__ import annotations

import hashlib
import json

from ..config import ImageConfig
from ..guards import check_model_source


def load_processor(model_name_or_path: str, max_pixels: int = ImageConfig.max_pixels, min_pixels: int = ImageConfig.min_pixels):
    """``AutoProcessor`` for a hub id or local folder, with images capped at ``max_pixels``.

    The cap is written into the image processor's ``size`` so that data prep, training and anything
    that loads the saved processor resize images the same way.
    """
    from transformers import AutoProcessor

    check_model_source(model_name_or_path)  # offline, a hub id fails now with a hint, not after minutes of retries
    processor = AutoProcessor.from_pretrained(model_name_or_path)
    processor.image_processor.size = {"longest_edge": max_pixels, "shortest_edge": min_pixels}
    return processor


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
