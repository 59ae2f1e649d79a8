"""Data routing: random layerwise token drop (random-LTD, arXiv 2211.11586).

In training, each chosen transformer layer runs on a random sorted subset of each sample's
tokens; the other tokens skip that layer unchanged. The kept length follows
``RandomLTDScheduler``. DeepSpeed's names: ``convert_to_random_ltd``,
``RandomLayerTokenDrop``, ``RandomLTDScheduler``, ``remove_random_ltd_state_dict``,
``save_without_random_ltd``; gather and scatter are plain PyTorch (CPU and GPU).
"""

from shardwise.runtime.data_pipeline.data_routing._config import (
    RandomLTDConfig,
    RandomLTDSchedule,
    parse_random_ltd,
)
from shardwise.runtime.data_pipeline.data_routing._random_ltd import RandomLTD, random_ltd_layers
from shardwise.runtime.data_pipeline.data_routing.basic_layer import RandomLayerTokenDrop
from shardwise.runtime.data_pipeline.data_routing.helper import (
    convert_to_random_ltd,
    remove_random_ltd_state_dict,
    save_without_random_ltd,
)
from shardwise.runtime.data_pipeline.data_routing.scheduler import RandomLTDScheduler

__all__ = [
    "RandomLTD",
    "RandomLTDConfig",
    "RandomLTDSchedule",
    "RandomLTDScheduler",
    "RandomLayerTokenDrop",
    "convert_to_random_ltd",
    "parse_random_ltd",
    "random_ltd_layers",
    "remove_random_ltd_state_dict",
    "save_without_random_ltd",
]
