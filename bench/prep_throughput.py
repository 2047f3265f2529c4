"""Data-prep throughput: rows/s per core of ``eogym_sft.data.prepare.prepare_files`` on the EO-Gym-shaped sample of
``bench/common.py``, wall-clock and CPU for each ``--num-proc`` (worker start-up included), with what a fresh worker
pays before its first row and the projected time for the 7,642-row train split on 16 cores (bench/README.md).

    python bench/prep_throughput.py --rows 2000 --num-proc 1 4 8 16 --json out.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command, generate_sample, machine_info, runs_table, scratch_dir, write_result  # noqa: E402

from eogym_sft.config import SampleConfig  # noqa: E402

TRAIN_ROWS = 7642  # EO-Gym train split
TARGET_CORES = 16
TARGET_SECONDS = 60.0


def _cpu_seconds() -> float:
    """CPU time of this process and of its reaped children (pool workers), user + system."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def time_prepare(jsonl: Path, model_dir: Path, cfg, num_proc: int) -> tuple[float, float, list, list]:
    """``(wall_s, cpu_s, results, marks)`` of one ``prepare_files`` call, worker start-up included; ``marks`` are
    ``(seconds since the start, rows)`` for each chunk of results, caught by standing in for its progress bar."""
    import tqdm.auto

    from eogym_sft.data.prepare import prepare_files

    marks: list[tuple[float, int]] = []

    class ProgressClock:  # prepare_files' progress bar: it calls update once a chunk, then close
        def __init__(self, *args, **kwargs):
            self.close = lambda: None

        def update(self, n=1):
            marks.append((time.perf_counter() - t0, n))

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


def time_runs(jsonl: Path, model_dir: Path, cfg, num_procs: list[int]) -> list[dict]:
    """One ``prepare_files`` run per worker count, each run's output hash checked against the first's."""
    runs, reference_hash = [], None
    for n in num_procs:
        wall, cpu, results, marks = time_prepare(jsonl, model_dir, cfg, n)
        samples = [s for r in results for s in r.samples]
        digest = hashlib.sha256("".join(json.dumps(s, sort_keys=True) for s in samples).encode()).hexdigest()[:16]
        reference_hash = reference_hash or digest
        rate = len(results) / wall
        first, steady = steady_state(marks, n)
        per_core, per_core_steady = rate / n, (steady / n if steady else None)
        projected = (first or 0.0) + TRAIN_ROWS / ((per_core_steady or per_core) * TARGET_CORES)
        runs.append({
            "num_proc": n, "rows": len(results), "samples": len(samples),
            **{f"rows_{k}": sum(r.status == k for r in results) for k in ("kept", "split", "dropped")},
            "wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "first_result_s": None if first is None else round(first, 3),
            "rows_per_s": round(rate, 3), "rows_per_s_per_core": round(per_core, 3),
            "rows_per_s_per_core_steady": None if per_core_steady is None else round(per_core_steady, 3),
            "rows_per_cpu_s": round(len(results) / cpu, 3) if cpu > 0 else None,
            "projected_s_7642_rows_16_cores": round(projected, 1), "meets_target": projected < TARGET_SECONDS,
            "output_hash": digest, "same_output_as_first": digest == reference_hash,
        })
        print(f"num_proc={n}: {len(results)} rows in {wall:.1f}s wall, {cpu:.1f}s CPU", flush=True)
    return runs


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=400, help="rows in the generated sample")
    parser.add_argument("--num-proc", type=int, nargs="+", default=None, help="worker counts to time (default: 1 and os.cpu_count())")
    parser.add_argument("--workdir", default=None, help="folder for the sample and the tiny model, kept and reused (default: a temp folder)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-length", type=int, default=SampleConfig.max_length, help="token budget per sample")
    parser.add_argument("--json", default="prep_throughput.json", help="where to write the JSON result")
    parser.add_argument("--no-startup", action="store_true", help="skip the worker start-up probe")
    args = parser.parse_args(argv)

    from eogym_sft.data.prepare import PrepConfig
    from eogym_sft.models.tiny import save_tiny_model

    with scratch_dir(args.workdir, "eogym_prep_bench_") as workdir:
        t0 = time.perf_counter()
        jsonl, data_root = generate_sample(workdir / "sample", args.rows, args.seed)
        gen_s = time.perf_counter() - t0
        model_dir = workdir / "tiny_model"  # only its processor matters
        if not (model_dir / "tokenizer.json").exists():
            save_tiny_model(model_dir)
        machine = machine_info()  # before the runs: the load average is other work on the machine
        probe = None if args.no_startup else worker_start_probe(model_dir)
        print(f"sample: {args.rows} rows in {gen_s:.1f}s; worker start-up in a fresh interpreter: {probe}", flush=True)
        runs = time_runs(jsonl, model_dir, PrepConfig(data_root=str(data_root), max_length=args.max_length),
                         args.num_proc or sorted({1, os.cpu_count() or 1}))
    result = {
        "bench": "prep_throughput", "command": command("prep_throughput", argv), "rows": args.rows, "seed": args.seed,
        "max_length": args.max_length, "sample_generation_s": round(gen_s, 2),
        "target": f"{TRAIN_ROWS} rows in < {TARGET_SECONDS:.0f}s on {TARGET_CORES} cores "
                  f"(>= {TRAIN_ROWS / TARGET_SECONDS / TARGET_CORES:.2f} rows/s per core)",
        "machine": machine, "worker_start_probe": probe, "runs": runs,
    }
    return write_result(result, args.json, format_table(result))


def format_table(result: dict) -> str:
    m = result["machine"]
    columns = [("num_proc", 8, "num_proc"), ("rows", 5, "rows"), ("samples", 7, "samples"), ("wall s", 7, "wall_s"),
               ("CPU s", 7, "cpu_s"), ("1st result s", 12, "first_result_s"), ("rows/s", 7, "rows_per_s"),
               ("rows/s/core", 11, "rows_per_s_per_core"), ("steady rows/s/core", 18, "rows_per_s_per_core_steady"),
               ("rows/CPU-s", 10, "rows_per_cpu_s"), ("7642@16c s", 10, "projected_s_7642_rows_16_cores")]
    return runs_table(result["runs"], columns, f"{m['cpu_model']} | {m['cpu_count']} CPUs ({m['usable_cpus']} usable, load avg "
                      f"{m['load_avg_1m']}) | Python {m['python']} | {m['date']}", f"target: {result['target']}")


if __name__ == "__main__":
    main()
