"""Prometheus metrics of an engine (``GET /metrics``): its :class:`EngineMetrics` read at each
scrape, under the names ``shardwise:<field>``, in a registry private to one app."""

from __future__ import annotations

import bisect
import threading

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
"""Upper bounds (seconds) of the time-to-first-token histogram (vLLM's)."""


class EngineCollector:
    """Reads ``engine.metrics()`` at each scrape. The engine lists every time to first token;
    the histogram folds in the ones not seen yet, so a scrape costs the new requests only."""

    def __init__(self, engine):
        self.engine = engine
        self._lock = threading.Lock()
        self._seen = 0
        self._counts = [0] * (len(TTFT_BUCKETS) + 1)
        self._sum = 0.0

    def collect(self):
        m = self.engine.metrics()
        yield GaugeMetricFamily(
            "shardwise:num_requests_running", "Requests in the running batch.", m.num_requests_running
        )
        yield GaugeMetricFamily("shardwise:num_requests_waiting", "Requests waiting to run.", m.num_requests_waiting)
        yield GaugeMetricFamily(
            "shardwise:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", m.kv_cache_usage_perc
        )
        yield CounterMetricFamily("shardwise:prompt_tokens", "Prompt tokens processed.", m.prompt_tokens_total)
        yield CounterMetricFamily("shardwise:generation_tokens", "Tokens generated.", m.generation_tokens_total)
        yield self._histogram(m.time_to_first_token_seconds)

    def _histogram(self, ttfts: list[float]) -> HistogramMetricFamily:
        with self._lock:
            for value in ttfts[self._seen :]:
                self._counts[bisect.bisect_left(TTFT_BUCKETS, value)] += 1
                self._sum += value
            self._seen = max(self._seen, len(ttfts))
            cumulative, buckets = 0, []
            for bound, count in zip((*map(str, TTFT_BUCKETS), "+Inf"), self._counts):
                cumulative += count
                buckets.append((bound, cumulative))
            total = self._sum
        family = HistogramMetricFamily("shardwise:time_to_first_token_seconds", "Time to first token (seconds).")
        family.add_metric([], buckets, total)
        return family


def engine_registry(engine) -> CollectorRegistry:
    """A private registry holding the engine's metrics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine))
    return registry
