"""Shared fixtures: the offline Qwen3-VL processor, a tiny model folder, the bundled sample, and small
builders for EO-Gym rows and images. Everything is offline."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
SYSTEM = "You are an expert remote-sensing analyst. Reply as: Final Answer: <answer>"
CROP_TOOL = {
    "type": "function",
    "function": {
        "name": "crop_optical_or_sar_image",
        "description": "Crop an optical or SAR image by a normalized AOI and return the saved path.",
        "parameters": {
            "type": "object",
            "properties": {"image_url": {"type": "string"}, "aoi": {"type": "array", "items": {"type": "number"}}},
            "required": ["image_url", "aoi"],
        },
    },
}
INDEX_TOOL = {
    "type": "function",
    "function": {
        "name": "compute_index",
        "description": "Compute a spectral index over a multispectral dataset.",
        "parameters": {"type": "object", "properties": {"dataset": {"type": "string"}, "index": {"type": "string"}}},
    },
}


# glibc's malloc hands every block over 32 MiB (a micro-batch's vocabulary-wide logits are hundreds of MiB) to
# mmap and back on free, so each one is fresh pages the kernel zeroes: on the 2-core box a third of the suite's
# CPU time was system time. Keeping freed memory in the heap (no mmap, no trim) and in huge pages halves that
# (the SFT demo: 60.7 s -> 48.9 s wall, docs/contributing.md). Read when a process starts: set here in the controller, it reaches the
# pytest-xdist workers and the subprocesses tests start, not the process already running (with -n 0).
MALLOC_TUNABLES = "glibc.malloc.hugetlb=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736"


def pytest_configure(config):
    """Under pytest-xdist, share the cores out between the workers: torch's default of one thread a core in
    every worker (and in the subprocesses tests start) would oversubscribe the machine."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        os.environ.setdefault("GLIBC_TUNABLES", MALLOC_TUNABLES)
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers:
        return
    import torch

    threads = str(max(1, (os.cpu_count() or 1) // int(workers)))
    os.environ["OMP_NUM_THREADS"] = threads  # for subprocesses
    torch.set_num_threads(int(threads))


def pytest_collection_modifyitems(config, items):
    """Files by the seconds of their slow tests (``@pytest.mark.slow(seconds)``, about what each took on the
    2-core box, fixtures it builds included), longest first, then the rest in collection order: with one file
    a pytest-xdist worker, the long runs then start first and the short files fill in around them instead of
    leaving one worker alone with a long one at the end. Stable: the order within a file stays."""
    seconds: dict = {}
    for item in items:
        marker = item.get_closest_marker("slow")
        if marker is not None:
            seconds[item.path] = seconds.get(item.path, 0) + (marker.args[0] if marker.args else 1)
    items.sort(key=lambda item: -seconds.get(item.path, 0))


@pytest.fixture(scope="session")
def processor():
    """The real offline Qwen3-VL processor (Qwen3 tokenizer files, trl's Qwen3-VL template)."""
    from eogym_sft.models.tiny import build_offline_processor

    return build_offline_processor()


@pytest.fixture(scope="session")
def capped_processor(processor):
    """``capped_processor(max_pixels, min_pixels)``: the session processor with that pixel cap, set where
    ``load_processor`` sets it (``image_processor.size``). A copy (one per cap) with its own image processor:
    the shared ``processor`` keeps its cap; the tokenizer, which the cap does not touch, is shared."""
    import copy

    copies = {}

    def capped(max_pixels: int, min_pixels: int):
        if (max_pixels, min_pixels) not in copies:
            capped_copy = copy.copy(processor)
            capped_copy.image_processor = copy.deepcopy(processor.image_processor)
            capped_copy.image_processor.size = {"longest_edge": max_pixels, "shortest_edge": min_pixels}
            copies[max_pixels, min_pixels] = capped_copy
        return copies[max_pixels, min_pixels]

    return capped


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A folder usable as ``--model``: a tiny random Qwen3-VL and the offline processor."""
    from eogym_sft.models.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def sample_dir():
    """The bundled sample (``eogym_sft/sample``, package data written by ``data_prep/make_sample.py``)."""
    from eogym_sft.demo import SAMPLE_DIR

    path = SAMPLE_DIR
    assert (path / "eogym_sample.jsonl").is_file(), "run `python data_prep/make_sample.py` to write the sample"
    return path


def save_image(root: Path, rel: str, width: int, height: int, mode: str = "RGB", **save_args) -> str:
    """Write a non-blank ``width`` x ``height`` image under ``root``; return ``rel``."""
    rng = np.random.default_rng(width * 7919 + height)
    arr = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    img = Image.fromarray(arr)
    if mode != "RGB":
        img = img.convert(mode)
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, **save_args)
    return rel


@pytest.fixture
def data_root(tmp_path):
    """A data root with a few images: two row images and two tool crops."""
    save_image(tmp_path, "EO_GYM_DATA/aaaa0000/scene.jpg", 640, 480)  # -> 480x640, 300 tokens
    save_image(tmp_path, "EO_GYM_DATA/bbbb1111/post.png", 256, 256)  # -> 256x256, 64 tokens
    save_image(tmp_path, "image_cache/crops/c1.png", 128, 96)  # -> 224x320 (min pixels), 70 tokens
    save_image(tmp_path, "image_cache/crops/c2.png", 300, 300)  # -> 288x288, 81 tokens
    return tmp_path


def crop_call(image: str, aoi: list[float]) -> dict:
    return {"name": "crop_optical_or_sar_image", "arguments": {"image_url": image, "aoi": aoi}}


def crop_result(path: str) -> str:
    return json.dumps({"cropped_path": path, "width": 64, "height": 64})


def make_row(
    n_steps: int = 2, row_id: str = "train_0000000_aaaaaaaaaaaa", crops=None, images=None, tools=None
) -> dict:
    """An OpenAI-dialect EO-Gym row: question with ``<image>`` tags, ``n_steps`` crop calls, a final answer."""
    images = ["EO_GYM_DATA/aaaa0000/scene.jpg"] if images is None else images
    crops = crops if crops is not None else ["image_cache/crops/c1.png", "image_cache/crops/c2.png"]
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "<image>" * len(images) + "How many ships are in the harbour?"},
    ]
    for k in range(n_steps):
        call = crop_call(images[0] if images else "EO_GYM_DATA/x/y.jpg", [0.1 * k, 0.1, 0.5, 0.5])
        messages.append(
            {
                "role": "assistant",
                "content": f"Step {k}: I crop the harbour.",
                "tool_calls": [
                    {
                        "id": f"call_{k}",
                        "type": "function",
                        "function": dict(call, arguments=json.dumps(call["arguments"])),
                    }
                ],
            }
        )
        messages.append({"role": "tool", "tool_call_id": f"call_{k}", "content": crop_result(crops[k % len(crops)])})
    messages.append({"role": "assistant", "content": "I count the bright hulls.\nFinal Answer: 3"})
    return {
        "id": row_id,
        "images": images,
        "tools": [CROP_TOOL, INDEX_TOOL] if tools is None else tools,
        "messages": messages,
        "gt_answer": "3",
        "data_source": "fair1_vhr",
        "question_type": "object counting",
        "EO_task": "Object Counting",
    }


@pytest.fixture
def row_factory():
    """``make_row`` as a fixture, so tests need not import conftest."""
    return make_row


def trained_runs(processor, input_ids: list[int], mask: list[int]) -> list[tuple[int, str]]:
    """Split a token sequence into maximal runs of equal mask, each decoded: ``[(mask, text), ...]``."""
    runs, start = [], 0
    for i in range(1, len(input_ids) + 1):
        if i == len(input_ids) or mask[i] != mask[start]:
            runs.append((mask[start], processor.tokenizer.decode(input_ids[start:i])))
            start = i
    return runs


@pytest.fixture
def runs_of():
    """``trained_runs`` as a fixture."""
    return trained_runs
