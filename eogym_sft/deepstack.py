"""Qwen3-VL's DeepStack by integer index instead of boolean mask: no host sync per layer, forward or backward.

Qwen3-VL adds features from the vision tower's middle blocks to the hidden states at the image tokens after
each of the first decoder layers (``Qwen3VLTextModel._deepstack_process``, three layers on the 4B model). It
reads and writes those positions through a boolean mask, and indexing by a boolean mask on the GPU syncs
with the host (``nonzero``) on every read and write, forward and backward. On an H200 those syncs idled the
GPU 20.1 ms in a window of two micro-batches of the 4B recipe, and the last of them, at the end of each
backward, leaves the GPU idle while the host runs the Trainer's loop up to the next micro-batch (48.5 ms
in that window; docs/benchmarks.md, "After the changes").

:func:`index_deepstack` replaces that method on the model's text tower with one that finds the positions
once per forward (one sync) and then reads and writes them by index (``index_select``, ``index_copy``),
whose backward needs no sync. Values and gradients are bit for bit the same (``tests/test_deepstack.py``,
which also pins the upstream method's signature: it is private). Opt-in: on an H200 the 4B recipe's step ran
0.3% and 2.4% faster with it, inside the run-to-run spread (arm ``B-deepstackidx`` of
``bench/train_throughput.py``; docs/benchmarks.md, "The levers"), too little to put a private override in every run.
"""

from __future__ import annotations

import types

import torch


class _Handle:
    """Undoes :func:`index_deepstack`, as a hook's handle removes its hook."""

    def __init__(self, towers: list):
        self.towers = towers

    def remove(self) -> None:
        for tower in self.towers:
            del tower._deepstack_process, tower._eogym_visual_index  # the class's own method again


def index_deepstack(model):
    """Have every Qwen3-VL text tower in ``model`` add DeepStack's features by index. Returns a handle whose
    ``remove()`` undoes it, or ``None`` for a model without such a tower."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextModel

    towers = [m for m in model.modules() if isinstance(m, Qwen3VLTextModel)]
    for tower in towers:
        tower._deepstack_process = types.MethodType(_deepstack_by_index, tower)
        tower._eogym_visual_index = (None, None)  # (the mask it was found from, the flat positions)
    return _Handle(towers) if towers else None


def visual_positions(tower, visual_pos_masks: torch.Tensor) -> torch.Tensor:
    """The flat positions of ``visual_pos_masks`` (``[batch, seq]``), found once per mask: the text tower's forward
    hands the same mask to each DeepStack layer."""
    mask, index = tower._eogym_visual_index
    if mask is not visual_pos_masks:
        index = visual_pos_masks.flatten().nonzero().squeeze(1)  # the forward's one sync
        tower._eogym_visual_index = (visual_pos_masks, index)
    return index


def _deepstack_by_index(self, hidden_states: torch.Tensor, visual_pos_masks: torch.Tensor, visual_embeds):
    """``Qwen3VLTextModel._deepstack_process``, out of place, by index."""
    index = visual_positions(self, visual_pos_masks).to(hidden_states.device)
    visual_embeds = visual_embeds.to(hidden_states.device, hidden_states.dtype)
    flat = hidden_states.flatten(0, -2)
    return flat.index_copy(0, index, flat.index_select(0, index) + visual_embeds).view_as(hidden_states)
