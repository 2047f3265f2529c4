"""The vision tower's patch embedding as one matmul: the convolution's numbers on its own parameters, in the model
``load_base_model`` returns (the same image features, state dict and checkpoint)."""

from __future__ import annotations

import pytest
import torch

from eogym_sft.models.patch_embed import PatchMatmul, is_patch_conv, patch_embed_as_matmul


def _conv(kernel=(2, 4, 4), channels=3, out=8, seed=0) -> torch.nn.Conv3d:
    torch.manual_seed(seed)
    return torch.nn.Conv3d(channels, out, kernel, stride=kernel, bias=True)


def test_the_matmul_gives_the_convolutions_output_on_its_own_parameters():
    conv = _conv()
    patches = torch.randn(37, 3, 2, 4, 4)
    swapped = PatchMatmul(conv)
    assert swapped.weight is conv.weight and swapped.bias is conv.bias
    with torch.no_grad():
        torch.testing.assert_close(swapped(patches), conv(patches), rtol=1e-5, atol=1e-6)
        back = swapped.as_conv3d()
        assert is_patch_conv(back) and back.weight is conv.weight and torch.equal(back(patches), conv(patches))


def test_only_convolutions_each_patch_meets_once_are_swapped():
    assert is_patch_conv(_conv())
    assert not is_patch_conv(torch.nn.Conv3d(3, 8, (2, 4, 4), stride=(1, 2, 2)))  # overlapping patches
    assert not is_patch_conv(torch.nn.Conv3d(3, 8, (2, 4, 4), stride=(2, 4, 4), padding=1))
    assert not is_patch_conv(torch.nn.Conv2d(3, 8, 4, stride=4)) and not is_patch_conv(None)


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory):
    from eogym_sft.models.tiny import build_tiny_model

    folder = tmp_path_factory.mktemp("tiny")
    build_tiny_model(seed=4).save_pretrained(folder)
    return folder


def test_load_base_model_embeds_patches_by_matmul_with_the_same_features_and_checkpoint(saved_tiny, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText

    from eogym_sft.models.loading import load_base_model

    plain = AutoModelForImageTextToText.from_pretrained(saved_tiny, dtype="float32")
    model = load_base_model(str(saved_tiny), "float32")
    assert isinstance(model.model.visual.patch_embed.proj, PatchMatmul)
    assert patch_embed_as_matmul(model) == 0  # already swapped
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in plain.state_dict().items()}
    vision = plain.config.vision_config
    grid = torch.tensor([[1, 4, 6]])  # one image of 4 x 6 patches
    pixels = torch.randn(24, vision.in_channels * vision.temporal_patch_size * vision.patch_size**2)
    with torch.no_grad():
        want = plain.model.get_image_features(pixels, grid)
        got = model.model.get_image_features(pixels, grid)
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, rtol=1e-4, atol=1e-5)  # every patch
    assert len(got.pooler_output) == 1 and got.pooler_output[0].shape == (6, plain.config.text_config.hidden_size)
    torch.testing.assert_close(got.pooler_output[0], want.pooler_output[0], rtol=1e-4, atol=1e-5)  # merged tokens
    model.save_pretrained(tmp_path / "saved")
    with safe_open(str(tmp_path / "saved" / "model.safetensors"), "pt") as saved:
        assert saved.get_tensor("model.visual.patch_embed.proj.weight").shape == plain.model.visual.patch_embed.proj.weight.shape
