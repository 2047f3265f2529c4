"""What the slots engine logs of a step's rollout: its own ``rollout/...`` metrics, and the length and tool metrics
TRL's ``_generate`` logs, under TRL's names."""

from __future__ import annotations

import torch


def log_rollout(trainer, mode: str, stats: dict, encode_seconds: float, slots: int, samples, episodes) -> None:
    """The rollout's own metrics (``rollout/...``), then TRL's length and tool metrics (:func:`log_lengths`)."""
    metrics = trainer._metrics[mode]
    metrics["rollout/seconds"].append(stats["seconds"])
    metrics["rollout/encode_seconds"].append(encode_seconds)
    metrics["rollout/new_tokens_per_s"].append(stats["new_tokens"] / max(stats["seconds"], 1e-9))
    metrics["rollout/slots"].append(float(slots))
    metrics["rollout/failed"].append(sum(s.failed for s in samples) / len(samples))
    log_lengths(trainer, samples, [ep.calls for ep in episodes], [env.tool_errors for env in trainer.environments],
                trainer.accelerator.device, mode)


def log_lengths(trainer, samples, calls, failures, device, mode) -> None:
    """The length and tool metrics TRL's ``_generate`` logs, under the same names."""
    gather = trainer.accelerator.gather
    prompt_lengths = gather(torch.tensor([len(s.prompt_ids) for s in samples], device=device))
    lengths = gather(torch.tensor([sum(s.tool_mask) for s in samples], device=device)).float()
    truncated = gather(torch.tensor([s.truncated for s in samples], device=device))
    if mode == "train":
        trainer.state.num_input_tokens_seen += (prompt_lengths.sum() + lengths.sum()).item()
    m = trainer._metrics[mode]
    m["num_tokens"] = [trainer.state.num_input_tokens_seen]
    m["completions/mean_length"].append(lengths.mean().item())
    m["completions/min_length"].append(lengths.min().item())
    m["completions/max_length"].append(lengths.max().item())
    m["completions/clipped_ratio"].append(truncated.float().mean().item())
    ended = lengths[~truncated] if (~truncated).any() else torch.zeros(1, device=device)
    m["completions/mean_terminated_length"].append(ended.mean().item())
    m["completions/min_terminated_length"].append(ended.min().item())
    m["completions/max_terminated_length"].append(ended.max().item())
    total_calls = gather(torch.tensor(sum(calls), device=device)).sum()
    total_failures = gather(torch.tensor(sum(failures), device=device)).sum()
    m["tools/call_frequency"].append((total_calls / len(prompt_lengths)).item())
    m["tools/failure_frequency"].append((total_failures / total_calls).item() if total_calls > 0 else 0.0)
