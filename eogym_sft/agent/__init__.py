"""The agent runtime: the slot decoder and its sampling, the closed-loop episode loop, policies behind
chat-completions servers, and cache sizing. Evaluation (``rollout``, ``evaluate``) and training (GRPO) both run on
it."""
