"""The pipeline package's error type (its own module, so the partitioning functions and
``module.py`` can both raise it without importing each other)."""


class PipelineError(Exception):
    """A pipeline model or schedule is set up wrongly."""
