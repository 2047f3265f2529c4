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
