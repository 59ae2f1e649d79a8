"""Tensor (Megatron-style) and sequence parallelism.

A tensor-parallel layer holds its rank's shard of the parameters as ordinary
``nn.Parameter`` objects and communicates over the tensor group it is given (``group=``:
a process group, a :class:`~shardwise.comm.Communicator`, a grid with ``tensor_comm`` or
an mpu). The pieces:

- ``mappings``: the differentiable collectives that move activations into and out of the
  tensor region (hidden features split) and the sequence region (sequence split);
- ``layers``: :class:`ColumnParallelLinear`, :class:`RowParallelLinear`,
  :class:`VocabParallelEmbedding`, :class:`SequenceParallelLayerNorm`, each buildable
  from the full PyTorch layer (``from_linear``, ``from_conv1d``, ``from_embedding``,
  ``from_layer_norm``);
- :func:`vocab_parallel_cross_entropy`: the loss over vocabulary-split logits;
- :func:`shard_info`: where a parameter's shard sits in the full one (for checkpoints).

Glossary: *tensor group* is the process group the layers split over; *tp_degree* its
size; a *sharded* parameter is one rank's chunk of a full parameter (marked
``tensor_model_parallel``); a *replicated* parameter is held whole by every tensor rank
(row-parallel bias, LayerNorm) and is not marked.
"""

from shardwise.tensor_parallel._comm import as_tensor_comm
from shardwise.tensor_parallel._partition import ShardInfo, shard_info
from shardwise.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from shardwise.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceParallelLayerNorm,
    VocabParallelEmbedding,
)
from shardwise.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    copy_to_tensor_region,
    gather_from_sequence_parallel_region,
    gather_from_sequence_region,
    gather_from_tensor_model_parallel_region,
    gather_from_tensor_region,
    reduce_from_tensor_model_parallel_region,
    reduce_from_tensor_region,
    reduce_scatter_to_sequence_parallel_region,
    reduce_scatter_to_sequence_region,
    scatter_to_sequence_parallel_region,
    scatter_to_sequence_region,
    scatter_to_tensor_model_parallel_region,
    scatter_to_tensor_region,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "SequenceParallelLayerNorm",
    "ShardInfo",
    "VocabParallelEmbedding",
    "as_tensor_comm",
    "copy_to_tensor_model_parallel_region",
    "copy_to_tensor_region",
    "gather_from_sequence_parallel_region",
    "gather_from_sequence_region",
    "gather_from_tensor_model_parallel_region",
    "gather_from_tensor_region",
    "reduce_from_tensor_model_parallel_region",
    "reduce_from_tensor_region",
    "reduce_scatter_to_sequence_parallel_region",
    "reduce_scatter_to_sequence_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_sequence_region",
    "scatter_to_tensor_model_parallel_region",
    "scatter_to_tensor_region",
    "shard_info",
    "vocab_parallel_cross_entropy",
]
