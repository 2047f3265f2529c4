"""Saving the processor: the same tokenizer back, from one parse of tokenizer.json."""

from __future__ import annotations

import json


def _tokenizer_json_parses(monkeypatch, load):
    """How many times ``load()`` parses a ``tokenizer.json`` with ``json.load``."""
    parses = []
    real_load = json.load

    def counting_load(fp, *args, **kwargs):
        parses.append(getattr(fp, "name", ""))
        return real_load(fp, *args, **kwargs)

    monkeypatch.setattr(json, "load", counting_load)
    result = load()
    monkeypatch.setattr(json, "load", real_load)
    return result, sum(name.endswith("tokenizer.json") for name in parses)


def test_a_saved_processor_loads_the_same_tokenizer_from_one_parse(processor, tmp_path, monkeypatch):
    """transformers' own save leaves the added tokens out of tokenizer_config.json, and its load then parses
    tokenizer.json twice (the upstream behaviour ``save_processor`` works around: when this count drops to
    one, delete the workaround). ``save_processor``'s folder loads the same tokenizer from one parse."""
    from transformers import AutoProcessor

    from eogym_sft.models.processor import processor_fingerprint, save_processor

    processor.save_pretrained(tmp_path / "plain")
    save_processor(processor, tmp_path / "ours")
    assert "added_tokens_decoder" not in json.loads((tmp_path / "plain" / "tokenizer_config.json").read_text())
    plain, plain_parses = _tokenizer_json_parses(monkeypatch, lambda: AutoProcessor.from_pretrained(tmp_path / "plain"))
    ours, our_parses = _tokenizer_json_parses(monkeypatch, lambda: AutoProcessor.from_pretrained(tmp_path / "ours"))
    assert (plain_parses, our_parses) == (2, 1)
    assert ours.tokenizer.added_tokens_decoder == plain.tokenizer.added_tokens_decoder == processor.tokenizer.added_tokens_decoder
    assert repr(ours.tokenizer).replace(str(tmp_path / "ours"), "") == repr(plain.tokenizer).replace(str(tmp_path / "plain"), "")
    assert processor_fingerprint(ours) == processor_fingerprint(plain) == processor_fingerprint(processor)
    text = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>crop <tool_call>{}</tool_call><|im_end|>"
    assert ours.tokenizer(text)["input_ids"] == plain.tokenizer(text)["input_ids"]
    save_processor(ours, tmp_path / "again")  # a folder saved from a loaded one: the field already there
    assert json.loads((tmp_path / "again" / "tokenizer_config.json").read_text())["added_tokens_decoder"] == json.loads(
        (tmp_path / "ours" / "tokenizer_config.json").read_text())["added_tokens_decoder"]


def _scenes():
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in ((64, 96), (120, 80), (64, 64))]


def test_once_per_image_gives_the_image_processors_tensors_and_patches_each_object_once(processor):
    """Two episodes' images as TRL flattens them (the prompt's two scenes in each, then a crop of the second's own):
    the same tensors as the image processor's own call over all five, from a call over the three distinct objects."""
    import torch

    from eogym_sft.models.processor import OncePerImage

    a, b, crop = _scenes()
    flat = [a, b, a, b, crop]
    expected = processor.image_processor(images=flat, return_tensors="pt")
    calls = []
    inner = processor.image_processor

    class Counting:
        def __getattr__(self, name):
            return getattr(inner, name)

        def __call__(self, images=None, **kwargs):
            calls.append(len(images))
            return inner(images=images, **kwargs)

    once = OncePerImage(Counting())
    got = once(images=flat, return_tensors="pt")
    assert calls == [3]
    assert torch.equal(got["image_grid_thw"], expected["image_grid_thw"])
    assert torch.equal(got["pixel_values"], expected["pixel_values"])
    assert once.merge_size == inner.merge_size  # what TRL and the packed loss read from it


def test_once_per_image_hands_other_calls_over_unchanged(processor):
    """Distinct images, images nested per sample, and a call for numpy arrays go to the image processor as given."""
    from eogym_sft.models.processor import OncePerImage

    a, b, _ = _scenes()
    seen = []
    inner = processor.image_processor

    class Recording:
        def __call__(self, images=None, return_tensors=None, **kwargs):
            seen.append((images, return_tensors))
            return inner(images=images, return_tensors=return_tensors, **kwargs)

    once = OncePerImage(Recording())
    once(images=[a, b], return_tensors="pt")
    once(images=[[a], [a, b]], return_tensors="pt")
    once(images=[a, a], return_tensors="np")
    assert [(len(images), rt) for images, rt in seen] == [(2, "pt"), (2, "pt"), (2, "np")]
    assert seen[1][0] == [[a], [a, b]]


def test_images_processed_once_is_undone_after_the_block(processor):
    from eogym_sft.models.processor import OncePerImage, images_processed_once

    inner = processor.image_processor
    try:
        with images_processed_once(processor):
            assert isinstance(processor.image_processor, OncePerImage)
            raise RuntimeError("a failed step")
    except RuntimeError:
        pass
    assert processor.image_processor is inner
