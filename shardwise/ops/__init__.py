"""DeepSpeed's ``deepspeed.ops`` names, so scripts that build these optimizers (and
sparse-attention layouts, and the fused BERT layer) directly run unchanged
(``import shardwise as deepspeed``)."""

from shardwise.ops import adagrad, adam, lion, sparse_attention, transformer

__all__ = ["adagrad", "adam", "lion", "sparse_attention", "transformer"]
