#!/usr/bin/env bash
# The test suite's wall time at two commits on one machine: fresh clones of BASE and of HEAD, each installed editable
# without dependencies and run alternately (BASE, HEAD, BASE, ...) with the README's `CI=true python -m pytest -q`, so
# that a drift in the machine's speed falls on both. One line a run; suite_time.json (the runs and the machine) in
# the current folder. The checkout is reinstalled at the end.   bash bench/suite_time.sh BASE [ROUNDS]
set -euo pipefail
base=${1:?usage: bash bench/suite_time.sh BASE [ROUNDS]}
rounds=${2:-2}
repo=$(cd "$(dirname "$0")/.." && pwd)
head=$(git -C "$repo" rev-parse --short HEAD)
work=$(mktemp -d /tmp/suite_time.XXXXXX)
results=$(pwd)/suite_time.json
trap 'pip install -q --no-deps --no-build-isolation -e "$repo" >/dev/null 2>&1' EXIT

for commit in "$base" "$head"; do
  git clone -q "$repo" "$work/$commit"
  git -C "$work/$commit" checkout -q "$commit"
done

runs=$work/runs.tsv
for round in $(seq 1 "$rounds"); do
  for commit in "$base" "$head"; do
    cd "$work/$commit"
    pip install -q --no-deps --no-build-isolation -e . >"$work/$commit.install.log" 2>&1 \
      || { echo "suite_time.sh: the editable install of $commit failed: $work/$commit.install.log" >&2; exit 1; }
    CI=true python -m pytest -q -p no:cacheprovider >"$work/$commit.$round.log" 2>&1 || true
    summary=$(tail -1 "$work/$commit.$round.log")   # "633 passed, 8 skipped, 51 warnings in 190.36s (0:03:10)"
    passed=$(grep -oE '[0-9]+ passed' <<<"$summary" | cut -d' ' -f1 || true)
    failed=$(grep -oE '[0-9]+ failed' <<<"$summary" | cut -d' ' -f1 || true)
    skipped=$(grep -oE '[0-9]+ skipped' <<<"$summary" | cut -d' ' -f1 || true)
    seconds=$(grep -oE 'in [0-9.]+s' <<<"$summary" | tr -dc '0-9.' || true)
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$commit" "$round" "${passed:-0}" "${failed:-0}" "${skipped:-0}" \
        "$seconds" "$(date -u +%FT%TZ)" | tee -a "$runs"
  done
done

python - "$runs" "$results" "$repo/bench" <<'EOF'
import json, sys
sys.path.insert(0, sys.argv[3])
from common import machine_info
keys = ("commit", "round", "passed", "failed", "skipped", "seconds", "ended_utc")
runs = [dict(zip(keys, line.rstrip("\n").split("\t"))) for line in open(sys.argv[1])]
for run in runs:
    for key in ("round", "passed", "failed", "skipped"):
        run[key] = int(run[key])
    run["seconds"] = float(run["seconds"]) if run["seconds"] else None  # None: pytest did not finish
json.dump({"runs": runs, "machine": machine_info()}, open(sys.argv[2], "w"), indent=1)
print(f"wrote {sys.argv[2]}")
EOF
