"""The slot-decoder rollout of GRPO (``eogym_sft.training.grpo_slots``) against TRL's own loop, on CPU with
the tiny Qwen3-VL: the same scripted episodes give TRL's loss the same batch (ids, masks, images, pixels),
which pins the private ``_generate`` contract the subclass relies on; the log-probabilities the decoder
sampled from equal those of the loss forward; the cache is sized by its budget."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import make_row, save_image
from helpers import IM_END, ScriptedPolicy, gold_and_wrong_group, perturb_lora_b, trained_spans

from eogym_sft.data.traces import normalize_row
from eogym_sft.agent.decoder import SlotDecoder
from eogym_sft.models.loading import apply_lora, load_base_model
from eogym_sft.models.processor import load_processor
from eogym_sft.data.collator import EOGymCollator
from eogym_sft.training.grpo import GRPOScriptArguments, build_trainer, load_episodes
from eogym_sft.training.grpo_slots import SlotEngine
from eogym_sft.agent.rollout_config import SlotRolloutArguments, kv_bytes_per_token, slots_for

MIN_PIXELS, MAX_PIXELS = 1024, 4096
KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask", "image_grid_thw", "num_images")


@pytest.fixture(scope="module")
def batches(tmp_path_factory, tiny_model_dir):
    """One generation batch (the gold trajectory with a crop, a wrong one-turn answer) through
    ``_generate_and_score_completions`` of a trainer on each engine, same model, same scripted policy."""
    tmp_path = tmp_path_factory.mktemp("grpo_slots")
    group = gold_and_wrong_group(tmp_path, tiny_model_dir, MAX_PIXELS, MIN_PIXELS)
    row, data_root, processor = group["row"], group["data_root"], group["processor"]
    model = perturb_lora_b(apply_lora(load_base_model(str(tiny_model_dir), "float32", "sdpa")), seed=0)
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(row) + "\n")
    data = load_episodes(path, data_root)
    from trl import GRPOConfig

    out = {}
    for engine in ("trl", "slots"):
        script_args = GRPOScriptArguments(
            dataset_path="unused", data_root=str(data_root), tool_backends="replay", max_pixels=MAX_PIXELS,
            min_pixels=MIN_PIXELS, rollout_engine=engine, max_episode_tokens=2048,
        )
        args = GRPOConfig(
            output_dir=str(tmp_path / engine), per_device_train_batch_size=2, num_generations=2, max_steps=1,
            max_completion_length=1024, beta=0.0, use_cpu=True, bf16=False, report_to="none", save_strategy="no",
            seed=0, generation_kwargs={"do_sample": False},
        )
        policy = ScriptedPolicy(group["scripts"], group["header"])
        modes = ModeRecorder(model)
        trainer = build_trainer(model, processor, data, script_args, args, logits_processors=[policy, modes])
        model.train()
        example = trainer.train_dataset[0]
        with torch.no_grad():
            out[engine] = {"batch": trainer._generate_and_score_completions([example, example]), "trainer": trainer}
        out[engine]["modes"], out[engine]["mode_after"] = modes.seen, model.training
    out["model"], out["processor"] = model, processor
    return out


class ModeRecorder:
    """A logits processor that changes nothing and records whether the model was in train mode."""

    def __init__(self, model):
        self.model, self.seen = model, set()

    def __call__(self, input_ids, scores):
        self.seen.add(self.model.training)
        return scores


def test_slots_generate_in_eval_mode_and_train_after(batches):
    assert batches["slots"]["modes"] == {False}  # LoRA dropout off while sampling
    assert batches["slots"]["mode_after"] is True


def test_both_engines_hand_the_loss_the_same_batch(batches):
    """Pins TRL 1.16's private contract: what ``_generate`` returns is turned into these tensors the same way."""
    trl, slots = batches["trl"]["batch"], batches["slots"]["batch"]
    for key in KEYS:
        assert torch.equal(torch.as_tensor(trl[key]), torch.as_tensor(slots[key])), key
    torch.testing.assert_close(slots["pixel_values"], trl["pixel_values"], rtol=0, atol=0)
    assert torch.equal(slots["mm_token_type_ids"], trl["mm_token_type_ids"])
    assert slots["num_images"] == [2, 1]  # the gold episode: the row image and its crop; the wrong one: the row image
    assert torch.equal(slots["advantages"], trl["advantages"])
    assert int(slots["tool_mask"][0].sum()) < int(slots["completion_mask"][0].sum())  # the crop's tool turn is context


def test_trl_patches_the_steps_images_through_once_per_image(batches, monkeypatch):
    """TRL 1.16 looks up ``processing_class.image_processor`` when it patches a step's images, so the trainer's
    :class:`~eogym_sft.models.processor.OncePerImage` sees the flattened episodes' images: the two episodes' shared
    row image is one object (the slots engine decodes a path once a step), patched once. The batch it gives is the
    one ``test_both_engines_hand_the_loss_the_same_batch`` checks against TRL's loop."""
    from eogym_sft.models.processor import OncePerImage

    calls = []
    real = OncePerImage.__call__

    def recording(self, images=None, **kwargs):
        if isinstance(images, list) and len(images) > 1:
            calls.append((len(images), len({id(im) for im in images})))
        return real(self, images=images, **kwargs)

    monkeypatch.setattr(OncePerImage, "__call__", recording)
    trainer = batches["slots"]["trainer"]
    monkeypatch.setattr(trainer, "_metrics", copy.deepcopy(trainer._metrics))  # the fixture's step stays the only one logged
    example = trainer.train_dataset[0]
    with torch.no_grad():
        batch = trainer._generate_and_score_completions([example, example])
    assert calls == [(3, 2)]  # the gold episode's row image and crop, the wrong one's row image
    assert not isinstance(trainer.processing_class.image_processor, OncePerImage)  # undone after the step
    torch.testing.assert_close(batch["pixel_values"], batches["slots"]["batch"]["pixel_values"], rtol=0, atol=0)


def test_slots_are_what_the_cache_budget_holds(tiny_model_dir):
    model = load_base_model(str(tiny_model_dir), "float32", "sdpa")
    text = model.config.text_config
    per_token = 2 * text.num_hidden_layers * text.num_key_value_heads * text.head_dim * 4
    assert kv_bytes_per_token(apply_lora(model)) == per_token
    from eogym_sft.agent.rollout_config import kv_bytes

    assert kv_bytes({"num_hidden_layers": 36, "num_key_value_heads": 8, "head_dim": 128}, 2) == 147456  # the 4B, as `plan` reads it
    assert kv_bytes({"num_hidden_layers": 2, "num_key_value_heads": 2, "hidden_size": 64, "num_attention_heads": 4}, 4) == 512
    assert slots_for(16, 16384, 147456, 40.0) == 16  # the 4B: 144 KiB a token, 2.25 GiB a slot
    assert slots_for(16, 16384, 147456, 24.0) == 10
    assert slots_for(4, 16384, 147456, 40.0) == 4  # never more slots than episodes
    with pytest.raises(ValueError, match="holds no slot"):
        slots_for(16, 16384, 147456, 1.0)


def test_the_rollout_settings_refuse_nonsense():
    with pytest.raises(ValueError, match="rollout_engine"):
        SlotRolloutArguments(rollout_engine="vllm")
    with pytest.raises(ValueError, match="positive"):
        SlotRolloutArguments(rollout_cache_gib=0)


def test_the_decoder_is_kept_between_steps_and_emptied(batches):
    trainer = batches["slots"]["trainer"]
    assert isinstance(trainer.engine, SlotEngine)
    decoder = trainer.engine._decoder
    assert decoder is not None and decoder.slots == 2 and decoder.max_len == 2048
    assert trainer.engine.decoder(trainer.model, 2) is decoder and all(not t for t in decoder.tokens)
    assert trainer._metrics["train"]["rollout/failed"] == [0.0]


def test_sampled_logprobs_equal_the_loss_forward(batches):
    """The decoder's logits (prefill at each turn's start over the KV cache, one-token decode within a turn)
    give each trained token the log-probability the engine's packed loss forward gives it (float32 on CPU;
    tests/training/test_packed_logps.py checks that one against TRL's padded forward)."""
    batch, trainer, model = batches["slots"]["batch"], batches["slots"]["trainer"], batches["model"]
    model.eval()
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        padded, _, _ = trainer._get_per_token_logps_and_entropies(
            model, ids, mask, batch["completion_ids"].size(1), batch_size=2, pixel_values=batch["pixel_values"],
            image_grid_thw=batch["image_grid_thw"], num_images=batch["num_images"], mm_token_type_ids=batch["mm_token_type_ids"],
        )
    from eogym_sft.agent.image_inputs import ImageInput

    grids = [tuple(int(v) for v in g) for g in batch["image_grid_thw"]]
    patches = [g[0] * g[1] * g[2] for g in grids]
    pixels = list(torch.split(batch["pixel_values"], patches))
    pictures = [ImageInput(p, g, trainer.processing_class.image_processor.merge_size) for p, g in zip(pixels, grids)]
    decoder = SlotDecoder(model, 1, 2048)
    image_pad = model.config.image_token_id
    first = 0
    for b in range(2):
        n_images = batch["num_images"][b]
        images, first = pictures[first : first + n_images], first + n_images
        prompt = batch["prompt_ids"][b][batch["prompt_mask"][b].bool()].tolist()
        length = int(batch["completion_mask"][b].sum())
        completion = batch["completion_ids"][b][:length].tolist()
        trained = batch["tool_mask"][b][:length].tolist()
        decoder.release(0)
        logits = decoder.prefill(0, prompt, images[: _images_in(prompt, image_pad)])
        sampled, expected = [], []
        for j, tok in enumerate(completion):
            if trained[j]:
                sampled.append(torch.log_softmax(logits, -1)[tok].item())
                expected.append(padded[b, j].item())
            if j + 1 == len(completion):
                break
            if not trained[j + 1]:
                continue  # context: no prediction needed
            if trained[j]:
                logits = decoder.decode({0: tok})[1][0]
            else:
                seq = prompt + completion[: j + 1]
                logits = decoder.prefill(0, seq, images[: _images_in(seq, image_pad)])
        assert len(sampled) == int(batch["tool_mask"][b][:length].sum()) > 0
        torch.testing.assert_close(torch.tensor(sampled), torch.tensor(expected), rtol=0, atol=1e-4)


def _images_in(ids: list[int], image_pad: int) -> int:
    return sum(1 for i, t in enumerate(ids) if t == image_pad and (i == 0 or ids[i - 1] != image_pad))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_replay_weights_updated_in_place(tiny_model_dir):
    """The decoder is kept across steps with its graphs: an optimizer step updates the LoRA weights in place, the
    next generation's run_episodes calls check_weights (which refills the merged weights in place), and a replayed
    graph must read the new values."""
    model = perturb_lora_b(apply_lora(load_base_model(str(tiny_model_dir), "float32", "sdpa")), seed=0).cuda().eval()
    graphed = SlotDecoder(model, 2, 1024, cuda_graphs=True)
    eager = SlotDecoder(model, 2, 1024)
    prompt = list(range(100, 140))

    def step(decoder):
        if decoder is eager:
            decoder.reset()
        else:  # what SlotEngine.decoder and run_episodes do
            for s in range(decoder.slots):
                decoder.release(s)
            decoder.check_weights()
        decoder.prefill(0, prompt, [])
        return decoder.decode({0: 7})[1][0].clone()

    step(graphed)  # captures
    captured = dict(graphed._step.graphs)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_(0.05)
    torch.testing.assert_close(step(graphed), step(eager), rtol=1e-4, atol=1e-4)
    assert graphed._step.graphs == captured  # the same graphs, replayed over the refilled buffers


@pytest.fixture(scope="module")
def gold_episode(tmp_path_factory, tiny_model_dir):
    """The tiny row's gold trajectory (a crop call, its result with the crop, the answer) as an ended episode."""
    from eogym_sft.agent.episodes import new_episode

    root = tmp_path_factory.mktemp("episode_data")
    for rel, width, height in [("EO_GYM_DATA/aaaa0000/scene.jpg", 96, 64), ("image_cache/crops/c1.png", 48, 32)]:
        save_image(root, rel, width, height)
    row = make_row(n_steps=1)
    episode = new_episode(row, "rows.jsonl:1", "policy", 0, env=None)
    episode.row["messages"] = [dict(m) for m in row["messages"]]
    episode.stop = "final_answer"
    processor = load_processor(str(tiny_model_dir), MAX_PIXELS, MIN_PIXELS)
    trace = normalize_row(row)
    sft = EOGymCollator(processor, data_root=str(root))([{"messages": trace.messages, "images": trace.images, "tools": trace.tools}])
    episode.sampled_ids = trained_spans(sft["labels"][0])  # what a policy writing the gold turns samples
    return episode, root


def _sample(episode, root, processor, max_completion_length=4096):
    from eogym_sft.agent.episodes import picture_cache
    from eogym_sft.training.grpo_slots import episode_sample

    return episode_sample(episode, processor, root, "produced", picture_cache(processor), max_completion_length)


def test_an_episode_is_its_sft_sample_split_at_the_first_turn(gold_episode, tiny_model_dir, capped_processor):
    episode, root = gold_episode
    processor = capped_processor(MAX_PIXELS, MIN_PIXELS)
    sample = _sample(episode, root, processor)
    collator = EOGymCollator(processor, data_root=str(root))
    trace = normalize_row(episode.row)
    sft = collator([{"messages": trace.messages, "images": trace.images, "tools": trace.tools}])
    ids, labels = sft["input_ids"][0].tolist(), sft["labels"][0].tolist()
    assert sample.prompt_ids + sample.completion_ids == ids[:-1]  # SFT keeps the newline after the last <|im_end|>
    assert sample.tool_mask == [int(t != -100) for t in labels[len(sample.prompt_ids) : -1]]
    assert sample.completion_ids[-1] == IM_END and not sample.truncated and len(sample.images) == 2

    image_pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    crop_start = sample.completion_ids.index(image_pad)
    assert sample.completion_ids[crop_start + 1] == image_pad  # the crop is more than one token
    cut = _sample(episode, root, processor, max_completion_length=crop_start + 1)  # inside the crop's tokens
    assert cut.completion_ids == sample.completion_ids[:crop_start] and cut.tool_mask == sample.tool_mask[:crop_start]
    assert cut.truncated and len(cut.images) == 1  # the crop is dropped whole, with its pixels


def test_a_cut_last_turn_ends_without_im_end(gold_episode, tiny_model_dir, capped_processor):
    episode, root = gold_episode
    processor = capped_processor(MAX_PIXELS, MIN_PIXELS)
    episode.stop, sampled = "max_new_tokens", episode.sampled_ids
    episode.sampled_ids = sampled[:-1] + [sampled[-1][:-1]]  # the last turn ran out of tokens before <|im_end|>
    try:
        sample = _sample(episode, root, processor)
    finally:
        episode.stop, episode.sampled_ids = "final_answer", sampled
    full = _sample(episode, root, processor)
    assert sample.truncated and sample.completion_ids == full.completion_ids[:-1]


def test_an_episode_that_fails_trains_on_nothing_and_is_counted(batches):
    """A row image gone missing mid-run: that episode is named, counted and masked; the other trains.
    With ``rollout_keep_cache`` false the decoder is dropped after the rollout."""
    trainer = batches["slots"]["trainer"]
    good = trainer.train_dataset[0]
    row = json.loads(good["row"])
    broken = {**good, "row": json.dumps({**row, "images": ["EO_GYM_DATA/gone.jpg"]})}
    batches["model"].train()
    trainer.engine.rollout_args.rollout_keep_cache = False  # and the cache is freed after the rollout
    try:
        with torch.no_grad():
            batch = trainer._generate_and_score_completions([good, broken])
    finally:
        trainer.engine.rollout_args.rollout_keep_cache = True
    assert trainer.engine._decoder is None and trainer.engine.sampling.decoder is None
    assert int((batch["tool_mask"][1] * batch["completion_mask"][1]).sum()) == 0  # the loss mask TRL uses
    assert int((batch["tool_mask"][0] * batch["completion_mask"][0]).sum()) > 0
    assert batch["num_images"] == [2, 0]
    assert trainer._metrics["train"]["rollout/failed"][-1] == 0.5


def test_an_episode_longer_than_max_completion_length_is_named_in_a_warning(batches, caplog):
    """Each turn fits, the whole episode (its tool result and crop count) does not: it trains on nothing,
    and the log says so and what to raise, instead of a reward curve that never moves."""
    trainer, batch = batches["slots"]["trainer"], batches["slots"]["batch"]
    trained = batch["tool_mask"][0][: int(batch["completion_mask"][0].sum())].tolist()
    first_turn = trained.index(0)  # the call turn ends where the tool result begins
    limit = first_turn + 8  # room for each turn (the answer is shorter), not for the result between them
    assert limit < len(trained)
    example = trainer.train_dataset[0]
    batches["model"].train()
    saved = trainer.max_completion_length
    trainer.max_completion_length = limit
    try:
        with caplog.at_level("WARNING", logger="eogym_sft.training.grpo_slots"), torch.no_grad():
            trainer._generate_and_score_completions([example, example])
    finally:
        trainer.max_completion_length = saved
    warned = [r.getMessage() for r in caplog.records if "longer than max_completion_length" in r.getMessage()]
    assert warned == [f"1 of 2 episodes ended on their own but are longer than max_completion_length={limit} (tool results and "
                      "their images count) and train on nothing: raise max_completion_length"]


def test_the_slots_engine_trains_the_ids_it_sampled(tmp_path, tiny_model_dir):
    """Token in, token out: each assistant turn reaches TRL's loss as the ids the policy sampled, for ids that
    do not round-trip through the tokenizer ("F" + "inal", a word split in two in a tool-call turn), a newline before
    <|im_end|>, and a turn cut at its token limit on trailing spaces; not the text re-tokenized."""
    from helpers import scripted_trainer

    def scripts(group):
        tokenizer = group["processor"].tokenizer
        enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        call = list(group["scripts"][0][0])  # the gold crop call, <|im_end|> included
        k = next(i for i in range(1, len(call)) if len(tokenizer.decode(call[i : i + 1]).strip()) > 2)
        word = tokenizer.decode(call[k : k + 1])
        call[k : k + 1] = enc(word[:-1]) + enc(word[-1:])
        answer = enc("F") + enc("inal Answer: 3\n") + [IM_END]
        spaces = enc("I count") + enc(" ") * 120
        assert answer[:-1] != enc("Final Answer: 3\n") and call[:-1] != enc(tokenizer.decode(call[:-1]))  # neither round-trips
        return [[answer], [call, spaces]]

    trainer, policy = scripted_trainer(
        tmp_path, tiny_model_dir, "slots", scripts, rollout_turn_tokens=96, mask_truncated_completions=False,
    )
    with torch.no_grad():
        batch = trainer._generate_and_score_completions([trainer.train_dataset[0]] * 2)
    answer, (call, spaces) = policy.scripts[0][0], policy.scripts[1]
    trained = []
    for b in range(2):
        length = int(batch["completion_mask"][b].sum())
        trained.append(_runs(batch["completion_ids"][b][:length].tolist(), batch["tool_mask"][b][:length].tolist()))
    assert trained[0] == [answer]
    assert trained[1] == [call, spaces[:96]]  # the cut turn: its first 96 sampled ids, spaces and all, no <|im_end|>
    assert batch["num_images"] == [1, 2]  # the crop came back between the two turns


def _runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    runs, current = [], []
    for tok, m in zip(ids, mask):
        if m:
            current.append(tok)
        elif current:
            runs, current = runs + [current], []
    return runs + ([current] if current else [])


def test_the_slots_engine_refuses_sharded_weights():
    """The slot decoder and its kept CUDA graphs read whole weights in place: ZeRO-3 and FSDP are refused
    when the trainer is built (accelerate's state stands in: neither runs on one CPU)."""
    from types import SimpleNamespace

    from eogym_sft.training.grpo_slots import check_whole_weights

    check_whole_weights(SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=2), fsdp_plugin=None))
    with pytest.raises(ValueError, match="ZeRO-3 shards them"):
        check_whole_weights(SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=3), fsdp_plugin=None))
    with pytest.raises(ValueError, match="FSDP shards them: use --rollout_engine trl"):
        check_whole_weights(SimpleNamespace(deepspeed_plugin=None, fsdp_plugin=object()))


def test_the_kept_cache_is_freed_only_for_a_loss_micro_batch_that_would_not_fit_beside_it(tmp_path):
    from types import SimpleNamespace

    from trl import GRPOConfig

    from eogym_sft.models.loading import apply_lora
    from eogym_sft.models.tiny import TINY_QWEN3_VL_CONFIG
    from eogym_sft.training.memory_hook import grpo_loss_reserve, longest_micro_batch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    model = apply_lora(Qwen3VLForConditionalGeneration(Qwen3VLConfig.from_dict(TINY_QWEN3_VL_CONFIG)), 4, 8, 0.05)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2,
                      max_completion_length=64, use_cpu=True, report_to="none")
    engine = SlotEngine(SimpleNamespace(max_episode_tokens=128))
    engine.trainer_args = args
    samples = [SimpleNamespace(prompt_ids=[0] * p, completion_ids=[0] * c) for p, c in ((50, 10), (90, 30), (20, 5))]
    need = grpo_loss_reserve(model, args, engine.rollout_args, 1, False,
                             longest_micro_batch([[0] * 50, [0] * 90, [0] * 20], [10, 30, 5], 2, shared=False))
    for room, kept in ((need, True), (need - 1, False)):
        engine._decoder, engine._loss_room = "the decoder", room
        engine.keep_or_release(model, samples)
        assert (engine._decoder is not None) == kept
    engine._decoder, engine._loss_room = "the decoder", None  # off CUDA, or a cache the user sized: kept
    engine.keep_or_release(model, samples)
    assert engine._decoder == "the decoder"
