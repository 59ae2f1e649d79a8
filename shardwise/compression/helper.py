"""``deepspeed.compression.helper``: the module-tree helpers DeepSpeed-Chat's LoRA code
imports (they live in ``shardwise.utils._modules``) and ``convert_conv1d_to_linear``."""

from shardwise.compression.compress import convert_conv1d_to_linear
from shardwise.utils._modules import recursive_getattr, recursive_setattr

__all__ = ["convert_conv1d_to_linear", "recursive_getattr", "recursive_setattr"]
