"""DeepSpeed's ``deepspeed.ops.sparse_attention`` names: block-sparse attention layouts
(see [Note: sparsity layout] in ``sparsity_config.py``) and the attention over them
(``SparseSelfAttention``, on ``block_sparse_attention`` in ``_block_sparse.py``)."""

from shardwise.ops.sparse_attention._block_sparse import block_sparse_attention
from shardwise.ops.sparse_attention.sparse_self_attention import SparseSelfAttention

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
    "SparseSelfAttention",
    "SparsityConfig",
    "VariableSparsityConfig",
    "block_sparse_attention",
    "check_layout",
]
