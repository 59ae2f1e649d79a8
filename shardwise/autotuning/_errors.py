"""The tuner's error."""


class AutotuningError(RuntimeError):
    """The tuning run cannot go on or found nothing; the message says what each experiment
    failed with."""
