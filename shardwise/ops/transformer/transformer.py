"""``deepspeed.ops.transformer.transformer``: see ``shardwise.ops.transformer._bert_layer``."""

from shardwise.ops.transformer._bert_layer import DeepSpeedTransformerConfig, DeepSpeedTransformerLayer

__all__ = ["DeepSpeedTransformerConfig", "DeepSpeedTransformerLayer"]
