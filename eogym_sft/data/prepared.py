"""Write and read a prepared dataset folder: ``dataset/``, ``manifest.jsonl``, ``stats.json``."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

from ..atomic import write_lines_atomic, write_text_atomic
from ..guards import refuse_output_over_input

META_FIELDS = ("EO_task", "question_type", "data_source", "gt_answer")
HISTOGRAM_BIN = 512


def features():
    """The dataset schema, fixed so that nothing is inferred (messages and tools stay JSON strings)."""
    from datasets import Features, Sequence, Value

    return Features(
        {
            "sample_id": Value("string"),
            "source_id": Value("string"),
            "window": Value("int32"),
            "n_windows": Value("int32"),
            "trained_turns": Sequence(Value("int32")),
            "messages": Value("string"),
            "tools": Value("string"),
            "images": Sequence(Value("string")),
            "image_hw": Sequence(Sequence(Value("int32"))),
            "input_ids": Sequence(Value("int32")),
            "assistant_masks": Sequence(Value("int8")),
            "n_tokens": Value("int32"),
            "n_trained_tokens": Value("int32"),
            "n_image_tokens": Value("int32"),
            **{name: Value("string") for name in META_FIELDS},
            "source_file": Value("string"),
            "source_line": Value("int32"),
        }
    )


def content_hash(samples) -> str:
    """sha256 of the samples (an iterable of dicts), in order: equal inputs and settings give an equal hash."""
    digest = hashlib.sha256()
    for sample in samples:
        digest.update(json.dumps(sample, sort_keys=True, ensure_ascii=False).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def compute_stats(results, samples: list[dict]) -> dict:
    """Counts that add up: every input line is kept, split or dropped, and samples trace back to lines."""
    status = Counter(r.status for r in results)
    tokens = sum(s["n_tokens"] for s in samples)
    trained = sum(s["n_trained_tokens"] for s in samples)
    image = sum(s["n_image_tokens"] for s in samples)
    hist = Counter((s["n_tokens"] // HISTOGRAM_BIN) * HISTOGRAM_BIN for s in samples)
    windows = Counter(len(r.samples) for r in results if r.status == "split")  # str keys below: as JSON stores them
    return {
        "rows_in": len(results),
        "rows_kept": status["kept"],
        "rows_split": status["split"],
        "rows_dropped": status["dropped"],
        "drops_by_reason": dict(sorted(Counter(r.reason for r in results if r.status == "dropped").items())),
        "samples_out": len(samples),
        "windows_per_split_row": {str(k): v for k, v in sorted(windows.items())},
        "tokens_total": tokens,
        "tokens_trained": trained,
        "tokens_image": image,
        "trained_token_share": round(trained / tokens, 4) if tokens else 0.0,
        "image_token_share": round(image / tokens, 4) if tokens else 0.0,
        "token_histogram": {f"{k}-{k + HISTOGRAM_BIN - 1}": v for k, v in sorted(hist.items())},
        "max_tokens_seen": max((s["n_tokens"] for s in samples), default=0),
        "images_per_sample": {str(k): v for k, v in sorted(Counter(len(s["images"]) for s in samples).items())},
        "tool_images_attached": dict(
            sorted(sum((Counter(r.tool_images) for r in results if r.status != "dropped"), Counter()).items())
        ),
        "content_hash": content_hash(samples),
    }


def format_summary(stats: dict) -> str:
    """A short human-readable report of ``stats``."""
    lines = [
        f"rows in {stats['rows_in']}: kept {stats['rows_kept']}, split {stats['rows_split']}, dropped "
        f"{stats['rows_dropped']}",
        f"samples out {stats['samples_out']}; tokens {stats['tokens_total']} "
        f"(trained {stats['trained_token_share']:.1%}, image {stats['image_token_share']:.1%}); longest "
        f"{stats['max_tokens_seen']}",
    ]
    for reason, count in stats["drops_by_reason"].items():
        lines.append(f"  dropped {count:6d}  {reason}")
    lines.append("token histogram: " + ", ".join(f"{k}: {v}" for k, v in stats["token_histogram"].items()))
    lines.append("images per sample: " + ", ".join(f"{k}: {v}" for k, v in stats["images_per_sample"].items()))
    attached = stats.get("tool_images_attached", {})
    lines.append("tool images attached: " + (", ".join(f"{k}: {v}" for k, v in attached.items()) or "none"))
    lines.append(f"content hash {stats['content_hash']}")
    return "\n".join(lines)


def write_prepared(output: str | Path, results, settings: dict) -> dict:
    """Save the dataset, the manifest (one line per input line) and ``stats.json``; return the stats."""
    from datasets import Dataset

    output = Path(output)
    refuse_output_over_input(output, settings.get("inputs", []), "eogym-sft prepare")
    output.mkdir(parents=True, exist_ok=True)
    # stats.json goes first and comes back last: a folder loads only with it, so a run killed half way
    # (an --overwrite rerun included) leaves a folder that refuses to load, never a half-new one that loads
    (output / "stats.json").unlink(missing_ok=True)
    samples = [s for r in results for s in r.samples]
    schema = features()
    # from_dict, not from_list: it also builds an empty dataset (every row dropped), saved as one empty shard
    dataset = Dataset.from_dict({name: [s[name] for s in samples] for name in schema}, features=schema)
    dataset.save_to_disk(str(output / "dataset"), num_shards=None if samples else 1)
    write_lines_atomic(output / "manifest.jsonl",
                       (json.dumps(res.manifest_entry(), ensure_ascii=False) + "\n" for res in results))
    stats = compute_stats(results, samples)
    stats["settings"] = settings
    write_text_atomic(output / "stats.json", json.dumps(stats, indent=2, ensure_ascii=False) + "\n")
    return stats


def dataset_rows(dataset, batch_size: int = 256):
    """The rows of a ``datasets.Dataset`` as plain dicts, read a batch at a time (faster than row by row)."""
    for batch in dataset.iter(batch_size=batch_size):
        names = list(batch)
        for values in zip(*batch.values()):
            yield dict(zip(names, values))


def load_prepared(folder: str | Path):
    """The prepared ``datasets.Dataset`` and its ``stats.json``, after checking that the dataset still
    has the content hash that ``stats.json`` recorded (a swapped or edited data file is refused)."""
    from datasets import load_from_disk

    folder = Path(folder)
    if not (folder / "dataset").is_dir() or not (folder / "stats.json").is_file():
        raise FileNotFoundError(f"{folder} is not a prepared folder (no dataset/ or stats.json): run `eogym-sft "
                                "prepare`")
    try:
        stats = json.loads((folder / "stats.json").read_text())
    except ValueError as err:
        raise ValueError(f"{folder}/stats.json is damaged ({err}): prepare the folder again with `eogym-sft "
                         "prepare`") from None
    dataset = load_from_disk(str(folder / "dataset"))
    expected = stats.get("content_hash")
    if expected is None:
        raise ValueError(f"{folder}/stats.json has no content_hash: prepare the folder again with `eogym-sft prepare`")
    found = content_hash(dataset_rows(dataset))
    if found != expected:
        raise ValueError(
            f"{folder}/dataset does not match {folder}/stats.json: content hash {found}, stats.json records "
            f"{expected}; the data was changed after prep: prepare it again"
        )
    return dataset, stats
