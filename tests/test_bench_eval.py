"""bench/eval_throughput.py runs end to end on CPU with the tiny model and tiny settings; its table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_eval_bench_times_every_batch_size_and_arm(tiny_model_dir, tmp_path, data_root, row_factory, capsys):
    sys.path.insert(0, str(BENCH))
    from eval_throughput import format_table, main

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row_factory(row_id=f"r{k}")) + "\n" for k in range(2)))
    out = tmp_path / "eval.json"
    result = main([
        "--model", str(tiny_model_dir), "--data", str(data), "--data-root", str(data_root), "--rows", "2",
        "--batch-size", "1", "2", "--max-new-tokens", "2", "--json", str(out),
    ])
    assert json.loads(out.read_text()) == result
    assert [(r["batch_size"], r["path"], r["arm"]) for r in result["runs"]] == [
        (b, p, a) for b in (1, 2) for p in ("generate", "slots") for a in ("base", "lora_r16")
    ]
    assert all(r["turns"] == result["turns"] and r["mean_new_tokens"] <= 2 for r in result["runs"])
    table = format_table(result).splitlines()
    assert table[2] == "batch      path        arm   turns/s  new tok/s new tok/turn   wall s  peak GiB"
    assert table[3].split() == ["1", "generate", "base", *(str(result["runs"][0][k]) for k in ("turns_per_s", "new_tokens_per_s", "mean_new_tokens", "wall_s")), "-"]
    assert capsys.readouterr().out.endswith(format_table(result) + f"\nwrote {out}\n")
