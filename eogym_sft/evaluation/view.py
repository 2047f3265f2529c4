"""``eogym-sft view``: one self-contained HTML page of what runs did, readable offline.

:mod:`.view_data` finds the runs and gathers their records. The page: per rollout or evaluation the
summary tables (Pass@k per arm, paired deltas with 95% CIs, tool use, stop reasons, errors by code), then
every episode turn by turn, rendered by the page's script from one embedded JSON blob, a page of episodes at
a time, with filters and the arms of one question side by side; per training run a plot per logged metric
(matplotlib SVG). Record text only ever reaches the page as JSON (``<``, ``>``, ``&``, U+2028/9 escaped) set
with ``textContent``, and a Content Security Policy with a per-page nonce lets no other script and no
network request run.
"""

from __future__ import annotations

import base64
import html
import io
import json
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..config import number
from .report import EPISODE_METRICS, TURN_METRICS
from .view_data import (
    EPISODE_FIELDS,
    IMAGE_BUDGET,
    ImageStore,
    Run,
    Texts,
    ViewError,
    find_runs,
    is_number,
    read_json,
    read_jsonl,
    run_data_root,
    trainer_state,
)
from .view_episodes import evaluation_turn, rollout_episode, summarize_records, well_typed

__all__ = ["ViewError", "add_view_args", "embed_json", "find_runs", "plot_keys", "render", "run_view", "serve",
           "write_report"]

TEMPLATE = Path(__file__).with_name("view.html")
GENERATOR = b'<meta name="generator" content="eogym-sft view">'  # in the template's head: marks a page as view's
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
NOT_PLOTTED = {"epoch", "step", "total_flos", "train_runtime", "train_samples_per_second", "train_steps_per_second",
               "train_loss"}


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
    """The summary's paired comparisons as the CLI prints them (:func:`eogym_sft.evaluation.report.paired_table`):
    its own SE and 95% CI, each row naming the CI's method."""
    rows = []
    for p in paired:
        ci, se = p.get("ci95"), p.get("se")
        rows.append([p.get("a"), p.get("b"), p.get("metric"), p.get("n"), p.get("mean_a"), p.get("mean_b"),
                     None if p.get("delta") is None else f"{p['delta']:+.3f}", None if se is None else f"{se:.4f}",
                     None if not ci else f"[{ci[0]:+.3f}, {ci[1]:+.3f}]", p.get("ci_method"),
                     f"{p.get('wins')}/{p.get('losses')}/{p.get('ties')}"])
    caption = (
        f"paired, B - A on identical {unit}; SE = sd(diff)/sqrt(n); 95% CI by the row's method (paired t: delta +/- "
        f"t(0.975, n - 1) SE, clipped to [-1, 1] where it passed a bound); W/L/T = {unit} where B is "
        "better/worse/equal"
    )
    return html_table(["A", "B", "metric", "n", "mean A", "mean B", "delta", "SE", "95% CI", "CI method", "W/L/T"],
                      rows, caption)


def rollout_summary_html(summary: dict, skipped: list[dict]) -> str:
    """Pass@k and tool use per arm, per ``EO_task``, paired deltas, stop reasons, tool errors by code, skips."""
    ks = summary.get("settings", {}).get("ks") or sorted(
        {int(k[5:]) for a in summary["arms"].values() for k in a["overall"]
         if k.startswith("pass@") and k[5:].isdigit()}
    )
    arms = summary["arms"]
    cols = ["questions", "episodes", *(f"pass@{k}" for k in ks), *EPISODE_METRICS, "judge_failed"]
    rows = [[arm, *(a["overall"].get(c) for c in cols)] for arm, a in arms.items()]
    parts = [html_table(["arm", *cols], rows, "per arm")]
    tasks = sorted({t for a in arms.values() for t in a.get("by_EO_task", {})})
    task_cols = [(arm, f"pass@{k}") for arm in arms for k in ks]
    task_rows = [[t, *(arms[arm].get("by_EO_task", {}).get(t, {}).get(metric) for arm, metric in task_cols)]
                 for t in tasks]
    parts.append(html_table(["EO_task", *(f"{arm} {metric}" for arm, metric in task_cols)], task_rows, "per EO_task"))
    parts.append(paired_html(summary.get("paired") or [], "questions"))
    parts.append(_counts_table(arms, "stop_reasons", "stop reasons (episodes)"))
    parts.append(_counts_table(arms, "tool_error_codes", "tool errors by code"))
    parts.append(skipped_html(skipped))
    return "".join(parts)


def evaluation_summary_html(summary: dict, skipped: list[dict]) -> str:
    arms = summary["arms"]
    metrics = [m for m in TURN_METRICS + ("answer_judge",) if any(m in a["overall"] for a in arms.values())]
    rows = [[arm, max((v["n"] for v in a["overall"].values()), default=0),
             *((a["overall"].get(m) or {}).get("mean") for m in metrics)]
            for arm, a in arms.items()]
    per_arm = html_table(["arm", "turns", *metrics], rows, "per arm (means over turns)")
    return per_arm + paired_html(summary.get("paired") or [], "turns") + skipped_html(skipped)


def skipped_html(skipped: list[dict]) -> str:
    by_reason: dict[str, list] = {}
    for item in skipped:
        by_reason.setdefault(str(item.get("reason")), []).append(item)
    rows = [
        [reason, len(items),
         ", ".join(str(i.get("source") or i.get("episode")) for i in items[:5]) + (" ..." if len(items) > 5 else "")]
        for reason, items in sorted(by_reason.items())
    ]
    return html_table(["reason", "count", "first sources"], rows,
                      "skipped.jsonl: rows and episodes left out, by reason")


# ---------------------------------------------------------------- training plots


def plot_keys(history: list[dict]) -> list[str]:
    """The numeric keys of ``log_history`` worth a plot: :data:`PLOTS`' that exist, in order, then the rest."""
    present = dict.fromkeys(k for h in history for k, v in h.items() if is_number(v))
    rest = [
        k for k in present if k not in PLOTS and k not in NOT_PLOTTED and not k.endswith(("_runtime", "_per_second"))
    ]
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


def training_html(state_path: Path, problems: list[str], roots=()) -> str:
    state = read_json(state_path, problems, roots) or {}
    log = state.get("log_history")
    history = [h for h in log if isinstance(h, dict)] if isinstance(log, list) else []
    main, rest = [], []
    for key in plot_keys(history):
        points = [(h["step"] if is_number(h.get("step")) else i, h[key])
                  for i, h in enumerate(history) if is_number(h.get(key))]
        figure = (f'<figure data-metric="{html.escape(key)}"><img alt="{html.escape(key)}" '
                  f'src="{plot_svg(key, points)}"></figure>')
        (main if key in PLOTS else rest).append(figure)
    step = html.escape(_fmt(state.get('global_step')))
    head = f"<p>{html.escape(str(state_path))}: {len(history)} log entries, global step {step}</p>"
    if not main + rest:
        return head + "<p>no metrics logged</p>"
    more = (
        f'<details><summary>{len(rest)} more logged metrics</summary><div '
        f'class="plots">{"".join(rest)}</div></details>'
        if rest
        else ""
    )
    return head + f'<div class="plots">{"".join(main)}</div>' + more


def validation_html(report: dict) -> str:
    models = report.get("models") if isinstance(report.get("models"), dict) else {}
    overall = {name: m["overall"] for name, m in models.items()
               if isinstance(m, dict) and isinstance(m.get("overall"), dict)}
    metrics = list(dict.fromkeys(k for o in overall.values() for k, v in o.items() if is_number(v)))
    rows = [[name, *(o.get(k) for k in metrics)] for name, o in overall.items()]
    return html_table(["model", *metrics], rows, f"overall, {report.get('samples', '?')} samples")


# ---------------------------------------------------------------- the page


@dataclass
class Page:
    store: ImageStore
    texts: Texts = field(default_factory=Texts)
    sections: list[str] = field(default_factory=list)
    runs: list[dict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)



def add_run(page: Page, run: Run, data_root: str | None) -> None:
    """Append ``run``'s section (and its episodes, for rollouts and evaluations) to ``page``. A run whose files
    have a shape the page cannot show is named in the page's problems; the other runs are shown as ever."""
    index = len(page.sections)
    title = f"{run.name} ({run.kind})"
    try:
        if run.kind == "training":
            body = training_html(trainer_state(run.path), page.problems, run.roots)
        elif run.kind == "validation":
            body = validation_html(read_json(run.path, page.problems, run.roots) or {})
        else:
            body = _episodes_section(page, run, index, data_root)
    except UNEXPECTED_SHAPE as err:
        page.problems.append(_shape_problem(run.path, err))
        body = "<p>not shown: its files have a shape this page cannot show (see the problems above)</p>"
    head = f'<h2>{html.escape(title)}</h2><p class="path">{html.escape(str(run.path))}</p>'
    page.sections.append(f'<section id="run-{index}">{head}{body}</section>')


# What a file of unexpected shape raises in the code that shows it (a list where an object was meant, a string
# where a number was): the run, or its tables, are left out and named, never a traceback that loses the page.
UNEXPECTED_SHAPE = (KeyError, TypeError, AttributeError, ValueError, IndexError)


def _shape_problem(path: Path, err: Exception) -> str:
    return f"{path}: an unexpected shape ({type(err).__name__}: {str(err)[:200]}): not shown"


def _tables(page: Page, run: Run, show, summary: dict, skipped: list[dict], note: str = "") -> str:
    """``show(summary, skipped)``, or, for a summary of a shape the tables cannot show, a note and a named problem."""
    try:
        return note + show(summary, skipped)
    except UNEXPECTED_SHAPE as err:
        page.problems.append(_shape_problem(run.path / "summary.json", err))
        return "<p>summary tables not shown: summary.json has an unexpected shape (see the problems above)</p>"


def _episodes_section(page: Page, run: Run, index: int, data_root: str | None) -> str:
    summary = read_json(run.path / "summary.json", page.problems, run.roots)
    has_skipped = (run.path / "skipped.jsonl").exists()
    skipped = read_jsonl(run.path / "skipped.jsonl", page.problems, run.roots) if has_skipped else []
    if run.kind == "evaluation":
        records = read_jsonl(run.path / "results.jsonl", page.problems, run.roots)
        episodes = [evaluation_turn(r, page.texts) for r in records]
        tables = _tables(page, run, evaluation_summary_html, summary, skipped) if summary else "<p>no summary.json</p>"
    else:
        files = (
            [run.path / "episodes.jsonl"]
            if (run.path / "episodes.jsonl").exists()
            else sorted(run.path.glob("episodes.rank*.jsonl"))
        )
        records = [r for f in files for r in read_jsonl(f, page.problems, run.roots)]
        root = run_data_root(run, data_root, page.problems)
        episodes = [rollout_episode(r, root, page.store, page.texts) for r in records]
        whole = [r for r in records if well_typed(r)]
        if len(whole) < len(records):
            lacking = len(records) - len(whole)
            page.problems.append(f"{run.path}: {lacking} episodes lack one of {', '.join(EPISODE_FIELDS)} (or its "
                                 "type): shown, not counted")
        if summary is None and whole:
            note = "<p>no summary.json (an unfinished run): figures from the episodes so far</p>"
            tables = _tables(page, run, lambda s, k: rollout_summary_html(summarize_records(whole), k), {}, skipped,
                             note)
        else:
            tables = _tables(page, run, rollout_summary_html, summary, skipped) if summary else "<p>no episodes</p>"
    page.runs.append({"section": index, "name": run.name, "kind": run.kind, "episodes": episodes})
    return f'<div class="summary">{tables}</div><div class="episodes" data-run="{len(page.runs) - 1}"></div>'


def embed_json(value) -> str:
    """``value`` as JSON safe inside a ``<script>`` element: no ``<``, ``>`` or ``&`` (so no ``</script>``
    or ``<!--``) and no U+2028/U+2029."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    for char, escaped in (("&", "\\u0026"), ("<", "\\u003c"), (">", "\\u003e"), ("\u2028", "\\u2028"),
                          ("\u2029", "\\u2029")):
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
        notes.append(f"{over} images over the page's image budget ({image_budget // 2**20} MiB) are links to their "
                     "files, not embedded")
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
    return re.sub("__(NONCE|TITLE|NAV|PROBLEMS|SECTIONS|DATA)__", lambda m: replacements[m.group(0)],
                  TEMPLATE.read_text())


def is_page(path: Path) -> bool:
    """Whether ``path`` is a page this command wrote (its generator tag in the first bytes): what ``--overwrite`` may
    replace."""
    with open(path, "rb") as fh:
        return GENERATOR in fh.read(512)


def write_report(
    paths: list[str | Path], output: str | Path, data_root: str | None = None, image_budget: int = IMAGE_BUDGET,
    overwrite: bool = True
) -> Path:
    """Find the runs under ``paths``, render them and write ``output`` atomically; return its path. ``output`` follows
    every command's rule (:func:`eogym_sft.guards.check_output`): an existing file needs ``overwrite`` and, inside a
    run or over one of its files, must be a page."""
    from ..atomic import write_text_atomic
    from ..guards import check_output

    output = Path(output)
    runs = find_runs(paths)
    check_output(output, "eogym-sft view", overwrite, "page", inputs=[run.path for run in runs], own=is_page)
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
    add("runs", nargs="+", metavar="RUN",
        help="rollout, evaluation or training output folder(s), or a demo's output folder")
    add("--output", default="report.html", help="the HTML file to write")
    add("--overwrite", action="store_true", help="replace an existing page at --output (any other file is refused)")
    add("--data-root", default=None,
        help="folder the episodes' image paths are relative to (None: each rollout's run.json data_root)")
    add("--image-budget-mb", type=number(float), default=IMAGE_BUDGET / 2**20,
        help="MiB of embedded images; beyond it, images are links to files")
    add("--serve", action="store_true", help="also serve the page on http://127.0.0.1 (this machine only)")
    add("--port", type=number(int, 0, 65535), default=0, help="port for --serve (0: any free one)")
    add("--serve-seconds", type=number(float, 0, 366 * 86400), default=3600.0,
        help="stop serving after this many seconds")


def run_view(args) -> Path:
    """``eogym-sft view``: write the page, print its path, serve it if asked."""
    start = time.perf_counter()
    try:
        path = write_report(args.runs, args.output, args.data_root, int(args.image_budget_mb * 2**20), args.overwrite)
    except ViewError as err:
        raise SystemExit(f"eogym-sft view: {err}") from None
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB, {time.perf_counter() - start:.1f} s): open it in a "
          "browser")
    if args.serve:
        serve(path, args.port, args.serve_seconds)
    return path
