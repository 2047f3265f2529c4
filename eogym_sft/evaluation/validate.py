"""``eogym-sft validate``: loss and token accuracy of a base model and LoRA adapters on prepared data.

It runs the training forward pass: each batch's samples packed into one row (the collator's
``padding_free`` mode) through the recipe's variable-length attention (:mod:`eogym_sft.models.attention`),
with logits computed only at supervised positions (the LM head over a 151,936-token vocabulary is the
largest activation otherwise). Every figure is a token-weighted sum over the whole set, summed across
ranks before dividing; see :mod:`eogym_sft.metrics.token_accuracy`. Arms are chosen as for ``evaluate``
and ``rollout`` (the base unless ``--no-base``, then one per ``--adapter [NAME=]DIR``).

What keeps the GPU busy: batches are collated (images decoded, resized and patchified) in DataLoader
workers, with the host-side bookkeeping of each batch (sample spans, groups, token classes, the supervised
positions), while the model runs; each batch is collated once and run through every arm in turn; the
decoder layers are compiled as for training (on CUDA); and the forward has no host sync of its own
between the model's and the one that reads a batch's scores back.
"""

from __future__ import annotations

import json
import os
import time
from bisect import bisect_right
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path

import torch

from ..metrics.token_accuracy import IGNORE_INDEX, correct_predictions, token_classes
from ..models.loading import unwrap_peft
from .run_args import ValidateConfig, check_validate_output

GROUP_FIELDS = ("EO_task", "question_type")


def supervised_positions(labels: torch.Tensor) -> torch.Tensor:
    """``(row, position)`` of every supervised target of ``labels`` (the next-token targets ``labels[:, 1:]``)."""
    return (labels[:, 1:] != IGNORE_INDEX).nonzero()


@torch.no_grad()
def supervised_scores(model, batch: dict,
                      where: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per supervised target token: cross-entropy, correctness, and its ``(row, position)`` index.

    ``where`` (:func:`supervised_positions` of the batch's labels, computed on the host before the batch
    moves) saves the host sync that finding them on the device costs in the middle of the forward."""
    lm = unwrap_peft(model)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    hidden = lm.model(**inputs, use_cache=False).last_hidden_state[:, :-1]
    targets = batch["labels"][:, 1:]
    where = supervised_positions(batch["labels"]) if where is None else where.to(hidden.device, non_blocking=True)
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


class ScoringBatches(torch.utils.data.Dataset):
    """Batch ``k`` of ``indices`` (``batch_size`` samples of ``dataset`` each), collated and ready to score.

    Everything the host needs besides the model's output is computed here, in the DataLoader's workers:
    the model inputs, the supervised positions (:func:`supervised_positions`), which sample each target
    lies in and its token class, the samples' group keys, the tokens run and the samples the collator
    skipped. The main process then only moves the inputs, runs the arms and adds up."""

    def __init__(self, collator, dataset, indices: list[int], batch_size: int):
        self.collator, self.dataset, self.batch_size = collator, dataset, batch_size
        self.chunks = [indices[k : k + batch_size] for k in range(0, len(indices), batch_size)]

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, k: int) -> dict:
        examples = [self.dataset[i] for i in self.chunks[k]]
        batch = self.collator(examples)
        skipped = batch.pop("skipped_samples", [])
        left_out = {r["index"] for r in skipped}
        examples = [ex for j, ex in enumerate(examples) if j not in left_out]
        if not examples:
            return {"inputs": None, "skipped": skipped}
        spans = sample_spans(batch, len(examples), self.collator.padding_free)
        tokenizer = self.collator.processor.tokenizer
        classes = [
            token_classes(batch["input_ids"][row, a:b].tolist(), (batch["labels"][row, a:b] != IGNORE_INDEX).tolist(),
                          tokenizer)
            for row, row_spans in enumerate(spans) for a, b in row_spans
        ]
        where = supervised_positions(batch["labels"])
        return {
            "inputs": batch,
            "where": where,
            "groups": _target_groups(where, spans, examples, classes),
            "tokens": int(batch["attention_mask"].sum()) if "attention_mask" in batch else batch["input_ids"].numel(),
            "skipped": skipped,
        }


def _target_groups(where: torch.Tensor, spans, examples: list[dict], classes) -> tuple[list[str], torch.Tensor]:
    """The groups of each supervised target in ``where`` order: ``overall``, its sample's ``EO_task`` and
    ``question_type``, and its token class (``spans`` from :func:`sample_spans`; ``classes`` per sample), as
    ``(names, ids)``: ``ids[t]`` indexes ``names`` (a tensor pins and crosses processes at no per-target cost)."""
    keys = [[f"{f}/{ex.get(f) or 'unknown'}" for f in GROUP_FIELDS] for ex in examples]
    firsts, offsets, k = [], [], 0
    for row in spans:
        firsts.append([start for start, _ in row])
        offsets.append(k)
        k += len(row)
    names: dict[str, int] = {}
    ids = []
    for row, pos in where.tolist():
        target = pos + 1  # a packed sample's first token is never a target (the collator masks it)
        j = bisect_right(firsts[row], target) - 1
        sample = offsets[row] + j
        groups = ("overall", *keys[sample], f"token_class/{classes[sample][target - firsts[row][j]]}")
        ids.append([names.setdefault(g, len(names)) for g in groups])
    return list(names), torch.tensor(ids, dtype=torch.long).reshape(-1, 2 + len(GROUP_FIELDS))


def _accumulate(totals, names: list[str], ids: torch.Tensor, loss: torch.Tensor, correct: torch.Tensor) -> None:
    """Add each scored target to its groups (:func:`_target_groups`), in target order (Python floats: the
    same sums on every path)."""
    for groups, lost, c in zip(ids.tolist(), loss.tolist(), correct.tolist()):
        for g in groups:
            total = totals[names[g]]
            total[0] += lost
            total[1] += c
            total[2] += 1


def _add_up(scored: list) -> None:
    for totals, names, ids, loss, correct in scored:
        _accumulate(totals, names, ids, loss.cpu(), correct.cpu())


def _merge_ranks(totals: dict) -> dict:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return totals
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, dict(totals))
    merged = defaultdict(lambda: [0.0, 0, 0])
    for part in gathered:
        for key, (lost, c, n) in part.items():
            merged[key][0] += lost
            merged[key][1] += c
            merged[key][2] += n
    return merged


def _report(totals: dict) -> dict:
    merged = _merge_ranks(totals)
    return {
        key: {"loss": lost / n, "token_accuracy": c / n, "tokens": n}
        for key, (lost, c, n) in sorted(merged.items(), key=lambda kv: (kv[0] != "overall", kv[0]))
    }


def _batches(scoring: ScoringBatches, workers: int, device: torch.device):
    """``scoring``'s batches in order: from ``workers`` DataLoader processes (one batch ahead each, pinned
    for the copy to a GPU), or made here when ``workers`` is 0."""
    workers = min(workers, len(scoring))
    if workers == 0:
        return (scoring[k] for k in range(len(scoring)))
    return torch.utils.data.DataLoader(
        scoring, batch_size=None, num_workers=workers, prefetch_factor=1, collate_fn=_as_is,
        pin_memory=device.type == "cuda",
    )


def _as_is(item):
    return item


def score_arms(
    model, arms: list, collator, dataset, batch_size: int = 8, device: str | torch.device = "cpu",
    progress: bool = True,
    skipped: list | None = None, label: str = "validate", stats: dict | None = None, workers: int = 0,
) -> dict[str, dict]:
    """``{arm name: scores}`` for every arm of ``arms`` (:class:`eogym_sft.models.loading.Arm`), each batch
    collated once and run through every arm in turn. Scores are :func:`score_dataset`'s; ``workers``
    DataLoader processes collate the batches (0: this process). ``stats``, when given, gets this rank's
    ``seconds``, ``tokens`` (every token run through the model, context included, summed over the arms)
    and ``tokens_per_s``."""
    from ..models.loading import use_arm

    return _score(model, [(arm.name, lambda arm=arm: use_arm(model, arm)) for arm in arms], collator, dataset,
                  batch_size, device,
                  progress, skipped, label, stats, workers)


def score_dataset(
    model, collator, dataset, batch_size: int = 8, device: str | torch.device = "cpu", progress: bool = True,
    skipped: list | None = None,
    label: str = "validate", stats: dict | None = None, workers: int = 0,
) -> dict:
    """``{group: {"loss", "token_accuracy", "tokens"}}`` for groups ``overall``, ``EO_task/...``,
    ``question_type/...`` and ``token_class/...``, token-weighted over the whole dataset, of ``model`` as it is.

    ``batch_size`` samples go through each forward, packed into one row when the collator is
    ``padding_free`` (the fast path; the model should run a variable-length attention), else padded.
    ``workers`` DataLoader processes collate the batches (0: this process).
    With a collator that skips bad images (``skip_bad_images=True``), the samples it skipped are
    appended to ``skipped`` (this rank's) and left out of every figure. ``stats``, when given, gets this
    rank's ``seconds``, ``tokens`` (every token run through the model, context included) and ``tokens_per_s``."""
    return _score(model, [("model", nullcontext)], collator, dataset, batch_size, device, progress, skipped, label,
                  stats, workers)["model"]


def _score(model, arms, collator, dataset, batch_size, device, progress, skipped, label, stats,
           workers) -> dict[str, dict]:
    from tqdm.auto import tqdm

    rank, world = 0, 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    device = torch.device(device)
    scoring = ScoringBatches(collator, dataset, list(range(rank, len(dataset), world)), batch_size)
    totals = {name: defaultdict(lambda: [0.0, 0, 0]) for name, _ in arms}
    start, tokens, pending = time.perf_counter(), 0, []
    for item in tqdm(_batches(scoring, workers, device), total=len(scoring), desc=label, disable=not progress):
        if skipped is not None:
            skipped.extend(item["skipped"])
        if item["inputs"] is None:
            continue
        tokens += item["tokens"] * len(arms)
        inputs = {k: v.to(device, non_blocking=True) for k, v in item["inputs"].items()}
        scored = []
        for name, activate in arms:
            with activate():
                scored.append((totals[name], *item["groups"], *supervised_scores(model, inputs, item["where"])[:2]))
        # The previous batch's scores are read back and added up while this batch's last forward runs: the
        # model syncs with the host at the start of a forward (image grids, sample boundaries), so they are done.
        _add_up(pending)
        pending = scored
    _add_up(pending)
    if stats is not None:
        seconds = time.perf_counter() - start
        stats.update(seconds=seconds, tokens=tokens, tokens_per_s=tokens / seconds if seconds else None)
    return {name: _report(t) for name, t in totals.items()}


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


def default_attention(device) -> str:
    """The recipe's text attention where it runs: cuDNN's varlen kernels on CUDA, the reference elsewhere."""
    from ..models.attention import CUDNN_NAME, NAME

    return CUDNN_NAME if torch.device(device).type == "cuda" else NAME


def default_compile(device) -> bool:
    """Whether validate compiles the decoder layers by default: on CUDA."""
    return torch.device(device).type == "cuda"


def dataloader_workers(requested: int) -> int:
    """``requested`` workers, at most one fewer than the CPUs this process may use (the main process runs the
    model)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(0, min(requested, cpus - 1))


def scoring_collator(processor, max_length: int, data_root: str, attention: str, dtype):
    """Validate's collator: packed batches unless the text tower runs ``sdpa`` (padded), pixels in the model's dtype,
    a sample whose image fails skipped and named."""
    from ..data.collator import EOGymCollator

    return EOGymCollator(
        processor, max_length=max_length, data_root=data_root, padding_free=attention != "sdpa", skip_bad_images=True,
        pixel_dtype=dtype,
    )


def sized_batch(model, dataset, requested: int | None, device) -> int:
    """Samples a forward: ``requested`` if its largest batch fits (refused if not), else the most of
    :data:`VALIDATE_BATCHES` whose largest batch the GPU holds beside the model; off CUDA ``requested`` or
    :data:`CPU_BATCH`. One line says what it chose."""
    from ..agent.rollout_config import CPU_BATCH, usable_bytes
    from ..models.memory import GIB, MicroBatch, forward_bytes, widths_of
    from .run_args import VALIDATE_BATCHES

    usable = usable_bytes(device)
    if usable is None:
        return requested or CPU_BATCH
    config = unwrap_peft(model).config
    vocab, merge = config.get_text_config().vocab_size, config.vision_config.spatial_merge_size ** 2
    widths = widths_of(config.to_dict())
    columns = [list(dataset[name]) for name in ("n_tokens", "n_trained_tokens", "n_image_tokens")]
    rank, world = (
        (torch.distributed.get_rank(), torch.distributed.get_world_size())
        if torch.distributed.is_initialized()
        else (0, 1)
    )
    mine = list(range(rank, len(dataset), world))

    def largest(b: int) -> float:
        chunks = [mine[k : k + b] for k in range(0, len(mine), b)] or [[]]
        return max(forward_bytes(MicroBatch(*(sum(col[i] for i in chunk) for col in columns)), vocab,
                                 merge, widths=widths) for chunk in chunks)

    for b in [requested] if requested else VALIDATE_BATCHES:
        if largest(b) <= usable:
            print(f"memory plan: {usable / GIB:.1f} GiB free beside the model: {b} samples a forward (largest "
                  f"{largest(b) / GIB:.1f} GiB predicted)")
            return b
    asked = f"--batch-size {requested}" if requested else "one sample a forward"
    raise ValueError(f"{asked} does not fit: its largest batch is predicted to need "
                     f"{largest(requested or 1) / GIB:.1f} GiB of the "
                     f"{usable / GIB:.1f} GiB free beside the model: lower --batch-size or --max-length")


def validate(cfg: ValidateConfig) -> dict:
    """Score every arm on ``cfg.data``; write and return the report."""
    from ..data.datasets import load_or_prepare, split_by_trace
    from ..data.prepare import PrepConfig
    from ..atomic import write_text_atomic
    from ..models.loading import (
        compile_language_layers,
        load_inference_model,
        parse_arms,
        resolve_device,
    )
    from ..models.processor import load_processor

    check_validate_output(cfg)
    arms = parse_arms(cfg.adapters, cfg.model, cfg.include_base, cfg.allow_other_base)
    device, dtype = resolve_device(cfg.device, cfg.dtype)
    attention = cfg.attn_implementation or default_attention(device)
    processor = load_processor(cfg.model, cfg.max_pixels, cfg.min_pixels)
    workdir = Path(cfg.output).with_suffix("").as_posix() + "_prepared"
    dataset, _ = load_or_prepare(cfg.data, cfg.model, processor,
                                 PrepConfig(max_length=cfg.max_length, data_root=cfg.data_root), workdir, cfg.num_proc)
    if cfg.held_out_fraction:
        dataset = split_by_trace(dataset, cfg.held_out_fraction, cfg.seed)[1]
    model = load_inference_model(cfg.model, arms, device, dtype, attn_implementation=attention)
    collator = scoring_collator(processor, cfg.max_length, cfg.data_root, attention, dtype)
    compiled = default_compile(device) if cfg.compile_layers is None else cfg.compile_layers
    if compiled:
        compile_language_layers(model)
    workers, timing, skipped = dataloader_workers(cfg.dataloader_workers), {}, []
    batch_size = sized_batch(model, dataset, cfg.batch_size, device)
    models = score_arms(model, arms, collator, dataset, batch_size, device, skipped=skipped, stats=timing,
                        workers=workers)
    report = {
        "model": cfg.model, "adapters": {a.name: a.adapter for a in arms if a.adapter}, "data": cfg.data,
        "held_out_fraction": cfg.held_out_fraction, "samples": len(dataset), "samples_skipped": len(skipped),
        "skipped": skipped,
        "attn_implementation": attention, "batch_size": batch_size, "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "compiled_layers": compiled, "dataloader_workers": workers,
        "models": models, "timing": timing,
    }
    Path(cfg.output).parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(cfg.output, json.dumps(report, indent=2) + "\n")
    print(format_report(report))
    for record in skipped:
        print(f"skipped sample {record['sample_id']} ({record['reason']}): {record['file']}")
    for name, scores in models.items():
        print(f"token accuracy ({name}): {scores['overall']['token_accuracy']:.4f}")
    print(f"{timing['tokens']} tokens through the model in {timing['seconds']:.1f} s "
          f"({timing['tokens_per_s'] or 0:.0f} tokens/s, all arms)")
    print(f"report: {cfg.output}")
    return report

