"""The vision tower's blocks and mergers compiled regionally, each block one graph: :func:`compile_vision_blocks`.

In arm B's profile much of the eager vision tower's kernel time is elementwise work around its matmuls: each
block's rotary embedding alone is about fourteen kernels over float32 copies of the queries
and keys, where one fused kernel reads and writes them once (docs/benchmarks.md, "Training throughput, one H200").
Compiling the block fuses it, with its norms, GELU and residual adds.

A block is one graph only if its attention is one opaque call. transformers' sdpa branch of
``Qwen3VLVisionAttention`` reads the images' lengths with ``.tolist()`` and loops over them, one SDPA call an
image: Dynamo would break the block there and specialise on the image count. For an attention whose name contains
"flash", ``Qwen3VLVisionAttention`` instead hands the attention function every image at once, with their boundaries
(``cu_seq_lens_q``): :data:`VISION_NAME` takes that route and runs, inside one custom op
(:func:`per_image_sdpa_op`), exactly what the sdpa branch runs: the same SDPA call on the same views, image by image.
So the kernels, and the numbers, of the attention do not change; only the elementwise work around it is fused.
(A variable-length flash kernel in its place changed the numbers and slowed GRPO's step: docs/benchmarks.md,
"Levers tried".)
"""

from __future__ import annotations

import functools

import torch

# Must contain "flash": only then does Qwen3VLVisionAttention pass all images and their boundaries in one call.
VISION_NAME = "eogym_vision_sdpa_flashpath"


def _per_image_sdpa(query, key, value, cu, scale):
    """What transformers' sdpa branch of ``Qwen3VLVisionAttention`` computes, call for call: one non-causal SDPA
    an image on views of ``[1, heads, patches, dim]``, each output ``[1, patches, heads, dim]``, concatenated.
    ``cu`` on the host (the collator's :class:`~eogym_sft.models.host_layout.HostLayout`) costs no sync."""
    lengths = (cu[1:] - cu[:-1]).tolist()
    splits = (torch.split(t, lengths, dim=2) for t in (query, key, value))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    outs = [sdpa(q, k, v, scale=scale, is_causal=False).transpose(1, 2).contiguous() for q, k, v in zip(*splits)]
    return torch.cat(outs, dim=1)


@functools.cache
def per_image_sdpa_op():
    """:func:`_per_image_sdpa` as one custom op (defined on first use, not at import): a compiled block calls it as
    one node for any number of images. It has no backward: the tower is frozen (``apply_lora``, and
    ``check_trainable`` refuses a trainable one), and a backward through it fails loudly, naming the op."""

    @torch.library.custom_op("eogym::per_image_sdpa", mutates_args=())
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float) -> torch.Tensor:
        return _per_image_sdpa(q, k, v, cu, scale)

    @attend.register_fake
    def _(q, k, v, cu, scale):
        return q.new_empty(q.shape[0], q.shape[2], q.shape[1], v.shape[3])

    return attend


def vision_tower(model):
    """The ``Qwen3VLVisionModel`` inside ``model`` (or ``model`` itself), ``None`` if it has none."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    return next((m for m in model.modules() if isinstance(m, Qwen3VLVisionModel)), None)


def vision_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                             cu_seq_lens_q=None, attend=None, **kwargs):
    """Attention-interface function for the vision tower: ``query/key/value`` ``[1, heads, patches, dim]``, all of a
    forward's images one after another, ``cu_seq_lens_q`` their boundaries. Returns ``[1, patches, heads, dim]``,
    what the sdpa branch gives, by ``attend`` (:func:`per_image_sdpa_op`, bound at registration: looking it up
    inside a compiled block would break the graph)."""
    if dropout:
        raise ValueError(f"attn_implementation={VISION_NAME!r} has no attention dropout")
    return attend(query, key, value, cu_seq_lens_q, scaling), None


def use_vision_block_attention(model) -> None:
    """Run ``model``'s vision tower on :data:`VISION_NAME`; its other attentions stay as they are.

    Set on the loaded model: ``from_pretrained`` takes a name with "flash" in it for a kernel to fetch from the
    hub, while ``set_attn_implementation`` on a sub-model checks only that the name is registered. Set it before a
    collator reads the tower's settings (``VisionGeometry.of``): with it the workers find the longest image too."""
    from transformers import AttentionInterface

    AttentionInterface.register(VISION_NAME, functools.partial(vision_attention_forward, attend=per_image_sdpa_op()))
    model.set_attn_implementation({"vision_config": VISION_NAME})
    tower = vision_tower(model)
    if tower is not None and tower.config._attn_implementation != VISION_NAME:
        # A bare tower has no vision_config to switch, and set on itself a "flash" name is looked up on the hub.
        raise ValueError(f"{type(model).__name__}: the vision blocks are compiled on a whole Qwen3-VL model (with its "
                         "vision_config), not on its vision tower alone")


def vision_block_modules(model) -> list[torch.nn.Module]:
    """Qwen3-VL's vision blocks and patch mergers (the final one and DeepStack's) inside ``model``."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionBlock, Qwen3VLVisionPatchMerger

    return [m for m in model.modules() if isinstance(m, (Qwen3VLVisionBlock, Qwen3VLVisionPatchMerger))]


def compile_vision_blocks(model, **compile_kwargs) -> int:
    """Regional ``torch.compile`` of the vision tower: each block and patch merger in place, with ``dynamic=True``
    (images change the patch count every micro-batch), the attention switched to :data:`VISION_NAME` first.
    Returns how many modules were compiled. The blocks compile twice (block 0's input is a view of the patch
    embedding's sum) and the mergers twice (with and without DeepStack's norm after the shuffle), evaluation as many
    again. The blocks' entries count against the recompile limit together with the decoder layers': both run
    through transformers' one checkpointing wrapper (tests/models/test_vision_blocks.py)."""
    modules = vision_block_modules(model)
    if not modules:
        raise ValueError("compile_vision_blocks: the model has no Qwen3-VL vision blocks")
    use_vision_block_attention(model)
    compile_kwargs.setdefault("dynamic", True)
    for module in modules:
        module.compile(**compile_kwargs)
    return len(modules)
