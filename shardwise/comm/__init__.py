"""Process-group start-up and collectives; the only code that calls torch.distributed.

The library's code uses :class:`Communicator`. DeepSpeed scripts use the functional API
(``import deepspeed.comm as dist``; ``dist.all_reduce(t)``), re-exported here from
``_functional``. Both report to the comms logger (``configure``, ``log_summary``,
``comms_logger_from_config``; see [Note: the comms logger] in ``_logger.py``).
"""

from shardwise.comm import _functional
from shardwise.comm._collectives import CollectiveError, CollectiveRecord, Communicator, Handle
from shardwise.comm._compressed import CompressedAllReduce
from shardwise.comm._functional import *  # noqa: F403 -- DeepSpeed's flat comm namespace
from shardwise.comm._init import LaunchEnv, discover_launch_env, init_distributed
from shardwise.comm._logger import CommsLogger, CommsLoggerConfig, comms_logger, comms_logger_from_config

__all__ = [
    "CollectiveError",
    "CollectiveRecord",
    "CommsLogger",
    "CommsLoggerConfig",
    "Communicator",
    "CompressedAllReduce",
    "Handle",
    "LaunchEnv",
    "comms_logger",
    "comms_logger_from_config",
    "discover_launch_env",
    "init_distributed",
    *_functional.__all__,
]
