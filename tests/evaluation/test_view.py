"""``eogym-sft view``: the page of rollouts, evaluations and training runs (eogym_sft/evaluation/view.py); what it
gathers from run folders is tested in test_view_data.py."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import pytest
from PIL import Image

from eogym_sft.cli import main
from eogym_sft.evaluation.report import summarize_rollouts
from eogym_sft.evaluation.view import (
    ViewError,
    embed_json,
    find_runs,
    render,
    serve,
    write_report,
)

SCENE = "EO_GYM_DATA/scene/a.png"
CROP = "image_cache/crops/c1.png"
SYSTEM = "Crop the quadrant, then reply: Final Answer: <colour>."
HOSTILE = "</script><script>document.title='pwned'</script><img src=x onerror=\"document.title='pwned'\"> \u2028&amp;"


class PageParser(HTMLParser):
    """The page's script elements (attributes and text) and whether every opened element was closed."""

    VOID = {"meta", "br", "img", "input", "link", "hr"}

    def __init__(self):
        super().__init__()
        self.scripts, self.stack, self.in_script = [], [], None

    def handle_starttag(self, tag, attrs):
        if tag not in self.VOID:
            self.stack.append(tag)
        if tag == "script":
            self.in_script = [dict(attrs), ""]

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes {self.stack[-1:]}"
        self.stack.pop()
        if tag == "script":
            self.scripts.append(tuple(self.in_script))
            self.in_script = None

    def handle_data(self, data):
        if self.in_script is not None:
            self.in_script[1] += data


def page_data(page: str) -> dict:
    parser = PageParser()
    parser.feed(page)
    parser.close()
    assert parser.stack == []
    blobs = [text for attrs, text in parser.scripts if attrs.get("id") == "eogym-data"]
    assert len(parser.scripts) == 2 and len(blobs) == 1
    return json.loads(blobs[0])


@pytest.fixture
def data_root(tmp_path) -> Path:
    root = tmp_path / "root"
    (root / "EO_GYM_DATA/scene").mkdir(parents=True)
    (root / "image_cache/crops").mkdir(parents=True)
    Image.new("RGB", (256, 256), (200, 30, 30)).save(root / SCENE)
    Image.new("RGB", (128, 128), (30, 200, 30)).save(root / CROP)
    shutil.copy(root / CROP, root / "image_cache/crops/same_bytes.png")
    return root


def episode(question: str, arm: str, sample: int, answer: str | None = "red", gt: str = "red", image=SCENE, crop=CROP) -> dict:
    """A record as agent.episodes.Episode.record() writes it: question, one crop call and its result, an answer."""
    call = {"type": "function", "function": {"name": "crop_optical_or_sar_image", "arguments": json.dumps({"aoi": [0, 0, 0.5, 0.5]})}}
    result = {"cropped_path": crop, "width": 128, "height": 128, "bbox_px": [0, 0, 128, 128], "aoi_norm": [0.0, 0.0, 0.5, 0.5]}
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"<image>\nWhat colour is the top-left quadrant of {question}?"},
        {"role": "assistant", "content": "", "generated": "<tool_call>...</tool_call>", "tool_calls": [call]},
        {"role": "tool", "content": json.dumps(result)},
        {"role": "assistant", "content": f"Final Answer: {answer}", "generated": f"Final Answer: {answer}"},
    ]
    correct = None if answer is None else answer == gt
    return {
        "id": f"{question}:{arm}:{sample}", "images": [image], "messages": messages, "gt_answer": gt, "EO_task": "colour",
        "question_type": "quadrant", "data_source": "test", "source_id": question, "source": f"q.jsonl:{question}", "arm": arm,
        "sample": sample, "stop_reason": "final_answer" if answer else "no_call", "error": None, "turns": 2, "tool_calls": 1,
        "tool_errors": 0, "tool_error_codes": {}, "new_tokens": 40, "final_answer": answer, "images_seen": [image],
        "rule_correct": correct, "correct": correct, "judge_error": None,
    }


def write_rollout(folder: Path, records: list[dict], data_root: Path, summary: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "episodes.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    (folder / "run.json").write_text(json.dumps({"data_root": str(data_root)}))
    if summary:
        arms = list(dict.fromkeys(r["arm"] for r in records))
        (folder / "summary.json").write_text(json.dumps(summarize_rollouts(records, arms, [1, 2], {"ks": [1, 2]}, {}, {})))
    return folder


def two_arm_records() -> list[dict]:
    return [episode(q, arm, k, answer="red" if arm == "sft" else "blue") for q in ("q0", "q1") for arm in ("base", "sft") for k in (0, 1)]


def test_page_parses_and_holds_every_episode_with_its_summary(tmp_path, data_root):
    records = two_arm_records()
    run = write_rollout(tmp_path / "roll", records, data_root)
    page = render(find_runs([run]))
    data = page_data(page)
    assert [e["id"] for e in data["runs"][0]["episodes"]] == [r["id"] for r in records]
    first = data["runs"][0]["episodes"][0]
    assert [m["r"] for m in first["msgs"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert data["texts"][first["msgs"][0]["t"]] == SYSTEM and data["texts"].count(SYSTEM) == 1  # interned once
    assert first["msgs"][2]["calls"] == [{"n": "crop_optical_or_sar_image", "a": '{"aoi": [0, 0, 0.5, 0.5]}'}]
    assert (first["answer"], first["gt"], first["correct"]) == ("blue", "red", False)
    assert "<td>sft</td><td>2</td><td>4</td><td>1.000</td><td>1.000</td>" in page  # per arm: questions, episodes, pass@1, pass@2
    assert "<td>base</td><td>sft</td><td>pass@1</td><td>2</td><td>0.000</td><td>1.000</td><td>+1.000</td>" in page


def test_images_are_embedded_thumbnails_deduplicated_with_the_crop_box(tmp_path, data_root):
    records = [episode("q0", "base", 0), episode("q1", "base", 0, crop="image_cache/crops/same_bytes.png")]
    data = page_data(render(find_runs([write_rollout(tmp_path / "roll", records, data_root)]), str(data_root)))
    images = data["images"]
    assert len(images) == 2  # the scene, and one crop for two files of the same bytes
    for entry in images.values():
        assert entry["src"].startswith("data:image/png;base64,")
        assert Path(entry["file"].removeprefix("file://")).is_relative_to(data_root)
    user, tool = data["runs"][0]["episodes"][1]["msgs"][1], data["runs"][0]["episodes"][1]["msgs"][3]
    assert images[user["img"][0]]["path"] == SCENE and (images[user["img"][0]]["w"], images[user["img"][0]]["h"]) == (256, 256)
    assert tool["img"] == data["runs"][0]["episodes"][0]["msgs"][3]["img"]
    assert tool["box"] == {"img": user["img"][0], "aoi": [0.0, 0.0, 0.5, 0.5]}


def test_over_the_image_budget_an_image_is_a_link_to_its_file(tmp_path, data_root):
    run = write_rollout(tmp_path / "roll", [episode("q0", "base", 0)], data_root)
    images = page_data(render(find_runs([run]), str(data_root), image_budget=0))["images"]
    assert all("src" not in e and e["file"].startswith("file://") for e in images.values())


def test_hostile_text_stays_text(tmp_path, data_root):
    record = episode(HOSTILE, "base", 0, answer=HOSTILE)
    page = render(find_runs([write_rollout(tmp_path / "roll", [record], data_root)]))
    assert "document.title" in page and "<script>document" not in page and "<img src=x" not in page and "\u2028" not in page
    data = page_data(page)
    ep = data["runs"][0]["episodes"][0]
    assert ep["id"] == record["id"] and ep["answer"] == HOSTILE
    assert data["texts"][ep["msgs"][1]["t"]] == f"What colour is the top-left quadrant of {HOSTILE}?"


def test_embed_json_escapes_what_could_end_the_script():
    assert embed_json({"a": "</script><!--&\u2028\u2029"}) == '{"a":"\\u003c/script\\u003e\\u003c!--\\u0026\\u2028\\u2029"}'


def test_a_missing_or_broken_image_is_a_named_placeholder(tmp_path, data_root):
    (data_root / "image_cache/crops/broken.png").write_bytes(b"not a png")
    records = [episode("q0", "base", 0, image="EO_GYM_DATA/scene/gone.png"), episode("q1", "base", 0, crop="image_cache/crops/broken.png"),
               episode("q2", "base", 0, image="../outside.png")]
    data = page_data(render(find_runs([write_rollout(tmp_path / "roll", records, data_root)]), str(data_root)))
    missing = {e["path"]: e["missing"] for e in data["images"].values() if "missing" in e}
    assert missing["EO_GYM_DATA/scene/gone.png"] == "cannot be opened (No such file or directory)"
    assert missing["image_cache/crops/broken.png"].startswith("does not decode (")
    assert missing["../outside.png"] == "unsafe_image_path"
    assert [e["id"] for e in data["runs"][0]["episodes"]] == ["q0:base:0", "q1:base:0", "q2:base:0"]


def test_a_bad_line_is_named_and_the_rest_shown_and_an_unfinished_run_is_summarised(tmp_path, data_root):
    run = write_rollout(tmp_path / "roll", two_arm_records(), data_root, summary=False)
    with open(run / "episodes.jsonl", "a") as fh:
        fh.write(json.dumps({"id": "no fields"}) + "\n" + '{"id": "cut sho')
    page = render(find_runs([run]))
    assert [e["id"] for e in page_data(page)["runs"][0]["episodes"]][-2:] == ["q1:sft:1", "no fields"]
    assert f"{run / 'episodes.jsonl'}:10: not usable JSON (malformed_json: Unterminated string starting at at column 8): skipped" in page
    assert f"{run}: 1 episodes lack one of arm, source_id," in page
    assert "no summary.json (an unfinished run)" in page and "<td>sft</td><td>2</td><td>4</td><td>1.000</td><td>1.000</td>" in page


def test_ten_thousand_episodes_render_small_and_fast(tmp_path, data_root):
    for i in range(50):
        Image.new("RGB", (300, 200), (i * 5, 100, 200 - i * 3)).save(data_root / f"EO_GYM_DATA/scene/s{i}.png")
    records = [episode(f"q{i}", arm, 0, image=f"EO_GYM_DATA/scene/s{i % 50}.png") for i in range(5000) for arm in ("base", "sft")]
    run = write_rollout(tmp_path / "roll", records, data_root)
    start = time.perf_counter()
    out = write_report([run], tmp_path / "report.html")
    seconds = time.perf_counter() - start
    size = out.stat().st_size
    assert len(page_data(out.read_text())["runs"][0]["episodes"]) == 10_000
    assert size < 12 * 2**20, size
    assert seconds < 60, seconds  # 15 s on the 2-core box under a load of 12


def grpo_state(folder: Path) -> Path:
    history = [{"step": s, "loss": 0.1 * s, "reward": 0.5 + 0.1 * s, "reward_std": 0.2, "completions/clipped_ratio": 0.0,
                "tools/call_frequency": 1.0, "rollout/seconds": 3.0, "epoch": 0.1 * s} for s in (1, 2, 3)]
    (folder / "checkpoint-3").mkdir(parents=True)
    (folder / "checkpoint-1").mkdir()
    (folder / "checkpoint-3/trainer_state.json").write_text(json.dumps({"global_step": 3, "log_history": history}))
    (folder / "checkpoint-1/trainer_state.json").write_text(json.dumps({"global_step": 1, "log_history": history[:1]}))
    return folder


def test_training_runs_plot_the_keys_that_exist(tmp_path):
    run = grpo_state(tmp_path / "grpo")
    page = render(find_runs([run]))
    metrics = [line.split('"')[1] for line in page.split("<figure data-metric=")[1:]]
    assert metrics == ["loss", "reward", "reward_std", "completions/clipped_ratio", "tools/call_frequency", "rollout/seconds"]
    assert "global step 3" in page and "checkpoint-3" in page and "<summary>1 more logged metrics</summary>" in page
    assert page.count('src="data:image/svg+xml;base64,') == 6


def test_a_demo_folder_shows_each_of_its_runs(tmp_path, data_root):
    demo = tmp_path / "demo"
    write_rollout(demo / "rollout", [episode("q0", "base", 0)], data_root)
    grpo_state(demo / "grpo")
    (demo / "validation.json").write_text(json.dumps({"samples": 3, "models": {"base": {"overall": {"token_accuracy": 0.5, "loss": 2.0}}}}))
    (demo / "task").mkdir()
    runs = find_runs([demo])
    assert [(r.kind, r.name) for r in runs] == [
        ("training", "demo/grpo"), ("rollout", "demo/rollout"), ("validation", "demo/validation.json")
    ]
    page = render(runs)
    assert "<td>base</td><td>0.500</td><td>2.000</td>" in page  # the validation report
    assert page.count("<section id=") == 3 and len(page_data(page)["runs"]) == 1  # the rollout's episodes


def test_the_report_never_overwrites_a_run_file(tmp_path, data_root):
    """The page follows every command's output rule (eogym_sft.guards.check_output, tested there for every
    command): not over a run's file, even with overwrite; an existing page needs overwrite."""
    run = write_rollout(tmp_path / "roll", [episode("q0", "base", 0)], data_root)
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    for name in ("summary.json", "episodes.jsonl", "run.json"):
        with pytest.raises(FileExistsError, match=f"{run / name} belongs to the rollout in {run} \\(it holds run.json\\)"):
            write_report([run], run / name, overwrite=True)
    bare = write_rollout(tmp_path / "bare", [episode("q0", "base", 0)], data_root)
    (bare / "run.json").unlink()  # no record: still the folder view reads
    (bare / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="notes.txt is a file of an input folder this command reads"):
        write_report([bare], bare / "notes.txt", overwrite=True)
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before and (bare / "notes.txt").read_text() == "mine"
    page = write_report([run], run / "report.html", overwrite=False)  # a new file in the run's folder: fine
    with pytest.raises(FileExistsError, match="exists and is not empty: pick another output or pass --overwrite"):
        write_report([run], page, overwrite=False)
    write_report([run], page, overwrite=True)  # its own earlier page


def test_evaluation_turns_are_shown_per_arm(tmp_path):
    folder = tmp_path / "eval"
    folder.mkdir()
    crop = [{"name": "crop", "arguments": {"aoi": [0, 0, 1, 1]}}]
    record = {"arm": "base", "trace_id": "t1", "turn": 0, "source": "d.jsonl:1", "EO_task": "colour", "question_type": "q",
              "reference": {"action": "call", "content": "", "calls": crop, "is_final": False},
              "gt_answer": None, "outputs": ["<tool_call>x</tool_call>"], "finished": [True],
              "parsed": [{"content": "", "calls": crop, "errors": [], "final_answer": None}],
              "scores": {"turn_correct": 1.0, "call_match": 1.0, "answer_exact": None}}
    (folder / "results.jsonl").write_text(json.dumps(record) + "\n")
    (folder / "summary.json").write_text(json.dumps({"arms": {"base": {"overall": {"turn_correct": {"mean": 1.0, "n": 1}}}}, "paired": []}))
    page = render(find_runs([folder]))
    ep = page_data(page)["runs"][0]["episodes"][0]
    assert (ep["id"], ep["q"], ep["correct"], ep["stop"]) == ("t1:0:base", "t1:0", True, "call")
    assert [m["r"] for m in ep["msgs"]] == ["reference", "assistant"]
    assert ep["msgs"][0]["calls"] == ep["msgs"][1]["calls"] == [{"n": "crop", "a": '{"aoi": [0, 0, 1, 1]}'}]
    assert "<td>base</td><td>1</td><td>1.000</td>" in page


def test_serve_answers_the_page_on_localhost_only(tmp_path):
    report = tmp_path / "report.html"
    report.write_text("<!doctype html><p>hi</p>")
    urls = []
    thread = threading.Thread(target=serve, args=(report, 0, 5.0, urls.append))
    thread.start()
    while not urls:
        time.sleep(0.01)
    assert urls[0].startswith("http://127.0.0.1:") and urls[0].endswith("/report.html")
    assert urllib.request.urlopen(urls[0]).read() == report.read_bytes()
    with pytest.raises(urllib.error.HTTPError, match="404"):
        urllib.request.urlopen(urls[0].replace("report.html", "etc/passwd"))
    thread.join(timeout=10)
    assert not thread.is_alive()  # stopped by its time bound


def test_the_viewer_imports_neither_torch_nor_matplotlib_nor_training():
    code = "import sys, eogym_sft.evaluation.view; print([m for m in ('torch', 'matplotlib', 'eogym_sft.training') if m in sys.modules])"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


def test_the_command_writes_the_page_and_says_where(tmp_path, data_root, capsys):
    run = write_rollout(tmp_path / "roll", two_arm_records(), data_root)
    main(["view", str(run), "--output", str(tmp_path / "out/report.html")])
    assert capsys.readouterr().out.startswith(f"wrote {tmp_path / 'out/report.html'} (")
    assert len(page_data((tmp_path / "out/report.html").read_text())["runs"][0]["episodes"]) == 8


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (apt-get install chromium)")
def test_a_browser_renders_the_episodes_and_runs_no_injected_script(tmp_path, data_root):
    records = [episode(HOSTILE, "base", 0, answer=HOSTILE)] + [episode(f"q{i}", "base", 0) for i in range(59)]
    records.append(episode("q59", "base", 0, crop="image_cache/crops/gone.png"))
    out = write_report([write_rollout(tmp_path / "roll", records, data_root)], tmp_path / "report.html", str(data_root))

    def dom(url: str) -> str:
        return subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}",
             "--virtual-time-budget=5000", "--dump-dom", url], capture_output=True, text=True, timeout=120,
        ).stdout

    opened = dom(out.as_uri() + "#episode=q59:base:0")  # on page 2, opened: its turns, images, crop box, placeholder
    assert 'data-ready="1"' in opened and opened.count("data-episode-id=") == 11 and opened.count('class="ep-body"') == 1
    assert opened.count('<div class="msg ') == 5 and opened.count('class="box"') == 1 and opened.count('<span class="thumb">') == 2
    assert 'data-placeholder="image_cache/crops/gone.png"' in opened
    dom = dom(out.as_uri())
    assert 'data-ready="1"' in dom
    assert dom.count("data-episode-id=") == 50  # the first page
    assert 'data-total="61"' in dom and "61 of 61 episodes" in dom
    assert "<title>eogym-sft view: roll</title>" in dom and "pwned</title>" not in dom
    assert '<span class="ep-id">&lt;/script&gt;&lt;script&gt;document.title=\'pwned\'&lt;/script&gt;&lt;img src=x ' in dom  # as text
    assert '<img src="x"' not in dom and "<script>document.title" not in dom


ODD_STRINGS = ["__proto__", "constructor", "toString", "hasOwnProperty", "(all)", "=", "", "%E0%A4%A"]


def odd_runs(tmp_path, data_root) -> list[Path]:
    """Three runs: every odd string as a question, an arm and a task; one with an episode whose fields are of
    every wrong type; one plain run."""
    odd = [episode(s, a, 0) | {"EO_task": s, "stop_reason": s} for s in ODD_STRINGS for a in ("__proto__", "base")]
    broken = [episode("fine", "base", 0), episode("worse", "base", 0) | {"id": ["x"], "arm": {"a": 1}, "messages": "x", "sample": "x"}]
    plain = [episode(f"p{i}", "base", 0) for i in range(3)]
    runs = [write_rollout(tmp_path / "odd", odd, data_root), write_rollout(tmp_path / "broken", broken, data_root, summary=False)]
    return runs + [write_rollout(tmp_path / "plain", plain, data_root)]


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (apt-get install chromium)")
def test_a_browser_shows_every_run_whatever_its_ids_questions_and_arms(tmp_path, data_root):
    """``__proto__`` as a question stopped the page's script: no episode of any run was listed. Each odd string is a
    question, an arm and a task here, and one run has a record of wrong types: every run's episodes are listed,
    filtering on an odd arm keeps its episodes, and the odd question's arms open side by side."""
    out = write_report(odd_runs(tmp_path, data_root), tmp_path / "report.html", str(data_root))

    def dom(fragment: str = "") -> str:
        return subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}",
             "--virtual-time-budget=5000", "--dump-dom", out.as_uri() + fragment], capture_output=True, text=True, timeout=120,
        ).stdout

    page = dom()
    assert 'data-ready="1"' in page and '<p class="problems">the episodes of this run cannot be shown' not in page
    assert [int(n) for n in re.findall(r'data-total="(\d+)"', page)] == [2 * len(ODD_STRINGS), 2, 3]
    assert page.count("data-episode-id=") == 2 * len(ODD_STRINGS) + 2 + 3
    compared = dom("#compare=__proto__:__proto__:0")
    assert 'data-ready="1"' in compared and compared.count('<div class="col">') == 2  # both arms of question __proto__
    opened = dom("#episode=constructor:base:0")
    assert opened.count('class="ep-body"') == 1 and "arms of this question side by side (2)" in opened


NODE = shutil.which("node")


@pytest.mark.skipif(NODE is None, reason="no node binary")
def test_the_pages_script_handles_any_id_question_or_arm_without_a_browser(tmp_path, data_root):
    """The same page, its script run by Node.js against a minimal DOM (tests/evaluation/view_dom.js), where no
    browser is installed: every run mounts, each filter option shows its own episodes, ``__proto__`` compares."""
    out = write_report(odd_runs(tmp_path, data_root), tmp_path / "report.html", str(data_root))

    def run(fragment: str = "") -> dict:
        done = subprocess.run([NODE, str(Path(__file__).with_name("view_dom.js")), str(out), fragment],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout)

    page = run()
    odd, broken, plain = page["runs"]
    assert page["ready"] and [r["problems"] for r in page["runs"]] == [[], [], []]
    assert (odd["total"], odd["shown"], broken["total"], plain["total"]) == (2 * len(ODD_STRINGS), 2 * len(ODD_STRINGS), 2, 3)
    arms, verdicts, tasks, stops = odd["filters"]
    assert arms == [["(all)", 16], ["__proto__", 8], ["base", 8]]
    assert sorted(tasks[1:]) == sorted([s or "(none)", 2] for s in ODD_STRINGS) and tasks[0] == ["(all)", 16]  # "(all)" the task: 2
    assert sorted(stops[1:]) == sorted([s, 2] for s in ODD_STRINGS) and verdicts == [["(all)", 16], ["correct", 16], ["incorrect", 0], ["unscored", 0]]
    assert run("#compare=__proto__:__proto__:0")["compare"] == ["__proto__", "base"]
    assert run("#compare=%E0%A4%A:base:0")["compare"] == ["__proto__", "base"]  # a malformed %-escape, taken as written


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (apt-get install chromium)")
def test_a_browser_shows_the_gold_calls_beside_the_models_with_the_matched_prefix(tmp_path, data_root):
    """The episode crops [0, 0, 0.5, 0.5]; its gold list holds a crop within IoU 0.5 of it, then a call named by
    hostile text, which the page shows as text."""
    record = episode("q0", "base", 0)
    record["gold_calls"] = [{"name": "crop_optical_or_sar_image", "arguments": {"aoi": [0, 0, 0.5, 0.45]}}, {"name": HOSTILE, "arguments": {}}]
    out = write_report([write_rollout(tmp_path / "roll", [record], data_root)], tmp_path / "report.html")
    dom = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}",
         "--virtual-time-budget=5000", "--dump-dom", out.as_uri() + "#episode=q0:base:0"], capture_output=True, text=True, timeout=120,
    ).stdout
    assert 'data-ready="1"' in dom and dom.count('<table class="gold">') == 1
    assert "0/2 same call (param_prefix), 1/2 box within IoU 0.5 (param_prefix_aoi@0.5, ours), 1/2 same tool" in dom
    table = dom.split('<table class="gold">')[1].split("</table>")[0]
    assert table.count('<tr class="m-aoi">') == 1 and table.count("<tr") == 3 and "m-exact" not in table
    assert "pwned</title>" not in dom and '<img src="x"' not in dom and "&lt;/script&gt;&lt;script&gt;document.title" in dom


def test_the_pages_paired_table_is_the_summarys_and_the_clis(tmp_path, data_root):
    """Every paired row of the page: the summary's own numbers (SE, 95% CI, its method) and the CLI's text of them."""
    import html as html_lib

    from eogym_sft.evaluation.report import paired_table

    records = [episode(f"q{i}", "base", 0, answer="blue") for i in range(5)]
    records += [episode(f"q{i}", "sft", 0, answer="red" if i else "blue") for i in range(5)]  # +0.8: its t interval passes 1
    run = write_rollout(tmp_path / "roll", records, data_root)
    summary = json.loads((run / "summary.json").read_text())
    page = render(find_runs([run]))
    table = page[page.index("<caption>paired, B - A on identical questions") :]
    table = table[: table.index("</table>")]
    rows = [[html_lib.unescape(c) for c in re.findall(r"<td>(.*?)</td>", row)] for row in re.findall(r"<tr>(.*?)</tr>", table)]
    rows = [r for r in rows if r]
    assert len(rows) == len(summary["paired"]) >= 2
    cli = paired_table(summary["paired"])  # what format_rollout_report prints of them
    clipped = 0
    for row, p in zip(rows, summary["paired"]):
        ci = "[{:+.3f}, {:+.3f}]".format(*p["ci95"]) if p["ci95"] else "-"
        se = "-" if p["se"] is None else f"{p['se']:.4f}"
        assert row == [p["a"], p["b"], p["metric"], str(p["n"]), f"{p['mean_a']:.3f}", f"{p['mean_b']:.3f}", f"{p['delta']:+.3f}",
                       se, ci, p["ci_method"], f"{p['wins']}/{p['losses']}/{p['ties']}"]
        line = next(l for l in cli if l.split()[:3] == [p["a"], p["b"], p["metric"]])
        assert f" {se} " in line and (ci + ("*" if p["ci_method"].endswith("clipped to [-1, 1]") else "")) in line
        clipped += p["ci_method"] == "paired t, clipped to [-1, 1]"
    assert clipped >= 1 and rows[0][8] == "[+0.245, +1.000]" and "normal approx" not in page
