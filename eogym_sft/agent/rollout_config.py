"""How GRPO generates its episodes: the ``--rollout_*`` settings, and the slot decoder's cache sizing for GRPO,
``rollout`` and ``evaluate``: as many slots as the GPU's free memory holds beside the model, a prefill and the merged
LoRA weights (:func:`fitting_slots`), unless a setting says how many.

Kept apart from :mod:`eogym_sft.training.grpo_slots` (which subclasses TRL's trainer) so that reading the
settings imports neither TRL nor a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ENGINES = ("slots", "trl")
# Off CUDA nothing is sized: slots of rollout and evaluate's batch, as their defaults were before they were sized
CPU_SLOTS, CPU_BATCH = 32, 8
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
    rollout_cache_gib: float | None = field(
        default=None,
        metadata={"help": "KV cache budget of the slot decoder in GiB; slots = min(episodes, budget // slot size). "
                          "Default: what the GPU holds beside the model, the loss micro-batch and a prefill (logged "
                          "at start)"},
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
        if min(self.max_episode_tokens, self.rollout_turn_tokens) < 1 or (
            self.rollout_cache_gib is not None and self.rollout_cache_gib <= 0
        ):
            raise ValueError("max_episode_tokens, rollout_turn_tokens and rollout_cache_gib must be positive")


def kv_bytes_per_token(model) -> int:
    """Bytes of keys and values one token takes in a :class:`SlotDecoder` over ``model`` (all layers)."""
    import torch

    from ..models.loading import unwrap_peft

    base = unwrap_peft(model)
    return kv_bytes(base.config.text_config.to_dict(), torch.empty((), dtype=base.lm_head.weight.dtype).element_size())


def kv_bytes(text_config: dict, element_bytes: int) -> int:
    """Bytes of keys and values one token takes over every layer of a text config (``config.json``'s
    ``text_config``), at ``element_bytes`` an element."""
    t = text_config
    head_dim = t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]
    return 2 * t["num_hidden_layers"] * t["num_key_value_heads"] * head_dim * element_bytes


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
        raise ValueError(f"rollout_cache_gib={budget_gib} holds no slot of max_episode_tokens={max_length} "
                         f"({need:.2f} GiB)")
    return min(episodes, fit)


def usable_bytes(device) -> float | None:
    """What new allocations on ``device`` can take now: the GPU's free memory and what PyTorch's caching allocator
    holds unused. ``None`` off CUDA: there is nothing to size against."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return float(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def merged_bytes(model) -> int:
    """Bytes of the merged copies a slot decoder keeps of the LoRA-wrapped projections while an adapter runs."""
    return sum(m.base_layer.weight.numel() * m.base_layer.weight.element_size() for m in model.modules()
               if hasattr(m, "lora_A") and hasattr(m, "base_layer"))


def decoder_reserve(model, prefill_tokens: int, adapters: bool, other_phase: float = 0.0) -> float:
    """Bytes a slot decoder over ``model`` needs beside its KV cache
    (:func:`eogym_sft.models.memory.generation_reserve`): the merged weights and the margin, and the larger of a
    prefill and ``other_phase``, the transient of work that runs between generations (GRPO's loss), never beside a
    prefill."""
    from ..models.memory import generation_reserve, widths_of

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    merge = base.config.vision_config.spatial_merge_size ** 2
    parts = generation_reserve(merge, prefill_tokens, merged_bytes(model) if adapters else 0,
                               widths=widths_of(base.config.to_dict()))
    return parts["merged_weights"] + max(parts["prefill"], other_phase) + parts["margin"]


def fitting_slots(episodes: int, max_length: int, bytes_per_token: int, usable: float, reserve: float, setting: str,
                  requested: int | None = None) -> int:
    """Slots of ``max_length`` tokens that ``usable`` bytes hold after ``reserve``, at most one per episode. A
    ``requested`` count is kept if it fits; one that does not, or no slot at all, is refused in one line naming
    ``setting`` (how the command spells the flag to lower).

    >>> fitting_slots(40, 16384, 147456, 70 * 2**30, 10 * 2**30, "--slots")
    26
    >>> fitting_slots(40, 16384, 147456, 70 * 2**30, 10 * 2**30, "--slots", requested=8)
    8
    """
    from ..models.memory import GIB

    slot = max_length * bytes_per_token
    fit = int(max(0.0, usable - reserve) // slot)
    want = min(episodes, requested if requested is not None else episodes)
    if fit < 1 or (requested is not None and want > fit):
        asked = f"{setting} {requested}" if requested is not None else "one slot"
        raise ValueError(
            f"{asked} of {max_length:,} tokens ({slot / GIB:.2f} GiB each) does not fit: {usable / GIB:.1f} GiB free "
            f"beside the model, {reserve / GIB:.1f} GiB of it kept for the rest; {fit} fit: lower {setting} or the "
            "episode's token budget"
        )
    return min(want, fit)


def sized_slots(model, episodes: int, max_length: int, requested: int | None, adapters: bool, setting: str,
                cpu_default: int) -> int:
    """Slots for ``episodes`` of ``max_length`` tokens on ``model``'s GPU (:func:`fitting_slots`), printed in one line;
    ``requested`` is kept if it fits. Off CUDA: ``requested`` or ``cpu_default``, at most one per episode."""
    import torch

    from ..models.memory import GIB

    episodes = max(1, episodes)
    device = next(model.parameters()).device
    usable = usable_bytes(device)
    if usable is None:
        return min(episodes, requested or cpu_default)
    from .decoder import PREFILL_TOKENS

    reserve = decoder_reserve(model, PREFILL_TOKENS, adapters)
    per_token = kv_bytes_per_token(model)
    slots = fitting_slots(episodes, max_length, per_token, usable, reserve, setting, requested)
    print(f"memory plan: {torch.cuda.get_device_name(device)}, {usable / GIB:.1f} GiB free beside the model, "
          f"{reserve / GIB:.1f} GiB kept for a prefill and merged LoRA weights: {slots} slots of {max_length:,} "
          f"tokens, {slots * max_length * per_token / GIB:.1f} GiB of KV cache")
    return slots
