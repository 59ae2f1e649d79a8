"""Activation checkpointing with DeepSpeed's API (``deepspeed.checkpointing``)."""

from shardwise.runtime.activation_checkpointing import checkpointing

__all__ = ["checkpointing"]
