"""The SFT loss: next-token cross-entropy and the logged entropy from one softmax over the vocabulary."""

from __future__ import annotations

import torch

from ..metrics.token_accuracy import IGNORE_INDEX

PROFILER_RANGE = "eogym::cross_entropy"  # the loss's ops, named in a torch.profiler trace


class CrossEntropyWithEntropy(torch.autograd.Function):
    """Per row of ``logits [N, V]``: the cross-entropy against ``targets`` (0 where ``ignore_index``), the
    entropy of the row's softmax and its argmax (neither with a gradient; the argmax is the max the softmax
    needs anyway, and token accuracy reads it).

    One softmax, where ``log_softmax`` + ``nll_loss`` and a separate entropy take three exponentials per
    logit (the entropy's, and ``log_softmax``'s backward's): the softmax is kept, the log-normalizer is
    ``max - log(softmax[argmax])`` (``softmax[argmax]`` is ``1 / sum(exp(logits - max))``), the entropy
    ``log_normalizer - softmax . logits``, and the backward ``(softmax - one_hot) * grad``, written into the
    kept softmax. No vocabulary-wide temporary besides the softmax: half the peak memory of the three-pass
    path, and faster on a GPU and a CPU with the argmax (docs/benchmarks.md).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int):
        # In the logits' precision: under bf16 autocast (the recipe's) the entropy's bmm would run in bf16
        with torch.autocast(logits.device.type, enabled=False):
            return CrossEntropyWithEntropy._forward(ctx, logits, targets, ignore_index)

    @staticmethod
    def _forward(ctx, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int):
        peak, top = logits.max(-1, keepdim=True)
        probs = torch.softmax(logits, -1)
        log_normalizer = (peak - probs.gather(-1, top).log()).squeeze(-1)
        entropy = log_normalizer - torch.bmm(probs.unsqueeze(1), logits.unsqueeze(2)).view(-1)
        valid = targets != ignore_index
        index = targets.masked_fill(~valid, 0)
        loss = (log_normalizer - logits.gather(-1, index[:, None]).squeeze(-1)).masked_fill_(~valid, 0.0)
        ctx.save_for_backward(probs, index, valid)
        top = top.squeeze(-1)
        ctx.mark_non_differentiable(entropy, top)
        return loss, entropy, top

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _grad_entropy, _grad_top):
        probs, index, valid = ctx.saved_tensors
        grad = (grad_loss * valid)[:, None]
        grad_logits = probs.mul_(grad)
        grad_logits.scatter_add_(-1, index[:, None], -grad)
        return grad_logits, None, None


def cross_entropy_with_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX):
    """``(loss, entropy, argmax)`` per row of ``logits [N, V]`` (see :class:`CrossEntropyWithEntropy`): the loss
    equals ``cross_entropy(logits, targets, ignore_index=ignore_index, reduction="none")`` and its gradient."""
    with torch.profiler.record_function(PROFILER_RANGE):
        return CrossEntropyWithEntropy.apply(logits, targets, ignore_index)
