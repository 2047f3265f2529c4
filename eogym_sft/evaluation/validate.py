"""``eogym-sft validate``: loss and token accuracy of a base model and LoRA adapters on prepared data.

It runs the training forward pass: each batch's samples packed into one row (the collator's
``padding_free`` mode) through the recipe's variable-length attention (:mod:`eogym_sft.models.attention`),
with logits computed only at supervised positions (the LM head over a 151,936-token vocabulary is the
largest activation otherwise). Every figure is a token-weighted sum over the whole set, summed across
ranks before dividing; see :mod:`eogym_sft.metrics.token_accuracy`. Arms are chosen as for ``evaluate``
and ``rollout`` (the base unless ``--no-base``, then one per ``--adapter [NAME=]DIR``).
"""

from __future__ import annotations

import json
import time
from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import SampleConfig
from ..metrics.token_accuracy import IGNORE_INDEX, correct_predictions, token_classes

GROUP_FIELDS = ("EO_task", "question_type")


def _causal_lm(model):
    """The ``...ForConditionalGeneration`` module under a PEFT wrapper (LoRA layers are injected in it)."""
    from peft import PeftModel

    return model.get_base_model() if isinstance(model, PeftModel) else model


@torch.no_grad()
def supervised_scores(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per supervised target token: cross-entropy, correctness, and its ``(row, position)`` index."""
    lm = _causal_lm(model)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    hidden = lm.model(**inputs, use_cache=False).last_hidden_state[:, :-1]
    targets = batch["labels"][:, 1:]
    where = (targets != IGNORE_INDEX).nonzero()
    logits = lm.lm_head(hidden[where[:, 0], where[:, 1]]).float()
    goal = targets[where[:, 0], where[:, 1]]
    loss = torch.nn.functional.cross_entropy(logits, goal, reduction="none")
    return loss, correct_predictions(logits, goal), where


def sample_spans(batch: dict, samples: int, packed: bool) -> list[list[tuple[int, int]]]:
    """Per batch row, the ``(start, end)`` of each of its samples, in example order: one per row when
    padded, every sample of the one row when packed (where the text position restarts at 0)."""
    if not packed:
        return [[(0, batch["input_ids"].shape[1])] for _ in range(samples)]
    from ..models.attention import sample_boundaries

    cu = sample_boundaries(batch["position_ids"][0])[0].tolist()
    spans = list(zip(cu[:-1], cu[1:]))
    if len(spans) != samples:
        raise ValueError(f"a packed batch of {samples} samples shows {len(spans)} position restarts")
    return [spans]


def _accumulate(totals, keys, classes, spans, loss, correct, where) -> None:
    """Add each scored target to the groups of the sample it lies in (``spans`` from :func:`sample_spans`;
    ``keys`` and ``classes`` per sample, in the same order)."""
    firsts, offsets, k = [], [], 0
    for row in spans:
        firsts.append([start for start, _ in row])
        offsets.append(k)
        k += len(row)
    for (row, pos), l, c in zip(where.tolist(), loss.tolist(), correct.tolist()):
        target = pos + 1  # a packed sample's first token is never a target (the collator masks it)
        j = bisect_right(firsts[row], target) - 1
        sample = offsets[row] + j
        groups = ["overall", *keys[sample], f"token_class/{classes[sample][target - firsts[row][j]]}"]
        for g in groups:
            totals[g][0] += l
            totals[g][1] += c
            totals[g][2] += 1


def _merge_ranks(totals: dict) -> dict:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return totals
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, dict(totals))
    merged = defaultdict(lambda: [0.0, 0, 0])
    for part in gathered:
        for key, (l, c, n) in part.items():
            merged[key][0] += l
            merged[key][1] += c
            merged[key][2] += n
    return merged


def score_dataset(
    model, collator, dataset, batch_size: int = 8, device: str | torch.device = "cpu", progress: bool = True, skipped: list | None = None,
    label: str = "validate", stats: dict | None = None,
) -> dict:
    """``{group: {"loss", "token_accuracy", "tokens"}}`` for groups ``overall``, ``EO_task/...``,
    ``question_type/...`` and ``token_class/...``, token-weighted over the whole dataset.

    ``batch_size`` samples go through each forward, packed into one row when the collator is
    ``padding_free`` (the fast path; the model should run a variable-length attention), else padded.
    With a collator that skips bad images (``skip_bad_images=True``), the samples it skipped are
    appended to ``skipped`` (this rank's) and left out of every figure. ``stats``, when given, gets this
    rank's ``seconds`` and ``tokens`` (every token run through the model, context included)."""
    from tqdm.auto import tqdm

    rank, world = 0, 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    indices = list(range(rank, len(dataset), world))
    tokenizer = collator.processor.tokenizer
    totals = defaultdict(lambda: [0.0, 0, 0])
    start, tokens = time.perf_counter(), 0
    for first in tqdm(range(0, len(indices), batch_size), desc=label, disable=not progress):
        examples = [dataset[i] for i in indices[first : first + batch_size]]
        batch = collator(examples)
        left_out = batch.pop("skipped_samples", [])
        if skipped is not None:
            skipped.extend(left_out)
        examples = [ex for k, ex in enumerate(examples) if k not in {r["index"] for r in left_out}]
        if not examples:
            continue
        spans = sample_spans(batch, len(examples), collator.padding_free)
        keys = [[f"{f}/{ex.get(f) or 'unknown'}" for f in GROUP_FIELDS] for ex in examples]
        classes = [
            token_classes(batch["input_ids"][row, a:b].tolist(), (batch["labels"][row, a:b] != IGNORE_INDEX).tolist(), tokenizer)
            for row, row_spans in enumerate(spans) for a, b in row_spans
        ]
        tokens += int(batch["attention_mask"].sum()) if "attention_mask" in batch else batch["input_ids"].numel()
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        loss, correct, where = supervised_scores(model, batch)
        _accumulate(totals, keys, classes, spans, loss.cpu(), correct.cpu(), where.cpu())
    if stats is not None:
        stats.update(seconds=time.perf_counter() - start, tokens=tokens)
    merged = _merge_ranks(totals)
    return {
        key: {"loss": l / n, "token_accuracy": c / n, "tokens": n}
        for key, (l, c, n) in sorted(merged.items(), key=lambda kv: (kv[0] != "overall", kv[0]))
    }


def format_report(report: dict) -> str:
    """A table with one row per group and one column pair per model."""
    columns = list(report["models"])
    header = f"{'group':<44}" + "".join(f"{c + ' loss':>16}{c + ' acc':>14}" for c in columns) + f"{'tokens':>10}"
    lines = [header]
    first = report["models"][columns[0]]
    for group, row in first.items():
        cells = ""
        for c in columns:
            r = report["models"][c].get(group, {"loss": float("nan"), "token_accuracy": float("nan")})
            cells += f"{r['loss']:>16.4f}{r['token_accuracy']:>14.4f}"
        lines.append(f"{group[:44]:<44}{cells}{row['tokens']:>10}")
    return "\n".join(lines)


@dataclass(kw_only=True)
class ValidateConfig(SampleConfig):
    """Settings of ``eogym-sft validate``."""

    model: str  # base model: hub id or local folder
    data: str  # prepared folder, or EO-Gym JSONL (prepared on the way in)
    output: str  # report.json to write
    adapters: list[str] = field(default_factory=list)  # "DIR" or "NAME=DIR", one arm each
    include_base: bool = True  # score the base model (every adapter off) as an arm
    data_root: str = "."
    batch_size: int = 8  # samples packed into one forward
    num_proc: int = 1  # data-prep workers when data is JSONL
    device: str = "auto"
    dtype: str = "auto"  # bf16 on GPU, fp32 on CPU
    # The text tower's attention: the recipe's variable-length kernels (default: eogym_varlen_cudnn on
    # CUDA, eogym_varlen elsewhere), or sdpa.
    attn_implementation: str | None = None
    allow_other_base: bool = False  # use an adapter whose adapter_config.json names another base
    overwrite: bool = False  # replace an existing report
    # Score only the traces a training run held out: its eval_fraction and seed (split_by_trace).
    held_out_fraction: float | None = None
    seed: int = 42

    def __post_init__(self):
        super().__post_init__()
        if not self.include_base and not self.adapters:
            raise ValueError("nothing to score: no base arm and no adapters")
        if self.batch_size < 1:
            raise ValueError("batch_size must be at least 1")


def default_attention(device) -> str:
    """The recipe's text attention where it runs: cuDNN's varlen kernels on CUDA, the reference elsewhere."""
    from ..models.attention import CUDNN_NAME, NAME

    return CUDNN_NAME if torch.device(device).type == "cuda" else NAME


def validate(cfg: ValidateConfig) -> dict:
    """Score every arm on ``cfg.data``; write and return the report."""
    from ..data.datasets import load_or_prepare, split_by_trace
    from ..data.prepare import PrepConfig
    from ..guards import refuse_nonempty_output
    from ..models.loading import (
        load_inference_model,
        parse_arms,
        resolve_device,
        use_arm,
    )
    from ..models.processor import load_processor
    from ..training.collator import EOGymCollator

    refuse_nonempty_output(cfg.output, cfg.overwrite, "eogym-sft validate")
    arms = parse_arms(cfg.adapters, cfg.model, cfg.include_base, cfg.allow_other_base)
    device, dtype = resolve_device(cfg.device, cfg.dtype)
    attention = cfg.attn_implementation or default_attention(device)
    processor = load_processor(cfg.model, cfg.max_pixels, cfg.min_pixels)
    workdir = Path(cfg.output).with_suffix("").as_posix() + "_prepared"
    dataset, _ = load_or_prepare(cfg.data, cfg.model, processor, PrepConfig(max_length=cfg.max_length, data_root=cfg.data_root), workdir, cfg.num_proc)
    if cfg.held_out_fraction:
        dataset = split_by_trace(dataset, cfg.held_out_fraction, cfg.seed)[1]
    model = load_inference_model(cfg.model, arms, device, dtype, attn_implementation=attention)
    collator = EOGymCollator(
        processor, max_length=cfg.max_length, data_root=cfg.data_root, padding_free=attention != "sdpa", skip_bad_images=True, pixel_dtype=dtype,
    )
    models, timing, skipped = {}, {}, []
    for k, arm in enumerate(arms):
        stats = {}
        with use_arm(model, arm):
            models[arm.name] = score_dataset(
                model, collator, dataset, cfg.batch_size, device, skipped=skipped if k == 0 else None, label=f"validate {arm.name}", stats=stats,
            )
        timing[arm.name] = {**stats, "tokens_per_s": stats["tokens"] / stats["seconds"] if stats["seconds"] else None}
    report = {
        "model": cfg.model, "adapters": {a.name: a.adapter for a in arms if a.adapter}, "data": cfg.data,
        "held_out_fraction": cfg.held_out_fraction, "samples": len(dataset), "samples_skipped": len(skipped), "skipped": skipped,
        "attn_implementation": attention, "batch_size": cfg.batch_size, "device": str(device), "dtype": str(dtype).replace("torch.", ""),
        "models": models, "timing": timing,
    }
    Path(cfg.output).parent.mkdir(parents=True, exist_ok=True)
    Path(cfg.output).write_text(json.dumps(report, indent=2) + "\n")
    print(format_report(report))
    for record in skipped:
        print(f"skipped sample {record['sample_id']} ({record['reason']}): {record['file']}")
    for name, scores in models.items():
        print(f"token accuracy ({name}): {scores['overall']['token_accuracy']:.4f}  ({timing[name]['tokens_per_s']:.0f} tokens/s)")
    print(f"report: {cfg.output}")
    return report

