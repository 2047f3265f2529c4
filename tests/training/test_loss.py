"""The SFT loss's one-softmax cross-entropy and entropy against torch's own functions."""

from __future__ import annotations

import pytest
import torch

from eogym_sft.training.loss import cross_entropy_with_entropy

IGNORE = -100


def _rows(seed: int = 0, rows: int = 7, vocab: int = 33, scale: float = 4.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * scale
    targets = torch.randint(0, vocab, (rows,), generator=g)
    targets[[1, 4]] = IGNORE
    return logits, targets


def test_loss_entropy_and_gradient_equal_torchs_in_float64():
    logits, targets = _rows()
    ours = logits.clone().requires_grad_()
    theirs = logits.clone().requires_grad_()
    loss, entropy, predicted = cross_entropy_with_entropy(ours, targets)
    want = torch.nn.functional.cross_entropy(theirs, targets, ignore_index=IGNORE, reduction="none")
    weights = torch.arange(1.0, 8.0, dtype=torch.float64)  # a gradient that differs by row
    (loss * weights).sum().backward()
    (want * weights).sum().backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=1e-12)
    log_p = logits.log_softmax(-1)
    torch.testing.assert_close(entropy, -(log_p.exp() * log_p).sum(-1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-12, atol=1e-12)
    assert loss[[1, 4]].tolist() == [0.0, 0.0] and ours.grad[[1, 4]].abs().sum() == 0  # ignored rows: no loss, no gradient
    assert torch.equal(predicted, logits.argmax(-1)) and not entropy.requires_grad and not predicted.requires_grad


def test_float32_with_large_logits_stays_within_rounding_of_torch():
    logits, targets = _rows(seed=1, rows=64, vocab=151936 // 64, scale=30.0)
    logits = logits.float()
    ours = logits.clone().requires_grad_()
    theirs = logits.clone().requires_grad_()
    loss, _, _ = cross_entropy_with_entropy(ours, targets)
    want = torch.nn.functional.cross_entropy(theirs, targets, ignore_index=IGNORE, reduction="none")
    loss.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-6)


def test_under_bf16_autocast_everything_stays_in_the_logits_precision():
    """The recipe trains under bf16 autocast, which would run the entropy's product in bf16 (0.05 off here)."""
    logits, targets = _rows(seed=2, rows=64, vocab=5000)
    logits = logits.float()
    loss, entropy, _ = cross_entropy_with_entropy(logits, targets)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_autocast, entropy_autocast, _ = cross_entropy_with_entropy(logits, targets)
    assert entropy_autocast.dtype == loss_autocast.dtype == torch.float32
    assert torch.equal(loss_autocast, loss) and torch.equal(entropy_autocast, entropy)


def test_no_grad_and_no_rows():
    logits, targets = _rows()
    with torch.no_grad():
        loss, entropy, _ = cross_entropy_with_entropy(logits, targets)
    assert loss.shape == entropy.shape == (7,) and not loss.requires_grad
    empty = torch.zeros(0, 33, requires_grad=True)
    loss, entropy, _ = cross_entropy_with_entropy(empty, torch.zeros(0, dtype=torch.long))
    loss.sum().backward()
    assert loss.shape == entropy.shape == (0,) and empty.grad.shape == (0, 33)


def test_a_second_backward_through_the_reused_softmax_is_refused():
    """The backward writes the gradient into the kept softmax: autograd's version check refuses a second one."""
    logits, targets = _rows()
    logits.requires_grad_()
    loss, _, _ = cross_entropy_with_entropy(logits, targets)
    loss.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.sum().backward()
