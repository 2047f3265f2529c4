"""What the training bench (``bench/train_throughput.py``) measures inside a run: step times, compiles, and a
profiler breakdown:

- :class:`StepProbe`, a Trainer callback: wall time of each optimizer step, the wait before it (the
  Trainer fetches all of a step's micro-batches before it starts, so a dataloader that cannot keep a
  whole step in flight shows here), the optimizer step, evaluation, and Dynamo's compiled graphs,
  recompiles and compile seconds, step by step.
- :func:`component_times`, a torch.profiler trace folded into the components of a LoRA step
  (vision tower, attention, base matmuls, LoRA matmuls, LM head and loss, optimizer, other kernels)
  plus the host's dataloader wait.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import sync as _sync  # noqa: E402

from eogym_sft.training.loss import PROFILER_RANGE as LOSS_RANGE  # noqa: E402 (the SFT loss's forward ops)

RECOMPILE_LOGGER = "torch._dynamo.guards.__recompiles"  # torch._logging's artifact logger for `recompiles`


def compile_stats() -> dict:
    """Dynamo's running totals: graphs compiled and seconds spent compiling (forward and backward)."""
    from torch._dynamo.utils import calculate_time_spent, counters

    spent = calculate_time_spent()
    return {"graphs": int(counters["stats"]["unique_graphs"]), "compile_s": spent.get("total_wall_time", 0.0)}


class RecompileLog(logging.Handler):
    """Collects Dynamo's recompile messages (``TORCH_LOGS=recompiles``) as they happen: each names the
    function and the guard that failed (a new shape, grad mode, a tensor that now requires grad)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        torch._logging.set_logs(recompiles=True)
        logging.getLogger(RECOMPILE_LOGGER).addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger(RECOMPILE_LOGGER).removeHandler(self)
        torch._logging.set_logs()

    def reasons(self, top: int = 5) -> list[tuple[str, int]]:
        """The most frequent first guard failures, e.g. ``size mismatch at index 1``, with their counts."""
        first = []
        for message in self.messages:
            lines = [line.strip("- ").strip() for line in message.splitlines() if line.strip().startswith("- ")]
            first.append(lines[0] if lines else message.splitlines()[0])
        return Counter(first).most_common(top)


class StepProbe:
    """Trainer callback: per optimizer step its wall time, the wait before it, its optimizer step,
    the graphs Dynamo compiled since training began (not before: another arm in the same process);
    and the time of each evaluation. CUDA is synchronized at
    each mark, so the times are the GPU's."""

    def __init__(self):
        self.train_start = None
        self.begins, self.ends, self.optimizer_s, self.eval_s, self.graphs, self.compile_s = [], [], [], [], [], []
        self._pre_optimizer = self._last_end = None

    def on_train_begin(self, *a, **k):
        _sync()
        self.train_start = time.perf_counter()
        self._last_end = self.train_start
        self._compiled_before = compile_stats()  # Dynamo's totals are the process's: count this run's own

    def on_step_begin(self, *a, **k):
        _sync()
        self.begins.append(time.perf_counter())

    def on_pre_optimizer_step(self, *a, **k):
        _sync()
        self._pre_optimizer = time.perf_counter()

    def on_optimizer_step(self, *a, **k):
        _sync()
        self.optimizer_s.append(time.perf_counter() - self._pre_optimizer)

    def on_step_end(self, *a, **k):
        _sync()
        self.ends.append(time.perf_counter())
        self._last_end = self.ends[-1]
        stats, before = compile_stats(), self._compiled_before
        self.graphs.append(stats["graphs"] - before["graphs"])
        self.compile_s.append(stats["compile_s"] - before["compile_s"])

    def on_evaluate(self, *a, **k):
        _sync()
        self.eval_s.append(time.perf_counter() - self._last_end)  # from the step that triggered it (its log included)

    def __getattr__(self, name):  # the other TrainerCallback hooks do nothing
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)

    def summary(self, warmup: int, skip_last: int = 0) -> dict:
        """Timing of the steps after ``warmup`` (and before the last ``skip_last``, e.g. a profiled one)."""
        stop = len(self.ends) - skip_last
        b, e = self.begins[warmup:stop], self.ends[warmup:stop]
        wall = e[-1] - b[0]
        waits = [b[i + 1] - e[i] for i in range(len(b) - 1)]
        before = self.graphs[warmup - 1] if warmup else 0
        return {
            "timed_steps": len(b),
            "timed_wall_s": wall,
            "median_step_s": sorted(y - x for x, y in zip(b, e))[len(b) // 2],
            "time_to_first_step_s": self.ends[0] - self.train_start,
            "first_step_wait_s": self.begins[0] - self.train_start,
            "dataloader_wait_fraction": sum(waits) / wall,
            "median_optimizer_s": sorted(self.optimizer_s[warmup:stop])[len(b) // 2] if self.optimizer_s[warmup:stop] else None,
            "graphs_compiled_first_step": self.graphs[0],
            "graphs_compiled_after_warmup": self.graphs[stop - 1] - before,
            "compile_s_total": self.compile_s[-1],
            "compile_s_first_step": self.compile_s[0],
            "eval_s": self.eval_s,
        }


# ---------------------------------------------------------------- profiler breakdown

COMPONENTS = ("vision_tower", "attention", "base_matmul", "lora_matmul", "lm_head_and_loss", "optimizer", "other_kernels")
VISION_RANGE = "eogym::vision_tower"
HEAD_RANGE = "eogym::lm_head"
TEXT_RANGE = "eogym::language_model"  # the decoder layers' forward, named in the trace (no component of its own)
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm")
LOSS_WORDS = ("log_softmax", "nll_loss", "cross_entropy", "crossentropy", "logsumexp", "_forward_kernel", "_backward_kernel")
ATTENTION_WORDS = ("attention", "attn", "flash", "fmha", "sdpa")
# Kernel names by family, for the kernels Inductor launches without an aten op above them (its Triton
# kernels, and in compiled backward graphs much else): checked in order, so flash kernels are attention.
KERNEL_FAMILIES = (
    ("attention", ("flash", "fmha", "attention")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "gemv")),
    ("inductor_fused", ("triton_",)),
    ("optimizer", ("multi_tensor_apply", "fused_adam")),
)


def kernel_family(name: str) -> str:
    """The family of a GPU kernel from its name (see ``KERNEL_FAMILIES``); ``other`` when none matches."""
    lower = name.lower()
    return next((family for family, words in KERNEL_FAMILIES if any(w in lower for w in words)), "other")


def annotate(model) -> list:
    """Profiler ranges around the vision tower, the language model and the LM head (module hooks, outside
    compiled code). Returns the hook handles; remove them when done."""
    labels = {"model.visual": VISION_RANGE, "model.language_model": TEXT_RANGE, "lm_head": HEAD_RANGE}
    handles = []
    for name, module in model.named_modules():
        label = next((label for end, label in labels.items() if name.endswith(end)), None)
        if label is None:
            continue
        ranges = []

        def enter(_module, _args, label=label, ranges=ranges):
            ranges.append(torch.profiler.record_function(label).__enter__())

        def leave(_module, _args, _out, ranges=ranges):
            ranges.pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    return handles


def _ancestors(event):
    parent = event.cpu_parent
    while parent is not None:
        yield parent.name
        parent = parent.cpu_parent


def _shape_dims(event) -> set[int]:
    return {int(d) for shape in (event.input_shapes or []) if isinstance(shape, (list, tuple)) for d in shape}


def classify(event, lora_rank: int, vocab: int) -> str:
    """The component an op's own kernel time belongs to (see COMPONENTS)."""
    above = [event.name, *_ancestors(event)]
    name = event.name.lower()
    if VISION_RANGE in above:
        return "vision_tower"
    if any(a.startswith(("Optimizer.step", "Optimizer.zero_grad")) for a in above):
        return "optimizer"
    if event.name in MATMUL_OPS:
        dims = _shape_dims(event)
        if HEAD_RANGE in above or vocab in dims or 32768 in dims or vocab % 32768 in dims:  # TRL's head tiles by 32,768
            return "lm_head_and_loss"
        return "lora_matmul" if lora_rank in dims else "base_matmul"
    if HEAD_RANGE in above or LOSS_RANGE in above or any(w in name for w in LOSS_WORDS):
        return "lm_head_and_loss"
    if any(w in name for w in ATTENTION_WORDS):
        return "attention"
    return "other_kernels"


def component_times(prof, lora_rank: int, vocab: int, window_s: float | None = None, on_gpu: bool | None = None) -> dict:
    """Seconds per component over the profiled window, each kernel counted once; plus the host's wait on
    the dataloader, and with ``window_s`` (the window's wall time) how busy the GPU was: well under 1
    means it waited on the host (launch overhead, host syncs), which no kernel time shows.

    On a GPU, torch.profiler lists every kernel twice: as an event of its own (named after the kernel)
    and inside the op that launched it (that op's ``self_device_time_total``). A kernel is classified by
    its launching op (so by module and shape), and the kernel events give the total: kernels that no
    op launched (linked by no correlation id) are ``unattributed_kernels``. Under ``torch.compile`` most
    kernels are such (Inductor's Triton kernels, and much of a compiled backward), so every kernel is also
    summed by its name's family (``kernel_families_s``: matmul, attention, Inductor-fused, optimizer,
    other). On a CPU run an op's own CPU time stands in for kernel time."""
    from torch.autograd import DeviceType

    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    seconds = dict.fromkeys(COMPONENTS, 0.0)
    families = {family: 0.0 for family, _ in KERNEL_FAMILIES} | {"other": 0.0}
    kernels = data_wait = 0.0
    events = prof.events()
    for event in events:
        if event.name.startswith("enumerate(DataLoader)"):
            data_wait += event.cpu_time_total / 1e6
            continue
        if event.device_type != DeviceType.CPU and getattr(event, "is_user_annotation", False):
            continue  # a record_function range drawn on the GPU timeline: it spans kernels, it is not one
        if event.device_type != DeviceType.CPU:  # a kernel's own event: in the total and by its name only
            kernels += event.self_device_time_total / 1e6
            families[kernel_family(event.name)] += event.self_device_time_total / 1e6
            continue
        own = (event.self_device_time_total if on_gpu else event.self_cpu_time_total) / 1e6
        if own > 0:
            seconds[classify(event, lora_rank, vocab)] += own
    if on_gpu:
        seconds["unattributed_kernels"] = max(0.0, kernels - sum(seconds.values()))
    total = sum(seconds.values())
    return {
        "clock": "gpu kernel time" if on_gpu else "cpu op time",
        "seconds": seconds,
        "share": {k: v / total if total else 0.0 for k, v in seconds.items()},
        "total_s": total,
        "kernel_families_s": families if on_gpu else None,  # every kernel by its name: complete where ops are not
        "host_dataloader_wait_s": data_wait,
        "window_s": window_s,
        "gpu_busy_fraction": total / window_s if on_gpu and window_s else None,  # kernels on several streams can overlap
        "gaps": gpu_gaps(events) if on_gpu else None,
    }


def _host_label(event) -> str:
    """An op and where it ran: its name, the nearest ``eogym::`` range above it and its outermost op."""
    chain = [event.name, *_ancestors(event)]
    marks = [name for name in chain[1:-1] if name.startswith("eogym::")][:1]
    return " < ".join(dict.fromkeys([chain[0], *marks, chain[-1]]))


def gpu_gaps(events, min_gap_us: float = 20.0, top: int = 12) -> dict:
    """Where the GPU waited on the host in a profiled window: the idle intervals between kernels (any stream) of at
    least ``min_gap_us``, summed by the host op running when the GPU went idle (``at_start``: what the host did
    after its last launch, such as a read-back that drained the queue and what followed it) and when the GPU got
    work again (``at_end``: the op that launched the next kernel). An op is the innermost one on any thread (the
    autograd engine runs the backward on its own), labelled by :func:`_host_label`. The profiler slows the host,
    so gaps run longer than in an unprofiled step; their ranking is what this is for."""
    import heapq

    from torch.autograd import DeviceType

    kernels = sorted((e.time_range.start, e.time_range.end) for e in events
                     if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False))
    gaps, busy_until = [], None
    for start, end in kernels:
        if busy_until is not None and start - busy_until >= min_gap_us:
            gaps.append((busy_until, start))
        busy_until = end if busy_until is None else max(busy_until, end)
    ops = sorted((e for e in events if e.device_type == DeviceType.CPU), key=lambda e: e.time_range.start)
    moments = sorted({t for gap in gaps for t in gap})
    running, active, i = {}, [], 0
    for t in moments:  # a sweep: ops that started by t, less those that ended by t
        while i < len(ops) and ops[i].time_range.start <= t:
            heapq.heappush(active, (ops[i].time_range.end, i))
            i += 1
        while active and active[0][0] <= t:
            heapq.heappop(active)
        inner = max(active, key=lambda item: (ops[item[1]].time_range.start, -item[0]), default=None)
        running[t] = "(no op)" if inner is None else _host_label(ops[inner[1]])
    by_start, by_end = {}, {}
    for start, end in gaps:
        for table, label in ((by_start, running[start]), (by_end, running[end])):
            seconds, count = table.get(label, (0.0, 0))
            table[label] = (seconds + (end - start) / 1e6, count + 1)

    def ranked(table):
        return [{"op": label, "s": round(sec, 6), "gaps": n} for label, (sec, n) in sorted(table.items(), key=lambda kv: -kv[1][0])[:top]]

    longest = sorted(gaps, key=lambda gap: gap[1] - gap[0], reverse=True)[:5]
    return {
        "min_gap_us": min_gap_us,
        "count": len(gaps),
        "total_s": round(sum(end - start for start, end in gaps) / 1e6, 6),
        "kernels_span_s": round((busy_until - kernels[0][0]) / 1e6, 6) if kernels else 0.0,
        "at_start": ranked(by_start),
        "at_end": ranked(by_end),
        "longest": [{"us": round(end - start, 1), "at_start": running[start], "at_end": running[end]} for start, end in longest],
    }


def save_trace(prof, path: str) -> None:
    """The profiler's Chrome trace, gzipped (a call brings back files of at most 16 MiB)."""
    import gzip
    import shutil
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as plain:
        prof.export_chrome_trace(plain.name)
        with open(plain.name, "rb") as fin, gzip.open(path, "wb") as fout:
            shutil.copyfileobj(fin, fout)


class ProfileLastStep:
    """Trainer callback: torch.profiler over the last ``micro_batches`` micro-batches of step
    ``step`` (0-based) and its optimizer step. A whole 32-micro-batch step would be a trace too
    large to fold in the time a GPU session has."""

    def __init__(self, step: int, grad_accum: int, micro_batches: int = 2, trace: str | None = None):
        self.step, self.start_after = step, max(0, grad_accum - micro_batches)
        self.prof, self._step, self._done = None, -1, 0
        self.window_s = None
        self.trace = trace  # a gzipped Chrome trace of the window (Perfetto, chrome://tracing)

    def on_step_begin(self, *a, **k):
        self._step += 1
        self._done = 0
        self._maybe_start()

    def on_substep_end(self, *a, **k):
        self._done += 1
        self._maybe_start()

    def _maybe_start(self):
        if self._step == self.step and self._done == self.start_after and self.prof is None:
            _sync()
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities, record_shapes=True)
            self.prof.__enter__()
            self._start = time.perf_counter()

    def on_step_end(self, *a, **k):
        if self.prof is not None and self._step == self.step:
            _sync()
            self.window_s = time.perf_counter() - self._start
            self.prof.__exit__(None, None, None)
            if self.trace:
                save_trace(self.prof, self.trace)

    def __getattr__(self, name):
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)
