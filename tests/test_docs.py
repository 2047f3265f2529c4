"""Every fenced command and snippet in README.md and docs/*.md runs here or says why not, and every link between
the docs lands on a file and heading that exist.

A bash or python block runs when it can here: a bash block whose every command is a ``--help``, and any python
block. Any other block carries a marker on the lines just above its fence: ``<!-- needs: REASON -->`` (REASON
one of ``NEEDS``) or ``<!-- runs-in: PATH[::TEST] -->`` for a command another test already runs."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
NEEDS = {"gpu", "hub", "eo-gym data", "network", "a server", "an api key", "minutes"}  # minutes: a bench or a long run
RUNNABLE_LANGUAGES = {"bash", "python"}
FENCE = re.compile(r"^```(\S*)\n(.*?)^```\s*$", re.S | re.M)
MARKER = re.compile(r"<!--\s*(needs|runs-in):\s*(.*?)\s*-->")


@dataclass
class Block:
    doc: Path
    line: int
    language: str
    text: str
    markers: list[tuple[str, str]]

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}"

    def commands(self) -> list[str]:
        """Shell lines, continuations joined, comments and blanks dropped."""
        joined = self.text.replace("\\\n", " ")
        return [line.split(" #")[0].strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def blocks(doc: Path) -> list[Block]:
    text = doc.read_text()
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").splitlines()
        comments = []
        while before and (before[-1].strip().startswith("<!--") or not before[-1].strip()):
            comments.append(before.pop())
        markers = [m.groups() for line in comments for m in MARKER.finditer(line)]
        found.append(Block(doc, text.count("\n", 0, match.start()) + 1, match.group(1), match.group(2), markers))
    return found


ALL = [block for doc in DOCS for block in blocks(doc)]


def is_help_only(block: Block) -> bool:
    return block.language == "bash" and bool(block.commands()) and all(c.endswith("--help") for c in block.commands())


def runs_here(block: Block) -> bool:
    return (block.language == "python" or is_help_only(block)) and not block.markers


def as_argv(command: str) -> list[str]:
    """A doc command as this checkout runs it: ``eogym-sft`` as its CLI, ``python`` as this interpreter."""
    argv = shlex.split(command)
    if argv[0] == "eogym-sft":
        return [sys.executable, "-m", "eogym_sft.cli", *argv[1:]]
    assert argv[0] == "python", command
    return [sys.executable, *argv[1:]]


def test_every_command_block_runs_here_or_says_why():
    unmarked = [b.where for b in ALL if b.language in RUNNABLE_LANGUAGES and not b.markers and not runs_here(b)]
    assert not unmarked, f"blocks neither run by tests/test_docs.py nor marked <!-- needs: ... --> or <!-- runs-in: ... -->: {unmarked}"


def test_every_fence_names_its_language():
    """So that no command hides in an unlabelled fence: layouts and synopses are ``text``, records ``json``."""
    unlabelled = [b.where for b in ALL if not b.language]
    assert not unlabelled, f"fences without a language (bash, python, text, json, ...): {unlabelled}"


def test_every_marker_names_a_known_reason_or_an_existing_test():
    wrong = []
    for block in ALL:
        for kind, value in block.markers:
            if kind == "needs" and value not in NEEDS:
                wrong.append(f"{block.where}: needs {value!r} is not one of {sorted(NEEDS)}")
            if kind == "runs-in":
                path, _, name = value.partition("::")
                if not (REPO / path).is_file():
                    wrong.append(f"{block.where}: runs-in {path}: no such file")
                elif name and not re.search(rf"^\s*def {re.escape(name)}\(", (REPO / path).read_text(), re.M):
                    wrong.append(f"{block.where}: runs-in {value}: no such test")
    assert not wrong, "\n".join(wrong)


def test_a_block_a_script_runs_shows_the_scripts_commands():
    """README's test block (``runs-in: .ci/run``) is what CI runs: each of its commands is a line of the script."""
    wrong = []
    for block in ALL:
        for kind, value in block.markers:
            script = REPO / value
            if kind == "runs-in" and "::" not in value and script.suffix != ".py" and script.is_file():
                lines = {line.strip() for line in script.read_text().splitlines()}
                wrong += [f"{block.where}: {c!r} is no line of {value}" for c in block.commands() if c not in lines]
    assert not wrong, "\n".join(wrong)


HELP = [(b.where, c) for b in ALL if runs_here(b) and b.language == "bash" for c in b.commands()]


@pytest.mark.parametrize("where,command", HELP, ids=[c for _, c in HELP])
def test_help_commands_run(where, command):
    done = subprocess.run(as_argv(command), cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{where}: {command}\n{done.stderr[-2000:]}"
    assert "usage" in done.stdout.lower(), f"{where}: {command} printed no usage"


# Runs each snippet in a fresh namespace, all in one interpreter (one import of torch and transformers for all).
RUNNER = """
import sys, traceback
failed = 0
for where, source in SNIPPETS:
    try:
        exec(compile(source, where, "exec"), {"__name__": "__main__"})
    except BaseException:
        failed += 1
        print(f"FAILED {where}", file=sys.stderr)
        traceback.print_exc()
sys.exit(failed)
"""


@pytest.mark.slow(40)
def test_python_snippets_run_on_the_bundled_sample(tmp_path):
    """Each python block, from a folder that sees the checkout's package and recipes as its root does."""
    for name in ("recipes", "eogym_sft"):
        (tmp_path / name).symlink_to(REPO / name)
    snippets = [(b.where, b.text) for b in ALL if runs_here(b) and b.language == "python"]
    script = tmp_path / "run_snippets.py"
    script.write_text(f"SNIPPETS = {snippets!r}\n{RUNNER}")
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-4000:]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    text = FENCE.sub("", doc.read_text())
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_links_between_docs_land_on_a_file_and_heading_that_exist():
    broken = []
    for doc in DOCS:
        text = FENCE.sub("", doc.read_text())
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                broken.append(f"{doc.relative_to(REPO)}: {target}: no such file")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{doc.relative_to(REPO)}: {target}: no such heading in {file.name}")
    assert not broken, "\n".join(broken)


def test_slugs_follow_githubs_rule():
    assert slug("11. Closed-loop rollouts: `eogym-sft rollout`") == "11-closed-loop-rollouts-eogym-sft-rollout"
    assert slug("Where to get EO-Gym, and where to put it") == "where-to-get-eo-gym-and-where-to-put-it"
    assert slug("A first run on CPU") == "a-first-run-on-cpu"


CITATION = re.compile(r"""(README\.md|docs/\w+\.md|\]\(\w+\.md\)),? (?:section (\d+)|["'](.{3,50}?)["'])""")


def headings(doc: Path) -> list[str]:
    return [re.sub(r"[`*]", "", h).strip() for h in re.findall(r"^#{1,6} (.+)$", FENCE.sub("", doc.read_text()), re.M)]


def test_sections_the_code_and_docs_cite_exist():
    """``docs/evaluation.md, section 15`` and ``docs/rl.md, "The rollout engine"``: a renamed or renumbered heading
    fails here, naming the file that cites it."""
    sources = [*DOCS, *(REPO / "eogym_sft").rglob("*.py"), *(REPO / "recipes").glob("*"), *(REPO / "bench").glob("*.py")]
    missing = []
    for source in sources:
        if not source.is_file():
            continue
        text = re.sub(r"\s*\n\s*#?\s*", " ", source.read_text())  # a citation broken over lines or comment lines
        for doc, number, title in CITATION.findall(text):
            name = doc.strip("]()")
            target = REPO / name if "/" in name or name == "README.md" else REPO / "docs" / name
            found = headings(target)
            if number and not any(h.startswith(f"{number}. ") for h in found):
                missing.append(f"{source.relative_to(REPO)}: {name}, section {number}")
            if title and not any(h.startswith(title) for h in found):
                missing.append(f"{source.relative_to(REPO)}: {name}, {title!r}")
    assert not missing, "cited sections with no such heading:\n" + "\n".join(missing)


# ---------------------------------------------------------------- quoted results and their files

FIGURES_BLOCK = re.compile(r"<!--\s*figures:\s*(\S+)\s*-->(.*?)<!--\s*/figures\s*-->", re.S)
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
DECIMAL = re.compile(r"(?<![\w.@])([+-]?)(\d+\.\d+)(?![\w.])")
SECONDS = re.compile(r"(?<![\w.@])(\d+)(?:-(\d+))? s\b")


def numbers_in(value) -> list[float]:
    """Every number in parsed JSON, however deep."""
    if isinstance(value, dict):
        return [n for v in value.values() for n in numbers_in(v)]
    if isinstance(value, list):
        return [n for v in value for n in numbers_in(v)]
    return [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else []


def unsourced_figures(text: str, values: list[float]) -> list[str]:
    """The figures of ``text`` (decimals as printed, sign included, and seconds) that no value of ``values`` gives."""
    text = DATE.sub(" ", text)
    missing = []
    for sign, digits in DECIMAL.findall(text):
        places = len(digits.split(".")[1])
        shown = f"{sign}{digits}"
        if not any(f"{v:+.{places}f}".lstrip("+" if not sign else "") == shown or f"{v:.{places}f}" == shown for v in values):
            missing.append(shown)
    for first, last in SECONDS.findall(text):
        missing += [n for n in (first, last) if n and int(n) not in values]
    return missing


def figures_blocks() -> list[tuple[Path, str, str]]:
    return [(doc, source, body) for doc in DOCS for source, body in FIGURES_BLOCK.findall(doc.read_text())]


def test_every_quoted_figure_comes_from_the_results_file_its_block_names():
    """A ``<!-- figures: FILE -->`` block quotes only numbers FILE holds (to the decimals shown): a rerun that writes
    FILE anew fails this test until the prose says what the run said. bench/README.md documents the run that
    writes FILE (its command names FILE)."""
    blocks = figures_blocks()
    assert (REPO / "README.md", "bench/results/cpu_agent_demo.json") in {(doc, source) for doc, source, _ in blocks}
    bench_readme = (REPO / "bench" / "README.md").read_text()
    for doc, source, body in blocks:
        assert f"--json {source}" in bench_readme, f"{source}: no run in bench/README.md writes it"
        assert unsourced_figures(body, numbers_in(json.loads((REPO / source).read_text()))) == [], f"{doc.name}: figures not in {source}"


def test_the_figure_check_catches_a_drifted_figure():
    values = numbers_in({"seeds": [{"sft": 0.78125, "delta": -0.03125, "ci95": [-0.133, 0.0702]}], "wall_s": [139, 182]})
    assert unsourced_figures("SFT 0.781, GRPO - SFT -0.031 [-0.133, +0.070], 139-182 s a run (2026-12-02)", values) == []
    assert unsourced_figures("SFT 0.750, GRPO - SFT +0.031 [-0.133, +0.071], 139-183 s a run", values) == ["0.750", "+0.031", "+0.071", "183"]


def test_the_readme_quotes_no_test_count():
    """A count of passing tests drifts with every test added: the README has none (contributing.md has a dated run)."""
    assert re.findall(r"\d+ passed|\d+ skipped", (REPO / "README.md").read_text()) == []


# ---------------------------------------------------------------- the record's size (issue 67)

RECORD = [*DOCS, REPO / "bench" / "README.md"]
RECORD_WORDS_LIMIT = 22_000  # issue 67's target, met: an explanation has one home; never raise it
BENCHMARKS_LINES_LIMIT = 300
RESULTS_BYTES_LIMIT = 300_000  # bench/results: one compact summary per cited claim, no raw reports


def word_count(text: str) -> int:
    """Words as ``wc -w`` counts them: runs of non-whitespace."""
    return len(text.split())


def test_the_docs_stay_within_their_word_limit():
    counts = {str(doc.relative_to(REPO)): word_count(doc.read_text()) for doc in RECORD}
    total = sum(counts.values())
    largest = ", ".join(f"{name} {n}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1])[:4])
    assert total <= RECORD_WORDS_LIMIT, f"README + docs + bench/README.md hold {total} words, over {RECORD_WORDS_LIMIT}: cut repetition ({largest}, ...)"


def test_benchmarks_md_stays_within_its_line_limit():
    lines = (REPO / "docs" / "benchmarks.md").read_text().count("\n")
    assert lines <= BENCHMARKS_LINES_LIMIT, f"docs/benchmarks.md has {lines} lines, over {BENCHMARKS_LINES_LIMIT}: superseded figures go"


def test_bench_results_stay_within_their_size_limit():
    sizes = {p.name: p.stat().st_size for p in (REPO / "bench" / "results").iterdir() if p.is_file()}
    largest = ", ".join(f"{name} {n:,}" for name, n in sorted(sizes.items(), key=lambda kv: -kv[1])[:3])
    assert sum(sizes.values()) < RESULTS_BYTES_LIMIT, f"bench/results holds {sum(sizes.values()):,} bytes ({largest}, ...)"


def test_word_count_counts_as_wc_does():
    assert word_count("a  b\tc\n\n`d`-e |  | f\n") == 7  # a, b, c, `d`-e, |, |, f


# ---------------------------------------------------------------- GPU stages the docs name

SESSION = REPO / "bench" / "h200_session.sh"


def session_stages(script: str) -> set[str]:
    """The stage names of bench/h200_session.sh: its ``case`` labels."""
    return set(re.findall(r"^([a-z0-9_]+)\)(?:\s|$)", script, re.M))


def named_stages(text: str) -> list[str]:
    """Stages a doc names: the one-word commands of a ``## Headline`` table's command column, and ``h200_session.sh NAME``."""
    found = re.findall(r"h200_session\.sh ([a-z0-9_]+)\b", text)
    headline = re.search(r"^## Headline\n(.*?)(?=^## )", text, re.S | re.M)
    rows = [line.strip().strip("|").split("|") for line in (headline.group(1) if headline else "").splitlines() if line.startswith("|")]
    header = [c.strip() for c in rows[0]] if rows else []
    if "command" in header:
        column = header.index("command")
        found += [name for row in rows[2:] for name in re.findall(r"`([a-z0-9_]+)`", row[column])]
    return found


def test_the_docs_name_only_stages_that_h200_session_sh_has():
    stages = session_stages(SESSION.read_text())
    stale = [f"{doc.name}: {name}" for doc in DOCS for name in named_stages(doc.read_text()) if name not in stages]
    assert not stale, f"stages no longer in bench/h200_session.sh (its case labels): {stale}"


def test_named_stages_reads_the_headlines_command_column_and_script_calls():
    text = ("## Headline\n\n| claim | command | results |\n|---|---|---|\n| x | `after_1gpu`, then `gone` | `a.json` |\n"
            "| y | `python bench/x.py --arms B` | `b.json` |\n\n## Next\n\nRun `bash bench/h200_session.sh gaps` and `other`.\n")
    assert named_stages(text) == ["gaps", "after_1gpu", "gone"]
    script = "case \"$1\" in\nsetup)\n  x\n  ;;\ngaps)  # a comment\n  y\n  ;;\n*)\n  z(a)\nesac\n"
    assert session_stages(script) == {"setup", "gaps"}
