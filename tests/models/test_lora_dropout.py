"""LoRA's dropout from packed keep bits: the Philox in torch against Random123's known answer and against the Triton
kernel (under triton's interpreter on CPU, compiled for sm_90 without a GPU, and marked gpu on CUDA), the mask's
statistics, the module's numbers eager and compiled (the backward's mask is the forward's), and its place in a PEFT
model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eogym_sft.models import lora_dropout
from eogym_sft.models.lora_dropout import PackedMaskDropout, expand, keep_bits, keep_bits_torch, philox, threshold

# (words, seed, p) under the interpreter: a ragged last block, a seed over 32 bits (both key words), p's extremes
INTERPRETED = [(3000, 123456789012345, 0.05), (1, 7, 0.5), (2048, 2**61 + 12345, 0.9), (1500, 0, 0.001)]


def _seed(value: int, device="cpu") -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int64, device=device)


def interpreted_checks() -> list[str]:
    """The kernel's words under the interpreter (TRITON_INTERPRET=1 set before triton was imported) against
    :func:`keep_bits_torch`, bit for bit; the cases checked, one a line."""
    done = []
    for words, seed, p in INTERPRETED:
        out = torch.empty(words, dtype=torch.int32)
        grid = (lora_dropout.triton.cdiv(words, lora_dropout.BLOCK),)
        lora_dropout._keep_bits_kernel[grid](_seed(seed), out, words, threshold(p), BLOCK=lora_dropout.BLOCK)
        assert torch.equal(out, keep_bits_torch(_seed(seed), words, threshold(p))), (words, seed, p)
        done.append(f"{words} words seed {seed} p {p}")
    return done


def test_the_kernel_draws_the_torch_philox_bit_for_bit_under_the_interpreter():
    pytest.importorskip("triton", reason="the kernel is triton's (setup.cfg's dev extra installs it)")
    # TRITON_INTERPRET is read when triton's jit decorates the kernel: a fresh process, which imports this checkout
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(filter(None, (repo, os.environ.get("PYTHONPATH"))))}
    ran = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stdout.splitlines() == [f"{w} words seed {s} p {p}" for w, s, p in INTERPRETED]


def test_triton_compiles_the_kernel_for_sm90_without_a_gpu():
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter's kernels are no JIT functions to compile")
    kernel = lora_dropout._keep_bits_kernel
    signature = {"seed_ptr": "*i64", "out_ptr": "*i32", "words": "i32", "cut": "i32", "BLOCK": "constexpr"}
    source = ASTSource(kernel, signature, constexprs={(kernel.arg_names.index("BLOCK"),): lora_dropout.BLOCK})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 64))
    assert compiled.asm["cubin"][:4] == b"\x7fELF" and ".target sm_90" in compiled.asm["ptx"]


def test_the_torch_philox_gives_random123s_known_answer():
    # Philox-4x32-10, counter 0 and key 0 (Random123's kat_vectors), Triton's randint4x(0, 0)
    assert [int(v) for v in philox(_seed(0), torch.tensor([0]))] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


def test_bits_are_laid_out_as_documented():
    seed, cut = _seed(99), threshold(0.3)
    words = keep_bits_torch(seed, 5, cut)
    for w in range(5):
        for j in range(4):
            outputs = [int(r) for r in philox(seed, torch.tensor([4 * w + j]))]
            for k, r in enumerate(outputs):
                for h, half in enumerate((r & 0xFFFF, r >> 16)):
                    bit = (int(words[w]) >> (8 * j + 2 * k + h)) & 1
                    assert bit == (half >= cut), (w, j, k, h)
    assert torch.equal(expand(words, (5, 32)).flatten()[33], torch.tensor(bool(int(words[1]) >> 1 & 1)))


def test_the_mask_keeps_one_minus_p_in_every_bit_position_and_repeats_no_word():
    p, words = 0.05, 2**15
    keep = expand(keep_bits(_seed(2026), words, p), (words, 32)).float()
    n = keep.numel()
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(keep.mean().item() - (1 - p)) < 4 * sigma
    by_position = keep.mean(0)
    assert (by_position - (1 - p)).abs().max().item() < 5 * sigma * 32**0.5  # each position holds n / 32 draws
    raw = keep_bits(_seed(2026), words, 0.5)
    assert raw.unique().numel() > words - 4  # 32-bit words: a repeat among 2**15 is rare, a pattern (pytorch#198333) is not
    assert not torch.equal(keep_bits(_seed(2027), words, p), keep_bits(_seed(2026), words, p))
    assert threshold(0.05) == 3277


def test_the_ops_pass_torchs_op_checks():
    keep_bits(_seed(5), 10, 0.1)  # registers both
    for op in (torch.ops.eogym.keep_bits.default, torch.ops.eogym.keep_bits_torch.default):
        results = torch.library.opcheck(op, (_seed(5), 10, threshold(0.1)))
        assert set(results.values()) == {"SUCCESS"}, (op, results)


def test_a_compiled_graph_off_cuda_calls_the_torch_philox_as_one_op():
    """Traced into the graph, the Philox's thousands of integer ops tripled a compiled layer's first step on a CPU."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def capture(graph_module, example_inputs):
        graphs.append(graph_module)
        return make_boxed_func(graph_module.forward)

    torch._dynamo.reset()
    try:
        compiled = torch.compile(PackedMaskDropout(0.3), backend=aot_autograd(fw_compiler=capture), fullgraph=True)
        compiled(torch.randn(4, 64, requires_grad=True))
    finally:
        torch._dynamo.reset()
    calls = [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert "eogym.keep_bits_torch.default" in calls and len(calls) < 30, calls


def test_keep_bits_refuses_what_it_cannot_draw():
    for p in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="dropout probability"):
            keep_bits(_seed(1), 4, p)
    with pytest.raises(ValueError, match="2\\*\\*29"):
        keep_bits(_seed(1), 2**29, 0.1)


def _expected(x: torch.Tensor, p: float, rng_seed: int) -> torch.Tensor:
    """The module's output after ``torch.manual_seed(rng_seed)``: the seed it draws, its bits, PEFT's scaling."""
    torch.manual_seed(rng_seed)
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
    keep = expand(keep_bits_torch(seed, x.numel() // 32, threshold(p)), x.shape)
    return x * keep.to(x.dtype) * (1.0 / (1.0 - p))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_module_scales_what_its_bits_keep_and_its_gradient_is_that_mask(dtype):
    dropout = PackedMaskDropout(0.25)
    x = torch.randn(3, 5, 64).to(dtype).requires_grad_()
    want = _expected(x.detach(), 0.25, rng_seed=11)
    torch.manual_seed(11)
    out = dropout(x)
    assert out.dtype == dtype and torch.equal(out, want)
    grad = torch.randn_like(out)
    out.backward(grad)
    assert torch.equal(x.grad, _expected(grad, 0.25, rng_seed=11))


def test_the_module_is_the_identity_in_eval_at_p_0_and_nn_dropout_elsewhere():
    x = torch.randn(4, 64)
    assert PackedMaskDropout(0.3).eval()(x) is x
    assert PackedMaskDropout(0.0)(x) is x
    odd = torch.randn(4, 48)  # not a multiple of 32 features
    torch.manual_seed(3)
    want = torch.nn.Dropout(0.3)(odd)
    torch.manual_seed(3)
    assert torch.equal(PackedMaskDropout(0.3)(odd), want)
    assert isinstance(PackedMaskDropout(0.3), torch.nn.Dropout)


def test_compiled_by_inductor_the_backward_uses_the_forwards_mask_at_every_length():
    dropout = PackedMaskDropout(0.3)
    torch._dynamo.reset()
    compiled = torch.compile(dropout, dynamic=True, fullgraph=True)
    try:
        for shape in ((5, 7, 64), (9, 3, 64), (40, 2560)):
            x = torch.randn(shape, requires_grad=True)
            out = compiled(x)
            out.backward(torch.ones_like(out))
            factor = x.grad  # the mask times 1 / (1 - p): what the backward applied
            assert set(factor.unique().tolist()) <= {0.0, torch.tensor(1 / 0.7).item()}
            assert torch.equal(out, x.detach() * factor)  # what the forward applied
            assert abs((factor > 0).float().mean().item() - 0.7) < 0.1
    finally:
        torch._dynamo.reset()


def test_apply_lora_and_continue_lora_draw_every_lora_dropout_from_packed_bits(tmp_path):
    from trl.trainer.utils import disable_dropout_in_model

    from eogym_sft.models.loading import apply_lora, continue_lora
    from eogym_sft.models.tiny import build_tiny_model

    def dropouts(model):
        return [d for m in model.modules() if isinstance(getattr(m, "lora_dropout", None), torch.nn.ModuleDict)
                for d in m.lora_dropout.values()]

    model = apply_lora(build_tiny_model(seed=1), dropout=0.05)
    found = dropouts(model)
    assert found and all(type(d) is PackedMaskDropout and d.p == 0.05 for d in found)
    model.save_pretrained(tmp_path / "adapter")
    assert '"lora_dropout": 0.05' in (tmp_path / "adapter" / "adapter_config.json").read_text()
    again = dropouts(continue_lora(build_tiny_model(seed=1), str(tmp_path / "adapter")))
    assert len(again) == len(found) and all(type(d) is PackedMaskDropout for d in again)
    disable_dropout_in_model(model)  # TRL's GRPO and DPO: p = 0 on every nn.Dropout
    assert all(d.p == 0 for d in dropouts(model))
    assert all(type(d) is torch.nn.Identity for d in dropouts(apply_lora(build_tiny_model(seed=1), dropout=0.0)))


def test_under_activation_checkpointing_the_recomputed_forward_draws_the_same_masks(capped_processor):
    """A checkpointed layer runs its forward again in the backward: the seed comes from torch's generator, which the
    checkpoint restores, so the loss and LoRA gradients equal a run without checkpointing bit for bit (compiled
    layers, aot_eager: Dynamo's and AOTAutograd's graphs as on the GPU)."""
    from helpers import chat_example, perturb_lora_b
    from PIL import Image

    from eogym_sft.data.collator import EOGymCollator
    from eogym_sft.models.attention import add_sample_boundaries, register_varlen_attention
    from eogym_sft.models.loading import apply_lora, compile_language_layers
    from eogym_sft.models.tiny import build_tiny_model

    processor = capped_processor(16384, 1024)
    batch = EOGymCollator(processor, padding_free=True)(
        [chat_example("Flooded?", "Final Answer: no"), chat_example("Land cover?", "Forest.", [Image.new("RGB", (96, 32), "green")])]
    )
    register_varlen_attention()

    def loss_and_grads(checkpointing: bool):
        torch._dynamo.reset()
        model = build_tiny_model(seed=3)
        model.set_attn_implementation({"text_config": "eogym_varlen", "vision_config": "sdpa"})
        add_sample_boundaries(model)
        model = perturb_lora_b(apply_lora(model, dropout=0.3), seed=3).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        compile_language_layers(model, backend="aot_eager")
        torch.manual_seed(0)
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    try:
        (plain_loss, plain), (checkpointed_loss, checkpointed) = loss_and_grads(False), loss_and_grads(True)
    finally:
        torch._dynamo.reset()
    assert torch.equal(checkpointed_loss, plain_loss)
    assert plain.keys() == checkpointed.keys() and all(torch.equal(checkpointed[n], g) for n, g in plain.items())


# --------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
def test_the_cuda_kernel_draws_the_torch_philox_and_a_compiled_layer_keeps_one_mask():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    for words, seed, p in INTERPRETED + [(13699 * 9728 // 32, 2**40 + 1, 0.05)]:
        got = keep_bits(_seed(seed, "cuda"), words, p)
        assert torch.equal(got, keep_bits_torch(_seed(seed, "cuda"), words, threshold(p))), (words, seed, p)
    torch._dynamo.reset()
    dropout = PackedMaskDropout(0.05)
    compiled = torch.compile(lambda x: dropout(x) * 2.0, dynamic=True, fullgraph=True)  # the scale fused with the mask
    for rows in (6000, 7331):
        x = (torch.rand(rows, 2560, device="cuda") + 0.5).to(torch.bfloat16).requires_grad_()  # no zeros
        out = compiled(x)
        out.backward(torch.ones_like(out))
        assert torch.equal(out != 0, x.grad != 0)  # the backward dropped what the forward dropped
        assert abs((out != 0).float().mean().item() - 0.95) < 0.005
    torch._dynamo.reset()


if __name__ == "__main__":  # the interpreter's run: see test_the_kernel_draws_the_torch_philox_bit_for_bit_under_the_interpreter
    assert os.environ.get("TRITON_INTERPRET") == "1"
    print(*interpreted_checks(), sep="\n")
