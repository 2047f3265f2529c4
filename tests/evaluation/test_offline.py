"""Tests for ``eogym-sft evaluate``: scoring rules on hand-made outputs, paired statistics worked out by
hand, turn planning, and an end-to-end run of a tiny Qwen3-VL with two LoRA adapters (offline, CPU)."""

import copy
import json
import math

import pytest
from offline_rows import CROP, TOOLS, eval_cfg, write_eval_data

from eogym_sft.data.encoding import render
from eogym_sft.demo import SAMPLE_JSONL
from eogym_sft.metrics.scoring import (
    Reference,
    combine_samples,
    extract_final_answer,
    mean_scores,
    normalize_answer,
    paired_stats,
    parse_output,
    score_output,
    values_match,
)

TOOL_NAMES = [t["function"]["name"] for t in TOOLS]
LIST = {"name": "get_optical_image_list", "arguments": {"image_url": "EO_GYM_DATA/a/b.jpg"}}


def call_text(name, arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def score(text, ref_calls=(), final=False, gt="", tol=1e-6, judged=None):
    ref = Reference(
        calls=list(ref_calls),
        content="Final Answer: x" if final else "",
        tool_names=TOOL_NAMES,
        is_final=final,
        gt_answer=gt,
    )
    return score_output(parse_output(text), ref, tol, judged=judged)


# ---------------------------------------------------------------- per-output scores


def test_right_tool_and_arguments():
    s = score(
        "Let me crop.\n"
        + call_text(CROP["name"], {"aoi": [0.25, 0.25, 0.75, 0.75], "image_url": "EO_GYM_DATA/a/b.jpg"})
        + "<|im_end|>",
        [CROP],
    )
    assert s == {
        "turn_correct": True,
        "action_match": True,
        "name_match": True,
        "call_match": True,
        "answer_exact": None,
        "answer_normalized": None,
        "answer_judge": None,
        "invalid_call": False,
        "unknown_tool": False,
        "answered_instead_of_call": False,
        "called_instead_of_answer": None,
        "no_answer": None,
        "truncated": False,
    }


def test_right_tool_wrong_arguments():
    s = score(call_text(CROP["name"], {"image_url": "EO_GYM_DATA/a/b.jpg", "aoi": [0.25, 0.25, 0.75, 0.5]}), [CROP])
    assert (s["name_match"], s["call_match"], s["turn_correct"], s["action_match"]) == (True, False, False, True)
    missing_key = score(call_text(CROP["name"], {"image_url": "EO_GYM_DATA/a/b.jpg"}), [CROP])
    assert (missing_key["name_match"], missing_key["call_match"]) == (True, False)


@pytest.mark.parametrize(
    "pred, ref, tol, expected",
    [
        (0.25 + 4e-7, 0.25, 1e-6, True),  # |diff| <= 1e-6 * max(1, ...)
        (0.25 + 2e-6, 0.25, 1e-6, False),
        (1e9 + 900, 1e9, 1e-6, True),  # relative above 1: 900 <= 1e-6 * 1e9
        (1e9 + 1100, 1e9, 1e-6, False),
        (0.26, 0.25, 0.02, True),  # the tolerance is a flag
        (5, 5.0, 0.0, True),  # int and float are both numbers
        ("5", 5, 1e-6, False),  # a string is not a number
        (True, 1, 1e-6, False),  # a bool is not a number
        (" a b ", "a b", 0.0, True),  # strings exact after strip
        ("A b", "a b", 0.0, False),
        ({"y": 1, "x": [1, 2]}, {"x": [1, 2], "y": 1}, 0.0, True),  # key order irrelevant
        ([2, 1], [1, 2], 0.0, False),  # lists are ordered
        ({"x": 1, "z": None}, {"x": 1}, 0.0, False),  # an extra key is a mismatch
        (None, None, 0.0, True),
    ],
)
def test_values_match(pred, ref, tol, expected):
    assert values_match(pred, ref, tol) is expected


def test_number_tolerance_in_a_call():
    near = score(
        call_text(CROP["name"], {"image_url": "EO_GYM_DATA/a/b.jpg", "aoi": [0.2500001, 0.25, 0.75, 0.75]}), [CROP]
    )
    far = score(
        call_text(CROP["name"], {"image_url": "EO_GYM_DATA/a/b.jpg", "aoi": [0.2500001, 0.25, 0.75, 0.75]}),
        [CROP],
        tol=1e-8,
    )
    assert (near["call_match"], far["call_match"]) == (True, False)


def test_arguments_as_a_json_string_follow_data_prep():
    text = (
        "<tool_call>" + json.dumps({"name": LIST["name"], "arguments": json.dumps(LIST["arguments"])}) + "</tool_call>"
    )
    assert score(text, [LIST])["call_match"] is True


def test_invalid_tool_call_json():
    s = score('<tool_call>\n{"name": "get_optical_image_list", "arguments": {"image_url": "x"}\n</tool_call>', [LIST])
    assert (s["invalid_call"], s["name_match"], s["call_match"], s["action_match"], s["answered_instead_of_call"]) == (
        True,
        False,
        False,
        True,
        False,
    )
    parsed = parse_output('<tool_call>{"name": "x"</tool_call>')
    assert parsed.calls == [None] and parsed.errors[0].startswith("invalid_tool_call")


def test_one_bad_block_does_not_hide_a_good_one():
    parsed = parse_output(call_text(**LIST) + "\n<tool_call>{not json}</tool_call>")
    assert parsed.calls == [LIST, None]
    s = score(call_text(**LIST) + "\n<tool_call>{not json}</tool_call>", [LIST])
    assert (s["invalid_call"], s["name_match"]) == (True, False)


def test_unclosed_tool_call_is_invalid():
    parsed = parse_output('Cropping now.\n<tool_call>\n{"name": "crop_optical_or_sar_image", "argu')
    assert parsed.calls == [None] and parsed.content == "Cropping now." and parsed.has_call


def test_unknown_tool():
    s = score(call_text("zoom_in", {"factor": 2}), [LIST])
    assert (s["unknown_tool"], s["name_match"], s["invalid_call"], s["action_match"]) == (True, False, False, True)
    assert score(call_text(**LIST), [LIST])["unknown_tool"] is False


def test_answer_instead_of_call():
    s = score("Final Answer: 5", [LIST])
    assert (s["answered_instead_of_call"], s["action_match"], s["turn_correct"], s["name_match"], s["call_match"]) == (
        True,
        False,
        False,
        False,
        False,
    )
    assert s["called_instead_of_answer"] is None and s["no_answer"] is None  # not the final turn


def test_call_instead_of_answer():
    s = score(call_text(**LIST), final=True, gt="5")
    assert (
        s["called_instead_of_answer"],
        s["action_match"],
        s["no_answer"],
        s["answer_normalized"],
        s["turn_correct"],
    ) == (
        True,
        False,
        True,
        False,
        False,
    )
    assert s["answered_instead_of_call"] is None and s["name_match"] is None


def test_missing_final_answer():
    s = score("The harbour holds five ships.", final=True, gt="5")
    assert (s["no_answer"], s["answer_exact"], s["answer_normalized"], s["turn_correct"], s["action_match"]) == (
        True,
        False,
        False,
        False,
        True,
    )


@pytest.mark.parametrize(
    "output, gt, exact, normalized",
    [
        ("Final Answer: 5", "5", True, True),
        ("Final Answer: 5.0<|im_end|>", "5", False, True),
        ("Final Answer: five", "5", False, False),  # number words are not numbers
        ("Final Answer: 5 m", "5m", False, True),
        ("final answer:  Next frame not available.", "Next frame not available", False, True),
        ("**Final Answer:** 1,000 ships", "1000 ships", False, True),
        ("Final Answer: 12%", "12 %", False, True),
        ("Final Answer: -3.50", "-3.5", False, True),
        ("Final Answer: 53", "5", False, False),
        ("Final Answer: built-up area", "Built up area", False, True),
    ],
)
def test_final_answer_matching(output, gt, exact, normalized):
    s = score(output, final=True, gt=gt)
    assert (s["answer_exact"], s["answer_normalized"], s["no_answer"]) == (exact, normalized, False)
    assert s["turn_correct"] is normalized


def test_extract_final_answer():
    assert extract_final_answer("I counted.\nFinal Answer: 7 ships\nDone") == "7 ships"
    assert extract_final_answer("Final Answer: a\nFinal Answer: b") == "b"
    assert extract_final_answer("Final Answer:\n\n 4") == "4"
    assert extract_final_answer("Final Answer:   ") is None
    assert extract_final_answer("The answer is 4") is None


def test_normalize_answer():
    assert normalize_answer("  The Airport, 5.0 M. ") == "the airport 5m"
    assert normalize_answer("0.50") == normalize_answer(".5") == "0.5"
    assert normalize_answer("v1.2.3") == "v1.2.3"


def test_multiple_calls_compare_as_ordered_lists():
    two = call_text(**LIST) + "\n" + call_text(**CROP)
    assert score(two, [LIST, CROP])["call_match"] is True
    swapped = score(call_text(**CROP) + "\n" + call_text(**LIST), [LIST, CROP])
    assert (swapped["name_match"], swapped["call_match"]) == (False, False)
    assert score(call_text(**LIST), [LIST, CROP])["name_match"] is False


def test_judge_verdict_is_recorded_on_final_turns_only():
    assert score("Final Answer: a harbour", final=True, gt="port", judged=True)["answer_judge"] is True
    assert score("Final Answer: 5", final=True, gt="5")["answer_judge"] is None  # no judge ran
    assert score(call_text(**LIST), [LIST], judged=True)["answer_judge"] is None


def test_combine_samples_mean_and_pass_at_k():
    samples = [
        score(call_text(**LIST), [LIST]),
        score("Final Answer: 1", [LIST]),
        score(call_text("zoom", {}), [LIST]),
    ]
    combined = combine_samples(samples, 3)
    assert combined["call_match"] == pytest.approx(1 / 3)
    assert combined["call_match@3"] == 1.0
    assert combined["unknown_tool"] == pytest.approx(1 / 3)
    assert combined["answer_normalized"] is None and combined["answer_normalized@3"] is None
    assert "unknown_tool@3" not in combined


def test_mean_scores_skip_not_applicable():
    turns = [
        {"call_match": 1.0, "name_match": 1.0},
        {"call_match": 0.0, "name_match": 1.0},
        {"call_match": None, "name_match": None},
    ]
    out = mean_scores(turns)
    assert out["call_match"] == {"mean": 0.5, "n": 2}
    assert out["args_match_given_name"] == {"mean": 0.5, "n": 2}


# ---------------------------------------------------------------- paired statistics


def test_paired_stats_by_hand():
    # diffs b - a = [0, 1, 0, 1, -1]; mean 0.2; squared deviations 0.04+0.64+0.04+0.64+1.44 = 2.8;
    # sample variance 2.8/4 = 0.7; SE = sqrt(0.7/5) = sqrt(0.14). Clusters t1={0,1}, t2={2,3}, t3={4}:
    # summed deviations 0.6, 0.6, -1.2; CR1 SE = sqrt(3/2 * (0.36+0.36+1.44)) / 5 = sqrt(3.24)/5 = 0.36.
    a, b = [1, 0, 1, 0, 1], [1, 1, 1, 1, 0]
    out = paired_stats(a, b, clusters=["t1", "t1", "t2", "t2", "t3"])
    assert out["n"] == 5 and out["n_clusters"] == 3
    assert out["mean_a"] == pytest.approx(0.6) and out["mean_b"] == pytest.approx(0.8)
    assert out["delta"] == pytest.approx(0.2)
    assert out["se"] == pytest.approx(math.sqrt(0.14))
    t4 = 2.7764451051977934  # Student's t, 97.5%, 4 degrees of freedom
    assert out["ci95"] == pytest.approx([0.2 - t4 * math.sqrt(0.14), 1.0], rel=1e-9)  # 0.2 + t4 SE = 1.239: cut at 1
    assert out["ci_method"] == "paired t, clipped to [-1, 1]"
    assert (out["wins"], out["losses"], out["ties"]) == (2, 1, 2)
    assert out["se_clustered"] == pytest.approx(0.36)


def test_paired_stats_one_unit_per_cluster_equals_plain_se():
    a, b = [0.0, 0.5, 1.0, 0.0], [1.0, 0.5, 0.0, 1.0]
    out = paired_stats(a, b, clusters=["p", "q", "r", "s"])
    assert out["se_clustered"] == pytest.approx(out["se"])
    assert paired_stats([1.0], [0.0])["se"] is None
    with pytest.raises(ValueError):
        paired_stats([1.0], [])


# ---------------------------------------------------------------- planning and end to end


def _varied_config():
    """A tiny config whose random weights give varied greedy tokens (the default init repeats one token)."""
    from eogym_sft.models.tiny import TINY_QWEN3_VL_CONFIG

    config = copy.deepcopy(TINY_QWEN3_VL_CONFIG)
    config["text_config"]["initializer_range"] = 1.0
    return config


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_eval_data(tmp_path_factory.mktemp("eval_data"))


SAMPLE = SAMPLE_JSONL


@pytest.mark.skipif(not SAMPLE.is_file(), reason="the bundled sample is not there")
def test_bundled_sample_reference_turns_score_perfectly(processor):
    """Parity of data prep and scoring: every reference turn of the bundled sample, rendered by the chat
    template as the training target and parsed back, is a correct next action and answer."""
    from eogym_sft.evaluation.offline import plan_turns, read_traces

    cfg = eval_cfg((SAMPLE.parent, SAMPLE))
    traces, failures = read_traces(cfg)
    prompts, skipped = plan_turns(processor, traces, cfg)
    assert len(traces) == 41 and {f["reason"] for f in failures} == {
        "malformed_json",
        "unknown_role",
        "invalid_tool_arguments",
    }
    assert {s["reason"] for s in skipped} == {"missing_image"}
    by_id = {t.id: t for _, t in traces}
    finals = 0
    for p in prompts:
        trace = by_id[p.trace_id]
        target = render(processor, trace.messages[: p.message_index + 1], trace.tools)[len(p.text) :]
        scores = score_output(parse_output(target), p.reference, 0.0)
        assert scores["turn_correct"] and scores["action_match"] and not scores["invalid_call"], (p.trace_id, p.turn)
        assert scores["unknown_tool"] is False
        finals += p.reference.scores_answer
    assert len(prompts) >= 100 and finals == 40


def echo_judge(question, prediction, reference):
    """A judge for the end-to-end test: right when the prediction contains the reference."""
    assert "How many ships" in question
    return reference in prediction


def test_score_turns_calls_the_judge_on_final_answers(data, processor):
    from eogym_sft.evaluation.offline import (
        load_judge,
        plan_turns,
        read_traces,
        score_turns,
    )

    cfg = eval_cfg(data)
    prompts = plan_turns(processor, read_traces(cfg)[0], cfg)[0][:2]  # r1: a call turn, then the final turn
    outputs = [["Final Answer: 5"], ["Let me count.\nFinal Answer: 5 ships<|im_end|>"]]
    generations = [{"outputs": o, "finished": [True], "new_tokens": [9]} for o in outputs]
    judge = load_judge(f"{__name__}:echo_judge")
    call_turn, final_turn = score_turns("base", prompts, generations, cfg, judge)
    assert call_turn["scores"]["answer_judge"] is None and call_turn["scores"]["answered_instead_of_call"] == 1.0
    assert final_turn["scores"]["answer_judge"] == 1.0  # "5" is in "5 ships"
    assert (final_turn["scores"]["answer_normalized"], final_turn["scores"]["answer_exact"]) == (0.0, 0.0)

    def broken(question, prediction, reference):
        raise TimeoutError("judge API down")

    (record,) = score_turns("base", prompts[1:], generations[1:], cfg, broken)
    assert record["scores"]["answer_judge"] is None and "TimeoutError" in record["judge_errors"][0]
    with pytest.raises(ValueError, match="module:function"):
        load_judge("no_colon")


@pytest.fixture(scope="module")
def models(tmp_path_factory, processor):
    """A tiny Qwen3-VL folder and two LoRA adapters on it with different random weights."""
    import torch
    from peft import LoraConfig, get_peft_model

    from eogym_sft.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("eval_models")
    build_tiny_model(0, _varied_config()).save_pretrained(root / "base")
    processor.save_pretrained(root / "base")
    for seed in (1, 2):
        model = build_tiny_model(0, _varied_config())  # seeds torch with 0 itself
        torch.manual_seed(seed)
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        get_peft_model(model, lora).save_pretrained(root / f"lora{seed}")
    return root


def test_end_to_end_two_adapters_on_identical_turns(data, models, tmp_path, capsys):
    from eogym_sft.cli import main

    root, path = data
    out = tmp_path / "eval"
    adapters = ["--adapter", f"one={models / 'lora1'}", str(models / "lora2")]
    data_args = ["--data", str(path), "--data-root", str(root), "--output", str(out)]
    run_args = ["--max-new-tokens", "4", "--batch-size", "4", "--no-progress", "--judge", f"{__name__}:echo_judge"]
    main(["evaluate", "--model", str(models / "base"), *adapters, *data_args, *run_args])
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    arms = ["base", "one", "lora2"]
    assert list(summary["arms"]) == arms
    by_arm = {a: {(r["trace_id"], r["turn"]): r for r in records if r["arm"] == a} for a in arms}
    keys = set(by_arm["base"])
    assert len(keys) == 6 and all(set(by_arm[a]) == keys for a in arms)
    assert ("r5", 1) not in keys  # its crop does not decode: skipped in every arm
    for key in keys:  # identical prompts in every arm
        assert len({by_arm[a][key]["prompt_sha256"] for a in arms}) == 1
    outputs = {a: [by_arm[a][k]["outputs"][0] for k in sorted(keys)] for a in arms}
    assert len({tuple(v) for v in outputs.values()}) == 3  # the adapters really are switched in
    pairs = {(p["a"], p["b"]) for p in summary["paired"]}
    assert pairs == {("base", "one"), ("base", "lora2"), ("one", "lora2")}
    turn_pairs = [p for p in summary["paired"] if p["metric"] == "turn_correct"]
    assert [p["n"] for p in turn_pairs] == [6, 6, 6]
    assert all(p["wins"] + p["losses"] + p["ties"] == 6 for p in turn_pairs)
    counts = summary["counts"]
    assert (counts["rows_in"], counts["rows_failed"], counts["turns_scored"], counts["turns_skipped"]) == (8, 4, 6, 2)
    skipped = [json.loads(line) for line in (out / "skipped.jsonl").read_text().splitlines()]
    assert {s["reason"] for s in skipped} == {
        "malformed_json",
        "blank_line",
        "no_assistant_turn",
        "duplicate_id",
        "missing_image",
        "corrupt_image",
    }
    final = by_arm["base"][("r1", 1)]
    assert final["gt_answer"] == "5" and final["sample_scores"][0]["answer_judge"] is not None
    assert "Object Counting" in summary["arms"]["one"]["by_EO_task"]
    assert "95% CI, paired t" in capsys.readouterr().out


def test_batching_and_base_arm_match_a_plain_model(data, models, processor):
    """Left-padded batches give the greedy tokens of one-by-one generation, and the base arm of a peft
    model (adapters disabled) gives the plain base model's tokens; bf16 runs on CPU too."""
    from eogym_sft.evaluation.offline import (
        Arm,
        generate_turns,
        load_model,
        plan_turns,
        read_traces,
        use_arm,
    )

    cfg = eval_cfg(data, model=str(models / "base"), max_new_tokens=4, batch_size=1)
    prompts = plan_turns(processor, read_traces(cfg)[0], cfg)[0][:3]  # 1, 2 and no images
    plain = load_model(cfg, [Arm("base")])
    one_by_one = generate_turns(plain, processor, prompts, cfg)
    cfg.batch_size = 4
    assert generate_turns(plain, processor, prompts, cfg) == one_by_one
    arms = [Arm("base"), Arm("one", str(models / "lora1"), "arm0")]
    wrapped = load_model(cfg, arms)
    with use_arm(wrapped, arms[0]):
        assert generate_turns(wrapped, processor, prompts, cfg) == one_by_one
    with use_arm(wrapped, arms[1]):
        assert generate_turns(wrapped, processor, prompts, cfg) != one_by_one
    cfg.dtype = "bfloat16"
    (bf16,) = generate_turns(load_model(cfg, [Arm("base")]), processor, prompts[1:2], cfg)  # two images
    assert len(bf16["outputs"]) == 1 and bf16["new_tokens"][0] > 0


def test_sampling_gives_k_outputs_and_pass_at_k(data, models, processor):
    from eogym_sft.evaluation.offline import (
        Arm,
        generate_turns,
        load_model,
        plan_turns,
        read_traces,
        score_turns,
    )

    cfg = eval_cfg(data, model=str(models / "base"), max_new_tokens=4, samples=3, temperature=1.0)
    prompts, _ = plan_turns(processor, read_traces(cfg)[0], cfg)
    generations = generate_turns(load_model(cfg, [Arm("base")]), processor, prompts[:2], cfg)
    records = score_turns("base", prompts[:2], generations, cfg)
    assert all(len(r["outputs"]) == 3 == len(r["sample_scores"]) for r in records)
    assert "turn_correct@3" in records[0]["scores"]
    with pytest.raises(ValueError, match="temperature"):
        eval_cfg(data, samples=3)


def test_evaluate_refuses_another_base_and_a_non_empty_output(data, models, tmp_path):
    import shutil

    from eogym_sft.cli import main

    root, path = data
    other = tmp_path / "other"
    shutil.copytree(models / "lora1", other)
    config = json.loads((other / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps(dict(config, base_model_name_or_path="Qwen/Qwen3-VL-8B-Instruct")))
    argv = ["evaluate", "--model", str(models / "base"), "--data", str(path), "--data-root", str(root), "--no-progress"]
    with pytest.raises(SystemExit, match=rf"other was trained on 'Qwen/Qwen3-VL-8B-Instruct' but --model is '{models / 'base'}'"):
        main([*argv, "--adapter", str(other), "--output", str(tmp_path / "eval")])
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "notes.txt").write_text("an earlier run")
    with pytest.raises(SystemExit, match="used exists and is not empty"):
        main([*argv, "--output", str(tmp_path / "used")])


def test_evaluate_with_a_wrong_data_root_stops_with_the_likely_cause(tmp_path, row_factory, tiny_model_dir):
    from eogym_sft.cli import main

    data = tmp_path / "test.jsonl"
    data.write_text("\n".join(json.dumps(row_factory(row_id=f"t{k}")) for k in range(2)) + "\n")
    argv = ["evaluate", "--model", str(tiny_model_dir), "--data", str(data), "--data-root", str(tmp_path), "--output", str(tmp_path / "out"), "--no-progress"]
    with pytest.raises(SystemExit, match=r"^eogym-sft evaluate: 6 of 6 turns dropped as missing_image .*likely cause: the images are not under --data-root"):
        main(argv)
    assert not (tmp_path / "out" / "summary.json").exists()


def test_the_slot_decoder_gives_the_greedy_outputs_of_generate(data, models, processor):
    """Greedy turns on the slot decoder (what evaluate runs) equal plain ``generate``'s, in the base arm
    and an adapter arm, undecodable images included."""
    from eogym_sft.evaluation.offline import (
        Arm,
        decode_turns,
        generate_turns,
        load_model,
        plan_turns,
        read_traces,
        turn_decoder,
        use_arm,
    )

    cfg = eval_cfg(data, model=str(models / "base"), max_new_tokens=6, batch_size=2)
    prompts = plan_turns(processor, read_traces(cfg)[0], cfg)[0]
    arms = [Arm("base"), Arm("one", str(models / "lora1"), "arm0")]
    model = load_model(cfg, arms)
    decoder = turn_decoder(model, prompts, cfg)
    assert decoder.slots == 2 and decoder.max_len == max(p.prompt_tokens for p in prompts) + 8
    outputs = []
    for arm in arms:
        with use_arm(model, arm):
            want = generate_turns(model, processor, prompts, cfg)
            got = decode_turns(decoder, processor, prompts, cfg)
        decoder.reset()
        assert got == want, arm.name
        outputs.append(got)
    assert outputs[0] != outputs[1]  # the adapter is switched in
    assert any("error" in g for g in outputs[0]) and any("outputs" in g for g in outputs[0])
