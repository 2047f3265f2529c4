"""``EOGymSFTTrainer``: the supervised-positions-only loss equals the model's own full-logits loss, and the
logged token accuracy is the token-weighted count of ``eogym_sft.metrics``."""

from __future__ import annotations

import json

import pytest
import torch

from eogym_sft.metrics import token_accuracy_counts

MIN_PIXELS, MAX_PIXELS = 1024, 16384


def _examples():
    from PIL import Image

    def ex(question, answer, images=()):
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
        return {
            "messages": [{"role": "user", "content": content}, {"role": "assistant", "content": answer}],
            "images": list(images),
        }

    tool_use = {  # a tool call and a tool result with an image (no tools block: it would add 150 context tokens)
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Ships?"}]},
            {
                "role": "assistant",
                "content": "Crop.",
                "tool_calls": [{"type": "function", "function": {"name": "crop", "arguments": {}}}],
            },
            {"role": "tool", "content": [{"type": "text", "text": "ok"}, {"type": "image"}]},
            {"role": "assistant", "content": "Final Answer: 2"},
        ],
        "images": [Image.new("RGB", (64, 64), "red"), Image.new("RGB", (32, 64), "blue")],
    }
    return [
        tool_use,
        ex("Flooded?", "Final Answer: no"),
        ex("Land cover?", "Forest.", [Image.new("RGB", (96, 32), "green")]),
    ]


@pytest.fixture(scope="module")
def trainer(processor, tmp_path_factory):
    from trl import SFTConfig

    from eogym_sft.collator import EOGymCollator
    from eogym_sft.modeling import apply_lora
    from eogym_sft.tiny import build_tiny_model
    from eogym_sft.trainer import EOGymSFTTrainer

    model = build_tiny_model(seed=4)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():  # larger weights: a loss far from log(vocab), and some right predictions
        for param in model.parameters():
            if param.ndim >= 2:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
        # an LM head that leans towards <|im_end|>: some predictions are right, most are not
        head = torch.nn.Linear(16, model.lm_head.out_features, bias=True)
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[151645] = 8.0
        model.lm_head = head
    model.config.use_cache = False
    model = apply_lora(model)
    with torch.no_grad():  # a non-zero adapter, so that the LoRA path is part of the comparison
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    args = SFTConfig(
        output_dir=str(tmp_path_factory.mktemp("trainer")),
        use_cpu=True,
        bf16=False,
        report_to="none",
        remove_unused_columns=False,
        dataset_kwargs={"skip_prepare_dataset": True},
        per_device_train_batch_size=3,
    )
    collator = EOGymCollator(processor, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    from datasets import Dataset

    train = Dataset.from_list([{"messages": json.dumps(ex["messages"])} for ex in _examples()[1:]])  # needed, unused
    trainer = EOGymSFTTrainer(
        model=model, args=args, data_collator=collator, train_dataset=train, processing_class=processor
    )
    trainer.model.eval()  # no LoRA dropout: the two losses see the same network
    return trainer


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "packed"])
def test_compute_loss_equals_the_full_logits_loss(trainer, processor, padding_free):
    from eogym_sft.collator import EOGymCollator

    collator = EOGymCollator(processor, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, padding_free=padding_free)
    batch = collator(_examples())
    trainer._token_counts.clear()
    with torch.no_grad():
        full = trainer.model(**batch, use_cache=False)
        loss = trainer.compute_loss(trainer.model, batch)
    assert 1.0 < full.loss.item() < 100.0
    assert abs(loss.item() - full.loss.item()) < 1e-5
    # the counts it keeps for logging are the metrics' definition on the full logits
    assert trainer._token_counts["eval"].tolist() == token_accuracy_counts(full.logits, batch["labels"]).tolist()
    # with num_items_in_batch (gradient accumulation) the sum is divided by that count instead
    n = int((batch["labels"][:, 1:] != -100).sum())
    with torch.no_grad():
        summed = trainer.compute_loss(trainer.model, batch, num_items_in_batch=torch.tensor(4 * n))
    assert abs(summed.item() - full.loss.item() / 4) < 1e-5


def test_compute_loss_gradients_match(trainer, processor):
    from eogym_sft.collator import EOGymCollator

    batch = EOGymCollator(processor, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)(_examples())
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    want = torch.autograd.grad(trainer.model(**batch, use_cache=False).loss, params)
    got = torch.autograd.grad(trainer.compute_loss(trainer.model, batch), params)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-4)
    assert any(w.abs().sum() > 0 for w in want)


def test_logged_token_accuracy_is_token_weighted(trainer, processor):
    from eogym_sft.collator import EOGymCollator

    collator = EOGymCollator(processor, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    batches = [collator(_examples()[:1]), collator(_examples()[1:])]
    trainer._token_counts.clear()
    trainer._metrics["eval"].clear()
    totals = torch.zeros(2, dtype=torch.long)
    step_accuracies = []
    with torch.no_grad():
        for batch in batches:
            trainer.compute_loss(trainer.model, batch)
            counts = token_accuracy_counts(trainer.model(**batch, use_cache=False).logits, batch["labels"])
            totals += counts
            step_accuracies.append(counts[0].item() / counts[1].item())
    # steps of different accuracy, so that the token-weighted figure differs from the mean of the steps
    assert step_accuracies[0] != step_accuracies[1] and 0 < totals[0] < totals[1]
    assert abs(totals[0].item() / totals[1].item() - sum(step_accuracies) / 2) > 0.01
    logs = {"eval_loss": 1.0}
    trainer.log(logs)
    assert logs["eval_token_accuracy"] == totals[0].item() / totals[1].item()
    assert logs["eval_mean_token_accuracy"] == pytest.approx(sum(step_accuracies) / 2)
    assert "eval" not in trainer._token_counts  # counted once per logging window


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "packed"])
def test_repeated_samples_of_the_last_batch_are_not_counted(trainer, processor, padding_free):
    """On the last batch accelerate repeats samples to even out the ranks and reports how many are real
    (``remainder``); the accuracy counts keep exactly those, one row per sample, in padded and packed batches."""
    from eogym_sft.collator import EOGymCollator

    class LastBatch:  # what accelerate's gradient state reads from the active dataloader
        end_of_dataloader = True
        remainder = 1  # one real sample, the others repeated

    collator = EOGymCollator(processor, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, padding_free=padding_free)
    examples = _examples()
    alone = collator(examples[:1])
    with torch.no_grad():
        first_only = token_accuracy_counts(trainer.model(**alone, use_cache=False).logits, alone["labels"])
    last_batch = LastBatch()
    state = trainer.accelerator.gradient_state
    trainer._token_counts.clear()
    state._add_dataloader(last_batch)
    try:
        with torch.no_grad():
            trainer.compute_loss(trainer.model, collator(examples))
    finally:
        state._remove_dataloader(last_batch)
    assert trainer._token_counts["eval"].tolist() == first_only.tolist()
    assert first_only[1] > 0
