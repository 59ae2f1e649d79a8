"""``deepspeed.compression``: quantization-aware training and pruning (``compress``), the
schedule the engine advances (``scheduler``), ZeroQuant post-training quantization with
layer-by-layer distillation (:func:`zeroquant`), and ``helper`` (DeepSpeed-Chat imports its
``recursive_getattr`` / ``recursive_setattr``, which live in ``shardwise.utils._modules``)."""

from shardwise.compression._zeroquant import BlockError, layer_by_layer_distillation, zeroquant
from shardwise.compression.compress import convert_conv1d_to_linear, init_compression, redundancy_clean
from shardwise.compression.scheduler import compression_scheduler

__all__ = [
    "BlockError",
    "compression_scheduler",
    "convert_conv1d_to_linear",
    "init_compression",
    "layer_by_layer_distillation",
    "redundancy_clean",
    "zeroquant",
]
