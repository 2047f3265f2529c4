"""``eogym-sft episodes``: keep the rollout episodes a rejection-sampling round trains on.

Rollout episodes (``episodes.jsonl`` of ``eogym-sft rollout``) are EO-Gym rows plus their outcome, so the
ones kept are ready for ``eogym-sft prepare`` or an SFT run with the rollout's ``--data-root``. The rule:

* ``correct``: ``correct`` is true (the judge's verdict, else the normalised match against ``gt_answer``)
  and the episode ended on its own ``Final Answer:`` (``stop_reason`` ``final_answer``);
* ``incorrect``: ``correct`` is false (any stop reason but ``error``);
* ``all``: every episode but those that ended in ``error``.

Unscored episodes (no ``gt_answer``, a failed judge request) are kept only by ``all``. A line that is not a
JSON episode (bad UTF-8, malformed, nested too deep, a number too long) is skipped, named (file:line) and
counted; ``--arm`` keeps one arm's episodes. The output is written atomically once every line is read, never
over the input (nor through a link to it), and not at all when no episode is kept.
"""

from __future__ import annotations

from pathlib import Path

from ..atomic import write_lines_atomic
from ..guards import check_output, refuse_output_over_input
from ..safe_json import UntrustedJSONError, jsonl_lines, loads, record_line

KEEP = ("correct", "incorrect", "all")


def keeps(episode: dict, keep: str) -> bool:
    """Whether the rule ``keep`` (one of :data:`KEEP`) keeps this episode record."""
    if episode.get("stop_reason") == "error":
        return False
    if keep == "correct":
        return episode.get("correct") is True and episode.get("stop_reason") == "final_answer"
    if keep == "incorrect":
        return episode.get("correct") is False
    if keep == "all":
        return True
    raise ValueError(f"unknown filter {keep!r}: choose from {', '.join(KEEP)}")


def filter_episodes(input_path: str | Path, output_path: str | Path, keep: str = "correct",
                    arm: str | None = None) -> dict:
    """Write the episodes of ``input_path`` that ``keep`` keeps (of ``arm`` only, if given) to ``output_path``
    (atomically; nothing when none is kept); return ``{"read", "kept", "skipped", "skipped_lines"}``."""
    if keep not in KEEP:
        raise ValueError(f"unknown filter {keep!r}: choose from {', '.join(KEEP)}")
    refuse_output_over_input(output_path, [input_path], "eogym-sft episodes")
    stats = {"read": 0, "kept": 0, "skipped": 0, "skipped_lines": []}
    kept = []
    for line_no, line in jsonl_lines(Path(input_path).read_bytes()):
        stats["read"] += 1
        try:
            episode = loads(line)
            if not isinstance(episode, dict) or "stop_reason" not in episode or "messages" not in episode:
                raise ValueError("not a rollout episode (no stop_reason or messages field)")
        except (UntrustedJSONError, ValueError) as err:
            stats["skipped"] += 1
            stats["skipped_lines"].append(f"{input_path}:{line_no}: {err}")
            continue
        if (arm is None or episode.get("arm") == arm) and keeps(episode, keep):
            kept.append(record_line(episode))
    stats["kept"] = len(kept)
    if kept:
        write_lines_atomic(output_path, kept)
    return stats


def add_episodes_args(parser) -> None:
    parser.add_argument("--input", required=True, help="episodes.jsonl of eogym-sft rollout")
    parser.add_argument("--output", required=True,
                        help="JSONL of the episodes kept (EO-Gym rows: eogym-sft prepare reads it)")
    parser.add_argument("--filter", choices=KEEP, default="correct",
                        help="which episodes to keep (docs/evaluation.md, section 15)")
    parser.add_argument("--arm", default=None, help="keep only this arm's episodes (e.g. sft)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output file")


def run_episodes_filter(args) -> dict:
    if not Path(args.input).is_file():
        raise SystemExit(f"eogym-sft episodes: no such input file: {args.input}")
    check_output(args.output, "eogym-sft episodes", args.overwrite, "episode rows", inputs=[args.input])
    stats = filter_episodes(args.input, args.output, args.filter, args.arm)
    for where in stats["skipped_lines"][:20]:
        print(f"skipped {where}")
    if stats["kept"] == 0:
        raise SystemExit(
            f"eogym-sft episodes: no episode of {stats['read']} passed --filter {args.filter} (skipped "
            f"{stats['skipped']} bad lines): nothing to train on, {args.output} not written"
        )
    print(f"kept {stats['kept']} of {stats['read']} episodes ({args.filter}); skipped {stats['skipped']} bad lines -> "
          f"{args.output}")
    return stats
