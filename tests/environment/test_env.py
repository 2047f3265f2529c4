"""The environment end to end: a scripted policy (a stand-in model that emits known tool calls) drives it
over the bundled sample; mistakes come back as counted errors; a result shows the model exactly the
images data prep shows it for the same tool result."""

from __future__ import annotations

import json
import shutil

import pytest

from eogym_sft.data.traces import TraceError, normalize_row
from eogym_sft.environment.env import EOGymEnvironment, check_arguments

CROP = "crop_optical_or_sar_image"


@pytest.fixture(scope="module")
def sample_copy(sample_dir, tmp_path_factory):
    """A writable copy of the bundled sample (the environment writes crops into the data root)."""
    root = tmp_path_factory.mktemp("sample") / "sample"
    shutil.copytree(sample_dir, root)
    return root


def _good_rows(root) -> list[dict]:
    return [json.loads(line) for line in (root / "eogym_sample.jsonl").read_text().splitlines()[:40]]


def scripted_policy(row: dict):
    """The calls of the row's own gold trace, in order, then three mistakes."""
    trace = normalize_row(row)
    for msg in trace.messages:
        for call in msg.get("tool_calls", []):
            yield call["function"]["name"], json.dumps(call["function"]["arguments"])
    yield "segment_everything", "{}"  # not one of the row's tools
    yield CROP, '{"image_url": "EO_GYM_DATA/x/y.jpg", "aoi": [0.1, 0.1'  # truncated JSON
    yield CROP, {"image_url": "EO_GYM_DATA/x/y.jpg", "aoi": [0.9, 0.1, 0.2, 0.5]}  # x0 > x1


def test_a_scripted_policy_runs_every_sample_row(sample_copy):
    totals = {"calls": 0, "crop": 0, "replay": 0}
    for row in _good_rows(sample_copy):
        env = EOGymEnvironment(row, sample_copy)
        recorded = [m for m in normalize_row(row).messages if m["role"] == "tool"]
        results = [env.call(name, args) for name, args in scripted_policy(row)]
        *gold, unknown, truncated, bad_aoi = results
        assert len(gold) == len(recorded)
        for result, turn in zip(gold, recorded):
            assert result.ok, (row["id"], result.text)
            recorded_text = turn["content"][0]["text"]
            if result.name == CROP:  # computed, on the same box the trace recorded
                assert result.backend == "crop"
                assert json.loads(result.text)["bbox_px"] == json.loads(recorded_text)["bbox_px"]
                assert len(result.images) == 1 and result.images[0].startswith(str(sample_copy / "image_cache" / "crops"))
            else:  # replayed word for word, with the images prep attaches to that turn
                assert result.backend == "replay" and result.text == recorded_text
                assert result.message() == turn
        assert (unknown.ok, unknown.error) == (False, "unknown_tool")
        has_crop = any(t["function"]["name"] == CROP for t in env.tools)  # else the crop calls are unknown too
        bad = "bad_arguments" if has_crop else "unknown_tool"
        assert (truncated.ok, truncated.error) == (False, bad)
        assert (bad_aoi.ok, bad_aoi.error, bad_aoi.backend) == (False, bad, "crop" if has_crop else None)
        assert bad_aoi.text.startswith("Error: aoi must be normalised" if has_crop else "Error: unknown tool")
        n_crop = sum(r.name == CROP for r in gold)
        assert env.counts == {
            "calls": len(gold) + 3,
            "errors": 3,
            **({"error:unknown_tool": 1, "error:bad_arguments": 2} if has_crop else {"error:unknown_tool": 3}),
            **({"backend:crop": n_crop} if n_crop else {}),
            **({"backend:replay": len(gold) - n_crop} if len(gold) > n_crop else {}),
        }
        totals["calls"] += len(gold)
        totals["crop"] += n_crop
    assert (totals["calls"], totals["crop"]) == (98, 57)  # every sample crop recomputed on its recorded box


def test_the_environment_attaches_what_prep_attaches(sample_copy):
    """The same tool result, through prep (a trace holding it) and through the environment."""
    row = _good_rows(sample_copy)[0]
    listing_row = row  # its first call is get_optical_image_list, whose result lists two frames
    for attach in ("produced", "attach", "text", "text,crop_optical_or_sar_image=produced"):
        env = EOGymEnvironment(row, sample_copy, attach=attach)
        crop = env.call(CROP, {"image_url": row["images"][0], "aoi": [0.1, 0.2, 0.6, 0.7]})
        listing = env.call("get_optical_image_list", {"image_url": listing_row["images"][0]})
        assert crop.ok and listing.ok
        for result in (crop, listing):
            prepped = normalize_row(
                {
                    "id": "x",
                    "messages": [
                        {"role": "user", "content": "q"},
                        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": result.name, "arguments": result.arguments}}]},
                        {"role": "tool", "content": result.text},
                        {"role": "assistant", "content": "Final Answer: a"},
                    ],
                },
                attach,
            )
            assert [str(sample_copy / p) for p in prepped.images] == result.images, (attach, result.name)
            assert prepped.messages[2] == result.message()
    produced = EOGymEnvironment(row, sample_copy)
    assert len(produced.call("get_optical_image_list", {"image_url": row["images"][0]}).images) == 0
    assert len(EOGymEnvironment(row, sample_copy, attach="attach").call("get_optical_image_list", {"image_url": row["images"][0]}).images) == 2


def test_question_only_rows_run_the_crop_and_nothing_else(sample_copy):
    row = _good_rows(sample_copy)[0]
    question_only = {k: row[k] for k in ("id", "images", "tools")} | {"messages": row["messages"][:2]}
    env = EOGymEnvironment(question_only, sample_copy)
    assert env.call(CROP, {"image_url": row["images"][0], "aoi": [0, 0, 0.5, 0.5]}).ok
    listing = env.call("get_optical_image_list", {"image_url": row["images"][0]})
    assert (listing.ok, listing.error, listing.images) == (False, "no_backend", [])
    assert "get_optical_image_list cannot be run here" in listing.text
    assert env.counts["error:no_backend"] == 1 and env.counts["backend:crop"] == 1


def test_a_result_naming_an_image_prep_would_refuse_is_an_error(sample_copy):
    class Server:  # a user's own backend: any object with a name and answer()
        name = "mine"

        def answer(self, tool, arguments):
            return json.dumps({"cropped_path": arguments["image_url"]}), None

    whole = next((sample_copy / "image_cache" / "crops").glob("*.png")).read_bytes()
    (sample_copy / "image_cache" / "cut.png").write_bytes(whole[: len(whole) // 2])  # a good header, half a body
    row = _good_rows(sample_copy)[0]
    env = EOGymEnvironment(row, sample_copy, backends=(Server(),))
    for path in ("image_cache/crops/never_written.png", "image_cache/cut.png"):
        result = env.call(CROP, {"image_url": path, "aoi": [0, 0, 1, 1]})
        assert (result.ok, result.error, result.backend, result.images) == (False, "bad_image", "mine", [])
    assert "cut.png, which cannot be shown (corrupt_image)" in result.text
    assert env.counts["error:bad_image"] == 2


def test_settings_that_cannot_work_fail_at_construction(sample_copy, tmp_path):
    row = _good_rows(sample_copy)[0]
    with pytest.raises(ValueError, match="inside the data root"):
        EOGymEnvironment(row, sample_copy, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="needs http="):
        EOGymEnvironment(row, sample_copy, backends=("http",))
    with pytest.raises(ValueError, match="unknown backend 'vllm'"):
        EOGymEnvironment(row, sample_copy, backends=("vllm",))
    with pytest.raises(ValueError, match="must be one of produced, attach, text"):
        EOGymEnvironment(row, sample_copy, attach="produced,get_sar_image=all")
    with pytest.raises(TraceError, match="bad_field_type at tools"):
        EOGymEnvironment(dict(row, tools="[not json"), sample_copy)


def test_check_arguments():
    schema = {
        "type": "object",
        "properties": {"image_url": {"type": "string"}, "aoi": {"type": "array"}, "k": {"type": ["integer", "null"]}, "t": {"type": "number"}},
        "required": ["image_url"],
    }
    assert check_arguments(schema, {"image_url": "a", "aoi": [1], "k": None, "t": 2, "other": 1}) is None
    assert check_arguments(schema, {"aoi": [1]}) == "missing required argument(s): image_url"
    assert check_arguments(schema, {"image_url": 3}) == "argument 'image_url' must be string, got 3"
    assert check_arguments(schema, {"image_url": "a", "aoi": "[0, 0, 1, 1]"}) == 'argument \'aoi\' must be array, got "[0, 0, 1, 1]"'
    assert check_arguments(schema, {"image_url": "a", "t": True}) == "argument 't' must be number, got true"
    assert check_arguments(schema, {"image_url": "a", "k": 1.5}) == "argument 'k' must be integer or null, got 1.5"
    closed = dict(schema, additionalProperties=False)
    assert check_arguments(closed, {"image_url": "a", "zz": 1}) == "unknown argument(s): zz"


def test_tool_call_command(sample_copy, capsys):
    from eogym_sft.cli import main

    row = _good_rows(sample_copy)[0]
    image = normalize_row(row).images[0]  # 320x256
    main(["tool-call", "--data-root", str(sample_copy), CROP, json.dumps({"image_url": image, "aoi": [0.25, 0.25, 0.75, 0.75]})])
    out = json.loads(capsys.readouterr().out)
    assert (out["ok"], out["backend"], out["error"]) == (True, "crop", None)
    assert json.loads(out["text"])["bbox_px"] == [80, 64, 240, 192]
    assert out["images"] == [str(sample_copy / json.loads(out["text"])["cropped_path"])]
    # replay needs the row: its schemas and its trace
    args = json.dumps({"image_url": image})
    main(["tool-call", "--data-root", str(sample_copy), "--tools", "crop,replay", "--row", str(sample_copy / "eogym_sample.jsonl"), row["id"], "get_optical_image_list", args])
    out = json.loads(capsys.readouterr().out)
    assert (out["ok"], out["backend"], out["images"]) == (True, "replay", [])
    with pytest.raises(SystemExit) as stop:  # no backend answers: the error is printed, the exit status is 1
        main(["tool-call", "--data-root", str(sample_copy), "get_optical_image_list", args])
    assert stop.value.code == 1
    assert json.loads(capsys.readouterr().out)["error"] == "no_backend"


################
# A model's hostile calls are messages, never exceptions (issue 28)
################


def _crop_env(root, **kw):
    row = {"id": "r", "tools": [{"type": "function", "function": {"name": CROP, "parameters": {"type": "object"}}}]}
    return EOGymEnvironment(row, root, ("crop",), **kw)


def test_hostile_calls_are_bad_arguments_messages(sample_copy):
    image = normalize_row(_good_rows(sample_copy)[0]).images[0]
    env = _crop_env(sample_copy)
    cases = {
        "a long path": {"image_url": "a" * 5000 + ".jpg", "aoi": [0, 0, 1, 1]},  # ENAMETOOLONG
        "a long component": {"image_url": "EO_GYM_DATA/" + "b" * 300 + ".jpg", "aoi": [0, 0, 1, 1]},
        "a huge AOI integer": {"image_url": image, "aoi": [0, 0, 10**400, 1]},  # OverflowError in float()
        "a 10 MB AOI": {"image_url": image, "aoi": ["x" * (10 << 20), 0, 1, 1]},
    }
    for what, arguments in cases.items():
        result = env.call(CROP, arguments)
        assert (result.ok, result.error) == (False, "bad_arguments"), what
        assert len(result.text) < 400, what  # a short prefix of the argument, never all of it
    hostile = '{"image_url": "a", "aoi": ' + "[" * 100000 + "]" * 100000 + "}"
    result = env.call(CROP, hostile)
    assert (result.ok, result.error) == (False, "bad_arguments") and "json_too_deep" in result.text
    assert env.counts["error:bad_arguments"] == 5


def test_a_broken_crop_cache_is_a_message(sample_copy, tmp_path):
    image = normalize_row(_good_rows(sample_copy)[0]).images[0]
    cache = sample_copy / "image_cache" / "not_a_folder"
    cache.write_text("a file where the cache should be")
    try:
        result = _crop_env(sample_copy, cache_dir=cache).call(CROP, {"image_url": image, "aoi": [0.1, 0.1, 0.3, 0.3]})
    finally:
        cache.unlink()
    assert (result.ok, result.error, result.backend) == (False, "tool_failed", "crop")
    assert result.text.startswith("Error: the crop could not be saved to the crop cache")


def test_a_long_tool_text_is_cut_for_the_model(sample_copy):
    class Chatty:
        name = "chatty"

        def answer(self, tool, arguments):
            return "y" * 100, None

    env = EOGymEnvironment({"id": "r", "tools": [{"name": "t", "parameters": {}}]}, sample_copy, (Chatty(),), max_tool_text_chars=10)
    result = env.call("t", {})
    assert result.ok and result.text == "yyyyyyyyyy\n[result truncated: 90 more characters]"
    assert env.counts["truncated_results"] == 1


def test_find_row_skips_hostile_lines(tmp_path):
    from eogym_sft.environment.env import find_row

    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b"[" * 100000 + b"\n" + b'{"n": ' + b"9" * 5000 + b"}\n" + b'{"id": "r1"}\n')
    assert find_row(path, "r1") == {"id": "r1"}


def test_a_crop_without_image_url_takes_the_rows_only_image_where_the_schema_allows_it(tmp_path):
    from PIL import Image

    (tmp_path / "EO_GYM_DATA").mkdir()
    for name in ("a.png", "b.png"):
        Image.new("RGB", (8, 4), (10, 20, 30)).save(tmp_path / "EO_GYM_DATA" / name)
    optional = {"type": "object", "properties": {"image_url": {"type": "string"}, "aoi": {"type": "array"}}, "required": ["aoi"]}
    required = {**optional, "required": ["image_url", "aoi"]}

    def row(images, parameters):
        return {"id": "r", "images": images, "tools": [{"type": "function", "function": {"name": CROP, "parameters": parameters}}]}

    one = EOGymEnvironment(row(["EO_GYM_DATA/a.png"], optional), tmp_path).call(CROP, {"aoi": [0, 0, 0.5, 1]})
    named = EOGymEnvironment(row(["EO_GYM_DATA/a.png"], optional), tmp_path).call(CROP, {"image_url": "EO_GYM_DATA/a.png", "aoi": [0, 0, 0.5, 1]})
    assert one.ok and one.text == named.text and json.loads(one.text)["bbox_px"] == [0, 0, 4, 4]
    two = EOGymEnvironment(row(["EO_GYM_DATA/a.png", "EO_GYM_DATA/b.png"], optional), tmp_path).call(CROP, {"aoi": [0, 0, 0.5, 1]})
    assert (two.ok, two.error) == (False, "bad_arguments") and "image_url" in two.text  # which one? never guessed
    schema_says_no = EOGymEnvironment(row(["EO_GYM_DATA/a.png"], required), tmp_path).call(CROP, {"aoi": [0, 0, 0.5, 1]})
    assert (schema_says_no.ok, schema_says_no.error) == (False, "bad_arguments") and "missing required argument(s): image_url" in schema_says_no.text


def test_one_turn_runs_at_most_the_cap(sample_copy):
    from eogym_sft.environment.env import MAX_CALLS_PER_TURN

    row = _good_rows(sample_copy)[0]
    env = EOGymEnvironment(row, sample_copy)
    calls = [{"name": "segment_everything", "arguments": "{}"}] * 20_000
    results = env.call_turn(calls)
    assert MAX_CALLS_PER_TURN == 8 and len(results) == 9
    assert [r.error for r in results] == ["unknown_tool"] * 8 + ["too_many_calls"]
    assert results[-1].text == "Error: 20000 tool calls in one turn; only the first 8 were run, the other 19992 were not."
    assert (env.counts["calls"], env.counts["skipped_calls"]) == (8, 19_992)
    assert len(env.call_turn(calls[:8])) == 8 and env.counts["skipped_calls"] == 19_992
