"""Start-up noise from other libraries that says nothing to a user of this one, silenced by name."""

from __future__ import annotations

import logging
import os

DEEPSPEED_PROBE = "Setting accelerator to CPU"


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
