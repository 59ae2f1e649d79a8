"""``shardwise run``: start a training script on every rank of one or many machines."""

from shardwise.launcher.hostfile import HostfileError, parse_hostfile, parse_selection, select_resources
from shardwise.launcher.main import build_parser, main

__all__ = ["HostfileError", "build_parser", "main", "parse_hostfile", "parse_selection", "select_resources"]
