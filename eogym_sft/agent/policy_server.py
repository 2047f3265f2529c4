"""A policy behind an OpenAI-compatible ``/chat/completions`` server (vLLM, SGLang, OpenAI, Gemini's
OpenAI endpoint) as a rollout arm: the same episodes, tools, judge and report as a local model.

Each turn sends the whole conversation so far: the row's system prompt and question, the row's own
tools in the request's ``tools``, every image as a PNG data URL resized under the processor's pixel cap
(the pixels a local arm sees), earlier assistant turns with their ``tool_calls`` and the tool results
with their images. A reply's ``tool_calls`` become ``<tool_call>`` blocks of the assistant text, so
:meth:`~eogym_sft.agent.episodes.Episode.take_turn` reads them and plain-text calls with the same
parser as data prep. ``finish_reason == "length"`` is a truncated turn.

Network rules: http(s) only; a redirect is an error naming its target (never followed); one deadline
per call, retries and a trickling reply included; replies larger than ``max_response_bytes`` are
refused; 429, 5xx, timeouts and dropped connections are retried, other errors are not. A failed call
ends its episode in ``error`` with a :class:`PolicyError` named in the record; the run goes on (and the
episode is left out of Pass@k, counted by code). The API key is read from the environment variable
``api_key_env`` at request time and never recorded (:func:`eogym_sft.net.redact` scrubs it, and any URL
credentials, from every error). A reply's ``usage.completion_tokens`` is counted only when it is an integer
in ``[0, MAX_USAGE_TOKENS]``; any other value is dropped and counted (``usage_dropped``). Ctrl-C stops at once:
no new episode starts, the calls in flight are cut off (:class:`eogym_sft.net.Cancel`), their episodes are
not recorded (a rerun runs them), and the log keeps only whole records. Stdlib only (``http.client`` and threads).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, fields
from pathlib import Path
from urllib.parse import urlsplit

from .. import net
from ..config import check_types
from ..safe_json import UntrustedJSONError, loads, loads_object
from ..data.images import ImageCache, load_rgb, resolve_image_path
from ..data.traces import parse_tool_call_text
from ..models.layout import image_factor
from .episodes import Episode, LoopConfig, canonical_prompt

TOOL_IMAGE_MODES = ("tool", "user")
NET_CODES = {  # eogym_sft.net's errors as the codes a policy error is counted by
    net.RedirectRefused: "redirect", net.DeadlineExceeded: "timeout", net.ResponseTooLarge: "too_large",
    net.HTTPStatusError: "http_status", net.BadResponse: "bad_json", net.Cancelled: "cancelled",
}
MAX_USAGE_TOKENS = 1 << 24  # a turn's completion tokens past this are no count a server means
# Settings that change how a run is carried out, not what it produces (a resumed run may change them).
TRANSPORT_FIELDS = ("concurrency", "deadline_s", "retries", "backoff_s")


class PolicyError(RuntimeError):
    """A policy-server call that failed; ``code`` is one of redirect, http_status, timeout, connection,
    too_large, bad_json, bad_reply."""

    def __init__(self, code: str, detail: str, retry: bool = False):
        super().__init__(f"{code}: {detail}")
        self.code, self.retry = code, retry


@dataclass(kw_only=True)
class PolicyServer:
    """One policy arm behind a chat-completions endpoint (``--policy-url``, ``--policy-model``,
    ``--policy-config``).

    Args:
        url: the full endpoint, e.g. ``http://localhost:8000/v1/chat/completions``.
        model: the ``model`` field of each request (for vLLM the served or LoRA module name).
        name: the arm's name in the report (default: ``model``).
        api_key_env: environment variable holding the bearer token (none sent when unset or empty).
        concurrency: requests in flight (episodes run at once against this server).
        deadline_s: seconds one call may take, its retries and pauses included.
        retries: further attempts after a retryable failure, pausing ``backoff_s * 2**k``.
        max_response_bytes: a larger reply is refused (``too_large``).
        tool_images_as: ``tool``: a tool result's images go in the tool message (what Qwen3-VL's
            template renders and the adapter was trained on; vLLM and SGLang accept it); ``user``: the
            tool message holds the text and a user message after it the images (OpenAI and Gemini
            accept images only from the user).
        max_tokens_field: ``max_tokens`` or ``max_completion_tokens`` (OpenAI's reasoning models).
        body: further request fields, e.g. ``{"chat_template_kwargs": {"enable_thinking": false}}``.
    """

    url: str
    model: str
    name: str | None = None
    api_key_env: str | None = None
    concurrency: int = 8
    deadline_s: float = 300.0
    retries: int = 2
    backoff_s: float = 1.0
    max_response_bytes: int = 8 * 2**20
    tool_images_as: str = "tool"
    max_tokens_field: str = "max_tokens"
    body: dict = field(default_factory=dict)

    def __post_init__(self):
        self.name = self.name or self.model
        check_types(self, "policy setting")  # from --policy-config JSON: "8", true or Infinity where a number is meant
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--policy-url must be an http(s) URL with a host, got {self.url!r}")
        if (
            self.concurrency < 1
            or self.retries < 0
            or self.deadline_s <= 0
            or self.backoff_s < 0
            or self.max_response_bytes < 1
        ):
            raise ValueError("policy concurrency and max_response_bytes must be >= 1, retries and backoff_s >= 0, "
                             "deadline_s > 0")
        if self.tool_images_as not in TOOL_IMAGE_MODES:
            raise ValueError(f"tool_images_as must be one of {TOOL_IMAGE_MODES}, got {self.tool_images_as!r}")
        if not isinstance(self.body, dict) or {"messages", "tools", "model"} & set(self.body):
            raise ValueError("policy body must be an object of extra request fields (not messages, tools or model)")

    def headers(self) -> dict:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return headers


def policy_servers(urls: list[str], models: list[str], configs: list[str]) -> list[PolicyServer]:
    """Pair the i-th ``--policy-url`` with the i-th ``--policy-model`` (``[ARM=]MODEL``); one
    ``--policy-config`` applies to every server, else one per server. A config is a JSON object or
    the path of a file holding one; an unknown key is an error naming it."""
    if len(urls) != len(models):
        raise ValueError(f"give one --policy-model per --policy-url (got {len(urls)} URLs, {len(models)} models)")
    if len(configs) not in (0, 1, len(urls)):
        raise ValueError(f"give one --policy-config for all servers or one per server, got {len(configs)} for "
                         f"{len(urls)}")
    configs = configs * len(urls) if len(configs) == 1 else configs or [None] * len(urls)
    servers = []
    for url, model, config in zip(urls, models, configs):
        name, sep, served = model.partition("=")
        settings = _read_config(config) if config else {}
        known = {f.name for f in fields(PolicyServer)} - {"url", "model", "name"}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ValueError(f"--policy-config: unknown key(s) {unknown}; known: {', '.join(sorted(known))}")
        servers.append(PolicyServer(url=url, model=served if sep else model, name=name if sep else None, **settings))
    return servers


def _read_config(text: str) -> dict:
    source = "--policy-config"
    if not text.lstrip().startswith("{"):
        source, text = text, Path(text).read_text()
    return loads_object(text, source, "a policy server's settings")


# ---------------------------------------------------------------- the wire


def post_json(server: PolicyServer, body: dict, cancel: net.Cancel | None = None) -> dict:
    """POST ``body`` to ``server.url`` through :func:`eogym_sft.net.post_json` (http(s) only, no redirects, one
    deadline with retries, a reply cap); the reply's JSON object, or :class:`PolicyError` naming why not."""
    try:
        payload = net.post_json(
            server.url, body, server.headers(), server.deadline_s, server.max_response_bytes, server.retries,
            server.backoff_s, cancel
        )
    except net.NetError as err:
        raise PolicyError(NET_CODES.get(type(err), "connection"), str(err)) from None
    if not isinstance(payload, dict):
        raise PolicyError("bad_json", f"the reply is JSON but not an object: {str(payload)[:80]!r}")
    return payload


# ---------------------------------------------------------------- requests and replies


def capped_size(processor, width: int, height: int) -> tuple[int, int]:
    """``(width, height)`` the processor resizes an image to (its pixel cap and patch grid)."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    ip = processor.image_processor
    h, w = smart_resize(height, width, factor=image_factor(processor), min_pixels=ip.size["shortest_edge"],
                        max_pixels=ip.size["longest_edge"])
    return w, h


def data_url(processor, path) -> str:
    """A PNG data URL of the image at ``path`` at the size the processor gives it."""
    from PIL import Image

    image = load_rgb(path)
    size = capped_size(processor, *image.size)
    if size != image.size:
        image = image.resize(size, Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def data_url_cache(processor, budget: int = 2 * 2**30) -> ImageCache:
    """Data URLs by resolved path: every turn resends the conversation's images."""
    return ImageCache(budget, load=lambda path: data_url(processor, path), cost=len)


def _assistant_calls(message: dict) -> tuple[str, list[dict]]:
    """An assistant turn's text and calls: its ``tool_calls``, or, for a turn kept as generated (its
    ``<tool_call>`` blocks in the text, how an episode's own turns come back), the blocks parsed out."""
    if message.get("tool_calls"):
        return message["content"], [c["function"] for c in message["tool_calls"]]
    text, calls = parse_tool_call_text(message["content"] or "", "assistant")
    return text, [c["function"] for c in calls]


def api_messages(trace, urls: list[str], tool_images_as: str = "tool") -> list[dict]:
    """A canonical conversation (:func:`~eogym_sft.agent.episodes.canonical_prompt`) as
    chat-completions messages; ``urls`` are the data URLs of ``trace.images`` in order."""
    urls, out, pending = iter(urls), [], []
    for turn, m in enumerate(trace.messages):
        role = m["role"]
        if role == "system":
            out.append({"role": "system", "content": m["content"]})
        elif role == "assistant":
            content, found = _assistant_calls(m)
            calls = [
                {"id": f"call_{turn}_{k}", "type": "function",
                 "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
                for k, c in enumerate(found)
            ]
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            pending = [c["id"] for c in calls]
            out.append(message)
        else:
            parts = [_api_part(p, urls) for p in m["content"]]
            if role == "user":
                out.append({"role": "user", "content": parts})
                continue
            call_id = pending.pop(0) if pending else f"call_{turn}"
            text = "".join(p["text"] for p in parts if p["type"] == "text")
            images = [p for p in parts if p["type"] == "image_url"]
            if tool_images_as == "tool" and images:
                out.append({"role": "tool", "tool_call_id": call_id, "content": parts})
            else:
                out.append({"role": "tool", "tool_call_id": call_id, "content": text})
                if images:
                    out.append({"role": "user", "content": images})
    return out


def _api_part(part: dict, urls) -> dict:
    if part["type"] == "image":
        return {"type": "image_url", "image_url": {"url": next(urls)}}
    return {"type": "text", "text": part["text"]}


def chat_request(server: PolicyServer, trace, urls: list[str], sampling, max_new_tokens: int,
                 seed: int | None) -> dict:
    """The request body of one turn."""
    body = {"model": server.model, "messages": api_messages(trace, urls, server.tool_images_as)}
    if trace.tools:
        body["tools"] = trace.tools
    body["temperature"] = sampling.temperature
    if sampling.temperature > 0:
        body["top_p"] = sampling.top_p
        if sampling.top_k:
            body["top_k"] = sampling.top_k  # vLLM and SGLang read it; OpenAI ignores unknown sampling fields
        if seed is not None:
            body["seed"] = seed
    body[server.max_tokens_field] = max_new_tokens
    return {**body, **server.body}


def reply_turn(payload: dict) -> tuple[str, bool, int | None]:
    """``(text, truncated, completion_tokens)`` of a chat-completions reply: the message's text with
    each of its ``tool_calls`` appended as a ``<tool_call>`` block; :class:`PolicyError` (bad_reply)
    when the reply has no message. ``completion_tokens`` is 0 when the reply has no ``usage`` count and
    ``None`` when its count is no integer in ``[0, MAX_USAGE_TOKENS]`` (dropped: a summary sums them)."""
    try:
        choice = payload["choices"][0]
        message = choice["message"]
        if not isinstance(message, dict):
            raise TypeError("message is not an object")
    except (KeyError, IndexError, TypeError) as err:
        raise PolicyError("bad_reply", f"no choices[0].message in the reply ({type(err).__name__}: {err})") from None
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    text = content if isinstance(content, str) else ""
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise PolicyError("bad_reply", f"tool_calls is {type(calls).__name__}, not a list")
    blocks = [_call_block(c) for c in calls]
    text = "\n".join(part for part in [text.strip(), *blocks] if part)
    usage = payload.get("usage") if isinstance(payload.get("usage"), dict) else {}
    tokens = usage.get("completion_tokens", 0)
    valid = type(tokens) is int and 0 <= tokens <= MAX_USAGE_TOKENS  # not bool, not 1e30
    return text, choice.get("finish_reason") == "length", tokens if valid else None


def _call_block(call) -> str:
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        return "<tool_call>\nnot an object\n</tool_call>"  # take_turn counts it as an invalid call
    arguments = fn.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = loads(arguments) if arguments.strip() else {}
        except UntrustedJSONError:
            pass  # kept as the string: data prep's parser names it invalid_tool_arguments
    return "<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": arguments},
                                        ensure_ascii=False) + "\n</tool_call>"


def request_seed(seed: int, question_id: str, sample: int) -> int:
    """A per-episode seed: samples of a question differ, a rerun repeats them."""
    digest = hashlib.sha256(f"{seed}:{question_id}:{sample}".encode()).digest()
    return int.from_bytes(digest[:4], "big") >> 1


# ---------------------------------------------------------------- episodes


def run_policy_episode(
    server: PolicyServer, ep: Episode, processor, urls: ImageCache, sampling, loop: LoopConfig, data_root,
    cancel: net.Cancel | None = None, usage_dropped: list | None = None,
) -> Episode:
    """Run ``ep`` to its end against ``server``; a failure ends it in ``error``, named. A reply's usage count
    that is dropped (:func:`reply_turn`) appends the episode's id to ``usage_dropped``."""
    try:
        while ep.stop is None:
            if cancel is not None and cancel.is_set():
                raise PolicyError("cancelled", "the run was interrupted")
            trace = canonical_prompt(ep.row, loop.tool_images)
            images = [urls.get(resolve_image_path(rel, data_root)) for rel in trace.images]
            ep.images_seen = list(trace.images)
            seed = request_seed(loop.seed, ep.question_id, ep.sample) + ep.turns
            payload = post_json(server, chat_request(server, trace, images, sampling, loop.max_new_tokens, seed),
                                cancel)
            text, truncated, tokens = reply_turn(payload)
            if tokens is None and usage_dropped is not None:
                usage_dropped.append(f"{ep.question_id}:{ep.arm}:{ep.sample}")
            ep.new_tokens += tokens or 0
            if not ep.take_turn(text, truncated, loop.max_turns):
                break
    except Exception as err:  # one episode's bad reply, image or tool must not end the run
        ep.fail(err)
    return ep


def run_policy_episodes(server: PolicyServer, processor, episodes, sampling, loop: LoopConfig, data_root, on_done,
                        bar=None) -> dict:
    """Run every episode of ``episodes``, ``server.concurrency`` at a time; ``on_done(episode)`` runs in
    this thread as each ends. Returns ``{"seconds", "new_tokens", "usage_dropped"}`` (tokens as the server's
    ``usage`` counts them; replies whose count was dropped). Interrupted (Ctrl-C), it starts nothing more, cuts
    off the calls in flight, records none of their episodes and raises within a second."""
    urls = data_url_cache(processor)
    stats = {"seconds": 0.0, "new_tokens": 0}
    start = time.perf_counter()
    items = iter(episodes)
    cancel, dropped = net.Cancel(), []

    def finish(ep: Episode) -> None:
        stats["new_tokens"] += ep.new_tokens
        on_done(ep)
        if bar is not None:
            bar.update(1)

    pool = ThreadPoolExecutor(max_workers=server.concurrency)
    try:
        running = set()
        while True:
            while len(running) < server.concurrency:
                ep = next(items, None)
                if ep is None:
                    break
                if ep.stop is not None:  # failed before it began (its environment)
                    finish(ep)
                    continue
                running.add(pool.submit(run_policy_episode, server, ep, processor, urls, sampling, loop, data_root,
                                        cancel, dropped))
            if not running:
                break
            # a timeout: the main thread comes back to take a Ctrl-C that the OS gave to another thread
            finished, running = wait(running, timeout=0.25, return_when=FIRST_COMPLETED)
            for future in finished:
                finish(future.result())
    except BaseException:
        cancel.cancel()  # the episodes in flight end at once, as errors that are not recorded
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    stats["seconds"] = time.perf_counter() - start
    stats["usage_dropped"] = len(dropped)
    return stats
