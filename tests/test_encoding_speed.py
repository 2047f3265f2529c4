"""The fast ``encode_conversation`` gives exactly what the straightforward one gives.

``reference_encode`` below is the original implementation: every prefix rendered through the public
``processor.apply_chat_template``. The package's version renders each prefix once, from one converted
copy of the conversation, through the same compiled template (see ``encoding._PrefixRenderer``).
Both must give equal ``Encoded`` fields, or the same error, on a few hundred EO-Gym-shaped rows from
the throughput bench's generator, on split-window-like sub-conversations, and on odd templates.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import random
from pathlib import Path

import pytest

from eogym_sft import encoding
from eogym_sft.encoding import Encoded, encode_conversation, encode_ids
from eogym_sft.traces import TraceError, normalize_row

REPO = Path(__file__).resolve().parents[1]
N_ROWS = 300


# --- the reference: the original, straightforward implementation --------------------------------


def reference_render(processor, messages, tools, add_generation_prompt=False):
    return processor.apply_chat_template(
        messages, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def reference_encode(processor, messages, tools) -> Encoded:
    text = reference_render(processor, messages, tools)
    tok = getattr(processor, "tokenizer", processor)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    starts = [s for s, _ in enc["offset_mapping"]]

    def char_to_token(char, where):
        if char == len(text):
            return len(starts)
        for t, s in enumerate(starts):
            if s == char:
                return t
            if s > char:
                break
        raise TraceError("template_mismatch", where, f"no token boundary at character {char}")

    mask = [0] * len(enc["input_ids"])
    a_starts, a_ends, a_index = [], [], []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        where = f"messages[{i}]"
        before = reference_render(processor, messages[:i], tools) if i else ""
        header_end = reference_render(processor, messages[:i], tools, add_generation_prompt=True)
        after = reference_render(processor, messages[: i + 1], tools)
        if not (text.startswith(after) and after.startswith(header_end) and header_end.startswith(before)):
            raise TraceError("template_mismatch", where, "the chat template does not render this conversation prefix by prefix")
        if not after.endswith("\n"):
            raise TraceError("template_mismatch", where, "an assistant turn does not end with '<|im_end|>\\n'")
        first = char_to_token(len(header_end), where)
        last = char_to_token(len(after) - 1, where)
        for t in range(first, last):
            mask[t] = 1
        a_starts.append(char_to_token(len(before), where))
        a_ends.append(char_to_token(len(after), where))
        a_index.append(i)
    return Encoded(text, list(enc["input_ids"]), mask, a_starts, a_ends, a_index)


def outcome(fn, *args):
    """``("ok", fields)`` or ``("error", type, details)``, comparable between implementations."""
    try:
        enc = fn(*args)
    except TraceError as err:
        return ("error", "TraceError", err.reason, err.field, err.detail)
    except Exception as err:  # noqa: BLE001 - whatever the reference raises, the fast one must too
        return ("error", type(err).__name__, str(err))
    return ("ok", vars(enc))


def assert_same(processor, messages, tools):
    expected = outcome(reference_encode, processor, messages, tools)
    assert outcome(encode_conversation, processor, messages, tools) == expected
    return expected


# --- inputs ---------------------------------------------------------------------------------------


def _bench_module():
    spec = importlib.util.spec_from_file_location("prep_throughput", REPO / "bench" / "prep_throughput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def traces():
    """N_ROWS canonical traces from the bench's generator (both dialects, 1-6 tool calls, 5-15 tools)."""
    rows = [row for row, _ in _bench_module().generate_rows(N_ROWS, seed=7)]
    return [normalize_row(row) for row in rows]


def _windows(trace, rng: random.Random):
    """Sub-conversations shaped like split windows: head + a run of turns ending at an assistant."""
    msgs = trace.messages
    assistants = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    head = msgs[: assistants[0]]
    for _ in range(2):
        a, b = sorted(rng.sample(assistants, 2)) if len(assistants) > 1 else (assistants[0], assistants[0])
        yield head + msgs[a : b + 1]


# --- tests ----------------------------------------------------------------------------------------


def test_fast_encoding_equals_reference_on_generated_rows(processor, traces):
    ok = 0
    for trace in traces:
        ok += assert_same(processor, trace.messages, trace.tools)[0] == "ok"
    assert ok == len(traces)  # the sample is all well-formed: every row is compared field by field


def test_fast_encoding_equals_reference_on_windows_and_without_tools(processor, traces):
    rng = random.Random(0)
    for trace in traces[:30]:
        for messages in _windows(trace, rng):
            assert assert_same(processor, messages, trace.tools)[0] == "ok"
        assert assert_same(processor, trace.messages, [])[0] == "ok"
        assert assert_same(processor, trace.messages, None)[0] == "ok"
        # a conversation that stops at a tool result (the fast path is still checked against the full text)
        last_tool = max(i for i, m in enumerate(trace.messages) if m["role"] == "tool")
        assert_same(processor, trace.messages[: last_tool + 1], trace.tools)


def test_interleaved_conversations_do_not_share_cached_json(processor, traces):
    """tojson results are memoised per conversation: alternating rows with other tool sets stays exact."""
    a, b = traces[0], traces[1]
    for trace in (a, b, a, b):
        assert_same(processor, trace.messages, trace.tools)
    mutated = copy.deepcopy(a.tools)
    mutated[0]["function"]["description"] += " (changed)"
    assert "(changed)" in encode_conversation(processor, a.messages, mutated).text


def test_the_fast_path_is_taken(processor, traces, monkeypatch):
    """One public render per conversation (the full text); the prefixes come from the fast path."""
    trace = traces[0]
    renderer = encoding._PrefixRenderer(processor, trace.messages, trace.tools, encoding.render(processor, trace.messages, trace.tools))
    assert renderer.fast is not None
    calls = []
    original = type(processor).apply_chat_template
    monkeypatch.setattr(type(processor), "apply_chat_template", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    # patching the class method counts as an override, so the fast path steps aside: count that too
    encode_conversation(processor, trace.messages, trace.tools)
    n_assistant = sum(m["role"] == "assistant" for m in trace.messages)
    assert len(calls) == 3 * n_assistant  # fallback: every distinct prefix once, the full text included
    monkeypatch.undo()
    calls.clear()
    monkeypatch.setattr(encoding, "render", lambda *a, **k: calls.append(1) or reference_render(*a, **k))
    encode_conversation(processor, trace.messages, trace.tools)
    assert len(calls) == 1


def test_processor_overriding_apply_chat_template_uses_the_public_path(processor, traces):
    class Wrapped:
        def __init__(self, inner):
            self.tokenizer = inner.tokenizer
            self.chat_template = inner.chat_template
            self.inner = inner

        def apply_chat_template(self, *args, **kwargs):
            return self.inner.apply_chat_template(*args, **kwargs)

    wrapped = Wrapped(processor)
    trace = traces[2]
    assert encoding._PrefixRenderer(wrapped, trace.messages, trace.tools, "").fast is None
    assert assert_same(wrapped, trace.messages, trace.tools)[0] == "ok"


@pytest.mark.parametrize(
    "template",
    [
        # not prefix-stable: the count of messages comes first
        "{{ messages | length }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content if m.content is string else '' }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        # assistant turns that do not end with a newline
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content if m.content is string else '' }}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        # raises for tool turns
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
        "<|im_start|>{{ m.role }}\n<|im_end|>\n{% endfor %}",
        # tools rendered with options through tojson
        "{% for t in tools %}{{ t | tojson(indent=2) }}{{ t | tojson }}{% endfor %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.tool_calls %}{% for c in m.tool_calls %}{{ c.function.arguments | tojson(sort_keys=true) }}{% endfor %}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    ],
)
def test_other_templates_give_the_same_result_or_error(processor, traces, template):
    odd = copy.copy(processor)
    odd.chat_template = template
    for trace in traces[:5]:
        assert_same(odd, trace.messages, trace.tools)


def test_leading_assistant_turn_behaves_as_before(processor):
    messages = [
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": [{"type": "text", "text": "q"}]},
        {"role": "assistant", "content": "Final Answer: 1"},
    ]
    assert_same(processor, messages, None)


def test_encode_ids_equals_the_encoded_ids(processor, traces):
    for trace in traces[:20]:
        assert encode_ids(processor, trace.messages, trace.tools) == encode_conversation(processor, trace.messages, trace.tools).input_ids


def test_generated_rows_are_deterministic():
    bench = _bench_module()
    first = [json.dumps(r) for r, _ in bench.generate_rows(20, seed=3)]
    assert first == [json.dumps(r) for r, _ in bench.generate_rows(20, seed=3)]


def test_tokeniser_in_another_state_goes_through_its_own_call(processor, traces):
    """The Rust backend is called directly only in the state ``tok(...)`` itself sets."""
    backend = processor.tokenizer._tokenizer
    assert encoding._direct_backend(processor.tokenizer) is backend
    backend.enable_truncation(max_length=100_000)
    try:
        assert encoding._direct_backend(processor.tokenizer) is None
        trace = traces[3]
        expected = outcome(reference_encode, processor, trace.messages, trace.tools)
        backend.enable_truncation(max_length=100_000)
        assert outcome(encode_conversation, processor, trace.messages, trace.tools) == expected
    finally:
        backend.no_truncation()


def test_piecewise_tokenisation_equals_whole_texts(processor, traces, monkeypatch):
    """Texts are tokenised message by message with a cache; ids and offsets equal the whole-text ones."""
    backend = processor.tokenizer._tokenizer
    pieces = encoding._Pieces.of(backend)
    assert pieces is not None  # the Qwen3 tokenizer can be cut before <|im_start|>
    monkeypatch.setattr(encoding._Pieces, "CACHE_SIZE", 5)  # evictions too
    texts = [encoding.render(processor, t.messages, t.tools) for t in traces[:12]]
    texts += [texts[0], "no marker at all", "<|im_start|>only one", "a<|im_start|><|im_start|>b<|im_end|>\n<|im_start|>"]
    texts += ["<|im_start|>user\nquoted <|im_start|> and <|im_end|> inside a message<|im_end|>\n" * 2]
    for text in texts + texts[::-1]:
        whole = backend.encode(text, add_special_tokens=False)
        assert pieces.encode(text) == (whole.ids, [s for s, _ in whole.offsets])
    assert encoding._Pieces.of(backend) is pieces  # the self-checks passed: still on


def test_piecewise_tokenisation_refuses_tokens_that_could_match_across_the_cut():
    from types import SimpleNamespace

    def fake(*tokens):
        flags = dict(normalized=False, lstrip=False, rstrip=False, single_word=False)
        added = {i: SimpleNamespace(content=c, **{**flags, **kw}) for i, (c, kw) in enumerate(tokens)}
        return SimpleNamespace(get_added_tokens_decoder=lambda: added)

    ok = ("<|im_start|>", {})
    assert encoding._Pieces._cuttable(fake(ok, ("<|im_end|>", {}), ("<tool_call>", {})))
    assert not encoding._Pieces._cuttable(fake(("<|im_end|>", {})))  # no marker token
    assert not encoding._Pieces._cuttable(fake(("<|im_start|>", {"lstrip": True})))  # eats the whitespace before it
    assert not encoding._Pieces._cuttable(fake(ok, ("\n<|im_start|>", {})))  # contains the marker
    assert not encoding._Pieces._cuttable(fake(ok, ("end<|", {})))  # overlaps its start
