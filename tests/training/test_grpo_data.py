"""GRPO's examples read from EO-Gym rows (eogym_sft/training/grpo_data.py): one per question, bad rows skipped,
named and counted, rows grouped by their tool schemas."""

from __future__ import annotations

import json

import pytest

from eogym_sft.training.grpo_data import EpisodeData, load_episodes, prompt_trace, tools_key


def write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_prompt_trace_works_on_question_only_rows(row_factory):
    full = row_factory(n_steps=2)
    question_only = {**full, "messages": full["messages"][:2]}
    for row in (full, question_only):
        trace = prompt_trace(row)
        assert [m["role"] for m in trace.messages] == ["system", "user"]
        assert trace.images == ["EO_GYM_DATA/aaaa0000/scene.jpg"]
        assert [t["function"]["name"] for t in trace.tools] == ["crop_optical_or_sar_image", "compute_index"]


def test_load_episodes_skips_names_and_counts_bad_rows(tmp_path, data_root, row_factory):
    good = row_factory(n_steps=1)
    other_tools = {**row_factory(n_steps=0, row_id="train_2"), "tools": [good["tools"][0]]}
    path = write_jsonl(
        tmp_path / "rows.jsonl",
        [
            good,
            "{not json",
            {**good, "id": "no_answer", "gt_answer": ""},
            {**good, "id": "no_image", "images": ["EO_GYM_DATA/missing.jpg"]},
            other_tools,
        ],
    )
    data = load_episodes(path, data_root)
    assert [r["id"] for r in data.records] == ["train_0000000_aaaaaaaaaaaa", "train_2"]
    assert data.stats()["skipped"] == {"malformed_json": 1, "missing_field": 1, "missing_image": 1}
    assert [s.split(": ")[0] for s in data.skipped_rows] == [f"{path}:2", f"{path}:3", f"{path}:4"]
    assert data.rows_in == 5
    keys = [r["environment"] for r in data.records]
    assert keys == [tools_key(good["tools"]), tools_key([good["tools"][0]])]
    assert data.schemas == {keys[0]: good["tools"], keys[1]: [good["tools"][0]]}
    assert data.tool_names == ["compute_index", "crop_optical_or_sar_image"]


def test_episode_data_refuses_an_empty_file(tmp_path, data_root):
    with pytest.raises(ValueError, match="no usable rows"):
        load_episodes(write_jsonl(tmp_path / "rows.jsonl", ["{bad"]), data_root)
    assert EpisodeData([], {}).stats()["episodes"] == 0
