"""Training/rollout mismatch of GRPO: how far the log-probability the loss forward gives each trained token is from
the one the rollout engine sampled it with.

Both engines hand TRL each token's sampled log-probability (``_generate``'s ``logprobs``, TRL's
``sampling_per_token_logps``): the slot decoder's from the logits of each decode step (:class:`SampledLogps`),
TRL's loop's from ``generate``'s own forwards (:class:`GeneratedLogps`). Both are the policy's own, as TRL's loss
forward scores them: at the loss's temperature, before any logits processor (tests and benches force episodes
with them), top-k or top-p, the vision tokens (never sampled) left out. Per step the trainer logs, over the trained
tokens (``completion_mask * tool_mask``), ``rollout/logp_abs_diff`` (the mean |logp_rollout - logp_train|) and
``rollout/k3_kl`` (the K3 estimate of KL(rollout || train), ``exp(d) - 1 - d`` with ``d = logp_train - logp_rollout``),
as verl and ms-swift users watch them. ``logp_train`` is the policy's when the batch was generated (TRL's
``old_per_token_logps``) when TRL keeps it, else the loss forward's on the same weights (one pass a batch). LoRA
dropout on in training counts as mismatch.
"""

from __future__ import annotations

import math

import torch


def mismatch(train_logps: torch.Tensor, rollout_logps: torch.Tensor, mask: torch.Tensor) -> dict | None:
    """``{"abs_diff", "k3"}`` means over the positions of ``mask`` where both are finite; None where there is none."""
    keep = mask.bool() & torch.isfinite(rollout_logps) & torch.isfinite(train_logps)
    if not keep.any():
        return None
    d = (train_logps.detach().float() - rollout_logps.float())[keep]
    return {"abs_diff": d.abs().mean().item(), "k3": (torch.expm1(d) - d).mean().item()}


def token_logps(logits: torch.Tensor, picks, temperature: float, banned_ids=()) -> torch.Tensor:
    """``log softmax(logits / temperature)`` at each row's pick, with ``banned_ids`` at minus infinity."""
    x = logits.float() / temperature
    if len(banned_ids):
        x = x.index_fill(-1, torch.tensor(list(banned_ids), device=x.device), float("-inf"))
    picks = torch.as_tensor(picks, device=x.device).view(-1, 1)
    return x.gather(-1, picks)[:, 0] - torch.logsumexp(x, dim=-1)


class SampledLogps:
    """The slot decoder's picks' log-probabilities, kept on the device while the rollout runs (no host sync a
    step) and read once at its end: :meth:`done` marks where an episode left its slot, :meth:`turns` gives each
    marked episode the turns its slot sampled since the last mark (a pick at a turn's first token starts a turn)."""

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.events: list[tuple] = []  # ("pick", slots, generated, logps on the device) or ("done", slot, key)

    def add(self, slots, generated, logits, picks, banned_ids=()) -> None:
        self.events.append(("pick", list(slots), list(generated),
                            token_logps(logits, picks, self.temperature, banned_ids)))

    def done(self, slot: int | None, key) -> None:
        self.events.append(("done", slot, key))

    def turns(self) -> dict:
        """``{key: [[logp, ...] per turn]}`` of every episode marked :meth:`done`."""
        picks = [e[3] for e in self.events if e[0] == "pick"]
        values = iter(torch.cat(picks).tolist() if picks else [])
        open_turns: dict[int, list[list[float]]] = {}
        out = {}
        for event in self.events:
            if event[0] == "done":
                out[event[2]] = open_turns.pop(event[1], []) if event[1] is not None else []
                continue
            for slot, n in zip(event[1], event[2]):
                turns = open_turns.setdefault(slot, [])
                if n == 0 or not turns:
                    turns.append([])
                turns[-1].append(next(values))
        return out


def completion_logps(tool_mask: list[int], turns: list[list[float]], sampled_ids: list[list[int]]) -> list[float]:
    """Per completion token: its sampled log-probability where ``tool_mask`` is 1 (the sampled turns, in order;
    a cut last turn or a completion cut short only drops their ends), 0.0 elsewhere as TRL fills tool tokens. NaN
    at every trained token when the turns recorded do not match the episode's (never paired wrongly)."""
    ok = len(turns) >= len(sampled_ids) and all(len(a) == len(b) for a, b in zip(turns, sampled_ids))
    flat = iter([v for turn in turns[: len(sampled_ids)] for v in turn] if ok else [])
    return [next(flat, math.nan) if m else 0.0 for m in tool_mask]


class GeneratedLogps:
    """While ``generate`` runs (TRL's loop): each sampled token's log-probability, read from the model's own
    forwards (a forward hook: each forward's last logits, and the next forward's input token that was sampled
    from them), so no per-step scores over the vocabulary are kept."""

    def __init__(self, temperature: float, banned_ids=()):
        self.temperature, self.banned_ids = temperature, list(banned_ids)
        self._last: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def wrap(self, generate, model):
        def recorded(*args, **kwargs):
            self._last, self.steps = None, []
            handle = model.register_forward_hook(self._hook, with_kwargs=True)
            try:
                out = generate(*args, **kwargs)
            finally:
                handle.remove()
            sequences = out if isinstance(out, torch.Tensor) else out.sequences
            self._close(sequences[:, -1])
            return out

        return recorded

    def _hook(self, module, args, kwargs, output) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._close(None if ids is None else ids[:, -1])
        self._last = output.logits[:, -1].detach()

    def _close(self, tokens) -> None:
        if self._last is not None and tokens is not None:
            self.steps.append(token_logps(self._last, tokens.to(self._last.device), self.temperature,
                                          self.banned_ids).cpu())
        self._last = None

    def lists(self, lengths: list[int]) -> list[list[float]]:
        """The last ``generate``'s log-probabilities, row ``r`` cut to ``lengths[r]`` tokens; NaN for a row when
        fewer steps were recorded than its length or rows than asked for (never paired wrongly)."""
        table = torch.stack(self.steps, dim=1) if self.steps else None
        return [
            table[r, :n].tolist() if table is not None and r < len(table) and n <= table.shape[1] else [math.nan] * n
            for r, n in enumerate(lengths)
        ]
