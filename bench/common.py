"""What the benches share: where and when a bench ran (:func:`machine_info`), how it writes and prints its result,
the arguments and data of the GPU benches, and the EO-Gym-shaped sample they run on (:func:`generate_sample`)."""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import math
import os
import platform
import random
import re
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def machine_info(device=None) -> dict:
    """Where and when a bench ran: the CPU (model, count, usable, load), the device (``device``: a torch device,
    CPU when ``None``), the versions of Python, torch, transformers, trl and peft, and the UTC time."""
    import peft
    import torch
    import transformers
    import trl

    cpu_model = platform.processor() or ""
    try:
        cpu_model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    on_gpu = device is not None and torch.device(device).type == "cuda"
    return {
        "device": str(device or "cpu"),
        "device_name": torch.cuda.get_device_name(device) if on_gpu else cpu_model or "cpu",
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_threads": torch.get_num_threads(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "platform": platform.platform(),
        **{m.__name__: m.__version__ for m in (torch, transformers, trl, peft)},
        **({"cuda": torch.version.cuda} if on_gpu else {}),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def command(bench: str, argv: list[str] | None) -> str:
    """The command line a bench ran with, for its JSON."""
    return " ".join(["python", f"bench/{bench}.py", *(sys.argv[1:] if argv is None else argv)])


def sync(device=None) -> None:
    """Wait for the GPU (``device``, or the current one when CUDA is there), so that a wall time is the GPU's."""
    import torch

    if (device is None and torch.cuda.is_available()) or (device is not None and torch.device(device).type == "cuda"):
        torch.cuda.synchronize(device)


def now() -> float:
    """``time.perf_counter()`` once the GPU is done (:func:`sync`): the GPU's time, not the host's."""
    sync()
    return time.perf_counter()


def peak_gib(device) -> float | None:
    """Peak allocated GPU memory on ``device`` since the last reset, in GiB (``None`` off a GPU)."""
    import torch

    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if torch.device(device).type == "cuda" else None


def rounded(value, digits: int = 4):
    """Floats to ``digits`` decimals, below 1 to ``digits`` significant digits (a 2e-6 difference stays one)."""
    if isinstance(value, dict):
        return {key: rounded(item, digits) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(item, digits) for item in value]
    if isinstance(value, float) and math.isfinite(value):
        return round(value, digits) if abs(value) >= 1 else float(f"{value:.{digits}g}")
    return value


def results_json(result: dict) -> str:
    """A result as bench/results keeps it (``python bench/common.py results FILE``): compact, :func:`rounded`."""
    return json.dumps(rounded(result), separators=(",", ":"), ensure_ascii=False) + "\n"


def write_result(result: dict, json_path, table: str | None = None) -> dict:
    """Print ``table`` (when given), write ``result`` as compact JSON to ``json_path`` (when given), say where,
    return it. bench/results keeps it as :func:`results_json` writes it."""
    if table is not None:
        print(table)
    if json_path is not None:
        json_path = Path(json_path)
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, separators=(",", ":")) + "\n")
        print(f"wrote {json_path}")
    return result


@contextmanager
def scratch_dir(workdir: str | None, prefix: str):
    """A bench's work folder: ``workdir`` when given (kept), else a temp folder removed on exit."""
    if workdir is not None:
        Path(workdir).mkdir(parents=True, exist_ok=True)
        yield Path(workdir)
        return
    tmp = tempfile.mkdtemp(prefix=prefix)
    try:
        yield Path(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def machine_line(result: dict) -> str:
    """Where and when a GPU bench ran, from its ``machine`` and ``dtype``: the first line of its table."""
    m = result["machine"]
    return f"{m['device_name']} | {result['dtype']} | torch {m['torch']} | transformers {m['transformers']} | {m['date']}"


def runs_table(runs: list[dict], columns: list[tuple], *head: str) -> str:
    """A bench's printed table: the lines ``head``, then a line per run with ``(header, width, key[, format])``
    columns right-aligned, ``key`` a run's field or a function of the run (``-`` for None); a run that failed shows
    its error instead."""
    lines = [*head, " ".join(f"{c[0]:>{c[1]}}" for c in columns)]
    for r in runs:
        if "error" in r:
            lines.append(f"{r[columns[0][2]]:>{columns[0][1]}} failed: {r['error'][:80]}")
            continue
        cells = [(c[2](r) if callable(c[2]) else r.get(c[2]), c[3] if len(c) > 3 else "") for c in columns]
        lines.append(" ".join(f"{'-' if v is None else format(v, fmt):>{c[1]}}" for (v, fmt), c in zip(cells, columns)))
    return "\n".join(lines)


def add_run_args(parser: argparse.ArgumentParser, name: str, data_help: str) -> None:
    """The arguments of the evaluation, validation and rollout benches: data, device, dtype, seed, folder, JSON."""
    parser.add_argument("--data", default=None, help=data_help)
    parser.add_argument("--data-root", default=".", help="data root of --data")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="folder for the generated sample (default: a temp folder, removed after)")
    parser.add_argument("--json", default=f"{name}.json", help="where to write the result")


def run_data(args: argparse.Namespace, workdir: Path) -> tuple[Path, Path]:
    """The JSONL and data root a bench of :func:`add_run_args` runs on: ``--data`` and ``--data-root``, or else
    ``--rows`` rows of :func:`generate_sample` (seed ``--seed``) under ``workdir``."""
    if args.data:
        return Path(args.data), Path(args.data_root)
    return generate_sample(workdir / "sample", args.rows, args.seed)


def data_note(args: argparse.Namespace, data: Path) -> str:
    """What a bench of :func:`add_run_args` ran on, for its JSON."""
    return str(data) if args.data else f"generated by bench/common.py, {args.rows} rows, seed {args.seed}"


def add_random_lora(model, seed: int):
    """``model`` with one random rank-16 adapter ``arm0`` on the recipe's targets (B not zero, so it acts)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from eogym_sft.models.loading import LORA_TARGETS

    torch.manual_seed(seed)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=list(LORA_TARGETS), init_lora_weights=False)
    return get_peft_model(model, lora, adapter_name="arm0").eval()


# ---------------------------------------------------------------- the EO-Gym-shaped sample
# Row images up to 4000x4000 px, tool results naming image_cache/...png crops, 5-15 tool schemas a row, mostly the
# OpenAI tool_calls dialect, some Qwen/Hermes <tool_call> text. A handful of distinct image files (a noise tile
# upscaled, with pixel-level grain so that JPEG and PNG bodies are as dense as imagery's) are written once and
# hard-linked under many hashed names: data prep checks each distinct path once, so every row costs what real data
# costs, except for disk reads.

# (width, height, format) of the distinct row images, sizes as EO-Gym's scenes and tiles come; the crops that tools
# write to image_cache/ (always PNG).
ROW_IMAGE_SHAPES = [(4000, 4000, "JPEG"), (4000, 3000, "JPEG"), (3840, 2160, "JPEG"), (3000, 2000, "JPEG"), (2500, 2500, "PNG"),
                    (2048, 2048, "PNG"), (1500, 1500, "JPEG"), (1200, 800, "PNG"), (1024, 1024, "PNG"), (800, 600, "JPEG"),
                    (600, 600, "PNG"), (512, 512, "PNG")]
CROP_SHAPES = [(128, 128), (224, 224), (256, 256), (320, 240), (384, 384), (512, 512), (640, 480),
               (768, 768), (1024, 768), (1024, 1024), (1280, 720), (2048, 1024)]
TOOL_NAMES = ("load_scene crop_region zoom compute_ndvi compute_ndwi cloud_mask detect_objects segment_landcover count_objects "
              "measure_area measure_distance change_detection query_metadata reproject histogram band_math read_netcdf "
              "time_series geocode super_resolve").split()
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


def make_row(i: int, rng: random.Random) -> tuple[dict, list[tuple[str, int, str]]]:
    """Row ``i`` of the sample and the image files it names: ``(row, [(pool, index, rel_path)])``,
    ``pool`` being ``"row"`` (an index into ROW_IMAGE_SHAPES) or ``"crop"`` (into CROP_SHAPES)."""
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

    for step in range(rng.randint(1, 6)):
        name = rng.choice(names)
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
        if rng.random() < 0.85:
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


def generate_sample(folder: str | Path, rows: int = 400, seed: int = 0) -> tuple[Path, Path]:
    """Write ``train.jsonl`` and its data root (``EO_GYM_DATA/``, ``image_cache/``) under ``folder``, deterministic in
    ``rows`` and ``seed``; return ``(jsonl_path, data_root)``."""
    folder = Path(folder)
    data_root = folder / "data"
    pools = dict(zip(("row", "crop"), _write_pool(folder / "pool")))
    jsonl = folder / "train.jsonl"
    with open(jsonl, "w") as fh:
        rng = random.Random(seed)
        for row, files in (make_row(i, rng) for i in range(rows)):
            for pool, index, rel in files:
                _place(pools[pool][index], data_root / rel)
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    return jsonl, data_root


def launch_log_result(log_path: str, exit_code: int, device: str, launch: str) -> dict:
    """A launched recipe's log as a result: its exit, memory plan line and logged dicts (readme_command)."""
    log, ended = Path(log_path).read_text(errors="replace"), time.gmtime(Path(log_path).stat().st_mtime)
    return {"what": "the README's SFT launch, unchanged but for the model, data, output and --max_steps 2",
            "command": " ".join(launch.split()), "device": device, "date": time.strftime("%Y-%m-%dT%H:%MZ", ended),
            "exit_code": exit_code, "memory_plan_line": (re.findall(r"memory plan: [^\r\n]*", log) or [None])[-1],
            "logged": re.findall(r"\{'(?:loss|eval_loss|train_runtime)'[^}]*\}", log)}


def defaults_result(out: str, device: str) -> dict:
    """The defaults stage's runs: each one's memory plan line, traceback or not, and nvidia-smi's largest sample."""
    runs = {}
    for smi in sorted(Path(out).glob("*_smi.csv")):
        name = smi.name[: -len("_smi.csv")]
        samples = [tuple(int(v) for v in line.split(",")) for line in smi.read_text().splitlines() if line.strip()]
        log = (Path(out) / f"{name}_defaults.log").read_text(errors="replace")
        runs[name] = {"memory_plan_line": (re.findall(r"memory plan: [^\r\n]*", log) or [None])[-1],
                      "traceback": "Traceback" in log, "peak_mib_used": max(samples)[0] if samples else None,
                      "total_mib": samples[0][1] if samples else None}
    newest = max((smi.stat().st_mtime for smi in Path(out).glob("*_smi.csv")), default=time.time())
    return {"what": "validate, evaluate and rollout at their defaults on the base and a random adapter (h200_session.sh defaults)",
            "device": device, "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime(newest)), "runs": runs}


if __name__ == "__main__":  # readme-log LOG EXIT DEVICE LAUNCH, defaults OUT DEVICE (h200_session.sh's), results FILE
    writers = {"readme-log": lambda log, code, *rest: launch_log_result(log, int(code), *rest), "defaults": defaults_result,
               "results": lambda path: json.loads(Path(path).read_text())}
    print(results_json(writers[sys.argv[1]](*sys.argv[2:])), end="")
