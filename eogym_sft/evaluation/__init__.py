"""Evaluation: teacher-forced ``validate`` and ``evaluate``, closed-loop ``rollout`` (on the agent runtime),
reports."""
