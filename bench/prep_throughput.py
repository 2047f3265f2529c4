"""Data-prep throughput: rows/s per core of ``eogym_sft.data.prepare.prepare_files`` on an EO-Gym-shaped sample.

One command::

    python bench/prep_throughput.py                      # 400 rows, --num-proc 1 and os.cpu_count()
    python bench/prep_throughput.py --breakdown          # + CPU time per stage (template, tokeniser, ...)
    python bench/prep_throughput.py --rows 2000 --num-proc 1 4 8 16 --json out.json

It (a) writes a deterministic, scaled-up EO-Gym-shaped sample (row images up to 4000x4000 px, tool
results naming ``image_cache/...png`` crops, 5-15 tool schemas a row, mostly the OpenAI ``tool_calls``
dialect, some Qwen/Hermes ``<tool_call>`` text), (b) writes the tiny offline model folder (only its
processor matters here), (c) times ``prepare_files`` wall-clock and CPU for each ``--num-proc`` value,
worker start-up included, noting when each chunk of results arrives, and (d) prints a table and writes
JSON with rows/s, rows/s per core (overall, and steady: after the first round of chunks), rows per CPU
second, and the projected time for the 7,642-row train split on 16 cores (time to the first result +
7,642 / (16 x steady rows/s per core)), plus machine info. A fresh-interpreter probe times what each
spawned worker pays before its first row. ``bench/README.md`` describes every figure.

Images are written fast: a handful of distinct files (a small noise tile upscaled, with pixel-level
grain so that JPEG and PNG bodies are as dense as imagery's) are written once and hard-linked (copied
where links fail) under many hashed names. Data prep checks each distinct path once (its header for the
size, its whole body for truncation), so every row naming its own files costs what real data costs,
except for disk reads: the linked files share the page cache.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from eogym_sft.config import SampleConfig

TRAIN_ROWS = 7642  # EO-Gym train split
TARGET_CORES = 16
TARGET_SECONDS = 60.0

# (width, height, format) of the distinct row images; sizes as EO-Gym's scenes and tiles come.
ROW_IMAGE_SHAPES = [
    (4000, 4000, "JPEG"), (4000, 3000, "JPEG"), (3840, 2160, "JPEG"), (3000, 2000, "JPEG"),
    (2500, 2500, "PNG"), (2048, 2048, "PNG"), (1500, 1500, "JPEG"), (1200, 800, "PNG"),
    (1024, 1024, "PNG"), (800, 600, "JPEG"), (600, 600, "PNG"), (512, 512, "PNG"),
]
# Crops that tools write to image_cache/ (always PNG).
CROP_SHAPES = [(128, 128), (224, 224), (256, 256), (320, 240), (384, 384), (512, 512), (640, 480),
               (768, 768), (1024, 768), (1024, 1024), (1280, 720), (2048, 1024)]

TOOL_NAMES = [
    "load_scene", "crop_region", "zoom", "compute_ndvi", "compute_ndwi", "cloud_mask", "detect_objects",
    "segment_landcover", "count_objects", "measure_area", "measure_distance", "change_detection",
    "query_metadata", "reproject", "histogram", "band_math", "read_netcdf", "time_series", "geocode",
    "super_resolve",
]
EO_TASKS = ["object_counting", "change_detection", "land_cover", "disaster_assessment", "ocean_monitoring", "agriculture"]
QUESTION_TYPES = ["counting", "multiple_choice", "numeric", "yes_no", "open"]
DATA_SOURCES = ["sentinel2", "landsat8", "xview", "dota", "fmow", "era5"]
WORDS = (
    "the scene shows a coastal area with several ships near the harbour and agricultural fields to the "
    "north; vegetation index is high over the fields while the water body has low reflectance in the red "
    "band. I need to inspect the region more closely before counting the objects and measuring the area "
    "of the flooded zone compared with the reference acquisition from the previous season"
).split()

SYSTEM_PROMPT = (
    "You are EO-Agent, an expert assistant for Earth-observation analysis. You can call tools to load "
    "satellite scenes, crop and zoom into regions, compute spectral indices (NDVI, NDWI), detect and "
    "count objects, segment land cover, compare acquisitions over time and read gridded NetCDF "
    "products. Think step by step. Call one or more tools when you need more evidence; every tool "
    "returns a JSON result, and image-producing tools write a PNG crop under image_cache/ that is shown "
    "to you. Coordinates are pixel coordinates in the original image unless stated otherwise. When you "
    "are confident, reply with a line starting with 'Final Answer:' followed by the answer only, in the "
    "format the question asks for. Never invent tool outputs."
)


def _text(rng: random.Random, lo: int, hi: int) -> str:
    n = rng.randint(lo, hi)
    start = rng.randrange(len(WORDS))
    return " ".join(WORDS[(start + k) % len(WORDS)] for k in range(n)).capitalize() + "."


def _tool_schema(name: str, rng: random.Random) -> dict:
    props = {
        "image": {"type": "string", "description": "path of the image to operate on"},
        "bbox": {"type": "array", "items": {"type": "integer"}, "description": "[x0, y0, x1, y1] in pixels"},
    }
    for k in range(rng.randint(0, 3)):
        props[f"param_{k}"] = {"type": rng.choice(["number", "string", "boolean"]), "description": _text(rng, 3, 9)}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name.replace('_', ' ').capitalize()}: {_text(rng, 6, 18)}",
            "parameters": {"type": "object", "properties": props, "required": ["image"]},
        },
    }


def _digest(*parts) -> str:
    return hashlib.sha1("/".join(map(str, parts)).encode()).hexdigest()[:16]


def _grain(img, rng):
    """Pixel-level noise (sigma 12) on a smooth image: a body as dense to decode as imagery's."""
    import numpy as np
    from PIL import Image

    arr = np.asarray(img, dtype=np.int16) + rng.normal(0, 12, (img.height, img.width, 1)).astype(np.int16)
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8), "RGB")


def _unit(*parts) -> float:
    """A deterministic number in [0, 1) from ``parts``: decisions that must not consume the row's rng."""
    return int(_digest(*parts), 16) / 16**16


LISTING_TOOL = "get_optical_image_list"
LISTING_SCHEMA = {
    "type": "function",
    "function": {
        "name": LISTING_TOOL,
        "description": "List RGB images co-located with the provided frame, ordered by timestamp. Only return lists "
                       "optical images without analyze content.",
        "parameters": {"type": "object", "properties": {"image": {"type": "string"}}, "required": ["image"]},
    },
}


def _listing(row_id: str, task: str, step: int, files: list) -> dict:
    """A get_optical_image_list result: 2-6 co-located frames (row-image files), appended to ``files``."""
    frames = []
    for k in range(2 + int(_unit(row_id, "frames", step) * 5)):
        src = int(_unit(row_id, "frame", step, k) * len(ROW_IMAGE_SHAPES))
        rel = f"EO_GYM_DATA/{task}/{_digest(row_id, 'frame', step, k)}{'.jpg' if ROW_IMAGE_SHAPES[src][2] == 'JPEG' else '.png'}"
        files.append(("row", src, rel))
        frames.append({"timestamp": f"20{15 + k}-06-01", "image_url": rel})
    return {"status": "ok", "images": frames}


def _write_pool(pool: Path) -> tuple[list[Path], list[Path]]:
    """The distinct image files (noise tiles upscaled), written once."""
    import numpy as np
    from PIL import Image

    pool.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    rows, crops = [], []
    for k, (w, h, fmt) in enumerate(ROW_IMAGE_SHAPES):
        path = pool / f"row_{k}_{w}x{h}.{'jpg' if fmt == 'JPEG' else 'png'}"
        if not path.exists():
            tile = Image.fromarray(rng.integers(0, 256, (24, 24, 3), dtype=np.uint8), "RGB")
            img = _grain(tile.resize((w, h), Image.Resampling.BILINEAR), rng)
            img.save(path, fmt, **({"quality": 85} if fmt == "JPEG" else {"compress_level": 1}))
        rows.append(path)
    for k, (w, h) in enumerate(CROP_SHAPES):
        path = pool / f"crop_{k}_{w}x{h}.png"
        if not path.exists():
            tile = Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8), "RGB")
            _grain(tile.resize((w, h), Image.Resampling.BILINEAR), rng).save(path, "PNG", compress_level=1)
        crops.append(path)
    return rows, crops


def _place(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists():
        return
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def make_row(i: int, rng: random.Random, listing_share: float = 0.0) -> tuple[dict, list[tuple[str, int, str]]]:
    """Row ``i`` of the sample and the image files it names: ``(row, [(pool, index, rel_path)])``,
    ``pool`` being ``"row"`` (an index into ROW_IMAGE_SHAPES) or ``"crop"`` (into CROP_SHAPES).

    With ``listing_share`` > 0, about that share of tool calls are ``get_optical_image_list`` listings
    whose results name co-located ``EO_GYM_DATA/`` frames; the rng draws stay the same, so 0 gives
    exactly the rows of the throughput bench."""
    task = rng.choice(EO_TASKS)
    row_id = f"eogym-bench-{i:06d}"
    hermes = rng.random() < 0.15  # mostly the OpenAI tool_calls dialect
    tools = [_tool_schema(n, rng) for n in rng.sample(TOOL_NAMES, rng.randint(5, 15))]
    names = [t["function"]["name"] for t in tools]
    files = []

    images = []
    for k in range(rng.randint(1, 5)):
        src = rng.randrange(len(ROW_IMAGE_SHAPES))
        ext = ".jpg" if ROW_IMAGE_SHAPES[src][2] == "JPEG" else ".png"
        rel = f"EO_GYM_DATA/{task}/{_digest(row_id, k)}{ext}"
        files.append(("row", src, rel))
        images.append(rel)
    question = f"{_text(rng, 10, 40)} How many objects of interest are visible, and what is their total area?"
    if rng.random() < 0.5:  # explicit <image> placeholders, else the images go first in the user turn
        question = "".join("<image>" for _ in images) + "\n" + question
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]

    if listing_share:
        tools.append(LISTING_SCHEMA)
    for step in range(rng.randint(1, 6)):
        name = rng.choice(names)
        listing = _unit(row_id, "listing", step) < listing_share
        if listing:
            name = LISTING_TOOL
        args = {"image": images[0], "bbox": [rng.randrange(0, 2000) for _ in range(4)]}
        if rng.random() < 0.3:
            args["threshold"] = round(rng.random(), 3)
        thought = _text(rng, 15, 70)
        if hermes:
            call = json.dumps({"name": name, "arguments": args})
            messages.append({"role": "assistant", "content": f"{thought}\n<tool_call>\n{call}\n</tool_call>"})
        else:
            arguments = json.dumps(args) if rng.random() < 0.8 else args  # JSON string, sometimes an object
            messages.append({
                "role": "assistant",
                "content": thought,
                "tool_calls": [{"id": f"call_{step}", "type": "function", "function": {"name": name, "arguments": arguments}}],
            })
        if listing:
            rng.random()  # the draw the other branches make
            result = _listing(row_id, task, step, files)
        elif rng.random() < 0.85:
            rel = f"image_cache/{_digest(row_id, 'crop', step)}.png"
            files.append(("crop", rng.randrange(len(CROP_SHAPES)), rel))
            result = {"status": "ok", "output_image": f"/srv/eo_tools/cache/{rel}", "summary": _text(rng, 8, 40)}
        else:
            result = {"status": "ok", "output_file": f"EO_GYM_DATA/{task}/{_digest(row_id, 'nc', step)}.nc",
                      "values": [round(rng.uniform(-1, 1), 4) for _ in range(rng.randint(3, 12))]}
        result_text = json.dumps(result)
        if hermes:
            messages.append({"role": "user", "content": f"<tool_response>\n{result_text}\n</tool_response>"})
        else:
            messages.append({"role": "tool", "tool_call_id": f"call_{step}", "content": result_text})
    messages.append({"role": "assistant", "content": f"{_text(rng, 10, 40)}\nFinal Answer: {rng.randint(0, 40)}"})
    row = {
        "id": row_id,
        "messages": messages,
        "images": images,
        "tools": tools if rng.random() < 0.7 else json.dumps(tools),
        "EO_task": task,
        "question_type": rng.choice(QUESTION_TYPES),
        "data_source": rng.choice(DATA_SOURCES),
        "gt_answer": str(rng.randint(0, 40)),
    }
    return row, files


def generate_rows(rows: int = 400, seed: int = 0, listing_share: float = 0.0):
    """The sample's rows with the image files each names, without writing anything (see make_row)."""
    rng = random.Random(seed)
    for i in range(rows):
        yield make_row(i, rng, listing_share)


def generate_sample(folder: str | Path, rows: int = 400, seed: int = 0, listing_share: float = 0.0) -> tuple[Path, Path]:
    """Write ``train.jsonl`` and its data root (``EO_GYM_DATA/``, ``image_cache/``) under ``folder``.

    Deterministic in ``rows`` and ``seed``. Returns ``(jsonl_path, data_root)``.
    """
    folder = Path(folder)
    data_root = folder / "data"
    pools = dict(zip(("row", "crop"), _write_pool(folder / "pool")))
    jsonl = folder / "train.jsonl"
    with open(jsonl, "w") as fh:
        for row, files in generate_rows(rows, seed, listing_share):
            for pool, index, rel in files:
                _place(pools[pool][index], data_root / rel)
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    return jsonl, data_root


def machine_info() -> dict:
    import transformers

    model = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable,
        "cpu_model": model,
        "python": platform.python_version(),
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def _cpu_seconds() -> float:
    """CPU time of this process and of its reaped children (pool workers), user + system."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def time_prepare(jsonl: Path, model_dir: Path, cfg, num_proc: int) -> tuple[float, float, list, list]:
    """``(wall_s, cpu_s, results, marks)`` of one ``prepare_files`` call, worker start-up included.

    ``marks`` are ``(seconds since the start, rows)`` for each chunk of results as it arrived, caught
    by standing in for the progress bar that ``prepare_files`` updates per chunk (empty if it has none).
    """
    import tqdm.auto

    from eogym_sft.data.prepare import prepare_files

    marks: list[tuple[float, int]] = []

    class ProgressClock:
        def __init__(self, *args, **kwargs):
            pass

        def update(self, n=1):
            marks.append((time.perf_counter() - t0, n))

        def close(self):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.close()

    real_tqdm = tqdm.auto.tqdm
    tqdm.auto.tqdm = ProgressClock
    try:
        c0, t0 = _cpu_seconds(), time.perf_counter()
        results = prepare_files([str(jsonl)], str(model_dir), cfg, num_proc=num_proc, progress=True)
        wall, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
    finally:
        tqdm.auto.tqdm = real_tqdm
    return wall, cpu, results, marks


def steady_state(marks: list[tuple[float, int]], num_proc: int) -> tuple[float | None, float | None]:
    """``(first_result_s, rows_per_s)``: when the first chunk of results came back (worker start-up
    plus one chunk), and the rate after the first round of ``num_proc`` chunks (start-up excluded)."""
    if not marks:
        return None, None
    if len(marks) < 2:
        return marks[0][0], None
    i0 = min(num_proc, len(marks) - 1) - 1
    span = marks[-1][0] - marks[i0][0]
    rows = sum(n for _, n in marks[i0 + 1 :])
    return marks[0][0], (rows / span if span > 0 else None)


WORKER_START_PROBE = """
import json, sys, time
t0 = time.perf_counter()
import eogym_sft.data.prepare
t1 = time.perf_counter()
import transformers.processing_utils, transformers.image_processing_utils  # torch, torchvision
t2 = time.perf_counter()
from eogym_sft.models.processor import load_processor
load_processor(sys.argv[1])
t3 = time.perf_counter()
print(json.dumps({"import_eogym_sft_s": t1 - t0, "import_transformers_torch_s": t2 - t1, "load_processor_s": t3 - t2}))
"""


def worker_start_probe(model_dir: Path) -> dict:
    """What a spawned worker pays before its first row, measured in a fresh interpreter."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", WORKER_START_PROBE, str(model_dir)], capture_output=True, text=True, check=True)
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    probe["interpreter_total_s"] = time.perf_counter() - t0
    return {k: round(v, 2) for k, v in probe.items()}


# --- where the time goes (--breakdown) -------------------------------------------------------------

# (module, attribute, category): wrapped with exclusive timers, so the categories add up to the total.
BREAKDOWN_TARGETS = [
    ("eogym_sft.models.processor", "load_processor", "processor load"),
    ("eogym_sft.data.prepare", "_decode_line", "JSON decode of input lines"),
    ("eogym_sft.data.prepare", "normalize_row", "normalize_row (dialects)"),
    ("eogym_sft.data.prepare", "_image_layout", "image headers + resize arithmetic"),
    ("eogym_sft.data.prepare", "encode_conversation", "encode: offsets, masks (rest)"),
    ("eogym_sft.data.encoding", "render", "template: render() = processor.apply_chat_template"),
    ("eogym_sft.data.prepare", "_check_window_render", "window re-check (rest)"),
    ("eogym_sft.data.prepare", "trace_samples", "samples: windows, costs, JSON dumps"),
    ("eogym_sft.data.prepare", "prepare_line", "prepare_line (rest)"),
    ("eogym_sft.data.prepare", "prepare_files", "reading lines, chunks (rest)"),
]
TOKENISE = "tokenisation (tokenizers)"


class _Timers:
    """Exclusive CPU-time accounting over nested wrapped calls."""

    def __init__(self):
        self.exclusive, self.inclusive, self.calls, self.stack = {}, {}, {}, []

    def wrap(self, fn, category: str):
        timers = self

        def wrapped(*args, **kwargs):
            timers.stack.append(0.0)
            t0 = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.process_time() - t0
                children = timers.stack.pop()
                if timers.stack:
                    timers.stack[-1] += elapsed
                timers.exclusive[category] = timers.exclusive.get(category, 0.0) + elapsed - children
                timers.inclusive[category] = timers.inclusive.get(category, 0.0) + elapsed
                timers.calls[category] = timers.calls.get(category, 0) + 1

        return wrapped


def breakdown(jsonl: Path, model_dir: Path, cfg) -> dict:
    """CPU seconds by category for ``prepare_files`` at num_proc=1 (this process), by wrapping the
    package's functions with exclusive timers (missing names are skipped)."""
    import importlib

    from eogym_sft.data import encoding

    timers, undo = _Timers(), []

    def patch(owner, name, value):
        undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    for module_name, attr, category in BREAKDOWN_TARGETS:
        owner = importlib.import_module(module_name)
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        if owner is not None and callable(getattr(owner, name, None)):
            patch(owner, name, timers.wrap(getattr(owner, name), category))
    if callable(getattr(encoding, "_ids_and_starts", None)):  # the tokeniser call inside encode_conversation
        patch(encoding, "_ids_and_starts", timers.wrap(encoding._ids_and_starts, TOKENISE))
    elif callable(getattr(encoding, "_tokenizer", None)):
        get_tokenizer = encoding._tokenizer

        class TimedTokenizer:
            def __init__(self, tok):
                self.tok, self.call = tok, timers.wrap(tok, TOKENISE)

            def __call__(self, *args, **kwargs):
                return self.call(*args, **kwargs)

            def __getattr__(self, name):
                return getattr(self.tok, name)

        patch(encoding, "_tokenizer", lambda processor: TimedTokenizer(get_tokenizer(processor)))
    try:
        from eogym_sft.data.prepare import prepare_files

        c0, t0 = time.process_time(), time.perf_counter()
        results = prepare_files([str(jsonl)], str(model_dir), cfg, num_proc=1, progress=False)
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    finally:
        for owner, name, value in reversed(undo):
            setattr(owner, name, value)
    load = timers.exclusive.pop("processor load", 0.0)
    rows_cpu = cpu - load
    categories = {k: round(v, 3) for k, v in sorted(timers.exclusive.items(), key=lambda kv: -kv[1])}
    return {
        "rows": len(results),
        "cpu_s": round(cpu, 3),
        "wall_s": round(wall, 3),
        "processor_load_cpu_s": round(load, 3),
        "rows_cpu_s": round(rows_cpu, 3),
        "ms_per_row": round(1000 * rows_cpu / max(1, len(results)), 2),
        "exclusive_cpu_s": categories,
        "share": {k: round(v / rows_cpu, 4) for k, v in categories.items()} if rows_cpu > 0 else {},
        "window_recheck_inclusive_cpu_s": round(timers.inclusive.get("window re-check (rest)", 0.0), 3),
        "calls": timers.calls,
    }


def write_result(result: dict, json_path, table: str | None = None) -> dict:
    """Print ``table`` (when given), write a bench's result as JSON (its folder made as needed), say where,
    and return it; every bench ends so."""
    if table is not None:
        print(table)
    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {json_path}")
    return result


@contextmanager
def scratch_dir(workdir: str | None, prefix: str):
    """A bench's work folder: ``workdir`` when given (kept), else a temp folder removed on exit."""
    if workdir is not None:
        yield Path(workdir)
        return
    tmp = tempfile.mkdtemp(prefix=prefix)
    try:
        yield Path(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def format_breakdown(b: dict) -> str:
    lines = [f"where the time goes (num_proc=1, {b['rows']} rows, {b['rows_cpu_s']:.2f} CPU s after the processor load "
             f"= {b['ms_per_row']:.1f} ms/row; exclusive CPU time):"]
    for k, v in b["exclusive_cpu_s"].items():
        lines.append(f"  {v:8.2f} s  {100 * b['share'].get(k, 0):5.1f}%  {k}")
    lines.append(f"  (window re-check, encodes inside it included: {b['window_recheck_inclusive_cpu_s']:.2f} s)")
    return "\n".join(lines)


# --- the command ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=400, help="rows in the generated sample (default 400)")
    parser.add_argument("--num-proc", type=int, nargs="+", default=None, help="worker counts to time (default: 1 and os.cpu_count())")
    parser.add_argument("--workdir", default=None, help="folder for the sample and the tiny model, kept and reused (default: a temp folder, removed after)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-length", type=int, default=SampleConfig.max_length, help="token budget per sample")
    parser.add_argument("--json", default=None, help="where to write the JSON result (default: ./prep_throughput.json, or <workdir>/prep_throughput.json)")
    parser.add_argument("--no-startup", action="store_true", help="skip the worker start-up probe (a fresh interpreter that imports and loads what a worker does)")
    parser.add_argument("--breakdown", action="store_true", help="also run num_proc=1 with per-stage timers and print where the time goes")
    args = parser.parse_args(argv)

    from eogym_sft.data.prepare import PrepConfig
    from eogym_sft.models.tiny import save_tiny_model

    num_procs = args.num_proc or sorted({1, os.cpu_count() or 1})
    tmp = None if args.workdir else tempfile.mkdtemp(prefix="eogym_prep_bench_")
    workdir = Path(args.workdir or tmp)
    workdir.mkdir(parents=True, exist_ok=True)
    json_path = Path(args.json) if args.json else (Path.cwd() if tmp else workdir) / "prep_throughput.json"
    try:
        t0 = time.perf_counter()
        jsonl, data_root = generate_sample(workdir / "sample", args.rows, args.seed)
        gen_s = time.perf_counter() - t0
        print(f"sample: {args.rows} rows under {workdir / 'sample'} ({gen_s:.1f}s)", flush=True)

        model_dir = workdir / "tiny_model"
        t0 = time.perf_counter()
        if not (model_dir / "tokenizer.json").exists():
            save_tiny_model(model_dir)
        print(f"tiny model: {model_dir} ({time.perf_counter() - t0:.1f}s)", flush=True)

        cfg = PrepConfig(data_root=str(data_root), max_length=args.max_length)
        machine = machine_info()  # before the runs: the load average is other work on the machine
        probe = None if args.no_startup else worker_start_probe(model_dir)
        if probe:
            print(f"worker start-up in a fresh interpreter: {probe}", flush=True)

        runs, reference_hash = [], None
        for n in num_procs:
            wall, cpu, results, marks = time_prepare(jsonl, model_dir, cfg, n)
            samples = [s for r in results for s in r.samples]
            status = {k: sum(r.status == k for r in results) for k in ("kept", "split", "dropped")}
            digest = hashlib.sha256("".join(json.dumps(s, sort_keys=True) for s in samples).encode()).hexdigest()[:16]
            reference_hash = reference_hash or digest
            rate = len(results) / wall
            first, steady = steady_state(marks, n)
            per_core, per_core_steady = rate / n, (steady / n if steady else None)
            projected = (first or 0.0) + TRAIN_ROWS / ((per_core_steady or per_core) * TARGET_CORES)
            runs.append({
                "num_proc": n,
                "rows": len(results),
                "samples": len(samples),
                **{f"rows_{k}": v for k, v in status.items()},
                "wall_s": round(wall, 3),
                "cpu_s": round(cpu, 3),
                "first_result_s": None if first is None else round(first, 3),
                "rows_per_s": round(rate, 3),
                "rows_per_s_per_core": round(per_core, 3),
                "rows_per_s_per_core_steady": None if per_core_steady is None else round(per_core_steady, 3),
                "rows_per_cpu_s": round(len(results) / cpu, 3) if cpu > 0 else None,
                "projected_s_7642_rows_16_cores": round(projected, 1),
                "meets_target": projected < TARGET_SECONDS,
                "output_hash": digest,
                "same_output_as_first": digest == reference_hash,
            })
            print(f"num_proc={n}: {len(results)} rows in {wall:.1f}s wall, {cpu:.1f}s CPU", flush=True)

        result = {
            "bench": "prep_throughput",
            "command": " ".join(["python", "bench/prep_throughput.py", *(argv if argv is not None else sys.argv[1:])]),
            "rows": args.rows,
            "seed": args.seed,
            "max_length": args.max_length,
            "sample_generation_s": round(gen_s, 2),
            "target": f"{TRAIN_ROWS} rows in < {TARGET_SECONDS:.0f}s on {TARGET_CORES} cores "
                      f"(>= {TRAIN_ROWS / TARGET_SECONDS / TARGET_CORES:.2f} rows/s per core)",
            "machine": machine,
            "worker_start_probe": probe,
            "runs": runs,
        }
        if args.breakdown:
            result["breakdown"] = breakdown(jsonl, model_dir, cfg)
        print()
        print(format_table(result))
        if args.breakdown:
            print()
            print(format_breakdown(result["breakdown"]))
        return write_result(result, json_path)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def format_table(result: dict) -> str:
    m = result["machine"]
    head = (f"{m['cpu_model']} | {m['cpu_count']} CPUs ({m['usable_cpus']} usable, load avg {m['load_avg_1m']}) | "
            f"Python {m['python']} | transformers {m['transformers']} | {m['date']}")
    cols = ["num_proc", "rows", "samples", "wall_s", "cpu_s", "1st result s", "rows/s", "rows/s/core",
            "steady rows/s/core", "rows/CPU-s", "7642@16c (s)"]
    lines = [head, f"target: {result['target']}", " | ".join(cols), " | ".join("-" * len(c) for c in cols)]
    for r in result["runs"]:
        vals = [r["num_proc"], r["rows"], r["samples"], r["wall_s"], r["cpu_s"], r["first_result_s"], r["rows_per_s"],
                r["rows_per_s_per_core"], r["rows_per_s_per_core_steady"], r["rows_per_cpu_s"],
                r["projected_s_7642_rows_16_cores"]]
        lines.append(" | ".join(f"{'-' if v is None else v:>{len(c)}}" for v, c in zip(vals, cols)))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
