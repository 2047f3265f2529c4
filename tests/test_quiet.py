"""eogym_sft.quiet: DeepSpeed's accelerator probe is dropped by its message, nothing else DeepSpeed logs."""

from __future__ import annotations

import logging

from eogym_sft.quiet import DEEPSPEED_PROBE, quiet_deepspeed_probe


class Recorder(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_the_probe_is_dropped_and_other_deepspeed_warnings_kept(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    quiet_deepspeed_probe()
    quiet_deepspeed_probe()  # idempotent: one filter
    from deepspeed.accelerator import real_accelerator
    from deepspeed.utils import logger

    assert logger.name == "DeepSpeed" and real_accelerator.accel_logger is logger  # the logger the probe warns on
    recorder = Recorder()
    logger.addHandler(recorder)
    try:
        logger.warning(DEEPSPEED_PROBE + ". If you have GPU or other accelerator, we were unable to detect it.")
        logger.warning("a real DeepSpeed warning")
    finally:
        logger.removeHandler(recorder)
    assert recorder.messages == ["a real DeepSpeed warning"]
    assert len([f for f in logging.getLogger("DeepSpeed").filters if type(f).__name__ == "_DropDeepSpeedProbe"]) == 1


def test_a_deepspeed_run_keeps_the_probe(monkeypatch):
    """Under ``accelerate launch`` with a DeepSpeed config the probe's message is about the run: it stays."""
    logger = logging.getLogger("DeepSpeed")
    monkeypatch.setattr(logger, "filters", [])
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    quiet_deepspeed_probe()
    assert logger.filters == []


def test_grpo_quietly_drops_the_named_notices_and_keeps_the_rest():
    import warnings

    from eogym_sft.quiet import (
        OLD_CHECKPOINTING_NAMES,
        TRL_EXPERIMENTAL_ENVIRONMENT,
        grpo_quietly,
    )

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with grpo_quietly():
            for name in OLD_CHECKPOINTING_NAMES:
                warnings.warn(f"`{name}` is deprecated and will be removed in v6.", FutureWarning)
            warnings.warn(TRL_EXPERIMENTAL_ENVIRONMENT + ". This API may change.", UserWarning)
            warnings.warn("`something_else` is deprecated", FutureWarning)
            warnings.warn("a user warning of another kind", UserWarning)
        warnings.warn("`is_gradient_checkpointing` is deprecated", FutureWarning)  # outside: kept
    assert [str(w.message) for w in caught] == [
        "`something_else` is deprecated", "a user warning of another kind", "`is_gradient_checkpointing` is deprecated"]
