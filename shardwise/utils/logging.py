"""``deepspeed.utils.logging``: see ``shardwise.utils._logging``."""

from shardwise.utils._logging import log_dist, log_dist_once, logger, print_dist, set_log_level_from_string

__all__ = ["log_dist", "log_dist_once", "logger", "print_dist", "set_log_level_from_string"]
