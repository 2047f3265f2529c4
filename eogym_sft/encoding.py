"""Render canonical conversations with the model's chat template and find the tokens to train on.

The text is always ``processor.apply_chat_template(messages, tools=tools)``, the exact string the model
sees at inference. Trained tokens are each assistant message's content, tool calls and closing
``<|im_end|>``; everything else (system, tools block, user, tool results, image placeholders, the
``<|im_start|>assistant\\n`` header, the newline after ``<|im_end|>``) is context.

Trained spans are found by rendering prefixes of the conversation: the text an assistant turn adds
after ``render(messages[:i], add_generation_prompt=True)`` up to ``render(messages[:i + 1])``. A
template for which these are not prefixes of the full text is refused rather than guessed at.

Token ids here carry one ``<|image_pad|>`` per image; the collator expands each to the image's token
count once the image is loaded.

Speed (``bench/prep_throughput.py``; the results are those of the plain algorithm above, which
``tests/test_encoding_speed.py`` keeps as its reference): the full text comes from
``processor.apply_chat_template`` once; the prefixes come from the same compiled template fed one
converted copy of the conversation, with ``tojson`` memoised per conversation (:class:`_PrefixRenderer`,
checked against the full text on every conversation); and the text is tokenised by the Rust backend one
message at a time with a cache of pieces (:class:`_Pieces`). Anything these shortcuts do not cover goes
through the public calls.
"""

from __future__ import annotations

from collections import OrderedDict
from contextvars import ContextVar
from dataclasses import dataclass
from functools import lru_cache

from .traces import TraceError


@dataclass
class Encoded:
    """A rendered conversation and the token layout that windowing and the collator need."""

    text: str
    input_ids: list[int]
    assistant_mask: list[int]
    assistant_starts: list[int]  # token index where each assistant message begins (its header)
    assistant_ends: list[int]  # token index just past each assistant message (after the "\n")
    assistant_message_index: list[int]  # index in ``messages`` of each assistant message


def render(processor, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool = False) -> str:
    """The chat template's text for ``messages``, with the ``# Tools`` block when there are tools."""
    return processor.apply_chat_template(
        messages, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def _tokenizer(processor):
    return getattr(processor, "tokenizer", processor)


def _ids_and_starts(tok, text: str) -> tuple[list[int], list[int]]:
    """Token ids of ``text`` (no special tokens added) and the character where each token starts.

    The same as ``tok(text, add_special_tokens=False, return_offsets_mapping=True)``. For a
    transformers fast tokenizer whose Rust backend is in the state that call sets (no truncation, no
    padding, special tokens kept whole) the backend is called directly, on this thread, and one message
    at a time (see :class:`_Pieces`), so that pieces seen before (a split window's turns, a system
    prompt and tools block shared by many rows) are not tokenised again.
    """
    backend = _direct_backend(tok)
    if backend is None:
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [start for start, _ in enc["offset_mapping"]]
    pieces = _Pieces.of(backend)
    if pieces is None:
        return _encode_whole(backend, text)
    return pieces.encode(text)


def _encode_whole(backend, text: str) -> tuple[list[int], list[int]]:
    enc = backend.encode(text, add_special_tokens=False)
    return enc.ids, [start for start, _ in enc.offsets]


class _Pieces:
    """Tokenise a rendered conversation piece by piece, cutting before each ``<|im_start|>``.

    A Hugging Face tokenizer first splits its input at added tokens that match the raw text
    (``normalized=False``), then normalises, pre-tokenises and tokenises every stretch between them
    on its own. Cutting the text right before such a token therefore changes nothing, as long as no
    other added token can match across the cut (checked on the vocabulary) and the token does not
    absorb the whitespace beside it (``lstrip``/``rstrip``/``single_word`` off). The first
    ``SELF_CHECKS`` texts of each tokenizer are also tokenised whole and compared; any difference
    turns piecewise tokenisation off for that tokenizer.
    """

    MARK = "<|im_start|>"
    CACHE_SIZE = 2048
    SELF_CHECKS = 8
    _by_backend: dict[int, tuple[object, "_Pieces | None"]] = {}

    def __init__(self, backend):
        self.backend = backend
        self.cache: OrderedDict[str, tuple[list[int], list[int]]] = OrderedDict()
        self.checks_left = self.SELF_CHECKS

    @classmethod
    def of(cls, backend) -> "_Pieces | None":
        entry = cls._by_backend.get(id(backend))
        if entry is None or entry[0] is not backend:
            if len(cls._by_backend) >= 16:
                cls._by_backend.clear()
            entry = (backend, cls(backend) if cls._cuttable(backend) else None)
            cls._by_backend[id(backend)] = entry
        return entry[1]

    @classmethod
    def _cuttable(cls, backend) -> bool:
        try:
            added = list(backend.get_added_tokens_decoder().values())
        except Exception:  # noqa: BLE001 - an older or unusual backend: tokenise whole texts
            return False
        mark = [t for t in added if t.content == cls.MARK]
        if len(mark) != 1 or mark[0].normalized or mark[0].lstrip or mark[0].rstrip or mark[0].single_word:
            return False
        m = cls.MARK
        for token in added:
            c = token.content
            if c == m:
                continue
            if m in c or any(c.endswith(m[:k]) for k in range(1, min(len(c), len(m)) + 1)):
                return False  # could match across the cut
        return True

    def encode(self, text: str) -> tuple[list[int], list[int]]:
        cuts = [0]
        at = text.find(self.MARK, 1)
        while at != -1:
            cuts.append(at)
            at = text.find(self.MARK, at + 1)
        if len(cuts) == 1:
            return _encode_whole(self.backend, text)
        cuts.append(len(text))
        ids: list[int] = []
        starts: list[int] = []
        cache = self.cache
        for a, b in zip(cuts, cuts[1:]):
            piece = text[a:b]
            hit = cache.get(piece)
            if hit is None:
                hit = cache[piece] = _encode_whole(self.backend, piece)
                while len(cache) > self.CACHE_SIZE:
                    try:
                        cache.popitem(last=False)
                    except KeyError:  # emptied meanwhile by another thread
                        break
            else:
                try:
                    cache.move_to_end(piece)
                except KeyError:  # evicted meanwhile by another thread
                    pass
            ids += hit[0]
            starts += [s + a for s in hit[1]] if a else hit[1]
        if self.checks_left > 0:
            self.checks_left -= 1
            whole = _encode_whole(self.backend, text)
            if whole != (ids, starts):
                self.checks_left = 0
                _Pieces._by_backend[id(self.backend)] = (self.backend, None)
                return whole
        return ids, starts


def _direct_backend(tok):
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    backend = getattr(tok, "_tokenizer", None)
    if (
        backend is None
        or not isinstance(tok, TokenizersBackend)
        or type(tok).__call__ is not PreTrainedTokenizerBase.__call__
        or type(tok)._encode_plus is not TokenizersBackend._encode_plus
        or backend.truncation is not None
        or backend.padding is not None
        or backend.encode_special_tokens != bool(getattr(tok, "split_special_tokens", False))
    ):
        return None
    return backend


def _char_to_token(starts: list[int], text_len: int, char: int, where: str) -> int:
    """Index of the token that starts exactly at ``char`` (len(tokens) for the end of the text)."""
    if char == text_len:
        return len(starts)
    lo, hi = 0, len(starts)
    while lo < hi:
        mid = (lo + hi) // 2
        if starts[mid] < char:
            lo = mid + 1
        else:
            hi = mid
    if lo == len(starts) or starts[lo] != char:
        raise TraceError("template_mismatch", where, f"no token boundary at character {char}")
    return lo


def encode_conversation(processor, messages: list[dict], tools: list[dict] | None) -> Encoded:
    """Render and tokenise ``messages``; mark the assistant tokens to train on.

    Raises :class:`TraceError` (``template_mismatch``) if the chat template does not render
    conversations prefix by prefix, or if a trained span does not fall on token boundaries.
    """
    text = render(processor, messages, tools)
    prefix = _PrefixRenderer(processor, messages, tools, text)
    input_ids, starts = _ids_and_starts(_tokenizer(processor), text)
    mask = [0] * len(input_ids)
    a_starts, a_ends, a_index = [], [], []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        where = f"messages[{i}]"
        before = prefix(i) if i else ""
        header_end = prefix(i, add_generation_prompt=True)
        after = prefix(i + 1)
        if not (text.startswith(after) and after.startswith(header_end) and header_end.startswith(before)):
            raise TraceError("template_mismatch", where, "the chat template does not render this conversation prefix by prefix")
        if not after.endswith("\n"):
            raise TraceError("template_mismatch", where, "an assistant turn does not end with '<|im_end|>\\n'")
        first = _char_to_token(starts, len(text), len(header_end), where)
        last = _char_to_token(starts, len(text), len(after) - 1, where)  # the closing "\n" stays context
        mask[first:last] = [1] * max(0, last - first)
        a_starts.append(_char_to_token(starts, len(text), len(before), where))
        a_ends.append(_char_to_token(starts, len(text), len(after), where))
        a_index.append(i)
    return Encoded(text, input_ids, mask, a_starts, a_ends, a_index)


def encode_ids(processor, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """``encode_conversation(...).input_ids`` without the prefix renders that the masks need.

    For checks that only compare token ids (a split window re-rendered on its own, say): one render
    and one tokenisation instead of three renders per assistant turn. Unlike ``encode_conversation``
    it does not check that the template renders prefix by prefix.
    """
    return _ids_and_starts(_tokenizer(processor), render(processor, messages, tools))[0]


class _PrefixRenderer:
    """``render(processor, messages[:k], tools, add_generation_prompt)``, each distinct prefix once, fast.

    ``processor.apply_chat_template`` converts the whole conversation and every tool schema to plain
    template data and parses the template on every call, which costs more than the Jinja render itself
    and, over all prefixes, grows with the square of the number of turns. Here the conversation goes
    through the same transformers steps once (``_normalize_conversations``, ``_plain_template_data``,
    ``_alias_reasoning_fields``), and each prefix is a slice of it handed to the same compiled
    template with the same arguments. Those steps work message by message, so a slice of the
    converted conversation is the converted slice.

    The fast path is checked on every conversation: the full conversation rendered this way must
    equal ``text`` (from ``processor.apply_chat_template``). Where it does not, where it is not
    available (a processor that overrides ``apply_chat_template``, a bare tokenizer, other
    transformers internals), or where it raises, ``render`` itself is used, so the results (and errors)
    are always those of ``render``.
    """

    def __init__(self, processor, messages: list[dict], tools: list[dict] | None, text: str):
        self.processor, self.messages, self.tools = processor, messages, tools
        self.cache: dict[tuple[int, bool], str] = {(len(messages), False): text}
        self.fast = None
        self.tojson_memo: dict = {}
        try:
            self.fast = _fast_setup(processor, messages, tools)
        except Exception:  # noqa: BLE001 - any surprise in transformers internals: use render()
            self.fast = None
        if self.fast is not None and self._fast_render(len(messages), False) != text:
            self.fast = None

    def _fast_render(self, k: int, add_generation_prompt: bool) -> str | None:
        compiled, chat, tool_schemas, template_kwargs = self.fast
        token = _TOJSON_MEMO.set(self.tojson_memo)
        try:
            return compiled.render(
                messages=chat[:k],
                tools=tool_schemas,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **template_kwargs,
            )
        except Exception:  # noqa: BLE001 - let render() raise its own error, or succeed
            return None
        finally:
            _TOJSON_MEMO.reset(token)

    def __call__(self, k: int, add_generation_prompt: bool = False) -> str:
        key = (k, add_generation_prompt)
        out = self.cache.get(key)
        if out is None:
            if self.fast is not None and k > 0:
                out = self._fast_render(k, add_generation_prompt)
            if out is None:
                out = render(self.processor, self.messages[:k], self.tools, add_generation_prompt=add_generation_prompt)
            self.cache[key] = out
        return out


def _fast_setup(processor, messages: list[dict], tools: list[dict] | None):
    """The compiled template and the converted conversation, as ``ProcessorMixin.apply_chat_template``
    (transformers 5) builds them for ``tokenize=False`` without extra kwargs; None where it does not apply."""
    from transformers.processing_utils import ProcessorMixin
    from transformers.utils import chat_template_utils as ctu

    if not messages or getattr(type(processor), "apply_chat_template", None) is not ProcessorMixin.apply_chat_template:
        return None
    tools = tools or None
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        return None
    template = processor._resolve_chat_template(None)
    conversations, is_batched = processor._normalize_conversations(messages)
    if is_batched:
        return None
    chat = ctu._plain_template_data(conversations[0])
    if not all(isinstance(m, dict) for m in chat):
        return None
    chat = ctu._alias_reasoning_fields(chat)
    tool_schemas = ctu._plain_template_data(list(tools) if tools is not None else None)
    template_kwargs = ctu._plain_template_data({**processor.tokenizer.special_tokens_map})
    return _memo_template(template), chat, tool_schemas, template_kwargs


# Within one conversation every prefix renders the same tool schemas (and the same tool-call
# arguments) through ``tojson``; the memo keeps each result for the conversation's renders. Keys
# are object ids, and each entry holds its object, so an id cannot be reused while it is cached.
_TOJSON_MEMO: ContextVar[dict | None] = ContextVar("eogym_sft_tojson_memo", default=None)


@lru_cache(maxsize=8)
def _memo_template(template: str):
    """``template`` compiled in an overlay of transformers' chat-template environment (same sandbox,
    options, globals and extensions) whose ``tojson`` filter is the original one, memoised."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    env = _compile_jinja_template(template).environment.overlay()
    base = env.filters["tojson"]

    def tojson(x, *args, **kwargs):
        memo = _TOJSON_MEMO.get()
        if memo is None or type(x) not in (dict, list):
            return base(x, *args, **kwargs)
        try:
            key = (id(x), args, tuple(sorted(kwargs.items())))
            hash(key)
        except TypeError:  # e.g. separators given as a list
            return base(x, *args, **kwargs)
        hit = memo.get(key)
        if hit is not None and hit[0] is x:
            return hit[1]
        out = base(x, *args, **kwargs)
        memo[key] = (x, out)
        return out

    env.filters = {**env.filters, "tojson": tojson}
    return env.from_string(template)
