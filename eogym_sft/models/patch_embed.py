"""The vision tower's patch embedding as one matmul.

Qwen3-VL embeds each patch (3 channels x 2 frames x 16 x 16 pixels on the 4B) with a ``Conv3d`` whose kernel equals
its stride: every patch meets the kernel once, so the convolution is ``F.linear`` over the flattened patches with the
kernel flattened the same way. cuDNN picks slow algorithms for that shape on some versions (transformers#45750;
docs/benchmarks.md); cuBLAS runs the matmul. :class:`PatchMatmul` takes the convolution's place
holding its own ``weight`` and ``bias`` parameters, so names, shapes, state dicts, checkpoints and the frozen flags do
not change. (transformers' ``fusion_config={"patch_embeddings": True}`` does the same at load, but patches the class
for every later load in the process.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class PatchMatmul(torch.nn.Module):
    """A stride-equals-kernel ``Conv3d`` as a matmul: ``(patches, C, T, H, W)`` in, ``(patches, out, 1, 1, 1)`` out,
    what the convolution returns for that input."""

    def __init__(self, conv: torch.nn.Conv3d):
        super().__init__()
        self.weight, self.bias = conv.weight, conv.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_channels = self.weight.shape[0]
        flat = F.linear(x.reshape(x.shape[0], -1), self.weight.reshape(out_channels, -1), self.bias)
        return flat.view(x.shape[0], out_channels, 1, 1, 1)

    def as_conv3d(self) -> torch.nn.Conv3d:
        """The ``Conv3d`` it replaced, on the same parameters."""
        out_channels, in_channels, *kernel = self.weight.shape
        conv = torch.nn.Conv3d(in_channels, out_channels, kernel, stride=kernel, bias=self.bias is not None,
                               device="meta")
        conv.weight, conv.bias = self.weight, self.bias
        return conv


def is_patch_conv(module) -> bool:
    """A ``Conv3d`` that each input patch meets once: kernel equal to stride, no padding, dilation or groups."""
    return (
        isinstance(module, torch.nn.Conv3d)
        and tuple(module.kernel_size) == tuple(module.stride)
        and tuple(module.padding) == (0, 0, 0)
        and tuple(module.dilation) == (1, 1, 1)
        and module.groups == 1
    )


def patch_embed_as_matmul(model) -> int:
    """Swap each patch embedding's ``proj`` convolution (``visual.patch_embed.proj`` on Qwen3-VL) for a
    :class:`PatchMatmul`; return how many were swapped."""
    swapped = 0
    for name, module in model.named_modules():
        if name.endswith("patch_embed") and is_patch_conv(getattr(module, "proj", None)):
            module.proj = PatchMatmul(module.proj)
            swapped += 1
    return swapped
