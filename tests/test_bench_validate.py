"""bench/validate_throughput.py runs end to end on CPU with the tiny model: both paths timed, their
figures equal (fp32), its table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_validate_bench_times_the_old_and_new_paths(tiny_model_dir, tmp_path, data_root, row_factory, capsys):
    sys.path.insert(0, str(BENCH))
    from validate_throughput import format_table, main

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row_factory(row_id=f"r{k}")) + "\n" for k in range(3)))
    out = tmp_path / "validate.json"
    result = main(["--model", str(tiny_model_dir), "--data", str(data), "--data-root", str(data_root), "--batch-size", "3",
                   "--old-batch-size", "2", "--workdir", str(tmp_path / "work"), "--json", str(out)])
    assert json.loads(out.read_text()) == result
    old, new = result["runs"]
    assert (old["path"], old["attention"], old["packed"], new["path"], new["attention"], new["packed"]) == (
        "old", "sdpa", False, "new", "eogym_varlen", True)
    assert old["tokens"] == new["tokens"] > 0 and old["supervised_tokens"] == new["supervised_tokens"] > 0
    agreement = result["agreement"]
    assert agreement["same_tokens"] and agreement["accuracy_old"] == agreement["accuracy_new"]
    assert agreement["loss_new"] == pytest.approx(agreement["loss_old"], rel=1e-5)
    assert result["speedup"] == round(new["tokens_per_s"] / old["tokens_per_s"], 3)
    assert capsys.readouterr().out.endswith(format_table(result) + f"\nwrote {out}\n")
