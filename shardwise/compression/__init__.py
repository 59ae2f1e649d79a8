"""``deepspeed.compression``: quantization-aware training and pruning (``compress``), the
schedule the engine advances (``scheduler``), and ``helper`` (DeepSpeed-Chat imports its
``recursive_getattr`` / ``recursive_setattr``, which live in ``shardwise.utils._modules``)."""

from shardwise.compression.compress import convert_conv1d_to_linear, init_compression, redundancy_clean
from shardwise.compression.scheduler import compression_scheduler

__all__ = ["compression_scheduler", "convert_conv1d_to_linear", "init_compression", "redundancy_clean"]
