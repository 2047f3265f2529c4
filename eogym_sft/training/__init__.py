"""Training: the micro-batch sampler, the SFT trainer and run, resume and run records, GRPO and its reward."""
