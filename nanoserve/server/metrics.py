"""Prometheus metrics for /metrics, in a CollectorRegistry of the app's own (no global state).

Two kinds: engine state (gauges and cumulative counters the engine already keeps) is read from the
AsyncEngine's latest EngineStats when scraped; latencies are observed as requests stream, by a
RequestTracker per HTTP request.

Each metric is exported under nanoserve's own name and, for dashboards built for vLLM, under vLLM's
(`vllm:...`, labelled with model_name, the first served name), with vLLM's types and, for the request token
histograms and iteration_tokens_total, its buckets. With --data-parallel-size N the nanoserve_ engine metrics are
the replicas' sums, and the vllm: engine metrics come once per replica, labelled engine="0" .. "N-1" as vLLM's
are; the request latency histograms, observed in the API server, count every replica's requests together.
"""

import os
import time
from bisect import bisect_left

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.utils import floatToGoString

from nanoserve.outputs import RequestOutput
from nanoserve.runtime.async_engine import AsyncEngine
from nanoserve.runtime.engine_core import ITERATION_TOKEN_BUCKETS, EngineStats
from nanoserve.sampling_params import SamplingParams
from nanoserve.spec_decode.stats import SpecDecodeStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                  0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
# Inter-token latencies a RequestTracker may hold before adding them to the histogram (see there).
_FLUSH_EVERY = 64
_FINISH_REASONS = ("stop", "length", "abort", "error")


def _1_2_5_buckets(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to limit: vLLM's buckets for a request's token counts."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class _EngineCollector:
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model = [model_name]  # the vllm: metrics' one label value

    def collect(self):
        s = self.engine.stats
        waiting = self.engine.num_waiting_in(s)
        yield GaugeMetricFamily("nanoserve_num_requests_running", "Sequences running in the engine",
                                value=s.num_running)
        yield GaugeMetricFamily("nanoserve_num_requests_waiting", "Requests admitted but not yet running",
                                value=waiting)
        yield GaugeMetricFamily("nanoserve_kv_cache_usage_perc", "Fraction of KV blocks in use (0..1)",
                                value=s.kv_usage)
        yield CounterMetricFamily("nanoserve_prefix_cache_queries", "Prompt tokens looked up in the "
                                  "prefix cache", value=s.prefix_queries)
        yield CounterMetricFamily("nanoserve_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                  value=s.prefix_hits)
        yield CounterMetricFamily("nanoserve_prompt_tokens", "Prompt tokens scheduled", value=s.prompt_tokens)
        yield CounterMetricFamily("nanoserve_generation_tokens", "Tokens generated",
                                  value=s.generation_tokens)
        yield CounterMetricFamily("nanoserve_num_preemptions", "Sequences preempted (to be recomputed)",
                                  value=s.num_preemptions)
        yield GaugeMetricFamily("nanoserve_cpu_kv_cache_usage_perc", "Fraction of the CPU tier's KV blocks holding "
                                "evicted prefix blocks (0..1; 0 without --kv-offload-gb)",
                                value=s.num_cpu_blocks_used / s.num_cpu_blocks if s.num_cpu_blocks else 0.0)
        yield CounterMetricFamily("nanoserve_cpu_prefix_cache_hits", "Prompt tokens found in the CPU tier (part of "
                                  "nanoserve_prefix_cache_hits)", value=s.cpu_prefix_hits)
        yield from self._vllm(s, waiting)

    def _vllm(self, s: EngineStats, waiting: int):
        """vLLM's engine metrics, one series per engine (label `engine`, "0" .. as vLLM numbers its data-parallel
        engines); the nanoserve_ names above give their sums."""
        replicas = self.engine.replica_stats
        for kind, name, doc, value in (
                (GaugeMetricFamily, "num_requests_running", "Sequences running in the engine",
                 lambda r: r.num_running),
                (GaugeMetricFamily, "num_requests_waiting", "Requests waiting to be processed",
                 # One engine: counting what is on its way to it, as nanoserve_num_requests_waiting does.
                 lambda r: waiting if len(replicas) == 1 else r.num_waiting),
                (GaugeMetricFamily, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage",
                 lambda r: r.kv_usage),
                (CounterMetricFamily, "prefix_cache_queries", "Prefix cache queries, in tokens",
                 lambda r: r.prefix_queries),
                (CounterMetricFamily, "prefix_cache_hits", "Prefix cache hits, in tokens", lambda r: r.prefix_hits),
                (CounterMetricFamily, "prompt_tokens", "Number of prefill tokens processed",
                 lambda r: r.prompt_tokens),
                (CounterMetricFamily, "generation_tokens", "Number of generation tokens processed",
                 lambda r: r.generation_tokens),
                (CounterMetricFamily, "num_preemptions", "Cumulative number of preemption from the engine",
                 lambda r: r.num_preemptions)):
            family = kind("vllm:" + name, doc, labels=["model_name", "engine"])
            for index, replica in enumerate(replicas):
                family.add_metric([*self.model, str(index)], value(replica))
            yield family
        yield self._iteration_tokens(replicas)
        yield self._cache_config(replicas)
        # Summed over the replicas (merge_stats), under the model_name label only.
        if s.spec_decode is not None:
            yield from self._spec_decode(s.spec_decode)

    def _spec_decode(self, spec: SpecDecodeStats):
        """vLLM's speculative decoding counters (only when it is on, as there)."""
        for name, doc, value in (
                ("spec_decode_num_drafts", "Number of spec decoding drafts.", spec.num_drafts),
                ("spec_decode_num_draft_tokens", "Number of draft tokens.", spec.num_draft_tokens),
                ("spec_decode_num_accepted_tokens", "Number of accepted tokens.", spec.num_accepted_tokens)):
            family = CounterMetricFamily("vllm:" + name, doc, labels=["model_name"])
            family.add_metric(self.model, value)
            yield family
        family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted tokens per draft position.", labels=["model_name", "position"])
        for position, value in enumerate(spec.accepted_per_pos):
            family.add_metric([*self.model, str(position)], value)
        yield family

    def _iteration_tokens(self, replicas: list[EngineStats]) -> HistogramMetricFamily:
        family = HistogramMetricFamily("vllm:iteration_tokens_total", "Histogram of number of tokens per "
                                       "engine_step", labels=["model_name", "engine"])
        for index, s in enumerate(replicas):
            counts = s.iteration_tokens or (0,) * (len(ITERATION_TOKEN_BUCKETS) + 1)
            cumulative, buckets = 0, []
            for bound, count in zip([*map(floatToGoString, ITERATION_TOKEN_BUCKETS), "+Inf"], counts, strict=True):
                cumulative += count
                buckets.append((bound, cumulative))
            family.add_metric([*self.model, str(index)], buckets, sum_value=s.iteration_tokens_sum)
        return family

    def _cache_config(self, replicas: list[EngineStats]) -> GaugeMetricFamily:
        config = self.engine.engine.config
        labels = {"block_size": config.args.block_size, "num_gpu_blocks": None,
                  "enable_prefix_caching": config.args.enable_prefix_caching,
                  "gpu_memory_utilization": config.args.gpu_memory_utilization,
                  "cache_dtype": str(config.kv_dtype).removeprefix("torch."),  # kv_cache_dtype, resolved
                  # What the weights run in, beside the KV cache's dtype.
                  "quantization": config.quantization.describe() if config.quantization else "none"}
        family = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                   labels=[*labels, "engine"])
        for index, s in enumerate(replicas):
            values = {**labels, "num_gpu_blocks": s.num_blocks, "engine": index}
            family.add_metric([str(value) for value in values.values()], 1)
        return family


class ServerMetrics:
    def __init__(self, engine: AsyncEngine, model_name: str = "", max_model_len: int = 1 << 20) -> None:
        """model_name labels the vllm: metrics; max_model_len bounds the buckets of their token histograms."""
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        r = self.registry
        # Several API server processes (--api-server-count): each writes its counts to files in this
        # directory, and a scrape of any one of them sums every process's files, plus the engine's stats.
        self.scraped = r
        if multiproc_dir := os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            self.scraped = CollectorRegistry()
            MultiProcessCollector(self.scraped, multiproc_dir)
            self.scraped.register(_EngineCollector(engine, model_name))
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
        self.vllm = VllmRequestMetrics(r, model_name, max_model_len)

    def count_finished(self, finish_reason: str, count: int = 1) -> None:
        self.finished.labels(finish_reason=finish_reason).inc(count)
        self.vllm.finished(finish_reason).inc(count)

    @property
    def itl_bounds(self) -> list[float]:
        """The inter-token latency buckets' upper bounds, +Inf last: a value goes in the first bucket whose
        bound is >= it, as Histogram.observe puts it."""
        return self.itl._upper_bounds

    def add_itl(self, counts: list[int], total: float) -> None:
        """What counts[i] observe()s of values in bucket i, summing to total, would do. prometheus_client has
        no public way to add many observations at once; these two attributes are what observe() itself
        updates, with whichever value class (in-process or multiprocess) the library is set up for."""
        for histogram in (self.itl, self.vllm.itl):
            for bucket, count in zip(histogram._buckets, counts, strict=True):
                if count:
                    bucket.inc(count)
            histogram._sum.inc(total)

    def render(self) -> bytes:
        return generate_latest(self.scraped)

    def tracker(self, params: SamplingParams | None = None) -> "RequestTracker":
        return RequestTracker(self, params)


class VllmRequestMetrics:
    """The per-request metrics under vLLM's names: one child per metric for the one model_name label value
    (finished requests one per finish reason), made once so that observing one costs no labels() lookup."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram("vllm:" + name, doc, ["model_name"], buckets=buckets, registry=registry
                             ).labels(model_name)

        tokens = _1_2_5_buckets(max_model_len)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token in seconds", _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Inter-token latency in seconds", _TOKEN_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency in seconds",
                             _LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Time spent in WAITING phase for request",
                               _LATENCY_BUCKETS)
        self.inference = histogram("request_inference_time_seconds", "Time spent in RUNNING phase for request",
                                   _LATENCY_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "Time spent in PREFILL phase for request",
                                 _LATENCY_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "Time spent in DECODE phase for request",
                                _LATENCY_BUCKETS)
        self.prompt_tokens = histogram("request_prompt_tokens", "Number of prefill tokens processed", tokens)
        self.generation_tokens = histogram("request_generation_tokens", "Number of generation tokens processed",
                                           tokens)
        self.params_n = histogram("request_params_n", "Histogram of the n request parameter", (1, 2, 5, 10, 20))
        self.params_max_tokens = histogram("request_params_max_tokens",
                                           "Histogram of the max_tokens request parameter", tokens)
        success = Counter("vllm:request_success", "Count of successfully processed requests",
                          ["model_name", "finished_reason"], registry=registry)
        self._success = {reason: success.labels(model_name, reason) for reason in _FINISH_REASONS}
        self._success_counter, self._model_name = success, model_name

    def finished(self, finish_reason: str) -> Counter:
        child = self._success.get(finish_reason)
        if child is None:
            child = self._success[finish_reason] = self._success_counter.labels(self._model_name, finish_reason)
        return child


class RequestTracker:
    """Observes one HTTP request's engine outputs (cumulative) as they arrive.

    Inter-token latencies are counted into buckets of its own and added to the histogram in one go (every
    _FLUSH_EVERY tokens, when an output finishes, and at flush()), not observed one by one: a streamed
    token's observe() was a good part of its cost in the server. /metrics holds every latency of a request
    by the time its last chunk is sent; a scrape in the middle of a stream may lag it by a few tokens."""

    def __init__(self, metrics: ServerMetrics, params: SamplingParams | None = None) -> None:
        self.m = metrics
        self.params = params
        self.last: dict[tuple[str, int], list] = {}  # (request, sample) -> [time, tokens], updated in place
        self.finish_reasons: list[str] = []  # of the samples finished so far
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
            self.finish_reasons.append(c.finish_reason or "abort")
            self.m.count_finished(self.finish_reasons[-1])
        self._observe_request(out, now)

    def _observe_request(self, out: RequestOutput, now: float) -> None:
        """A finished request's (one prompt's, all its samples') sizes and times."""
        vllm = self.m.vllm
        vllm.prompt_tokens.observe(len(out.prompt_token_ids))
        vllm.generation_tokens.observe(sum(len(c.token_ids) for c in out.outputs))
        if self.params is not None:
            vllm.params_n.observe(self.params.n)
            if self.params.max_tokens is not None:
                vllm.params_max_tokens.observe(self.params.max_tokens)
        metrics = out.metrics
        if metrics is None:
            return
        end = metrics.finished_time or now
        for histogram in (self.m.e2e, vllm.e2e):
            histogram.observe(end - metrics.arrival_time)
        if metrics.first_token_time is not None:
            for histogram in (self.m.ttft, vllm.ttft):
                histogram.observe(metrics.first_token_time - metrics.arrival_time)
            vllm.decode.observe(end - metrics.first_token_time)
        scheduled = metrics.first_scheduled_time
        if scheduled is not None:
            for histogram in (self.m.queue_time, vllm.queue):
                histogram.observe(scheduled - metrics.arrival_time)
            vllm.inference.observe(end - scheduled)
            if metrics.first_token_time is not None:
                vllm.prefill.observe(metrics.first_token_time - scheduled)

    @property
    def generated_tokens(self) -> int:
        """Tokens generated so far, over every sample seen."""
        return sum(tokens for _, tokens in self.last.values())

    def flush(self) -> None:
        """Add the latencies counted so far to the histogram."""
        if not self._pending:
            return
        self.m.add_itl(self._counts, self._sum)
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._pending = 0
