"""Prometheus metrics for /metrics, in a CollectorRegistry of the app's own (no global state).

Two kinds: engine state (gauges and cumulative counters the engine already keeps) is read from the
AsyncEngine's latest EngineStats when scraped; latencies are observed as requests stream, by a
RequestTracker per HTTP request.
"""

import os
import time
from bisect import bisect_left

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from nanoserve.engine.async_engine import AsyncEngine
from nanoserve.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                  0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
# Inter-token latencies a RequestTracker may hold before adding them to the histogram (see there).
_FLUSH_EVERY = 64


class _EngineCollector:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def collect(self):
        s = self.engine.stats
        yield GaugeMetricFamily("nanoserve_num_requests_running", "Sequences running in the engine",
                                value=s.num_running)
        yield GaugeMetricFamily("nanoserve_num_requests_waiting", "Requests admitted but not yet running",
                                value=self.engine.num_waiting_in(s))
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
        # Several API server processes (--api-server-count): each writes its counts to files in this
        # directory, and a scrape of any one of them sums every process's files, plus the engine's stats.
        self.scraped = r
        if multiproc_dir := os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            self.scraped = CollectorRegistry()
            MultiProcessCollector(self.scraped, multiproc_dir)
            self.scraped.register(_EngineCollector(engine))
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

    @property
    def itl_bounds(self) -> list[float]:
        """The inter-token latency buckets' upper bounds, +Inf last: a value goes in the first bucket whose
        bound is >= it, as Histogram.observe puts it."""
        return self.itl._upper_bounds

    def add_itl(self, counts: list[int], total: float) -> None:
        """What counts[i] observe()s of values in bucket i, summing to total, would do. prometheus_client has
        no public way to add many observations at once; these two attributes are what observe() itself
        updates, with whichever value class (in-process or multiprocess) the library is set up for."""
        for bucket, count in zip(self.itl._buckets, counts, strict=True):
            if count:
                bucket.inc(count)
        self.itl._sum.inc(total)

    def render(self) -> bytes:
        return generate_latest(self.scraped)

    def tracker(self) -> "RequestTracker":
        return RequestTracker(self)


class RequestTracker:
    """Observes one HTTP request's engine outputs (cumulative) as they arrive.

    Inter-token latencies are counted into buckets of its own and added to the histogram in one go (every
    _FLUSH_EVERY tokens, when an output finishes, and at flush()), not observed one by one: a streamed
    token's observe() was a good part of its cost in the server. /metrics holds every latency of a request
    by the time its last chunk is sent; a scrape in the middle of a stream may lag it by a few tokens."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.m = metrics
        self.last: dict[tuple[str, int], list] = {}  # (request, sample) -> [time, tokens], updated in place
        self._bounds = metrics.itl_bounds
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._pending = 0

    def observe(self, out: RequestOutput) -> None:
        now = time.monotonic()
        last = self.last
        for c in out.outputs:
            num_tokens = len(c.token_ids)
            prev = last.get((out.request_id, c.index))
            if prev is None:
                if num_tokens:
                    last[out.request_id, c.index] = [now, num_tokens]
                continue
            new = num_tokens - prev[1]
            if new > 0:
                # Tokens that arrive together share the gap since the last ones: `new` equal latencies.
                gap = (now - prev[0]) / new
                self._counts[bisect_left(self._bounds, gap)] += new
                self._sum += gap * new
                self._pending += new
                prev[0], prev[1] = now, num_tokens
        if self._pending >= _FLUSH_EVERY:
            self.flush()
        if not out.finished:
            return
        self.flush()
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

    def flush(self) -> None:
        """Add the latencies counted so far to the histogram."""
        if not self._pending:
            return
        self.m.add_itl(self._counts, self._sum)
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._pending = 0
