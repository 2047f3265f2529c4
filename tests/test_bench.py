"""The training bench on CPU with the tiny model: ``bench/train_throughput.py`` with its step probe and
profiler breakdown, arm B built by the recipe's own builders. Figures are not checked (CPU), the accounting is:
steps, tokens, components."""

from __future__ import annotations

import copy
import json
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


def test_a_b_arm_is_the_recipes_yaml_with_only_its_own_changes(tmp_path):
    """Arm B's configs are ``recipes/eo_gym_4b.yaml`` as TrlParser reads it; an arm changes only its settings."""
    from train_throughput import arm_settings, recipe_configs

    script, training, model = recipe_configs(arm_settings("B"), tmp_path / "B", 3, 2, "m", "r")
    assert (script.compile_layers, training.padding_free, training.train_sampling_strategy) == (True, True, "batch_rebalance")
    assert (model.attn_implementation, model.lora_r, model.lora_dropout) == ("eogym_varlen_cudnn", 16, 0.05)
    assert (training.per_device_train_batch_size, training.gradient_accumulation_steps, training.max_steps) == (2, 2, 3)
    assert (training.weight_decay, training.lr_scheduler_type, training.seed) == (0.1, "cosine", 42)  # the YAML's, untouched
    assert training.dataloader_num_workers == 8 and not training.logging_nan_inf_filter and not training.activation_checkpointing
    _, b1, _ = recipe_configs(arm_settings("B-b1-GC"), tmp_path / "b1", 3, 2, "m", "r")
    assert (b1.per_device_train_batch_size, b1.activation_checkpointing) == (1, True)
    _, fixed, flash = recipe_configs(arm_settings("B-fixedcount"), tmp_path / "f", 3, 2, "m", "r")
    assert fixed.train_sampling_strategy == "random" and flash.attn_implementation == "eogym_varlen_cudnn"


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
