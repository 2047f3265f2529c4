"""Write the bundled EO-Gym-format sample to ``eogym_sft/sample/`` (package data): deterministic, seeded, no network.

One command (run from the repository root)::

    python data_prep/make_sample.py                # writes eogym_sft/sample/
    python data_prep/make_sample.py --output DIR --seed 0

It writes ``eogym_sample.jsonl`` (40 good rows, then 4 deliberately bad ones) and the small images the
rows name: ``EO_GYM_DATA/<8hex>/<64hex>.jpg|png`` (scenes, frames, SAR) and ``image_cache/...png``
(crops and index previews that tool results name). The rows spread over every dialect that
``eogym_sft.data.traces`` accepts (see ``docs/data.md``):

* OpenAI ``tool_calls`` with ``arguments`` as a JSON string or as an object, results as role ``tool``
  (and one legacy ``function_call`` + role ``function`` row);
* Qwen/Hermes ``<tool_call>{...}</tool_call>`` text (sometimes two calls in a turn), results as
  ``user`` turns of ``<tool_response>...</tool_response>`` blocks;
* content as a string, as null (tool-call turns) and as a list of text/image parts;
* ``tools`` as a list and as a JSON string;
* row images bound by ``<image>`` tags, by bare ``{"type": "image"}`` parts, by parts naming their
  path, or (no placeholder) at the start of the first user turn;
* tool results naming ``image_cache/...png`` crops (sometimes behind an absolute cache prefix), and
  non-image outputs (``.nc`` NetCDF paths, JSON).

Rows marked long carry several crops, so that ``--max-length 2048`` must split them while 8192 holds
them whole. The bad rows at the end (malformed JSON, unknown role, invalid tool-call arguments, a
missing image) show the manifest at work. The pixels are synthetic (gradients, fields, roads,
objects, low noise) so that nothing is blank; everything fits in well under 2 MB.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
from pathlib import Path

import numpy as np
from PIL import Image

SYSTEM_PROMPT = (
    "You are an expert remote-sensing analyst. You must use the given tool to help you see the fine details "
    "of the image directly. 1. NEVER answer immediately. 2. ALWAYS call a tool first. 3. Only after you are "
    "finished with tools, reply on a single line as: Final Answer: <answer>. Keep the answer short: a number, "
    "a direction, a date or a few words."
)


def _fn(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


_IMAGE_URL = {"type": "string", "description": "Portable path of the image, e.g. EO_GYM_DATA/<id>/<hash>.jpg."}
TOOLS = {
    "get_optical_image_list": _fn(
        "get_optical_image_list",
        "List RGB images co-located with the provided frame, ordered by timestamp. Only return lists optical "
        "images without analyze content.",
        {"image_url": _IMAGE_URL},
        ["image_url"],
    ),
    "crop_optical_or_sar_image": _fn(
        "crop_optical_or_sar_image",
        "Crop an optical or SAR image by a normalized AOI and return the saved path.",
        {
            "image_url": _IMAGE_URL,
            "aoi": {
                "type": "array",
                "items": {"type": "number"},
                "description": "Normalized area of interest [x0, y0, x1, y1] in 0..1.",
            },
        },
        ["image_url", "aoi"],
    ),
    "get_multispectral_list": _fn(
        "get_multispectral_list",
        "Get several multispectral dataset locations (e.g., Sentinel-2/Landsat) for a given multispectral "
        "dataset location.",
        {"dataset_url": {"type": "string", "description": "Location of a multispectral dataset."}},
        ["dataset_url"],
    ),
    "compute_index": _fn(
        "compute_index",
        "Compute a spectral index over a multispectral dataset and return its statistics and output file.",
        {
            "dataset": {"type": "string", "description": "Path of a multispectral NetCDF dataset."},
            "index": {"type": "string", "enum": ["NDVI", "NDWI", "NBR", "NDBI"]},
        },
        ["dataset", "index"],
    ),
    "get_object_bbox_by_optical_image": _fn(
        "get_object_bbox_by_optical_image",
        "Detect objects of a category in an optical image and return their pixel bounding boxes.",
        {"image_url": _IMAGE_URL, "object_name": {"type": "string", "description": "Object category, e.g. ship."}},
        ["image_url", "object_name"],
    ),
    "get_sar_image": _fn(
        "get_sar_image",
        "Return the SAR acquisition co-registered with an optical frame.",
        {"image_url": _IMAGE_URL},
        ["image_url"],
    ),
    "get_image_metadata": _fn(
        "get_image_metadata",
        "Return the sensor, acquisition time, ground sampling distance and footprint of an image.",
        {"image_url": _IMAGE_URL},
        ["image_url"],
    ),
    "get_water_mask": _fn(
        "get_water_mask",
        "Segment open water in an optical or SAR image and return the mask path and water fraction.",
        {"image_url": _IMAGE_URL},
        ["image_url"],
    ),
}


class Writer:
    """Makes names, pixels and files; everything is drawn from one seeded generator."""

    def __init__(self, root: Path, seed: int):
        self.root = root
        self.rng = random.Random(seed)
        self.np = np.random.default_rng(seed)

    def hex(self, n: int) -> str:
        return "".join(self.rng.choice("0123456789abcdef") for _ in range(n))

    # ---- pixels ----------------------------------------------------------------------------------
    def scene(self, width: int, height: int) -> np.ndarray:
        """An RGB 'optical scene': gradient ground, crop fields, a road, bright objects, low noise."""
        r = self.np
        yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
        angle = r.uniform(0, np.pi)
        t = (xx * np.cos(angle) + yy * np.sin(angle)) / max(width, height)
        c0, c1 = r.uniform(40, 140, 3), r.uniform(90, 200, 3)
        img = c0[None, None, :] * (1 - t[..., None]) + c1[None, None, :] * t[..., None]
        for _ in range(r.integers(3, 7)):  # fields
            x0, y0 = r.integers(0, width), r.integers(0, height)
            w, h = r.integers(width // 8, width // 3 + 1), r.integers(height // 8, height // 3 + 1)
            img[y0 : y0 + h, x0 : x0 + w] = r.uniform(30, 220, 3)
        if r.random() < 0.7:  # a road
            y = int(r.integers(0, height))
            img[max(0, y - 2) : y + 2, :] = (170, 165, 150)
        for _ in range(r.integers(2, 9)):  # objects: planes, ships, buildings
            x0, y0 = r.integers(0, max(1, width - 8)), r.integers(0, max(1, height - 8))
            s = int(r.integers(3, 8))
            img[y0 : y0 + s, x0 : x0 + s] = r.uniform(200, 255, 3)
        # low-amplitude noise on 4x4 blocks, so PNG crops stay small
        noise = r.integers(-3, 4, size=((height + 3) // 4, (width + 3) // 4, 1)).astype(np.float32)
        img += np.kron(noise, np.ones((4, 4, 1), np.float32))[:height, :width]
        return np.clip(img, 0, 255).astype(np.uint8)

    def sar(self, width: int, height: int) -> np.ndarray:
        """A grayscale 'SAR' frame: dark water, brighter land, a few bright scatterers."""
        r = self.np
        base = np.full((height, width), 35, np.float32)
        cut = int(r.integers(width // 4, 3 * width // 4))
        base[:, cut:] = 110
        for _ in range(r.integers(2, 6)):
            x0, y0 = r.integers(0, cut), r.integers(0, height)
            base[y0 : y0 + 3, x0 : x0 + 6] = 250
        speckle = r.integers(-6, 7, size=((height + 3) // 4, (width + 3) // 4)).astype(np.float32)
        base += np.kron(speckle, np.ones((4, 4), np.float32))[:height, :width]
        return np.clip(base, 0, 255).astype(np.uint8)

    # ---- files -----------------------------------------------------------------------------------
    def save(self, rel: str, array: np.ndarray, mode: str | None = None) -> str:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        img = Image.fromarray(array)
        if mode == "P":  # palette PNG with a transparent index (an index preview)
            img = img.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
            img.save(path, transparency=0, optimize=True)
        elif rel.endswith(".jpg"):
            img.save(path, quality=70, optimize=True)
        else:
            img.save(path, optimize=True)
        return rel

    def data_image(self, width: int, height: int, ext: str = "jpg", sar: bool = False) -> tuple[str, np.ndarray]:
        """A new ``EO_GYM_DATA/<8hex>/<64hex>.<ext>`` scene; returns its path and pixels."""
        digest = self.hex(64)
        pixels = self.sar(width, height) if sar else self.scene(width, height)
        return self.save(f"EO_GYM_DATA/{digest[:8]}/{digest}.{ext}", pixels), pixels

    def crop(self, pixels: np.ndarray, aoi: list[float], max_side: int = 0) -> tuple[str, int, int, list[int]]:
        """Crop ``pixels`` by a normalized AOI into ``image_cache/crops/<32hex>.png``, as the EO tool does."""
        height, width = pixels.shape[:2]
        box = [round(aoi[0] * width), round(aoi[1] * height), round(aoi[2] * width), round(aoi[3] * height)]
        part = pixels[box[1] : box[3], box[0] : box[2]]
        if max_side and max(part.shape[:2]) > max_side:  # keep the bundle small
            step = -(-max(part.shape[:2]) // max_side)
            part = part[::step, ::step]
        rel = self.save(f"image_cache/crops/{self.hex(32)}.png", np.ascontiguousarray(part))
        return rel, part.shape[1], part.shape[0], box


# ---- logical traces ------------------------------------------------------------------------------
# A trace is dialect-free: a question, the row images, steps of (thought, [(tool, args)], [result]),
# and a final answer. ``result`` is (text, None) or (text, crop path): the crop is named in the text.


def _aoi(rng: random.Random, size: float = 0.5) -> list[float]:
    x0, y0 = round(rng.uniform(0, 1 - size), 2), round(rng.uniform(0, 1 - size), 2)
    return [x0, y0, round(x0 + size, 2), round(y0 + size, 2)]


def _crop_result(
    w: Writer, src: str, pixels: np.ndarray, aoi: list[float], max_side: int = 0, prefix: str = ""
) -> tuple[str, str]:
    rel, cw, ch, box = w.crop(pixels, aoi, max_side)
    text = json.dumps({"cropped_path": prefix + rel, "width": cw, "height": ch, "bbox_px": box, "aoi_norm": aoi})
    return text, rel


def task_temporal(w: Writer, k: int, long: bool = False) -> dict:
    rng = w.rng
    frame, pixels = w.data_image(rng.choice([256, 320, 384]), rng.choice([224, 256]))
    others = [w.data_image(128, 96) for _ in range(2)]  # the co-located frames the listing names
    years = sorted(rng.sample(range(2015, 2023), 2))
    listing = json.dumps(
        [
            {"timestamp": f"{y}-0{rng.randint(1, 9)}-1{rng.randint(0, 9)}", "image_url": p}
            for y, (p, _) in zip(years, others)
        ]
    )
    steps = [
        (
            "I will list the co-located optical frames first.",
            [("get_optical_image_list", {"image_url": frame})],
            [(listing, None)],
        )
    ]
    crops = [(frame, pixels)] + (others if long else others[:1])
    for src, px in crops:
        aoi = _aoi(rng, 0.5)
        steps.append(
            (
                f"Let me crop the construction area in {src.split('/')[-1][:8]}.",
                [("crop_optical_or_sar_image", {"image_url": src, "aoi": aoi})],
                [_crop_result(w, src, px, aoi, 96)],
            )
        )
    answer = str(years[rng.randint(0, 1)]) if k % 3 else "Next frame not available"
    return {
        "question": "In which year was the large building in the centre of this frame completed? The frames are listed by the tools.",
        "images": [frame],
        "steps": steps,
        "final": f"Comparing the frames, the roof first appears in the later acquisition.\nFinal Answer: {answer}",
        "gt": answer,
        "meta": ("fmow", "optical temporal analysis", "Temporal Reasoning"),
        "tools": ["get_optical_image_list", "crop_optical_or_sar_image", "get_image_metadata"],
    }


def task_moving(w: Writer, k: int, long: bool = False) -> dict:
    rng = w.rng
    img, pixels = w.data_image(rng.choice([448, 600]), rng.choice([320, 384]), ext=rng.choice(["jpg", "png"]))
    boxes = [
        [rng.randint(20, 200), rng.randint(20, 200), rng.randint(210, 300), rng.randint(210, 300)] for _ in range(2)
    ]
    det = json.dumps({"object": "ship", "count": len(boxes), "boxes": boxes})
    steps = [
        (
            "First I locate the ships.",
            [("get_object_bbox_by_optical_image", {"image_url": img, "object_name": "ship"})],
            [(det, None)],
        )
    ]
    for n in range(3 if long else 1):
        aoi = _aoi(rng, 0.4)
        prefix = "/srv/eo_gym/" if k % 4 == 1 else ""  # a tool server's absolute cache prefix
        steps.append(
            (
                "Now I zoom on the wake behind the ship." if n == 0 else "I check the wake at the stern once more.",
                [("crop_optical_or_sar_image", {"image_url": img, "aoi": aoi})],
                [_crop_result(w, img, pixels, aoi, 200 if long else 128, prefix)],
            )
        )
    answer = rng.choice(["north-east", "south", "west", "north-west"])
    return {
        "question": "Which direction is the largest ship moving?",
        "images": [img],
        "steps": steps,
        "final": f"The V-shaped wake trails behind the stern, so the ship heads {answer}.\nFinal Answer: {answer}",
        "gt": answer,
        "meta": ("fair1_vhr", "moving reasoning", "Spatial Navigation"),
        "tools": [
            "get_object_bbox_by_optical_image",
            "crop_optical_or_sar_image",
            "get_image_metadata",
            "get_sar_image",
        ],
    }


def task_counting(w: Writer, k: int, long: bool = False) -> dict:
    rng = w.rng
    img, pixels = w.data_image(rng.choice([256, 333, 480]), rng.choice([217, 256, 360]))
    n = rng.randint(2, 9)
    boxes = [
        [rng.randint(0, 100), rng.randint(0, 100), rng.randint(101, 200), rng.randint(101, 200)] for _ in range(n)
    ]
    steps = [
        (
            "I detect the airplanes on the apron.",
            [("get_object_bbox_by_optical_image", {"image_url": img, "object_name": "airplane"})],
            [(json.dumps({"object": "airplane", "count": n, "boxes": boxes}), None)],
        )
    ]
    if k % 2 == 0:
        aoi = _aoi(rng, 0.6)
        steps.append(
            (
                "I verify the detections on a crop.",
                [("crop_optical_or_sar_image", {"image_url": img, "aoi": aoi})],
                [_crop_result(w, img, pixels, aoi, 128)],
            )
        )
    return {
        "question": "How many airplanes are parked in this image?",
        "images": [img],
        "steps": steps,
        "final": f"The detector and the crop agree.\nFinal Answer: {n}",
        "gt": str(n),
        "meta": ("fair1_vhr", "object counting", "Object Counting"),
        "tools": ["get_object_bbox_by_optical_image", "crop_optical_or_sar_image", "get_image_metadata"],
    }


def task_disaster(w: Writer, k: int, long: bool = False) -> dict:
    """Pre/post images; each step crops both (two calls in one turn)."""
    rng = w.rng
    size = rng.choice([320, 384])
    pre, pre_px = w.data_image(size, size)
    post, post_px = w.data_image(size, size)
    steps = []
    for n in range(4 if long else 1):
        aoi = _aoi(rng, 0.5)
        steps.append(
            (
                "I crop the same block before and after the event." if n == 0 else f"Next block, area {n + 1}.",
                [
                    ("crop_optical_or_sar_image", {"image_url": pre, "aoi": aoi}),
                    ("crop_optical_or_sar_image", {"image_url": post, "aoi": aoi}),
                ],
                [_crop_result(w, pre, pre_px, aoi, 128), _crop_result(w, post, post_px, aoi, 128)],
            )
        )
    answer = str(rng.randint(0, 12))
    return {
        "question": "The first image is before the hurricane and the second after it. How many buildings were destroyed?",
        "images": [pre, post],
        "steps": steps,
        "final": f"Counting roofs missing in the post-event crops.\nFinal Answer: {answer}",
        "gt": answer,
        "meta": ("xbd", "building damage assessment", "Disaster Impact"),
        "tools": [
            "crop_optical_or_sar_image",
            "get_object_bbox_by_optical_image",
            "get_image_metadata",
            "get_optical_image_list",
        ],
    }


def task_multispectral(w: Writer, k: int, long: bool = False) -> dict:
    """No row images: NetCDF paths and index statistics (one run attaches a palette PNG preview)."""
    rng = w.rng
    site = w.hex(8)
    sensor = rng.choice(["S2", "LC08"])
    ncs = [f"EO_GYM_DATA/{site}/{w.hex(56)}_{sensor}_{y}.nc" for y in (2019, 2023)]
    index = rng.choice(["NDVI", "NDWI", "NBR"])
    stats = [round(rng.uniform(-0.2, 0.8), 3) for _ in ncs]
    results = []
    for nc, mean in zip(ncs, stats):
        out = {
            "index": index,
            "mean": mean,
            "std": round(rng.uniform(0.02, 0.2), 3),
            "output_path": f"image_cache/index/{w.hex(24)}.nc",
        }
        if k % 3 == 0:
            preview = w.save(f"image_cache/index/{w.hex(24)}_{index.lower()}.png", w.scene(96, 96), mode="P")
            out["preview_path"] = preview
        results.append((json.dumps(out), None))
    steps = [
        (
            "I look up the multispectral acquisitions for this site.",
            [("get_multispectral_list", {"dataset_url": f"EO_GYM_DATA/{site}/{sensor}"})],
            [(json.dumps({"datasets": ncs}), None)],
        ),
        (
            f"I compute {index} for both dates.",
            [("compute_index", {"dataset": nc, "index": index}) for nc in ncs],
            results,
        ),
    ]
    trend = "increased" if stats[1] > stats[0] else "decreased"
    return {
        "question": f"Has vegetation/water cover at site {site} increased or decreased between 2019 and 2023 according to {index}?",
        "images": [],
        "steps": steps,
        "final": f"The mean {index} went from {stats[0]} to {stats[1]}.\nFinal Answer: {trend}",
        "gt": trend,
        "meta": (
            "sentinel2" if sensor == "S2" else "landsat",
            "multispectral change analysis",
            "Geospatial Reasoning",
        ),
        "tools": ["get_multispectral_list", "compute_index", "get_image_metadata"],
    }


def task_sar(w: Writer, k: int, long: bool = False) -> dict:
    """Optical + grayscale SAR row images; a crop of the SAR frame."""
    rng = w.rng
    opt, _ = w.data_image(256, 256)
    sar, sar_px = w.data_image(256, 192, ext="png", sar=True)
    aoi = _aoi(rng, 0.5)
    n = rng.randint(1, 6)
    steps = [
        (
            "The optical frame is cloudy, so I crop the SAR image.",
            [("crop_optical_or_sar_image", {"image_url": sar, "aoi": aoi})],
            [_crop_result(w, sar, sar_px, aoi, 128)],
        )
    ]
    if k % 2:
        steps.append(
            (
                "I also check the water extent.",
                [("get_water_mask", {"image_url": sar})],
                [
                    (
                        json.dumps(
                            {
                                "water_fraction": round(rng.uniform(0.2, 0.7), 2),
                                "mask_path": f"image_cache/masks/{w.hex(24)}.nc",
                            }
                        ),
                        None,
                    )
                ],
            )
        )
    return {
        "question": "The second image is a SAR acquisition of the same harbour. How many ships are moored at the pier?",
        "images": [opt, sar],
        "steps": steps,
        "final": f"Bright point scatterers line the pier.\nFinal Answer: {n}",
        "gt": str(n),
        "meta": ("m4_sar", "sar ship counting", "Cross-modal Reasoning"),
        "tools": ["crop_optical_or_sar_image", "get_sar_image", "get_water_mask", "get_image_metadata"],
    }


def task_direct(w: Writer, k: int, long: bool = False) -> dict:
    """A 3-message row: no tool call at all (EO-Gym has rows of 3 messages)."""
    img, _ = w.data_image(64, 64, ext="png")
    return {
        "question": "Is this tile land or water?",
        "images": [img],
        "steps": [],
        "final": "Final Answer: land",
        "gt": "land",
        "meta": ("fmow", "land cover", "Spatial Navigation"),
        "tools": ["crop_optical_or_sar_image", "get_image_metadata"],
    }


TASKS = [task_temporal, task_moving, task_counting, task_disaster, task_multispectral, task_sar]


# ---- dialects ------------------------------------------------------------------------------------


def _row_tools(w: Writer, needed: list[str]) -> list[dict]:
    names = list(needed)
    extra = [n for n in TOOLS if n not in names]
    w.rng.shuffle(extra)
    names += extra[: w.rng.randint(max(0, 5 - len(names)), 6 - len(names))]
    w.rng.shuffle(names)  # the first tool differs from row to row
    return [TOOLS[n] for n in names]


def _user_turn(question: str, images: list[str], binding: str) -> dict:
    """The question turn with the row images bound by ``binding``."""
    if binding == "tags":  # <image> placeholders in a string
        return {"role": "user", "content": "".join("<image>\n" for _ in images) + question}
    if binding == "parts":  # bare {"type": "image"} parts that take the row images in order
        return {"role": "user", "content": [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]}
    if binding == "paths":  # image parts that name their file
        return {
            "role": "user",
            "content": [{"type": "image", "image": p} for p in images] + [{"type": "text", "text": question}],
        }
    return {"role": "user", "content": question}  # "none": row images go to the start of this turn


def _openai_messages(trace: dict, w: Writer, args_as: str, null_content: bool, list_results: bool) -> list[dict]:
    out = []
    for thought, calls, results in trace["steps"]:
        ids = [f"call_{w.hex(8)}" for _ in calls]
        tool_calls = [
            {
                "id": i,
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args) if args_as == "string" else args},
            }
            for i, (name, args) in zip(ids, calls)
        ]
        out.append({"role": "assistant", "content": None if null_content else thought, "tool_calls": tool_calls})
        for i, (name, _), (text, _) in zip(ids, calls, results):
            content = [{"type": "text", "text": text}] if list_results else text
            out.append({"role": "tool", "tool_call_id": i, "name": name, "content": content})
    return out


def _hermes_messages(trace: dict) -> list[dict]:
    out = []
    for thought, calls, results in trace["steps"]:
        blocks = "\n".join(
            "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>" for name, args in calls
        )
        out.append({"role": "assistant", "content": f"{thought}\n{blocks}"})
        out.append(
            {"role": "user", "content": "\n".join(f"<tool_response>\n{text}\n</tool_response>" for text, _ in results)}
        )
    return out


def _legacy_messages(trace: dict) -> list[dict]:
    """Legacy OpenAI: one ``function_call`` per turn, results as role ``function``."""
    out = []
    for thought, calls, results in trace["steps"]:
        for (name, args), (text, _) in zip(calls, results):
            out.append(
                {
                    "role": "assistant",
                    "content": thought,
                    "function_call": {"name": name, "arguments": json.dumps(args)},
                }
            )
            out.append({"role": "function", "name": name, "content": text})
    return out


# Row recipes: (task, dialect, image binding, tools as JSON string, long). 40 rows.
RECIPES = [
    (0, "openai_str", "tags", False, False),
    (1, "openai_obj", "none", False, False),
    (2, "hermes", "tags", False, False),
    (3, "hermes", "parts", False, False),  # two <tool_call> blocks per turn
    (4, "openai_str", "none", True, False),
    (5, "openai_obj_null", "parts", False, False),
    (6, "openai_str", "tags", False, False),  # direct answer, 3 messages
    (0, "hermes", "none", False, False),
    (1, "openai_str_list", "paths", False, False),
    (2, "openai_obj", "tags", True, False),
    (3, "openai_str_null", "tags", False, True),  # long
    (4, "hermes", "none", False, False),
    (5, "legacy", "tags", False, False),
    (0, "openai_obj", "parts", False, True),  # long
    (1, "hermes", "tags", True, True),  # long
    (2, "openai_str_null", "none", False, False),
    (3, "openai_obj_list", "none", False, False),
    (4, "openai_obj_null", "none", False, False),
    (5, "hermes", "parts", False, False),
    (0, "openai_str", "paths", False, False),
    (1, "openai_str_null", "tags", False, False),
    (2, "hermes", "paths", False, False),
    (3, "hermes", "tags", True, True),  # long, Hermes, two calls per turn
    (4, "openai_str_list", "none", False, False),
    (5, "openai_obj", "tags", False, False),
    (6, "hermes", "none", False, False),  # direct answer, no placeholder
    (0, "openai_str", "none", True, False),
    (1, "openai_obj_null", "parts", False, False),
    (2, "openai_str", "tags", False, False),
    (3, "openai_obj", "paths", False, False),
    (4, "hermes", "none", True, False),
    (5, "openai_str_null", "tags", False, False),
    (0, "hermes", "tags", False, False),
    (1, "openai_str", "none", False, False),
    (2, "openai_obj_list", "parts", False, False),
    (3, "openai_str", "none", False, False),
    (4, "openai_obj", "none", False, False),
    (5, "openai_obj", "paths", True, False),
    (1, "openai_str", "tags", False, True),  # long
    (2, "hermes", "none", False, False),
]


def make_row(w: Writer, index: int, recipe) -> dict:
    task, dialect, binding, tools_as_string, long = recipe
    trace = (TASKS + [task_direct])[task](w, index, long)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, _user_turn(trace["question"], trace["images"], binding)]
    if dialect == "hermes":
        messages += _hermes_messages(trace)
    elif dialect == "legacy":
        messages += _legacy_messages(trace)
    else:
        args_as = "string" if dialect.startswith("openai_str") else "object"
        messages += _openai_messages(trace, w, args_as, dialect.endswith("_null"), dialect.endswith("_list"))
    messages.append({"role": "assistant", "content": trace["final"]})
    tools = _row_tools(w, trace["tools"])
    data_source, question_type, eo_task = trace["meta"]
    return {
        "id": f"train_{index:07d}_{w.hex(12)}",
        "images": trace["images"],
        "tools": json.dumps(tools) if tools_as_string else tools,
        "messages": messages,
        "gt_answer": trace["gt"],
        "data_source": data_source,
        "question_type": question_type,
        "EO_task": eo_task,
    }


def bad_lines(w: Writer, start: int) -> list[str]:
    """Four rows that data prep must drop, each with its own reason."""
    base = make_row(w, start, (2, "openai_str", "tags", False, False))
    malformed = json.dumps(base)[:-40]  # cut off mid-row: malformed_json

    unknown = make_row(w, start + 1, (2, "openai_obj", "none", False, False))
    unknown["messages"].insert(2, {"role": "observer", "content": "The operator looks at the screen."})  # unknown_role

    bad_args = make_row(w, start + 2, (1, "openai_str", "tags", False, False))
    call = bad_args["messages"][2]["tool_calls"][0]["function"]
    call["arguments"] = call["arguments"][:-9]  # truncated JSON string: invalid_tool_arguments

    missing = make_row(w, start + 3, (2, "hermes", "tags", False, False))
    digest = w.hex(64)  # an image that was never extracted: missing_image
    missing["images"] = [f"EO_GYM_DATA/{digest[:8]}/{digest}.jpg"]
    return [malformed, json.dumps(unknown), json.dumps(bad_args), json.dumps(missing)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", default="eogym_sft/sample", help="folder to write the sample to (replaced)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    root = Path(args.output)
    for part in ("EO_GYM_DATA", "image_cache", "eogym_sample.jsonl"):  # start clean: same seed, same files
        target = root / part
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
    root.mkdir(parents=True, exist_ok=True)
    w = Writer(root, args.seed)
    lines = [json.dumps(make_row(w, i, recipe)) for i, recipe in enumerate(RECIPES)]
    lines += bad_lines(w, len(RECIPES))
    (root / "eogym_sample.jsonl").write_text("\n".join(lines) + "\n")
    files = [p for p in root.rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(files))).hexdigest()[:16]
    print(f"wrote {len(lines)} rows and {len(files) - 1} images to {root} ({size / 1e6:.2f} MB, sha256 {digest})")


if __name__ == "__main__":
    main()
