"""Prometheus metrics for /metrics, in a CollectorRegistry of the app's own (no global state).

Two kinds: engine state (gauges and cumulative counters the engine already keeps) is read from the
AsyncEngine's latest EngineStats when scraped; latencies are observed as requests stream, by a
RequestTracker per HTTP request.
"""

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from nanoserve.engine.async_engine import AsyncEngine
from nanoserve.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                  0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)


class _EngineCollector:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def collect(self):
        s = self.engine.stats
        yield GaugeMetricFamily("nanoserve_num_requests_running", "Sequences running in the engine",
                                value=s.num_running)
        yield GaugeMetricFamily("nanoserve_num_requests_waiting", "Requests admitted but not yet running",
                                value=self.engine.num_waiting)
        yield GaugeMetricFamily("nanoserve_kv_cache_usage_perc", "Fraction of KV blocks in use (0..1)",
                                value=s.kv_usage)
        yield CounterMetricFamily("nanoserve_prefix_cache_queries", "Prompt tokens looked up in the "
                                  "prefix cache", value=s.prefix_queries)
        yield CounterMetricFamily("nanoserve_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                  value=s.prefix_hits)
        yield CounterMetricFamily("nanoserve_prompt_tokens", "Prompt tokens scheduled", value=s.prompt_tokens)
        yield CounterMetricFamily("nanoserve_generation_tokens", "Tokens generated",
                                  value=s.generation_tokens)


class ServerMetrics:
    def __init__(self, engine: AsyncEngine) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        r = self.registry
        self.ttft = Histogram("nanoserve_time_to_first_token_seconds", "Arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("nanoserve_inter_token_latency_seconds", "Time between tokens of a sequence",
                             buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("nanoserve_e2e_request_latency_seconds", "Arrival to finish",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("nanoserve_request_queue_time_seconds", "Arrival to first scheduled",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.finished = Counter("nanoserve_request_success", "Finished sequences by finish_reason",
                                ["finish_reason"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self) -> "RequestTracker":
        return RequestTracker(self)


class RequestTracker:
    """Observes one HTTP request's engine outputs (cumulative) as they arrive."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.m = metrics
        self.last: dict[tuple[str, int], tuple[float, int]] = {}  # (request, sample) -> (time, tokens)

    def observe(self, out: RequestOutput) -> None:
        now = time.monotonic()
        for c in out.outputs:
            key = (out.request_id, c.index)
            prev_time, prev_tokens = self.last.get(key, (None, 0))
            new = len(c.token_ids) - prev_tokens
            if new > 0:
                if prev_time is not None:
                    # Tokens that arrive together share the gap since the last ones.
                    for _ in range(new):
                        self.m.itl.observe((now - prev_time) / new)
                self.last[key] = (now, len(c.token_ids))
        if not out.finished:
            return
        for c in out.outputs:
            self.m.finished.labels(finish_reason=c.finish_reason or "abort").inc()
        metrics = out.metrics
        if metrics is None:
            return
        end = metrics.finished_time or now
        self.m.e2e.observe(end - metrics.arrival_time)
        if metrics.first_token_time is not None:
            self.m.ttft.observe(metrics.first_token_time - metrics.arrival_time)
        if metrics.first_scheduled_time is not None:
            self.m.queue_time.observe(metrics.first_scheduled_time - metrics.arrival_time)
