"""A learnable EO-Gym task family whose answer only the crop tool can reveal: ``colour_grid``.

Each scene is a ``SCENE_PX`` x ``SCENE_PX`` PNG split into four quadrants. Every quadrant is painted with a
one-pixel checkerboard of a colour and its complement (``c`` and ``255 - c``), the colour drawn from
:data:`COLOURS`. The question names one quadrant and asks for its colour.

Why only the tool reveals it: a checkerboard of ``c`` and ``255 - c`` averages to mid-grey under any
antialiased downscale by two or more, so at a pixel cap of a quarter of the scene's pixels (the agent
demo's, ``SCENE_PX**2 / 4``) every quadrant of the full image is the same grey whatever its colour.
``crop_optical_or_sar_image`` on the named quadrant returns it at its native resolution, where the
checkerboard, and so the colour, is intact. The full image alone scores chance (1 in ``len(COLOURS)``).

Rows are EO-Gym's own format (``id``, ``images``, ``tools`` as OpenAI schemas, ``messages`` from the system
prompt to ``Final Answer: <colour>``, ``gt_answer``, ``data_source``, ``question_type``, ``EO_task``). The
gold trace calls the real crop tool with the quadrant's normalised AOI (and no ``image_url``: the task's
schema makes it optional, and the ``crop`` backend then crops the row's only image), and its tool result
is what the environment's ``crop`` backend returns for that call (it writes the crop under ``image_cache/``).
Pure functions but :func:`write_task`, which writes images and JSONL.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

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
SYSTEM_PROMPT = "The image is too coarse to show texture: crop the quadrant asked about, then reply: Final Answer: <colour>."
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


def task_spec(seed: int, index: int) -> dict:
    """The ``index``-th question of ``seed``: its id, image path, quadrant colours and asked quadrant."""
    rng = random.Random(f"colour_grid:{seed}:{index}")
    colours = {q: rng.choice(list(COLOURS)) for q in QUADRANTS}
    row_id = f"cg{seed}_{index:04d}"
    return {"id": row_id, "image": f"{IMAGE_DIR}/{row_id}.png", "colours": colours, "quadrant": rng.choice(list(QUADRANTS))}


def gold_row(spec: dict, crop_result: str) -> dict:
    """The EO-Gym row of a question, its gold trace calling the crop tool; ``crop_result`` is the tool's text."""
    quadrant, answer = spec["quadrant"], spec["colours"][spec["quadrant"]]
    call = {"aoi": QUADRANTS[quadrant]}
    return {
        "id": spec["id"],
        "images": [spec["image"]],
        "tools": [CROP_SCHEMA],
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": question_text(quadrant)},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": f"call_{spec['id']}", "type": "function", "function": {"name": CROP_TOOL, "arguments": json.dumps(call)}}
                ],
            },
            {"role": "tool", "content": crop_result},
            {"role": "assistant", "content": f"Final Answer: {answer}"},
        ],
        "gt_answer": answer,
        "data_source": DATA_SOURCE,
        "question_type": quadrant,
        "EO_task": "colour_grid",
    }


def write_task(output: str | Path, rows: int, seed: int = 0, start: int = 0, name: str = "tasks.jsonl") -> Path:
    """Write ``rows`` questions (indices ``start`` to ``start + rows - 1`` of ``seed``) under ``output``: the
    scenes under ``EO_GYM_DATA/``, the crops of the gold calls under ``image_cache/`` (by the ``crop``
    backend), the rows to ``output/name``. Returns the JSONL path."""
    from PIL import Image

    from .env import EOGymEnvironment

    if rows < 1:
        raise ValueError(f"rows must be at least 1, got {rows}")
    output = Path(output)
    lines = []
    for index in range(start, start + rows):
        spec = task_spec(seed, index)
        path = output / spec["image"]
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(scene_pixels(spec["colours"])).save(path, format="PNG")
        env = EOGymEnvironment({"id": spec["id"], "images": [spec["image"]], "tools": [CROP_SCHEMA]}, output, backends=("crop",))
        result = env.call(CROP_TOOL, {"aoi": QUADRANTS[spec["quadrant"]]})
        if not result.ok:
            raise RuntimeError(f"the crop backend refused the gold call of {spec['id']}: {result.text}")
        lines.append(json.dumps(gold_row(spec, result.text)))
    jsonl = output / name
    jsonl.write_text("\n".join(lines) + "\n")
    return jsonl
