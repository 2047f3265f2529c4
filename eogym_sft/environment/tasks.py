"""Three learnable EO-Gym task families whose answers only the crop tool can reveal: ``colour_grid``,
``colour_pair`` and ``colour_count`` (:data:`TASKS`; ``eogym-sft make-task --task NAME``).

Each scene is a ``SCENE_PX`` x ``SCENE_PX`` PNG split into four quadrants. Every quadrant is painted with a
one-pixel checkerboard of a colour and its complement (``c`` and ``255 - c``), the colour drawn from
:data:`COLOURS`.

* ``colour_grid``: the question names one quadrant and asks for its colour. Gold trace: one crop of
  that quadrant, then ``Final Answer: <colour>``.
* ``colour_pair``: the question names two quadrants and asks for both colours, in that order. Gold trace:
  one turn of two crops, then ``Final Answer: <colour>, <colour>``: both must be right (chance 1 in 16).
* ``colour_count``: the question names a colour and asks how many of the four quadrants show it (0 to 4,
  each count equally likely, so no answer is right more than a fifth of the time by itself). Gold trace:
  one turn of four crops, one per quadrant, then ``Final Answer: <count>``. One crop answers nothing:
  the policy must crop every quadrant and combine what it saw.

Why only the tool reveals it: a checkerboard of ``c`` and ``255 - c`` averages to mid-grey under any
antialiased downscale by two or more, so at a pixel cap of a quarter of the scene's pixels (the agent
demo's, ``SCENE_PX**2 / 4``) every quadrant of the full image is the same grey whatever its colour.
``crop_optical_or_sar_image`` on a quadrant returns it at its native resolution (a quadrant is exactly
the cap), where the checkerboard, and so the colour, is intact; a larger crop is downscaled to grey again.

Rows are EO-Gym's own format (``id``, ``images``, ``tools`` as OpenAI schemas, ``messages`` from the system
prompt to ``Final Answer: ...``, ``gt_answer``, ``data_source``, ``question_type``, ``EO_task``). The
gold calls name the quadrant's normalised AOI (and no ``image_url``: the task's schema makes it optional,
and the ``crop`` backend then crops the row's only image), and each tool result is what the
environment's ``crop`` backend returns for that call (it writes the crop under ``image_cache/``).
Pure functions but :func:`write_task`, which writes images and JSONL.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..atomic import umask, write_lines_atomic
from ..guards import check_file_name
from .backends.crop import CROP_TOOL

SCENE_PX = 256  # the scene's side; a quadrant is 128 px, the crop shows it at native resolution
COLOURS = {"red": (230, 30, 30), "green": (30, 210, 50), "blue": (40, 60, 235), "white": (245, 245, 245)}
QUADRANTS = {  # name -> normalised AOI [x0, y0, x1, y1] of the crop that shows it
    "top-left": [0, 0, 0.5, 0.5],
    "top-right": [0.5, 0, 1, 0.5],
    "bottom-left": [0, 0.5, 0.5, 1],
    "bottom-right": [0.5, 0.5, 1, 1],
}
DATA_SOURCE = "eogym_sft.colour_grid"
IMAGE_DIR = "EO_GYM_DATA/colour_grid"
SYSTEM_PROMPT = (
    "The image is too coarse to show texture: crop the quadrant asked about, then reply: Final Answer: <colour>."
)
PAIR_SYSTEM_PROMPT = (
    "The image is too coarse to show texture: crop each of the two quadrants asked about, then reply: Final Answer: "
    "<colour>, <colour>."
)
COUNT_SYSTEM_PROMPT = (
    "The image is too coarse to show texture: crop each of the four quadrants, then reply: Final Answer: <number>."
)
# The real tool's name and arguments; image_url may be left out (the crop backend then crops the row's
# only image), so that the call a model must learn is the AOI alone: a small model learns to pick one
# of four AOIs in a few dozen steps, while copying a row-specific path takes it far longer.
CROP_SCHEMA = {
    "type": "function",
    "function": {
        "name": CROP_TOOL,
        "description": "Crop an image to a normalized AOI.",
        "parameters": {
            "type": "object",
            "properties": {
                "aoi": {"type": "array", "items": {"type": "number"}, "description": "[x0, y0, x1, y1] in 0..1"},
                "image_url": {"type": "string", "description": "default: the question's image"},
            },
            "required": ["aoi"],
        },
    },
}


def checkerboard(colour: tuple[int, int, int], height: int, width: int) -> np.ndarray:
    """``height`` x ``width`` x 3 uint8: ``colour`` where ``x + y`` is even, its complement where odd."""
    c = np.array(colour, dtype=np.uint8)
    odd = (np.add.outer(np.arange(height), np.arange(width)) % 2).astype(bool)
    out = np.empty((height, width, 3), dtype=np.uint8)
    out[~odd], out[odd] = c, 255 - c
    return out


def scene_pixels(colours: dict[str, str]) -> np.ndarray:
    """The scene of a ``{quadrant: colour name}`` map as a ``SCENE_PX`` x ``SCENE_PX`` x 3 array."""
    half = SCENE_PX // 2
    out = np.empty((SCENE_PX, SCENE_PX, 3), dtype=np.uint8)
    for name, (x0, y0, _, _) in QUADRANTS.items():
        top, left = int(y0 * SCENE_PX), int(x0 * SCENE_PX)
        out[top : top + half, left : left + half] = checkerboard(COLOURS[colours[name]], half, half)
    return out


def read_colour(pixels: np.ndarray) -> str:
    """The colour a checkerboard region shows: the :data:`COLOURS` entry nearest the mean of its even
    pixels (``x + y`` even, from the region's own top-left). Works on a crop at native resolution."""
    pixels = np.asarray(pixels, dtype=np.float64)
    even = (np.add.outer(np.arange(pixels.shape[0]), np.arange(pixels.shape[1])) % 2) == 0
    mean = pixels[even].mean(axis=0)
    return min(COLOURS, key=lambda n: float(((mean - np.array(COLOURS[n])) ** 2).sum()))


def question_text(quadrant: str) -> str:
    return f"<image>\nWhich colour, {', '.join(COLOURS)}, is the {quadrant} quadrant?"


def pair_question_text(first: str, second: str) -> str:
    return f"<image>\nWhich colours, {', '.join(COLOURS)}, are the {first} and the {second} quadrants, in that order?"


def count_question_text(colour: str) -> str:
    return f"<image>\nHow many of the four quadrants are {colour} (of {', '.join(COLOURS)})?"


def task_spec(seed: int, index: int) -> dict:
    """The ``index``-th ``colour_grid`` question of ``seed``: its id, image, quadrant colours, the gold
    calls' AOIs, the question, its answer and its ``question_type`` (the quadrant)."""
    rng = random.Random(f"colour_grid:{seed}:{index}")
    colours = {q: rng.choice(list(COLOURS)) for q in QUADRANTS}
    row_id = f"cg{seed}_{index:04d}"
    quadrant = rng.choice(list(QUADRANTS))
    return {
        "id": row_id, "image": f"{IMAGE_DIR}/{row_id}.png", "colours": colours, "quadrant": quadrant,
        "aois": [QUADRANTS[quadrant]],
        "question": question_text(quadrant), "answer": colours[quadrant], "question_type": quadrant,
    }


def pair_spec(seed: int, index: int) -> dict:
    """The ``index``-th ``colour_pair`` question of ``seed``: two different quadrants in the order asked, their
    gold crops in that order, the answer ``"<colour>, <colour>"`` (``question_type``: the two quadrants)."""
    rng = random.Random(f"colour_pair:{seed}:{index}")
    colours = {q: rng.choice(list(COLOURS)) for q in QUADRANTS}
    first, second = rng.sample(list(QUADRANTS), 2)
    row_id = f"cp{seed}_{index:04d}"
    return {
        "id": row_id, "image": f"EO_GYM_DATA/colour_pair/{row_id}.png", "colours": colours,
        "aois": [QUADRANTS[first], QUADRANTS[second]],
        "question": pair_question_text(first, second), "answer": f"{colours[first]}, {colours[second]}",
        "question_type": f"{first}+{second}",
    }


def count_spec(seed: int, index: int) -> dict:
    """The ``index``-th ``colour_count`` question of ``seed``: the count is drawn first (0 to 4 equally
    likely), then which quadrants show the asked colour, then the others' colours from the rest."""
    rng = random.Random(f"colour_count:{seed}:{index}")
    colour = rng.choice(list(COLOURS))
    count = rng.randint(0, len(QUADRANTS))
    showing = set(rng.sample(list(QUADRANTS), count))
    others = [c for c in COLOURS if c != colour]
    colours = {q: colour if q in showing else rng.choice(others) for q in QUADRANTS}
    row_id = f"cc{seed}_{index:04d}"
    return {
        "id": row_id, "image": f"EO_GYM_DATA/colour_count/{row_id}.png", "colours": colours,
        "aois": list(QUADRANTS.values()),
        "question": count_question_text(colour), "answer": str(count), "question_type": colour,
    }


@dataclass(frozen=True)
class Task:
    """A task family: how its ``index``-th question of a seed is drawn, and what its rows say."""

    name: str
    spec: Callable[[int, int], dict]
    system_prompt: str
    turn_tokens: int  # a turn's token budget: the gold call turn (its tool calls and <|im_end|>) with room
    # an episode's after the question (its turns, tool results and their images) with room: GRPO's completion
    episode_tokens: int


TASKS = {  # gold traces, in the tiny model's tokens: call turn 40, episode about 150 | 80, about 345 | 157, about 690
    "colour_grid": Task("colour_grid", task_spec, SYSTEM_PROMPT, turn_tokens=48, episode_tokens=512),
    "colour_pair": Task("colour_pair", pair_spec, PAIR_SYSTEM_PROMPT, turn_tokens=96, episode_tokens=640),
    "colour_count": Task("colour_count", count_spec, COUNT_SYSTEM_PROMPT, turn_tokens=176, episode_tokens=768),
}


def gold_row(spec: dict, crop_results: str | list[str], task: str = "colour_grid") -> dict:
    """The EO-Gym row of a question: one assistant turn calling the crop tool on each of ``spec["aois"]``,
    their results (``crop_results``, the tool's texts in order), then the final answer."""
    results = [crop_results] if isinstance(crop_results, str) else list(crop_results)
    calls = [
        {"id": f"call_{spec['id']}" + (f"_{k}" if len(results) > 1 else ""), "type": "function",
         "function": {"name": CROP_TOOL, "arguments": json.dumps({"aoi": aoi})}}
        for k, aoi in enumerate(spec["aois"])
    ]
    return {
        "id": spec["id"],
        "images": [spec["image"]],
        "tools": [CROP_SCHEMA],
        "messages": [
            {"role": "system", "content": TASKS[task].system_prompt},
            {"role": "user", "content": spec["question"]},
            {"role": "assistant", "content": "", "tool_calls": calls},
            *({"role": "tool", "content": text} for text in results),
            {"role": "assistant", "content": f"Final Answer: {spec['answer']}"},
        ],
        "gt_answer": spec["answer"],
        "data_source": f"eogym_sft.{task}",
        "question_type": spec["question_type"],
        "EO_task": task,
    }


def _png_bytes(pixels: np.ndarray) -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _write_atomic(path: Path, data: bytes) -> None:
    """Write then rename: a run killed mid-write leaves a dot-file, never half a scene under its name."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~umask())  # mkstemp makes 0600: a scene gets the user's umask as any output
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


BLOCK_BYTES = 4096  # a file's size on disk rounds up to whole blocks
LINE_BYTES = 2048  # a JSONL row: about 1.2 KB with one call, 2 KB with four


def check_disk(output: Path, rows: int, scene_bytes: int, n_crops: int) -> None:
    """Refuse a ``rows`` that cannot fit the disk (bytes or files) under ``output`` before anything is
    written. A question is its scene, its crops (each a part of the scene, so no larger) and its line."""
    files = rows * (1 + n_crops)
    need = files * -(-scene_bytes // BLOCK_BYTES) * BLOCK_BYTES + rows * LINE_BYTES
    probe = next(p for p in (output, *output.parents) if p.exists())
    disk = os.statvfs(probe)
    free = disk.f_bavail * disk.f_frsize
    if need > free:
        raise ValueError(f"--rows {rows} needs about {need / 1e9:,.1f} GB under {output}, which has {free / 1e9:,.1f} "
                         "GB free")
    if disk.f_files and files > disk.f_favail:  # f_files is 0 where the file system has no inode limit
        raise ValueError(f"--rows {rows} needs {files:,} files under {output}, where {disk.f_favail:,} more fit")


def write_task(
    output: str | Path, rows: int, seed: int = 0, start: int = 0, name: str = "tasks.jsonl", task: str = "colour_grid"
) -> Path:
    """Write ``rows`` questions of ``task`` (indices ``start`` to ``start + rows - 1`` of ``seed``) under
    ``output``: the scenes under ``EO_GYM_DATA/``, the crops of the gold calls under ``image_cache/`` (by
    the ``crop`` backend), the rows to ``output/name``. Returns the JSONL path.

    The same arguments write the same bytes. Rows stream to a temporary file renamed to ``name`` at the
    end, and every scene and crop is written then renamed: a run stopped at any point leaves no JSONL
    (the old one, if any, untouched) and no half-written image; a rerun rewrites what it needs."""
    if task not in TASKS:
        raise ValueError(f"no task {task!r}: choose one of {', '.join(TASKS)}")
    if rows < 1:
        raise ValueError(f"rows must be at least 1, got {rows}")
    check_file_name(name)  # a name inside output, never a path out of it
    family, output = TASKS[task], Path(output)
    first = family.spec(seed, start)
    check_disk(output, rows, len(_png_bytes(scene_pixels(first["colours"]))), len(first["aois"]))
    output.mkdir(parents=True, exist_ok=True)
    jsonl = output / name
    write_lines_atomic(
        jsonl,
        (
            json.dumps(_write_question(output, family.spec(seed, index), task)) + "\n"
            for index in range(start, start + rows)
        ),
    )
    return jsonl


def _write_question(output: Path, spec: dict, task: str) -> dict:
    """Write one question's scene and gold crops under ``output``; return its row."""
    from .env import EOGymEnvironment

    path = output / spec["image"]
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(path, _png_bytes(scene_pixels(spec["colours"])))
    env = EOGymEnvironment({"id": spec["id"], "images": [spec["image"]], "tools": [CROP_SCHEMA]}, output,
                           backends=("crop",))
    texts = []
    for aoi in spec["aois"]:
        result = env.call(CROP_TOOL, {"aoi": aoi})
        if not result.ok:
            raise RuntimeError(f"the crop backend refused the gold call of {spec['id']}: {result.text}")
        texts.append(result.text)
    return gold_row(spec, texts, task)
