"""Host syncs of one training micro-batch (forward and backward), with the collator's ``HostLayout`` and without.

    PYTHONPATH=. python bench/sync_counter.py                          # the tiny model on the CPU: would-be syncs
    PYTHONPATH=. python bench/sync_counter.py --device cuda --config recipes/configs/qwen3_vl_4b_instruct.json

Every read of a GPU value on the host (``.item()``, ``.tolist()``, ``nonzero``, boolean-mask indexing, a
``repeat_interleave`` without its output size, ...) waits for the GPU's queue to drain (issue 41). On a GPU they are
counted by ``torch.cuda.set_sync_debug_mode("warn")``, which warns at each. On a CPU there is no device to wait for,
so :class:`WouldBeSyncs` counts the ops that would sync on one: a ``TorchDispatchMode`` and a patched
``Tensor.tolist`` that count them unless every tensor they read is on the host in the GPU run too (the layout's
tensors, and what is computed from them alone). The CPU stand-in for a GPU attention kernel
(``eogym_varlen``'s per-sample reference loop) is not counted: on a GPU flash's kernel reads the boundaries itself.

Micro-batch: the tiny Qwen3-VL with LoRA (or ``--config``'s architecture with random bf16 weights), ``--samples``
packed samples with two images each. Prints JSON: per arm, the count by kind, and whether loss and gradients agree.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

REPO = Path(__file__).resolve().parents[1]
aten = torch.ops.aten
NONZERO = {aten.nonzero.default, aten.masked_select.default, aten.unique_consecutive.default, aten._unique2.default}
SCALAR = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default}
INDEX = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
STAND_INS = ("_varlen_reference", "_varlen_reference_backward")  # CPU loops standing in for a GPU kernel


def sync_kind(func, args, kwargs) -> str | None:
    """The kind of host sync ``func`` makes on a CUDA tensor, ``None`` if none."""
    if func in SCALAR:
        return "item"
    if func in NONZERO:
        return "nonzero"
    if func in INDEX:
        indices = args[1] if len(args) > 1 else ()
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
            return "boolean mask"
    if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
        return "repeat_interleave"
    return None


class WouldBeSyncs(TorchDispatchMode):
    """Counts the ops that would sync on a GPU (see the module docstring); ``host`` are the tensors that stay on the
    host in the GPU run. ``Tensor.tolist`` does not pass through the dispatcher on a CPU; it is patched while active."""

    def __init__(self, host=()):
        super().__init__()
        self.counts: Counter = Counter()
        self._host = {id(t): t for t in host}  # holds them, so that no id is reused

    def is_host(self, t) -> bool:
        return id(t) in self._host

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        on_host = bool(tensors) and all(self.is_host(t) for t in tensors)
        if on_host:
            self._host.update((id(t), t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        elif (kind := sync_kind(func, args, kwargs)) is not None:
            self.counts[kind] += 1
        return out

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        counter, tolist = self, self._tolist

        def counted(t):
            if not counter.is_host(t) and sys._getframe(1).f_code.co_name not in STAND_INS:
                counter.counts["tolist"] += 1
            return tolist(t)

        torch.Tensor.tolist = counted
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


def _examples(n: int):
    from PIL import Image

    rng = torch.Generator().manual_seed(0)
    out = []
    for k in range(n):
        sizes = [(32 * int(torch.randint(1, 4, (), generator=rng)), 32 * int(torch.randint(1, 4, (), generator=rng))) for _ in range(2)]
        out.append({
            "messages": [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Scene {k}: ships?"}]},
                {"role": "assistant", "content": "Crop.", "tool_calls": [{"type": "function", "function": {"name": "crop", "arguments": {}}}]},
                {"role": "tool", "content": [{"type": "text", "text": "ok"}, {"type": "image"}]},
                {"role": "assistant", "content": f"Final Answer: {k}"},
            ],
            "images": [Image.new("RGB", size, (40 * k % 255, 90, 160)) for size in sizes],
        })
    return out


def build(device: str, config: str | None, attn: str):
    from datasets import Dataset
    from trl import SFTConfig

    from eogym_sft.data.collator import EOGymCollator
    from eogym_sft.models.attention import add_sample_boundaries, register_varlen_attention
    from eogym_sft.models.host_layout import VisionGeometry
    from eogym_sft.models.loading import apply_lora
    from eogym_sft.models.tiny import build_offline_processor, build_tiny_model
    from eogym_sft.training.trainer import EOGymSFTTrainer

    processor = build_offline_processor()
    processor.image_processor.size = {"longest_edge": 16384, "shortest_edge": 1024}
    arch = json.loads(Path(config).read_text()) if config else None
    model = build_tiny_model(seed=0, config=arch, dtype="bfloat16" if arch else "float32", device=device)
    if attn != "sdpa":
        register_varlen_attention()
        model.set_attn_implementation({"text_config": attn, "vision_config": "sdpa"})
        add_sample_boundaries(model)
    model = apply_lora(model)
    args = SFTConfig(output_dir="/tmp/sync_counter", use_cpu=device == "cpu", bf16=arch is not None, report_to="none",
                     padding_free=True, remove_unused_columns=False, dataset_kwargs={"skip_prepare_dataset": True})
    collator = EOGymCollator(processor, padding_free=True, host_layout=True, vision=VisionGeometry.of(model))
    trainer = EOGymSFTTrainer(model=model, args=args, data_collator=collator, train_dataset=Dataset.from_list([{"messages": "[]"}]),
                              processing_class=processor)
    trainer.model.train()
    for module in trainer.model.modules():  # no dropout: the arms' losses and gradients compare exactly
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return trainer, collator


def layout_tensors(layout) -> list:
    tensors = [layout.supervised, layout.cu_seq_lens, layout.image_grid_thw]
    return [t for t in tensors + list((layout.vision or {}).values()) if isinstance(t, torch.Tensor)]


def count(trainer, batch, device: str) -> tuple[Counter, torch.Tensor, list]:
    """Host syncs of one micro-batch's loss and backward, by kind; with the loss and the LoRA gradients."""
    batch = trainer._prepare_inputs(batch)
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    if device == "cuda":
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                loss = trainer.compute_loss(trainer.model, batch, num_items_in_batch=torch.tensor(64, device=device))
                grads = torch.autograd.grad(loss, params)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts = Counter(str(w.message).split(" ")[0] for w in caught if "synchroniz" in str(w.message))
        return counts, loss.detach(), grads
    layout = batch.get("host_layout")
    with WouldBeSyncs(layout_tensors(layout) if layout is not None else ()) as counter:
        loss = trainer.compute_loss(trainer.model, batch, num_items_in_batch=torch.tensor(64))
        grads = torch.autograd.grad(loss, params)
    return counter.counts, loss.detach(), grads


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--config", help="a Qwen3-VL config JSON (default: the tiny one)")
    parser.add_argument("--attn", default="eogym_varlen", help="the text tower's attention (eogym_varlen, eogym_varlen_cudnn, sdpa)")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--json", help="write the result here too")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    trainer, collator = build(args.device, args.config, args.attn)
    with_layout = collator(_examples(args.samples))
    without = {k: v for k, v in with_layout.items() if k != "host_layout"}
    result = {"device": args.device, "config": args.config or "tiny", "attn": args.attn, "samples": args.samples,
              "images": int(with_layout["image_grid_thw"].shape[0])}
    runs, syncs = {}, {}
    # a first, uncounted run pays what happens once (kernel selection, caches); then each arm on the same weights
    for arm, batch in (("warm-up", without), ("without_layout", without), ("with_layout", with_layout)):
        counts, loss, grads = count(trainer, dict(batch), args.device)
        runs[arm] = (loss, grads)
        syncs[arm] = {"total": sum(counts.values()), **dict(sorted(counts.items()))}
    result["syncs"] = {arm: syncs[arm] for arm in ("without_layout", "with_layout")}
    (loss_a, grads_a), (loss_b, grads_b) = runs["without_layout"], runs["with_layout"]
    result["loss_equal"] = bool(torch.equal(loss_a, loss_b))
    result["grads_equal"] = all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
