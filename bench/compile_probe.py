"""Where the first training step's compile time goes: the recipe's compiled decoder layer alone.

    python bench/compile_probe.py --backend aot_eager --lengths 1000,1000 --json compile_cpu.json
    python bench/compile_probe.py --device cuda --backend inductor --lengths 3000,3000 --json compile_h200.json

Builds Qwen3-VL's text tower at the given config's dimensions (the 4B one by default) with ``--layers``
decoder layers and a tiny vision tower (it is not compiled), puts the recipe's LoRA on it
(``apply_lora``: r16, alpha 32, dropout 0.05 on q/k/v/o/gate/up/down), switches the text attention to the
recipe's (``attn_implementation`` in recipes/eo_gym_4b.yaml) and compiles the layers as the recipe does
(``compile_language_layers``). Then it runs
forward + backward of the text tower on a packed micro-batch (``--lengths``: one sample each, position
ids restarting at 0 as ``EOGymCollator`` gives them), then on a micro-batch of other lengths, which must
not compile again, then on the first one again.

Each variant (``--variants``) runs in a fresh process with its own Inductor and Triton caches (kept under
``--cache-dir``, so that a second call is warm): the same compile with one setting changed. Reported per
variant: the steps' wall times (the first minus the third is about what compiling cost), Dynamo's compile
seconds and phase timers (``step_probe.compile_phases``), its compile attempts (two: it restarted its
analysis), graphs, recompiles, the compile caches' hits and misses, and with ``--profile N`` the first
step's own time by area under cProfile and its N functions with the most cumulative time.

``aot_eager`` stops after AOTAutograd: Dynamo's tracing and AOTAutograd's joint graph and partition run
on the host the same way for a CUDA model, so the CPU times those; ``inductor`` adds code generation.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import importlib
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eval_throughput import machine_info  # noqa: E402
from prep_throughput import write_result  # noqa: E402
from step_probe import RecompileLog, compile_caches, compile_phases, compile_stats  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "recipes" / "configs" / "qwen3_vl_4b_instruct.json"
ATTENTION = yaml.safe_load((REPO / "recipes" / "eo_gym_4b.yaml").read_text())["attn_implementation"]
TINY_VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "deepstack_visual_indexes": [0]}

# Each variant changes one thing of the recipe's compile: "compile" adds compile_language_layers keyword
# arguments, "config" patches torch config modules ({"torch._inductor.config": {"key": value}}) while the
# model runs, "float_inputs" undoes compile_language_layers' constant floats (what the recipe compiled before).
VARIANTS: dict[str, dict] = {
    "shipped": {},  # compile_language_layers as the recipe calls it
    "float_inputs": {"float_inputs": True},  # floats as graph inputs: a restart and a second trace
    "static": {"compile": {"dynamic": False}},  # no symbolic shapes (a lower bound: it recompiles on each new length)
    "no_pointwise_autotune": {"config": {"torch._inductor.config": {"triton.autotune_pointwise": False}}},  # GPU
    "in_process_compile": {"config": {"torch._inductor.config": {"compile_threads": 1}}},  # no compile worker pool
}
# Where a cProfile'd first step spends its own time, by the file a function is in (first match wins).
AREAS = (
    ("torch/_inductor/", "inductor"), ("triton/", "triton"), ("torch/_dynamo/", "dynamo"),
    ("torch/_functorch/", "aot_autograd"), ("torch/fx/experimental/", "symbolic shapes"), ("sympy/", "symbolic shapes"),
    ("torch/_subclasses/", "fake tensors"), ("torch/fx/", "fx"), ("torch/_guards", "dynamo"), ("peft/", "peft"),
    ("transformers/", "transformers"), ("eogym_sft/", "eogym_sft"), ("torch/", "torch, other python"),
)


def build_model(config_path: Path, layers: int, device: str, dtype: str, vocab: int = 1024):
    """Qwen3-VL at ``config_path``'s text dimensions with ``layers`` decoder layers, the recipe's LoRA and
    attention; the vocabulary and vision tower are shrunk (neither is compiled)."""
    from eogym_sft.models.attention import (
        add_sample_boundaries,
        register_varlen_attention,
    )
    from eogym_sft.models.loading import apply_lora
    from eogym_sft.models.tiny import build_tiny_model

    config = copy.deepcopy(json.loads(Path(config_path).read_text()))
    config["text_config"].update(num_hidden_layers=layers, vocab_size=vocab, bos_token_id=None, eos_token_id=None)
    config["vision_config"].update(TINY_VISION, out_hidden_size=config["text_config"]["hidden_size"])
    model = build_tiny_model(seed=0, config=config, dtype=dtype, device=device)
    register_varlen_attention()
    model.set_attn_implementation({"text_config": ATTENTION, "vision_config": "sdpa"})
    add_sample_boundaries(model)
    return apply_lora(model).train()


def packed_inputs(lengths: list[int], hidden: int, device: str, dtype: str, seed: int = 0) -> dict:
    """Embeddings of one packed row of samples and its 4-row position ids (text, then mRoPE t/h/w), as the
    collator gives them: each sample's positions restart at 0."""
    gen = torch.Generator().manual_seed(seed)
    embeds = torch.randn(1, sum(lengths), hidden, generator=gen).to(device, getattr(torch, dtype))
    positions = torch.cat([torch.arange(n) for n in lengths])
    return {"inputs_embeds": embeds.requires_grad_(), "position_ids": positions.expand(4, 1, -1).to(device)}


def step(decoder, inputs: dict) -> tuple[float, float]:
    """Forward, then backward, of the text tower: wall seconds of each (the layers compile in the first forward;
    a CUDA backward runs on autograd's own thread, where Triton tunes the backward's kernels at their first launch)."""
    sync = torch.cuda.synchronize if inputs["inputs_embeds"].is_cuda else (lambda: None)
    start = time.perf_counter()
    out = decoder(**inputs, use_cache=False).last_hidden_state
    sync()
    middle = time.perf_counter()
    out.float().square().mean().backward()
    sync()
    return middle - start, time.perf_counter() - middle


def top_functions(stats: pstats.Stats, n: int) -> list[dict]:
    """The ``n`` functions with the most cumulative time."""
    rows = []
    for (path, line, name), (_, calls, _, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{Path(path).name}:{line}({name})", "path": path, "calls": calls, "cumulative_s": round(cumulative, 3)})
    return sorted(rows, key=lambda r: -r["cumulative_s"])[:n]


def area(path: str, name: str) -> str:
    if path == "~":  # a C function: where Python waits for a lock or a subprocess, or runs C++ (ops, kernels)
        waits = ("acquire", "wait", "select", "poll", "sleep", "read")
        return "waiting (locks, subprocesses)" if any(w in name for w in waits) else "C++ (ops, kernels, builtins)"
    path = path.replace("\\", "/")
    return next((label for marker, label in AREAS if marker in path), "other python")


def time_by_area(stats: pstats.Stats) -> dict[str, float]:
    """Each function's own time (not its callees'), summed by area, on the profiled thread: at most the step's
    wall time (autograd runs a CUDA backward on a thread of its own, which cProfile does not see)."""
    totals: dict[str, float] = {}
    for (path, _, name), (_, _, own, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        key = area(path, name)
        totals[key] = totals.get(key, 0.0) + own
    return {k: round(v, 2) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def run_variant(args, name: str) -> dict:
    """One variant, in this process: build, compile, three steps (first, other lengths, first again)."""
    from torch._dynamo.utils import compile_times, counters

    from eogym_sft.models.loading import compile_language_layers

    variant = VARIANTS[name]
    start = time.perf_counter()
    model = build_model(args.config, args.layers, args.device, args.dtype)
    decoder = model.get_decoder()
    build_s = time.perf_counter() - start
    lengths = [int(n) for n in args.lengths.split(",")]
    other = [n + 37 * (k + 1) for k, n in enumerate(lengths)]  # other lengths, other boundaries
    inputs = [packed_inputs(ls, decoder.config.hidden_size, args.device, args.dtype, seed=k) for k, ls in enumerate((lengths, other))]
    torch._dynamo.reset()
    counters.clear()  # graphs and cache hits of this variant only
    compile_language_layers(model, backend=args.backend, **variant.get("compile", {}))
    if variant.get("float_inputs"):
        for layer in decoder.layers:
            layer._compiled_call_impl = layer._compiled_call_impl.__wrapped__  # without the constant-floats patch
    profile = cProfile.Profile() if args.profile else None
    with ExitStack() as stack:
        for module, values in variant.get("config", {}).items():
            stack.enter_context(importlib.import_module(module).patch(values))
        recompiles = stack.enter_context(RecompileLog())
        if profile:
            profile.enable()
        first_fwd, first_bwd = step(decoder, inputs[0])
        if profile:
            profile.disable()
        first = compile_stats()
        phases = compile_phases(24)
        attempts = sorted(n for n in compile_times(repr="csv", aggregate=True)[0] if n.startswith("compile_attempt_"))
        second_s = sum(step(decoder, inputs[1]))
        third_fwd, third_bwd = step(decoder, inputs[0])
    stats = compile_stats()
    result = {
        "variant": name, "backend": args.backend, "device": args.device, "dtype": args.dtype, "layers": args.layers,
        "lengths": lengths, "second_lengths": other, "torch": torch.__version__, "build_s": round(build_s, 2),
        "first_step_s": round(first_fwd + first_bwd, 2), "second_step_s": round(second_s, 2),
        "third_step_s": round(third_fwd + third_bwd, 2), "first_forward_s": round(first_fwd, 2),
        "first_backward_s": round(first_bwd, 2), "third_forward_s": round(third_fwd, 2), "third_backward_s": round(third_bwd, 2),
        "compile_s_first_step": round(first["compile_s"], 2), "compile_s": round(stats["compile_s"], 2),
        "graphs": stats["graphs"], "recompiles": len(recompiles.messages), "recompile_reasons": recompiles.messages[:4],
        "compile_attempts": attempts,
        "compile_phases_s": {k: round(v, 3) for k, v in phases.items()},
        "compile_caches": compile_caches(),
    }
    if profile:
        stats_ = pstats.Stats(profile, stream=io.StringIO())
        result["profiled_s_by_area"] = time_by_area(stats_)  # this thread's: not a CUDA backward's
        result["top_cumulative"] = top_functions(stats_, args.profile)
    return result


def child_env(cache_dir: Path, name: str) -> dict:
    """The variant's process environment: its own Inductor and Triton caches, under ``cache_dir``, and this
    checkout's ``eogym_sft`` first on the path."""
    folder = cache_dir / name
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor"),
            "TRITON_CACHE_DIR": str(folder / "triton")}


def summary(r: dict) -> str:
    phases = r["compile_phases_s"]
    main_phases = ", ".join(f"{k} {phases[k]}" for k in ("bytecode_tracing", "aot_trace_joint_graph", "inductor_compile") if k in phases)
    return (f"{r['variant']}: first step {r['first_step_s']} s (forward {r['first_forward_s']}, backward {r['first_backward_s']}; "
            f"later steps {r['second_step_s']}, {r['third_step_s']}), compile "
            f"{r['compile_s_first_step']} s [{main_phases}], attempts {len(r['compile_attempts'])}, graphs {r['graphs']}, "
            f"recompiles {r['recompiles']}, caches {r['compile_caches']}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=CONFIG, help="a Qwen3-VL config.json (the 4B one by default)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (they share one compiled graph)")
    parser.add_argument("--lengths", default="1000,1000", help="the first micro-batch's samples' lengths")
    parser.add_argument("--backend", default="aot_eager", choices=("aot_eager", "inductor"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--variants", default="shipped", help=f"comma-separated, each in a fresh process: {', '.join(VARIANTS)}")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="keep each variant's Inductor and Triton caches under DIR/<variant> (a second call is warm); "
                             "default: a fresh folder per variant (cold)")
    parser.add_argument("--profile", type=int, default=0, help="cProfile the first step: its time by area and its N top functions")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # the child: one variant in this process
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.variant:
        args.json.write_text(json.dumps(run_variant(args, args.variant), indent=2))
        return {}
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    argv = sys.argv[1:] if argv is None else argv
    result = {"command": " ".join(["bench/compile_probe.py", *argv]), "machine": machine_info(torch.device(args.device)), "variants": []}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            out = Path(tmp) / f"{name}.json"
            child = [sys.executable, __file__, *argv, "--variant", name, "--json", str(out)]
            subprocess.run(child, check=True, env=child_env(args.cache_dir or Path(tmp) / "caches", name))
            result["variants"].append(json.loads(out.read_text()))
            print(summary(result["variants"][-1]), flush=True)
            if args.json:  # after each variant, so that a run stopped by a time limit keeps what it measured
                write_result(result, args.json)
    return result

if __name__ == "__main__":
    main()
