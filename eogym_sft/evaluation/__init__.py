"""Evaluation: teacher-forced ``validate`` and ``evaluate``, closed-loop episodes and ``rollout``, reports."""
