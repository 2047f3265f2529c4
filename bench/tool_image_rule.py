"""What the tool-image rule does to prepared data: tokens per sample and the split rate, per mode.

One command::

    python bench/tool_image_rule.py                               # 400 rows, 30% of tool calls are listings
    python bench/tool_image_rule.py --rows 2000 --listing-share 0.2 --modes produced attach text --json out.json

It writes the throughput bench's EO-Gym-shaped sample (``generate_sample`` in ``bench/prep_throughput.py``)
with about ``--listing-share`` of the tool calls turned into ``get_optical_image_list`` listings (2-6
co-located ``EO_GYM_DATA/`` frames each, as large as row images), prepares it once per ``--tool-images``
mode in one process with the tiny offline model's processor, and reports per mode: rows kept / split /
dropped, the split rate, samples, mean tokens and image tokens per sample, mean tokens per row (over
the rows each mode keeps, and over the rows that no mode drops), and the images attached per tool (``stats.json``'s ``tool_images_attached``). CPU only; nothing is timed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from eogym_sft.config import SampleConfig  # noqa: E402


def measure(jsonl: Path, data_root: Path, processor, mode: str, max_length: int) -> dict:
    from eogym_sft.data.prepare import PrepConfig, prepare_files
    from eogym_sft.data.prepared import compute_stats

    cfg = PrepConfig(data_root=str(data_root), max_length=max_length, tool_images=mode)
    results = prepare_files([str(jsonl)], "unused", cfg, num_proc=1, progress=False, processor=processor)
    samples = [s for r in results for s in r.samples]
    stats = compute_stats(results, samples)
    rows_used = stats["rows_kept"] + stats["rows_split"]
    return {
        "mode": mode,
        "rows_kept": stats["rows_kept"],
        "rows_split": stats["rows_split"],
        "rows_dropped": stats["rows_dropped"],
        "split_rate": round(stats["rows_split"] / max(1, rows_used), 4),
        "samples": stats["samples_out"],
        "tokens_per_sample": round(stats["tokens_total"] / max(1, len(samples)), 1),
        "image_tokens_per_sample": round(stats["tokens_image"] / max(1, len(samples)), 1),
        "tokens_per_row": round(stats["tokens_total"] / max(1, rows_used), 1),
        "tool_images_attached": stats["tool_images_attached"],
        "drops_by_reason": stats["drops_by_reason"],
        "_row_tokens": {r.id: sum(s["n_tokens"] for s in r.samples) for r in results if r.status != "dropped"},
    }


def add_common_rows(runs: list[dict]) -> int:
    """Mean tokens per row over the rows that every mode keeps or splits (the same rows in each mode)."""
    common = set.intersection(*(set(run["_row_tokens"]) for run in runs))
    for run in runs:
        tokens = run.pop("_row_tokens")
        run["tokens_per_common_row"] = round(sum(tokens[i] for i in common) / max(1, len(common)), 1)
    return len(common)


def format_table(result: dict) -> str:
    cols = ["mode", "rows_kept", "rows_split", "rows_dropped", "split_rate", "samples", "tokens_per_sample",
            "image_tokens_per_sample", "tokens_per_row", "tokens_per_common_row"]
    lines = [" | ".join(cols)]
    for run in result["runs"]:
        lines.append(" | ".join(str(run[c]) for c in cols))
        lines.append(f"    attached per tool: {run['tool_images_attached']}; dropped: {run['drops_by_reason']}")
    lines.append(f"tokens_per_common_row: over the {result['common_rows']} rows that no mode drops")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--listing-share", type=float, default=0.3, help="share of tool calls that are get_optical_image_list listings")
    parser.add_argument("--max-length", "--max-tokens", type=int, default=SampleConfig.max_length, help="token budget per sample")
    parser.add_argument("--modes", nargs="+", default=["produced", "attach"], help="--tool-images specs to compare")
    parser.add_argument("--workdir", default=None, help="folder for the sample (default: a temp folder, removed after)")
    parser.add_argument("--json", default=None, help="where to write the JSON result")
    args = parser.parse_args(argv)

    from prep_throughput import generate_sample, write_result

    from eogym_sft.models.tiny import build_offline_processor

    tmp = None if args.workdir else tempfile.mkdtemp(prefix="eogym_tool_images_")
    workdir = Path(args.workdir or tmp)
    try:
        jsonl, data_root = generate_sample(workdir / "sample", args.rows, args.seed, args.listing_share)
        processor = build_offline_processor()
        runs = [measure(jsonl, data_root, processor, mode, args.max_length) for mode in args.modes]
        common = add_common_rows(runs)
        result = {
            "bench": "tool_image_rule",
            "command": " ".join(["python", "bench/tool_image_rule.py", *(argv if argv is not None else sys.argv[1:])]),
            "date": dt.date.today().isoformat(),
            "rows": args.rows,
            "seed": args.seed,
            "listing_share": args.listing_share,
            "max_length": args.max_length,
            "common_rows": common,
            "runs": runs,
        }
        print(format_table(result))
        return write_result(result, args.json) if args.json else result
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
