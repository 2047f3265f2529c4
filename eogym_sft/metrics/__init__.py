"""Metrics: token accuracy, answer and action scoring, judges. Pure functions, no model."""
