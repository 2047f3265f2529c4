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
        self._record(mode, logits.detach(), picked, valid, inputs)
        return (loss, outputs) if return_outputs else loss

    @torch.no_grad()
    def _record(self, mode, logits, picked, valid, inputs) -> None:
        correct = ((logits.argmax(-1) == picked) & valid).sum()
        counts = self.accelerator.gather_for_metrics(torch.stack([correct, valid.sum()])[None]).sum(0).cpu()
        self._token_counts[mode] += counts
        step_accuracy = (counts[0] / counts[1]).item() if counts[1] > 0 else 0.0
        self._metrics[mode]["mean_token_accuracy"].append(step_accuracy)
        if mode == "train":
            if "attention_mask" in inputs:
                local = inputs["attention_mask"].sum()
            else:
                local = torch.tensor(inputs["input_ids"].numel(), device=inputs["input_ids"].device)
            self._total_train_tokens += self.accelerator.gather_for_metrics(local[None]).sum().item()
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
