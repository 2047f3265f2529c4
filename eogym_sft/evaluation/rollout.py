"""``eogym-sft rollout``: closed-loop episodes of a base Qwen3-VL and LoRA adapters on EO-Gym questions,
scored as the paper scores them (Pass@k of final answers against ``gt_answer``).

For every arm (the base, then each adapter, then each policy server) and every row, ``samples`` episodes
start from the row's system prompt, tools and question (any gold trajectory after it is ignored, so
question-only rows work). Local arms run in :mod:`eogym_sft.agent.episodes` on one
:class:`~eogym_sft.agent.decoder.SlotDecoder`; policy arms against an OpenAI-compatible server
(:mod:`eogym_sft.agent.policy_server`). Outputs in ``--output``: ``episodes.jsonl`` (one EO-Gym row
per episode, readable by ``eogym-sft prepare`` with the same ``--data-root``; an append-only log a rerun
continues, :mod:`eogym_sft.evaluation.resume`), ``run.json``, ``skipped.jsonl``, ``summary.json`` and
``report.txt``. Under ``torchrun`` the rows are shared out over the ranks (:mod:`eogym_sft.evaluation.ranks`).
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from collections import Counter
from pathlib import Path

from ..data.datasets import read_rows
from ..data.prepare import DROP_SHARE, check_reason_share
from ..data.images import ImageError, image_size, resolve_image_path
from ..data.traces import TraceError
from ..metrics.judge import ChatJudge, judge_all, load_judge
from ..metrics.scoring import normalize_answer
from ..metrics.tool_args import gold_calls
from ..agent.decoder import SlotDecoder
from ..agent.rollout_config import CPU_SLOTS, sized_slots
from ..agent.sampling import Sampling
from . import ranks
from ..agent.episodes import (
    LoopConfig,
    canonical_prompt,
    new_episode,
    question_messages,
    run_episodes,
)
from ..agent.policy_server import run_policy_episodes
from ..atomic import write_lines_atomic, write_text_atomic
from ..safe_json import record_line
from .report import format_rollout_report, policy_error_code, summarize_rollouts
from .resume import (
    EpisodeLog,
    episode_file,
    merge_episodes,
    open_run,
    order_key,
    read_episodes,
    redacted,
    resume_key,
    run_identity,
)
from .run_args import RolloutConfig, recorded_settings


def read_questions(cfg: RolloutConfig) -> tuple[list[tuple[str, dict]], list[dict]]:
    """``(source, row)`` for every usable row (its question renders and its images exist) and one entry
    per row that is not, naming file, line, field and reason."""
    rows, failures, seen = [], [], {}
    for source, row in read_rows(cfg.data, cfg.limit):
        try:
            if isinstance(row, TraceError):
                raise row
            if not isinstance(row, dict):
                raise TraceError("not_an_object", "<row>", f"a row must be a JSON object, got {type(row).__name__}")
            trace = canonical_prompt({**row, "messages": question_messages(row)}, cfg.tool_images)
            if trace.id in seen:
                raise TraceError("duplicate_id", "id", f"id {trace.id!r} already used at {seen[trace.id]}")
            for rel in trace.images:
                image_size(resolve_image_path(rel, cfg.data_root))
        except TraceError as err:
            failures.append({"source": source, "reason": err.reason, "field": err.field, "detail": err.detail})
            continue
        except ImageError as err:
            failures.append({"source": source, "reason": err.reason, "field": f"image {err.path}",
                             "detail": err.detail})
            continue
        seen[trace.id] = source
        rows.append((source, row))
    return rows, failures


def make_judge(cfg: RolloutConfig):
    """The judge the flags ask for, or None for the rule-based match alone."""
    if cfg.judge:
        return load_judge(cfg.judge)
    if cfg.judge_url:
        return ChatJudge(cfg.judge_url, cfg.judge_model, timeout=cfg.judge_timeout, retries=cfg.judge_retries)
    return None


def score_episodes(records: list[dict], judge=None) -> None:
    """Set ``rule_correct`` (normalised answer equals ``gt_answer``) and ``correct`` on each record:
    the judge's verdict when there is a judge (``None`` plus ``judge_error`` when its request failed),
    else the rule. No ``gt_answer``: both ``None``. No final answer: wrong, with no judge request."""
    asks = []
    for r in records:
        gt = str(r.get("gt_answer") or "").strip()
        answer = r["final_answer"]
        r["rule_correct"] = None if not gt else answer is not None and normalize_answer(answer) == normalize_answer(gt)
        r["correct"] = r["rule_correct"]
        r["judge_error"] = None
        if judge is not None and gt and answer is not None:
            asks.append(r)
    if not asks:
        return
    verdicts = judge_all(judge, [(_question_text(r), r["final_answer"], str(r["gt_answer"])) for r in asks])
    for r, (verdict, error) in zip(asks, verdicts):
        r["correct"], r["judge_error"] = verdict, error


def _question_text(record: dict) -> str:
    user = next((m for m in record["messages"] if m.get("role") == "user"), {})
    content = user.get("content")
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content or "").replace("<image>", "").strip()


def default_env_factory(cfg: RolloutConfig):
    """``row -> EOGymEnvironment`` with the backends of ``--tools``."""
    from ..environment.env import EOGymEnvironment

    def factory(row: dict):
        return EOGymEnvironment(row, cfg.data_root, backends=tuple(cfg.tools), http=cfg.tool_url,
                                attach=cfg.tool_images)

    return factory


def rollout(cfg: RolloutConfig, progress: bool = True, env_factory=None) -> dict | None:
    """Run every arm over every usable row ``cfg.samples`` times; write the outputs; return the summary
    (``None`` on ranks other than 0 of a multi-process run).

    Episodes already in ``cfg.output`` from an interrupted run of the same settings are kept and not
    run again (:mod:`eogym_sft.evaluation.resume`). Under ``torchrun`` or ``accelerate launch``
    (``RANK``/``WORLD_SIZE`` set) each rank runs every ``WORLD_SIZE``-th row and rank 0 merges.
    """
    from ..models.loading import parse_arms

    out = Path(cfg.output)
    group = ranks.join()
    local_arms = (
        parse_arms(cfg.adapters, cfg.model, cfg.include_base, cfg.allow_other_base)
        if cfg.include_base or cfg.adapters
        else []
    )
    names = [a.name for a in local_arms] + [p.name for p in cfg.policies]
    if len(set(names)) != len(names):
        raise ValueError(f"arm names must be unique, got {names}: name adapters NAME=DIR and policies --policy-model "
                         "NAME=MODEL")
    rows, failures = read_questions(cfg)  # before the output is made: a wrong data root writes nothing
    check_reason_share(failures, len(rows) + len(failures), 1.0 if cfg.allow_drops else DROP_SHARE)
    key = resume_key(cfg)
    locks = []  # rank 0 holds the output's lock until the run ends (or the process does)
    ranks.agree(group, lambda: locks.append(open_run(out, key, cfg.overwrite, "eogym-sft rollout", inputs=cfg.data)))
    try:
        return _run(cfg, out, group, local_arms, names, rows, failures, progress, env_factory, run_identity(key))
    finally:
        for lock in locks:
            lock.release()


def run_secrets(cfg: RolloutConfig) -> list[str]:
    """The keys this run sends (policy servers', the judge's): never written to a record."""
    envs = [p.api_key_env for p in cfg.policies if p.api_key_env] + (["OPENAI_API_KEY"] if cfg.judge_url else [])
    return [os.environ[e] for e in envs if os.environ.get(e)]


def _run(cfg: RolloutConfig, out: Path, group, local_arms, names, rows, failures, progress, env_factory,
         identity) -> dict | None:
    from tqdm.auto import tqdm

    from ..models.loading import resolve_device
    from ..models.processor import load_processor

    expected = {(name, str(r.get("id")), k) for name in names for _, r in rows for k in range(cfg.samples)}
    # only this run's own records (model, adapters, policies, settings)
    earlier = read_episodes(out, expected, identity)
    judge = make_judge(cfg)
    device, dtype = resolve_device(ranks.local_device(cfg.device, group), cfg.dtype)
    env_factory = env_factory or default_env_factory(cfg)
    processor = load_processor(cfg.model, cfg.max_pixels, cfg.min_pixels)
    mine = rows[group.rank :: group.world]
    todo = {
        name: [(s, r, k) for s, r in mine for k in range(cfg.samples) if (name, str(r.get("id")), k) not in earlier]
        for name in names
    }
    sampling = Sampling(cfg.temperature, cfg.top_p, cfg.top_k)
    loop = LoopConfig(cfg.max_turns, cfg.max_new_tokens, cfg.tool_images, cfg.seed)
    graphs = cfg.cuda_graphs and device.type == "cuda"
    local = _LocalArms(cfg, local_arms, device, dtype, graphs, max(len(v) for v in todo.values()) if todo else 1)
    timing = {}
    bar = tqdm(total=sum(map(len, todo.values())), unit="episode", desc="rollout", disable=not progress)
    with EpisodeLog(out / episode_file(group), run_secrets(cfg), identity) as log, Scorer(judge, log) as scorer:
        for name in names:
            if not todo[name]:
                continue
            bar.set_description(f"rollout {name}")
            episodes = (start_episode(row, source, name, k, env_factory) for source, row, k in todo[name])
            policy = next((p for p in cfg.policies if p.name == name), None)
            if policy is not None:
                stats = run_policy_episodes(policy, processor, episodes, sampling, loop, cfg.data_root, scorer.add,
                                            bar)
            else:
                stats = local.run(name, processor, episodes, sampling, loop, scorer.add, bar)
            timing[name] = {**stats, "episodes": len(todo[name])}
    bar.close()
    timing = ranks.gather_timing(group, timing)
    if group.rank != 0:
        ranks.leave(group)
        return None
    records = merge_episodes(out, order_key(names, rows))
    ranks.leave(group)
    settings = _ran_settings(cfg, local_arms, device, dtype, graphs, group.world, local.slots)
    counts = _counts(rows, failures, records, earlier)
    gold = {str(row.get("id")): gold_calls(row) for _, row in rows}
    counts["questions_with_gold"] = sum(calls is not None for calls in gold.values())
    summary = summarize_rollouts(records, names, cfg.ks, settings, counts, timing, gold)
    problems = failures + [_episode_problem(r) for r in records if r["stop_reason"] == "error" or r["judge_error"]]
    write_lines_atomic(out / "skipped.jsonl", (record_line(item) for item in problems))
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=2, ensure_ascii=True) + "\n")
    report = format_rollout_report(summary)
    write_text_atomic(out / "report.txt", report + "\n")
    print(report)
    return summary


def _ran_settings(cfg: RolloutConfig, local_arms, device, dtype, graphs: bool, world: int, slots) -> dict:
    """The settings summary.json records: those asked for (secrets redacted), then what ran."""
    import torch

    settings = redacted(recorded_settings(cfg, local_arms, device, dtype))  # a URL's user:password@ stays out
    settings["cuda_graphs"] = graphs  # what ran: the setting asks for graphs only where a GPU can replay them
    settings["peak_memory_bytes"] = (
        torch.cuda.max_memory_allocated(device) if device.type == "cuda" and local_arms else None
    )
    settings["world_size"] = world
    settings["slots_used"] = slots  # what ran: --slots, or what the GPU held (None: no local arm ran)
    return settings


def _counts(rows: list, failures: list, records: list[dict], earlier) -> dict:
    """The run's counts of rows, questions and episodes (resumed, failed and why) for summary.json."""
    return {
        "rows_in": len(rows) + len(failures),
        "rows_failed": len(failures),
        "questions": len(rows),
        "episodes": len(records),
        "episodes_resumed": sum(1 for r in records if (r["arm"], r["source_id"], r["sample"]) in earlier),
        "episode_errors": sum(r["stop_reason"] == "error" for r in records),
        "policy_errors": sum(policy_error_code(r) is not None for r in records),
        "policy_errors_by_code": dict(sorted(Counter(c for c in map(policy_error_code, records) if c).items())),
        "judge_failed": sum(bool(r["judge_error"]) for r in records),
        "episodes_unrecordable": sum(str(r["error"] or "").startswith(UNRECORDABLE) for r in records),
    }


class _LocalArms:
    """The base model and adapters of one process, loaded at the first local arm that has work."""

    def __init__(self, cfg: RolloutConfig, arms: list, device, dtype, graphs: bool, most_episodes: int):
        self.cfg, self.arms, self.device, self.dtype, self.graphs = cfg, arms, device, dtype, graphs
        self.most_episodes, self.slots = max(1, most_episodes), None  # sized once the model is loaded
        self.model = self.decoder = None

    def run(self, name: str, processor, episodes, sampling, loop, on_done, bar) -> dict:
        from ..models.loading import load_inference_model, use_arm

        if self.model is None:
            self.model = load_inference_model(self.cfg.model, self.arms, self.device, self.dtype)
            adapters = any(arm.adapter for arm in self.arms)
            self.slots = sized_slots(self.model, self.most_episodes, self.cfg.max_episode_tokens, self.cfg.slots,
                                     adapters, "--slots", CPU_SLOTS)
            self.decoder = SlotDecoder(self.model, self.slots, self.cfg.max_episode_tokens, cuda_graphs=self.graphs)
        arm = next(a for a in self.arms if a.name == name)
        with use_arm(self.model, arm):
            stats = run_episodes(self.decoder, processor, episodes, sampling, loop, self.cfg.data_root, on_done, bar)
        self.decoder.reset()  # the next arm's weights make these caches and graphs stale
        return stats


class Scorer:
    """Scores each finished episode (rule, then the judge in worker threads) and appends it to the log;
    a judge's failure is recorded in the episode, a failure to write ends the run."""

    def __init__(self, judge, log, workers: int = 8):
        self.judge, self.log = judge, log
        self.pool = ThreadPoolExecutor(max_workers=workers) if judge is not None else None
        self.futures = []

    def add(self, episode) -> None:
        record = episode.record()
        if self.pool is None:
            self._score(record)
        else:
            self.futures.append(self.pool.submit(self._score, record))

    def _score(self, record: dict) -> None:
        score_episodes([record], self.judge)
        try:
            self.log.write(record)
        except (TypeError, ValueError, RecursionError) as err:  # a value JSON cannot hold: this episode fails alone
            self.log.write(unrecordable(record, err))

    def __enter__(self):
        return self

    def __exit__(self, kind, *exc):
        if self.pool is None:
            return
        self.pool.shutdown(wait=True, cancel_futures=kind is not None)  # interrupted: judge no more
        if kind is None:
            for future in self.futures:
                future.result()  # a write that failed raises here


UNRECORDABLE = "unrecordable"
OUTCOME_DEFAULTS = {"turns": 0, "tool_calls": 0, "tool_errors": 0, "tool_error_codes": {}, "new_tokens": 0,
                    "final_answer": None,
                    "correct": None, "rule_correct": None, "judge_error": None, "images_seen": []}


def unrecordable(record: dict, err: BaseException) -> dict:
    """What the log keeps of an episode whose record cannot be written as JSON: its identity and the fields that
    can, no conversation, ended in ``error`` naming why (so it is counted, and a rerun does not retry it)."""
    kept = {}
    for name, value in record.items():
        try:
            record_line(value)
        except (TypeError, ValueError, RecursionError):
            continue
        kept[name] = value
    kept = {**OUTCOME_DEFAULTS, **kept, "messages": [], "stop_reason": "error", "correct": None}
    kept["error"] = f"{UNRECORDABLE}: the record is not JSON ({type(err).__name__}: {str(err)[:200]})"
    return kept


def start_episode(row: dict, source: str, arm: str, sample: int, env_factory):
    """A new episode with its own environment; one whose environment cannot be built ends at once in
    ``error``, named, and the run goes on."""
    try:
        env = env_factory(row)
    except Exception as err:  # a row the environment refuses fails alone
        episode = new_episode(row, source, arm, sample, None)
        episode.fail(err)
    else:
        episode = new_episode(row, source, arm, sample, env)
    episode.row["gold_calls"] = gold_calls(row)  # the trace's calls, for the viewer beside the model's
    return episode


def _episode_problem(record: dict) -> dict:
    reason = "episode_error" if record["stop_reason"] == "error" else "judge_failed"
    return {"source": record["source"], "episode": record["id"], "reason": reason,
            "detail": record["error"] or record["judge_error"]}
