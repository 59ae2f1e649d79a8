"""The ``shardwise`` logger prints INFO lines (progress, warnings) unless the user configured it."""

import logging
import sys


def install_default_handler() -> None:
    """Give the ``shardwise`` logger a stderr handler at INFO if it has none."""
    log = logging.getLogger("shardwise")
    if log.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[shardwise %(asctime)s] %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
