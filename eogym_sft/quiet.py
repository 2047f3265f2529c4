"""Noise from other libraries that says nothing to a user of this one, silenced by name."""

from __future__ import annotations

import logging
import os
import warnings
from contextlib import contextmanager

DEEPSPEED_PROBE = "Setting accelerator to CPU"
# transformers 5.24 renamed gradient checkpointing to activation checkpointing; PEFT (when it wraps a model) and TRL
# (around every generation of GRPO) still use the old names: a FutureWarning each, about nothing our settings do.
OLD_CHECKPOINTING_NAMES = ("is_gradient_checkpointing", "gradient_checkpointing_disable",
                           "gradient_checkpointing_enable")
# TRL's notice on every GRPOTrainer given an `environment_factory`, which the GRPO recipe is built on (docs/rl.md)
TRL_EXPERIMENTAL_ENVIRONMENT = "You are using 'environment_factory', which is an experimental feature"


class _DropDeepSpeedProbe(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(DEEPSPEED_PROBE)


def quiet_deepspeed_probe() -> None:
    """Drop DeepSpeed's "Setting accelerator to CPU" warning, which accelerate and transformers trigger on
    every import of an installed DeepSpeed when no GPU is found, unless the run uses DeepSpeed
    (``accelerate launch`` with a DeepSpeed config sets ``ACCELERATE_USE_DEEPSPEED``). A filter on the
    ``DeepSpeed`` logger, added before DeepSpeed creates it, outlives DeepSpeed's own set-up of it."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        return
    logger = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _DropDeepSpeedProbe) for f in logger.filters):
        logger.addFilter(_DropDeepSpeedProbe())


@contextmanager
def old_checkpointing_names_quietly(names=OLD_CHECKPOINTING_NAMES):
    """Drop transformers' FutureWarning for each of ``names`` (its deprecated gradient-checkpointing API) inside."""
    with warnings.catch_warnings():
        for name in names:
            warnings.filterwarnings("ignore", message=f"`{name}` is deprecated", category=FutureWarning)
        yield


@contextmanager
def grpo_quietly():
    """GRPO's upstream notices about our own choices, dropped inside: TRL's experimental-feature notice for
    ``environment_factory`` and the FutureWarnings of TRL's generation reading transformers' old names."""
    with old_checkpointing_names_quietly():
        warnings.filterwarnings("ignore", message=TRL_EXPERIMENTAL_ENVIRONMENT, category=UserWarning)
        yield
