"""Data-prep throughput: rows/s per core of ``eogym_sft.data.prepare.prepare_files`` on an EO-Gym-shaped sample.

One command::

    python bench/prep_throughput.py                      # 400 rows, --num-proc 1 and os.cpu_count()
    python bench/prep_throughput.py --rows 2000 --num-proc 1 4 8 16 --json out.json

It writes the sample of ``bench/common.py`` and the tiny offline model folder (only its processor matters), times
``prepare_files`` wall-clock and CPU for each ``--num-proc`` value (worker start-up included, noting when each chunk
of results arrives), and writes rows/s, rows/s per core (overall, and steady: after the first round of chunks), rows
per CPU second and the projected time for the 7,642-row train split on 16 cores, plus machine info. A
fresh-interpreter probe times what each spawned worker pays before its first row. ``bench/README.md`` describes
every figure.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import generate_sample, machine_info, write_result  # noqa: E402 (the bench folder)

from eogym_sft.config import SampleConfig  # noqa: E402

TRAIN_ROWS = 7642  # EO-Gym train split
TARGET_CORES = 16
TARGET_SECONDS = 60.0


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
        print()
        return write_result(result, json_path, format_table(result))
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
