"""``eogym-sft validate``: loss and token accuracy of an adapter (and optionally its base) on prepared data.

Logits are computed only at supervised positions (the LM head over a 151,936-token vocabulary is the
largest activation otherwise). Every figure is a token-weighted sum over the whole set, summed across
ranks before dividing; see :mod:`eogym_sft.metrics.token_accuracy`.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
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


def _accumulate(totals, keys_per_row, classes_per_row, loss, correct, where) -> None:
    for (row, pos), l, c in zip(where.tolist(), loss.tolist(), correct.tolist()):
        groups = ["overall", *keys_per_row[row], f"token_class/{classes_per_row[row][pos + 1]}"]
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
    model, collator, dataset, batch_size: int = 4, device: str | torch.device = "cpu", progress: bool = True, skipped: list | None = None,
    label: str = "validate",
) -> dict:
    """``{group: {"loss", "token_accuracy", "tokens"}}`` for groups ``overall``, ``EO_task/...``,
    ``question_type/...`` and ``token_class/...``, token-weighted over the whole dataset.

    With a collator that skips bad images (``skip_bad_images=True``), the samples it skipped are
    appended to ``skipped`` (this rank's) and left out of every figure."""
    from tqdm.auto import tqdm

    if collator.padding_free:
        raise ValueError("score_dataset needs a padded collator (padding_free=False): it groups scores by batch row")

    rank, world = 0, 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    indices = list(range(rank, len(dataset), world))
    tokenizer = collator.processor.tokenizer
    totals = defaultdict(lambda: [0.0, 0, 0])
    for start in tqdm(range(0, len(indices), batch_size), desc=label, disable=not progress):
        examples = [dataset[i] for i in indices[start : start + batch_size]]
        batch = collator(examples)
        left_out = batch.pop("skipped_samples", [])
        if skipped is not None:
            skipped.extend(left_out)
        examples = [ex for k, ex in enumerate(examples) if k not in {r["index"] for r in left_out}]
        if not examples:
            continue
        keys = [[f"{f}/{ex.get(f) or 'unknown'}" for f in GROUP_FIELDS] for ex in examples]
        classes = [
            token_classes(batch["input_ids"][b].tolist(), (batch["labels"][b] != IGNORE_INDEX).tolist(), tokenizer)
            for b in range(len(examples))
        ]
        batch = {k: v.to(device) for k, v in batch.items()}
        loss, correct, where = supervised_scores(model, batch)
        _accumulate(totals, keys, classes, loss.cpu(), correct.cpu(), where.cpu())
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
    adapter: str | None = None  # PEFT adapter folder; None scores the base model alone
    data_root: str = "."
    with_base: bool = False  # also score the base model, as a second column
    batch_size: int = 4
    num_proc: int = 1  # data-prep workers when data is JSONL
    dtype: str | None = None  # default: bfloat16 on GPU, float32 on CPU
    allow_other_base: bool = False  # use an adapter whose adapter_config.json names another base
    overwrite: bool = False  # replace an existing report
    # Score only the traces a training run held out: its eval_fraction and seed (split_by_trace).
    held_out_fraction: float | None = None
    seed: int = 42


def validate(cfg: ValidateConfig) -> dict:
    """Score ``cfg.adapter`` (and with ``with_base`` its base) on ``cfg.data``; write and return the report."""
    from ..data.datasets import load_or_prepare, split_by_trace
    from ..data.prepare import PrepConfig
    from ..guards import check_adapter_base, refuse_nonempty_output
    from ..models.loading import load_base_model
    from ..models.processor import load_processor
    from ..training.collator import EOGymCollator

    refuse_nonempty_output(cfg.output, cfg.overwrite, "eogym-sft validate")
    if cfg.adapter:
        check_adapter_base(cfg.adapter, cfg.model, cfg.allow_other_base)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = cfg.dtype or ("bfloat16" if device == "cuda" else "float32")
    processor = load_processor(cfg.model, cfg.max_pixels, cfg.min_pixels)
    workdir = Path(cfg.output).with_suffix("").as_posix() + "_prepared"
    dataset, _ = load_or_prepare(cfg.data, cfg.model, processor, PrepConfig(**cfg.sample_kwargs(), data_root=cfg.data_root), workdir, cfg.num_proc)
    if cfg.held_out_fraction:
        dataset = split_by_trace(dataset, cfg.held_out_fraction, cfg.seed)[1]
    model = load_base_model(cfg.model, dtype=dtype)
    if cfg.adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, cfg.adapter)
    model.to(device).eval()
    collator = EOGymCollator(processor, **cfg.sample_kwargs(), data_root=cfg.data_root, skip_bad_images=True)
    models, skipped = {}, []
    name = "adapter" if cfg.adapter else "base"
    models[name] = score_dataset(model, collator, dataset, cfg.batch_size, device, skipped=skipped, label=f"validate {name}")
    if cfg.adapter and cfg.with_base:
        with model.disable_adapter():
            models["base"] = score_dataset(model, collator, dataset, cfg.batch_size, device, label="validate base (adapter off)")
    report = {
        "model": cfg.model, "adapter": cfg.adapter, "data": cfg.data, "held_out_fraction": cfg.held_out_fraction, "samples": len(dataset),
        "samples_skipped": len(skipped), "skipped": skipped, "models": models,
    }
    Path(cfg.output).parent.mkdir(parents=True, exist_ok=True)
    Path(cfg.output).write_text(json.dumps(report, indent=2) + "\n")
    print(format_report(report))
    for record in skipped:
        print(f"skipped sample {record['sample_id']} ({record['reason']}): {record['file']}")
    print(f"token accuracy ({name}): {models[name]['overall']['token_accuracy']:.4f}  report: {cfg.output}")
    return report
