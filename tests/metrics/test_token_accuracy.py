"""Token accuracy has one definition: shifted argmax equals the label, over labels that are not -100,
as counts summed over batches and ranks before dividing. Token classes and ``score_dataset`` agree with
independent computations."""

from __future__ import annotations

import json
import socket

import pytest
import torch
import torch.multiprocessing as mp
from helpers import chat_example, lean_towards_im_end, sharpen

from eogym_sft.metrics.token_accuracy import (
    accuracy,
    sum_across_ranks,
    token_accuracy_counts,
)


def one_hot_logits(predictions: list[list[int]], vocab: int) -> torch.Tensor:
    """Logits whose argmax at ``[b, t]`` is ``predictions[b][t]`` (with a spread so it is not trivial)."""
    logits = torch.linspace(-1, 1, vocab).repeat(len(predictions), len(predictions[0]), 1)
    for b, row in enumerate(predictions):
        for t, p in enumerate(row):
            logits[b, t, p] = 5.0
    return logits


def test_token_accuracy_counts_by_hand():
    logits = one_hot_logits([[1, 2, 3, 0], [4, 4, 0, 2]], vocab=5)
    labels = torch.tensor([[-100, 1, 2, 4], [3, 4, -100, 0]])
    # logits[t] predicts labels[t + 1]:
    #   row 0: t0 1 vs 1 yes, t1 2 vs 2 yes, t2 3 vs 4 no                     -> 2 of 3
    #   row 1: t0 4 vs 4 yes, t1 vs -100 skipped, t2 0 vs 0 yes               -> 2 of 2
    #   labels[:, 0] (3) is never a target and the last position's prediction is never scored
    counts = token_accuracy_counts(logits, labels)
    assert counts.dtype == torch.long
    assert counts.tolist() == [4, 5]
    assert accuracy(counts) == 0.8
    # without the shift it would be 1 of 6: the shift matters for these numbers
    unshifted = ((logits.argmax(-1) == labels) & (labels != -100)).sum()
    assert unshifted.item() == 1
    # one row (no batch dimension) and a custom ignore index
    assert token_accuracy_counts(logits[1], labels[1]).tolist() == [2, 2]
    assert token_accuracy_counts(logits[0], torch.tensor([-1, 1, 2, -1]), ignore_index=-1).tolist() == [2, 2]
    assert accuracy(torch.tensor([0, 0])) == 0.0


def test_sum_across_ranks_without_a_process_group():
    counts = torch.tensor([3, 7])
    assert torch.equal(sum_across_ranks(counts), counts)


# ---- two simulated ranks ----------------------------------------------------------------------------

RANK_COUNTS = {0: (9, 10), 1: (1, 30)}  # 90% of 10 tokens and 3.3% of 30: token-weighted 25%, rank mean 46.7%


def _rank_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One row whose first ``correct`` of ``total`` targets are predicted right."""
    correct, total = RANK_COUNTS[rank]
    targets = [t % 7 for t in range(total)]
    predictions = [tok if t < correct else (tok + 1) % 7 for t, tok in enumerate(targets)] + [0]
    labels = torch.tensor([[-100] + targets])
    return one_hot_logits([predictions], vocab=7), labels


def _rank_worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from eogym_sft.evaluation.validate import _merge_ranks

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        logits, labels = _rank_data(rank)
        local = token_accuracy_counts(logits, labels)
        total = sum_across_ranks(local)
        merged = _merge_ranks({"overall": [0.5 * (rank + 1), int(local[0]), int(local[1])]})
        result = {
            "local": local.tolist(),
            "total": total.tolist(),
            "accuracy": accuracy(total),
            "merged": dict(merged),
        }
        with open(f"{out_dir}/rank{rank}.json", "w") as fh:
            json.dump(result, fh)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_token_accuracy_across_two_ranks(tmp_path):
    mp.spawn(_rank_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["local"] for r in results] == [[9, 10], [1, 30]]
    for r in results:  # every rank ends with the same sums
        assert r["total"] == [10, 40]
        assert r["accuracy"] == 10 / 40 == 0.25
        assert r["merged"] == {"overall": [1.5, 10, 40]}  # validate's merge: summed, not averaged
    mean_of_rank_accuracies = (9 / 10 + 1 / 30) / 2
    assert abs(results[0]["accuracy"] - mean_of_rank_accuracies) > 0.2


# ---- token classes --------------------------------------------------------------------------------

CALL = '<tool_call>\n{"name": "crop", "arguments": {"aoi": [0, 0, 1, 1]}}\n</tool_call>'


def _classes_by_segment(tokenizer, segments: list[tuple[str, str]]) -> tuple[list[int], list[str]]:
    ids, classes = [], []
    for cls, text in segments:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        classes += [cls] * len(piece)
    return ids, classes


def test_token_classes_of_rendered_assistant_turns(processor):
    from eogym_sft.data.encoding import encode_conversation
    from eogym_sft.metrics.token_accuracy import token_classes

    tool = {
        "type": "function",
        "function": {"name": "crop", "description": "Crop.", "parameters": {"type": "object", "properties": {}}},
    }
    messages = [
        {"role": "user", "content": "How many ships?"},
        {
            "role": "assistant",
            "content": "I will crop the pier.",
            "tool_calls": [{"type": "function", "function": {"name": "crop", "arguments": {"aoi": [0, 0, 1, 1]}}}],
        },
        {"role": "tool", "content": "done"},
        {"role": "assistant", "content": "I count the hulls.\nFinal Answer: 3 ships"},
    ]
    enc = encode_conversation(processor, messages, [tool])
    trained = [bool(m) for m in enc.assistant_mask]
    classes = token_classes(enc.input_ids, trained, processor.tokenizer)
    got_ids = [t for t, m in zip(enc.input_ids, trained) if m]
    got = [c for c, m in zip(classes, trained) if m]
    assert all(c is None for c, m in zip(classes, trained) if not m)
    expected_ids, expected = _classes_by_segment(
        processor.tokenizer,
        [
            ("free_text", "I will crop the pier.\n"),
            ("tool_call", CALL),
            ("end_of_turn", "<|im_end|>"),
            ("free_text", "I count the hulls.\n"),
            ("final_answer", "Final Answer: 3 ships"),
            ("end_of_turn", "<|im_end|>"),
        ],
    )
    assert got_ids == expected_ids
    assert got == expected


def test_final_answer_line_ends_with_its_turn(processor):
    """A final-answer line at the end of one turn must not run on into the next turn's free text."""
    from eogym_sft.data.encoding import encode_conversation
    from eogym_sft.metrics.token_accuracy import token_classes

    messages = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "Final Answer: 3"},
        {"role": "user", "content": "Sure?"},
        {"role": "assistant", "content": "Yes I am sure.\nFinal Answer: 3"},
    ]
    enc = encode_conversation(processor, messages, None)
    trained = [bool(m) for m in enc.assistant_mask]
    classes = [c for c, m in zip(token_classes(enc.input_ids, trained, processor.tokenizer), trained) if m]
    _, expected = _classes_by_segment(
        processor.tokenizer,
        [
            ("final_answer", "Final Answer: 3"),
            ("end_of_turn", "<|im_end|>"),
            ("free_text", "Yes I am sure.\n"),
            ("final_answer", "Final Answer: 3"),
            ("end_of_turn", "<|im_end|>"),
        ],
    )
    assert classes == expected


def test_token_classes_by_hand_ids():
    class Tok:  # the three special ids and a one-character decode for the rest
        specials = {"<tool_call>": 100, "</tool_call>": 101, "<|im_end|>": 102}

        def convert_tokens_to_ids(self, token):
            return self.specials[token]

        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    text = [ord(c) for c in "ok\n"]
    final = [ord(c) for c in "Final Answer: 7"]
    ids = [1] + text + [100, 60, 61, 101, 102] + [2, 3] + [ord("a")] + final + [ord("\n"), ord("b"), 102]
    trained = [False] + [True] * 3 + [True] * 5 + [False, False] + [True] * (1 + len(final) + 3)
    from eogym_sft.metrics.token_accuracy import token_classes

    classes = token_classes(ids, trained, Tok())
    expected = (
        [None]
        + ["free_text"] * 3
        + ["tool_call"] * 4
        + ["end_of_turn"]
        + [None, None]
        + ["free_text"]
        + ["final_answer"] * len(final)
        + ["free_text", "free_text", "end_of_turn"]
    )
    assert classes == expected


# ---- validate.score_dataset -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def biased_model():
    """The tiny Qwen3-VL with larger weights and an LM head that leans towards ``<|im_end|>``: some
    predictions are right and most are not, so accuracy is neither 0 nor 1."""
    from eogym_sft.models.tiny import build_tiny_model

    return lean_towards_im_end(sharpen(build_tiny_model(seed=2), seed=2))


def _examples():
    from PIL import Image

    def ex(question, answer, task, qtype, images=()):
        return chat_example(question, answer, images, EO_task=task, question_type=qtype)

    return [
        ex(
            "How many ships?",
            "I see boats.\nFinal Answer: 3",
            "Counting",
            "count",
            [Image.new("RGB", (64, 32), "red")],
        ),
        ex("Is it flooded?", "Final Answer: yes", "Change", None),
        ex("Which land cover dominates the scene?", "Forest.\nFinal Answer: forest", "Counting", "classify"),
    ]


def test_score_dataset_matches_full_logits(processor, capped_processor, biased_model):
    from eogym_sft.evaluation.validate import score_dataset
    from eogym_sft.data.collator import EOGymCollator

    collator = EOGymCollator(capped_processor(4096, 1024))
    examples = _examples()
    report = score_dataset(biased_model, collator, examples, batch_size=2, progress=False)

    # independent: full logits, one sample at a time, shifted by hand
    im_end = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    sums: dict[str, list] = {}
    for ex in examples:
        batch = collator([ex])
        with torch.no_grad():
            logits = biased_model(**batch, use_cache=False).logits[0].float()
        labels = batch["labels"][0]
        for t in range(len(labels) - 1):
            target = int(labels[t + 1])
            if target == -100:
                continue
            loss = torch.nn.functional.cross_entropy(logits[t][None], torch.tensor([target])).item()
            right = int(logits[t].argmax()) == target
            groups = ["overall", f"EO_task/{ex['EO_task']}", f"question_type/{ex['question_type'] or 'unknown'}"]
            if target == im_end:
                groups.append("token_class/end_of_turn")
            for g in groups:
                s = sums.setdefault(g, [0.0, 0, 0])
                s[0] += loss
                s[1] += right
                s[2] += 1
    assert 0 < sums["overall"][1] < sums["overall"][2]  # a non-trivial accuracy
    for group, (loss, correct, n) in sums.items():
        got = report[group]
        assert got["tokens"] == n, group
        assert got["token_accuracy"] == correct / n, group
        assert abs(got["loss"] - loss / n) < 1e-5, group
    assert set(report) >= {
        "EO_task/Change",
        "question_type/unknown",
        "token_class/final_answer",
        "token_class/free_text",
    }
    assert list(report)[0] == "overall"
    assert sum(report[g]["tokens"] for g in report if g.startswith("token_class/")) == report["overall"]["tokens"]
    assert sum(report[g]["tokens"] for g in report if g.startswith("EO_task/")) == report["overall"]["tokens"]


def test_score_dataset_leaves_out_a_sample_whose_image_fails(capped_processor, biased_model):
    from eogym_sft.evaluation.validate import score_dataset
    from eogym_sft.data.collator import EOGymCollator

    collator = EOGymCollator(capped_processor(4096, 1024), skip_bad_images=True)
    broken = chat_example("Ships?", "Final Answer: 2", ["gone/scene.png"], sample_id="gone-1#w0", EO_task="Counting")
    examples = _examples()
    want = score_dataset(biased_model, collator, examples, batch_size=2, progress=False)
    skipped = []
    # the broken sample alone in a batch, and beside good samples
    got = score_dataset(biased_model, collator, [broken, *examples, broken], batch_size=2, progress=False, skipped=skipped)
    assert got == want
    assert [(r["sample_id"], r["file"], r["reason"]) for r in skipped] == [("gone-1#w0", "gone/scene.png", "missing_image")] * 2
