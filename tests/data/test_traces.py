"""Every accepted input dialect normalises to the exact same canonical conversation; bad rows raise a
TraceError with a stable reason and the field at fault. Pure Python: no processor, no files."""

from __future__ import annotations

import copy
import json

import pytest

from eogym_sft.data.traces import (
    TraceError,
    count_images,
    normalize_row,
    normalize_tools,
    parse_tool_call_text,
)

SYSTEM = "You are an expert remote-sensing analyst. Final Answer: <answer>"
IMG = "EO_GYM_DATA/84ebc74d/84ebc74d00000000000000000000000000000000000000000000000000000000.jpg"
CROP1, CROP2 = "image_cache/crops/c1.png", "image_cache/crops/c2.png"
QUESTION = "How many ships are moored at the pier?"
CALL1 = {"name": "crop_optical_or_sar_image", "arguments": {"image_url": IMG, "aoi": [0.1, 0.2, 0.5, 0.6]}}
CALL2 = {"name": "compute_index", "arguments": {"dataset": "EO_GYM_DATA/s2/site_2020.nc", "index": "NDVI"}}
CALL3 = {"name": "crop_optical_or_sar_image", "arguments": {"image_url": IMG, "aoi": [0.5, 0.5, 1.0, 1.0]}}
R1 = json.dumps({"cropped_path": CROP1, "width": 64, "height": 48, "bbox_px": [6, 9, 70, 57]})
R2 = json.dumps({"index": "NDVI", "mean": 0.41, "output_path": "image_cache/index/n.nc"})  # NetCDF: stays text
R3 = f"Saved crop to {CROP2}"
THOUGHT1, THOUGHT2, FINAL = (
    "I crop the pier first.",
    "Now the index and the second half.",
    "Three hulls.\nFinal Answer: 3",
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "crop_optical_or_sar_image",
            "description": "Crop.",
            "parameters": {"type": "object", "properties": {"image_url": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "compute_index",
            "description": "Index.",
            "parameters": {"type": "object", "properties": {"index": {"type": "string"}}},
        },
    },
]


def _canonical_call(call: dict) -> dict:
    return {"type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}


EXPECTED = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
    {"role": "assistant", "content": THOUGHT1, "tool_calls": [_canonical_call(CALL1)]},
    {"role": "tool", "content": [{"type": "text", "text": R1}, {"type": "image"}]},
    {"role": "assistant", "content": THOUGHT2, "tool_calls": [_canonical_call(CALL2), _canonical_call(CALL3)]},
    {"role": "tool", "content": [{"type": "text", "text": R2}]},
    {"role": "tool", "content": [{"type": "text", "text": R3}, {"type": "image"}]},
    {"role": "assistant", "content": FINAL},
]
EXPECTED_IMAGES = [IMG, CROP1, CROP2]
META = {
    "EO_task": "Spatial Navigation",
    "question_type": "moving reasoning",
    "data_source": "fair1_vhr",
    "gt_answer": "3",
}


def _row(messages, images=(IMG,), tools=TOOLS) -> dict:
    return {"id": "train_0000007_d1563431f737", "images": list(images), "tools": tools, "messages": messages, **META}


def _openai(
    args_as_string: bool, tool_content_list: bool = False, user_content: str | list = "<image>" + QUESTION
) -> list[dict]:
    def call(i, c):
        args = json.dumps(c["arguments"]) if args_as_string else c["arguments"]
        return {"id": f"call_{i}", "type": "function", "function": {"name": c["name"], "arguments": args}}

    def tool(i, text):
        return {
            "role": "tool",
            "tool_call_id": f"call_{i}",
            "content": [{"type": "text", "text": text}] if tool_content_list else text,
        }

    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": user_content},
        {"role": "assistant", "content": THOUGHT1, "tool_calls": [call(1, CALL1)]},
        tool(1, R1),
        {"role": "assistant", "content": THOUGHT2, "tool_calls": [call(2, CALL2), call(3, CALL3)]},
        tool(2, R2),
        tool(3, R3),
        {"role": "assistant", "content": FINAL},
    ]


def _block(call: dict) -> str:
    return "<tool_call>\n" + json.dumps(call) + "\n</tool_call>"


def _hermes(user_content: str = QUESTION) -> list[dict]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": user_content},
        {"role": "assistant", "content": f"{THOUGHT1}\n{_block(CALL1)}"},
        {"role": "user", "content": f"<tool_response>\n{R1}\n</tool_response>"},
        {"role": "assistant", "content": f"{THOUGHT2}\n{_block(CALL2)}\n{_block(CALL3)}"},
        {
            "role": "user",
            "content": f"<tool_response>\n{R2}\n</tool_response>\n<tool_response>\n{R3}\n</tool_response>",
        },
        {"role": "assistant", "content": FINAL},
    ]


def _list_parts() -> list[dict]:
    """Every content a list of parts; the question image a bare ``{"type": "image"}`` part."""
    messages = _openai(
        True, tool_content_list=True, user_content=[{"type": "image"}, {"type": "text", "text": QUESTION}]
    )
    messages[0]["content"] = [{"type": "text", "text": SYSTEM}]
    messages[2]["content"] = [{"type": "text", "text": THOUGHT1}]
    messages[-1]["content"] = [{"type": "text", "text": "Three hulls.\n"}, "Final Answer: 3"]  # a bare string part too
    return messages


DIALECTS = {
    "openai_args_string": lambda: _row(_openai(True)),
    "openai_args_object": lambda: _row(_openai(False)),
    "openai_tool_content_list": lambda: _row(_openai(True, tool_content_list=True)),
    "hermes_tool_call_text": lambda: _row(_hermes()),  # no placeholder: row image starts the first user turn
    "hermes_with_image_tag": lambda: _row(_hermes("<image>" + QUESTION)),
    "content_parts": lambda: _row(_list_parts()),
    "image_part_names_path": lambda: _row(
        _openai(
            True,
            user_content=[
                {"type": "image_url", "image_url": {"url": "file://" + IMG}},
                {"type": "text", "text": QUESTION},
            ],
        ),
        images=(),
    ),
    "image_part_names_row_image": lambda: _row(  # the row lists it too: bound once, not twice
        _openai(True, user_content=[{"type": "image", "image": IMG}, {"type": "text", "text": QUESTION}])
    ),
    "tools_as_json_string": lambda: _row(_openai(False), tools=json.dumps(TOOLS)),
    "hermes_arguments_double_encoded": lambda: _row(
        [
            (
                m
                if k != 2
                else {
                    "role": "assistant",
                    "content": THOUGHT1 + "\n" + _block(dict(CALL1, arguments=json.dumps(CALL1["arguments"]))),
                }
            )
            for k, m in enumerate(_hermes())
        ]
    ),
}


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
def test_every_dialect_gives_the_same_canonical_trace(dialect):
    trace = normalize_row(DIALECTS[dialect]())
    assert trace.messages == EXPECTED
    assert trace.images == EXPECTED_IMAGES
    assert trace.tools == TOOLS
    assert trace.id == "train_0000007_d1563431f737"
    assert trace.meta == META
    assert trace.trimmed_messages == 0


def test_null_content_on_tool_call_turns_becomes_empty_text():
    messages = _openai(True)
    messages[2]["content"] = None
    messages[4]["content"] = None
    trace = normalize_row(_row(messages))
    assert trace.messages[2] == {"role": "assistant", "content": "", "tool_calls": [_canonical_call(CALL1)]}
    assert trace.messages[4] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [_canonical_call(CALL2), _canonical_call(CALL3)],
    }
    assert trace.messages[5:] == EXPECTED[5:]


def test_tool_images_as_text_keeps_paths_in_the_text_only():
    trace = normalize_row(_row(_openai(True)), tool_images="text")
    assert trace.messages[3] == {"role": "tool", "content": [{"type": "text", "text": R1}]}
    assert trace.messages[6] == {"role": "tool", "content": [{"type": "text", "text": R3}]}
    assert trace.images == [IMG]


def test_tool_image_paths_behind_an_absolute_prefix_attach_by_their_portable_part():
    text = json.dumps(
        {
            "cropped_path": "/srv/eo_gym/image_cache/crops/c1.png",
            "mask": "/srv/eo_gym/image_cache/m/a.nc",
            "again": "image_cache/crops/c1.png",
            "tile": "EO_GYM_DATA/ab/cd.TIF",
        }
    )
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "", "tool_calls": [{"function": CALL1}]},
        {"role": "function", "name": "crop_optical_or_sar_image", "content": text},
        {"role": "assistant", "content": FINAL},
    ]
    trace = normalize_row(_row(messages, images=()), tool_images="attach")
    # each named image once, in order of appearance; the .nc mask stays text
    assert trace.messages[3] == {
        "role": "tool",
        "content": [{"type": "text", "text": text}, {"type": "image"}, {"type": "image"}],
    }
    assert trace.images == [CROP1, "EO_GYM_DATA/ab/cd.TIF"]
    assert trace.tool_images == {"crop_optical_or_sar_image": 2}
    # the default attaches what the tool produced (the crop), and keeps the listed dataset tile as text
    trace = normalize_row(_row(messages, images=()))
    assert trace.messages[3] == {"role": "tool", "content": [{"type": "text", "text": text}, {"type": "image"}]}
    assert trace.images == [CROP1]
    assert trace.tool_images == {"crop_optical_or_sar_image": 1}


def test_legacy_function_call_and_function_role():
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "<image>" + QUESTION},
        {
            "role": "assistant",
            "content": THOUGHT1,
            "function_call": {"name": CALL1["name"], "arguments": json.dumps(CALL1["arguments"])},
        },
        {"role": "function", "name": CALL1["name"], "content": R1},
        {"role": "assistant", "content": FINAL},
    ]
    trace = normalize_row(_row(messages))
    assert trace.messages == EXPECTED[:4] + [EXPECTED[-1]]
    assert trace.images == [IMG, CROP1]


def test_image_tags_split_text_and_bind_row_images_in_order():
    second = "EO_GYM_DATA/bbbb1111/post.png"
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Before: <image>\nAfter: <image>\n" + QUESTION},
        {"role": "assistant", "content": FINAL},
    ]
    trace = normalize_row(_row(messages, images=(IMG, second)))
    assert trace.messages[1]["content"] == [
        {"type": "text", "text": "Before: "},
        {"type": "image"},
        {"type": "text", "text": "\nAfter: "},
        {"type": "image"},
        {"type": "text", "text": "\n" + QUESTION},
    ]
    assert trace.images == [IMG, second]


def test_row_images_without_placeholders_start_the_first_user_turn_in_row_order():
    second = "EO_GYM_DATA/bbbb1111/post.png"
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": FINAL},
    ]
    trace = normalize_row(_row(messages, images=(second, IMG)))
    assert trace.messages[1]["content"] == [{"type": "image"}, {"type": "image"}, {"type": "text", "text": QUESTION}]
    assert trace.images == [second, IMG]


def test_three_message_row_without_tool_calls():
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "Final Answer: land"},
    ]
    trace = normalize_row(_row(messages, images=(), tools=None) | {"gt_answer": 5, "id": 12})
    assert trace.messages == [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": [{"type": "text", "text": QUESTION}]},
        {"role": "assistant", "content": "Final Answer: land"},
    ]
    assert trace.images == [] and trace.tools == []
    assert trace.id == "12" and trace.meta["gt_answer"] == "5"


def test_turns_after_the_last_assistant_turn_are_trimmed_with_their_images():
    messages = _openai(True)[:4]  # ends with a tool result naming CROP1
    messages.append({"role": "assistant", "content": FINAL})
    messages.append({"role": "user", "content": "Thanks! <image>"})
    trace = normalize_row(_row(messages, images=(IMG, "EO_GYM_DATA/x/late.png")))
    assert trace.messages == EXPECTED[:4] + [EXPECTED[-1]]
    assert trace.images == [IMG, CROP1]
    assert trace.trimmed_messages == 1
    assert count_images(trace.messages) == 2


def test_arrow_none_padding_is_stripped_from_tools():
    padded = copy.deepcopy(TOOLS)
    padded[0]["function"]["parameters"]["properties"]["aoi"] = None
    padded[1]["function"]["strict"] = None
    assert normalize_tools(padded) == TOOLS
    assert normalize_tools([TOOLS[0]["function"]]) == [TOOLS[0]]  # a bare {"name", "parameters"} schema
    assert normalize_tools(None) == []


def test_parse_tool_call_text_keeps_the_surrounding_text():
    text, calls = parse_tool_call_text(f"Look.\n{_block(CALL1)}\nThen more.", "m")
    assert text == "Look.\nThen more."
    assert calls == [_canonical_call(CALL1)]


def _set(path, value):
    """A row mutator: ``path`` like ("messages", 2, "content")."""

    def mutate(row):
        target = row
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        return row

    return mutate


ERRORS = {
    "unknown_role": (_set(("messages", 3, "role"), "observer"), "unknown_role", "messages[3].role"),
    "role_missing": (lambda r: r["messages"][3].pop("role") and r, "unknown_role", "messages[3].role"),
    "misplaced_system": (_set(("messages", 3, "role"), "system"), "misplaced_system", "messages[3].role"),
    "assistant_before_user": (
        lambda r: {**r, "messages": [r["messages"][0], r["messages"][2], *r["messages"][1:2], *r["messages"][3:]]},
        "assistant_before_user",
        "messages[1]",
    ),
    "arguments_bad_json": (
        _set(("messages", 2, "tool_calls", 0, "function", "arguments"), '{"image_url": "a.jpg", "aoi": [0.1'),
        "invalid_tool_arguments",
        "messages[2].tool_calls[0].function.arguments",
    ),
    "arguments_not_object": (
        _set(("messages", 2, "tool_calls", 0, "function", "arguments"), "[1, 2]"),
        "invalid_tool_arguments",
        "messages[2].tool_calls[0].function.arguments",
    ),
    "tool_call_without_name": (
        _set(("messages", 2, "tool_calls", 0, "function", "name"), ""),
        "invalid_tool_call",
        "messages[2].tool_calls[0].function",
    ),
    "tool_call_not_object": (
        _set(("messages", 2, "tool_calls", 0), "crop"),
        "invalid_tool_call",
        "messages[2].tool_calls[0]",
    ),
    "hermes_bad_json": (
        _set(("messages", 2, "content"), "<tool_call>{name: crop}</tool_call>"),
        "invalid_tool_call",
        "messages[2].content<tool_call 0>",
    ),
    "hermes_not_object": (
        _set(("messages", 2, "content"), "<tool_call>[1]</tool_call>"),
        "invalid_tool_call",
        "messages[2].content<tool_call 0>",
    ),
    "hermes_unclosed": (
        _set(("messages", 2, "content"), '<tool_call>{"name": "x"}'),
        "invalid_tool_call",
        "messages[2].content",
    ),
    "hermes_bad_arguments": (
        _set(("messages", 2, "content"), '<tool_call>{"name": "x", "arguments": "{oops"}</tool_call>'),
        "invalid_tool_arguments",
        "messages[2].content<tool_call 0>.arguments",
    ),
    "calls_in_both_forms": (_set(("messages", 2, "content"), _block(CALL1)), "invalid_tool_call", "messages[2]"),
    "no_assistant_turn": (lambda r: r.update(messages=r["messages"][:2]) or r, "no_assistant_turn", "messages"),
    "more_tags_than_images": (
        _set(("messages", 1, "content"), "<image><image>" + QUESTION),
        "image_placeholder_mismatch",
        "images",
    ),
    "tag_but_no_images": (_set(("images",), []), "image_placeholder_mismatch", "images"),
    "images_but_no_user_turn": (
        lambda r: r.update(messages=[r["messages"][0], r["messages"][-1]]) or r,
        "image_placeholder_mismatch",
        "images",
    ),
    "mixed_tool_response": (
        lambda r: r.update(
            messages=[
                *r["messages"][:3],
                {"role": "user", "content": f"<tool_response>{R1}</tool_response> and more"},
                r["messages"][-1],
            ]
        )
        or r,
        "mixed_tool_response",
        "messages[3].content",
    ),
    "content_is_a_number": (_set(("messages", 1, "content"), 7), "bad_field_type", "messages[1].content"),
    "unsupported_part": (
        _set(("messages", 1, "content"), [{"type": "audio"}]),
        "bad_field_type",
        "messages[1].content[0].type",
    ),
    "image_in_assistant_turn": (
        _set(("messages", -1, "content"), [{"type": "image"}]),
        "bad_field_type",
        "messages[7].content",
    ),
    "images_not_a_list": (_set(("images",), IMG), "bad_field_type", "images"),
    "tools_bad_json_string": (_set(("tools",), "[{"), "bad_field_type", "tools"),
    "tools_not_a_list": (_set(("tools",), {"name": "x"}), "bad_field_type", "tools"),
    "messages_empty": (_set(("messages",), []), "bad_field_type", "messages"),
    "id_missing": (lambda r: r.pop("id") and r, "missing_field", "id"),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_bad_rows_name_their_reason_and_field(case):
    mutate, reason, field = ERRORS[case]
    with pytest.raises(TraceError) as info:
        normalize_row(mutate(_row(_openai(True))))
    assert (info.value.reason, info.value.field) == (reason, field)
    assert str(info.value).startswith(f"{reason} at {field}: ")


def test_a_row_that_is_not_an_object():
    with pytest.raises(TraceError) as info:
        normalize_row([1, 2])
    assert (info.value.reason, info.value.field) == ("not_an_object", "<row>")


@pytest.mark.parametrize(
    "result_turn",
    [
        {"role": "user", "content": "<tool_response>\nSee the crop.<image>\n</tool_response>"},  # Qwen/Hermes
        {"role": "tool", "content": "See the crop.<image>"},  # OpenAI
    ],
)
def test_image_tags_inside_tool_results_take_row_images(result_turn):
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "<image>" + QUESTION},
        {"role": "assistant", "content": f"{THOUGHT1}\n{_block(CALL1)}"},
        result_turn,
        {"role": "assistant", "content": FINAL},
    ]
    trace = normalize_row(_row(messages, images=(IMG, CROP1)))
    assert trace.messages[3] == {
        "role": "tool",
        "content": [{"type": "text", "text": "See the crop."}, {"type": "image"}],
    }
    assert trace.images == [IMG, CROP1]


################
# Property tests: any JSON a row may hold is a canonical trace or a TraceError, nothing else (issue 28)
################

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from eogym_sft.data.prepare import _decode_line  # noqa: E402

PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _json(floats):
    return st.recursive(
        st.none() | st.booleans() | st.integers() | floats | st.text(max_size=20),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
        max_leaves=10,
    )


JSON = _json(st.floats(allow_nan=True))
EQUAL_JSON = _json(st.floats(allow_nan=False))  # NaN != NaN: round trips compare values without it
ROLE = st.sampled_from(["system", "user", "assistant", "tool", "function", "robot", None])
CONTENT = st.none() | st.text(max_size=40) | st.lists(
    st.text(max_size=10) | st.fixed_dictionaries({"type": st.sampled_from(["text", "image", "video"]), "text": st.text(max_size=10)}),
    max_size=3,
)
MESSAGE = st.fixed_dictionaries(
    {"role": ROLE, "content": CONTENT},
    optional={"tool_calls": st.lists(st.fixed_dictionaries({"function": st.fixed_dictionaries({"name": JSON, "arguments": JSON | st.text(max_size=30)})}), max_size=2), "name": JSON},
)
ROW = st.fixed_dictionaries(
    {"id": JSON, "messages": st.lists(MESSAGE, max_size=6) | JSON},
    optional={"images": st.lists(st.text(max_size=10), max_size=2) | JSON, "tools": JSON},
)


@PROPERTY
@given(row=ROW | JSON)
def test_any_row_is_a_trace_or_a_trace_error(row):
    try:
        trace = normalize_row(row)
    except TraceError as err:
        assert err.reason and err.field
        return
    assert trace.messages[-1]["role"] == "assistant" and all(m["role"] in ("system", "user", "assistant", "tool") for m in trace.messages)


@PROPERTY
@given(raw=st.binary(max_size=200) | st.builds(lambda n: b"[" * n + b"]" * n, st.integers(0, 200000)) | st.builds(lambda n: b"9" * n, st.integers(4000, 6000)))
def test_any_line_decodes_or_is_a_named_trace_error(raw):
    try:
        _decode_line(raw)
    except TraceError as err:
        assert err.reason in ("non_utf8", "malformed_json", "json_too_deep", "json_number_too_long") and err.field == "<line>"


@PROPERTY
@given(text=st.text(max_size=200) | st.builds(lambda body: f"<tool_call>{body}</tool_call>", JSON.map(json.dumps) | st.text(max_size=50)))
def test_any_assistant_text_parses_or_is_a_named_trace_error(text):
    try:
        rest, calls = parse_tool_call_text(text, "messages[1].content")
    except TraceError as err:
        assert err.reason in ("invalid_tool_call", "invalid_tool_arguments")
        return
    assert all(isinstance(c["function"]["arguments"], dict) and c["function"]["name"] for c in calls)
    assert "<tool_call>" not in rest or calls == []


@PROPERTY
@given(name=st.text(min_size=1, max_size=20), arguments=st.dictionaries(st.text(max_size=8), EQUAL_JSON, max_size=4))
def test_a_well_formed_tool_call_round_trips(name, arguments):
    rest, calls = parse_tool_call_text(f"thinking\n<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>", "m")
    assert rest == "thinking" and calls == [{"type": "function", "function": {"name": name, "arguments": arguments}}]
