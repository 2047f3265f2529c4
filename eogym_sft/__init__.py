"""eogym_sft: LoRA SFT of Qwen3-VL on EO-Gym Earth-observation tool-use traces.

``from eogym_sft import EOGymCollator`` is the public entry point for other projects; the heavy
imports (torch, transformers) happen only when it is first used.
"""

__version__ = "0.1.0"
__all__ = ["EOGymCollator", "mrope_position_ids"]


def __getattr__(name):
    if name in __all__:
        from .data import collator

        return getattr(collator, name)
    raise AttributeError(f"module 'eogym_sft' has no attribute {name!r}")
