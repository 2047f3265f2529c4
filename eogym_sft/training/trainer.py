"""TRL's ``SFTTrainer`` with a loss that runs the LM head only where there is something to learn.

Only about one token in six of an EO-Gym sample is supervised, and the LM head (151,936 outputs) is the
largest single activation of the step. The model is asked for logits only at the positions whose
next-token label is set (``logits_to_keep``), through the wrapped model's own forward so that DDP and
DeepSpeed hooks still run. The loss is the same token-mean cross-entropy as the full-logits path.

TRL's loss settings keep working: ``loss_type="dft"`` weights each token's loss by its probability,
as TRL does; ``compute_loss_func`` and ``label_smoothing_factor`` need the full logits, so with either
set the loss is TRL's own ``SFTTrainer.compute_loss`` (its metrics only). Tests pin the loss and the
entropy to TRL's fused LM head path on the same batch.

It also logs ``token_accuracy``: correct over total supervised tokens summed across the logging
window (or the whole evaluation set) and across ranks, next to TRL's step-averaged
``mean_token_accuracy``, and ``entropy``, the mean entropy of the predicted next-token distribution
over the same tokens (token-weighted; TRL's is a mean of micro-batch means). Training counts stay on
the GPU until a log, so no step waits on the host.

With ``train_sampling_strategy="batch_rebalance"`` the micro-batches are built to a token budget
(:class:`~eogym_sft.training.sampler.TokenBalancedSampler`). Unless ``dataloader_prefetch_factor`` is set, the
workers keep a whole optimizer step of micro-batches in flight (see ``__init__``). ``padding_free=True`` in
the ``SFTConfig`` trains on packed batches; the collator must pack (``EOGymCollator(padding_free=True)``).

Samples that the collator skipped (``EOGymCollator(skip_bad_images=True)``: an image file that changed
after prep) are logged as a warning by sample id and file when they happen, counted in the logs
(``skipped_samples``, ``eval_skipped_samples``: checkpointed with the log history, so a resumed run
keeps the count) and listed in ``<output_dir>/skipped_samples.jsonl``.

A batch with a ``host_layout`` (``EOGymCollator(host_layout=True)``, :mod:`eogym_sft.models.host_layout`) gives the
forward what it would otherwise read back from the GPU: the supervised positions, the text tower's packed-sequence
arguments, the images' grid on the host and, by a vision-tower pre-hook for the one call, the tower's metadata. The
step computes the same values bit for bit with fewer host syncs; a batch without it takes the old path.

When ``train`` returns, the workers of persistent-worker DataLoaders are stopped (:func:`stop_dataloader_workers`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers.trainer_pt_utils import BatchRebalanceSampler
from trl import SFTTrainer

from ..guards import GPUOutOfMemory
from ..metrics.token_accuracy import IGNORE_INDEX, correct_argmax
from ..models.attention import packed_arguments
from ..models.host_layout import HostLayout, supervised_positions
from ..models.vision_blocks import vision_tower
from .loss import cross_entropy_with_entropy
from .memory_hook import out_of_memory_message
from .sampler import TokenBalancedSampler

logger = logging.getLogger(__name__)
SKIPPED_FILE = "skipped_samples.jsonl"
SHARED_MEMORY_FLOOR = 1 << 30  # below this, a container's /dev/shm (Docker's default: 64 MB) cannot hold a few batches


def warn_on_small_shared_memory(workers: int, path: str = "/dev/shm") -> bool:
    """Warn (and return ``True``) when DataLoader workers would hand batches over through a ``path`` under 1 GiB:
    a worker that runs out of it dies with a bus error, in the middle of a run."""
    if workers == 0 or not os.path.isdir(path):
        return False
    total = shutil.disk_usage(path).total
    if total >= SHARED_MEMORY_FLOOR:
        return False
    logger.warning(
        "%s holds %d MiB: the DataLoader's %d workers hand each batch (its pixel_values alone tens of MB) to the "
        "training process through it, and a worker that runs out dies with a bus error. Give the container more "
        "(docker run --shm-size=8g, or --ipc=host) or set dataloader_num_workers 0.", path, total >> 20, workers,
    )
    return True


class EOGymSFTTrainer(SFTTrainer):
    """``SFTTrainer`` with a supervised-positions-only LM head and token-weighted accuracy."""

    def __init__(self, model=None, args=None, data_collator=None, **kwargs):
        padding_free = bool(args is not None and args.padding_free)
        if padding_free and not getattr(data_collator, "padding_free", False):
            raise ValueError("padding_free=True needs a collator that packs the batch: "
                             "EOGymCollator(padding_free=True)")
        # TRL refuses padding_free on image data because its own collator cannot pack images; ours does, so
        # TRL is shown padding_free=False while it sets up (tests/training/test_trainer.py pins that refusal).
        if padding_free:
            args.padding_free = False
        try:
            super().__init__(model=model, args=args, data_collator=data_collator, **kwargs)
        finally:
            if padding_free:
                args.padding_free = True
        warn_on_small_shared_memory(self.args.dataloader_num_workers)
        if self.args.dataloader_num_workers > 0 and self.args.dataloader_prefetch_factor is None:
            # The Trainer draws all of a step's micro-batches before it runs the first (get_batch_samples);
            # with torch's 2 batches a worker the rest are collated (images decoded, resized) while the GPU waits.
            workers, accumulation = self.args.dataloader_num_workers, self.args.gradient_accumulation_steps
            self.args.dataloader_prefetch_factor = max(2, math.ceil(accumulation / workers))
        self._token_counts = defaultdict(lambda: torch.zeros(2, dtype=torch.long))
        self._train_steps: list[torch.Tensor] = []  # per micro-batch [correct, supervised, tokens], on device
        self._train_entropy: list[torch.Tensor] = []  # per micro-batch entropy sum, on device
        self._entropy_sums: dict[str, float] = defaultdict(float)
        self._skipped: list[dict] = []  # this rank's skipped samples since the last log
        self._flops_per_token: int | None = None

    def floating_point_ops(self, inputs) -> int:
        """Trainer's estimate (6 x input tokens x parameters less embeddings), its parameter count taken once: the
        Trainer asks after every micro-batch, and counting walks the whole model: host time between micro-batches
        (docs/benchmarks.md, "Levers tried")."""
        if self._flops_per_token is None:
            counted = hasattr(self.model, "num_parameters")
            self._flops_per_token = 6 * self.model.num_parameters(exclude_embeddings=True) if counted else 0
        main_input = getattr(self.model, "main_input_name", "input_ids")
        return self._flops_per_token * inputs[main_input].numel() if main_input in inputs else 0

    def _get_train_sampler(self, train_dataset=None):
        sampler = super()._get_train_sampler(train_dataset)
        if isinstance(sampler, BatchRebalanceSampler):
            sampler = TokenBalancedSampler(
                sampler.lengths, sampler.effective_batch_size, sampler.dp_size, sampler.grad_accum,
                seed=self.args.seed, rank=sampler.rank, drop_last=sampler.drop_last,
            )
        return sampler

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if self.model.training else "eval"
        inputs = dict(inputs)
        self._note_skipped(inputs.pop("skipped_samples", None) or [], mode)
        layout = inputs.pop("host_layout", None)
        if self.compute_loss_func is not None or self.label_smoother is not None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)  # both need full logits
        labels = inputs.pop("labels")
        targets = labels[:, 1:]
        if layout is None:
            keep = supervised_positions(labels, IGNORE_INDEX)  # a host sync
            outputs = model(**inputs, use_cache=False, logits_to_keep=keep)
        else:
            keep = layout.supervised.to(labels.device, non_blocking=True)
            with self._fed_vision_tower(layout):
                outputs = model(**{**inputs, **self._layout_inputs(layout, inputs)}, use_cache=False,
                                logits_to_keep=keep)
        logits = outputs.logits.float()
        picked = targets[:, keep]
        # One softmax gives the loss, the logged entropy and the argmax accuracy counts (training/loss.py). Flat
        # [positions, vocab]: a softmax over a transposed (strided) vocab dim is several times slower.
        per_token, entropy, predicted = (
            t.view(picked.shape) for t in cross_entropy_with_entropy(logits.flatten(0, 1), picked.flatten())
        )
        # TRL's dynamic fine-tuning: each token's loss times its (constant) probability
        if self.args.loss_type == "dft":
            per_token = per_token * torch.exp(-per_token).detach()
        valid = picked != IGNORE_INDEX
        denominator = num_items_in_batch if num_items_in_batch is not None else valid.sum()
        loss = per_token.sum() / torch.as_tensor(denominator, device=per_token.device).clamp(min=1)
        # As in Trainer: num_items_in_batch counts every rank's tokens and DDP averages the gradients.
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * self.accelerator.num_processes
        with torch.no_grad():
            right = correct_argmax(predicted, picked)
            entropy = entropy * valid
            if mode == "train":
                self._train_steps.append(torch.stack([right.sum(), valid.sum(), _real_tokens(inputs)]))
                self._train_entropy.append(entropy.sum())
            else:
                self._record_eval(right, valid, inputs, keep, entropy)
        return (loss, outputs) if return_outputs else loss

    def _layout_inputs(self, layout: HostLayout, inputs: dict) -> dict:
        """The text tower's packed-sequence arguments, and the images' grid on the host when the vision tower gets
        its metadata from the layout (then nothing of the model reads the grid on the device)."""
        text_config = self.model.config.get_text_config()
        ids = inputs["input_ids"]
        extra = packed_arguments(layout.cu_seq_lens, layout.max_length, text_config._attn_implementation, ids.shape[0],
                                 ids.device)
        if layout.vision is not None and "image_grid_thw" in inputs and self._tower() is not None:
            extra["image_grid_thw"] = layout.image_grid_thw
        return extra

    def _tower(self):
        if not hasattr(self, "_vision_tower"):
            self._vision_tower = vision_tower(self.model)  # looked up once: walking the model costs host time
        return self._vision_tower

    @contextmanager
    def _fed_vision_tower(self, layout: HostLayout):
        """For one forward, a pre-hook on the vision tower adds the layout's metadata under the keywords that
        transformers' ``vision_utils`` helpers take precomputed (``cu_seqlens``, ``max_seqlen``, ``position_ids``,
        ``interp_indices``, ``interp_weights``; :meth:`HostLayout.vision_keywords`), when the tower is called with the
        layout's grid."""
        if layout.vision is None:
            yield
            return
        tower = self._tower()

        def add(module, args, kwargs):
            grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
            if grid is not layout.image_grid_thw:
                return None
            return args, {**kwargs,
                          **layout.vision_keywords(module.pos_embed.weight.device, module.config._attn_implementation)}

        handle = tower.register_forward_pre_hook(add, with_kwargs=True) if tower is not None else None
        try:
            yield
        finally:
            if handle is not None:
                handle.remove()

    def _note_skipped(self, records: list[dict], mode: str) -> None:
        for record in records:
            logger.warning("skipped sample %s (%s): %s: %s", record["sample_id"], record["reason"], record["file"],
                           record["detail"])
            self._skipped.append({**record, "mode": mode, "step": self.state.global_step})

    def _flush_skipped(self, mode: str) -> int:
        """Gather every rank's skipped samples of ``mode``; the main process appends them to the run's list."""
        from accelerate.utils import gather_object

        mine = [r for r in self._skipped if r["mode"] == mode]
        self._skipped = [r for r in self._skipped if r["mode"] != mode]
        everyone = gather_object(mine) if self.accelerator.num_processes > 1 else mine
        if everyone and self.accelerator.is_main_process:
            Path(self.args.output_dir).mkdir(parents=True, exist_ok=True)
            with open(Path(self.args.output_dir) / SKIPPED_FILE, "a") as fh:
                fh.writelines(json.dumps(r) + "\n" for r in everyone)
        return len(everyone)

    def _record_eval(self, right, valid, inputs, keep, entropy) -> None:
        sample, n_samples = _sample_index(inputs, keep, right.shape)
        flat = sample.flatten()
        per_sample = torch.zeros(n_samples, 2, dtype=torch.long, device=flat.device)
        per_sample[:, 0].index_add_(0, flat, right.flatten().long())
        per_sample[:, 1].index_add_(0, flat, valid.flatten().long())
        entropy_sums = torch.zeros(n_samples, dtype=torch.float64, device=flat.device).index_add_(
            0, flat, entropy.flatten().double()
        )
        entropy_sums = self.accelerator.pad_across_processes(entropy_sums, dim=0)
        self._entropy_sums["eval"] += self.accelerator.gather_for_metrics(entropy_sums).sum().item()
        # One row per sample, so that on the last batch gather_for_metrics drops exactly the samples accelerate
        # repeated to even out the ranks (a row per rank would drop whole ranks, or count the repeats).
        per_sample = self.accelerator.pad_across_processes(per_sample, dim=0)
        counts = self.accelerator.gather_for_metrics(per_sample).sum(0).cpu()
        self._token_counts["eval"] += counts
        step_accuracy = (counts[0] / counts[1]).item() if counts[1] > 0 else 0.0
        self._metrics["eval"]["mean_token_accuracy"].append(step_accuracy)

    def _flush_train_counts(self) -> None:
        """Sum the window's micro-batch counts across ranks (one host sync a log) into TRL's metrics."""
        if not self._train_steps:
            return
        steps = self.accelerator.reduce(torch.stack(self._train_steps), reduction="sum").cpu()
        self._train_steps = []
        self._entropy_sums["train"] += self.accelerator.reduce(
            torch.stack(self._train_entropy).sum(), reduction="sum"
        ).item()
        self._train_entropy = []
        self._token_counts["train"] += steps[:, :2].sum(0)
        self._metrics["train"]["mean_token_accuracy"].extend((steps[:, 0] / steps[:, 1].clamp(min=1)).tolist())
        self._total_train_tokens += int(steps[:, 2].sum())  # samples repeated to even out ranks are trained on too
        self._metrics["train"]["num_tokens"] = [self._total_train_tokens]

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def log(self, logs: dict, start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        if mode == "train":
            self._flush_train_counts()
        correct, total = self._token_counts.pop(mode, torch.zeros(2, dtype=torch.long)).tolist()
        entropy_sum = self._entropy_sums.pop(mode, 0.0)
        prefix = "eval_" if mode == "eval" else ""
        if total:
            logs[prefix + "token_accuracy"] = correct / total
            logs[prefix + "entropy"] = entropy_sum / total
        logs.update(self._flush_all_skipped())  # both modes: a sample skipped in either is counted at the next log
        super().log(logs, start_time)

    def _flush_all_skipped(self) -> dict:
        counts = {"skipped_samples": self._flush_skipped("train"), "eval_skipped_samples": self._flush_skipped("eval")}
        return {key: n for key, n in counts.items() if n}

    def train(self, *args, **kwargs):
        """Trainer's ``train``; samples skipped after the last log are counted in the log history too, so that
        ``eogym_run.json`` and ``skipped_samples.jsonl`` agree with what was skipped. Persistent DataLoader
        workers are stopped before it returns (:func:`stop_dataloader_workers`). A CUDA out-of-memory error is
        raised again as :class:`~eogym_sft.guards.GPUOutOfMemory`, one line naming the setting to lower."""
        try:
            output = super().train(*args, **kwargs)
        except torch.OutOfMemoryError as err:
            raise GPUOutOfMemory(out_of_memory_message(self.args, self.state.global_step)) from err
        finally:
            stop_dataloader_workers(self)
        leftover = self._flush_all_skipped()
        if leftover:
            self.state.log_history.append({**leftover, "step": self.state.global_step})
        return output


def stop_dataloader_workers(trainer) -> int:
    """Stop the worker processes of ``trainer``'s persistent-worker DataLoaders (the training loader and the
    evaluation loaders the Trainer caches) now; returns how many loaders had workers. A later ``iter()`` on
    one starts new workers.

    Why: with ``dataloader_persistent_workers`` (the recipe's setting) the loaders stay referenced from a
    reference cycle (trainer, accelerator, callbacks), so the cycle collector frees them at some later
    allocation. It runs the queues' finalizers before the iterator's shutdown, the stop signal never reaches
    the workers, and torch waits 5 s for each before killing it: 40 s for the recipe's 8 workers, in whatever
    runs next (pytorch/pytorch#81794; torch has no public way to stop them, pytorch/pytorch#64766). Stopped
    here, while the queues are whole, the workers exit at once."""
    loaders = [trainer.callback_handler.train_dataloader, *getattr(trainer, "_eval_dataloaders", {}).values()]
    stopped = 0
    for loader in loaders:
        loader = getattr(loader, "base_dataloader", loader)  # accelerate's wrapper iterates the DataLoader it holds
        iterator = getattr(loader, "_iterator", None)  # only persistent-worker loaders keep theirs
        if iterator is None or not hasattr(iterator, "_shutdown_workers"):
            continue
        loader._iterator = None
        iterator._shutdown_workers()
        stopped += 1
    return stopped


def skipped_counts(log_history: list[dict]) -> dict:
    """Samples skipped over a run, from its (checkpointed) log history: ``{"train": n, "eval": n}``."""
    return {
        "train": sum(h.get("skipped_samples", 0) for h in log_history),
        "eval": sum(h.get("eval_skipped_samples", 0) for h in log_history),
    }


def _real_tokens(inputs) -> torch.Tensor:
    if "attention_mask" in inputs:
        return inputs["attention_mask"].sum()
    return torch.tensor(inputs["input_ids"].numel(), device=inputs["input_ids"].device)


def _sample_index(inputs, keep: torch.Tensor, shape) -> tuple[torch.Tensor, int]:
    """The sample (within the batch) of every kept position: its row, or its segment of a packed row."""
    position_ids = inputs.get("position_ids")
    if "attention_mask" not in inputs and position_ids is not None and position_ids.dim() == 3 and shape[0] == 1:
        segment = (position_ids[0, 0] == 0).long().cumsum(0) - 1  # a packed sample starts at text position 0
        return segment[keep][None], int(segment[-1]) + 1
    return torch.arange(shape[0], device=keep.device)[:, None].expand(shape), shape[0]
