"""The tool environment: one row's tools executed for a model, with backends under ``backends/``."""
