"""The GRPO reward of one closed-loop episode, and the per-batch diagnostics it logs.

reward = score x (1 - min(tool calls x tool_call_cost x action_cost_scale, max_cost_penalty)) + crop_iou_weight x crop
IoU

``score`` is 1 when the episode ends with a ``Final Answer:`` that matches ``gt_answer`` (the rule-based
normalised match of :mod:`eogym_sft.metrics.scoring`, or a judge), else 0; an episode that never answers
scores 0, and so does a truncated one (cut before ``<|im_end|>``), whatever its cut text says: evaluation
scores that turn as wrong, and rewarding it would reinforce "answer, then ramble to the limit". Every tool call costs,
invalid ones included, but the cost can take at most ``max_cost_penalty`` of the score: the capped action cost of the
GeoGuesser seed (run 3). The crop term, off by default, rewards the argument rather than the answer: per gold call with
a box (the row's own trace), the best IoU of the episode's calls to that tool
(:func:`eogym_sft.metrics.tool_args.crop_iou`), averaged; rows without gold boxes and truncated episodes get none. Pure
Python, no model.
"""

from __future__ import annotations

import json
import logging
import statistics
from dataclasses import dataclass, field

from ..metrics.judge import judge_all
from ..metrics.scoring import extract_final_answer, normalize_answer
from ..metrics.tool_args import crop_iou, gold_calls
from ..safe_json import UntrustedJSONError, loads

logger = logging.getLogger(__name__)

IM_END, END_OF_TEXT = 151645, 151643


def _assistant_turns(messages: list[dict]) -> list[dict]:
    return [m for m in messages if m.get("role") == "assistant"]


def _text(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content or [] if isinstance(p, dict) and p.get("type") == "text")


@dataclass
class Outcome:
    """What one episode did and what it earned."""

    answer: str | None
    score: float | None  # None: the judge failed, the episode is left unscored
    tool_calls: int  # calls the model made: parsed ones and <tool_call> blocks that did not parse
    invalid_calls: int  # calls that did not parse, named an unknown tool or had bad arguments
    turns: int  # assistant turns
    truncated: bool  # the last turn ran out of tokens before <|im_end|>
    penalty: float  # share of the score taken by the action cost
    reward: float | None
    crop_iou: float | None = None  # the crop term before its weight; None: no gold box, or the term is off

    def to_json(self) -> dict:
        return self.__dict__.copy()


@dataclass
class EpisodeReward:
    """TRL reward function over closed-loop episodes (``reward_funcs=[EpisodeReward(...)]``).

    Reads each completion (the assistant turns and tool results TRL recorded), the environment that ran
    its tool calls (its ``tool_calls`` and ``tool_errors`` counts) and the row's ``gt_answer``; logs the
    mean of every component and the seed's diagnostics through TRL's ``log_metric``.

    Args:
        num_generations (`int`): episodes per question; consecutive completions form a group.
        tool_call_cost (`float`, *optional*, defaults to `0.1`): cost of one tool call.
        action_cost_scale (`float`, *optional*, defaults to `0.2`): the seed's action cost scale.
        max_cost_penalty (`float`, *optional*, defaults to `0.2`): the largest share of the score the cost may take.
        judge (`callable`, *optional*): ``judge(question, prediction, reference) -> bool``, e.g. a
            :class:`~eogym_sft.metrics.judge.ChatJudge`; default: the normalised match.
        eos_token_ids (`tuple[int, ...]`): tokens that end a turn; a completion ending otherwise was truncated.
        judge_workers (`int`, *optional*, defaults to `8`): judge requests in flight at once.
        crop_iou_weight (`float`, *optional*, defaults to `0.0`): weight of the crop term (0: off, no gold read).
    """

    num_generations: int
    tool_call_cost: float = 0.1
    action_cost_scale: float = 0.2
    max_cost_penalty: float = 0.2
    judge: object = None
    eos_token_ids: tuple = (IM_END, END_OF_TEXT)
    judge_workers: int = 8
    crop_iou_weight: float = 0.0
    judge_errors: int = field(default=0, init=False)
    __name__ = "eogym_episode"  # TRL logs the reward as rewards/eogym_episode/mean

    def verdicts(self, questions: list[str], answers: list[str | None], references: list[str]) -> list[bool | None]:
        """Right or wrong per answer (no answer: wrong); ``None`` where the judge failed (counted)."""
        if self.judge is None:
            return [a is not None and normalize_answer(a) == normalize_answer(r) for a, r in zip(answers, references)]
        asked = [i for i, a in enumerate(answers) if a is not None]
        results = judge_all(self.judge, [(questions[i], answers[i], references[i]) for i in asked], self.judge_workers)
        verdicts: list[bool | None] = [False] * len(answers)
        for i, (verdict, error) in zip(asked, results):
            verdicts[i] = verdict
            if error is not None:  # a remote judge failing must not end the run: unscored and counted
                self.judge_errors += 1
                logger.warning("judge failed (%d so far), episode left unscored: %s", self.judge_errors, error)
        return verdicts

    def truncated(self, completion_ids: list[int]) -> bool:
        """Whether the episode was cut before its last turn's end token."""
        return not completion_ids or completion_ids[-1] not in self.eos_token_ids

    def outcome(
        self, messages: list[dict], completion_ids: list[int], correct: bool | None, executed: int = 0,
        failed: int = 0,
        gold: list[dict] | None = None,
    ) -> Outcome:
        """One episode's outcome; ``correct`` is its verdict (``None``: unscored), ``executed``/``failed`` the
        calls the environment ran / answered with an error, ``gold`` the row's gold calls (for the crop term)."""
        turns = _assistant_turns(messages)
        parsed = sum(len(m.get("tool_calls") or []) for m in turns)
        # TRL keeps a <tool_call> block that does not parse as plain text in the turn's content.
        unparsed = sum(_text(m.get("content")).count("<tool_call>") for m in turns)
        calls = parsed + unparsed
        penalty = min(calls * self.tool_call_cost * self.action_cost_scale, self.max_cost_penalty)
        truncated = self.truncated(completion_ids)
        score = 0.0 if truncated else None if correct is None else float(correct)
        reward = None if score is None else score * (1 - penalty)
        iou = crop_iou(gold, model_calls(turns)) if self.crop_iou_weight and gold else None
        if reward is not None and iou is not None and not truncated:
            reward += self.crop_iou_weight * iou
        # Parsed calls the environment never ran were refused by TRL itself (a tool name it does not know).
        invalid = unparsed + failed + max(parsed - executed, 0)
        return Outcome(final_answer(messages), score, calls, invalid, len(turns), truncated, penalty, reward, iou)

    def __call__(
        self, prompts, completions, completion_ids, gt_answer, environments=None, log_metric=None, log_extra=None,
        row=None, **_
    ):
        envs = environments or [None] * len(completions)
        rows = row if self.crop_iou_weight and row is not None else [None] * len(completions)
        golds = [gold_calls(loads(r)) if isinstance(r, str) else None for r in rows]
        # A truncated episode scores 0 whatever it says: the judge is not asked.
        answers = [None if self.truncated(ids) else final_answer(c) for c, ids in zip(completions, completion_ids)]
        verdicts = self.verdicts([question_text(p) for p in prompts], answers, list(gt_answer))
        outcomes = [
            self.outcome(c, ids, v, getattr(e, "tool_calls", 0), getattr(e, "tool_errors", 0), g)
            for c, ids, v, e, g in zip(completions, completion_ids, verdicts, envs, golds)
        ]
        rewards = [o.reward for o in outcomes]
        if log_metric is not None:
            for name, value in self.diagnostics(outcomes).items():
                log_metric(name, value)
        if log_extra is not None:
            log_extra("episode", [json.dumps(o.to_json()) for o in outcomes])
        return rewards

    def diagnostics(self, outcomes: list[Outcome]) -> dict:
        """Batch means of the reward components and episode shape, and the within-group reward spread."""
        n = len(outcomes)
        scored = [o for o in outcomes if o.reward is not None]
        out = {
            "episode/tool_calls": sum(o.tool_calls for o in outcomes) / n,
            "episode/invalid_calls": sum(o.invalid_calls for o in outcomes) / n,
            "episode/turns": sum(o.turns for o in outcomes) / n,
            "episode/answered": sum(o.answer is not None for o in outcomes) / n,
            "episode/truncated": sum(o.truncated for o in outcomes) / n,
            "episode/unscored": (n - len(scored)) / n,
            "reward/score": sum(o.score for o in scored) / len(scored) if scored else 0.0,
            "reward/cost_penalty": sum(o.penalty for o in outcomes) / n,
        }
        ious = [o.crop_iou for o in outcomes if o.crop_iou is not None]
        if ious:
            out["reward/crop_iou"] = sum(ious) / len(ious)
        spread = group_spread([o.reward for o in outcomes], self.num_generations)
        if spread is not None:
            out["reward/group_std"] = spread
        return out


def group_spread(rewards: list[float | None], group_size: int) -> float | None:
    """Mean over groups of the (population) standard deviation of the rewards within each group.

    Groups are consecutive runs of ``group_size`` completions, as TRL lays them out. Unscored episodes
    are left out of their group; a group with fewer than two scored episodes is skipped. ``None`` when no
    group qualifies. The GeoGuesser seed watched this: near zero, GRPO has no signal to learn from.

    >>> group_spread([1.0, 0.0, 0.5, 0.5], 2)
    0.25
    """
    if group_size < 2 or len(rewards) % group_size:
        return None
    spreads = []
    for start in range(0, len(rewards), group_size):
        group = [r for r in rewards[start : start + group_size] if r is not None]
        if len(group) > 1:
            spreads.append(statistics.pstdev(group))
    return sum(spreads) / len(spreads) if spreads else None


def model_calls(turns: list[dict]) -> list[dict]:
    """The parsed calls of the assistant turns, ``{"name", "arguments"}`` each (arguments JSON text parsed)."""
    out = []
    for m in turns:
        for c in m.get("tool_calls") or []:
            fn = c.get("function") or {}
            args = fn.get("arguments")
            try:
                args = loads(args) if isinstance(args, str) else args
            except UntrustedJSONError:
                pass  # kept as text: it holds no box
            out.append({"name": fn.get("name"), "arguments": args if isinstance(args, dict) else {}})
    return out


def final_answer(messages: list[dict]) -> str | None:
    """The ``Final Answer:`` of an episode's last assistant turn, if that turn makes no tool call."""
    turns = _assistant_turns(messages)
    if not turns or turns[-1].get("tool_calls"):
        return None
    return extract_final_answer(_text(turns[-1].get("content")))


def question_text(prompt: list[dict]) -> str:
    """The text of the prompt's user turns: what a judge is shown as the question."""
    return "\n".join(_text(m.get("content")) for m in prompt if m.get("role") == "user")
