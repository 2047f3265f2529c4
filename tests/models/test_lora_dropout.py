"""LoRA's input dropout inside the lora_A matmul: the kernels against torch given their own mask (under triton's
interpreter on CPU, compiled for sm_90 without a GPU, and marked gpu on CUDA in bf16), and the swap into a PEFT model
(on CPU it computes PEFT's numbers bit for bit)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eogym_sft.models import lora_dropout
from eogym_sft.models.lora_dropout import DropoutLoRAA, fuse_lora_dropout

# (dtype, input shape, rank, p) under the interpreter: ragged row and column tiles, a rank below 16, a 3-D input
INTERPRETED = [
    ("float32", (70, 136), 16, 0.3), ("float32", (3, 64), 8, 0.05), ("float16", (2, 150, 200), 16, 0.3),
    ("float16", (300, 72), 32, 0.5),
]
TOLERANCES = {torch.float32: 5e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _reference(x, weight, factors, grad):
    """``(out, dx, dweight)`` by torch for the kernels' own ``factors``: the dropped input rounded to x's dtype, then
    the matmul, as PEFT's dropout and lora_A compute it."""
    x = x.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    dropped = (x.float() * factors.view(x.shape)).to(x.dtype)
    out = dropped @ weight.t()
    out.backward(grad)
    return out, x.grad, weight.grad


def check(dtype, shape, rank: int, p: float, device="cpu") -> None:
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(shape, generator=g).to(device, dtype).requires_grad_()
    weight = (torch.randn(rank, shape[-1], generator=g) * 0.1).to(device, dtype).requires_grad_()
    grad = torch.randn((*shape[:-1], rank), generator=g).to(device, dtype)
    seed = torch.tensor([rank * 7919], dtype=torch.int64, device=device)
    out = lora_dropout.dropout_matmul(x, weight, seed, p)
    out.backward(grad)
    rows = x[..., 0].numel()
    factors = lora_dropout.dropout_factors(seed, rows, shape[-1], p, device)
    want, want_dx, want_dw = _reference(x, weight, factors, grad)
    tol = TOLERANCES[dtype]
    assert out.shape == want.shape and out.dtype == dtype
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)
    torch.testing.assert_close(x.grad, want_dx, atol=tol, rtol=tol)
    torch.testing.assert_close(weight.grad, want_dw, atol=tol * 4, rtol=tol)  # summed over every row
    kept = factors > 0
    assert torch.equal(factors[kept], torch.full_like(factors[kept], 1 / (1 - p)))
    assert abs(kept.float().mean().item() - (1 - p)) < 4 * ((p * (1 - p) / factors.numel()) ** 0.5)  # 4 sigma
    if p >= 0.3 and rows >= 64:  # the eight columns that share a Philox evaluation draw eight numbers, not one
        octet = kept.view(rows, -1, 8)
        assert all(not torch.equal(octet[..., i], octet[..., j]) for i in range(8) for j in range(i))
    assert torch.equal(lora_dropout.dropout_matmul(x, weight, seed, p), out)  # the seed fixes the mask
    assert not torch.equal(lora_dropout.dropout_matmul(x, weight, seed + 1, p), out)


def interpreted_checks() -> list[str]:
    """The ``INTERPRETED`` cases (TRITON_INTERPRET=1 set before triton was imported), then torch's op checks (schema,
    fake tensors, autograd registration, AOT dispatch with dynamic shapes: what a compiled layer relies on)."""
    done = []
    for dtype, shape, rank, p in INTERPRETED:
        check(getattr(torch, dtype), shape, rank, p)
        done.append(f"{dtype} {shape} rank {rank} p {p}")
    x, weight, seed = torch.randn(70, 136, requires_grad=True), torch.randn(16, 136, requires_grad=True), torch.tensor([3])
    for op, args in (
        (lora_dropout._ops(), (x, weight, seed, 0.25)),
        (torch.ops.eogym.dropout_matmul_backward.default, (torch.randn(70, 16), x.detach(), weight.detach(), seed, 0.25)),
    ):
        # fake tensors and AOT dispatch: test_the_ops_trace_with_symbolic_shapes (the interpreter runs kernels on them)
        results = torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration"))
        assert set(results.values()) == {"SUCCESS"}, results
    done.append("opcheck")
    return done


triton_needed = pytest.mark.skipif(lora_dropout.triton is None, reason="the kernels are triton's (setup.cfg's dev extra installs it)")


@triton_needed
def test_the_kernels_equal_torch_under_the_interpreter():
    # TRITON_INTERPRET is read when triton's jit decorates the kernels: a fresh process, with this checkout on its path
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(filter(None, (repo, os.environ.get("PYTHONPATH"))))}
    ran = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stdout.splitlines() == [f"{d} {s} rank {r} p {p}" for d, s, r, p in INTERPRETED] + ["opcheck"]


@triton_needed
def test_triton_compiles_the_kernels_for_sm90_without_a_gpu():
    """What the GPU host's compiler must accept, in bf16 at rank 16, down to a cubin for an H100/H200."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter's kernels are no JIT functions to compile")
    blocks = {"BLOCK_M": lora_dropout.BLOCK_M, "BLOCK_K": lora_dropout.BLOCK_K}
    floats = ("scale", "p")
    for kernel, pointers, constexprs in (
        (lora_dropout._forward, {"x": "*bf16", "w": "*bf16", "out": "*bf16", "seed_ptr": "*i64"}, blocks | {"BLOCK_R": 16, "K": 2560}),
        (lora_dropout._backward, {"dy": "*bf16", "x": "*bf16", "w": "*bf16", "dx": "*bf16", "shares": "*fp32", "seed_ptr": "*i64"},
         blocks | {"BLOCK_R": 16, "K": 2560, "ROWS": lora_dropout.BACKWARD_ROWS}),
        (lora_dropout._factors, {"out": "*fp32", "seed_ptr": "*i64"}, blocks),
    ):
        signature = {n: pointers.get(n, "fp32" if n in floats else "constexpr" if n in constexprs else "i32") for n in kernel.arg_names}
        source = ASTSource(kernel, signature, constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()})
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 64))
        assert compiled.asm["cubin"][:4] == b"\x7fELF" and ".target sm_90" in compiled.asm["ptx"]


@triton_needed
def test_the_ops_trace_with_symbolic_shapes():
    """What a compiled layer needs of the two ops without running a kernel: their bodies traced on fake tensors of
    symbolic shapes (the kernels' launches as Inductor would see them), forward and backward, the shapes right."""
    from torch.fx.experimental.proxy_tensor import make_fx

    lora_dropout._ops()

    def step(x, weight, seed):
        out = torch.ops.eogym.dropout_matmul(x, weight, seed, 0.25)
        return (out, *torch.autograd.grad(out.sum(), (x, weight)))

    x, weight = torch.randn(2, 35, 136, requires_grad=True), torch.randn(16, 136, requires_grad=True)
    graph = make_fx(step, tracing_mode="symbolic")(x, weight, torch.tensor([3]))
    called = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert torch.ops.eogym.dropout_matmul.default in called and torch.ops.eogym.dropout_matmul_backward.default in called
    outputs = next(n for n in graph.graph.nodes if n.op == "output").args[0]
    (b, t, r), (dx_b, dx_t, dx_k), (dw_r, dw_k) = [tuple(str(d) for d in o.meta["val"].shape) for o in outputs]
    assert all(d.startswith("s") for d in (b, t, r)), (b, t, r)  # the rows and the rank stay symbolic
    assert (dx_b, dx_t, dx_k) == (b, t, "136") and (dw_r, dw_k) == (r, "136")  # the kernels' K is a constant


def test_the_drop_threshold_is_p_in_16_bits():
    assert [lora_dropout.threshold(p) for p in (0.0, 0.05, 0.1, 0.5)] == [0, 3277, 6554, 32768]
    assert abs(lora_dropout.threshold(0.05) / 65536 - 0.05) < 2**-17


def test_inputs_the_kernels_cannot_take_are_refused():
    x, weight = torch.zeros(2, 12), torch.zeros(4, 12)
    with pytest.raises(ValueError, match="multiple of 8"):
        lora_dropout._check(x, weight, 0.1)
    with pytest.raises(ValueError, match="do not match"):
        lora_dropout._check(torch.zeros(2, 8), torch.zeros(4, 8, dtype=torch.float16), 0.1)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        lora_dropout._check(torch.zeros(2, 8), torch.zeros(4, 8), 1.0)


# --------------------------------------------------------------------------- the swap into a PEFT model


def _lora_model(dropout: float = 0.05):
    from eogym_sft.models.loading import apply_lora
    from eogym_sft.models.tiny import build_tiny_model

    return apply_lora(build_tiny_model(seed=5), dropout=dropout)


def _step(model, seed: int):
    """Loss and LoRA gradients of one training forward and backward on a fixed batch, torch seeded first."""
    model.train()
    model.zero_grad()
    torch.manual_seed(seed)
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_the_swap_moves_every_adapters_dropout_into_its_lora_a_and_keeps_the_weights_keys():
    model = _lora_model()
    keys = list(model.state_dict())
    assert fuse_lora_dropout(model) == 14  # 7 projections x 2 layers
    assert list(model.state_dict()) == keys
    layers = [m for m in model.modules() if hasattr(m, "lora_dropout")]
    assert all(type(m.lora_dropout["default"]) is torch.nn.Identity for m in layers)
    assert all(type(m.lora_A["default"]) is DropoutLoRAA and m.lora_A["default"].dropout_p == 0.05 for m in layers)
    assert fuse_lora_dropout(model) == 0  # already moved
    assert fuse_lora_dropout(_lora_model(dropout=0.0)) == 0  # PEFT's Identity: nothing to move


def test_on_cpu_the_swapped_model_computes_pefts_numbers_bit_for_bit():
    """Off the GPU the swapped lora_A runs torch's dropout then its matmul: the same random numbers in the same order
    as PEFT's dropout module, so the loss and every LoRA gradient are equal, in training and in eval."""
    model = _lora_model()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    fused = copy.deepcopy(model)
    fuse_lora_dropout(fused)
    loss, grads = _step(model, seed=3)
    fused_loss, fused_grads = _step(fused, seed=3)
    assert torch.equal(loss, fused_loss)
    assert grads.keys() == fused_grads.keys() and all(torch.equal(grads[n], fused_grads[n]) for n in grads)
    other_loss, _ = _step(fused, seed=4)
    assert not torch.equal(other_loss, loss)  # the dropout draws: another seed, another loss
    ids = torch.arange(12)[None]
    with torch.no_grad():
        assert torch.equal(model.eval()(input_ids=ids).logits, fused.eval()(input_ids=ids).logits)


def test_the_slot_decoder_does_not_merge_a_swapped_adapter_in_training_mode():
    from eogym_sft.agent.generation import merge_plan

    model = _lora_model()
    fuse_lora_dropout(model)
    lora = model.get_base_model().model.language_model.layers[0].self_attn.q_proj
    lora.train()
    assert merge_plan(lora) is None  # its lora_A draws a mask
    lora.eval()
    assert merge_plan(lora) == (lora.base_layer, ["default"])


# --------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or lora_dropout.triton is None, reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize(("dtype", "shape", "rank"), [(torch.bfloat16, (1000, 2560), 16), (torch.bfloat16, (3, 333, 9728), 16),
                                                      (torch.float16, (77, 4096), 8)])
def test_the_kernels_equal_torch_on_cuda(dtype, shape, rank):
    check(dtype, shape, rank, 0.05, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or lora_dropout.triton is None, reason="needs a CUDA GPU and triton")
def test_a_compiled_swapped_layer_trains_under_bf16_autocast():
    """The recipe's path: bf16 model, fp32 LoRA weights, autocast, compiled layers: one graph a layer, the op inside
    it, and finite gradients that reach every lora_A."""
    from eogym_sft.models.loading import compile_language_layers

    import torch._dynamo as dynamo

    model = _lora_model().to("cuda", torch.bfloat16)
    assert fuse_lora_dropout(model) == 14
    compile_language_layers(model)
    model.train()
    ids = torch.randint(0, 1000, (1, 64), device="cuda")
    dynamo.utils.counters.clear()
    with torch.autocast("cuda", torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    # registering the op inside the layer broke its graph at every lora_A (seen on an H100)
    assert sum(dynamo.utils.counters["graph_break"].values()) == 0, dict(dynamo.utils.counters["graph_break"])
    grads = [p.grad for n, p in model.named_parameters() if "lora_A" in n]
    assert len(grads) == 14 and all(g is not None and torch.isfinite(g).all() for g in grads)


if __name__ == "__main__":  # the interpreter's run: see test_the_kernels_equal_torch_under_the_interpreter
    assert os.environ.get("TRITON_INTERPRET") == "1"
    print(*interpreted_checks(), sep="\n")
