"""Process-group start-up and collectives; the only code that calls torch.distributed."""

from shardwise.comm._collectives import CollectiveError, CollectiveRecord, Communicator, Handle
from shardwise.comm._init import LaunchEnv, discover_launch_env, init_distributed

__all__ = ["CollectiveError", "CollectiveRecord", "Communicator", "Handle", "LaunchEnv",
           "discover_launch_env", "init_distributed"]
