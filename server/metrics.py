"""Server metrics through `prometheus_client`, under SGLang's names.

Every metric SGLang has an equivalent of carries SGLang's name (prefix `sglang:`), type, label
names and buckets (`sglang/srt/observability/metrics_collector.py`), so a dashboard built for
SGLang reads a radixlm server as it is; the rest are ours, prefixed `radixlm_`.

One `Metrics` object, with a `CollectorRegistry` of its own, per app (no module-global default
registry: two servers in one process must not mix their counts). The request metrics are updated
from the event loop; the engine's levels and totals are read at scrape time from the stats the
engine reports (`EngineCollector`), so nothing polls the engine between scrapes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from radixlm.protocol.histogram import Histogram as EngineHistogram
from radixlm.protocol.stats import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "radixlm_"

# SGLang's default buckets (TokenizerMetricsCollector)
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = (*TTFT_BUCKETS, 600, 1200, 1800, 2400)
ITL_BUCKETS = (
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080,
    0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000,
)  # fmt: skip
_STREAMING = ("true", "false")


class Metrics:
    """The metrics of one app. `model_name` labels SGLang's metrics, as SGLang labels them with
    its served model name."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        # the labels of SGLang's tokenizer-side metrics, and of its scheduler's (one rank here)
        self.labels = {"model_name": model_name, "engine_type": "unified"}
        self.engine_labels = {**self.labels, "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
        names = list(self.labels)
        r = self.registry
        self.prompt_tokens = Counter(
            "sglang:prompt_tokens_total",
            "Number of prefill tokens processed.",
            [*names, "is_streaming"],
            registry=r,
        )
        self.generation_tokens = Counter(
            "sglang:generation_tokens_total",
            "Number of generation tokens processed.",
            [*names, "is_streaming"],
            registry=r,
        )
        self.cached_tokens = Counter(
            "sglang:cached_tokens_total",
            "Number of cached prompt tokens by source (device/host/storage).",
            [*names, "cache_source"],
            registry=r,
        )
        self.num_requests = Counter(
            "sglang:num_requests_total",
            "Number of requests processed.",
            [*names, "is_streaming"],
            registry=r,
        )
        self.num_aborted = Counter(
            "sglang:num_aborted_requests_total", "Number of requests aborted.", names, registry=r
        )
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            [*names, "is_streaming"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            names,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "sglang:request_time_per_output_token_seconds",
            "Per-request TPOT in seconds: (finished_time - first_token_time) / "
            "(completion_tokens - 1).",
            [*names, "is_streaming"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            [*names, "is_streaming"],
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.http_requests = Counter(
            "sglang:http_requests_total",
            "Total number of HTTP requests by endpoint and method",
            ["endpoint", "method"],
            registry=r,
        )
        self.http_responses = Counter(
            "sglang:http_responses_total",
            "Total number of HTTP responses by endpoint and status code",
            ["endpoint", "status_code", "method"],
            registry=r,
        )
        self.http_active = Gauge(
            "sglang:http_requests_active",
            "Number of currently active HTTP requests",
            ["endpoint", "method"],
            registry=r,
        )
        # ours
        self.finished = Counter(
            PREFIX + "requests_total",
            "Generations finished, by finish reason.",
            ["finish_reason"],
            registry=r,
        )
        self.errors = Counter(
            PREFIX + "errors_total",
            "Error responses and failed generations, by kind.",
            ["kind"],
            registry=r,
        )
        self.queued = Gauge(
            PREFIX + "queued_requests",
            "Generations accepted and not finished (bounded by --max-queued-requests).",
            registry=r,
        )
        # every series that has a fixed label set answers from the first scrape, at 0
        for streaming in _STREAMING:
            for metric in (self.prompt_tokens, self.generation_tokens, self.num_requests):
                metric.labels(**self.labels, is_streaming=streaming)
            for metric in (self.ttft, self.tpot, self.e2e):
                metric.labels(**self.labels, is_streaming=streaming)
        self.cached_tokens.labels(**self.labels, cache_source="device")
        self.num_aborted.labels(**self.labels)
        self.itl.labels(**self.labels)
        self.engine = EngineCollector(self.engine_labels)
        r.register(self.engine)

    def timer(self, arrived: float, streaming: bool = False) -> GenerationTimer:
        """A timer for one generation of a request that arrived at `arrived` (time.perf_counter)."""
        return GenerationTimer(self, arrived, streaming)

    def count_error(self, kind: str) -> None:
        self.errors.labels(kind=kind).inc()

    def error_count(self, kind: str) -> float:
        """How many errors of `kind` were counted."""
        return self.registry.get_sample_value(PREFIX + "errors_total", {"kind": kind}) or 0.0

    def count_finished(self, reason: str) -> None:
        self.finished.labels(finish_reason=reason).inc()
        if reason == "abort":
            self.num_aborted.labels(**self.labels).inc()

    def render(self, engine_stats: EngineStats | None) -> bytes:
        """The metrics text; `engine_stats` None: the engine did not answer (its metrics left
        out, `radixlm_engine_responsive` 0)."""
        self.engine.stats = engine_stats
        try:
            return generate_latest(_WithoutCreated(self.registry))
        finally:
            self.engine.stats = None


class _WithoutCreated:
    """The registry's metrics less the `_created` timestamps prometheus_client adds to counters
    and histograms (a series per metric that no dashboard reads)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


class GenerationTimer:
    """Follows one generation's snapshots and records its latencies and token counts."""

    def __init__(self, metrics: Metrics, arrived: float, streaming: bool = False) -> None:
        self.metrics = metrics
        self.start = self.last = arrived
        self.first: float | None = None
        self.tokens = 0
        self.streaming = "true" if streaming else "false"

    def update(self, completion_tokens: int) -> None:
        new = completion_tokens - self.tokens
        if new <= 0:
            return
        now = time.perf_counter()
        m = self.metrics
        if self.tokens == 0:
            m.ttft.labels(**m.labels, is_streaming=self.streaming).observe(now - self.start)
            self.first = now
            new -= 1  # the first token's latency is the TTFT; the rest of this batch follow it
            gap = 0.0
        else:
            gap = (now - self.last) / new
        itl = m.itl.labels(**m.labels)
        for _ in range(new):
            itl.observe(gap)
        self.tokens = completion_tokens
        self.last = now

    def finish(self, meta_info: dict[str, Any]) -> None:
        completion = int(meta_info.get("completion_tokens", 0))
        self.update(completion)
        m = self.metrics
        now = time.perf_counter()
        streaming = {**m.labels, "is_streaming": self.streaming}
        m.e2e.labels(**streaming).observe(now - self.start)
        if self.first is not None and completion > 1:
            m.tpot.labels(**streaming).observe((now - self.first) / (completion - 1))
        m.prompt_tokens.labels(**streaming).inc(int(meta_info.get("prompt_tokens", 0)))
        m.generation_tokens.labels(**streaming).inc(completion)
        m.cached_tokens.labels(**m.labels, cache_source="device").inc(
            int(meta_info.get("cached_tokens", 0))
        )
        m.num_requests.labels(**streaming).inc()
        reason = meta_info.get("finish_reason") or {}
        kind = reason.get("type", "unknown") if isinstance(reason, dict) else str(reason)
        m.count_finished(kind)
        if meta_info.get("error"):
            m.count_error("engine_error")

    def abandon(self) -> None:
        """The client went away (or the server stopped) before the generation finished."""
        self.metrics.count_finished("abort")
        self.metrics.count_error("client_disconnected")

    def cancel(self) -> None:
        """Aborted because another generation of its request failed."""
        self.metrics.count_finished("abort")

    def refuse(self) -> float:
        """Refused before it ran (its grammar, in a list of prompts whose others run): counted as
        a refused single request is, the client's error, and finished as an abort with no
        latencies or tokens. The time from arrival to the refusal, in seconds."""
        self.metrics.count_finished("abort")
        self.metrics.count_error("invalid_request_error")
        return time.perf_counter() - self.start

    def fail(self) -> None:
        """The generation failed before it finished (the error itself is counted by its kind
        where the request is answered)."""
        self.metrics.count_finished("error")


# SGLang's scheduler gauges: its name -> (help, the value from our engine's stats)
def _sglang_engine_gauges(stats: EngineStats) -> dict[str, tuple[str, Any]]:
    capacity = stats.kv_pool_capacity_tokens
    free = stats.kv_pool_free_tokens
    evictable = stats.radix_cache_evictable_tokens
    used = max(0, capacity - free - evictable)  # as SGLang counts: cached, unlocked KV is free
    return {
        "num_running_reqs": ("The number of running requests.", stats.num_running_reqs),
        "num_queue_reqs": ("The number of requests in the waiting queue.", stats.num_waiting_reqs),
        "num_grammar_queue_reqs": (
            "The number of requests in the grammar waiting queue.",
            stats.num_grammar_queue_reqs,
        ),
        "cache_hit_rate": ("The prefix cache hit rate.", stats.cache_hit_rate),
        "token_usage": ("The token usage.", used / capacity if capacity else 0.0),
        "num_used_tokens": ("The number of used tokens.", used),
        "kv_available_tokens": ("Number of available KV tokens.", free),
        "kv_evictable_tokens": ("Number of evictable KV tokens.", evictable),
        "kv_used_tokens": ("Number of used KV tokens.", used),
    }


# the engine's running totals (since it started): its stats key -> (metric name, help)
_SGLANG_ENGINE_COUNTERS = {
    "num_preemptions": (
        "sglang:num_retracted_requests_total",
        "Total number of retracted requests (preempted for lack of KV slots).",
    ),
}
_ENGINE_COUNTERS = {
    "num_steps": ("engine_steps_total", "Forward steps run by the engine."),
    "graph_steps": ("engine_graph_steps_total", "Decode steps replayed from a CUDA graph."),
    "prefill_graph_steps": (
        "engine_prefill_graph_steps_total",
        "Other steps (prompt chunks, large decode batches) replayed from a prompt-step graph.",
    ),
    "overlapped_steps": (
        "engine_overlapped_steps_total",
        "Steps launched before the previous step's tokens reached the host.",
    ),
    "jump_forward_tokens": (
        "engine_jump_forward_tokens_total",
        "Tokens a grammar forced by jump-forward instead of sampling them.",
    ),
    "spec_verify_ct": ("engine_spec_verify_steps_total", "Speculative verify steps."),
    "spec_num_proposed_drafts": (
        "engine_spec_draft_tokens_total",
        "Draft tokens proposed for verification.",
    ),
    "spec_num_correct_drafts": (
        "engine_spec_accepted_draft_tokens_total",
        "Draft tokens the target model accepted.",
    ),
}
# stats shown as SGLang's metrics above, or counted by the server itself per request
_SHOWN = {
    "num_running_reqs",
    "num_waiting_reqs",
    "num_grammar_queue_reqs",
    "kv_pool_capacity_tokens",
    "kv_pool_free_tokens",
    "radix_cache_evictable_tokens",
    "cache_hit_rate",
    "radix_cache_tokens",
    "prompt_tokens",
    "cached_tokens",
    "generated_tokens",
    "grammar_compile_seconds",
    "spec_accept_length_histogram",
    *_SGLANG_ENGINE_COUNTERS,
    *_ENGINE_COUNTERS,
}


# engine statistics that are histogram snapshots (protocol/histogram.py): metric name and help
_ENGINE_HISTOGRAMS = {
    "grammar_compile_seconds": (
        "grammar_compile_seconds",
        "Time a constrained request waited for its grammar (a compile, or a cache hit).",
    ),
    "spec_accept_length_histogram": (
        "spec_accept_length",
        "Tokens each speculative verify step gave (accepted draft tokens and the target's own "
        "next token).",
    ),
}


class EngineCollector:
    """The engine's levels and totals, read from the stats of the scrape that is being answered
    (`stats`, set by `Metrics.render`; None: the engine did not answer)."""

    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels
        self.stats: EngineStats | None = None

    def describe(self) -> list[Metric]:
        return []  # (the metrics depend on the stats: nothing to check at registration)

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        responsive = GaugeMetricFamily(
            PREFIX + "engine_responsive",
            "1 if the engine answered this scrape's request for its statistics in time, else 0.",
            value=int(stats is not None),
        )
        yield responsive
        if stats is None:
            return
        names, values = list(self.labels), list(self.labels.values())
        for name, (help, value) in _sglang_engine_gauges(stats).items():
            if _is_number(value):
                gauge = GaugeMetricFamily("sglang:" + name, help, labels=names)
                gauge.add_metric(values, float(value))
                yield gauge
        for key, (name, help) in _SGLANG_ENGINE_COUNTERS.items():
            if _is_number(value := getattr(stats, key)):
                counter = CounterMetricFamily(name, help, labels=names)
                counter.add_metric(values, float(value))
                yield counter
        capacity, free = stats.kv_pool_capacity_tokens, stats.kv_pool_free_tokens
        yield from _gauge("kv_pool_capacity_tokens", "KV-pool slots in all.", capacity)
        yield from _gauge(
            "kv_cache_usage_ratio",
            "Share of KV-pool slots in use (by requests or the prefix cache).",
            (capacity - free) / capacity if capacity else 0.0,
        )
        yield from _gauge(
            "radix_cache_tokens", "Tokens held by the radix cache.", stats.radix_cache_tokens
        )
        for key, (name, help) in _ENGINE_COUNTERS.items():
            if _is_number(value := getattr(stats, key)):  # (None: speculation is off)
                yield CounterMetricFamily(PREFIX + name, help, value=float(value))
        for key, (name, help) in _ENGINE_HISTOGRAMS.items():
            snapshot = getattr(stats, key)
            if isinstance(snapshot, dict):  # (None: not kept; malformed: left out)
                with contextlib.suppress(ValueError, TypeError, KeyError):
                    yield _histogram(name, help, EngineHistogram.from_snapshot(snapshot))
        # any other number the engine reports, as a gauge (a running total belongs above)
        for key, value in sorted(stats.as_dict().items()):
            if key not in _SHOWN and _is_number(value):
                yield from _gauge("engine_" + _metric_name(key), f"Engine statistic {key}.", value)


def _gauge(name: str, help: str, value: Any) -> Iterator[Metric]:
    if _is_number(value):
        yield GaugeMetricFamily(PREFIX + name, help, value=float(value))


def _histogram(name: str, help: str, hist: EngineHistogram) -> Metric:
    data = hist.snapshot()
    bounds = [*data["buckets"], float("inf")]
    if len(data["counts"]) != len(bounds):
        raise ValueError("a histogram snapshot needs a count per bucket and one above them")
    buckets, cumulative = [], 0
    for bound, n in zip(bounds, data["counts"]):
        cumulative += n
        buckets.append(("+Inf" if bound == float("inf") else _bound(bound), cumulative))
    return HistogramMetricFamily(PREFIX + name, help, buckets=buckets, sum_value=data["sum"])


def _bound(value: float) -> str:
    return repr(float(value))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _metric_name(key: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in key)
