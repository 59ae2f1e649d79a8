"""Serving: an engine that batches requests as they come and go, behind an OpenAI-compatible
HTTP server (see [Note: the serving engine interface] in ``_api.py``)."""

from shardwise.serve._api import EngineMetrics, QueueFull, RequestStream, SamplingParams, SequentialEngine, TokenEvent

__all__ = ["EngineMetrics", "QueueFull", "RequestStream", "SamplingParams", "SequentialEngine", "TokenEvent"]
