"""TRL's ``SFTTrainer`` with a loss that runs the LM head only where there is something to learn.

Only about one token in six of an EO-Gym sample is supervised, and the LM head (151,936 outputs) is the
largest single activation of the step. The model is asked for logits only at the positions whose
next-token label is set (``logits_to_keep``), through the wrapped model's own forward so that DDP and
DeepSpeed hooks still run. The loss is the same token-mean cross-entropy as the full-logits path.

It also logs ``token_accuracy``: correct over total supervised tokens summed across the logging
window (or the whole evaluation set) and across ranks, next to TRL's step-averaged
``mean_token_accuracy``.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from trl import SFTTrainer

from .metrics import IGNORE_INDEX


class EOGymSFTTrainer(SFTTrainer):
    """``SFTTrainer`` with a supervised-positions-only LM head and token-weighted accuracy."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._token_counts = defaultdict(lambda: torch.zeros(2, dtype=torch.long))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if self.model.training else "eval"
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        targets = labels[:, 1:]
        keep = (targets != IGNORE_INDEX).any(0).nonzero().flatten()
        outputs = model(**inputs, use_cache=False, logits_to_keep=keep)
        logits = outputs.logits.float()
        picked = targets[:, keep]
        per_token = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), picked, ignore_index=IGNORE_INDEX, reduction="none"
        )
        valid = picked != IGNORE_INDEX
        denominator = num_items_in_batch if num_items_in_batch is not None else valid.sum()
        loss = per_token.sum() / torch.as_tensor(denominator, device=per_token.device).clamp(min=1)
        # As in Trainer: num_items_in_batch counts every rank's tokens and DDP averages the gradients.
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * self.accelerator.num_processes
        self._record(mode, logits.detach(), picked, valid, inputs, keep)
        return (loss, outputs) if return_outputs else loss

    @torch.no_grad()
    def _record(self, mode, logits, picked, valid, inputs, keep) -> None:
        right = (logits.argmax(-1) == picked) & valid
        sample, n_samples = _sample_index(inputs, keep, picked.shape)
        flat = sample.flatten()
        per_sample = torch.zeros(n_samples, 2, dtype=torch.long, device=flat.device)
        per_sample[:, 0].index_add_(0, flat, right.flatten().long())
        per_sample[:, 1].index_add_(0, flat, valid.flatten().long())
        # One row per sample, so that on the last batch gather_for_metrics drops exactly the samples accelerate
        # repeated to even out the ranks (a row per rank would drop whole ranks, or count the repeats).
        per_sample = self.accelerator.pad_across_processes(per_sample, dim=0)
        counts = self.accelerator.gather_for_metrics(per_sample).sum(0).cpu()
        self._token_counts[mode] += counts
        step_accuracy = (counts[0] / counts[1]).item() if counts[1] > 0 else 0.0
        self._metrics[mode]["mean_token_accuracy"].append(step_accuracy)
        if mode == "train":
            if "attention_mask" in inputs:
                local = inputs["attention_mask"].sum()
            else:
                local = torch.tensor(inputs["input_ids"].numel(), device=inputs["input_ids"].device)
            self._total_train_tokens += self.accelerator.gather(local[None]).sum().item()  # repeats are trained on too
            self._metrics[mode]["num_tokens"] = [self._total_train_tokens]

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def log(self, logs: dict, start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        correct, total = self._token_counts.pop(mode, torch.zeros(2, dtype=torch.long)).tolist()
        if total:
            logs[("eval_" if mode == "eval" else "") + "token_accuracy"] = correct / total
        super().log(logs, start_time)


def _sample_index(inputs, keep: torch.Tensor, shape) -> tuple[torch.Tensor, int]:
    """The sample (within the batch) of every kept position: its row, or its segment of a packed row."""
    position_ids = inputs.get("position_ids")
    if "attention_mask" not in inputs and position_ids is not None and position_ids.dim() == 3 and shape[0] == 1:
        segment = (position_ids[0, 0] == 0).long().cumsum(0) - 1  # a packed sample starts at text position 0
        return segment[keep][None], int(segment[-1]) + 1
    return torch.arange(shape[0], device=keep.device)[:, None].expand(shape), shape[0]
