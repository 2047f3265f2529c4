"""Closed-loop episodes back into SFT: a scripted policy writes compact-JSON tool calls and a turn cut at its
token limit; ``prepare`` then trains exactly the tokens generated, and never a cut turn."""

from __future__ import annotations

import json

import pytest

from eogym_sft.data.prepare import PrepConfig, prepare_line
from eogym_sft.data.traces import TraceError, normalize_row
from eogym_sft.environment.env import EOGymEnvironment
from eogym_sft.agent.episodes import LoopConfig, new_episode, run_episodes
from eogym_sft.agent.decoder import SlotDecoder
from eogym_sft.agent.piece_tokenizer import PieceTokenizer
from eogym_sft.agent.sampling import Sampling
from eogym_sft.models.tiny import build_tiny_model

# Compact JSON, as a model may write it: the chat template would render it with ", " and ": ".
COMPACT_CALL = (
    '<tool_call>\n{"name":"crop_optical_or_sar_image","arguments":'
    '{"image_url":"EO_GYM_DATA/aaaa0000/scene.jpg","aoi":[0.25,0.25,0.75,0.75]}}\n</tool_call><|im_end|>'
)
ANSWER = "I count the hulls.\nFinal Answer: 3<|im_end|>"
LONG = "I look at every pier of the harbour in turn, " * 8  # longer than the turn limit
MAX_NEW_TOKENS = 64


class Scripted(Sampling):
    """Writes the next scripted turn, token by token, through the real decoder (one slot: turns in order)."""

    def __init__(self, tokenizer, turns: list[str]):
        super().__init__()
        self.script = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in turns]
        self.turn = -1

    def pick(self, logits, generated, stop_ids, generator=None, banned_ids=()):
        if generated == [0]:
            self.turn += 1
        return [self.script[self.turn][generated[0]]]


def _trained_spans(sample) -> list[list[int]]:
    spans, current = [], []
    for tok, trained in zip(sample["input_ids"], sample["assistant_masks"]):
        if trained:
            current.append(tok)
        elif current:
            spans.append(current)
            current = []
    return spans + ([current] if current else [])


@pytest.fixture(scope="module")
def records(tmp_path_factory, processor):
    from conftest import make_row, save_image

    root = tmp_path_factory.mktemp("data")
    save_image(root, "EO_GYM_DATA/aaaa0000/scene.jpg", 640, 480)
    row = make_row(n_steps=1)
    episodes = [new_episode(row, "f:1", "base", k, EOGymEnvironment(row, root)) for k in range(2)]
    policy = Scripted(processor.tokenizer, [COMPACT_CALL, ANSWER, COMPACT_CALL, LONG])
    assert len(policy.script[0]) < MAX_NEW_TOKENS < len(policy.script[3])
    done = []
    decoder = SlotDecoder(build_tiny_model(0).eval(), slots=1, max_len=2048)
    run_episodes(decoder, processor, iter(episodes), policy, LoopConfig(4, MAX_NEW_TOKENS), root, done.append)
    return root, policy.script, [e.record() for e in done]


def _prepare(processor, root, record):
    return prepare_line(processor, PrepConfig(data_root=str(root)), "episodes.jsonl", 1, json.dumps(record).encode())


def test_prepare_trains_the_generated_tokens(processor, records):
    root, script, (answered, _) = records
    assert answered["stop_reason"] == "final_answer"
    call = answered["messages"][2]
    assert call["generated"] == COMPACT_CALL.removesuffix("<|im_end|>")
    assert call["tool_calls"][0]["function"]["name"] == "crop_optical_or_sar_image"  # the record's fields stay
    result = _prepare(processor, root, answered)
    assert result.status == "kept"
    assert _trained_spans(result.samples[0]) == [script[0], script[1]]  # <|im_end|> included, as generated


def test_a_turn_cut_at_the_token_limit_is_never_trained(processor, records):
    root, script, (_, cut) = records
    assert cut["stop_reason"] == "max_new_tokens"
    last = cut["messages"][-1]
    assert last["truncated"] is True and last["generated"] == processor.tokenizer.decode(script[3][:MAX_NEW_TOKENS])
    result = _prepare(processor, root, cut)
    assert result.status == "kept"
    assert _trained_spans(result.samples[0]) == [script[2]]  # the call before it; no <|im_end|> the model never wrote
    only_cut = {**cut, "messages": cut["messages"][:2] + [last]}
    assert _prepare(processor, root, only_cut).reason == "no_assistant_turn"


def test_generated_text_must_agree_with_the_turns_tool_calls(records):
    _, _, (answered, _) = records
    row = json.loads(json.dumps(answered))
    row["messages"][2]["generated"] = COMPACT_CALL.replace("0.25,0.25", "0.5,0.5").removesuffix("<|im_end|>")
    with pytest.raises(TraceError, match="generated_mismatch"):
        normalize_row(row)


def _crop_calls(n: int) -> str:
    blocks = [
        '<tool_call>\n{"name":"crop_optical_or_sar_image","arguments":'
        f'{{"image_url":"EO_GYM_DATA/aaaa0000/scene.jpg","aoi":[0,0,{(k + 1) / 100},0.5]}}}}\n</tool_call>'
        for k in range(n)
    ]
    return "\n".join(blocks) + "<|im_end|>"


def test_calls_past_the_cap_are_not_run_and_the_model_is_told(tmp_path, processor):
    from conftest import make_row, save_image

    save_image(tmp_path, "EO_GYM_DATA/aaaa0000/scene.jpg", 640, 480)
    row = make_row(n_steps=1)
    env = EOGymEnvironment(row, tmp_path, max_calls_per_turn=3)
    ep = new_episode(row, "f:1", "base", 0, env)
    assert ep.take_turn(_crop_calls(5), False, max_turns=4) is True
    tools = [m for m in ep.row["messages"] if m["role"] == "tool"]
    assert len(tools) == 4 and all(json.loads(m["content"])["width"] for m in tools[:3])
    assert tools[3]["content"] == "Error: 5 tool calls in one turn; only the first 3 were run, the other 2 were not."
    assert len(list((tmp_path / "image_cache" / "crops").glob("*.png"))) == 3  # the skipped calls wrote nothing
    assert env.counts["calls"] == 3 and env.counts["skipped_calls"] == 2
    ep.take_turn(_crop_calls(4), False, max_turns=4)
    record = ep.record()
    assert (record["tool_calls"], record["skipped_calls"], record["tool_errors"], record["tool_error_codes"]) == (6, 3, 0, {})
    assert _prepare(processor, tmp_path, {**record, "messages": record["messages"] + [{"role": "assistant", "content": ANSWER}]}).status == "kept"


def test_the_environment_refuses_a_cap_below_one(tmp_path):
    from conftest import make_row

    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match=f"max_calls_per_turn must be a whole number >= 1, got {bad!r}"):
            EOGymEnvironment(make_row(n_steps=1), tmp_path, max_calls_per_turn=bad)


# ---------------------------------------------------------------- prompts: tokens and images made ahead


def test_piece_tokenizer_equals_the_tokenizer_on_an_episodes_prompts(processor, data_root, row_factory):
    """Each next prompt of an episode is its last one and a turn: the same ids as encoding it whole, most of them held."""
    row = row_factory(n_steps=2)
    episode = new_episode(row, "f:1", "base", 0, EOGymEnvironment(row, data_root))
    pieces, encoded = PieceTokenizer(processor.tokenizer), []
    for turn in row["messages"][2:]:
        ids, _ = episode.prompt(processor, data_root, tokens=pieces)
        encoded.append(len(pieces.held))
        assert ids == episode.prompt(processor, data_root)[0]
        episode.row["messages"].append(turn)
    assert encoded == sorted(encoded) and len(set(encoded)) > 1


class _Loads:
    """An image cache's loader that records the thread of each load."""

    def __init__(self, processor):
        self.processor, self.threads = processor, []

    def __call__(self, path):
        import threading

        from eogym_sft.agent.image_inputs import image_input
        from eogym_sft.data.images import load_rgb

        self.threads.append(threading.current_thread() is threading.main_thread())
        return image_input(self.processor, load_rgb(path))


def test_preload_decodes_each_image_in_a_task_of_its_own_and_the_prompt_takes_them(processor, data_root, row_factory):
    from concurrent.futures import ThreadPoolExecutor

    from eogym_sft.data.images import ImageCache

    row = row_factory(images=["EO_GYM_DATA/aaaa0000/scene.jpg", "EO_GYM_DATA/bbbb1111/post.png"])
    loads = _Loads(processor)
    pictures = ImageCache(load=loads, cost=lambda picture: 1)
    episode = new_episode(row, "f:1", "base", 0, EOGymEnvironment(row, data_root))
    with ThreadPoolExecutor(max_workers=2) as pool:
        episode.preload(pictures, data_root, pool=pool)
        assert len(episode._ahead) == 2
    _, images = episode.prompt(processor, data_root, pictures=pictures)
    assert loads.threads == [False, False]  # both in the pool's threads, none since
    assert [im is pictures.get(data_root / rel) for im, rel in zip(images, row["images"])] == [True, True]
    assert episode._ahead == {}
    now = new_episode(row, "f:1", "base", 1, EOGymEnvironment(row, data_root))
    loads.threads.clear()
    now.preload(ImageCache(load=loads, cost=lambda picture: 1), data_root)  # without a pool: decoded here and now, held by the episode
    assert loads.threads == [True, True] and len(now._pictures) == 2 and now._ahead == {}


def test_a_preloaded_image_that_fails_fails_the_prompt_as_a_load_there_does(processor, data_root, row_factory):
    from concurrent.futures import ThreadPoolExecutor

    from eogym_sft.agent.episodes import picture_cache
    from eogym_sft.data.images import ImageError

    (data_root / "EO_GYM_DATA/aaaa0000/scene.jpg").write_bytes(b"\xff\xd8\xff not a jpeg")
    row = row_factory()
    errors = []
    for preload in (True, False):
        episode = new_episode(row, "f:1", "base", 0, EOGymEnvironment(row, data_root))
        pictures = picture_cache(processor)
        if preload:
            with ThreadPoolExecutor(max_workers=1) as pool:
                episode.preload(pictures, data_root, pool=pool)
        with pytest.raises(ImageError) as err:
            episode.prompt(processor, data_root, pictures=pictures)
        errors.append(str(err.value))
    assert errors[0] == errors[1] and "corrupt_image" in errors[0]


class _EveryTurnCrops(Sampling):
    """Every slot writes the same crop call every turn: the slots end their turns together."""

    def __init__(self, tokenizer):
        super().__init__()
        self.script = tokenizer(COMPACT_CALL, add_special_tokens=False)["input_ids"]

    def pick(self, logits, generated, stop_ids, generator=None, banned_ids=()):
        return [self.script[n] for n in generated]


def test_the_tool_images_of_a_step_start_decoding_before_its_next_prompts_are_made(processor, tmp_path):
    """Two slots end a turn in one step: both turns' tools run and their crops are handed to the workers before
    either next prompt is rendered (the prompts are then made in slot order, as the prefill takes them)."""
    from conftest import make_row, save_image

    save_image(tmp_path, "EO_GYM_DATA/aaaa0000/scene.jpg", 640, 480)
    row = make_row(n_steps=1)
    events = []
    episodes = [new_episode(row, "f:1", "base", k, EOGymEnvironment(row, tmp_path)) for k in range(2)]
    for ep in episodes:
        for name in ("preload", "prompt"):
            method = getattr(ep, name)
            setattr(ep, name, lambda *a, _m=method, _n=name, _e=ep, **k: events.append((_n, _e.sample, _e.turns)) or _m(*a, **k))
    decoder = SlotDecoder(build_tiny_model(0).eval(), slots=2, max_len=2048)
    done = []
    run_episodes(decoder, processor, iter(episodes), _EveryTurnCrops(processor.tokenizer), LoopConfig(2, MAX_NEW_TOKENS), tmp_path, done.append)
    assert [ep.stop for ep in done] == ["max_turns", "max_turns"] and len(done[0].images_seen) == 2  # the scene and its crop
    assert events == [("preload", 0, 0), ("preload", 1, 0), ("prompt", 0, 0), ("prompt", 1, 0),
                      ("preload", 0, 1), ("preload", 1, 1), ("prompt", 0, 1), ("prompt", 1, 1)]


def test_a_run_that_fails_ends_its_image_workers_too(processor, tmp_path):
    """``on_done`` failing (a full disk under the episode log, say) ends the run with its error, and the threads
    that decode the pending episodes' images end with it."""
    import threading

    from conftest import make_row, save_image

    save_image(tmp_path, "EO_GYM_DATA/aaaa0000/scene.jpg", 640, 480)
    row = make_row(n_steps=1)
    episodes = [new_episode(row, "f:1", "base", k, EOGymEnvironment(row, tmp_path)) for k in range(2)]
    decoder = SlotDecoder(build_tiny_model(0).eval(), slots=1, max_len=2048)
    before = set(threading.enumerate())

    def done(episode):
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        run_episodes(decoder, processor, iter(episodes), Scripted(processor.tokenizer, [ANSWER]), LoopConfig(2, MAX_NEW_TOKENS), tmp_path, done)
    assert [t.name for t in threading.enumerate() if t not in before] == []
