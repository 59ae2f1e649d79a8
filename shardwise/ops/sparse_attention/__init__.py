"""DeepSpeed's ``deepspeed.ops.sparse_attention`` names: block-sparse attention layouts
(see [Note: sparsity layout] in ``sparsity_config.py``)."""

from shardwise.ops.sparse_attention.sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
    check_layout,
)

__all__ = [
    "BigBirdSparsityConfig",
    "BSLongformerSparsityConfig",
    "DenseSparsityConfig",
    "FixedSparsityConfig",
    "LocalSlidingWindowSparsityConfig",
    "SparsityConfig",
    "VariableSparsityConfig",
    "check_layout",
]
