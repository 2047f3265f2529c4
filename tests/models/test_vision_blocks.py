"""The vision tower compiled block by block (``models/vision_blocks.py``): the eager tower's features bit for bit
(aot_eager) and to float32 rounding (Inductor) on images of several counts and sizes, one graph a block with no
break, the transformers behaviour it relies on (all images in one attention call for a "flash" name), the per-image
op against SDPA, and a training step through the trainer's host layout with the boundaries read on the host."""

from __future__ import annotations

import pytest
import torch
from helpers import chat_example, perturb_lora_b, sharpen

from eogym_sft.models.vision_blocks import VISION_NAME

# Images as (frames, height, width) in patches, each a multiple of the 2x2 merge: one, two and three images a call.
GRIDS = ([[1, 4, 6]], [[1, 2, 4], [1, 4, 6]], [[1, 6, 8], [1, 2, 4], [1, 4, 4]], [[1, 8, 8]])


def _vision_inputs(grid, seed=0, device="cpu", dtype=torch.float32):
    """Patches of random images for the tiny vision tower (3 channels x 2 frames x 16 x 16 px a patch)."""
    torch.manual_seed(seed)
    grid = torch.tensor(grid, device=device)
    return torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 16 * 16, device=device, dtype=dtype), grid


def _features(visual, pixels, grid) -> list[torch.Tensor]:
    """The tower's patch states, merged features and DeepStack features."""
    out = visual(pixels, grid_thw=grid)
    return [out.last_hidden_state, out.pooler_output, *out.deepstack_features]


def _entries(cls) -> int:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(cls.forward.__code__))


@pytest.fixture(scope="module")
def processor_at_cap(capped_processor):
    """The offline processor with a cap that keeps the images at a few visual tokens."""
    return capped_processor(16384, 1024)


@pytest.fixture()
def fresh_dynamo():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_blocks_give_the_eager_features_in_one_graph_a_block(backend, fresh_dynamo):
    """Training mode with grad enabled (as in an SFT step) and evaluation: each image count gives the eager tower's
    features, bit for bit through AOTAutograd's graphs and to float32 rounding through Inductor's kernels. Nothing
    breaks a block's graph; the blocks compile twice (block 0's input is a view of the patch embedding's sum) and the
    mergers twice (with and without DeepStack's norm), once more each for evaluation, and never again."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionBlock, Qwen3VLVisionPatchMerger

    from eogym_sft.models.tiny import build_tiny_model
    from eogym_sft.models.vision_blocks import compile_vision_blocks

    eager, compiled = build_tiny_model(seed=3).requires_grad_(False), build_tiny_model(seed=3).requires_grad_(False)  # frozen, as apply_lora leaves the tower
    assert compile_vision_blocks(compiled, backend=backend) == 2 + 2  # the tiny tower: 2 blocks, 2 mergers
    assert compiled.config.vision_config._attn_implementation == VISION_NAME
    assert compiled.config.text_config._attn_implementation == eager.config.text_config._attn_implementation
    exact = backend == "aot_eager"
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for training in (True, False):
            for model in (eager, compiled):
                model.train(training)
            for k, grid in enumerate(GRIDS):
                pixels, grid = _vision_inputs(grid, seed=k)
                with torch.set_grad_enabled(training):
                    want = _features(eager.model.visual, pixels, grid)
                    got = _features(compiled.model.visual, pixels, grid)
                assert len(got) == len(want) == 3
                for g, w in zip(got, want):
                    assert not g.requires_grad
                    if exact:
                        assert torch.equal(g, w)
                    else:
                        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert sum(fresh_dynamo["graph_break"].values()) == 0
    assert _entries(Qwen3VLVisionBlock) == 4 and _entries(Qwen3VLVisionPatchMerger) == 4


def test_transformers_hands_the_vision_attention_all_images_once_a_layer(monkeypatch):
    """The transformers behaviour the compiled blocks rely on: a name with "flash" in it is a flash attention to
    ``is_flash_attention_requested``, and ``Qwen3VLVisionAttention`` then calls it once a layer on all images, with
    their boundaries, non-causal. Any other name (sdpa) is called once an image a layer, without boundaries."""
    from transformers import AttentionInterface
    from transformers.utils.generic import is_flash_attention_requested

    from eogym_sft.models.tiny import TINY_QWEN3_VL_CONFIG, build_tiny_model
    from eogym_sft.models.vision_blocks import use_vision_block_attention

    assert is_flash_attention_requested(requested_attention_implementation=VISION_NAME)
    model = build_tiny_model(seed=3).eval()
    use_vision_block_attention(model)
    calls = {VISION_NAME: [], "sdpa": []}
    for name, seen in calls.items():
        def spy(module, query, *args, real=AttentionInterface._global_mapping[name], seen=seen, **kwargs):
            seen.append((tuple(query.shape), kwargs))
            return real(module, query, *args, **kwargs)

        monkeypatch.setitem(AttentionInterface._global_mapping, name, spy)
    pixels, grid = _vision_inputs(GRIDS[2])
    with torch.no_grad():
        _features(model.model.visual, pixels, grid)
    depth, heads = TINY_QWEN3_VL_CONFIG["vision_config"]["depth"], TINY_QWEN3_VL_CONFIG["vision_config"]["num_heads"]
    assert len(calls[VISION_NAME]) == depth and not calls["sdpa"]
    for shape, kwargs in calls[VISION_NAME]:
        assert shape == (1, heads, 48 + 8 + 16, 4)
        assert kwargs["cu_seq_lens_q"].tolist() == [0, 48, 56, 72] and kwargs["is_causal"] is False
    model.set_attn_implementation({"vision_config": "sdpa"})
    with torch.no_grad():
        _features(model.model.visual, pixels, grid)
    assert len(calls["sdpa"]) == depth * 3
    assert not any("cu_seq_lens_q" in kwargs for _, kwargs in calls["sdpa"])


def test_the_per_image_op_gives_sdpas_outputs_and_refuses_a_backward():
    """Three images of queries strided as the tower hands them over: the op's output is SDPA's image by image, and
    no image reaches another. The frozen tower needs no backward; one through the op fails, naming it."""
    from eogym_sft.models.vision_blocks import per_image_sdpa_op

    torch.manual_seed(0)
    heads, dim = 2, 8
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
    q, k, v = (torch.randn(17, heads, dim).transpose(0, 1)[None] for _ in range(3))
    out = per_image_sdpa_op()(q, k, v, cu, dim**-0.5)
    want = torch.cat([
        torch.nn.functional.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], scale=dim**-0.5).transpose(1, 2)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())
    ], dim=1)
    assert out.shape == (1, 17, heads, dim) and torch.equal(out, want)
    moved = per_image_sdpa_op()(q, k.index_fill(2, torch.tensor([0]), 9.0), v, cu, dim**-0.5)  # image 0's first key
    assert torch.equal(moved[:, 5:], out[:, 5:]) and not torch.equal(moved[:, :5], out[:, :5])
    with pytest.raises(RuntimeError, match="eogym.per_image_sdpa"):
        per_image_sdpa_op()(q.requires_grad_(), k, v, cu, dim**-0.5).sum().backward()


def test_the_vision_attention_refuses_dropout():
    from eogym_sft.models.vision_blocks import per_image_sdpa_op, vision_attention_forward

    q = torch.zeros(1, 2, 3, 8)
    with pytest.raises(ValueError, match=f"'{VISION_NAME}' has no attention dropout"):
        vision_attention_forward(None, q, q, q, None, dropout=0.1, cu_seq_lens_q=torch.tensor([0, 3]), attend=per_image_sdpa_op())


def test_compile_vision_blocks_needs_a_whole_qwen3_vl():
    """Without vision blocks, and on a bare vision tower (whose attention it cannot switch: its blocks would break at
    every image), it refuses instead of compiling blocks that split."""
    from eogym_sft.models.tiny import build_tiny_model
    from eogym_sft.models.vision_blocks import compile_vision_blocks

    with pytest.raises(ValueError, match="no Qwen3-VL vision blocks"):
        compile_vision_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    tower = build_tiny_model(seed=3).model.visual
    with pytest.raises(ValueError, match="Qwen3VLVisionModel: the vision blocks are compiled on a whole Qwen3-VL model"):
        compile_vision_blocks(tower)
    assert all(getattr(block, "_compiled_call_impl", None) is None for block in tower.blocks)


def test_a_training_step_with_compiled_blocks_reads_the_boundaries_on_the_host(processor_at_cap, tmp_path, monkeypatch, fresh_dynamo):
    """sft.py's order (LoRA, compiled layers and blocks, then the collator's host layout from the tower's settings):
    a packed micro-batch of six images trains to the eager model's loss and LoRA gradients (aot_eager),
    and every block's attention reads the images' boundaries on the host (no sync), as transformers' sdpa loop does
    with the layout."""
    from datasets import Dataset
    from trl import SFTConfig

    from eogym_sft.data.collator import EOGymCollator
    from eogym_sft.models import vision_blocks
    from eogym_sft.models.attention import add_sample_boundaries, register_varlen_attention
    from eogym_sft.models.host_layout import VisionGeometry
    from eogym_sft.models.loading import apply_lora, compile_language_layers
    from eogym_sft.models.tiny import build_tiny_model
    from eogym_sft.training.trainer import EOGymSFTTrainer

    register_varlen_attention()
    steps, seen, real = {}, [], vision_blocks._per_image_sdpa
    monkeypatch.setattr(vision_blocks, "_per_image_sdpa", lambda q, k, v, cu, s: seen.append(cu.device.type) or real(q, k, v, cu, s))
    for name in ("eager", "compiled"):
        model = sharpen(build_tiny_model(seed=4), seed=4)
        model.set_attn_implementation({"text_config": "eogym_varlen", "vision_config": "sdpa"})
        add_sample_boundaries(model)
        model = perturb_lora_b(apply_lora(model, dropout=0.0), seed=4).train()
        if name == "compiled":
            compile_language_layers(model, backend="aot_eager")
            vision_blocks.compile_vision_blocks(model, backend="aot_eager")
        collator = EOGymCollator(processor_at_cap, padding_free=True, host_layout=True, vision=VisionGeometry.of(model))
        args = SFTConfig(output_dir=str(tmp_path / name), use_cpu=True, bf16=False, report_to="none", padding_free=True,
                         remove_unused_columns=False, dataset_kwargs={"skip_prepare_dataset": True})
        trainer = EOGymSFTTrainer(model=model, args=args, data_collator=collator, train_dataset=Dataset.from_list([{"messages": "[]"}]),
                                  processing_class=processor_at_cap)
        batch = collator(_examples() * 2)
        longest = batch["host_layout"].vision["max_seqlen"]  # found in the workers only for a "flash" name
        assert longest is None if name == "eager" else type(longest) is int
        seen[:] = []
        loss = trainer.compute_loss(trainer.model, batch, num_items_in_batch=torch.tensor(64))
        params = [p for p in trainer.model.parameters() if p.requires_grad]
        steps[name] = (loss.detach(), torch.autograd.grad(loss, params), seen[:2])
        if name == "compiled":  # an evaluation forward, as the recipe runs between steps: one more graph each
            trainer.model.eval()
            with torch.no_grad(), torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
                trainer.compute_loss(trainer.model, collator(_examples()))
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextDecoderLayer, Qwen3VLVisionBlock

    # Decoder layers and vision blocks share transformers' checkpointing wrapper, and so Dynamo's cache and its
    # recompile limit (8): training 1 + 2 entries, evaluation as many again.
    assert Qwen3VLTextDecoderLayer.forward.__code__ is Qwen3VLVisionBlock.forward.__code__
    assert _entries(Qwen3VLVisionBlock) == 6 < torch._dynamo.config.recompile_limit
    (eager_loss, eager_grads, eager_seen), (loss, grads, seen) = steps["eager"], steps["compiled"]
    assert not eager_seen and seen[:2] == ["cpu"] * 2  # the tiny tower's two blocks, boundaries on the host
    torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=1e-6)  # as the compiled decoder layers' own test
    assert 1.0 < loss.item() < 100.0
    for g, w in zip(grads, eager_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    assert sum(fresh_dynamo["graph_break"].values()) == 0


def _examples():
    from PIL import Image

    return [
        chat_example("Flooded?", "Final Answer: no", [Image.new("RGB", (96, 32), "blue")]),
        chat_example("Ships?", "Final Answer: 3", [Image.new("RGB", (64, 64), "gray"), Image.new("RGB", (32, 32), "white")]),
    ]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_inductor_blocks_on_the_4b_towers_widths_give_the_eager_features(fresh_dynamo):
    """On CUDA in bf16, the 4B tower's widths (1,024 wide, 16 heads, GELU-tanh MLP of 4,096) at 3 blocks with a
    DeepStack merger after block 1, on three images of the recipe's sizes: Inductor's blocks are as close to the tower
    run in float32 as the eager bf16 tower is (they round less often: a few elements of millions differ from eager's
    by one or two bf16 steps), with no graph break; given the metadata as the host layout hands it over (the
    boundaries on the host), the compiled tower runs without a host sync."""
    import copy
    import json
    from pathlib import Path

    from eogym_sft.models.host_layout import VISION_DEVICE_KEYS, VisionGeometry, vision_metadata
    from eogym_sft.models.tiny import TINY_QWEN3_VL_CONFIG, build_tiny_model
    from eogym_sft.models.vision_blocks import compile_vision_blocks

    spec = json.loads((Path(__file__).resolve().parents[2] / "recipes/configs/qwen3_vl_4b_instruct.json").read_text())["vision_config"]
    config = copy.deepcopy(TINY_QWEN3_VL_CONFIG)  # the tiny text tower (not run here) with the 4B's vision widths
    config["vision_config"] = {**spec, "depth": 3, "deepstack_visual_indexes": [1]}
    models = [build_tiny_model(seed=0, config=config, dtype="bfloat16", device="cuda").eval().requires_grad_(False) for _ in range(2)]
    reference = copy.deepcopy(models[0]).float().model.visual
    compile_vision_blocks(models[1])
    eager, compiled = (m.model.visual for m in models)
    for grid in ([[1, 62, 62]], [[1, 40, 56], [1, 20, 24], [1, 62, 62]]):  # 980 merged tokens: the recipe's cap
        pixels, grid = _vision_inputs(grid, device="cuda", dtype=torch.bfloat16)
        keywords = {k: v.cuda() if k in VISION_DEVICE_KEYS else v for k, v in vision_metadata(grid.cpu(), VisionGeometry.of(compiled)).items()}
        with torch.no_grad():
            want, got = _features(eager, pixels, grid), _features(compiled, pixels, grid)
            compiled(pixels, grid_thw=grid, **keywords)  # compiles for boundaries on the host
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                fed = compiled(pixels, grid_thw=grid, **keywords)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            exact = _features(reference, pixels.float(), grid)
        for g, w, x in zip(got, want, exact):
            compiled_error, eager_error = (g.float() - x).abs(), (w.float() - x).abs()
            assert compiled_error.mean() <= 1.05 * eager_error.mean() and compiled_error.max() <= 2 * eager_error.max()
        assert torch.equal(fed.pooler_output, got[1])
    assert sum(fresh_dynamo["graph_break"].values()) == 0
