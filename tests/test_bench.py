"""The training benches on CPU with the tiny model: ``bench/train_throughput.py`` with its step probe and
profiler breakdown, and ``bench/recipe_throughput.py`` timing the recipe itself. Figures are not checked
(CPU), the accounting is: steps, tokens, components."""

from __future__ import annotations

import copy
import json
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> Path:
    """The tiny Qwen3-VL with dimensions unlike the LoRA rank (16), so the profile can tell LoRA matmuls apart."""
    from eogym_sft.models.tiny import TINY_QWEN3_VL_CONFIG

    config = copy.deepcopy(TINY_QWEN3_VL_CONFIG)
    config["text_config"].update(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=12)
    config["vision_config"].update(hidden_size=32, intermediate_size=64, out_hidden_size=32)
    path = tmp_path_factory.mktemp("config") / "tiny.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.slow(12)
def test_train_bench_times_steps_and_breaks_a_step_into_components(tiny_config, tmp_path):
    """One arm of train_throughput.py (its main() only adds the generated 4000-px sample, slow to decode on CPU)."""
    import train_throughput
    from test_recipe import MAX_PIXELS, MIN_PIXELS, write_rows

    from eogym_sft.data.datasets import load_or_prepare
    from eogym_sft.data.prepare import PrepConfig
    from eogym_sft.models.processor import load_processor

    base, cfg, model_dir = train_throughput.build_base(tiny_config, tmp_path)
    data = write_rows(tmp_path / "data")
    processor = load_processor(str(model_dir), MAX_PIXELS, MIN_PIXELS)
    prep = PrepConfig(data_root=str(data.parent))
    dataset, _ = load_or_prepare(str(data), str(model_dir), processor, prep, tmp_path / "prepared", 1)
    started = time.perf_counter()
    result = train_throughput.run_arm("B-nocompile", base, dataset, data.parent, processor, cfg, tmp_path, steps=1, warmup=1,
                                      grad_accum=2, profile=True)
    elapsed = time.perf_counter() - started
    assert result["timed_steps"] == 1 and result["micro_batches_per_step"] == 2
    assert result["timed_step_s"] == [pytest.approx(result["timed_wall_s"])]
    assert result["timed_step_real_tokens"] == [result["real_tokens_per_step"]]
    assert result["real_tokens_per_s"] == pytest.approx(result["real_tokens_per_step"] / result["timed_wall_s"])
    assert result["graphs_compiled_first_step"] == 0 and result["recompiles"] == 0  # nothing compiled in this arm
    assert 0 < result["pre_loop_s"] < result["time_to_first_step_s"]
    assert len(result["step_losses"]) == 3 and all(loss > 0 for loss in result["step_losses"])  # warm-up, timed, profiled
    profile = result["profile"]
    assert set(profile["seconds"]) == {"vision_tower", "attention", "base_matmul", "lora_matmul", "lm_head_and_loss",
                                       "optimizer", "other_kernels"}
    assert all(seconds > 0 for seconds in profile["seconds"].values()), profile["seconds"]
    assert sum(profile["share"].values()) == pytest.approx(1.0)
    # the profiled step runs inside run_arm, after the timed one; its profiler makes it many times longer on a CPU
    assert 0 < profile["window_s"] < elapsed - result["timed_wall_s"] and profile["gpu_busy_fraction"] is None  # CPU run


def test_micro_batches_are_counted_where_they_are_collated():
    """The bench counts each micro-batch on the host, as the collator builds it (no sync in the timed step):
    packed samples by their position restarts, padded rows by their mask; supervised tokens after the shift."""
    from train_throughput import COUNTS_KEY, Counted

    packed = {"position_ids": torch.tensor([0, 1, 2, 0, 1]).expand(4, 1, 5), "labels": torch.tensor([[-100, 5, 6, -100, 7]]),
              "image_grid_thw": torch.tensor([[1, 4, 6]])}
    padded = {"attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]), "labels": torch.tensor([[-100, 5, 6], [-100, 7, -100]])}
    trainer = type("Trainer", (), {})()
    trainer.data_collator = lambda examples: dict(examples[0])
    trainer.compute_loss = lambda model, inputs: sorted(inputs)
    counted = Counted(trainer)
    for batch, keys in ((packed, ["image_grid_thw", "labels", "position_ids"]), (padded, ["attention_mask", "labels"])):
        inputs = trainer.data_collator([batch])
        assert isinstance(inputs[COUNTS_KEY], tuple)
        assert trainer.compute_loss(None, inputs) == keys  # the counts do not reach the model
    assert counted.real == [5, 5] and counted.supervised == [3, 3] and counted.images == [[24], []]
    assert counted.lengths == [[(3, 1.5), (2, 1.5)], [(3, 1.5), (2, 1.5)]]


def test_step_losses_sum_each_steps_micro_batches():
    """Each step's loss as the Trainer logs it: its micro-batches' training_step values summed (they come scaled)."""
    from train_throughput import StepLosses

    trainer = type("Trainer", (), {})()
    trainer.training_step = lambda model, inputs, n: torch.tensor(inputs)
    losses = StepLosses(trainer)
    for value in (1.0, 2.0, 0.5, 0.25):
        assert trainer.training_step(None, value, None) == value
    assert losses.per_step(2) == [3.0, 0.75]


@pytest.fixture(scope="module")
def recipe_halves(tiny_model_dir, tmp_path_factory):
    """``bench/recipe_throughput.py`` on a run longer than one GPU call: the first half starts the run and stops
    with a checkpoint after step 2 of 4, the second resumes there (same --total-steps, so the same run to the
    resume check) and times the rest. Both tests below read these two reports."""
    import recipe_throughput
    from test_recipe import recipe_args, write_rows

    tmp_path = tmp_path_factory.mktemp("recipe_bench")
    data = write_rows(tmp_path / "data")
    cpu = recipe_args(tiny_model_dir, data, tmp_path / "unused", tmp_path / "prepared", steps=0)
    common = ["--model", str(tiny_model_dir), "--dataset", str(data), "--data-root", str(data.parent), "--warmup", "1",
              "--steps", "1", "--total-steps", "4", "--output-dir", str(tmp_path / "run")]
    first = recipe_throughput.main([*common, "--stop-after", "2", "--json", str(tmp_path / "first.json"), "--", *cpu])
    checkpoints = sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*"))
    second = recipe_throughput.main([*common, "--", *cpu, "--resume_from_checkpoint", "last"])
    return {"first": first, "second": second, "checkpoints_after_first": checkpoints, "dir": tmp_path}


@pytest.mark.slow(49)
def test_recipe_bench_times_the_recipe_itself(recipe_halves):
    report = recipe_halves["first"]
    recipe = report["recipe"]
    assert recipe["timed_steps"] == 1 and len(recipe["step_s"]) == 2 and len(recipe["optimizer_s"]) == 2
    assert len(recipe["real_tokens_per_step"]) == 2 and all(n > 0 for n in recipe["real_tokens_per_step"])
    assert recipe["real_tokens_per_s"] == pytest.approx(sum(recipe["real_tokens_per_step"][1:]) / recipe["timed_wall_s"])
    assert recipe["setup_s"] > 0 and recipe["time_to_first_step_from_start_s"] > recipe["time_to_first_step_s"]
    assert recipe["pixel_dtype"] == "torch.float32"  # the model's dtype on CPU (--dtype float32), handed to the collator
    assert json.loads((recipe_halves["dir"] / "first.json").read_text())["side_by_side"] is None


@pytest.mark.slow
def test_recipe_bench_times_a_run_in_resumed_halves(recipe_halves):
    first, second = recipe_halves["first"]["recipe"], recipe_halves["second"]["recipe"]
    assert first["eval_s"] == [] and recipe_halves["checkpoints_after_first"] == ["checkpoint-2"]
    assert len(second["step_s"]) == 2 and second["timed_steps"] == 1
    assert len(second["eval_s"]) == 1  # one evaluation, after the last step
    run = recipe_halves["dir"] / "run"
    assert (run / "adapter_model.safetensors").is_file()
    assert json.loads((run / "checkpoint-4" / "trainer_state.json").read_text())["global_step"] == 4


def test_side_by_side_puts_arm_b_beside_the_recipe(tmp_path):
    from recipe_throughput import side_by_side

    baseline = tmp_path / "train.json"
    baseline.write_text(json.dumps({"results": [{"arm": "A", "real_tokens_per_s": 1.0},
                                                {"arm": "B", "real_tokens_per_s": 400.0, "median_step_s": 2.0}]}))
    row = side_by_side({"real_tokens_per_s": 300.0}, str(baseline))
    assert row["recipe_vs_B_tokens_per_s"] == 0.75 and row["B_median_step_s"] == 2.0 and row["B_recompiles"] is None
    assert side_by_side({}, None) is None
    assert "error" in side_by_side({"real_tokens_per_s": 1.0}, str(baseline), arm="B-fixedcount")


def test_determinism_bench_reads_two_runs(tmp_path):
    """bench/determinism.py on two fake runs: one LoRA tensor and one logged loss differ by a known amount."""
    import torch
    from determinism import compare_runs
    from safetensors.torch import save_file

    for run, delta in (("a", 0.0), ("b", 0.25)):
        (tmp_path / run / "checkpoint-2").mkdir(parents=True)
        save_file({"x.lora_A.weight": torch.ones(2, 2), "x.lora_B.weight": torch.full((2, 2), 0.5 + delta)}, str(tmp_path / run / "adapter_model.safetensors"))
        history = [{"step": 1, "loss": 2.0, "grad_norm": 1.0}, {"step": 2, "loss": 1.5 + delta, "grad_norm": 1.0}, {"step": 2, "eval_loss": 1.7}]
        (tmp_path / run / "checkpoint-2" / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    result = compare_runs(tmp_path / "a", tmp_path / "b")
    assert result["adapter"] == {
        "tensors": 2, "tensors_differing": 1, "max_abs_diff": 0.25, "max_abs_weight": 1.0,
        "worst_tensors": {"x.lora_B.weight": 0.25, "x.lora_A.weight": 0.0},
    }
    assert result["curves"]["loss"]["steps"] == [1, 2] and result["curves"]["loss"]["max_abs_diff"] == 0.25
    assert result["curves"]["grad_norm"]["max_abs_diff"] == 0.0 and result["curves"]["eval_loss"]["max_abs_diff"] == 0.0


def test_profile_counts_each_kernel_once():
    """torch.profiler lists a kernel both as its own event and inside the op that launched it: the
    breakdown classifies it by the op and takes the total from the kernel events, so a kernel no op
    launched is shown as unattributed, and nothing is counted twice; a record_function range that the
    profiler also draws on the GPU timeline is not a kernel (the H200 profile of 2026-11-30 counted them)."""
    from step_probe import component_times
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import EventList, FunctionEvent

    def op(id, name, shapes):
        return FunctionEvent(id, name, thread=0, start_us=0, end_us=100, input_shapes=shapes, use_device="cuda")

    def kernel(id, name, us):
        return FunctionEvent(id, name, thread=0, start_us=0, end_us=us, use_device="cuda", device_type=DeviceType.CUDA)

    mm, lora, attn = op(1, "aten::mm", [[64, 2560], [2560, 9728]]), op(2, "aten::mm", [[64, 2560], [2560, 16]]), op(3, "flash_attn", [])
    mm.append_kernel("sm90_gemm", 0, 300)
    lora.append_kernel("gemv", 0, 20)
    attn.append_kernel("flash_fwd_kernel", 0, 500)
    annotation = FunctionEvent(8, "eogym::vision_tower", thread=0, start_us=0, end_us=900, use_device="cuda",
                               device_type=DeviceType.CUDA, is_user_annotation=True)  # a range on the GPU timeline, not a kernel
    events = EventList([mm, lora, attn, kernel(4, "sm90_gemm", 300), kernel(5, "gemv", 20), kernel(6, "flash_fwd_kernel", 500),
                        kernel(7, "triton_poi_fused_add_0", 80), annotation])  # the Triton one: launched by no op in the trace
    prof = type("Trace", (), {"events": lambda self: events})()
    result = component_times(prof, lora_rank=16, vocab=151936, window_s=0.001, on_gpu=True)
    seconds = {k: round(v * 1e6) for k, v in result["seconds"].items() if v}
    assert seconds == {"base_matmul": 300, "lora_matmul": 20, "attention": 500, "unattributed_kernels": 80}
    assert round(result["total_s"] * 1e6) == 900 and result["gpu_busy_fraction"] == pytest.approx(0.9)
    # by kernel name, every kernel once, the unattributed Triton one included
    families = {k: round(v * 1e6) for k, v in result["kernel_families_s"].items() if v}
    assert families == {"matmul": 320, "attention": 500, "inductor_fused": 80}


def test_gpu_gaps_are_summed_by_the_host_op_running_at_each_end():
    """The GPU's idle intervals between kernels (overlapping streams merged, a GPU-drawn range ignored, gaps under
    the threshold dropped), each charged to the innermost host op on any thread at its start and at its end."""
    from step_probe import gpu_gaps
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    def op(id, name, start, end, parent=None, thread=0):
        event = FunctionEvent(id, name, thread=thread, start_us=start, end_us=end, use_device="cuda")
        if parent is not None:
            event.set_cpu_parent(parent)
        return event

    def kernel(id, start, end, **kw):
        return FunctionEvent(id, f"k{id}", thread=0, start_us=start, end_us=end, use_device="cuda", device_type=DeviceType.CUDA, **kw)

    step = op(1, "Trainer.step", 0, 1000)
    vision = op(2, "eogym::vision_tower", 10, 400, step)
    backward = op(5, "autograd::engine::evaluate_function: MmBackward0", 590, 620, thread=1)
    events = [
        step, vision, op(3, "aten::nonzero", 300, 350, vision), op(4, "aten::mm", 360, 380, vision), backward,
        op(6, "aten::mm", 595, 610, backward, thread=1),
        kernel(11, 0, 100), kernel(12, 90, 320), kernel(13, 330, 340), kernel(14, 365, 500), kernel(15, 600, 700),
        kernel(16, 0, 1000, is_user_annotation=True),  # a range drawn on the GPU timeline: no kernel
    ]
    gaps = gpu_gaps(events, min_gap_us=20)  # 320-330 is under it; 340-365 and 500-600 are gaps
    assert (gaps["count"], gaps["total_s"], gaps["kernels_span_s"]) == (2, 125e-6, 700e-6)
    assert gaps["at_start"] == [{"op": "Trainer.step", "s": 100e-6, "gaps": 1},
                                {"op": "aten::nonzero < eogym::vision_tower < Trainer.step", "s": 25e-6, "gaps": 1}]
    assert gaps["at_end"] == [{"op": "aten::mm < autograd::engine::evaluate_function: MmBackward0", "s": 100e-6, "gaps": 1},
                              {"op": "aten::mm < eogym::vision_tower < Trainer.step", "s": 25e-6, "gaps": 1}]
    assert [g["us"] for g in gaps["longest"]] == [100.0, 25.0]
    assert gpu_gaps(events, min_gap_us=5)["count"] == 3


def test_compile_phases_reads_dynamos_timers():
    """Where compile time goes, from Dynamo's own timers: a compile on CPU shows its tracing phase."""
    import torch
    from step_probe import compile_phases

    torch._dynamo.reset()
    torch.compile(lambda x: (x.sin() + 1).relu(), backend="aot_eager")(torch.randn(4))
    phases = compile_phases()
    assert phases["_compile.compile_inner"] > 0 and phases["entire_frame_compile"] > 0  # both of Dynamo's timers
    assert list(phases.values()) == sorted(phases.values(), reverse=True)
    torch._dynamo.reset()


def test_compile_phases_do_not_depend_on_the_table_layout(monkeypatch):
    """With the `tabulate` package installed (the H200 image has it) Dynamo's printable table is aligned
    with spaces; a parser of the plain comma form found no phase there. The phases must not change."""
    import torch
    import torch._dynamo.utils as dynamo_utils
    from step_probe import compile_phases

    def spaced_table(rows, headers):
        return "\n".join(f"{name:<40}{value:>12}" for name, value in [headers, *rows])

    torch._dynamo.reset()
    torch.compile(lambda x: (x.cos() * 2).relu(), backend="aot_eager")(torch.randn(4))
    plain = compile_phases()
    monkeypatch.setattr(dynamo_utils, "tabulate", spaced_table)
    assert dynamo_utils.compile_times(repr="str", aggregate=True).count(",") == 0
    assert compile_phases() == plain and plain["_compile.compile_inner"] > 0
    torch._dynamo.reset()


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="Inductor on CPU needs a C++ compiler")
def test_compile_caches_count_inductors_cache_and_name_a_bypass():
    """A CPU Inductor compile goes through the FX graph cache: a miss the first time, a hit once Dynamo forgets
    the graph; the counters and a bypass's logged reason are what the benches report for a warm relaunch."""
    import logging

    import torch
    from step_probe import CacheBypassLog, compile_caches
    from torch._dynamo.utils import counters

    counters.clear()
    torch._dynamo.reset()
    fn = lambda x: (x.cos() * 3).relu()  # noqa: E731
    with torch._inductor.config.patch(fx_graph_cache=True, fx_graph_remote_cache=False):
        torch.compile(fn, backend="inductor")(torch.randn(8))
        torch._dynamo.reset()
        torch.compile(fn, backend="inductor")(torch.randn(8))
    caches = compile_caches()
    assert caches["fx_graph"]["miss"] + caches["fx_graph"]["hit"] == 2 and caches["fx_graph"]["hit"] >= 1
    with CacheBypassLog() as log:
        logging.getLogger("torch._inductor.codecache").info("Bypassing FX Graph Cache because '%s'", "a reason")
        logging.getLogger("torch._inductor.codecache").info("something else")
    assert log.reasons == ["Bypassing FX Graph Cache because 'a reason'"]
    torch._dynamo.reset()


def test_collate_bench_times_both_pixel_dtypes_on_the_same_micro_batches(tmp_path):
    """``bench/collate_throughput.py``: both arms collate the same images; bfloat16 pixels are exactly half the bytes."""
    import collate_throughput
    from PIL import Image

    for i, size in enumerate([(64, 48), (96, 96), (40, 120)]):
        Image.new("RGB", size, (30 * i, 90, 200)).save(tmp_path / f"im{i}.png")
    out = tmp_path / "collate.json"
    report = collate_throughput.main(["--data-root", str(tmp_path), "--micro-batches", "2", "--images", "2,1",
                                      "--max-pixels", "16384", "--min-pixels", "1024", "--json", str(out)])
    rows = report["median_per_micro_batch"]
    assert set(rows) == {"float32", "bfloat16"} and report["timed_micro_batches"] == 2
    assert rows["bfloat16"]["pixel_mib"] * 2 == rows["float32"]["pixel_mib"] > 0
    assert all(row["collate_ms"] > 0 and row["handover_ms"] > 0 for row in rows.values())
    assert json.loads(out.read_text())["images_per_sample"] == [2, 1]


def test_sft_loss_bench_times_both_losses_on_the_same_logits(tmp_path):
    """``bench/sft_loss.py``: both arms, alternating, on the same logits; they agree to float32 rounding."""
    import sft_loss

    out = tmp_path / "loss.json"
    report = sft_loss.main(["--positions", "16", "--vocab", "64", "--repeats", "2", "--json", str(out)])
    assert set(report["arms"]) == {"one-softmax", "log_softmax"}
    assert all(len(arm["seconds"]) == 2 and arm["peak_gib"] is None for arm in report["arms"].values())  # CPU: no peak
    assert set(report["max_abs_diff"]) == {"loss", "entropy", "grad"} and max(report["max_abs_diff"].values()) < 1e-5
    assert report["same_argmax"] and report["speedup"] > 0 and json.loads(out.read_text())["settings"]["positions"] == 16


def test_patch_embed_probe_times_the_convolution_and_its_matmul_on_the_same_patches(tmp_path):
    """``bench/patch_embed_probe.py``: transformers' Conv3d and the same weights as one matmul agree (float32 on a CPU)."""
    import patch_embed_probe

    out = tmp_path / "patch_embed.json"
    report = patch_embed_probe.main(["--patches", "64", "--repeats", "2", "--json", str(out)])
    assert set(report["arms"]) == {"conv3d", "linear"} and all(len(arm["ms"]) == 2 for arm in report["arms"].values())
    assert report["max_abs_diff"] < 1e-4 and report["conv3d_over_linear"] > 0
    assert json.loads(out.read_text())["settings"] == {"patches": 64, "kernel": [2, 16, 16], "hidden": 1024,
                                                      "dtype": "torch.float32", "repeats": 2}
