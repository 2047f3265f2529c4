"""Data prep: pixel arithmetic, samples and their token counts, every drop reason, split windows,
``--strict``, the manifest accounting and determinism, on crafted rows and on the bundled sample."""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from PIL import Image

from eogym_sft.data.encoding import encode_conversation
from eogym_sft.data.images import ImageError, load_rgb
from eogym_sft.data.prepare import (
    PrepConfig,
    PrepError,
    mark_duplicates,
    plan_windows,
    prepare_files,
    prepare_line,
    read_lines,
    resized_hw,
)
from eogym_sft.models.layout import image_token_count
from eogym_sft.data.prepared import (
    compute_stats,
    features,
    load_prepared,
    write_prepared,
)
from eogym_sft.data.traces import TraceError, normalize_row

MAX_PIXELS, MIN_PIXELS = 1003520, 65536
MANIFEST_KEYS = ["file", "line", "id", "status", "reason", "field", "detail", "sample_ids"]
REPO = Path(__file__).resolve().parents[2]

# ---- pixel arithmetic ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "width, height, expected_hw, tokens",
    [
        (1120, 896, (896, 1120), 980),  # exactly at the cap: 35 x 28 blocks
        (4000, 4000, (992, 992), 961),  # over the cap: floor to 32 keeps it under
        (640, 480, (480, 640), 300),  # in range: nearest multiple of 32
        (600, 450, (448, 608), 266),
        (3000, 1000, (576, 1728), 972),  # 3:1 kept under the cap
        (64, 64, (256, 256), 64),  # under the floor: scaled up to min pixels
        (128, 96, (224, 320), 70),
        (100, 20000, (14144, 64), 884),  # aspect 200, the largest allowed
    ],
)
def test_resized_sizes(width, height, expected_hw, tokens):
    hw = resized_hw(width, height, 32, MIN_PIXELS, MAX_PIXELS)
    assert hw == expected_hw
    assert image_token_count(hw, 32) == tokens


SIDES = [1, 20, 33, 64, 100, 217, 256, 333, 450, 512, 600, 897, 1000, 1121, 2048, 3000, 4000, 7000, 10000]


def _grid():
    return [(w, h) for w in SIDES for h in SIDES]


@pytest.mark.parametrize("min_pixels, max_pixels", [(MIN_PIXELS, MAX_PIXELS), (32 * 32 * 4, 256 * 28 * 28 * 2)])
def test_resize_rules_and_transformers_agreement_on_a_grid(min_pixels, max_pixels):
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    checked = 0
    for w, h in _grid():
        if max(w, h) / min(w, h) > 200:
            with pytest.raises(ImageError) as info:
                resized_hw(w, h, 32, min_pixels, max_pixels)
            assert info.value.reason == "image_aspect_ratio"
            with pytest.raises(ValueError):
                smart_resize(h, w, factor=32, min_pixels=min_pixels, max_pixels=max_pixels)
            continue
        rh, rw = resized_hw(w, h, 32, min_pixels, max_pixels)
        assert (rh, rw) == smart_resize(h, w, factor=32, min_pixels=min_pixels, max_pixels=max_pixels), (w, h)
        assert rh % 32 == 0 and rw % 32 == 0 and rh >= 32 and rw >= 32
        assert min_pixels <= rh * rw <= max_pixels, (w, h, rh, rw)
        # aspect kept: one scale s puts both sides within a 32-px step of (w * s, h * s)
        low, high = max((rw - 32) / w, (rh - 32) / h), min((rw + 32) / w, (rh + 32) / h)
        assert low <= high, (w, h, rh, rw)
        assert image_token_count((rh, rw), 32) <= max_pixels // 1024
        checked += 1
    assert checked == 325  # the 361 pairs of the grid minus the 36 above aspect 200


def test_at_most_980_tokens_at_the_default_cap():
    counts = [
        image_token_count(resized_hw(w, h, 32, MIN_PIXELS, MAX_PIXELS), 32)
        for w, h in _grid()
        if max(w, h) / min(w, h) <= 200
    ]
    assert max(counts) == 980 and min(counts) == 64


def test_qwen_vl_utils_zero_side_is_guarded():
    from qwen_vl_utils import smart_resize

    # qwen-vl-utils 0.0.14 floors the short side to 0 here (its downscale branch has no max(factor, .))
    assert 0 in smart_resize(100, 10000, factor=32, min_pixels=1024, max_pixels=65536)
    with pytest.raises(ImageError) as info:
        resized_hw(10000, 100, 32, 1024, 65536)
    assert info.value.reason == "image_aspect_ratio"


def test_config_is_validated():
    with pytest.raises(ValueError):
        PrepConfig(overlong="truncate")
    with pytest.raises(ValueError):
        PrepConfig(tool_images="inline")
    with pytest.raises(ValueError, match="max_length must be at least 1, got 0"):
        PrepConfig(max_length=0)
    with pytest.raises(TypeError):  # the processor carries the pixel cap, never the prep settings
        PrepConfig(max_pixels=4096)


def test_prep_takes_the_pixel_cap_from_the_processor(processor, tiny_model_dir, data_root, row_factory):
    from eogym_sft.data.prepare import _worker_processor, pixel_cap

    capped = _worker_processor(str(tiny_model_dir), (1024, 4096))  # what a prep worker loads for a parent at this cap
    assert pixel_cap(capped) == (1024, 4096) and pixel_cap(processor) == (MIN_PIXELS, MAX_PIXELS)
    row = row_factory(n_steps=0)  # one 640x480 scene
    default, small = _prep(processor, row, data_root).samples[0], _prep(capped, row, data_root).samples[0]
    assert (default["image_hw"], default["n_image_tokens"]) == ([[480, 640]], 300)
    assert (small["image_hw"], small["n_image_tokens"]) == ([[32, 64]], 2)


# ---- one line ------------------------------------------------------------------------------------


def _prep(processor, row, root, line=1, **cfg):
    raw = row if isinstance(row, bytes) else json.dumps(row).encode()
    return prepare_line(processor, PrepConfig(data_root=str(root), **cfg), "in.jsonl", line, raw)


def test_a_kept_row_and_its_sample(processor, data_root, row_factory):
    row = row_factory(n_steps=2)
    res = _prep(processor, row, data_root, line=7)
    assert (res.status, res.reason, res.id) == ("kept", None, row["id"])
    assert res.manifest_entry() == {
        "file": "in.jsonl",
        "line": 7,
        "id": row["id"],
        "status": "kept",
        "reason": None,
        "field": None,
        "detail": None,
        "sample_ids": [row["id"] + "#w0"],
    }
    [s] = res.samples
    trace = normalize_row(row)
    enc = encode_conversation(processor, trace.messages, trace.tools)
    assert set(s) == set(features())
    assert json.loads(s["messages"]) == trace.messages
    assert json.loads(s["tools"]) == row["tools"]
    assert s["images"] == ["EO_GYM_DATA/aaaa0000/scene.jpg", "image_cache/crops/c1.png", "image_cache/crops/c2.png"]
    assert s["image_hw"] == [[480, 640], [224, 320], [288, 288]]
    assert s["n_image_tokens"] == 300 + 70 + 81
    assert s["input_ids"] == enc.input_ids and s["assistant_masks"] == enc.assistant_mask
    assert s["n_tokens"] == len(enc.input_ids) - 3 + 451
    assert s["n_trained_tokens"] == sum(enc.assistant_mask) > 0
    assert (s["sample_id"], s["source_id"], s["window"], s["n_windows"], s["trained_turns"]) == (
        row["id"] + "#w0",
        row["id"],
        0,
        1,
        [0, 2],
    )
    assert (s["source_file"], s["source_line"]) == ("in.jsonl", 7)
    assert {k: s[k] for k in ("EO_task", "question_type", "data_source", "gt_answer")} == {
        "EO_task": "Object Counting",
        "question_type": "object counting",
        "data_source": "fair1_vhr",
        "gt_answer": "3",
    }


def test_n_tokens_is_what_the_real_processor_produces(processor, data_root, row_factory):
    res = _prep(processor, row_factory(n_steps=3), data_root)
    [s] = res.samples
    text = processor.apply_chat_template(json.loads(s["messages"]), tools=json.loads(s["tools"]), tokenize=False)
    pictures = [load_rgb(data_root / p) for p in s["images"]]
    out = processor(text=[text], images=pictures)
    assert len(out["input_ids"][0]) == s["n_tokens"]
    assert out["image_grid_thw"].tolist() == [[1, h // 16, w // 16] for h, w in s["image_hw"]]
    assert sum(1 for t in out["input_ids"][0] if t == 151655) == s["n_image_tokens"]


def test_tool_images_as_text(processor, data_root, row_factory):
    row = row_factory(crops=["image_cache/crops/not_extracted.png"])
    assert _prep(processor, row, data_root).reason == "missing_image"
    res = _prep(processor, row, data_root, tool_images="text")
    assert res.status == "kept"
    assert res.samples[0]["images"] == ["EO_GYM_DATA/aaaa0000/scene.jpg"]


def _bigger_header(root: Path) -> str:
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    path = root / "EO_GYM_DATA/bomb/b.png"
    path.parent.mkdir(parents=True)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", 30000, 30000, 8, 2, 0, 0, 0))
        + chunk(b"IEND", b"")
    )
    return "EO_GYM_DATA/bomb/b.png"


def _with(row_factory, **changes):
    row = row_factory()
    for key, value in changes.items():
        row[key] = value
    return row


def _drop_cases(row_factory, root):
    """(input, config, reason, field, id) for every way a line is dropped."""
    (root / "EO_GYM_DATA/bad").mkdir(parents=True)
    (root / "EO_GYM_DATA/bad/garbage.jpg").write_bytes(b"not a jpeg")
    scene = (root / "EO_GYM_DATA/aaaa0000/scene.jpg").read_bytes()
    (root / "EO_GYM_DATA/bad/cut.jpg").write_bytes(scene[: len(scene) // 2])  # the header is fine, the body cut
    crop = (root / "image_cache/crops/c2.png").read_bytes()
    (root / "image_cache/crops/cut.png").write_bytes(crop[:-200])
    Image.new("RGB", (10050, 50)).save(root / "EO_GYM_DATA/bad/strip.png")
    rid = "train_0000000_aaaaaaaaaaaa"
    row = row_factory()
    bad_role = row_factory()
    bad_role["messages"][3]["role"] = "observer"
    bad_args = row_factory()
    bad_args["messages"][2]["tool_calls"][0]["function"]["arguments"] = '{"image_url": "x.jpg", "aoi": [0.1'
    bad_call = row_factory()
    bad_call["messages"][2]["content"] = "<tool_call>{not json}</tool_call>"
    del bad_call["messages"][2]["tool_calls"]
    no_assistant = row_factory()
    no_assistant["messages"] = no_assistant["messages"][:2]
    escaping_crop = row_factory(crops=["image_cache/../../secret.png"])
    missing_crop = row_factory(crops=["image_cache/crops/c1.png", "image_cache/crops/gone.png"])
    mixed = row_factory()
    mixed["messages"][3] = {"role": "user", "content": "<tool_response>x</tool_response> and text"}
    return {
        "malformed_json": (json.dumps(row).encode()[:-30], {}, "malformed_json", "<line>", None),
        "non_utf8": (b'{"id": "caf\xe9", "messages": []}', {}, "non_utf8", "<line>", None),
        "blank_line": (b"", {}, "blank_line", "<line>", None),
        "whitespace_line": (b"  \t ", {}, "blank_line", "<line>", None),
        "not_an_object": (b"[1, 2]", {}, "not_an_object", "<row>", None),
        "missing_id": ({"messages": row["messages"]}, {}, "missing_field", "id", None),
        "unknown_role": (bad_role, {}, "unknown_role", "messages[3].role", rid),
        "invalid_tool_arguments": (
            bad_args,
            {},
            "invalid_tool_arguments",
            "messages[2].tool_calls[0].function.arguments",
            rid,
        ),
        "invalid_tool_call": (bad_call, {}, "invalid_tool_call", "messages[2].content<tool_call 0>", rid),
        "no_assistant_turn": (no_assistant, {}, "no_assistant_turn", "messages", rid),
        "mixed_tool_response": (mixed, {}, "mixed_tool_response", "messages[3].content", rid),
        "bad_field_type": (
            _with(row_factory, images="EO_GYM_DATA/aaaa0000/scene.jpg"),
            {},
            "bad_field_type",
            "images",
            rid,
        ),
        "image_placeholder_mismatch": (_with(row_factory, images=[]), {}, "image_placeholder_mismatch", "images", rid),
        "unsafe_absolute": (
            _with(row_factory, images=["/etc/hostname"]),
            {},
            "unsafe_image_path",
            "image 0 (/etc/hostname)",
            rid,
        ),
        "unsafe_dotdot": (
            _with(row_factory, images=["../secret.png"]),
            {},
            "unsafe_image_path",
            "image 0 (../secret.png)",
            rid,
        ),
        "unsafe_nul_byte": (
            _with(row_factory, images=["EO_GYM_DATA/a\x00.jpg"]),
            {},
            "unsafe_image_path",
            "image 0 (EO_GYM_DATA/a\x00.jpg)",
            rid,
        ),
        "unsafe_tool_path": (escaping_crop, {}, "unsafe_image_path", "image 1 (image_cache/../../secret.png)", rid),
        "missing_image": (
            _with(row_factory, images=["EO_GYM_DATA/none/x.jpg"]),
            {},
            "missing_image",
            "image 0 (EO_GYM_DATA/none/x.jpg)",
            rid,
        ),
        "missing_tool_image": (missing_crop, {}, "missing_image", "image 2 (image_cache/crops/gone.png)", rid),
        "corrupt_image": (
            _with(row_factory, images=["EO_GYM_DATA/bad/garbage.jpg"]),
            {},
            "corrupt_image",
            "image 0 (EO_GYM_DATA/bad/garbage.jpg)",
            rid,
        ),
        "truncated_image": (
            _with(row_factory, images=["EO_GYM_DATA/bad/cut.jpg"]),
            {},
            "corrupt_image",
            "image 0 (EO_GYM_DATA/bad/cut.jpg)",
            rid,
        ),
        "truncated_tool_image": (
            row_factory(crops=["image_cache/crops/c1.png", "image_cache/crops/cut.png"]),
            {},
            "corrupt_image",
            "image 2 (image_cache/crops/cut.png)",
            rid,
        ),
        "image_too_large": (
            _with(row_factory, images=[_bigger_header(root)]),
            {},
            "image_too_large",
            "image 0 (EO_GYM_DATA/bomb/b.png)",
            rid,
        ),
        "image_aspect_ratio": (
            _with(row_factory, images=["EO_GYM_DATA/bad/strip.png"]),
            {},
            "image_aspect_ratio",
            "image 0 (EO_GYM_DATA/bad/strip.png)",
            rid,
        ),
        "overlong": (row, {"overlong": "drop", "max_length": 900}, "overlong", "messages", rid),
        "turn_exceeds_budget": (row, {"max_length": 600}, "turn_exceeds_budget", "messages[2]", rid),
    }


DROP_CASES = [
    "malformed_json",
    "non_utf8",
    "blank_line",
    "whitespace_line",
    "not_an_object",
    "missing_id",
    "unknown_role",
    "invalid_tool_arguments",
    "invalid_tool_call",
    "no_assistant_turn",
    "mixed_tool_response",
    "bad_field_type",
    "image_placeholder_mismatch",
    "unsafe_absolute",
    "unsafe_dotdot",
    "unsafe_nul_byte",
    "unsafe_tool_path",
    "missing_image",
    "missing_tool_image",
    "corrupt_image",
    "truncated_image",
    "truncated_tool_image",
    "image_too_large",
    "image_aspect_ratio",
    "overlong",
    "turn_exceeds_budget",
]


@pytest.mark.parametrize("case", DROP_CASES)
def test_every_drop_reason_lands_in_the_manifest(processor, data_root, row_factory, case):
    raw, cfg, reason, field, row_id = _drop_cases(row_factory, data_root)[case]
    res = _prep(processor, raw, data_root, line=5, **cfg)
    entry = res.manifest_entry()
    assert list(entry) == MANIFEST_KEYS
    assert {k: entry[k] for k in ("file", "line", "id", "status", "reason", "field", "sample_ids")} == {
        "file": "in.jsonl",
        "line": 5,
        "id": row_id,
        "status": "dropped",
        "reason": reason,
        "field": field,
        "sample_ids": [],
    }
    assert entry["detail"]
    assert res.samples == []
    if reason == "blank_line":  # listed, but an empty line is no reason for --strict to stop
        assert _prep(processor, raw, data_root, line=5, strict=True, **cfg).manifest_entry() == entry
        return
    with pytest.raises(PrepError) as info:  # --strict: the same line is an error naming file, line and field
        _prep(processor, raw, data_root, line=5, strict=True, **cfg)
    assert str(info.value).startswith(f"in.jsonl:5: field {field}: {reason}: {entry['detail']}")


def test_drop_details_are_exact_where_they_carry_numbers(processor, data_root, row_factory):
    row = row_factory()
    n = _prep(processor, row, data_root).samples[0]["n_tokens"]
    assert _prep(processor, row, data_root, overlong="drop", max_length=n - 1).detail == f"{n} tokens, budget {n - 1}"
    assert _prep(processor, row, data_root, overlong="drop", max_length=n).status == "kept"
    assert _prep(processor, b'{"id": "caf\xe9"}', data_root).detail == "invalid UTF-8 at byte 11"


def test_duplicate_ids_keep_the_first_row_only(processor, data_root, row_factory):
    row = row_factory()
    broken = dict(row_factory(), messages=row["messages"][:2])  # same id, dropped for its own reason first
    results = [
        _prep(processor, r, data_root, line=k)
        for k, r in enumerate([broken, row, row_factory(row_id="other"), row], 1)
    ]
    results = mark_duplicates(results)
    assert [(r.status, r.reason) for r in results] == [
        ("dropped", "no_assistant_turn"),
        ("kept", None),
        ("kept", None),
        ("dropped", "duplicate_id"),
    ]
    assert results[3].manifest_entry()["detail"] == f"id {row['id']!r} already used at in.jsonl:2"
    assert results[3].samples == []
    with pytest.raises(PrepError, match=r"^in.jsonl:4: field id: duplicate_id: "):
        mark_duplicates([_prep(processor, r, data_root, line=k) for k, r in enumerate([row, row], 3)], strict=True)


# ---- split windows -------------------------------------------------------------------------------


def test_plan_windows_exact():
    # head = 10 tokens, then four assistant turns of 10 tokens each (the tool results count in the turn before)
    enc = SimpleNamespace(
        assistant_starts=[10, 20, 30, 40], assistant_ends=[20, 30, 40, 50], assistant_message_index=[2, 4, 6, 8]
    )
    costs = [1] * 50
    assert plan_windows(enc, costs, 30) == [(0, 0, 1), (1, 2, 2), (2, 3, 3)]
    assert plan_windows(enc, costs, 45) == [(0, 0, 2), (1, 3, 3)]  # context reaches back as far as it fits
    assert plan_windows(enc, costs, 50) == [(0, 0, 3)]
    costs[35] = 6  # an image placeholder worth 6 tokens in turn 2
    assert plan_windows(enc, costs, 35) == [(0, 0, 1), (1, 2, 2), (2, 3, 3)]
    with pytest.raises(TraceError) as info:
        plan_windows(enc, costs, 34)  # turn 2 with turn 1 as context needs 10 + 25
    assert (info.value.reason, info.value.field) == ("turn_exceeds_budget", "messages[6]")


def check_windows(processor, trace, samples, budget, runs_of):
    """The split-window contract, checked against the whole trace's encoding."""
    full = encode_conversation(processor, trace.messages, trace.tools)
    n_turns = len(full.assistant_starts)
    head = full.assistant_starts[0]
    head_msgs = full.assistant_message_index[0]
    head_images = sum(1 for t in full.input_ids[:head] if t == 151655)
    trained_full = [t for flag, t in runs_of(processor, full.input_ids, full.assistant_mask) if flag]
    trained_windows, turns = [], []
    for k, s in enumerate(samples):
        assert (s["window"], s["n_windows"], s["sample_id"]) == (k, len(samples), f"{trace.id}#w{k}")
        assert s["n_tokens"] <= budget
        assert s["n_tokens"] == len(s["input_ids"]) - len(s["images"]) + sum(
            image_token_count(hw, 32) for hw in s["image_hw"]
        )
        # each window starts with system + tools + the question and its images
        assert s["input_ids"][:head] == full.input_ids[:head]
        assert s["images"][:head_images] == trace.images[:head_images]
        messages = json.loads(s["messages"])
        assert messages[:head_msgs] == trace.messages[:head_msgs]
        # the window is a conversation of its own: it re-renders to the same tokens
        again = encode_conversation(processor, messages, trace.tools)
        assert again.input_ids == s["input_ids"]
        assert sum(1 for t in again.input_ids if t == 151655) == len(s["images"])
        first, last = s["trained_turns"]
        turns.extend(range(first, last + 1))
        window_trained = [t for flag, t in runs_of(processor, s["input_ids"], s["assistant_masks"]) if flag]
        again_trained = [t for flag, t in runs_of(processor, again.input_ids, again.assistant_mask) if flag]
        assert window_trained == again_trained[len(again_trained) - (last - first + 1) :]  # context turns untrained
        if k:  # a later window keeps the tool call whose result its first trained turn answers
            assert messages[head_msgs]["role"] == "assistant" and "tool_calls" in messages[head_msgs]
        trained_windows.extend(window_trained)
    assert turns == list(range(n_turns))  # every assistant turn trained exactly once, in order
    assert trained_windows == trained_full  # ... with exactly its own tokens: none twice, none lost
    assert sum(s["n_trained_tokens"] for s in samples) == sum(full.assistant_mask)


def test_a_long_trace_splits_into_windows(processor, data_root, row_factory, runs_of):
    row = row_factory(n_steps=7)
    whole = _prep(processor, row, data_root).samples[0]["n_tokens"]
    res = _prep(processor, row, data_root, max_length=1200)
    assert whole == 1950 and res.status == "split"
    assert [s["trained_turns"] for s in res.samples] == [[0, 2], [3, 4], [5, 7]]
    assert res.manifest_entry()["sample_ids"] == [f"{row['id']}#w{k}" for k in range(3)]
    check_windows(processor, normalize_row(row), res.samples, 1200, runs_of)
    # with drop instead, the same row is dropped as overlong
    assert _prep(processor, row, data_root, max_length=1200, overlong="drop").reason == "overlong"


# ---- the bundled sample, end to end --------------------------------------------------------------


def _run_lines(processor, sample_dir, **cfg):
    path = sample_dir / "eogym_sample.jsonl"
    config = PrepConfig(data_root=str(sample_dir), **cfg)
    return mark_duplicates([prepare_line(processor, config, str(path), n, raw) for n, raw in read_lines(path)])


@pytest.fixture(scope="module")
def sample_2048(processor, sample_dir):
    return _run_lines(processor, sample_dir, max_length=2048)


def test_sample_at_2048_splits_the_long_rows(processor, sample_dir, sample_2048, runs_of):
    stats = compute_stats(sample_2048, [s for r in sample_2048 for s in r.samples])
    assert (stats["rows_in"], stats["rows_kept"], stats["rows_split"], stats["rows_dropped"]) == (44, 35, 5, 4)
    assert stats["max_tokens_seen"] <= 2048
    # crops and index previews are attached; the frames get_optical_image_list lists stay text
    assert stats["tool_images_attached"] == {"compute_index": 4, "crop_optical_or_sar_image": 57}
    lines = (sample_dir / "eogym_sample.jsonl").read_bytes().splitlines()
    for res in sample_2048:
        if res.status == "split":
            check_windows(processor, normalize_row(json.loads(lines[res.line - 1])), res.samples, 2048, runs_of)


def test_written_stats_equal_the_returned_ones(sample_2048, tmp_path):
    stats = write_prepared(tmp_path / "split", sample_2048, {"max_length": 2048})
    dataset, saved = load_prepared(tmp_path / "split")
    assert saved == stats  # JSON keeps no int keys: the returned stats must not have any either
    assert stats["windows_per_split_row"] == {"2": 3, "4": 2}
    assert len(dataset) == stats["samples_out"] == 35 + 3 * 2 + 2 * 4


def test_attaching_listed_frames_too_splits_more_sample_rows(processor, sample_dir):
    results = _run_lines(processor, sample_dir, max_length=2048, tool_images="attach")
    stats = compute_stats(results, [s for r in results for s in r.samples])
    assert (stats["rows_kept"], stats["rows_split"], stats["windows_per_split_row"]) == (33, 7, {"2": 5, "4": 2})
    assert stats["tool_images_attached"] == {"compute_index": 4, "crop_optical_or_sar_image": 57, "get_optical_image_list": 12}
    # a per-tool override: attach every listed frame of the listing tool only
    same = _run_lines(processor, sample_dir, max_length=2048, tool_images="produced,get_optical_image_list=attach")
    assert [r.tool_images for r in same] == [r.tool_images for r in results]


def test_a_prepared_folder_whose_data_changed_is_refused(sample_2048, tmp_path):
    from datasets import load_from_disk

    stats = write_prepared(tmp_path / "p", sample_2048, {"max_length": 2048})
    dataset = load_from_disk(str(tmp_path / "p" / "dataset"))
    # another prep's data file in its place: one sample's ids edited
    edited = dataset.map(lambda row, i: {"input_ids": row["input_ids"][:-1] if i == 3 else row["input_ids"]}, with_indices=True)
    edited.save_to_disk(str(tmp_path / "edited"))
    shutil.rmtree(tmp_path / "p" / "dataset")
    shutil.copytree(tmp_path / "edited", tmp_path / "p" / "dataset")
    with pytest.raises(ValueError, match=rf"p/dataset does not match .*p/stats.json: content hash [0-9a-f]{{64}}, stats.json records {stats['content_hash']}"):
        load_prepared(tmp_path / "p")


def test_a_run_that_drops_every_row_still_writes_its_manifest(sample_2048, tmp_path):
    dropped = [r for r in sample_2048 if r.status == "dropped"]
    stats = write_prepared(tmp_path, dropped, {})
    dataset, saved = load_prepared(tmp_path)
    assert len(dataset) == 0 and dataset.features == features()
    assert (saved["rows_in"], saved["rows_dropped"], saved["samples_out"]) == (4, 4, 0) and saved == stats
    manifest = [json.loads(line) for line in (tmp_path / "manifest.jsonl").read_text().splitlines()]
    assert [m["reason"] for m in manifest] == [
        "malformed_json",
        "unknown_role",
        "invalid_tool_arguments",
        "missing_image",
    ]


@pytest.fixture(scope="module")
def cli_output(tiny_model_dir, sample_dir, tmp_path_factory):
    """``eogym-sft prepare`` on the bundled sample with the tiny model folder, as the demo runs it."""
    from eogym_sft.cli import add_prepare_args, run_prepare

    parser = argparse.ArgumentParser()
    add_prepare_args(parser)
    out = tmp_path_factory.mktemp("prepared")
    args = parser.parse_args(
        [
            "--input",
            str(sample_dir / "eogym_sample.jsonl"),
            "--data-root",
            str(sample_dir),
            "--model",
            str(tiny_model_dir),
            "--output",
            str(out),
        ]
    )
    return out, run_prepare(args)


def test_sample_manifest_accounts_for_every_line(cli_output, sample_dir):
    out, stats = cli_output
    n_lines = len((sample_dir / "eogym_sample.jsonl").read_bytes().splitlines())
    manifest = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert n_lines == 44 and len(manifest) == n_lines
    assert [m["line"] for m in manifest] == list(range(1, n_lines + 1))
    assert all(list(m) == MANIFEST_KEYS for m in manifest)
    assert stats["rows_in"] == stats["rows_kept"] + stats["rows_split"] + stats["rows_dropped"] == n_lines
    assert (stats["rows_kept"], stats["rows_split"], stats["rows_dropped"]) == (40, 0, 4)
    assert stats["drops_by_reason"] == {
        "invalid_tool_arguments": 1,
        "malformed_json": 1,
        "missing_image": 1,
        "unknown_role": 1,
    }
    assert [(m["line"], m["reason"]) for m in manifest if m["status"] == "dropped"] == [
        (41, "malformed_json"),
        (42, "unknown_role"),
        (43, "invalid_tool_arguments"),
        (44, "missing_image"),
    ]
    dataset, saved = load_prepared(out)
    assert saved == stats
    ids = [m_id for m in manifest for m_id in m["sample_ids"]]
    assert sorted(ids) == sorted(dataset["sample_id"]) and len(set(ids)) == len(ids) == stats["samples_out"] == len(
        dataset
    )
    assert dataset.features == features()
    assert sum(dataset["n_tokens"]) == stats["tokens_total"] and max(dataset["n_tokens"]) == stats["max_tokens_seen"]
    assert sum(stats["token_histogram"].values()) == sum(stats["images_per_sample"].values()) == len(dataset)
    assert stats["settings"]["max_length"] == 8192 and len(stats["settings"]["processor_fingerprint"]) == 16


def test_same_input_same_hash(processor, cli_output, sample_dir):
    _, stats = cli_output
    again = _run_lines(processor, sample_dir)  # a second run, in this process, with the fixture's processor
    assert compute_stats(again, [s for r in again for s in r.samples])["content_hash"] == stats["content_hash"]


def test_strict_stops_at_the_first_bad_line(processor, tiny_model_dir, data_root, row_factory, tmp_path, monkeypatch):
    import eogym_sft.models.processor

    monkeypatch.setattr(eogym_sft.models.processor, "load_processor", lambda *a, **k: processor)  # skip a second load
    bad = row_factory(row_id="b")
    bad["messages"][3]["role"] = "observer"
    path = tmp_path / "bad.jsonl"
    path.write_text(
        "\n".join(json.dumps(r) for r in [row_factory(row_id="a"), row_factory(row_id="c"), bad, {"id": 1}]) + "\n"
    )
    cfg = PrepConfig(data_root=str(data_root), strict=True)
    with pytest.raises(PrepError) as info:
        prepare_files([str(path)], str(tiny_model_dir), cfg, progress=False)
    assert (
        str(info.value)
        == f"{path}:3: field messages[3].role: unknown_role: role 'observer' is not one of system, user, assistant, tool, function"
    )
    lax = prepare_files([str(path)], str(tiny_model_dir), PrepConfig(data_root=str(data_root)), progress=False)
    assert [(r.line, r.status, r.reason) for r in lax] == [
        (1, "kept", None),
        (2, "kept", None),
        (3, "dropped", "unknown_role"),
        (4, "dropped", "missing_field"),
    ]


def test_make_sample_is_deterministic_and_matches_the_bundle(sample_dir, tmp_path):
    spec = importlib.util.spec_from_file_location("make_sample", REPO / "data_prep" / "make_sample.py")
    make_sample = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_sample)
    make_sample.main(["--output", str(tmp_path)])
    assert (tmp_path / "eogym_sample.jsonl").read_bytes() == (sample_dir / "eogym_sample.jsonl").read_bytes()

    def listing(root):  # names and pixel sizes; JPEG bytes may differ between libjpeg builds
        out = []
        for path in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix != ".jsonl"):
            with Image.open(path) as img:
                out.append((str(path.relative_to(root)), img.size, img.mode))
        return out

    assert listing(tmp_path) == listing(sample_dir)
    assert len(listing(sample_dir)) == 125
    assert sum(p.stat().st_size for p in sample_dir.rglob("*") if p.is_file()) < 2_000_000


################
# Hostile input through `eogym-sft prepare` (issue 28)
################


def _prepare_cli(tiny_model_dir, data_root, inputs, out, *extra):
    from eogym_sft.cli import main

    main(["prepare", "--input", *map(str, inputs), "--data-root", str(data_root), "--model", str(tiny_model_dir),
          "--output", str(out), *extra])
    return [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]


def test_hostile_lines_are_named_drops(tiny_model_dir, data_root, row_factory, tmp_path):
    good = [json.dumps(row_factory(row_id=f"ok{k}")).encode() for k in range(4)]
    hostile = [
        b"[" * 100000 + b"]" * 100000,  # RecursionError in json
        b'{"id": "big", "messages": [], "n": ' + b"9" * 5000 + b"}",  # the int digit limit
        b'{"id": "deep", "messages": [], "x": ' + b"[" * 70 + b"]" * 70 + b"}",  # parses, but deeper than any row: refused
    ]
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b"\n".join(good + hostile) + b"\n")  # a BOM before the first row
    manifest = _prepare_cli(tiny_model_dir, data_root, [path], tmp_path / "out")
    assert [(m["line"], m["status"], m["reason"]) for m in manifest] == [
        (1, "kept", None), (2, "kept", None), (3, "kept", None), (4, "kept", None),
        (5, "dropped", "json_too_deep"), (6, "dropped", "json_number_too_long"), (7, "dropped", "json_too_deep"),
    ]


def test_an_arguments_string_of_hostile_json_is_a_named_drop(tiny_model_dir, data_root, row_factory, tmp_path):
    rows = [row_factory(row_id=f"ok{k}") for k in range(3)]
    bad = row_factory(row_id="bad")
    bad["messages"][2]["tool_calls"][0]["function"]["arguments"] = "[" * 50000 + "]" * 50000
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows + [bad]) + "\n")
    manifest = _prepare_cli(tiny_model_dir, data_root, [path], tmp_path / "out")
    assert (manifest[3]["reason"], manifest[3]["field"]) == ("invalid_tool_arguments", "messages[2].tool_calls[0].function.arguments")


def test_rows_over_the_bounds_are_dropped_quickly(tiny_model_dir, data_root, row_factory, tmp_path):
    import time

    many = row_factory(row_id="many", n_steps=2500)  # 5,000 turns
    huge = row_factory(row_id="huge")
    huge["messages"][1]["content"] += "x" * (50 << 20)  # a 50 MB user turn
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [row_factory(row_id=f"ok{k}") for k in range(3)] + [many, huge]) + "\n")
    start = time.monotonic()
    manifest = _prepare_cli(tiny_model_dir, data_root, [path], tmp_path / "out")
    assert time.monotonic() - start < 60  # was more than 900 s for the 5,000-turn row alone
    assert [(m["reason"], m["field"]) for m in manifest[3:]] == [("too_many_messages", "messages"), ("row_too_large", "<line>")]
    assert manifest[3]["detail"] == "5003 messages, over the bound of 256"


def test_an_empty_input_file_is_an_error(tiny_model_dir, data_root, tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_bytes(b"")
    with pytest.raises(SystemExit, match=r"^eogym-sft prepare: .*empty.jsonl is empty: no rows to read \(--debug"):
        _prepare_cli(tiny_model_dir, data_root, [tmp_path / "empty.jsonl"], tmp_path / "out")
    assert not (tmp_path / "out" / "stats.json").exists()


def test_a_wrong_data_root_stops_prepare_with_the_likely_cause(tiny_model_dir, data_root, row_factory, tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(row_factory(row_id=f"r{k}")) for k in range(3)) + "\n")
    wrong = tmp_path / "elsewhere"
    wrong.mkdir()
    with pytest.raises(SystemExit, match=r"3 of 3 rows dropped as missing_image \(e\.g\. .*rows\.jsonl:1 image 0 .*likely cause: "
                       r"the images are not under --data-root.*Pass --allow-drops"):
        _prepare_cli(tiny_model_dir, wrong, [path], tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written
    manifest = _prepare_cli(tiny_model_dir, wrong, [path], tmp_path / "out", "--allow-drops")
    assert [m["reason"] for m in manifest] == ["missing_image"] * 3


def test_user_errors_are_one_line_and_debug_shows_the_traceback(tiny_model_dir, data_root, tmp_path, monkeypatch):
    from eogym_sft.cli import main

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("taken")
    (tmp_path / "rows.jsonl").write_text("{}\n")
    argv = ["prepare", "--input", str(tmp_path / "rows.jsonl"), "--model", str(tiny_model_dir), "--output", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as err:
        main(argv)
    assert str(err.value).count("\n") == 0 and str(err.value).startswith("eogym-sft prepare: ")
    assert "exists and is not empty" in str(err.value)
    with pytest.raises(FileExistsError):
        main(["--debug", *argv])
    monkeypatch.setenv("EOGYM_DEBUG", "1")
    with pytest.raises(FileExistsError):
        main(argv)


def test_a_rerun_killed_while_writing_leaves_a_folder_that_does_not_load(tmp_path, monkeypatch):
    from eogym_sft.data import prepared
    from eogym_sft.data.prepare import LineResult

    results = [LineResult("f", 1, "a", "dropped", "malformed_json", "<line>", "x")]
    prepared.write_prepared(tmp_path, results, {})
    assert prepared.load_prepared(tmp_path)[1]["rows_in"] == 1

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # as a kill between the dataset and the manifest

    monkeypatch.setattr(prepared, "write_lines_atomic", killed)
    with pytest.raises(KeyboardInterrupt):
        prepared.write_prepared(tmp_path, results + results, {})
    with pytest.raises(FileNotFoundError, match="not a prepared folder"):
        prepared.load_prepared(tmp_path)
    assert (tmp_path / "manifest.jsonl").read_text().count("\n") == 1  # the old manifest, whole
    (tmp_path / "stats.json").write_text('{"rows_in": ')
    with pytest.raises(ValueError, match="stats.json is damaged"):
        prepared.load_prepared(tmp_path)
