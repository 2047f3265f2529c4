"""``EOGymSFTTrainer``: the supervised-positions-only loss equals the model's own full-logits loss, and the
logged token accuracy is the token-weighted count of ``eogym_sft.metrics.token_accuracy``."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from helpers import chat_example, lean_towards_im_end, perturb_lora_b, sharpen

from eogym_sft.metrics.token_accuracy import token_accuracy_counts

MIN_PIXELS, MAX_PIXELS = 1024, 16384


def _examples():
    from PIL import Image

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
        chat_example("Flooded?", "Final Answer: no"),
        chat_example("Land cover?", "Forest.", [Image.new("RGB", (96, 32), "green")]),
    ]


@pytest.fixture(scope="module")
def processor_at_cap(capped_processor):
    """The offline processor carrying this module's pixel cap, which the collator resizes with."""
    return capped_processor(MAX_PIXELS, MIN_PIXELS)


@pytest.fixture(scope="module")
def trainer(processor_at_cap, tmp_path_factory):
    from trl import SFTConfig

    from eogym_sft.models.loading import apply_lora
    from eogym_sft.models.tiny import build_tiny_model
    from eogym_sft.data.collator import EOGymCollator
    from eogym_sft.training.trainer import EOGymSFTTrainer

    # a loss far from log(vocab), and some right predictions (most wrong)
    model = perturb_lora_b(apply_lora(lean_towards_im_end(sharpen(build_tiny_model(seed=4), seed=4))), seed=4)
    args = SFTConfig(
        output_dir=str(tmp_path_factory.mktemp("trainer")),
        use_cpu=True,
        bf16=False,
        report_to="none",
        remove_unused_columns=False,
        dataset_kwargs={"skip_prepare_dataset": True},
        per_device_train_batch_size=3,
    )
    collator = EOGymCollator(processor_at_cap)
    from datasets import Dataset

    train = Dataset.from_list([{"messages": json.dumps(ex["messages"])} for ex in _examples()[1:]])  # needed, unused
    trainer = EOGymSFTTrainer(
        model=model, args=args, data_collator=collator, train_dataset=train, processing_class=processor_at_cap
    )
    trainer.model.eval()  # no LoRA dropout: the two losses see the same network
    return trainer


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "packed"])
def test_compute_loss_equals_the_full_logits_loss(trainer, processor_at_cap, padding_free):
    from eogym_sft.data.collator import EOGymCollator

    collator = EOGymCollator(processor_at_cap, padding_free=padding_free)
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


def test_compute_loss_gradients_match(trainer, processor_at_cap):
    from eogym_sft.data.collator import EOGymCollator

    batch = EOGymCollator(processor_at_cap)(_examples())
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    want = torch.autograd.grad(trainer.model(**batch, use_cache=False).loss, params)
    got = torch.autograd.grad(trainer.compute_loss(trainer.model, batch), params)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-4)
    assert any(w.abs().sum() > 0 for w in want)


def test_logged_token_accuracy_is_token_weighted(trainer, processor_at_cap):
    from eogym_sft.data.collator import EOGymCollator

    collator = EOGymCollator(processor_at_cap)
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
def test_repeated_samples_of_the_last_batch_are_not_counted(trainer, processor_at_cap, padding_free):
    """On the last batch accelerate repeats samples to even out the ranks and reports how many are real
    (``remainder``); the accuracy counts keep exactly those, one row per sample, in padded and packed batches."""
    from eogym_sft.data.collator import EOGymCollator

    class LastBatch:  # what accelerate's gradient state reads from the active dataloader
        end_of_dataloader = True
        remainder = 1  # one real sample, the others repeated

    collator = EOGymCollator(processor_at_cap, padding_free=padding_free)
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


def test_train_counts_stay_on_device_until_the_log(trainer, processor_at_cap):
    from eogym_sft.data.collator import EOGymCollator

    collator = EOGymCollator(processor_at_cap, padding_free=True)
    batches = [collator(_examples()[:1]), collator(_examples()[1:])]
    dropouts = [m for m in trainer.model.modules() if isinstance(m, torch.nn.Dropout)]
    saved = [m.p for m in dropouts]
    trainer._train_steps.clear()
    trainer._metrics["train"].clear()
    trainer._total_train_tokens = 0
    trainer.model.train()
    try:
        for m in dropouts:  # train mode without dropout: the counts can be checked against the logits
            m.p = 0.0
        with torch.no_grad():
            counts = [token_accuracy_counts(trainer.model(**b, use_cache=False).logits, b["labels"]) for b in batches]
            for batch in batches:
                trainer.compute_loss(trainer.model, batch)
        assert len(trainer._train_steps) == 2 and "train" not in trainer._token_counts  # nothing summed yet
        logs = {"loss": 1.0}
        trainer.log(logs)
    finally:
        trainer.model.eval()
        for m, p in zip(dropouts, saved):
            m.p = p
    totals = counts[0] + counts[1]
    assert logs["token_accuracy"] == totals[0].item() / totals[1].item()
    assert logs["mean_token_accuracy"] == pytest.approx(sum(c[0].item() / c[1].item() for c in counts) / 2)
    assert logs["num_tokens"] == sum(b["input_ids"].numel() for b in batches)
    assert trainer._train_steps == []


def test_floating_point_ops_equal_the_trainers_and_count_the_parameters_once(trainer, processor_at_cap, monkeypatch):
    """The Trainer adds ``floating_point_ops`` of every micro-batch to ``total_flos``; ours gives its figure with
    the model's parameters counted on the first call only."""
    from transformers import Trainer

    from eogym_sft.data.collator import EOGymCollator

    collator = EOGymCollator(processor_at_cap, padding_free=True)
    batches = [collator(_examples()[:1]), collator(_examples()[1:])]
    want = [Trainer.floating_point_ops(trainer, b) for b in batches]
    calls = []
    count = trainer.model.num_parameters
    monkeypatch.setattr(trainer.model, "num_parameters", lambda **kw: calls.append(kw) or count(**kw), raising=False)
    monkeypatch.setattr(trainer, "_flops_per_token", None)
    assert [trainer.floating_point_ops(b) for b in batches] == want and want[0] != want[1]
    assert calls == [{"exclude_embeddings": True}]
    assert trainer.floating_point_ops({"labels": batches[0]["labels"]}) == 0  # no input ids, as the Trainer's


def test_a_small_shared_memory_is_named_before_workers_die_of_it(tmp_path, monkeypatch, caplog):
    """Docker's default /dev/shm (64 MB) kills DataLoader workers mid-run with a bus error: said up front."""
    import shutil

    from eogym_sft.training.trainer import warn_on_small_shared_memory

    assert not warn_on_small_shared_memory(8, str(tmp_path / "missing"))
    assert not warn_on_small_shared_memory(0, str(tmp_path))
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(total=64 << 20))
    with caplog.at_level("WARNING", logger="eogym_sft.training.trainer"):
        assert warn_on_small_shared_memory(8, str(tmp_path))
    assert f"{tmp_path} holds 64 MiB" in caplog.text and "--shm-size" in caplog.text
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(total=8 << 30))
    assert not warn_on_small_shared_memory(8, str(tmp_path))


def test_batch_rebalance_gives_token_balanced_micro_batches(processor, tmp_path):
    from datasets import Dataset
    from trl import SFTConfig

    from eogym_sft.models.tiny import build_tiny_model
    from eogym_sft.data.collator import EOGymCollator
    from eogym_sft.training.sampler import TokenBalancedSampler, deal_by_cost
    from eogym_sft.training.trainer import EOGymSFTTrainer

    lengths = [900, 100, 100, 100, 500, 400, 300, 100]
    train = Dataset.from_dict({"n_tokens": lengths, "messages": ["[]"] * len(lengths)})
    args = SFTConfig(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", remove_unused_columns=False, seed=3,
        dataset_kwargs={"skip_prepare_dataset": True}, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        train_sampling_strategy="batch_rebalance", length_column_name="n_tokens",
    )
    trainer = EOGymSFTTrainer(
        model=build_tiny_model(), args=args, data_collator=EOGymCollator(processor), train_dataset=train, processing_class=processor
    )
    sampler = trainer._get_train_sampler()
    assert isinstance(sampler, TokenBalancedSampler) and sampler.seed == 3
    order = torch.randperm(8, generator=torch.Generator().manual_seed(3)).tolist()
    want = [g for k in (0, 4) for g in deal_by_cost(order[k : k + 4], [lengths[i] for i in order[k : k + 4]], 2)]
    assert list(sampler) == want
    assert len(trainer.get_train_dataloader()) == 4  # the Trainer takes it as a batch sampler


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "packed"])
def test_grouping_into_micro_batches_leaves_the_step_gradient_unchanged(trainer, processor_at_cap, padding_free):
    """A step's samples in one micro-batch or dealt into several (the recipe's token-balanced 2 x 32 in
    place of the published 4 x 16): with the step's supervised-token count as the denominator, as the
    Trainer passes it, the accumulated gradient is the same."""
    from eogym_sft.data.collator import EOGymCollator

    collator = EOGymCollator(processor_at_cap, padding_free=padding_free)
    examples = _examples()
    params = [p for p in trainer.model.parameters() if p.requires_grad]

    def step_gradient(groups):
        batches = [collator([examples[i] for i in group]) for group in groups]
        n_items = torch.tensor(sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches))
        total = [torch.zeros_like(p) for p in params]
        for batch in batches:
            grads = torch.autograd.grad(trainer.compute_loss(trainer.model, batch, num_items_in_batch=n_items), params)
            total = [t + g for t, g in zip(total, grads)]
        return total

    whole, dealt = step_gradient([[0, 1, 2]]), step_gradient([[2], [0, 1]])
    for w, d in zip(whole, dealt):
        torch.testing.assert_close(d, w, atol=1e-6, rtol=1e-4)
    assert any(w.abs().sum() > 0 for w in whole)


def test_skipped_samples_are_logged_counted_and_listed(trainer, processor_at_cap, caplog):
    from eogym_sft.data.collator import EOGymCollator
    from eogym_sft.training.trainer import SKIPPED_FILE, skipped_counts

    collator = EOGymCollator(processor_at_cap, skip_bad_images=True)
    bad = dict(chat_example("Ships?", "Final Answer: 1", ["gone/scene.png"]), sample_id="scene-9#w0")
    batch = collator([bad])  # every sample skipped: a step that trains nothing, but runs
    assert batch["skipped_samples"][0]["sample_id"] == "scene-9#w0"
    trainer.model.train()
    try:
        with caplog.at_level("WARNING", logger="eogym_sft.training.trainer"):
            loss = trainer.compute_loss(trainer.model, batch)
    finally:
        trainer.model.eval()
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=False)
    assert loss.item() == 0.0 and all(g.abs().sum() == 0 for g in grads)
    assert "skipped sample scene-9#w0 (missing_image): gone/scene.png" in caplog.text
    logs = {"loss": 0.0}
    trainer.model.train()
    try:
        trainer.log(logs)
    finally:
        trainer.model.eval()
    assert logs["skipped_samples"] == 1
    (listed,) = [json.loads(line) for line in open(f"{trainer.args.output_dir}/{SKIPPED_FILE}")]
    assert (listed["sample_id"], listed["file"], listed["reason"], listed["mode"]) == ("scene-9#w0", "gone/scene.png", "missing_image", "train")
    assert skipped_counts(trainer.state.log_history[-1:]) == {"train": 1, "eval": 0}


def test_padding_free_config_trains_on_packed_image_batches(processor, tmp_path):
    """TRL refuses ``padding_free`` on image data (its collator cannot pack images); the trainer accepts it with
    a collator that packs, keeps the setting as given, and refuses it with one that pads."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from eogym_sft.models.tiny import build_tiny_model
    from eogym_sft.data.collator import EOGymCollator
    from eogym_sft.training.trainer import EOGymSFTTrainer

    train = Dataset.from_dict({"messages": ["[]"], "images": [[]]})
    args = SFTConfig(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", remove_unused_columns=False, padding_free=True,
        dataset_kwargs={"skip_prepare_dataset": True},
    )
    model, packing = build_tiny_model(), EOGymCollator(processor, padding_free=True)
    with pytest.raises(ValueError, match="Padding-free training is yet not supported for vision datasets"):
        SFTTrainer(model=model, args=args, data_collator=packing, train_dataset=train, processing_class=processor)
    trainer = EOGymSFTTrainer(model=model, args=args, data_collator=packing, train_dataset=train, processing_class=processor)
    assert trainer.args.padding_free is True and trainer.data_collator is packing
    with pytest.raises(ValueError, match="needs a collator that packs"):
        EOGymSFTTrainer(model=model, args=args, data_collator=EOGymCollator(processor), train_dataset=train, processing_class=processor)


@pytest.mark.parametrize("loss_type", ["nll", "dft"])
@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "packed"])
def test_loss_and_entropy_equal_trls_fused_lm_head_path(trainer, processor_at_cap, loss_type, padding_free):
    """TRL's own SFTTrainer.compute_loss (its fused LM head over every position) on the same batch: the same
    loss for each loss_type, and the same entropy as its `entropy` metric."""
    from trl import SFTTrainer

    from eogym_sft.data.collator import EOGymCollator

    batch = EOGymCollator(processor_at_cap, padding_free=padding_free)(_examples())
    trainer._token_counts.clear()
    trainer._entropy_sums.clear()
    trainer._metrics["eval"].clear()
    trainer.args.loss_type = loss_type
    try:
        with torch.no_grad():
            theirs = SFTTrainer.compute_loss(trainer, trainer.model, dict(batch))
            ours = trainer.compute_loss(trainer.model, batch)
    finally:
        trainer.args.loss_type = "nll"
    assert abs(ours.item() - theirs.item()) < 1e-5
    total = trainer._token_counts["eval"][1].item()
    assert trainer._entropy_sums["eval"] / total == pytest.approx(trainer._metrics["eval"]["entropy"][0], rel=1e-5)
    if loss_type == "dft":  # not the plain loss: the weights are the tokens' probabilities
        with torch.no_grad():
            assert ours.item() < trainer.model(**batch, use_cache=False).loss.item() / 2


def test_label_smoothing_and_compute_loss_func_are_trls_full_logits_loss(trainer, processor_at_cap):
    from transformers.trainer_pt_utils import LabelSmoother

    from eogym_sft.data.collator import EOGymCollator

    batch = EOGymCollator(processor_at_cap)(_examples())
    with torch.no_grad():
        full = trainer.model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False)
        smoothed = LabelSmoother(epsilon=0.1)(full, batch["labels"], shift_labels=True)
        plain = trainer.model(**batch, use_cache=False).loss
    seen = []

    def loss_func(outputs, labels, num_items_in_batch=None):
        seen.append((outputs.logits.shape, labels is batch["labels"]))
        return outputs.logits.float().mean() * 0 + 7.0

    try:
        trainer.label_smoother = LabelSmoother(epsilon=0.1)
        with torch.no_grad():
            assert trainer.compute_loss(trainer.model, dict(batch)).item() == pytest.approx(smoothed.item(), abs=1e-6)
        trainer.label_smoother = None
        trainer.compute_loss_func = loss_func
        with torch.no_grad():
            assert trainer.compute_loss(trainer.model, dict(batch)).item() == 7.0
    finally:
        trainer.label_smoother = None
        trainer.compute_loss_func = None
    assert abs(smoothed.item() - plain.item()) > 0.01
    assert seen == [(batch["input_ids"].shape + (151936,), True)]


@pytest.mark.parametrize("workers,accumulation,given,expected", [(4, 32, None, 8), (4, 2, None, 2), (3, 32, 5, 5), (0, 32, None, None)])
def test_workers_keep_a_whole_step_in_flight(processor, tmp_path, workers, accumulation, given, expected):
    from datasets import Dataset
    from trl import SFTConfig

    from eogym_sft.models.tiny import build_tiny_model
    from eogym_sft.data.collator import EOGymCollator
    from eogym_sft.training.trainer import EOGymSFTTrainer

    args = SFTConfig(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", remove_unused_columns=False,
        dataset_kwargs={"skip_prepare_dataset": True}, dataloader_num_workers=workers,
        gradient_accumulation_steps=accumulation, dataloader_prefetch_factor=given,
    )
    train = Dataset.from_dict({"messages": ["[]"]})
    trainer = EOGymSFTTrainer(model=build_tiny_model(), args=args, data_collator=EOGymCollator(processor), train_dataset=train,
                              processing_class=processor)
    assert trainer.args.dataloader_prefetch_factor == expected


def test_train_stops_persistent_dataloader_workers_before_it_returns(processor, tmp_path):
    """The recipe's persistent workers (training and cached evaluation loaders) have exited by themselves, exit
    code 0, when ``train`` returns: left to the cycle collector they would each be killed after a 5 s wait. This
    also pins the private torch and transformers attributes ``stop_dataloader_workers`` reads."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig

    from eogym_sft.models.tiny import build_tiny_model
    from eogym_sft.data.collator import EOGymCollator
    from eogym_sft.training.trainer import EOGymSFTTrainer, stop_dataloader_workers

    workers = []

    class Watch(TrainerCallback):  # the live worker processes of both loaders, seen from inside the run
        def on_evaluate(self, args, state, control, **kwargs):
            iterators = [loader._iterator for loader in (kwargs["train_dataloader"], *trainer._eval_dataloaders.values())]
            workers.extend(w for it in iterators if it is not None for w in it._workers if w not in workers)

    rows = [json.dumps(chat_example(f"Question {i}?", "Final Answer: yes")["messages"]) for i in range(4)]
    args = SFTConfig(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", remove_unused_columns=False, max_steps=2,
        dataset_kwargs={"skip_prepare_dataset": True}, per_device_train_batch_size=1, per_device_eval_batch_size=2,
        eval_strategy="steps", eval_steps=1, save_strategy="no", logging_steps=100,
        dataloader_num_workers=1, dataloader_persistent_workers=True,
    )
    data = Dataset.from_dict({"messages": rows})
    trainer = EOGymSFTTrainer(model=build_tiny_model(), args=args, data_collator=EOGymCollator(processor), train_dataset=data,
                              eval_dataset=data, processing_class=processor, callbacks=[Watch()])
    trainer.train()
    assert len(workers) == 2 and [w.exitcode for w in workers] == [0, 0]  # one a loader, each exited on its own
    assert stop_dataloader_workers(trainer) == 0  # nothing left to stop
    assert "eval_loss" in trainer.evaluate()  # the cached evaluation loader starts new workers
    assert len(workers) == 3 and workers[2].is_alive()
    assert stop_dataloader_workers(trainer) == 1 and workers[2].exitcode == 0


# What the trainer relies on in TRL and transformers beyond their public API. If an upgrade changes
# any of it, these fail, rather than the trainer silently doing something else.


def test_upstream_trainer_draws_a_whole_step_before_running_it(processor, tmp_path):
    """``Trainer.get_batch_samples`` takes all of a step's micro-batches before ``on_step_begin``: the reason the
    trainer sets the dataloader's prefetch factor to a step."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig

    from eogym_sft.models.tiny import build_tiny_model
    from eogym_sft.data.collator import EOGymCollator
    from eogym_sft.training.trainer import EOGymSFTTrainer

    calls, at_step_begin = [], []

    class Counting(EOGymCollator):
        def __call__(self, examples):
            calls.append(len(examples))
            return super().__call__(examples)

    class Watch(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            at_step_begin.append(len(calls))

    rows = [json.dumps(chat_example(f"Question {i}?", "Final Answer: yes")["messages"]) for i in range(8)]
    args = SFTConfig(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", remove_unused_columns=False, max_steps=2,
        dataset_kwargs={"skip_prepare_dataset": True}, per_device_train_batch_size=1, gradient_accumulation_steps=3,
        save_strategy="no", logging_steps=100,
    )
    trainer = EOGymSFTTrainer(model=build_tiny_model(), args=args, data_collator=Counting(processor),
                              train_dataset=Dataset.from_dict({"messages": rows}), processing_class=processor, callbacks=[Watch()])
    trainer.train()
    assert at_step_begin == [4, 7]  # each step's 3, and accelerate's dataloader reads one batch ahead


def test_upstream_private_hooks_keep_their_shape():
    """The private methods and attributes the trainer and sampler override or read."""
    import inspect

    from transformers import Trainer
    from transformers.trainer_pt_utils import BatchRebalanceSampler

    assert list(inspect.signature(Trainer._get_train_sampler).parameters) == ["self", "train_dataset"]
    assert list(inspect.signature(Trainer._prepare_inputs).parameters) == ["self", "inputs"]
    assert list(inspect.signature(BatchRebalanceSampler.__init__).parameters) == [
        "self", "lengths", "effective_batch_size", "dp_size", "grad_accum", "shuffle", "seed", "rank", "drop_last"]
    sampler = BatchRebalanceSampler([5, 4, 3, 2, 1, 6, 7, 8], 4, 2, 1, seed=3, rank=1, drop_last=False)
    assert (sampler.lengths, sampler.effective_batch_size, sampler.dp_size, sampler.grad_accum, sampler.rank, sampler.drop_last) == (
        [5, 4, 3, 2, 1, 6, 7, 8], 4, 2, 1, 1, False)

    class Recording(BatchRebalanceSampler):  # _assign gets each step's drawn samples; rank r's slots are yielded
        def _assign(self, indices, lengths):
            seen.append((list(indices), list(lengths)))
            return [[[i] for i in indices[:2]], [[i] for i in indices[2:]]]

    seen = []
    order = torch.randperm(8, generator=torch.Generator().manual_seed(3)).tolist()
    yielded = list(Recording([5, 4, 3, 2, 1, 6, 7, 8], 4, 2, 2, seed=3, rank=1))
    assert seen == [(order[:4], [[5, 4, 3, 2, 1, 6, 7, 8][i] for i in order[:4]]), (order[4:], [[5, 4, 3, 2, 1, 6, 7, 8][i] for i in order[4:]])]
    assert yielded == [[order[2]], [order[3]], [order[6]], [order[7]]]


def test_upstream_sft_log_averages_and_clears_its_metric_lists(trainer):
    """The trainer appends to TRL's ``_metrics[mode]`` lists and adds to its ``_total_train_tokens`` (an int from
    ``SFTTrainer.__init__``); ``SFTTrainer.log`` averages each list into the logs and clears them."""
    trainer._metrics["eval"].clear()
    trainer._metrics["eval"]["mean_token_accuracy"].extend([0.25, 0.75])
    logs = {"eval_loss": 1.0}
    trainer._token_counts.clear()
    trainer.log(logs)
    assert logs["eval_mean_token_accuracy"] == 0.5 and not trainer._metrics["eval"]
    assert isinstance(trainer._total_train_tokens, int)


@pytest.fixture(scope="module")
def packed_trainers(processor_at_cap, tmp_path_factory):
    """``{attn_implementation: trainer}``: a LoRA tiny model training on packed batches, its text tower on SDPA or on
    ``eogym_varlen`` (which takes the packed-sequence arguments)."""
    from datasets import Dataset
    from trl import SFTConfig

    from eogym_sft.data.collator import EOGymCollator
    from eogym_sft.models.attention import add_sample_boundaries, register_varlen_attention
    from eogym_sft.models.loading import apply_lora
    from eogym_sft.models.tiny import build_tiny_model
    from eogym_sft.training.trainer import EOGymSFTTrainer

    trainers = {}
    for attention in ("sdpa", "eogym_varlen"):
        model = sharpen(build_tiny_model(seed=4), seed=4)
        if attention != "sdpa":
            register_varlen_attention()
            model.set_attn_implementation({"text_config": attention, "vision_config": "sdpa"})
            add_sample_boundaries(model)
        model = perturb_lora_b(apply_lora(model), seed=4)
        args = SFTConfig(
            output_dir=str(tmp_path_factory.mktemp("packed")), use_cpu=True, bf16=False, report_to="none", padding_free=True,
            remove_unused_columns=False, dataset_kwargs={"skip_prepare_dataset": True},
        )
        train = Dataset.from_list([{"messages": "[]"}])  # needed, unused
        trainers[attention] = EOGymSFTTrainer(
            model=model, args=args, data_collator=EOGymCollator(processor_at_cap, padding_free=True), train_dataset=train,
            processing_class=processor_at_cap,
        )
    return trainers


def _train_micro_batch(trainer, batch):
    """One training micro-batch's loss, LoRA gradients and the counts kept for the log (no dropout)."""
    trainer._train_steps.clear()
    trainer._train_entropy.clear()
    trainer.model.train()
    for module in trainer.model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    loss = trainer.compute_loss(trainer.model, batch, num_items_in_batch=torch.tensor(64))
    return loss, torch.autograd.grad(loss, params), torch.stack(trainer._train_steps), torch.stack(trainer._train_entropy)


@pytest.mark.parametrize("attention", ["sdpa", "eogym_varlen"])
def test_the_host_layout_changes_nothing_the_step_computes(packed_trainers, processor_at_cap, attention, monkeypatch):
    """A packed micro-batch of six samples and six images, trained with the collator's host layout and without it:
    the loss, every LoRA gradient and the counts kept for the log are equal bit for bit. With the layout the vision
    tower computes none of its metadata and reads the layout's (the helpers' results are the layout's tensors), and
    without it computes the same values itself."""
    from transformers.models.qwen3_vl import modeling_qwen3_vl

    from eogym_sft.data.collator import EOGymCollator
    from eogym_sft.models.host_layout import HostLayout, VisionGeometry

    trainer = packed_trainers[attention]
    collator = EOGymCollator(processor_at_cap, padding_free=True, host_layout=True, vision=VisionGeometry.of(trainer.model))
    batch = collator(_examples() * 2)
    layout = batch["host_layout"]
    assert isinstance(layout, HostLayout) and batch["image_grid_thw"].shape[0] == 6 and layout.cu_seq_lens.numel() == 7
    seen = []
    for name in ("get_vision_interpolation_indices_and_weights", "get_vision_position_ids", "get_vision_attention_seqlens"):
        helper = getattr(modeling_qwen3_vl, name)
        monkeypatch.setattr(modeling_qwen3_vl, name, lambda *a, _h=helper, _n=name, **k: seen.append((_n, _h(*a, **k))) or seen[-1][1])
    without = _train_micro_batch(trainer, {k: v for k, v in batch.items() if k != "host_layout"})
    computed, seen[:] = list(seen), []
    with_layout = _train_micro_batch(trainer, batch)
    assert torch.equal(with_layout[0], without[0]) and 1.0 < without[0].item() < 100.0
    assert all(torch.equal(g, w) for g, w in zip(with_layout[1], without[1]))
    assert any(w.abs().sum() > 0 for w in without[1])
    assert torch.equal(with_layout[2], without[2]) and torch.equal(with_layout[3], without[3])
    # the layout's values are the model's own; with the layout the helpers hand back the layout's tensors
    vision = layout.vision
    ours = {"get_vision_interpolation_indices_and_weights": (vision["interp_indices"], vision["interp_weights"]),
            "get_vision_position_ids": vision["position_ids"],
            "get_vision_attention_seqlens": (vision["cu_seqlens"], vision["max_seqlen"])}
    assert [n for n, _ in computed] == [n for n, _ in seen] == list(ours)
    for (name, theirs), (_, fed) in zip(computed, seen):
        want = ours[name] if isinstance(ours[name], tuple) else (ours[name],)
        theirs, fed = (t if isinstance(t, tuple) else (t,) for t in (theirs, fed))
        assert all(type(a) is type(b) and (a is b or torch.equal(a, b)) for a, b in zip(theirs, want)), name
        assert all(a is b for a, b in zip(fed, want)), name
    assert not trainer._vision_tower._forward_pre_hooks  # the hook is removed after the call


def test_the_host_layout_equals_what_the_forward_reads(packed_trainers, processor_at_cap):
    """The layout's supervised positions are the loss's, and its boundaries those the text tower finds itself from
    the text position row (``add_sample_boundaries``), which it is given instead."""
    from eogym_sft.data.collator import EOGymCollator
    from eogym_sft.models.attention import sample_boundaries
    from eogym_sft.models.host_layout import supervised_positions

    trainer = packed_trainers["eogym_varlen"]
    batch = EOGymCollator(processor_at_cap, padding_free=True, host_layout=True)(_examples() * 2)
    layout = batch["host_layout"]
    assert layout.vision is None  # no geometry: the vision tower computes its own
    assert torch.equal(layout.supervised, (batch["labels"][:, 1:] != -100).any(0).nonzero().flatten())
    assert torch.equal(layout.supervised, supervised_positions(batch["labels"]))
    cu, longest = sample_boundaries(batch["position_ids"][0])
    assert torch.equal(layout.cu_seq_lens, cu) and layout.max_length == longest
    got = []
    decoder = trainer.model.get_decoder()
    handle = decoder.register_forward_pre_hook(lambda m, a, k: got.append(k), with_kwargs=True)
    try:
        with torch.no_grad():
            trainer.compute_loss(trainer.model, batch)
    finally:
        handle.remove()
    assert got[0]["cu_seq_lens_q"] is got[0]["cu_seq_lens_k"] and torch.equal(got[0]["cu_seq_lens_q"], cu)
    assert got[0]["max_length_q"] == got[0]["max_length_k"] == longest


def test_a_collator_without_the_host_layout_still_trains(packed_trainers, processor_at_cap):
    """A user's own collator (no ``host_layout`` in its batches) takes the old path: the model finds everything
    itself, and the step trains."""
    from eogym_sft.data.collator import EOGymCollator

    trainer = packed_trainers["eogym_varlen"]
    own = EOGymCollator(processor_at_cap, padding_free=True)
    batch = dict(own(_examples()))
    assert "host_layout" not in batch
    loss, grads, steps, _ = _train_micro_batch(trainer, batch)
    assert torch.isfinite(loss) and any(g.abs().sum() > 0 for g in grads) and steps[0, 1] > 0


def _cuda_syncs(trainer, batch) -> tuple[Counter, torch.Tensor, list]:
    """Host syncs of one micro-batch's loss and backward on CUDA, by kind (``set_sync_debug_mode("warn")`` warns at
    each), with the loss and the LoRA gradients."""
    import warnings

    batch = trainer._prepare_inputs(batch)
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            loss = trainer.compute_loss(trainer.model, batch, num_items_in_batch=torch.tensor(64, device="cuda"))
            grads = torch.autograd.grad(loss, params)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    counts = Counter(str(w.message).split(" ")[0] for w in caught if "synchroniz" in str(w.message))
    return counts, loss.detach(), grads


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("attention", ["eogym_varlen", "eogym_varlen_cudnn"])
def test_the_host_layout_on_a_gpu_syncs_less_and_changes_nothing(processor_at_cap, tmp_path, attention):
    """On CUDA (bf16, the recipe's attentions): a packed step through the trainer's DataLoader path (pinned, moved by
    ``_prepare_inputs``) with the layout has the same loss and LoRA gradients as without it, bit for bit, and fewer
    host syncs (``torch.cuda.set_sync_debug_mode("warn")``): none of the vision blocks' ``.tolist()``."""
    from datasets import Dataset
    from torch.utils.data._utils.pin_memory import pin_memory
    from trl import SFTConfig

    from eogym_sft.data.collator import EOGymCollator
    from eogym_sft.models.attention import add_sample_boundaries, register_varlen_attention
    from eogym_sft.models.host_layout import VisionGeometry
    from eogym_sft.models.loading import apply_lora
    from eogym_sft.models.tiny import DEMO_QWEN3_VL_CONFIG, build_tiny_model
    from eogym_sft.training.trainer import EOGymSFTTrainer

    register_varlen_attention()
    # the demo's width: flash and cuDNN take head dims that are multiples of 8, not the 16-wide model's 4
    model = build_tiny_model(seed=4, config=DEMO_QWEN3_VL_CONFIG, dtype="bfloat16", device="cuda")
    model.set_attn_implementation({"text_config": attention, "vision_config": "sdpa"})
    add_sample_boundaries(model)
    model = perturb_lora_b(apply_lora(model, dropout=0.0), seed=4)
    args = SFTConfig(output_dir=str(tmp_path), bf16=True, report_to="none", padding_free=True, remove_unused_columns=False,
                     dataset_kwargs={"skip_prepare_dataset": True})
    collator = EOGymCollator(processor_at_cap, padding_free=True, host_layout=True, vision=VisionGeometry.of(model), pixel_dtype=torch.bfloat16)
    trainer = EOGymSFTTrainer(model=model, args=args, data_collator=collator, train_dataset=Dataset.from_list([{"messages": "[]"}]),
                              processing_class=processor_at_cap)
    trainer.model.train()
    batch = pin_memory(collator(_examples() * 2))  # as the DataLoader hands it over
    assert batch["host_layout"].supervised.is_pinned() and batch["host_layout"].vision["interp_indices"].is_pinned()
    without = {k: v for k, v in batch.items() if k != "host_layout"}
    _cuda_syncs(trainer, dict(without))  # warm-up
    syncs_without, loss_without, grads_without = _cuda_syncs(trainer, dict(without))
    syncs_with, loss_with, grads_with = _cuda_syncs(trainer, dict(batch))
    assert torch.equal(loss_with, loss_without) and all(torch.equal(a, b) for a, b in zip(grads_with, grads_without))
    print(f"{attention}: host syncs without the layout {dict(syncs_without)}, with it {dict(syncs_with)}")
    assert sum(syncs_with.values()) + 2 * model.config.vision_config.depth <= sum(syncs_without.values())
