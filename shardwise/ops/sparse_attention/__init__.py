"""DeepSpeed's ``deepspeed.ops.sparse_attention`` names: block-sparse attention layouts
(see [Note: sparsity layout] in ``sparsity_config.py``) and the attention over them
(``SparseSelfAttention``, on ``block_sparse_attention`` in ``_block_sparse.py``), the BERT
module and helpers that switch a Hugging Face BERT or RoBERTa model to it
(``BertSparseSelfAttention``, ``SparseAttentionUtils``), and the config section's builder
(``sparsity_config_from_dict``)."""

from shardwise.ops.sparse_attention._block_sparse import block_sparse_attention
from shardwise.ops.sparse_attention._from_config import sparsity_config_from_dict
from shardwise.ops.sparse_attention.bert_sparse_self_attention import BertSparseSelfAttention
from shardwise.ops.sparse_attention.sparse_attention_utils import SparseAttentionUtils
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
    "BertSparseSelfAttention",
    "BigBirdSparsityConfig",
    "BSLongformerSparsityConfig",
    "DenseSparsityConfig",
    "FixedSparsityConfig",
    "LocalSlidingWindowSparsityConfig",
    "SparseAttentionUtils",
    "SparseSelfAttention",
    "SparsityConfig",
    "VariableSparsityConfig",
    "block_sparse_attention",
    "check_layout",
    "sparsity_config_from_dict",
]
