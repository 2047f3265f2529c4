"""Rendering is the model's own chat template with ``tools=``; the mask trains exactly the assistant
text, the tool-call JSON and the closing ``<|im_end|>`` of every assistant turn."""

from __future__ import annotations

import json

import pytest

from eogym_sft.data.encoding import encode_conversation, render
from eogym_sft.data.traces import TraceError, normalize_row

SYSTEM = "You are an expert remote-sensing analyst. Final Answer: <answer>"
IMG = "EO_GYM_DATA/aaaa0000/scene.jpg"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "crop_optical_or_sar_image",
            "description": "Crop an optical or SAR image by a normalized AOI and return the saved path.",
            "parameters": {
                "type": "object",
                "properties": {"image_url": {"type": "string"}, "aoi": {"type": "array"}},
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "compute_index",
            "description": "Spectral index (NDVI, NDWI) statistics.",
            "parameters": {"type": "object", "properties": {"index": {"type": "string"}}},
        },
    },
]
VISION = "<|vision_start|><|image_pad|><|vision_end|>"
CROP_ARGS = {"image_url": IMG, "aoi": [0.1, 0.2, 0.5, 0.6]}
NDVI_ARGS = {"dataset": "EO_GYM_DATA/s2/site.nc", "index": "NDVI"}
R1 = '{"cropped_path": "image_cache/crops/c1.png", "width": 64}'
R2 = '{"index": "NDVI", "mean": 0.41, "output_path": "image_cache/index/n.nc"}'
R3 = "Saved crop to image_cache/crops/c2.png"


def _row() -> dict:
    def call(name, args):
        return {"type": "function", "function": {"name": name, "arguments": json.dumps(args)}}

    return {
        "id": "train_0000001_aaaaaaaaaaaa",
        "images": [IMG],
        "tools": TOOLS,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "<image>How many ships?"},
            {
                "role": "assistant",
                "content": "I crop the pier.",
                "tool_calls": [call("crop_optical_or_sar_image", CROP_ARGS)],
            },
            {"role": "tool", "content": R1},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [call("compute_index", NDVI_ARGS), call("crop_optical_or_sar_image", CROP_ARGS)],
            },
            {"role": "tool", "content": R2},
            {"role": "tool", "content": R3},
            {"role": "assistant", "content": "Three hulls.\nFinal Answer: 3"},
        ],
    }


def _call_json(name, args) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


TOOLS_BLOCK = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + "\n".join(json.dumps(t) for t in TOOLS)
    + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
# Trained: what the assistant writes, and its <|im_end|>.
TRAINED = [
    "I crop the pier.\n" + _call_json("crop_optical_or_sar_image", CROP_ARGS) + "<|im_end|>",
    _call_json("compute_index", NDVI_ARGS) + "\n" + _call_json("crop_optical_or_sar_image", CROP_ARGS) + "<|im_end|>",
    "Three hulls.\nFinal Answer: 3<|im_end|>",
]
# Context: system + tools block, the question and its image, each tool result (crops attached), headers.
CONTEXT = [
    f"<|im_start|>system\n{SYSTEM}\n\n{TOOLS_BLOCK}<|im_end|>\n<|im_start|>user\n{VISION}How many ships?<|im_end|>\n<|im_start|>assistant\n",
    f"\n<|im_start|>user\n<tool_response>\n{R1}{VISION}\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    f"\n<|im_start|>user\n<tool_response>\n{R2}\n</tool_response>\n<tool_response>\n{R3}{VISION}\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    "\n",
]


@pytest.fixture(scope="module")
def trace():
    return normalize_row(_row())


@pytest.fixture(scope="module")
def encoded(processor, trace):
    return encode_conversation(processor, trace.messages, trace.tools)


def test_rendered_text_is_the_processors_own_chat_template(processor, trace, encoded):
    expected = processor.apply_chat_template(trace.messages, tools=trace.tools, tokenize=False)
    assert encoded.text == expected == render(processor, trace.messages, trace.tools)
    assert encoded.text == "".join(c + t for c, t in zip(CONTEXT, TRAINED + [""]))
    assert encoded.input_ids == processor.tokenizer(expected, add_special_tokens=False)["input_ids"]


def test_mask_trains_assistant_text_tool_calls_and_im_end_only(processor, encoded, runs_of):
    runs = runs_of(processor, encoded.input_ids, encoded.assistant_mask)
    assert [text for flag, text in runs if flag] == TRAINED
    assert [text for flag, text in runs if not flag] == CONTEXT
    assert [flag for flag, _ in runs] == [0, 1, 0, 1, 0, 1, 0]


def test_assistant_turn_boundaries(processor, trace, encoded):
    assert encoded.assistant_message_index == [2, 4, 7]
    turns = [
        processor.tokenizer.decode(encoded.input_ids[a:b])
        for a, b in zip(encoded.assistant_starts, encoded.assistant_ends)
    ]
    assert turns == ["<|im_start|>assistant\n" + t + "\n" for t in TRAINED]
    # each turn starts right after the previous turn's context: the tokens between are the tool results
    assert encoded.assistant_ends[-1] == len(encoded.input_ids)


def test_without_tools_there_is_no_tools_block(processor, trace, runs_of):
    enc = encode_conversation(processor, trace.messages, [])
    assert enc.text == processor.apply_chat_template(trace.messages, tokenize=False)
    assert "# Tools" not in enc.text
    runs = runs_of(processor, enc.input_ids, enc.assistant_mask)
    assert [text for flag, text in runs if flag] == TRAINED
    assert runs[0] == (
        0,
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{VISION}How many ships?<|im_end|>\n<|im_start|>assistant\n",
    )


def test_non_ascii_text_keeps_token_boundaries(processor, runs_of):
    messages = [
        {"role": "system", "content": "Analyste télédétection."},
        {"role": "user", "content": [{"type": "text", "text": "Combien de navires ? 船"}]},
        {"role": "assistant", "content": "Réponse finale : trois 船\nFinal Answer: 3"},
    ]
    enc = encode_conversation(processor, messages, None)
    runs = runs_of(processor, enc.input_ids, enc.assistant_mask)
    assert [text for flag, text in runs if flag] == ["Réponse finale : trois 船\nFinal Answer: 3<|im_end|>"]


class _DriftingTemplate:
    """A processor whose template renders the last turn differently from the same turn mid-conversation."""

    def __init__(self, processor):
        self.tokenizer = processor.tokenizer
        self._processor = processor

    def apply_chat_template(self, messages, **kwargs):
        text = self._processor.apply_chat_template(messages, **kwargs)
        return text + f"<!-- {len(messages)} turns -->"


def test_a_template_that_is_not_prefix_stable_is_refused(processor, trace):
    with pytest.raises(TraceError) as info:
        encode_conversation(_DriftingTemplate(processor), trace.messages, trace.tools)
    assert info.value.reason == "template_mismatch"
