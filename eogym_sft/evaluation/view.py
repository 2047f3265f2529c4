"""``eogym-sft view``: one self-contained HTML page of what runs did, readable offline.

A RUN is a folder (or a file) that one of the commands wrote, recognised by what it holds:

* a rollout (``eogym-sft rollout``, the demos' rollouts): ``episodes.jsonl`` (or its ``episodes.rank*.jsonl``
  of an interrupted multi-rank run), with ``run.json``, ``summary.json`` and ``skipped.jsonl`` where present;
* an evaluation (``eogym-sft evaluate``): ``results.jsonl``, one record per scored turn, and ``summary.json``;
* a training run (SFT or GRPO): ``trainer_state.json`` in it or in its last ``checkpoint-*/``;
* a validation report (``eogym-sft validate``, the SFT demo's ``validation.json``): a JSON file with ``models``.

A folder that is none of these is searched two levels down, so a demo's output folder is one RUN.

The page: per rollout or evaluation the summary tables (Pass@k per arm, paired deltas with 95% CIs, tool
use, stop reasons, errors by code), then every episode turn by turn, rendered by the page's script from
one embedded JSON blob, a page of episodes at a time, with filters and the arms of one question side by
side; per training run a plot per logged metric (matplotlib SVG). Images are embedded as downscaled
thumbnails (deduplicated by content hash, within ``image_budget`` bytes: beyond it an image is a link to
its file); one that is missing or does not decode is a placeholder naming it. Record text only ever reaches
the page as JSON (``<``, ``>``, ``&``, U+2028/9 escaped) set with ``textContent``, and a Content Security
Policy with a per-page nonce lets no other script and no network request run.
"""

from __future__ import annotations

import base64
import hashlib
import html
import io
import json
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..data.images import ImageError, load_rgb, resolve_image_path
from ..data.tool_images import ToolImageRule
from .report import EPISODE_METRICS, TURN_METRICS

TEMPLATE = Path(__file__).with_name("view.html")
IMAGE_BUDGET = 64 * 2**20  # bytes of embedded image data in one page
THUMB_SIDE = 512  # longest side of an embedded image; the page shows it smaller and, clicked, at this size
LOSSLESS_PIXELS = 256 * 256  # images this small are embedded as PNG: a crop's fine texture survives
TEXT_LIMIT = 20_000  # characters of one message kept in the page (the rest is cut, and says so)
ATTACH_ALL = ToolImageRule("attach")  # every image path a tool result names is shown
# Metrics plotted first, in this order, with their titles; every other numeric key of log_history follows.
PLOTS = {
    "loss": "loss",
    "mean_token_accuracy": "token accuracy",
    "learning_rate": "learning rate",
    "grad_norm": "grad norm",
    "reward": "reward (mean)",
    "reward/group_std": "reward spread (std within groups)",
    "reward_std": "reward std (TRL)",
    "reward/score": "answer score",
    "entropy": "entropy",
    "completions/mean_length": "episode length (tokens)",
    "episode/turns": "turns per episode",
    "episode/truncated": "truncated share",
    "completions/clipped_ratio": "truncated share (TRL's clipped ratio)",
    "episode/tool_calls": "tool calls per episode",
    "tools/call_frequency": "tool calls per episode (TRL)",
    "episode/answered": "answered share",
    "eval_loss": "eval loss",
    "eval_mean_token_accuracy": "eval token accuracy",
}
# What the summary of an unfinished rollout needs of each episode (the fields agent.episodes.Episode.record() writes).
EPISODE_FIELDS = ("arm", "source_id", "stop_reason", "turns", "tool_calls", "tool_errors", "tool_error_codes", "new_tokens", "final_answer")
READ_FILES = ("episodes.jsonl", "results.jsonl", "summary.json", "skipped.jsonl", "run.json", "trainer_state.json")
NOT_PLOTTED = {"epoch", "step", "total_flos", "train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss"}


class ViewError(ValueError):
    """A RUN that cannot be shown (nothing recognisable in it); the message names the path."""


# ---------------------------------------------------------------- finding and reading runs


@dataclass
class Run:
    """One recognised run: its ``kind`` (rollout, evaluation, training, validation) and its path."""

    kind: str
    path: Path
    name: str = ""


def run_kind(path: Path) -> str | None:
    """What ``path`` holds, or None."""
    if path.is_file():
        return "validation" if path.suffix == ".json" and _is_validation(path) else None
    if (path / "episodes.jsonl").is_file() or any(path.glob("episodes.rank*.jsonl")):
        return "rollout"
    if (path / "results.jsonl").is_file():
        return "evaluation"
    if trainer_state(path) is not None:
        return "training"
    return None


def _is_validation(path: Path) -> bool:
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(report, dict) and isinstance(report.get("models"), dict)


def trainer_state(path: Path) -> Path | None:
    """``trainer_state.json`` of a training output: its own, else its highest ``checkpoint-N``'s."""
    if (path / "trainer_state.json").is_file():
        return path / "trainer_state.json"
    states = [p for p in path.glob("checkpoint-*/trainer_state.json") if p.parent.name.split("-")[-1].isdigit()]
    return max(states, key=lambda p: int(p.parent.name.split("-")[-1]), default=None)


def find_runs(paths: list[str | Path]) -> list[Run]:
    """The runs named by ``paths``: each path itself, or, if it is none, the runs up to two levels under it
    (a demo's output) plus a ``validation.json`` there. Raises :class:`ViewError` for a path with none."""
    runs = []
    for given in map(Path, paths):
        if not given.exists():
            raise ViewError(f"{given}: no such file or folder")
        if given.is_file() and given.name in ("episodes.jsonl", "results.jsonl", "trainer_state.json"):
            given = given.parent  # the run is the folder the file is in
        found = _runs_in(given, given, depth=2)
        if not found:
            raise ViewError(
                f"{given}: no run found (looked for episodes.jsonl, results.jsonl, trainer_state.json or checkpoint-*/, "
                "a validation report, here and two levels down)"
            )
        runs += found
    return runs


def _runs_in(path: Path, top: Path, depth: int) -> list[Run]:
    kind = run_kind(path)
    if kind:
        name = path.name if path == top else path.relative_to(top.parent).as_posix()
        return [Run(kind, path, name)]
    if depth == 0 or not path.is_dir():
        return []
    found = []
    for child in sorted(path.iterdir()):
        if child.is_dir() or child.name == "validation.json":
            found += _runs_in(child, top, depth - 1)
    return found


def read_jsonl(path: Path, problems: list[str]) -> list[dict]:
    """The JSON objects of ``path``; a line that is not one is left out and named in ``problems``
    (the half-written last line of a killed run is one)."""
    records = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as err:
                problems.append(f"{path}:{number}: not JSON ({err.msg})")
                continue
            if not isinstance(record, dict):
                problems.append(f"{path}:{number}: not a JSON object")
                continue
            records.append(record)
    return records


def _read_json(path: Path, problems: list[str]) -> dict | None:
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text())
    except ValueError as err:
        problems.append(f"{path}: not JSON ({err})")
        return None
    return value if isinstance(value, dict) else None


# ---------------------------------------------------------------- images and texts shared by the page


class ImageStore:
    """The page's images by id: ``src`` (a data URI) for an embedded one; ``missing`` (why) for one that
    cannot be shown; ``file`` (its URI) for one over the budget. Identical files are embedded once."""

    def __init__(self, budget: int = IMAGE_BUDGET):
        self.budget, self.used = budget, 0
        self.entries: dict[str, dict] = {}
        self._by_path: dict[tuple[str, str], str] = {}

    def ref(self, rel, data_root: Path | None) -> str:
        """The id of the image ``rel`` (a row's relative path) under ``data_root``."""
        key = (str(data_root), str(rel))
        if key not in self._by_path:
            self._by_path[key] = self._add(rel, data_root)
        return self._by_path[key]

    def _missing(self, rel, why: str) -> str:
        ref = f"missing:{rel}"
        self.entries.setdefault(ref, {"path": str(rel), "missing": why})
        return ref

    def _add(self, rel, data_root: Path | None) -> str:
        if not isinstance(rel, str) or not rel:
            return self._missing(rel, "no image for this <image> tag")
        if data_root is None:
            return self._missing(rel, "no data root (pass --data-root)")
        try:
            path = resolve_image_path(rel, data_root)
            data = path.read_bytes()
        except ImageError as err:
            return self._missing(rel, err.reason)
        except OSError as err:
            return self._missing(rel, f"not readable under {data_root} ({type(err).__name__})")
        ref = hashlib.sha256(data).hexdigest()[:20]
        if ref in self.entries:
            return ref
        try:
            src, width, height = thumbnail(path)
        except (ImageError, OSError, ValueError) as err:
            return self._missing(rel, f"does not decode ({err})")
        entry = {"path": rel, "w": width, "h": height, "file": path.as_uri()}
        if self.used + len(src) <= self.budget:
            entry["src"] = src
            self.used += len(src)
        self.entries[ref] = entry
        return ref


def thumbnail(path: Path) -> tuple[str, int, int]:
    """``(data URI, width, height)``: the image at most :data:`THUMB_SIDE` on its longest side; PNG when
    small (a crop's pixels intact), else JPEG."""
    image = load_rgb(path)
    width, height = image.size
    out = io.BytesIO()
    if width * height <= LOSSLESS_PIXELS:
        image.save(out, "PNG", optimize=True)
        kind = "png"
    else:
        image.thumbnail((THUMB_SIDE, THUMB_SIDE))
        image.save(out, "JPEG", quality=80)
        kind = "jpeg"
    return f"data:image/{kind};base64," + base64.b64encode(out.getvalue()).decode(), width, height


class Texts:
    """Message texts interned once for the page (a system prompt or question repeats in every sample)."""

    def __init__(self):
        self.items: list[str] = []
        self._index: dict[str, int] = {}

    def add(self, text: str) -> int:
        if len(text) > TEXT_LIMIT:
            text = text[:TEXT_LIMIT] + f"\n[... {len(text) - TEXT_LIMIT} more characters not shown]"
        if text not in self._index:
            self._index[text] = len(self.items)
            self.items.append(text)
        return self._index[text]


# ---------------------------------------------------------------- episodes as the page shows them


def _content(content) -> tuple[str, list]:
    """A message's text and its image parts in order (a path, or None for an ``<image>`` tag)."""
    if content is None:
        return "", []
    if isinstance(content, str):
        return content.replace("<image>", "").strip("\n"), [None] * content.count("<image>")
    if not isinstance(content, list):
        return json.dumps(content, ensure_ascii=False), []
    texts, images = [], []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and ("text" in part or part.get("type") == "text"):
            texts.append(str(part.get("text") or ""))
        elif isinstance(part, dict):
            ref = part.get("image") or part.get("image_url") or part.get("path") or part.get("url")
            ref = ref.get("url") or ref.get("path") if isinstance(ref, dict) else ref
            images.append(ref.removeprefix("file://") if isinstance(ref, str) and ref else None)
    return "".join(texts), images


def _call(call) -> dict:
    function = call.get("function", call) if isinstance(call, dict) else {}
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"n": str(function.get("name") if isinstance(function, dict) else None), "a": arguments}


def _aoi(value) -> list[float] | None:
    if isinstance(value, list) and len(value) == 4 and all(map(_is_number, value)):
        x0, y0, x1, y1 = (float(v) for v in value)
        if 0 <= x0 < x1 <= 1 and 0 <= y0 < y1 <= 1:
            return [x0, y0, x1, y1]
    return None


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def page_messages(messages, row_images: list, data_root: Path | None, store: ImageStore, texts: Texts) -> list[dict]:
    """The messages of one conversation for the page: role, text (an index into ``texts``), images; an
    assistant's tool calls; a tool result's images and, for a crop, its box on the source image."""
    rows = iter(row_images)
    first_image = row_images[0] if row_images else None
    pending: list[dict] = []
    out = []
    for message in messages if isinstance(messages, list) else []:
        if not isinstance(message, dict):
            out.append({"r": "?", "t": texts.add(json.dumps(message, ensure_ascii=False))})
            continue
        role = str(message.get("role"))
        text, parts = _content(message.get("content"))
        item = {"r": role, "t": texts.add(text)}
        images = [store.ref(p if p else next(rows, None), data_root) for p in parts]
        if role == "assistant":
            pending = [_call(c) for c in message.get("tool_calls") or [] if isinstance(c, dict)]
            if pending:
                item["calls"] = pending[:]
            if message.get("truncated"):
                item["trunc"] = True
        elif role == "tool":
            call = pending.pop(0) if pending else {"n": None, "a": "{}"}
            name = str(message.get("name") or call["n"])
            item["name"] = name
            images += [store.ref(p, data_root) for p in ATTACH_ALL.images(name, text) if p not in parts]
            result, arguments = _json_object(text), _json_object(call["a"])
            aoi = _aoi(result.get("aoi_norm")) or _aoi(arguments.get("aoi"))
            source = arguments.get("image_url") or first_image
            if aoi and source:
                item["box"] = {"img": store.ref(source, data_root), "aoi": aoi}
        if images:
            item["img"] = images
        out.append(item)
    leftover = [store.ref(p, data_root) for p in rows]  # row images no tag placed: shown with the question
    user = next((m for m in out if m["r"] == "user"), None)
    if leftover and user is not None:
        user["img"] = user.get("img", []) + leftover
    return out


def _verdict(value) -> bool | None:
    return value if isinstance(value, bool) else None


def rollout_episode(record: dict, data_root: Path | None, store: ImageStore, texts: Texts) -> dict:
    """One ``episodes.jsonl`` record as the page's episode."""
    row_images = record.get("images") if isinstance(record.get("images"), list) else []
    answer = record.get("final_answer")
    return {
        "id": str(record.get("id")),
        "arm": str(record.get("arm")),
        "q": str(record.get("source_id")),
        "sample": record.get("sample"),
        "task": str(record.get("EO_task") or "(none)"),
        "qtype": str(record.get("question_type") or ""),
        "stop": str(record.get("stop_reason")),
        "correct": _verdict(record.get("correct")),
        "rule": _verdict(record.get("rule_correct")),
        "judged": record.get("rule_correct") is not None and record.get("correct") is not record.get("rule_correct"),
        "answer": None if answer is None else str(answer),
        "gt": None if record.get("gt_answer") is None else str(record.get("gt_answer")),
        "meta": {k: record.get(k) for k in ("source", "turns", "tool_calls", "tool_errors", "new_tokens") if record.get(k) is not None},
        "codes": record.get("tool_error_codes") if isinstance(record.get("tool_error_codes"), dict) else {},
        "error": record.get("error"),
        "judge_error": record.get("judge_error"),
        "msgs": page_messages(record.get("messages"), row_images, data_root, store, texts),
    }


def _flat_calls(calls) -> list[dict]:
    """Scoring's parsed calls (``{"name", "arguments"}``) as the page's."""
    return [{"n": str(c.get("name")), "a": json.dumps(c.get("arguments"), ensure_ascii=False)} for c in calls or [] if isinstance(c, dict)]


def evaluation_turn(record: dict, texts: Texts) -> dict:
    """One ``results.jsonl`` record (a reference turn and each arm's outputs for it) as the page's episode."""
    scores = record.get("scores") if isinstance(record.get("scores"), dict) else {}
    turn_correct = scores.get("turn_correct")
    reference = record.get("reference") if isinstance(record.get("reference"), dict) else {}
    ref_calls = _flat_calls(reference.get("calls"))
    msgs = [{"r": "reference", "t": texts.add(str(reference.get("content") or "")), **({"calls": ref_calls} if ref_calls else {})}]
    parsed = record.get("parsed") if isinstance(record.get("parsed"), list) else []
    for i, output in enumerate(record.get("outputs") or []):
        calls = parsed[i].get("calls") if i < len(parsed) and isinstance(parsed[i], dict) else None
        item = {"r": "assistant", "t": texts.add(str(output))}
        if calls:
            item["calls"] = _flat_calls(calls)
        msgs.append(item)
    final = next((p.get("final_answer") for p in parsed if isinstance(p, dict) and p.get("final_answer") is not None), None)
    key = f"{record.get('trace_id')}:{record.get('turn')}"
    return {
        "id": f"{key}:{record.get('arm')}",
        "arm": str(record.get("arm")),
        "q": key,
        "task": str(record.get("EO_task") or "(none)"),
        "qtype": str(record.get("question_type") or ""),
        "stop": str(reference.get("action") or "turn"),
        "correct": None if turn_correct is None else turn_correct == 1,
        "answer": None if final is None else str(final),
        "gt": None if record.get("gt_answer") is None else str(record.get("gt_answer")),
        "meta": {"source": record.get("source"), "scores": {k: v for k, v in scores.items() if v is not None}},
        "codes": {},
        "error": None,
        "judge_error": "; ".join(e for e in record.get("judge_errors") or [] if e) or None,
        "msgs": msgs,
    }


# ---------------------------------------------------------------- the summary tables (server-side HTML, escaped)


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def html_table(head: list[str], rows: list[list], caption: str = "") -> str:
    """An HTML table of escaped cells (floats to 3 decimals, None as ``-``)."""
    if not rows:
        return ""
    cap = f"<caption>{html.escape(caption)}</caption>" if caption else ""
    thead = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table>{cap}<thead><tr>{thead}</tr></thead><tbody>{body}</tbody></table>"


def _counts_table(arms: dict, key: str, caption: str) -> str:
    names = sorted({k for a in arms.values() for k in (a.get("overall", {}).get(key) or {})})
    rows = [[arm] + [(a.get("overall", {}).get(key) or {}).get(n, 0) for n in names] for arm, a in arms.items()]
    return html_table(["arm", *names], rows, caption) if names else ""


def paired_html(paired: list[dict], unit: str) -> str:
    rows = []
    for p in paired:
        ci = p.get("ci95_normal_approx")
        rows.append([p.get("a"), p.get("b"), p.get("metric"), p.get("n"), p.get("mean_a"), p.get("mean_b"),
                     None if p.get("delta") is None else f"{p['delta']:+.3f}", None if not ci else f"[{ci[0]:+.3f}, {ci[1]:+.3f}]",
                     f"{p.get('wins')}/{p.get('losses')}/{p.get('ties')}"])
    caption = (
        f"paired, B - A on identical {unit}; 95% CI = delta +/- 1.96 SE (normal approx.); "
        f"W/L/T = {unit} where B is better/worse/equal"
    )
    return html_table(["A", "B", "metric", "n", "mean A", "mean B", "delta", "95% CI", "W/L/T"], rows, caption)


def rollout_summary_html(summary: dict, skipped: list[dict]) -> str:
    """Pass@k and tool use per arm, per ``EO_task``, paired deltas, stop reasons, tool errors by code, skips."""
    ks = summary.get("settings", {}).get("ks") or sorted({int(k[5:]) for a in summary["arms"].values() for k in a["overall"]
                                                         if k.startswith("pass@") and k[5:].isdigit()})
    arms = summary["arms"]
    cols = ["questions", "episodes", *(f"pass@{k}" for k in ks), *EPISODE_METRICS, "judge_failed"]
    rows = [[arm, *(a["overall"].get(c) for c in cols)] for arm, a in arms.items()]
    parts = [html_table(["arm", *cols], rows, "per arm")]
    tasks = sorted({t for a in arms.values() for t in a.get("by_EO_task", {})})
    task_cols = [(arm, f"pass@{k}") for arm in arms for k in ks]
    task_rows = [[t, *(arms[arm].get("by_EO_task", {}).get(t, {}).get(metric) for arm, metric in task_cols)] for t in tasks]
    parts.append(html_table(["EO_task", *(f"{arm} {metric}" for arm, metric in task_cols)], task_rows, "per EO_task"))
    parts.append(paired_html(summary.get("paired") or [], "questions"))
    parts.append(_counts_table(arms, "stop_reasons", "stop reasons (episodes)"))
    parts.append(_counts_table(arms, "tool_error_codes", "tool errors by code"))
    parts.append(skipped_html(skipped))
    return "".join(parts)


def evaluation_summary_html(summary: dict, skipped: list[dict]) -> str:
    arms = summary["arms"]
    metrics = [m for m in TURN_METRICS + ("answer_judge",) if any(m in a["overall"] for a in arms.values())]
    rows = [[arm, max((v["n"] for v in a["overall"].values()), default=0), *((a["overall"].get(m) or {}).get("mean") for m in metrics)]
            for arm, a in arms.items()]
    per_arm = html_table(["arm", "turns", *metrics], rows, "per arm (means over turns)")
    return per_arm + paired_html(summary.get("paired") or [], "turns") + skipped_html(skipped)


def skipped_html(skipped: list[dict]) -> str:
    by_reason: dict[str, list] = {}
    for item in skipped:
        by_reason.setdefault(str(item.get("reason")), []).append(item)
    rows = [
        [reason, len(items), ", ".join(str(i.get("source") or i.get("episode")) for i in items[:5]) + (" ..." if len(items) > 5 else "")]
        for reason, items in sorted(by_reason.items())
    ]
    return html_table(["reason", "count", "first sources"], rows, "skipped.jsonl: rows and episodes left out, by reason")


def summarize_records(records: list[dict]) -> dict:
    """A summary for a rollout without ``summary.json`` (interrupted), from its episodes: Pass@1 and
    Pass@n for n the fewest samples any question has."""
    from .report import summarize_rollouts

    arms = list(dict.fromkeys(r["arm"] for r in records))
    per_question: dict = {}
    for r in records:
        per_question[(r["arm"], r["source_id"])] = per_question.get((r["arm"], r["source_id"]), 0) + 1
    ks = sorted({1, min(per_question.values())})
    return summarize_rollouts(records, arms, ks, {"ks": ks}, {}, {})


# ---------------------------------------------------------------- training plots


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def plot_keys(history: list[dict]) -> list[str]:
    """The numeric keys of ``log_history`` worth a plot: :data:`PLOTS`' that exist, in order, then the rest."""
    present = dict.fromkeys(k for h in history for k, v in h.items() if _is_number(v))
    rest = [k for k in present if k not in PLOTS and k not in NOT_PLOTTED and not k.endswith(("_runtime", "_per_second"))]
    return [k for k in PLOTS if k in present] + rest


def plot_svg(key: str, points: list[tuple[float, float]]) -> str:
    """One metric over steps as an SVG data URI (matplotlib, Agg backend, imported here so that the rest of
    the viewer and ``eogym-sft --help`` never load it)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.2, 2.6), dpi=100)
    ax = fig.subplots()
    steps, values = zip(*points)
    ax.plot(steps, values, marker="o" if len(points) < 30 else None, markersize=3, linewidth=1.4)
    ax.set_title(PLOTS.get(key, key), fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = io.BytesIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "eogym"}):
        fig.savefig(out, format="svg", metadata={"Date": None})
    return "data:image/svg+xml;base64," + base64.b64encode(out.getvalue()).decode()


def training_html(state_path: Path, problems: list[str]) -> str:
    state = _read_json(state_path, problems) or {}
    history = [h for h in state.get("log_history") or [] if isinstance(h, dict)]
    main, rest = [], []
    for key in plot_keys(history):
        points = [(h.get("step", i), h[key]) for i, h in enumerate(history) if _is_number(h.get(key))]
        figure = f'<figure data-metric="{html.escape(key)}"><img alt="{html.escape(key)}" src="{plot_svg(key, points)}"></figure>'
        (main if key in PLOTS else rest).append(figure)
    head = f"<p>{html.escape(str(state_path))}: {len(history)} log entries, global step {html.escape(_fmt(state.get('global_step')))}</p>"
    if not main + rest:
        return head + "<p>no metrics logged</p>"
    more = f'<details><summary>{len(rest)} more logged metrics</summary><div class="plots">{"".join(rest)}</div></details>' if rest else ""
    return head + f'<div class="plots">{"".join(main)}</div>' + more


def validation_html(report: dict) -> str:
    models = report.get("models") or {}
    metrics = list(dict.fromkeys(k for m in models.values() for k, v in (m.get("overall") or {}).items() if isinstance(v, (int, float))))
    rows = [[name, *((m.get("overall") or {}).get(k) for k in metrics)] for name, m in models.items()]
    return html_table(["model", *metrics], rows, f"overall, {report.get('samples', '?')} samples")


# ---------------------------------------------------------------- the page


@dataclass
class Page:
    store: ImageStore
    texts: Texts = field(default_factory=Texts)
    sections: list[str] = field(default_factory=list)
    runs: list[dict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def _data_root(run: Run, data_root: str | None, problems: list[str]) -> Path | None:
    if data_root:
        return Path(data_root)
    recorded = _read_json(run.path / "run.json", problems) or {}
    root = recorded.get("data_root")
    return Path(root) if isinstance(root, str) else None


def add_run(page: Page, run: Run, data_root: str | None) -> None:
    """Append ``run``'s section (and its episodes, for rollouts and evaluations) to ``page``."""
    index = len(page.sections)
    title = f"{run.name} ({run.kind})"
    if run.kind == "training":
        body = training_html(trainer_state(run.path), page.problems)
    elif run.kind == "validation":
        body = validation_html(json.loads(run.path.read_text()))
    else:
        body = _episodes_section(page, run, index, data_root)
    head = f'<h2>{html.escape(title)}</h2><p class="path">{html.escape(str(run.path))}</p>'
    page.sections.append(f'<section id="run-{index}">{head}{body}</section>')


def _episodes_section(page: Page, run: Run, index: int, data_root: str | None) -> str:
    summary = _read_json(run.path / "summary.json", page.problems)
    skipped = read_jsonl(run.path / "skipped.jsonl", page.problems) if (run.path / "skipped.jsonl").is_file() else []
    if run.kind == "evaluation":
        records = read_jsonl(run.path / "results.jsonl", page.problems)
        episodes = [evaluation_turn(r, page.texts) for r in records]
        tables = evaluation_summary_html(summary, skipped) if summary else "<p>no summary.json</p>"
    else:
        files = [run.path / "episodes.jsonl"] if (run.path / "episodes.jsonl").is_file() else sorted(run.path.glob("episodes.rank*.jsonl"))
        records = [r for f in files for r in read_jsonl(f, page.problems)]
        root = _data_root(run, data_root, page.problems)
        episodes = [rollout_episode(r, root, page.store, page.texts) for r in records]
        whole = [r for r in records if all(k in r for k in EPISODE_FIELDS)]
        if len(whole) < len(records):
            lacking = len(records) - len(whole)
            page.problems.append(f"{run.path}: {lacking} episodes lack one of {', '.join(EPISODE_FIELDS)}: shown, not counted")
        if summary is None and whole:
            summary = summarize_records(whole)
            tables = "<p>no summary.json (an unfinished run): figures from the episodes so far</p>" + rollout_summary_html(summary, skipped)
        else:
            tables = rollout_summary_html(summary, skipped) if summary else "<p>no episodes</p>"
    page.runs.append({"section": index, "name": run.name, "kind": run.kind, "episodes": episodes})
    return f'<div class="summary">{tables}</div><div class="episodes" data-run="{len(page.runs) - 1}"></div>'


def embed_json(value) -> str:
    """``value`` as JSON safe inside a ``<script>`` element: no ``<``, ``>`` or ``&`` (so no ``</script>``
    or ``<!--``) and no U+2028/U+2029."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    for char, escaped in (("&", "\\u0026"), ("<", "\\u003c"), (">", "\\u003e"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(char, escaped)
    return text


def render(runs: list[Run], data_root: str | None = None, image_budget: int = IMAGE_BUDGET) -> str:
    """The whole page for ``runs``."""
    page = Page(ImageStore(image_budget))
    for run in runs:
        add_run(page, run, data_root)
    data = {"texts": page.texts.items, "images": page.store.entries, "runs": page.runs}
    over = sum(1 for e in page.store.entries.values() if "file" in e and "src" not in e)
    notes = list(page.problems)
    if over:
        notes.append(f"{over} images over the page's image budget ({image_budget // 2**20} MiB) are links to their files, not embedded")
    problems = "".join(f"<li>{html.escape(p)}</li>" for p in notes[:50])
    problems += f"<li>... {len(notes) - 50} more</li>" if len(notes) > 50 else ""
    nav = "".join(f'<a href="#run-{i}">{html.escape(r.name)}</a>' for i, r in enumerate(runs))
    nonce = secrets.token_urlsafe(16)
    replacements = {
        "__NONCE__": nonce,
        "__TITLE__": html.escape("eogym-sft view: " + ", ".join(r.name for r in runs)),
        "__NAV__": nav,
        "__PROBLEMS__": f'<ul class="problems">{problems}</ul>' if problems else "",
        "__SECTIONS__": "".join(page.sections),
        "__DATA__": embed_json(data),
    }
    # one pass over the template: what is put in is never searched for markers again
    return re.sub("__(NONCE|TITLE|NAV|PROBLEMS|SECTIONS|DATA)__", lambda m: replacements[m.group(0)], TEMPLATE.read_text())


def write_report(paths: list[str | Path], output: str | Path, data_root: str | None = None, image_budget: int = IMAGE_BUDGET) -> Path:
    """Find the runs under ``paths``, render them and write ``output`` atomically; return its path."""
    from ..atomic import write_text_atomic

    output = Path(output)
    runs = find_runs(paths)
    for run in runs:
        if output.resolve() == run.path.resolve() or (output.parent.resolve() == run.path.resolve() and output.name in READ_FILES):
            raise ViewError(f"--output {output} would overwrite what {run.path} holds: pick another file")
    text = render(runs, data_root, image_budget)
    output.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(output, text)
    return output


# ---------------------------------------------------------------- serving and the command line


def serve(report: Path, port: int = 0, seconds: float = 3600.0, ready=None) -> None:
    """Serve ``report`` (and nothing else) on 127.0.0.1 for at most ``seconds`` or until Ctrl-C; ``ready(url)``
    is called once it listens (by default the URL is printed)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    body = report.read_bytes()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.split("?")[0] not in ("/", "/" + report.name):
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # one line per request on stderr is noise here
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    url = f"http://127.0.0.1:{server.server_address[1]}/{report.name}"
    (ready or (lambda u: print(f"serving {report} at {url} for {seconds:.0f} s (Ctrl-C stops)", flush=True)))(url)
    timer = threading.Timer(seconds, server.shutdown)
    timer.start()
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        timer.cancel()
        server.server_close()


def add_view_args(parser) -> None:
    """The flags of ``eogym-sft view``."""
    add = parser.add_argument
    add("runs", nargs="+", metavar="RUN", help="rollout, evaluation or training output folder(s), or a demo's output folder")
    add("--output", default="report.html", help="the HTML file to write")
    add("--data-root", default=None, help="folder the episodes' image paths are relative to (None: each rollout's run.json data_root)")
    add("--image-budget-mb", type=float, default=IMAGE_BUDGET / 2**20, help="MiB of embedded images; beyond it, images are links to files")
    add("--serve", action="store_true", help="also serve the page on http://127.0.0.1 (this machine only)")
    add("--port", type=int, default=0, help="port for --serve (0: any free one)")
    add("--serve-seconds", type=float, default=3600.0, help="stop serving after this many seconds")


def run_view(args) -> Path:
    """``eogym-sft view``: write the page, print its path, serve it if asked."""
    start = time.perf_counter()
    try:
        path = write_report(args.runs, args.output, args.data_root, int(args.image_budget_mb * 2**20))
    except ViewError as err:
        raise SystemExit(f"eogym-sft view: {err}") from None
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB, {time.perf_counter() - start:.1f} s): open it in a browser")
    if args.serve:
        serve(path, args.port, args.serve_seconds)
    return path
