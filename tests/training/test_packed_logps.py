"""The packed GRPO loss forward (``eogym_sft.training.packed_logps`` through ``EOGymGRPOTrainer`` on the slots engine) against TRL
1.16's own padded ``GRPOTrainer._get_per_token_logps_and_entropies`` on the tiny Qwen3-VL in float32: the same
per-token log-probabilities and entropies, the same loss and gradients, on a batch with row images, tool
crops in the completion, a row without images, a tool mask and a truncated (masked) episode.

Tolerance: float32, ``atol=1e-6, rtol=1e-5``. On CPU (2026-12-01) the log-probabilities and entropies came out
bit-equal and the gradients within 7e-9 (the loss sums the same terms in another order). The private contract pinned: TRL's method takes these arguments and
returns ``(rows, logits_to_keep)`` with 0 where the label is masked; ``_compute_loss`` reads it."""

from __future__ import annotations

import json
import types

import pytest
import torch
from conftest import make_row, save_image
from helpers import IM_END, perturb_lora_b
from PIL import Image
from trl import GRPOConfig, GRPOTrainer

from eogym_sft.models.loading import apply_lora, load_base_model
from eogym_sft.models.processor import load_processor
from eogym_sft.models.tiny import IMAGE_TOKEN_ID, VISION_END_TOKEN_ID, VISION_START_TOKEN_ID
from eogym_sft.training.grpo import GRPOScriptArguments, build_trainer, load_episodes
from eogym_sft.training.packed_logps import pack_rows

MIN_PIXELS, MAX_PIXELS = 1024, 4096
TOL = {"atol": 1e-6, "rtol": 1e-5}


@pytest.fixture(scope="module", params=["sdpa", "eogym_varlen"])
def setup(request, tmp_path_factory, tiny_model_dir):
    """A slots trainer over a tiny LoRA model with the text tower on ``params`` attention (the padded
    reference always runs SDPA: TRL's padded rows need the attention mask)."""
    tmp_path = tmp_path_factory.mktemp("packed")
    data_root = tmp_path / "data"
    save_image(data_root, "EO_GYM_DATA/aaaa0000/scene.jpg", 96, 64)
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(make_row(n_steps=0)) + "\n")
    processor = load_processor(str(tiny_model_dir), MAX_PIXELS, MIN_PIXELS)
    model = perturb_lora_b(apply_lora(load_base_model(str(tiny_model_dir), "float32", request.param)), seed=0)
    script_args = GRPOScriptArguments(
        dataset_path="unused", data_root=str(data_root), tool_backends="replay", max_pixels=MAX_PIXELS, min_pixels=MIN_PIXELS,
    )
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, num_generations=2, max_steps=1,
        max_completion_length=256, beta=0.0, use_cpu=True, bf16=False, report_to="none", save_strategy="no", seed=0,
    )
    trainer = build_trainer(model, processor, load_episodes(path, data_root), script_args, args)
    model.eval()  # LoRA dropout off: both paths see the same weights
    return trainer, processor, request.param


def _image(processor, width, height, seed):
    g = torch.Generator().manual_seed(seed)
    pixels = (torch.rand((height, width, 3), generator=g) * 255).to(torch.uint8).numpy()
    picture = Image.fromarray(pixels)
    grid = processor.image_processor(images=[picture], return_tensors="pt")["image_grid_thw"][0]
    return picture, [VISION_START_TOKEN_ID] + [IMAGE_TOKEN_ID] * (int(grid.prod()) // 4) + [VISION_END_TOKEN_ID]


def _text(processor, text):
    return processor.tokenizer(text, add_special_tokens=False)["input_ids"]


def episodes(processor, truncated_crop: bool):
    """(prompt, completion, tool_mask, images, truncated) of three episodes: a row image and a crop in the
    completion; no image at all; a row image and a truncated completion (with a crop if ``truncated_crop``)."""
    scene, scene_ids = _image(processor, 64, 64, 0)
    crop, crop_ids = _image(processor, 48, 32, 1)
    call = _text(processor, "I crop the harbour.<tool_call>{}</tool_call>") + [IM_END]
    tool = _text(processor, "\n<|im_start|>user\n<tool_response>\n") + crop_ids + _text(processor, "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    answer = _text(processor, "Final Answer: 3") + [IM_END]
    question = _text(processor, "<|im_start|>user\n") + scene_ids + _text(processor, "How many ships?<|im_end|>\n<|im_start|>assistant\n")
    plain = _text(processor, "<|im_start|>user\nHow many ships are in the harbour today?<|im_end|>\n<|im_start|>assistant\n")
    cut = call + (tool if truncated_crop else []) + _text(processor, "I count")
    return [
        (question, call + tool + answer, [1] * len(call) + [0] * len(tool) + [1] * len(answer), [scene, crop], False),
        (plain, answer, [1] * len(answer), [], False),
        (question, cut, [1] * len(cut), [scene, crop] if truncated_crop else [scene], True),
    ]


def shared_episodes(processor):
    """Four episodes, three of them on one question (the scene), each with its own completion: a crop and an
    answer, another crop and another answer, an answer alone; and one on a question without an image."""
    scene, scene_ids = _image(processor, 64, 64, 0)
    question = _text(processor, "<|im_start|>user\n") + scene_ids + _text(processor, "How many ships?<|im_end|>\n<|im_start|>assistant\n")
    plain = _text(processor, "<|im_start|>user\nHow many ships are in the harbour today?<|im_end|>\n<|im_start|>assistant\n")

    def answer(n):
        return _text(processor, f"Final Answer: {n}") + [IM_END]

    def crop_turn(what, seed, width, height):
        crop, crop_ids = _image(processor, width, height, seed)
        call = _text(processor, f"I crop the {what}.<tool_call>{{}}</tool_call>") + [IM_END]
        tool = _text(processor, "\n<|im_start|>user\n<tool_response>\n") + crop_ids + _text(processor, "</tool_response><|im_end|>\n<|im_start|>assistant\n")
        return call + tool, [1] * len(call) + [0] * len(tool), crop

    harbour, harbour_mask, harbour_crop = crop_turn("harbour", 1, 48, 32)
    pier, pier_mask, pier_crop = crop_turn("pier", 2, 32, 48)
    return [
        (question, harbour + answer(3), harbour_mask + [1] * len(answer(3)), [scene, harbour_crop], False),
        (plain, answer(2), [1] * len(answer(2)), [], False),
        (question, pier + answer(4), pier_mask + [1] * len(answer(4)), [scene, pier_crop], False),
        (question, answer(5), [1] * len(answer(5)), [scene], False),
    ]


def loss_inputs(trainer, processor, eps) -> dict:
    """The tensors ``_generate_and_score_completions`` hands the loss for these episodes (left-padded prompts,
    right-padded completions, a truncated episode masked, vision inputs of every image in row order)."""
    pad = processor.tokenizer.pad_token_id
    prompt_width, completion_width = max(len(e[0]) for e in eps), max(len(e[1]) for e in eps)
    rows = len(eps)
    prompt_ids = torch.full((rows, prompt_width), pad)
    prompt_mask = torch.zeros((rows, prompt_width), dtype=torch.long)
    completion_ids = torch.full((rows, completion_width), pad)
    completion_mask = torch.zeros((rows, completion_width), dtype=torch.long)
    tool_mask = torch.ones((rows, completion_width), dtype=torch.long)
    for b, (prompt, completion, tools, _, truncated) in enumerate(eps):
        prompt_ids[b, prompt_width - len(prompt):] = torch.tensor(prompt)
        prompt_mask[b, prompt_width - len(prompt):] = 1
        completion_ids[b, :len(completion)] = torch.tensor(completion)
        completion_mask[b, :len(completion)] = 0 if truncated else 1
        tool_mask[b, :len(completion)] = torch.tensor(tools)
    pictures = [p for e in eps for p in e[3]]
    vision = processor.image_processor(images=pictures, return_tensors="pt")
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    return {
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
        "completion_mask": completion_mask, "tool_mask": tool_mask,
        "advantages": torch.tensor([1.0, -0.5, 0.25, -0.75][:rows]),
        "num_items_in_batch": (completion_mask * tool_mask).sum(),
        "pixel_values": vision["pixel_values"], "image_grid_thw": vision["image_grid_thw"],
        "num_images": [len(e[3]) for e in eps], "mm_token_type_ids": (ids == IMAGE_TOKEN_ID).long(),
    }


def logps(trainer, inputs, padded: bool):
    method = GRPOTrainer._get_per_token_logps_and_entropies if padded else type(trainer)._get_per_token_logps_and_entropies
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with _attention(trainer, "sdpa" if padded else None), torch.no_grad():
        lp, ent, _ = method(
            trainer, trainer.model, ids, mask, inputs["completion_ids"].shape[1], compute_entropy=True,
            pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"], num_images=inputs["num_images"],
            mm_token_type_ids=inputs["mm_token_type_ids"],
        )
    return lp, ent


class _attention:
    """The text tower on another attention for a while (the padded reference needs SDPA's mask)."""

    def __init__(self, trainer, name):
        self.model = trainer.model.get_base_model()
        self.name, self.was = name, self.model.config.text_config._attn_implementation

    def __enter__(self):
        if self.name:
            self.model.set_attn_implementation({"text_config": self.name})

    def __exit__(self, *exc):
        self.model.set_attn_implementation({"text_config": self.was})


def test_packed_logps_and_entropies_equal_the_padded_forward(setup):
    trainer, processor, _ = setup
    inputs = loss_inputs(trainer, processor, episodes(processor, truncated_crop=False))
    padded, packed = logps(trainer, inputs, padded=True), logps(trainer, inputs, padded=False)
    for a, b in zip(packed, padded):
        torch.testing.assert_close(a, b, **TOL)
    real = torch.cat([inputs["completion_mask"][:2], inputs["completion_mask"][2:]]).bool()
    assert packed[0][real].abs().min() > 0 and torch.equal(packed[0][~real], torch.zeros_like(packed[0][~real]))
    assert inputs["num_images"] == [2, 0, 1] and int((inputs["tool_mask"][0] == 0).sum()) > 0


def test_episodes_of_one_prompt_share_it_and_score_as_the_padded_forward(setup, monkeypatch):
    """Under ``eogym_varlen`` the three episodes of one question share its prompt (and its image: encoded once);
    under SDPA (which would let them see each other) they are packed whole. Both score as TRL's padded forward."""
    import eogym_sft.models.attention as attention_module

    trainer, processor, attention = setup
    inputs = loss_inputs(trainer, processor, shared_episodes(processor))
    calls = []
    shared_attention = attention_module.shared_prefix_attention
    monkeypatch.setattr(attention_module, "shared_prefix_attention", lambda *a: calls.append(1) or shared_attention(*a))
    padded, packed = logps(trainer, inputs, padded=True), logps(trainer, inputs, padded=False)
    layers = trainer.model.get_base_model().config.text_config.num_hidden_layers
    assert len(calls) == (layers if attention == "eogym_varlen" else 0)
    for a, b in zip(packed, padded):
        torch.testing.assert_close(a, b, **TOL)
    assert packed[0][inputs["completion_mask"].bool()].abs().min() > 0
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    args = (ids, mask, inputs["completion_ids"].shape[1], IMAGE_TOKEN_ID, 2, inputs["pixel_values"], inputs["image_grid_thw"],
            inputs["num_images"], inputs["mm_token_type_ids"])
    whole, shared = pack_rows(*args), pack_rows(*args, share_prompts=True)
    prompt = int(inputs["prompt_mask"][0].sum())
    assert shared.inputs["input_ids"].shape[1] == whole.inputs["input_ids"].shape[1] - 2 * (prompt - 1)
    grid = inputs["image_grid_thw"]  # scene, crop, scene, crop, scene
    assert torch.equal(shared.inputs["image_grid_thw"], grid[[0, 1, 3]])
    segments = shared.inputs["eogym_shared_prefixes"].segments
    assert segments[0] == (0, prompt - 1, 0, 0) and [s[2:] for s in segments[1:4]] == [(0, prompt - 1)] * 3
    assert "eogym_shared_prefixes" not in whole.inputs
    assert torch.equal(shared.inputs["labels"][0][shared.source + 1], ids[shared.rows, inputs["prompt_ids"].shape[1] + shared.cols])


def _packed_shared(trainer, processor, eps):
    inputs = loss_inputs(trainer, processor, eps)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    return pack_rows(ids, mask, inputs["completion_ids"].shape[1], IMAGE_TOKEN_ID, 2, inputs["pixel_values"],
                     inputs["image_grid_thw"], inputs["num_images"], inputs["mm_token_type_ids"], share_prompts=True), mask


def test_a_prompt_is_shared_only_with_the_same_pixels_and_never_cut_inside_an_image(setup):
    """The same question over two scenes of one size (same tokens, other pixels) is two prompts; a prompt whose last
    token is an image pad is not shared (its copy of the last token would cut the image): both pack whole."""
    trainer, processor, _ = setup
    answer = _text(processor, "Final Answer: 3") + [IM_END]
    scene, scene_ids = _image(processor, 64, 64, 0)
    other, other_ids = _image(processor, 64, 64, 7)
    assert scene_ids == other_ids
    question = _text(processor, "<|im_start|>user\n") + scene_ids + _text(processor, "How many ships?<|im_end|>\n<|im_start|>assistant\n")
    eps = [(question, answer, [1] * len(answer), [picture], False) for picture in (scene, other)]
    packed, mask = _packed_shared(trainer, processor, eps)
    assert "eogym_shared_prefixes" not in packed.inputs and packed.inputs["input_ids"].shape[1] == int(mask.sum())
    cut = _text(processor, "<|im_start|>user\n") + scene_ids[:-1]  # ends in the image's last pad
    rest = [scene_ids[-1]] + answer
    packed, mask = _packed_shared(trainer, processor, [(cut, rest, [1] * len(rest), [scene], False)] * 2)
    assert "eogym_shared_prefixes" not in packed.inputs and packed.inputs["input_ids"].shape[1] == int(mask.sum())
    packed, mask = _packed_shared(trainer, processor, [eps[0]] * 2)  # the same pixels: shared
    assert packed.inputs["eogym_shared_prefixes"].segments[1][2:] == (0, len(question) - 1)


def test_a_masked_completion_is_dropped_with_its_crop(setup):
    """A truncated episode's completion with a crop inside: the padded path cannot run it (``get_rope_index``
    skips the masked image tokens but not their grid, which TRL's own loop avoids by dropping the crop), the
    packed path drops the completion and the crop: the other rows are what the padded path gives without it."""
    trainer, processor, _ = setup
    eps = episodes(processor, truncated_crop=True)
    packed = logps(trainer, loss_inputs(trainer, processor, eps), padded=False)
    alone = logps(trainer, loss_inputs(trainer, processor, eps[:2]), padded=True)
    width = alone[0].shape[1]
    for a, b in zip(packed, alone):
        torch.testing.assert_close(a[:2, :width], b, **TOL)
        assert torch.equal(a[2], torch.zeros_like(a[2])) and torch.equal(a[:2, width:], torch.zeros_like(a[:2, width:]))


def test_pack_rows_restarts_positions_per_episode_and_labels_completions_only(setup):
    trainer, processor, _ = setup
    inputs = loss_inputs(trainer, processor, episodes(processor, truncated_crop=True))
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    packed = pack_rows(
        ids, mask, inputs["completion_ids"].shape[1], IMAGE_TOKEN_ID, 2, inputs["pixel_values"], inputs["image_grid_thw"],
        inputs["num_images"], inputs["mm_token_type_ids"],
    )
    lengths = mask.sum(1).tolist()
    row = packed.inputs["input_ids"][0]
    assert row.shape[0] == sum(lengths)
    starts = (packed.inputs["position_ids"][0, 0] == 0).nonzero().flatten().tolist()
    assert starts == [0, lengths[0], lengths[0] + lengths[1]]
    labelled = (packed.inputs["labels"][0] != -100).sum().item()
    assert labelled == int(inputs["completion_mask"].sum()) == packed.source.numel()
    assert torch.equal(row[packed.source + 1], ids[packed.rows, inputs["prompt_ids"].shape[1] + packed.cols])
    grid = inputs["image_grid_thw"]
    assert torch.equal(packed.inputs["image_grid_thw"], grid[:3])  # the truncated row's crop (the 4th image) is gone
    assert packed.inputs["pixel_values"].shape[0] == int(grid[:3].prod(-1).sum())


@pytest.mark.parametrize("batch", ["episodes", "shared", "old"])
def test_the_loss_and_its_gradients_equal_the_padded_path(setup, batch):
    """``_compute_loss`` (TRL's) over the packed log-probabilities equals it over TRL's padded ones, with three
    episodes of one prompt sharing it (``shared``, under ``eogym_varlen``) too, and against old log-probs off the
    current ones (``old``: ``num_iterations`` > 1, the clip binding), where the packed forward scores only the
    counted tokens and the padded one every token."""
    trainer, processor, _ = setup
    eps = shared_episodes(processor) if batch == "shared" else episodes(processor, truncated_crop=False)
    inputs = loss_inputs(trainer, processor, eps)
    if batch == "old":
        with torch.no_grad():
            inputs["old_per_token_logps"] = logps(trainer, inputs, padded=True)[0] - 0.3
    model = trainer.model
    params = [p for p in model.parameters() if p.requires_grad]
    results = []
    for padded in (True, False):
        model.zero_grad()
        if padded:
            trainer._get_per_token_logps_and_entropies = types.MethodType(GRPOTrainer._get_per_token_logps_and_entropies, trainer)
        try:
            with _attention(trainer, "sdpa" if padded else None):
                loss = trainer._compute_loss(model, inputs)
                loss.backward()
        finally:
            trainer.__dict__.pop("_get_per_token_logps_and_entropies", None)
        results.append((loss.detach(), [p.grad.clone() for p in params]))
    (loss_padded, grads_padded), (loss_packed, grads_packed) = results
    torch.testing.assert_close(loss_packed, loss_padded, **TOL)
    assert loss_packed.abs() > 0
    for a, b in zip(grads_packed, grads_padded):
        torch.testing.assert_close(a, b, **TOL)
    assert sum(g.abs().sum() for g in grads_packed) > 0
    model.zero_grad()


def test_trls_padded_method_keeps_its_shape(setup):
    """Pins TRL 1.16's private method the subclass replaces: its parameters, and a ``(rows, logits_to_keep)``
    result with 0 where the label is masked (the truncated row)."""
    import inspect

    trainer, processor, _ = setup
    params = list(inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies).parameters)
    assert params[:8] == ["self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy", "compute_aux_loss"]
    ours = set(inspect.signature(type(trainer)._get_per_token_logps_and_entropies).parameters)
    assert {"pixel_values", "image_grid_thw", "num_images", "mm_token_type_ids"} <= ours
    inputs = loss_inputs(trainer, processor, episodes(processor, truncated_crop=False))
    lp, ent = logps(trainer, inputs, padded=True)
    assert lp.shape == ent.shape == inputs["completion_ids"].shape
    assert torch.equal(lp[2], torch.zeros_like(lp[2]))


def test_other_vision_inputs_are_refused(setup):
    trainer, processor, _ = setup
    ids = torch.ones((1, 4), dtype=torch.long)
    with pytest.raises(ValueError, match="Qwen-style vision inputs only"):
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, ids, 2, spatial_shapes=torch.ones(1, 2))


def head_rows(monkeypatch) -> list[int]:
    """The rows each call of TRL's fused-head kernel is handed, appended as the calls come."""
    import trl.trainer.utils as trl_utils

    rows_scored = []
    kernel = trl_utils._ChunkedLogProbFunction

    class Spy:
        @staticmethod
        def apply(hidden, *args):
            rows_scored.append(hidden.shape[0])
            return kernel.apply(hidden, *args)

    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", Spy)
    return rows_scored


def test_trls_fused_head_scores_only_labelled_rows_inside_labelled_rows_only(setup, monkeypatch):
    """Pins the name :func:`labelled_rows_only` swaps: TRL's fused forward decides from
    ``trl.trainer.utils._use_triton`` whether to hand its kernel the labelled rows or every row."""
    import trl.trainer.utils as trl_utils

    from eogym_sft.training.packed_logps import labelled_rows_only

    trainer, processor, _ = setup
    rows_scored = head_rows(monkeypatch)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    labels = torch.tensor([[-100, -100, -100, -100, 9, 10]])
    with torch.no_grad():
        everywhere = trainer.model(input_ids=ids, labels=labels, fused_lm_head=True).log_probs
        with labelled_rows_only():
            labelled = trainer.model(input_ids=ids, labels=labels, fused_lm_head=True).log_probs
    assert rows_scored == [5, 2]  # shifted by one: 5 positions predict a next token, 2 of them are labelled
    torch.testing.assert_close(labelled, everywhere, **TOL)
    assert trl_utils._use_triton(torch.device("cpu")) is False  # restored


def test_the_loss_forward_scores_only_the_tokens_the_loss_counts(setup, monkeypatch):
    """The tool result and its crop are context: ``_compute_loss``'s forward hands TRL's head only the
    model's own tokens (``completion_mask * tool_mask``), and the loss is the padded path's (the test above)."""
    trainer, processor, _ = setup
    inputs = loss_inputs(trainer, processor, episodes(processor, truncated_crop=False))
    rows_scored = head_rows(monkeypatch)
    with torch.no_grad():
        trainer._compute_loss(trainer.model, inputs)
    counted = int((inputs["completion_mask"] * inputs["tool_mask"]).sum())
    assert rows_scored == [counted] and counted < int(inputs["completion_mask"].sum())
    assert trainer._loss_mask is None  # only for the loss's own forward


def test_with_the_old_policys_logps_the_unscored_positions_hold_a_ratio_of_one():
    """``exp(0 - old)`` at an unscored position may be inf, and inf * 0 is NaN: with old log-probs
    (``num_iterations > 1``) the loss's batch holds 0 there (a copy; the buffered batch keeps its own), so the
    forward still scores only the counted tokens. The engines' sampled log-probs enter no ratio: left as they are."""
    from eogym_sft.training.packed_logps import loss_batch

    completion, tools = torch.tensor([[1, 1, 1, 0]]), torch.tensor([[1, 0, 1, 1]])
    base = {"completion_mask": completion, "tool_mask": tools}
    counted = torch.tensor([[1, 0, 1, 0]])
    assert loss_batch(base)[0] is base and torch.equal(loss_batch(base)[1], counted)
    assert loss_batch({"completion_mask": completion}) == ({"completion_mask": completion}, None)
    old = torch.tensor([[-1.0, -900.0, -2.0, -900.0]])
    batch, mask = loss_batch(base | {"old_per_token_logps": old, "sampling_per_token_logps": old})
    assert torch.equal(mask, counted) and torch.equal(batch["old_per_token_logps"], torch.tensor([[-1.0, 0.0, -2.0, 0.0]]))
    assert torch.equal(batch["sampling_per_token_logps"], old) and old[0, 1] == -900.0


def test_pack_rows_labels_exactly_the_tokens_of_the_score_mask(setup):
    """Every row's labels are its kept completion tokens inside ``score_mask`` (a random one here, so that each
    row's is different), each at its own column; the unscored ones stay in the row as context."""
    trainer, processor, _ = setup
    inputs = loss_inputs(trainer, processor, episodes(processor, truncated_crop=False))
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    width = inputs["completion_ids"].shape[1]
    score_mask = (torch.rand((3, width), generator=torch.Generator().manual_seed(0)) < 0.5).long()
    args = (ids, mask, width, IMAGE_TOKEN_ID, 2, inputs["pixel_values"], inputs["image_grid_thw"], inputs["num_images"], inputs["mm_token_type_ids"])
    packed, everything = pack_rows(*args, score_mask=score_mask), pack_rows(*args)
    assert torch.equal(packed.inputs["input_ids"], everything.inputs["input_ids"])
    want = (inputs["completion_mask"] * score_mask).bool()
    assert torch.equal(torch.sparse_coo_tensor(torch.stack([packed.rows, packed.cols]), torch.ones_like(packed.rows), want.shape).to_dense().bool(), want)
    assert (packed.inputs["labels"][0] != -100).sum() == int(want.sum()) < int(inputs["completion_mask"].sum())
