"""bench/validate_throughput.py runs end to end on CPU with the tiny model: the old padded path and the
new defaults with both arms timed, their figures equal (fp32), its table; what each path runs."""

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
                   "--old-batch-size", "2", "--paths", "old,new-2arms", "--workdir", str(tmp_path / "work"), "--json", str(out)])
    assert json.loads(out.read_text()) == result
    old, both = result["runs"]
    settings = [(r["path"], r["attention"], r["packed"], r["batch_size"], r["compiled"], r["arms"]) for r in result["runs"]]
    assert settings == [("old", "sdpa", False, 2, False, ["lora"]), ("new-2arms", "eogym_varlen", True, 3, False, ["base", "lora"])]
    assert old["workers"] == 0 and both["tokens"] == 2 * old["tokens"] > 0  # each arm's tokens
    assert old["supervised_tokens"] == both["supervised_tokens"] > 0
    agreement = result["agreement"]
    assert agreement["compared"] == ["old", "new-2arms"]
    assert agreement["same_tokens"] and agreement["accuracy_old"] == agreement["accuracy_new"]
    assert agreement["loss_new"] == pytest.approx(agreement["loss_old"], rel=1e-5)
    assert result["speedup_vs_old"] == {"new-2arms": round(both["tokens_per_s"] / old["tokens_per_s"], 3)}
    assert capsys.readouterr().out.endswith(format_table(result) + f"\nwrote {out}\n")


def test_validate_bench_paths_differ_from_new_by_one_setting_each():
    sys.path.insert(0, str(BENCH))
    from validate_throughput import PATHS, path_settings

    from eogym_sft.evaluation.validate import ValidateConfig, dataloader_workers

    cuda = path_settings("new", "cuda", 8, 4)
    assert cuda == {"attention": "eogym_varlen_cudnn", "packed": True, "batch_size": 8,
                    "workers": dataloader_workers(ValidateConfig.dataloader_workers), "compiled": True, "arms": ("lora",)}
    assert path_settings("old", "cuda", 8, 4) == {
        "attention": "sdpa", "packed": False, "batch_size": 4, "workers": 0, "compiled": False, "arms": ("lora",)}
    changed = {name: {k for k in cuda if path_settings(name, "cuda", 8, 4)[k] != cuda[k]} for name in PATHS[2:]}
    assert changed == {"new-2arms": {"arms"}, "new-eager": {"compiled"}, "new-inline": {"workers"}}
    assert path_settings("new", "cpu", 8, 4)["compiled"] is False


def test_validate_bench_refuses_paths_without_the_baseline_first(tiny_model_dir, tmp_path, capsys):
    sys.path.insert(0, str(BENCH))
    from validate_throughput import main

    with pytest.raises(SystemExit):
        main(["--model", str(tiny_model_dir), "--paths", "new,old", "--json", str(tmp_path / "x.json")])
    assert "--paths: old first" in capsys.readouterr().err
