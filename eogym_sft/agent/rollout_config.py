"""How GRPO generates its episodes: the ``--rollout_*`` settings and the slot decoder's cache sizing.

Kept apart from :mod:`eogym_sft.training.grpo_slots` (which subclasses TRL's trainer) so that reading the
settings imports neither TRL nor a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ENGINES = ("slots", "trl")
# An episode is prompt and turns: longer than a training sample's default. GRPO and eogym-sft rollout share it.
MAX_EPISODE_TOKENS = 16384


@dataclass
class SlotRolloutArguments:
    """How GRPO generates its episodes (the ``--rollout_*`` flags of the GRPO recipe)."""

    rollout_engine: str = field(
        default="slots",
        metadata={"help": "slots: the slot decoder and run_episodes (KV kept across turns); trl: TRL's generate loop"},
    )
    max_episode_tokens: int = field(
        default=MAX_EPISODE_TOKENS,
        metadata={
            "help": "an episode's token budget, image tokens included: what one slot of the slot decoder holds "
            "(the name eogym-sft rollout gives it too)"
        },
    )
    rollout_cache_gib: float = field(
        default=40.0,
        metadata={"help": "KV cache budget of the slot decoder in GiB; slots = min(episodes, budget // slot size)"},
    )
    rollout_turn_tokens: int = field(
        default=1024,
        metadata={"help": "most tokens one assistant turn may write (also capped by max_completion_length)"},
    )
    rollout_keep_cache: bool = field(
        default=True,
        metadata={"help": "keep the KV cache (and its CUDA graphs) between steps; false frees it for training"},
    )
    rollout_cuda_graphs: bool = field(
        default=True,
        metadata={"help": "replay the decode step from CUDA graphs on a CUDA device"},
    )

    def __post_init__(self):
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        if self.rollout_engine not in ENGINES:
            raise ValueError(f"rollout_engine must be one of {ENGINES}, got {self.rollout_engine!r}")
        if min(self.max_episode_tokens, self.rollout_turn_tokens) < 1 or self.rollout_cache_gib <= 0:
            raise ValueError("max_episode_tokens, rollout_turn_tokens and rollout_cache_gib must be positive")


def kv_bytes_per_token(model) -> int:
    """Bytes of keys and values one token takes in a :class:`SlotDecoder` over ``model`` (all layers)."""
    import torch

    from ..models.loading import unwrap_peft

    base = unwrap_peft(model)
    cfg = base.config.text_config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype = base.lm_head.weight.dtype
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def slots_for(episodes: int, max_length: int, bytes_per_token: int, budget_gib: float) -> int:
    """Slots a cache budget holds, at most one per episode; refuses a budget that holds none.

    >>> slots_for(16, 16384, 147456, 40.0)
    16
    >>> slots_for(16, 16384, 147456, 24.0)
    10
    """
    fit = int(budget_gib * 2**30 // (max_length * bytes_per_token))
    if fit < 1:
        need = max_length * bytes_per_token / 2**30
        raise ValueError(f"rollout_cache_gib={budget_gib} holds no slot of max_episode_tokens={max_length} ({need:.2f} GiB)")
    return min(episodes, fit)
