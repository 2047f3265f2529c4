"""GRPO's examples: one dataset row per question, read from EO-Gym JSONL with bad rows skipped, named and
counted, and grouped by their tool schemas (the ``environment`` column, :func:`tools_key`); see
:mod:`eogym_sft.training.grpo` for how the groups' schemas reach the prompt."""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..config import TOOL_IMAGES
from ..data.images import ImageError, image_size, load_rgb, resolve_image_path
from ..data.traces import TraceError
from ..agent.episodes import canonical_prompt, question_messages

logger = logging.getLogger("eogym_sft.training.grpo")  # one logger for the GRPO run: its level covers every part

RESERVED_NAMES = ("reset", "get_reward")  # TRL gives these methods their own meaning


def prompt_trace(row: dict, tool_images=TOOL_IMAGES):
    """The row normalised up to its first assistant turn (system, question, its images), as a
    :class:`~eogym_sft.data.traces.Trace`: the prompt ``eogym-sft rollout`` starts an episode from."""
    return canonical_prompt({**row, "messages": question_messages(row)}, tool_images)


def tools_key(tools: list[dict]) -> str:
    """The ``environment`` name of a tool list: rows with identical schemas share it."""
    digest = hashlib.sha256(json.dumps(tools, sort_keys=True).encode()).hexdigest()[:12]
    return f"tools-{digest}"


def episode_record(row: dict, data_root: str | Path) -> dict:
    """One GRPO example from an EO-Gym row; raises ``TraceError``/``ImageError``/``ValueError`` on bad rows."""
    trace = prompt_trace(row)
    if not str(trace.meta.get("gt_answer", "")).strip():
        raise TraceError("missing_field", "gt_answer", "GRPO scores answers against gt_answer, and this row has none")
    if not trace.tools:
        raise TraceError("missing_field", "tools", "the row offers no tools")
    for tool in trace.tools:
        name = tool["function"]["name"]
        if name in RESERVED_NAMES or name.startswith("_"):
            raise TraceError("bad_field_type", "tools",
                             f"tool name {name!r} is reserved by TRL's environment protocol")
    for path in trace.images:
        image_size(resolve_image_path(path, data_root))  # missing or unreadable images fail here, not mid-run
    return {
        "id": trace.id,
        "prompt": json.dumps(trace.messages),
        "images": trace.images,
        "environment": tools_key(trace.tools),
        "tools": json.dumps(trace.tools),
        "row": json.dumps(row),
        "gt_answer": trace.meta["gt_answer"],
        "EO_task": trace.meta["EO_task"],
    }


@dataclass
class EpisodeData:
    """The examples of a GRPO run, the tool schemas of each ``environment`` group, and what was skipped."""

    records: list[dict]
    schemas: dict[str, list[dict]]
    rows_in: int = 0
    skipped: Counter = field(default_factory=Counter)
    skipped_rows: list[str] = field(default_factory=list)  # "file:line: reason" (the first 50)

    @property
    def tool_names(self) -> list[str]:
        return sorted({t["function"]["name"] for tools in self.schemas.values() for t in tools})

    def stats(self) -> dict:
        return {
            "rows_in": self.rows_in,
            "episodes": len(self.records),
            "skipped": dict(self.skipped),
            "skipped_rows": self.skipped_rows,
        }


def load_episodes(path: str | Path, data_root: str | Path, limit: int | None = None) -> EpisodeData:
    """Read EO-Gym JSONL into GRPO examples. A bad row is skipped, named (file:line) and counted."""
    from ..data.prepare import _decode_line, read_lines

    data = EpisodeData([], {})
    for line_no, raw in read_lines(path):  # bytes: a line that is not UTF-8, or hostile JSON, is one skip
        if not raw.strip():
            continue
        if limit is not None and len(data.records) >= limit:
            break
        data.rows_in += 1
        try:
            record = episode_record(_decode_line(raw), data_root)
        except (TraceError, ImageError) as err:
            _skip(data, f"{path}:{line_no}", err.reason, str(err))
            continue
        data.records.append(record)
        data.schemas.setdefault(record["environment"], json.loads(record["tools"]))
    if not data.records:
        raise ValueError(f"{path}: no usable rows ({data.rows_in} read, skipped: {dict(data.skipped)})")
    logger.info(
        "GRPO episodes: %d of %d rows, %d tool sets, skipped %s",
        len(data.records), data.rows_in, len(data.schemas), dict(data.skipped),
    )
    return data


def _skip(data: EpisodeData, where: str, reason: str, detail: str) -> None:
    data.skipped[reason] += 1
    if len(data.skipped_rows) < 50:
        data.skipped_rows.append(f"{where}: {detail}")
    logger.warning("skipped %s: %s", where, detail)


@dataclass
class DecodeEpisodes:
    """``Dataset.with_transform`` hook: JSON prompts back to messages, image paths to RGB images (or, with
    ``images`` false, no ``images`` column at all)."""

    data_root: str
    images: bool = True

    def __call__(self, batch: dict) -> dict:
        out = dict(batch)
        out["prompt"] = [json.loads(p) for p in batch["prompt"]]
        if self.images:
            out["images"] = [
                [load_rgb(resolve_image_path(p, self.data_root)) for p in paths] for paths in batch["images"]
            ]
        else:
            del out["images"]
        return out


def episode_dataset(data: EpisodeData, data_root: str | Path, images: bool = True):
    """A ``datasets.Dataset`` TRL can sample from: ``prompt`` (messages), ``images`` (decoded on access),
    ``environment`` (the tool-set group), ``row`` (the raw EO-Gym row, for the environment) and ``gt_answer``.

    ``images=False`` leaves the images out: the slots engine reads them from the row when it starts an episode
    and hands TRL the episode's images itself, and TRL would otherwise decode every row image of every
    episode of the step in the dataloader (``num_generations`` times each), outside the rollout."""
    from datasets import Dataset

    return Dataset.from_list(data.records).with_transform(DecodeEpisodes(str(data_root), images))
