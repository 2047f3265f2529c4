"""Where the GPU waits on the host: the idle gaps of a profiled training window, by what the host was doing.

``bench/train_throughput.py --profile B --trace PATH`` writes the Chrome trace of a profiled window (torch.profiler,
gzipped). The GPU's kernels, copies and fills, merged over its streams, leave gaps; each gap ends with a launch,
and the host call behind it says why the GPU waited:

- after a host sync (a ``cudaStreamSynchronize``, a copy to the host) the GPU has no queue: if it ran at most
  ``SYNC_LEAD_US`` between the sync's return and the gap, it waited for the host's work after the sync, and the gap
  is the sync's, named by the ops around it (``aten::item`` inside ``eogym::vision_tower``, say);
- otherwise the host was slower than the GPU (launch-bound code): the gap is named by the ops around the launch.

    python bench/idle_gaps.py trace_B.json.gz [--top 15] [--json out.json]
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import defaultdict

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
HOST_CATEGORIES = ("cpu_op", "user_annotation")
SYNC_LEAD_US = 200.0  # a sync is behind a gap if the GPU ran at most this much between its return and the gap


def load_trace(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as fh:
        trace = json.load(fh)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def gaps(gpu: list[dict]) -> list[tuple[float, float, dict]]:
    """``(start, end, next event)`` of each stretch where no GPU event runs, on any stream."""
    out, busy_until = [], None
    for event in sorted(gpu, key=lambda e: e["ts"]):
        if busy_until is not None and event["ts"] > busy_until:
            out.append((busy_until, event["ts"], event))
        busy_until = _end(event) if busy_until is None else max(busy_until, _end(event))
    return out


class HostStacks:
    """The host ops (``cpu_op`` and ``record_function`` ranges) open on a thread at a given time, outermost first."""

    def __init__(self, events: list[dict]):
        self._ranges = defaultdict(list)
        for event in events:
            if event.get("cat") in HOST_CATEGORIES and event.get("ph") == "X":
                self._ranges[(event["pid"], event["tid"])].append(event)
        self._starts, self._parents = {}, {}
        for thread, ranges in self._ranges.items():
            ranges.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
            self._starts[thread] = [e["ts"] for e in ranges]
            parents, open_ = [], []  # ranges nest on a thread: each one's parent is the innermost still open
            for i, event in enumerate(ranges):
                while open_ and _end(ranges[open_[-1]]) < event["ts"]:
                    open_.pop()
                parents.append(open_[-1] if open_ else -1)
                open_.append(i)
            self._parents[thread] = parents

    def at(self, thread, ts: float) -> list[str]:
        ranges, parents = self._ranges.get(thread, []), self._parents.get(thread, [])
        i = bisect.bisect_right(self._starts.get(thread, []), ts) - 1
        while i >= 0 and _end(ranges[i]) < ts:  # the last range started may have ended: go up to one still open
            i = parents[i]
        names = []
        while i >= 0:
            names.append(ranges[i]["name"])
            i = parents[i]
        return names[::-1]


def _blocks(call: dict, gpu_names: dict) -> bool:
    """Whether a runtime call waits for the GPU: a synchronize, or a copy to the host (a copy on the device does not)."""
    if "Synchronize" in call["name"]:
        return True
    return "Memcpy" in call["name"] and "DtoH" in gpu_names.get(call.get("args", {}).get("correlation"), "")


def _end(event: dict) -> float:
    return event["ts"] + event.get("dur", 0)


def _name(stack: list[str], depth: int) -> str:
    """An outermost ``eogym::`` range (the bench's annotations), then the innermost ``depth`` ops."""
    marks = [name for name in stack if name.startswith("eogym::")]
    inner = [name for name in stack if not name.startswith("eogym::")][-depth:]
    return " > ".join(marks[:1] + inner) or "(no host op)"


def idle_report(events: list[dict], top: int = 15, depth: int = 3) -> dict:
    """The GPU's busy and idle time over the trace, and the idle time by cause (see the module docstring)."""
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES and e.get("ph") == "X"]
    if not gpu:
        raise ValueError("the trace has no GPU events (kernels, copies, fills): was it profiled on a GPU?")
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    copies = {e["args"]["correlation"]: e["name"] for e in gpu if "correlation" in e.get("args", {})}
    syncs = sorted((e for e in events if e.get("cat") in LAUNCH_CATEGORIES and _blocks(e, copies)), key=_end)
    sync_ends = [_end(e) for e in syncs]
    stacks = HostStacks(events)
    found = gaps(gpu)
    starts, idle_before = [g[0] for g in found], [0.0]  # idle_before[i]: idle time before gap i
    for start, end, _ in found:
        idle_before.append(idle_before[-1] + end - start)

    def busy_between(t0: float, t1: float) -> float:  # GPU busy time in [t0, t1], t1 the start of a gap
        if t0 >= t1:
            return 0.0
        i, j = bisect.bisect_right(starts, t0), bisect.bisect_left(starts, t1)
        idle_in = idle_before[j] - idle_before[i]  # the gaps that start inside
        if i > 0 and found[i - 1][1] > t0:  # and the rest of the one t0 falls in
            idle_in += found[i - 1][1] - t0
        return (t1 - t0) - idle_in

    by_cause = defaultdict(lambda: [0.0, 0])
    idle = after_sync = 0.0
    for start, end, nxt in found:
        length = end - start
        idle += length
        launch = launches.get(nxt.get("args", {}).get("correlation"))
        launched_at = launch["ts"] if launch else end
        # The last sync to return before the launch that ended the wait counts if the GPU had at most SYNC_LEAD_US of
        # work left when it returned: the host then had no lead, and the gap is that sync's and the host work after it.
        k = bisect.bisect_right(sync_ends, launched_at) - 1
        sync = syncs[k] if k >= 0 and busy_between(min(sync_ends[k], start), start) <= SYNC_LEAD_US else None
        if sync is not None:
            after_sync += length
            cause = "sync: " + _name(stacks.at((sync["pid"], sync["tid"]), sync["ts"]) + [sync["name"]], depth + 1)
        elif launch is not None:
            cause = "launch: " + _name(stacks.at((launch["pid"], launch["tid"]), launch["ts"]), depth)
        else:
            cause = "launch: (not in the trace)"
        by_cause[cause][0] += length
        by_cause[cause][1] += 1
    first = min(e["ts"] for e in gpu)
    last = max(_end(e) for e in gpu)
    ranked = sorted(by_cause.items(), key=lambda kv: -kv[1][0])
    return {
        "gpu_span_ms": (last - first) / 1e3,
        "idle_ms": idle / 1e3,
        "idle_share": idle / (last - first) if last > first else 0.0,
        "idle_after_sync_ms": after_sync / 1e3,
        "host_syncs": len(syncs),
        "causes": [{"cause": cause, "idle_ms": us / 1e3, "gaps": n} for cause, (us, n) in ranked[:top]],
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--depth", type=int, default=3, help="innermost host ops named per cause")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    report = idle_report(load_trace(args.trace), args.top, args.depth)
    print(f"GPU span {report['gpu_span_ms']:.1f} ms: idle {report['idle_ms']:.1f} ms ({report['idle_share']:.1%}), "
          f"{report['idle_after_sync_ms']:.1f} ms of it after {report['host_syncs']} host syncs")
    for row in report["causes"]:
        print(f"{row['idle_ms']:9.2f} ms {row['gaps']:6d} gaps  {row['cause']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    return report


if __name__ == "__main__":
    main()
