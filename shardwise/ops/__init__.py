"""DeepSpeed's ``deepspeed.ops`` names, so scripts that build these optimizers (and
sparse-attention layouts) directly run unchanged (``import shardwise as deepspeed``)."""

from shardwise.ops import adagrad, adam, lion, sparse_attention

__all__ = ["adagrad", "adam", "lion", "sparse_attention"]
