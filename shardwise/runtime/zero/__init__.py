"""DeepSpeed's ``deepspeed.runtime.zero`` names (the code is in ``shardwise.zero``)."""

from shardwise.runtime.zero import config, offload_config, partition_parameters
from shardwise.zero import GatheredParameters, Init, register_external_parameter

__all__ = [
    "GatheredParameters",
    "Init",
    "config",
    "offload_config",
    "partition_parameters",
    "register_external_parameter",
]
