"""Closed-loop episodes: the model answers, its tool calls run in the environment, their results come
back, until ``Final Answer:`` or a limit.

An episode keeps its conversation as an EO-Gym row (the form ``eogym-sft prepare`` reads) and renders
its next prompt from that row through :func:`eogym_sft.data.traces.normalize_row` and the chat template,
exactly as data prep renders a training sample; :class:`~eogym_sft.agent.decoder.SlotDecoder` then
recomputes only what the cache does not hold yet. :func:`run_episodes` keeps every slot busy: an
episode that ends frees its slot for the next one at once.

How a turn ends (``stop`` of a finished episode):

* ``final_answer``: a ``Final Answer:`` and no tool call;
* ``no_call``: neither a tool call nor a final answer;
* ``invalid_call``: a ``<tool_call>`` block that does not parse (its text is kept; prep would refuse it);
* ``max_new_tokens``: the turn hit the token limit before ``<|im_end|>``;
* ``max_turns``: tool calls still pending after the last allowed turn;
* ``context_full``: the next prompt plus a turn's tokens would not fit a slot;
* ``error``: something in this episode failed (an image that does not decode, ...); ``error`` names it.
"""

from __future__ import annotations

import json
import time
import warnings
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..config import TOOL_IMAGES
from ..data.encoding import render
from ..data.images import ImageCache, load_rgb, resolve_image_path
from ..data.traces import normalize_row
from ..metrics.scoring import END_MARKERS, parse_output, strip_end_markers
from ..models.layout import expand_image_pads
from .decoder import SlotDecoder
from .image_inputs import ImageInput, image_input
from .piece_tokenizer import PieceTokenizer
from .sampling import Sampling, vision_token_ids


def question_messages(row: dict) -> list[dict]:
    """The row's messages before its first assistant turn: system and question (a whole question-only row)."""
    messages = row.get("messages")
    if not isinstance(messages, list):
        return messages  # normalize_row names the problem
    first = next((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"),
                 len(messages))
    return messages[:first]


# Preprocessed images shared by the episodes of a run, in bytes of pixel values (a capped image is about
# 24 MB): the samples of one question and their common crops are decoded and resized once.
PICTURE_CACHE_BYTES = 4 * 2**30


def picture_cache(processor, budget: int = PICTURE_CACHE_BYTES) -> ImageCache:
    """An :class:`~eogym_sft.data.images.ImageCache` of :class:`~eogym_sft.agent.image_inputs.ImageInput` by resolved
    path."""
    return ImageCache(
        budget,
        load=lambda path: image_input(processor, load_rgb(path)),
        cost=lambda picture: picture.pixel_values.numel() * picture.pixel_values.element_size(),
    )


def canonical_prompt(row: dict, tool_images=TOOL_IMAGES):
    """The normalised conversation of ``row`` up to the assistant turn to generate next, as a
    :class:`~eogym_sft.data.traces.Trace` (prep's own normalisation: the rendering matches SFT's)."""
    messages = row.get("messages")
    if isinstance(messages, list):
        messages = messages + [{"role": "assistant", "content": ""}]  # normalize_row wants a turn to end on
    trace = normalize_row({**row, "messages": messages}, tool_images)
    trace.messages = trace.messages[:-1]
    return trace


@dataclass
class Episode:
    """One closed-loop attempt at one row by one arm; ``row`` grows turn by turn in EO-Gym form."""

    source: str  # file:line of the question
    question_id: str
    arm: str
    sample: int
    row: dict
    env: object
    turns: int = 0
    calls: int = 0
    skipped_calls: int = 0  # calls past the environment's max_calls_per_turn, not run
    tool_errors: int = 0
    tool_error_codes: dict = field(default_factory=dict)
    new_tokens: int = 0
    stop: str | None = None
    error: str | None = None
    final_answer: str | None = None
    images_seen: list[str] = field(default_factory=list)
    # per assistant turn, the token ids sampled (end token included)
    sampled_ids: list[list[int]] = field(default_factory=list)
    slot: int | None = None  # the decoder slot the episode ran in (run_episodes): its picks are that slot's
    _pictures: dict = field(default_factory=dict, repr=False)
    _ahead: dict = field(default_factory=dict, repr=False)  # rel -> Future of its picture, started by preload

    def prompt(
        self, processor, data_root, tool_images=TOOL_IMAGES, pictures: ImageCache | None = None,
        tokens: PieceTokenizer | None = None
    ) -> tuple[list[int], list[ImageInput]]:
        """The token ids (image pads expanded) and images of the next prompt; images come from ``pictures``
        (a :func:`picture_cache` shared by the run's episodes; by default one of this call's own), ids from
        ``tokens`` (a :class:`PieceTokenizer` shared alike; by default the tokenizer itself)."""
        trace = canonical_prompt(self.row, tool_images)
        text = render(processor, trace.messages, trace.tools, add_generation_prompt=True)
        pictures = pictures or picture_cache(processor)
        images = [self._picture(pictures, rel, data_root) for rel in trace.images]
        self.images_seen = list(trace.images)
        ids = tokens(text) if tokens is not None else processor.tokenizer(text, add_special_tokens=False)["input_ids"]
        return expand_image_pads(ids, [im.tokens for im in images],
                                 processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")), images

    def preload(self, pictures: ImageCache, data_root, tool_images=TOOL_IMAGES, pool=None) -> None:
        """Decode and preprocess the next prompt's images ahead of :meth:`prompt`: now, or with ``pool`` started there,
        one task an image (so that one episode's images decode side by side), each taken by :meth:`prompt` as it is
        ready. Called from the thread that calls :meth:`prompt`; a failure here shows again, named, when it runs."""
        try:
            for rel in canonical_prompt(self.row, tool_images).images:
                if pool is None:
                    self._picture(pictures, rel, data_root)
                elif rel not in self._pictures and rel not in self._ahead:
                    self._ahead[rel] = pool.submit(pictures.get, resolve_image_path(rel, data_root))
        except Exception:
            return

    def _picture(self, pictures: ImageCache, rel: str, data_root) -> ImageInput:
        # Held here too, so the shared cache may drop it while this episode still needs it.
        if rel not in self._pictures:
            picture = self._ready(rel)
            self._pictures[rel] = picture if picture is not None else pictures.get(resolve_image_path(rel, data_root))
        return self._pictures[rel]

    def _ready(self, rel: str) -> ImageInput | None:
        """The preloaded picture of ``rel`` if its task has finished well. Otherwise None: the caller asks the
        cache, which waits for a load in flight or loads it here (rather than idle while the task waits its
        turn), the same object either way; a failed task's error is raised again by that load."""
        ahead = self._ahead.pop(rel, None)
        if ahead is None or not ahead.done() or ahead.exception() is not None:
            return None
        return ahead.result()

    def take_turn(self, text: str, truncated: bool, max_turns: int) -> bool:
        """Record the model's message ``text``; run its tool calls. True when the episode goes on."""
        self.turns += 1
        body = strip_end_markers(text)
        parsed = parse_output(text)
        generated = _before_end_marker(text)
        if truncated:  # cut off mid-message: kept as text, marked so that prep never trains it as a whole turn
            self.row["messages"].append({"role": "assistant", "content": body, "generated": generated,
                                         "truncated": True})
            return self.stop_with("max_new_tokens")
        if parsed.errors:
            self.row["messages"].append({"role": "assistant", "content": body, "generated": generated})
            self.tool_errors += len(parsed.errors)
            self._count_error("invalid_call", len(parsed.errors))
            return self.stop_with("invalid_call")
        calls = [c for c in parsed.calls if c is not None]
        message = {"role": "assistant", "content": parsed.content if calls else body, "generated": generated}
        if calls:
            message["tool_calls"] = [
                {"type": "function",
                 "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
                for c in calls
            ]
        self.row["messages"].append(message)
        if not calls:
            self.final_answer = parsed.final_answer
            return self.stop_with("final_answer" if parsed.final_answer is not None else "no_call")
        results = self.env.call_turn(calls)  # at most the environment's max_calls_per_turn are run
        run = [r for r in results if r.error != "too_many_calls"]
        self.calls += len(run)
        self.skipped_calls += len(calls) - len(run)
        for result in results:
            if not result.ok and result.error != "too_many_calls":
                self.tool_errors += 1
                self._count_error(result.error or "unknown")
            self.row["messages"].append({"role": "tool", "content": result.text})
        if self.turns >= max_turns:
            return self.stop_with("max_turns")
        return True

    def _count_error(self, code: str, n: int = 1) -> None:
        self.tool_error_codes[code] = self.tool_error_codes.get(code, 0) + n

    def stop_with(self, reason: str) -> bool:
        self.stop = reason
        return False

    def fail(self, err: BaseException) -> None:
        self.stop, self.error = "error", f"{type(err).__name__}: {err}"

    def record(self) -> dict:
        """The episode as one EO-Gym JSONL row (``eogym-sft prepare`` reads it as it is) plus its outcome."""
        self._pictures.clear()
        self._ahead.clear()
        return {
            **self.row,
            "id": f"{self.question_id}:{self.arm}:{self.sample}",
            "source_id": self.question_id,
            "source": self.source,
            "arm": self.arm,
            "sample": self.sample,
            "stop_reason": self.stop,
            "error": self.error,
            "turns": self.turns,
            "tool_calls": self.calls,
            "skipped_calls": self.skipped_calls,
            "tool_errors": self.tool_errors,
            "tool_error_codes": self.tool_error_codes,
            "new_tokens": self.new_tokens,
            "final_answer": self.final_answer,
            "images_seen": self.images_seen,
        }


def _before_end_marker(text: str) -> str:
    """The turn's text as generated, without the one end-of-turn marker that closed it."""
    for marker in END_MARKERS:
        if text.endswith(marker):
            return text[: -len(marker)]
    return text


def new_episode(row: dict, source: str, arm: str, sample: int, env) -> Episode:
    """An episode starting from ``row``'s question (any gold trajectory after it is left out)."""
    start = {k: v for k, v in row.items() if k != "messages"}
    start["messages"] = [dict(m) for m in question_messages(row)]
    return Episode(source, str(row.get("id")), arm, sample, start, env)


@dataclass
class LoopConfig:
    """Limits of a closed-loop run."""

    max_turns: int = 8
    max_new_tokens: int = 512
    tool_images: str = TOOL_IMAGES  # which tool-result images the model sees: data prep's rule (a ToolImageRule spec)
    seed: int = 0


def run_episodes(
    decoder: SlotDecoder, processor, episodes, sampling: Sampling, cfg: LoopConfig, data_root, on_done, bar=None,
    pictures=None
) -> dict:
    """Run every episode of the iterable ``episodes`` to its end, ``decoder.slots`` at a time.

    ``on_done(episode)`` is called as each one ends (in completion order). The images of the next
    ``decoder.slots`` pending episodes are decoded by worker threads while the GPU works. Returns timing:
    ``{"seconds", "new_tokens", "decode_steps", "prefill_tokens"}``, ``prefill_retries`` (batched prefills that
    failed and were retried slot by slot, each warned) and where the seconds went: ``prefill_s``
    (prefills, vision encoding included, to their first token), ``decode_s`` (decode steps to their sampled
    tokens), ``tool_s`` (turns parsed and tools run) and ``other_s`` (the rest: prompts rendered and tokenised, slots
    refilled). Reading a sampled token waits for the GPU, so each share is the GPU's time plus the host's around it,
    with no added synchronisation. ``pictures`` (a :func:`picture_cache`) lets
    the caller read the decoded images afterwards (GRPO does); by default the run has its own.
    """
    decoder.check_weights()  # the arm and weights as they are now: merged LoRA weights refilled, stale graphs dropped
    return EpisodeLoop(decoder, processor, sampling, cfg, data_root, on_done, bar, pictures).run(episodes)


@dataclass
class Slot:
    """What one of the decoder's slots holds in a run of episodes."""

    episode: Episode | None = None
    turn: list[int] | None = None  # tokens of the turn so far (the last one not yet in the cache)
    goes_on: bool | None = None  # set when its turn ended this step: whether the episode goes on after it


class EpisodeLoop:
    """One run of :func:`run_episodes`: the slots, each with its episode and turn, refilled as episodes end."""

    def __init__(self, decoder: SlotDecoder, processor, sampling: Sampling, cfg: LoopConfig, data_root, on_done,
                 bar=None, pictures=None):
        import torch

        self.decoder, self.processor, self.sampling, self.cfg = decoder, processor, sampling, cfg
        self.data_root, self.on_done, self.bar = data_root, on_done, bar
        self.tokenizer = processor.tokenizer
        self.stop_ids = [self.tokenizer.convert_tokens_to_ids(m) for m in END_MARKERS]
        self.banned_ids = vision_token_ids(self.tokenizer)
        self.generator = torch.Generator(device=decoder.device).manual_seed(cfg.seed)
        self.pictures = picture_cache(processor) if pictures is None else pictures
        self.pieces = PieceTokenizer(self.tokenizer)
        self.slots = [Slot() for _ in range(decoder.slots)]
        self.stats = {"seconds": 0.0, "new_tokens": 0, "decode_steps": 0, "prefill_tokens": 0, "prefill_s": 0.0,
                      "decode_s": 0.0, "tool_s": 0.0, "prefill_retries": 0}
        self.pool = self.pending = None
        self.start = 0.0

    def run(self, episodes) -> dict:
        """Run every episode of ``episodes``; the timing :func:`run_episodes` returns."""
        self.pool = ThreadPoolExecutor(max_workers=4)
        try:
            self.pending = _prefetched(episodes, self.preload, len(self.slots))
            self.start = time.perf_counter()
            while True:
                started = self.start_turns()
                busy = [s for s, slot in enumerate(self.slots) if slot.episode is not None]
                if not busy:
                    if started:  # every turn that began failed: their slots take the next episodes
                        continue
                    break
                self.decode(busy)
        finally:
            self.pool.shutdown()
        stats = self.stats
        stats["seconds"] = time.perf_counter() - self.start
        stats["other_s"] = stats["seconds"] - stats["prefill_s"] - stats["decode_s"] - stats["tool_s"]
        return stats

    def preload(self, ep: Episode) -> None:
        ep.preload(self.pictures, self.data_root, self.cfg.tool_images, self.pool)

    def start_turns(self) -> bool:
        """End the turns that finished, then start the slots' next turns (refilled slots included), prefilled in
        batches of ``prefill_tokens`` new tokens; True when any prefill ran."""
        prompts, queued, started = {}, 0, False
        self.end_turns()
        for s in range(len(self.slots)):
            prompt = self.settle(s)
            if prompt is None:
                continue
            prompts[s] = prompt
            queued += self.decoder.new_tokens(*prompt)
            # the GPU starts on these while the workers decode the next images
            if queued >= self.decoder.prefill_tokens:
                self.begin_turns(prompts)
                prompts, queued, started = {}, 0, True
        if prompts:
            self.begin_turns(prompts)
            started = True
        return started

    def decode(self, busy: list[int]) -> None:
        """One decode step of the ``busy`` slots and one sampled token each."""
        began = time.perf_counter()
        order, logits = self.decoder.decode({s: self.slots[s].turn[-1] for s in busy})
        picks = self.sampling.pick(logits, [len(self.slots[s].turn) for s in order], self.stop_ids, self.generator,
                                   self.banned_ids)
        self.stats["decode_s"] += time.perf_counter() - began
        for s, tok in zip(order, picks):
            self.slots[s].turn.append(tok)
        self.stats["decode_steps"] += 1

    def next_prompt(self, ep: Episode):
        """The token ids and images ``ep``'s next turn starts from; None when the episode ends here instead."""
        try:
            ids, images = ep.prompt(self.processor, self.data_root, self.cfg.tool_images, self.pictures, self.pieces)
        except Exception as err:  # one episode's bad image or template error must not end the run
            ep.fail(err)
            return None
        if len(ids) + self.cfg.max_new_tokens >= self.decoder.max_len:
            ep.stop_with("context_full")
            return None
        return ids, images

    def prefill(self, prompts: dict) -> None:
        """Prefill the slots of ``prompts`` (slot -> ids, images) together and pick each one's first token."""
        import torch

        began = time.perf_counter()
        slots = list(prompts)
        logits = self.decoder.prefill_many([(s, *prompts[s]) for s in slots])
        self.stats["prefill_tokens"] += self.decoder.last_prefill_tokens
        picks = self.sampling.pick(torch.stack(logits), [0] * len(slots), self.stop_ids, self.generator,
                                   self.banned_ids)
        for s, tok in zip(slots, picks):
            self.slots[s].turn = [tok]
        self.stats["prefill_s"] += time.perf_counter() - began

    def begin_turns(self, prompts: dict) -> None:
        try:
            self.prefill(prompts)
        except Exception as err:  # one episode's images failed the forward: each alone, so only that one ends
            self.stats["prefill_retries"] += 1
            warnings.warn(f"a prefill of {len(prompts)} slots failed ({type(err).__name__}: {err}); each slot is "
                          "retried alone")
            for s, prompt in prompts.items():
                try:
                    self.prefill({s: prompt})
                except Exception as err:
                    self.slots[s].episode.fail(err)
                    self.finish(s)

    def end_turn(self, slot: Slot) -> bool:
        """Record ``slot``'s finished turn and run its tools; True when the episode goes on."""
        ep, tokens = slot.episode, slot.turn
        slot.turn = None
        ep.sampled_ids.append(tokens)
        ep.new_tokens += len(tokens)
        self.stats["new_tokens"] += len(tokens)
        truncated = tokens[-1] not in self.stop_ids
        began = time.perf_counter()
        try:
            going = ep.take_turn(self.tokenizer.decode(tokens, skip_special_tokens=False), truncated,
                                 self.cfg.max_turns)
        except Exception as err:  # an environment bug in one call: this episode ends, named
            ep.fail(err)
            return False
        finally:
            self.stats["tool_s"] += time.perf_counter() - began
        return going

    def end_turns(self) -> None:
        """End every finished turn before any next prompt is made, and start decoding the images those prompts
        show (a tool's crops): the workers decode them while the loop renders and prefills the slots in order."""
        for slot in self.slots:
            if slot.episode is not None and (
                slot.turn[-1] in self.stop_ids or len(slot.turn) >= self.cfg.max_new_tokens
            ):
                slot.goes_on = self.end_turn(slot)
                if slot.goes_on:
                    self.preload(slot.episode)

    def settle(self, s: int):
        """Leave slot ``s`` mid-turn, or empty when nothing is pending, or return the prompt its next turn
        starts from (the slots whose turns begin in one step are prefilled together)."""
        slot = self.slots[s]
        while True:
            if slot.episode is None:
                slot.episode = next(self.pending, None)
                if slot.episode is None:
                    return None
                slot.episode.slot = s
                # failed before it began (see new_episode)
                prompt = self.next_prompt(slot.episode) if slot.episode.stop is None else None
            elif slot.goes_on is None:  # mid-turn
                return None
            else:
                goes_on, slot.goes_on = slot.goes_on, None
                prompt = self.next_prompt(slot.episode) if goes_on else None
            if prompt is not None:
                return prompt
            self.finish(s)

    def finish(self, s: int) -> None:
        slot = self.slots[s]
        ep, slot.episode, slot.turn = slot.episode, None, None
        self.on_done(ep)
        if self.bar is not None:
            elapsed = time.perf_counter() - self.start
            self.bar.update(1)
            self.bar.set_postfix_str(f"{self.stats['new_tokens'] / max(elapsed, 1e-9):.0f} tok/s")


def _prefetched(items, start, depth: int):
    """``items`` in order, ``start(item)`` called on each ``depth`` items before it is yielded (to start its
    images decoding). Nothing waits here: the episode's prompt takes each image as it is ready."""
    ahead = deque()
    for item in items:
        start(item)
        ahead.append(item)
        if len(ahead) > depth:
            yield ahead.popleft()
    yield from ahead
