"""Several processes over one rollout: ``torchrun`` and ``accelerate launch`` set ``RANK``,
``WORLD_SIZE`` and ``LOCAL_RANK``; each rank runs its share of the rows on its own GPU and rank 0
writes the summary. The ranks talk through a gloo process group (small Python objects only), so the
same code runs on CPU. One process (no ``WORLD_SIZE``) needs no process group at all."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass
class Group:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    owns_group: bool = False  # this module started the process group and ends it


def _env_int(name: str, default: int, low: int, high: int | None = None) -> int:
    """The launcher's variable ``name`` as an int in ``low..high-1``, or one line naming it."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value >= high):
        bounds = f">= {low}" if high is None else f"from {low} to {high - 1}"
        raise ValueError(f"the environment variable {name}={raw!r} must be a whole number {bounds}")
    return value


def placement() -> tuple[int, int, int]:
    """``(rank, world_size, local_rank)`` from the launcher's variables, checked: a rank outside the world
    would wait in the rendezvous for ever."""
    world = _env_int("WORLD_SIZE", 1, 1)
    return _env_int("RANK", 0, 0, world), world, _env_int("LOCAL_RANK", 0, 0, world)


def join() -> Group:
    """This process's place among the ranks, joining the process group when there are several."""
    rank, world, local_rank = placement()
    if world == 1:
        return Group()
    import torch.distributed as dist

    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("gloo")
    return Group(dist.get_rank(), dist.get_world_size(), local_rank, owns)


def agree(group: Group, check) -> None:
    """Run ``check()`` on rank 0 only; an exception there is raised on every rank (none hangs waiting)."""
    problem = None
    if group.rank == 0:
        try:
            check()
        except (FileExistsError, ValueError, OSError) as err:
            problem = err
    if group.world > 1:
        import torch.distributed as dist

        box = [problem]
        dist.broadcast_object_list(box, src=0)
        problem = box[0]
    if problem is not None:
        raise problem


def local_device(device: str, group: Group) -> str:
    """``device`` with each rank on its own GPU when several ranks share a host."""
    if group.world > 1 and device in ("auto", "cuda"):
        import torch

        if torch.cuda.is_available():
            torch.cuda.set_device(group.local_rank)
            return f"cuda:{group.local_rank}"
    return device


def gather_timing(group: Group, timing: dict) -> dict:
    """Each arm's timing over all ranks (wall time the slowest rank's, counts summed), with rates."""
    parts = [timing]
    if group.world > 1:
        import torch.distributed as dist

        parts = [None] * group.world
        dist.all_gather_object(parts, timing)
    merged: dict = {}
    for part in parts:
        for arm, stats in part.items():
            into = merged.setdefault(arm, {})
            for k, v in stats.items():
                into[k] = max(into.get(k, 0), v) if k == "seconds" else into.get(k, 0) + v
    for stats in merged.values():
        seconds = stats["seconds"]
        stats["ranks"] = len(parts)
        stats["episodes_per_min"] = stats["episodes"] / (seconds / 60) if seconds else None
        stats["new_tokens_per_s"] = stats["new_tokens"] / seconds if seconds else None
    return merged


def leave(group: Group) -> None:
    """Wait for every rank (rank 0 has merged the logs), then end the process group if ours."""
    if group.world > 1:
        import torch.distributed as dist

        dist.barrier()
        if group.owns_group:
            dist.destroy_process_group()
