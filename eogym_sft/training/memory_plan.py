"""How a step's samples are grouped and whether layers are recomputed, chosen from the GPU's memory.

A step's loss is the token mean over all its samples, so how they are grouped into micro-batches does not
change the update; it changes the peak memory and the speed. The peak of a micro-batch is predicted by
:mod:`eogym_sft.models.memory`. The plan takes the fewest micro-batches a step whose largest micro-batch fits,
with no checkpointing if one fits, and layers recomputed only when none does (:func:`choose`). With a prepared
dataset the micro-batches are the ones :class:`TokenBalancedSampler` will deal, every step of every epoch; without
one, the worst case: every sample ``max_length`` tokens (:func:`worst_case_batches`).

Nothing here touches a GPU: ``eogym-sft plan`` runs it anywhere, and the recipe calls it with the free memory
it reads at start (:mod:`eogym_sft.training.memory_hook`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from ..models.memory import GIB, Calibration, MicroBatch, ModelShape, Setup, peak_terms

# The settings the plan chooses when they are not given (on the command line or in the config file).
PLANNED = ("per_device_train_batch_size", "gradient_accumulation_steps", "activation_checkpointing",
           "per_device_eval_batch_size")
# Samples an evaluation batch may hold, most first (evaluation is a forward without gradients: its batch
# changes no figure)
EVAL_BATCHES = (4, 2, 1)
# Activation checkpointing, least recompute first: off, every 2nd decoder layer, every layer.
CHECKPOINT_CHOICES = (0, 2, 1)


# Without data, the share of a sample's tokens taken as supervised: a sample is a conversation whose prompt (system,
# tool schemas, question, images) and tool results are never supervised. With data the plan reads each sample's count.
WORST_SUPERVISED_SHARE = 0.5


def worst_case_batches(samples: int, max_length: int, step_samples: int = 0) -> list[MicroBatch]:
    """Without data: ``samples`` samples of ``max_length`` tokens, each an image's and half of them supervised, in a
    step of ``step_samples`` samples on the process (0: the micro-batch alone)."""
    tokens = samples * max_length
    return [MicroBatch(tokens, int(tokens * WORST_SUPERVISED_SHARE), tokens, samples, step_samples * max_length)]


@dataclass
class Plan:
    """The chosen grouping and checkpointing, what it is predicted to take and what it was chosen against."""

    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    checkpoint_every: int
    micro_batch_tokens: int  # the largest micro-batch's tokens over the run
    predicted_peak_gib: float  # allocated, at that micro-batch
    predicted_reserved_gib: float
    budget_gib: float
    fits: bool
    terms_gib: dict = field(default_factory=dict)
    per_device_eval_batch_size: int | None = None  # chosen by :func:`choose_eval`
    predicted_eval_peak_gib: float | None = None

    @property
    def activation_checkpointing(self) -> bool:
        return self.checkpoint_every > 0

    def to_json(self) -> dict:
        return {**asdict(self), "activation_checkpointing": self.activation_checkpointing}


def batch_sizes(samples_per_step: int, processes: int) -> list[int]:
    """Samples a micro-batch that split a step evenly over the processes, largest first.

    Only exact divisors: the Trainer multiplies ``per_device_train_batch_size`` into the samples its sampler draws a
    step, into the total batch it logs and checkpoints, and into DeepSpeed's batch settings, so a grouping whose
    micro-batches hold a fractional number of samples on average would make those disagree with the step.

    >>> batch_sizes(64, 1)
    [64, 32, 16, 8, 4, 2, 1]
    >>> batch_sizes(64, 16)
    [4, 2, 1]
    """
    if samples_per_step % processes:
        raise ValueError(f"{samples_per_step} samples a step do not split over {processes} processes")
    per_process = samples_per_step // processes
    return [b for b in range(per_process, 0, -1) if per_process % b == 0]


def evaluate(shape: ModelShape, setup: Setup, batches: list[MicroBatch], cal: Calibration | None = None) -> dict:
    """The terms of the micro-batch with the largest predicted peak among ``batches``."""
    return max((peak_terms(shape, setup, b, cal) | {"tokens": b.tokens} for b in batches), key=lambda t: t["reserved"])


def choose(shape: ModelShape, setup: Setup, batches_for, budget_bytes: float, samples_per_step: int, *,
           batch_size: int | None = None, checkpoint_every: int | None = None, cal: Calibration | None = None) -> Plan:
    """The fastest plan that fits ``budget_bytes``: no checkpointing before any, then the most samples a
    micro-batch. ``batches_for(b)`` lists the micro-batches of b samples (on average) a process meets over the run.
    ``batch_size`` and ``checkpoint_every`` given are kept; when nothing fits, the plan returned is the
    smallest-peak one with ``fits`` false."""
    sizes = [batch_size] if batch_size else batch_sizes(samples_per_step, setup.processes)
    checkpoints = [checkpoint_every] if checkpoint_every is not None else list(CHECKPOINT_CHOICES)
    tried = []
    for every in checkpoints:
        for b in sizes:
            worst = evaluate(shape, Setup(setup.processes, setup.zero_stage, setup.lora_dropout, every),
                             batches_for(b), cal)
            plan = make_plan(b, samples_per_step // (b * setup.processes), every, worst, budget_bytes)
            if plan.fits:
                return plan
            tried.append((worst["reserved"], plan))
    return min(tried, key=lambda pair: pair[0])[1]


def choose_eval(plan: Plan, shape: ModelShape, setup: Setup, batches_for, budget_bytes: float,
                batch_size: int | None = None, cal: Calibration | None = None) -> Plan:
    """``plan`` with its evaluation batch: ``batch_size`` if given, else the most of :data:`EVAL_BATCHES` samples whose
    largest forward fits beside the training state (``batches_for(b)``: the evaluation batches of b samples). A
    given one that does not fit, or none, makes the plan not fit."""
    from ..models.memory import CALIBRATION, forward_bytes, static_terms

    cal = cal or CALIBRATION
    static = sum(static_terms(shape, setup, cal).values()) - cal.budget_margin_bytes  # forward_bytes adds the margin
    peak = 0.0
    for b in [batch_size] if batch_size else EVAL_BATCHES:
        peak = max(static + forward_bytes(batch, shape.vocab, shape.patches_per_token, cal, shape.widths)
                   for batch in batches_for(b))
        if peak * cal.reserved_over_allocated <= budget_bytes:
            break
    plan.per_device_eval_batch_size, plan.predicted_eval_peak_gib = b, round(peak / GIB, 2)
    plan.fits = plan.fits and peak * cal.reserved_over_allocated <= budget_bytes
    return plan


def eval_batches(tokens: list[int], supervised: list[int], images: list[int], b: int) -> list[MicroBatch]:
    """The evaluation batches of ``b`` consecutive samples (the evaluation loader's order; ranks take whole
    batches)."""
    starts = range(0, len(tokens), b)
    return [MicroBatch(sum(tokens[i:i + b]), sum(supervised[i:i + b]), sum(images[i:i + b]), len(tokens[i:i + b]))
            for i in starts]


def make_plan(batch: int, accumulation: int, every: int, worst: dict, budget_bytes: float) -> Plan:
    terms = {k: round(v / GIB, 3) for k, v in worst.items() if k != "tokens"}
    return Plan(
        per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation, checkpoint_every=every,
        micro_batch_tokens=worst["tokens"], predicted_peak_gib=round(worst["allocated"] / GIB, 2),
        predicted_reserved_gib=round(worst["reserved"] / GIB, 2), budget_gib=round(budget_bytes / GIB, 2),
        fits=worst["reserved"] <= budget_bytes, terms_gib=terms,
    )


def dealt_batches(lengths: list[int], supervised: list[int], images: list[int], samples_per_step: int, groups: int,
                  steps: int, seed: int, drop_last: bool = False, processes: int = 1) -> list[MicroBatch]:
    """Every distinct micro-batch :class:`TokenBalancedSampler` deals over ``steps`` optimizer steps, a step's
    samples in ``groups`` groups over all processes (the groups are the same however they are spread over ranks).
    A micro-batch's step image tokens are those of the step's largest ``groups / processes`` groups: the most any
    process can hold, however the groups are spread."""
    from .sampler import TokenBalancedSampler

    sampler = TokenBalancedSampler(lengths, samples_per_step, 1, groups, seed=seed, drop_last=drop_last)
    per_epoch = max(1, len(sampler) // groups)
    by_step: dict[int, list] = {}
    for epoch in range(math.ceil(steps / per_epoch)):
        sampler.set_epoch(epoch)
        for i, group in enumerate(sampler):
            if (epoch * per_epoch) + i // groups >= steps:
                break
            by_step.setdefault(epoch * per_epoch + i // groups, []).append(group)
    seen = set()
    for step_groups in by_step.values():
        sizes = [(sum(lengths[j] for j in g), sum(supervised[j] for j in g), sum(images[j] for j in g), len(g))
                 for g in step_groups]
        held = sum(sorted((s[2] for s in sizes), reverse=True)[:math.ceil(groups / processes)])
        seen.update(size + (held,) for size in sizes)
    return [MicroBatch(*sizes) for sizes in sorted(seen)]


def run_steps(n_samples: int, samples_per_step: int, max_steps: int, epochs: float, drop_last: bool = False) -> int:
    """Optimizer steps the run takes, as the Trainer counts them."""
    per_epoch = max(1, n_samples // samples_per_step + (0 if drop_last or n_samples % samples_per_step == 0 else 1))
    return max_steps if max_steps > 0 else math.ceil(epochs * per_epoch)


def ordinal(n: int) -> str:
    """``n`` as an ordinal word.

    >>> [ordinal(n) for n in (2, 3, 4, 11, 21)]
    ['2nd', '3rd', '4th', '11th', '21st']
    """
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def plan_line(plan: Plan, device: str, free_bytes: float, processes: int) -> str:
    """The one line the recipe prints at start."""
    micro = plan.gradient_accumulation_steps
    checkpointing = ("off" if not plan.checkpoint_every else
                     "every layer" if plan.checkpoint_every == 1 else f"every {ordinal(plan.checkpoint_every)} layer")
    return (
        f"memory plan: {device}, {free_bytes / GIB:.1f} GiB free, budget {plan.budget_gib:.1f} GiB: {micro} "
        f"micro-batches a step on each of {processes} process(es), {plan.per_device_train_batch_size} sample(s) each "
        f"(largest {plan.micro_batch_tokens:,} tokens), activation checkpointing {checkpointing}, predicted peak "
        f"{plan.predicted_peak_gib:.1f} GiB allocated, {plan.predicted_reserved_gib:.1f} GiB reserved"
        + (f"; evaluation batches of {plan.per_device_eval_batch_size} sample(s)"
           if plan.per_device_eval_batch_size else "")
    )
