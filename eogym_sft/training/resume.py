"""Which checkpoint a run may resume from, and when a new run may use an output folder.

Every checkpoint gets ``eogym_checkpoint.json`` once all of it is on disk (written atomically): the run's
resolved config and data hash (its *identity*). A checkpoint without it, or with it or ``trainer_state.json``
damaged, was cut short (killed while saving) and is never resumed from: ``last`` passes over it.
Resuming compares identities and names every setting that differs; settings that change only where
things are written or how often (:data:`FREE_ON_RESUME`) may differ.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from transformers import TrainerCallback

from ..atomic import write_text_atomic

logger = logging.getLogger(__name__)

MARKER = "eogym_checkpoint.json"
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
# Settings that do not change what a resumed run computes: where it writes, what and how often it
# logs, saves and evaluates, how many workers load its data.
FREE_ON_RESUME = frozenset(
    {
        "resume_from_checkpoint", "output_dir", "local_rank", "overwrite_output_dir", "logging_dir", "run_name",
        "report_to",
        "logging_steps", "logging_first_step", "logging_strategy", "save_steps", "save_strategy", "save_total_limit",
        "eval_steps", "per_device_eval_batch_size", "dataloader_num_workers", "dataloader_persistent_workers",
        "dataloader_pin_memory", "dataloader_prefetch_factor", "prep_num_proc", "prepared_dir", "disable_tqdm",
    }
)


def run_identity(configs: dict[str, dict], data_hash: str | None) -> dict:
    """What must be equal for a checkpoint to belong to this run: resolved configs (as JSON) and data hash."""
    return json.loads(json.dumps({"config": configs, "data_hash": data_hash}, default=str))


def identity_differences(saved: dict, current: dict) -> list[str]:
    """``section.key: saved -> current`` for every setting that differs, free ones aside."""
    diffs = []
    if saved.get("data_hash") != current.get("data_hash"):
        diffs.append(f"data content hash: {saved.get('data_hash')} -> {current.get('data_hash')}")
    saved_config, current_config = saved.get("config", {}), current.get("config", {})
    for section in sorted(set(saved_config) | set(current_config)):
        old, new = saved_config.get(section, {}), current_config.get(section, {})
        for key in sorted(set(old) | set(new)):
            if key not in FREE_ON_RESUME and old.get(key) != new.get(key):
                diffs.append(f"{section}.{key}: {old.get(key)!r} -> {new.get(key)!r}")
    return diffs


class CheckpointIdentity(TrainerCallback):
    """Writes the run's identity into each checkpoint after the Trainer has saved all of it."""

    def __init__(self, identity: dict):
        self.identity = identity

    def on_save(self, args, state, control, **kwargs):
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # every rank's part of the checkpoint is on disk
        if state.is_world_process_zero:
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            write_text_atomic(folder / MARKER,
                              json.dumps({**self.identity, "step": state.global_step}, indent=2) + "\n")
        return control


def checkpoints(output_dir: str | Path) -> list[Path]:
    """``checkpoint-N`` folders of ``output_dir``, newest (largest N) first."""
    folder = Path(output_dir)
    found = [p for p in folder.iterdir() if p.is_dir() and CHECKPOINT_RE.match(p.name)] if folder.is_dir() else []
    return sorted(found, key=lambda p: -int(CHECKPOINT_RE.match(p.name)[1]))


def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):  # missing, unreadable, cut short, not UTF-8
        return None
    return value if isinstance(value, dict) else None


def is_complete(checkpoint: Path) -> bool:
    """Whether the checkpoint's marker and ``trainer_state.json`` are both there and whole JSON objects."""
    state = _read_json(checkpoint / "trainer_state.json")
    return _read_json(checkpoint / MARKER) is not None and state is not None and "global_step" in state


def wants_resume(wanted) -> bool:
    """Whether ``--resume_from_checkpoint`` asks to resume (a path, ``true`` or ``last``)."""
    return wanted is not None and str(wanted).lower() not in ("false", "none", "")


def resolve_resume(wanted, output_dir: str | Path, identity: dict) -> Path | None:
    """The checkpoint to resume from (``None``: start fresh), checked to be complete and of this run.

    ``wanted`` is ``--resume_from_checkpoint``: a path, ``true``/``last`` for the newest complete
    checkpoint in ``output_dir`` (an incomplete newer one is passed over, with a warning), or unset.
    """
    if not wants_resume(wanted):
        return None
    if str(wanted).lower() in ("true", "last"):
        found = checkpoints(output_dir)
        complete = [c for c in found if is_complete(c)]
        if not complete:
            what = f"only incomplete ones ({', '.join(c.name for c in found)})" if found else "no checkpoint-* folder"
            raise FileNotFoundError(f"--resume_from_checkpoint {wanted}: {output_dir} holds {what}")
        for skipped in found[: found.index(complete[0])]:
            logger.warning(
                "%s is incomplete (%s or trainer_state.json missing or damaged: cut short while saving): resuming "
                "from %s",
                skipped, MARKER, complete[0].name,
            )
        chosen = complete[0]
    else:
        chosen = Path(wanted)
        if not is_complete(chosen):
            raise FileNotFoundError(
                f"--resume_from_checkpoint {wanted}: not a complete checkpoint ({MARKER} or trainer_state.json "
                "missing or damaged)"
            )
    diffs = identity_differences(json.loads((chosen / MARKER).read_text()), identity)
    if diffs:
        raise ValueError(
            f"{chosen} belongs to another run; what differs (checkpoint -> now):\n  " + "\n  ".join(diffs)
        )
    return chosen


def finished(checkpoint: Path) -> bool:
    """Whether the run had already reached its last step when ``checkpoint`` was saved."""
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    return state["global_step"] >= state["max_steps"] > 0


def refuse_used_output_dir(output_dir: str | Path, overwrite: bool, resuming: bool) -> None:
    """A new run does not write into a folder that holds checkpoints or an adapter of an earlier run."""
    folder = Path(output_dir)
    log = folder / "skipped_samples.jsonl"  # appended to as the run goes: never through a link to another file
    if log.is_symlink() and (resuming or not overwrite):  # --overwrite_output_dir removes the link itself
        raise FileExistsError(f"{log} is a symbolic link: a run's log is never written through a link; remove it or "
                              "pick another --output_dir")
    earlier = checkpoints(folder) + [p for p in (folder / "adapter_model.safetensors",
                                                 folder / "eogym_run.json") if p.exists()]
    if earlier and not (overwrite or resuming):
        raise FileExistsError(
            f"{folder} holds an earlier run ({', '.join(p.name for p in earlier[:3])}): pass --resume_from_checkpoint "
            "last to continue it, --overwrite_output_dir true to start over in it, or another --output_dir"
        )


def clear_earlier_run(output_dir: str | Path) -> None:
    """``overwrite_output_dir``: remove an earlier run's checkpoints, so that resuming later never meets them."""
    import shutil

    for folder in checkpoints(output_dir):
        logger.warning("overwrite_output_dir: removing %s", folder)
        shutil.rmtree(folder)
    # the earlier run's lists and records: a new run starts its own (the trainer appends to skipped_samples.jsonl)
    for name in ("skipped_samples.jsonl", "eogym_run.json"):
        (Path(output_dir) / name).unlink(missing_ok=True)


def claim_output_dir(training_args, overwrite: bool) -> None:
    """Before a run writes anything: a new run refuses a used ``output_dir``, or with ``overwrite`` clears it."""
    resuming = wants_resume(training_args.resume_from_checkpoint)
    refuse_used_output_dir(training_args.output_dir, overwrite, resuming)
    if overwrite and not resuming and training_args.process_index == 0:
        clear_earlier_run(training_args.output_dir)


def resume_point(training_args, configs: dict, data_hash: str | None) -> tuple[dict, Path | None]:
    """This run's identity (resolved ``configs`` and ``data_hash``) and the checkpoint it resumes from
    (``None``: from the start). A checkpoint that already finished the run is returned too, with a warning:
    :func:`finished` tells the caller there is nothing to train."""
    from .run_info import as_dict

    identity = run_identity({name: as_dict(cfg) for name, cfg in configs.items()}, data_hash)
    checkpoint = resolve_resume(training_args.resume_from_checkpoint, training_args.output_dir, identity)
    if checkpoint is not None and finished(checkpoint):
        logger.warning("%s: this run already finished (step %s); nothing to train", checkpoint,
                       checkpoint.name.split("-")[-1])
    return identity, checkpoint
