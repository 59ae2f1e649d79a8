"""``deepspeed.ops.transformer``: DeepSpeed's fused BERT layer, in plain PyTorch
(``_bert_layer.py``)."""

from shardwise.ops.transformer import transformer
from shardwise.ops.transformer._bert_layer import DeepSpeedTransformerConfig, DeepSpeedTransformerLayer

__all__ = ["DeepSpeedTransformerConfig", "DeepSpeedTransformerLayer", "transformer"]
