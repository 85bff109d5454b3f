"""Server metrics in the Prometheus text format (version 0.0.4), written by hand.

One `Metrics` object per app (no module globals: two servers in one process must not mix their
counts). Updated from the event loop only.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import defaultdict
from typing import Any

from radixlm.runtime.histogram import Histogram

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
PREFIX = "radixlm_"


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cached_tokens = 0
        self.finished: dict[str, int] = defaultdict(int)  # by finish reason
        self.errors: dict[str, int] = defaultdict(int)  # by kind
        self.http_requests: dict[str, int] = defaultdict(int)  # by status class
        self.in_flight = 0

    def timer(self, arrived: float) -> GenerationTimer:
        """A timer for one generation of a request that arrived at `arrived` (time.perf_counter)."""
        return GenerationTimer(self, arrived)

    def count_error(self, kind: str) -> None:
        self.errors[kind] += 1

    def render(self, engine_stats: dict[str, Any] | None) -> str:
        """The metrics text; `engine_stats` None: the engine did not answer (its gauges left out)."""
        out: list[str] = []
        _histogram(
            out,
            "time_to_first_token_seconds",
            "Time from a request's arrival to its first output token.",
            self.ttft,
        )
        _histogram(
            out,
            "inter_token_latency_seconds",
            "Time between two consecutive output tokens of a request.",
            self.itl,
        )
        _histogram(
            out,
            "e2e_request_latency_seconds",
            "Time from a request's arrival to its generation's last token.",
            self.e2e,
        )
        _counter(out, "prompt_tokens_total", "Prompt tokens processed.", self.prompt_tokens)
        _counter(out, "generation_tokens_total", "Tokens generated.", self.generation_tokens)
        _counter(
            out,
            "cached_tokens_total",
            "Prompt tokens served from the prefix cache.",
            self.cached_tokens,
        )
        _labelled(
            out,
            "requests_total",
            "counter",
            "Generations finished, by finish reason.",
            "finish_reason",
            self.finished,
        )
        _labelled(
            out,
            "errors_total",
            "counter",
            "Error responses and failed generations, by kind.",
            "kind",
            self.errors,
        )
        _labelled(
            out,
            "http_responses_total",
            "counter",
            "HTTP responses, by status class.",
            "status",
            self.http_requests,
        )
        _gauge(out, "http_requests_in_flight", "HTTP requests being served.", self.in_flight)
        _gauge(
            out,
            "engine_responsive",
            "1 if the engine answered this scrape's request for its statistics in time, else 0.",
            int(engine_stats is not None),
        )
        if engine_stats is not None:
            _engine_metrics(out, engine_stats)
        return "\n".join(out) + "\n"


class GenerationTimer:
    """Follows one generation's snapshots and records its latencies and token counts."""

    def __init__(self, metrics: Metrics, arrived: float) -> None:
        self.metrics = metrics
        self.start = self.last = arrived
        self.tokens = 0

    def update(self, completion_tokens: int) -> None:
        new = completion_tokens - self.tokens
        if new <= 0:
            return
        now = time.perf_counter()
        if self.tokens == 0:
            self.metrics.ttft.observe(now - self.start)
            new -= 1  # the first token's latency is the TTFT; the rest of this batch follow it
            gap = 0.0
        else:
            gap = (now - self.last) / new
        for _ in range(new):
            self.metrics.itl.observe(gap)
        self.tokens = completion_tokens
        self.last = now

    def finish(self, meta_info: dict[str, Any]) -> None:
        self.update(int(meta_info.get("completion_tokens", 0)))
        m = self.metrics
        m.e2e.observe(time.perf_counter() - self.start)
        m.prompt_tokens += int(meta_info.get("prompt_tokens", 0))
        m.generation_tokens += int(meta_info.get("completion_tokens", 0))
        m.cached_tokens += int(meta_info.get("cached_tokens", 0))
        reason = meta_info.get("finish_reason") or {}
        kind = reason.get("type", "unknown") if isinstance(reason, dict) else str(reason)
        m.finished[kind] += 1
        if meta_info.get("error"):
            m.count_error("engine_error")

    def abandon(self) -> None:
        """The client went away (or the server stopped) before the generation finished."""
        self.metrics.finished["abort"] += 1
        self.metrics.count_error("client_disconnected")

    def cancel(self) -> None:
        """Aborted because another generation of its request failed."""
        self.metrics.finished["abort"] += 1

    def refuse(self) -> float:
        """Refused before it ran (its grammar, in a list of prompts whose others run): counted as
        a refused single request is, the client's error, and finished as an abort with no
        latencies or tokens. The time from arrival to the refusal, in seconds."""
        self.metrics.finished["abort"] += 1
        self.metrics.count_error("invalid_request_error")
        return time.perf_counter() - self.start

    def fail(self) -> None:
        """The generation failed before it finished (the error itself is counted by its kind
        where the request is answered)."""
        self.metrics.finished["error"] += 1


# the engine's running totals (since it started): its stats key -> (metric name, help)
_ENGINE_COUNTERS = {
    "num_preemptions": ("preemptions_total", "Requests preempted for lack of KV slots."),
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
}


def _engine_metrics(out: list[str], stats: dict[str, Any]) -> None:
    _gauge(
        out, "num_running_reqs", "Requests in the running batch.", stats.get("num_running_reqs", 0)
    )
    _gauge(
        out,
        "num_waiting_reqs",
        "Requests queued for admission.",
        stats.get("num_waiting_reqs", 0),
    )
    capacity = stats.get("kv_pool_capacity_tokens") or 0
    free = stats.get("kv_pool_free_tokens") or 0
    _gauge(out, "kv_pool_capacity_tokens", "KV-pool slots in all.", capacity)
    _gauge(
        out,
        "kv_cache_usage_ratio",
        "Share of KV-pool slots in use (by requests or the prefix cache).",
        (capacity - free) / capacity if capacity else 0.0,
    )
    _gauge(
        out,
        "cache_hit_rate",
        "Share of prompt tokens served from the radix cache since start.",
        stats.get("cache_hit_rate", 0.0),
    )
    _gauge(
        out,
        "radix_cache_tokens",
        "Tokens held by the radix cache.",
        stats.get("radix_cache_tokens"),
    )
    for key, (name, help) in _ENGINE_COUNTERS.items():
        _counter(out, name, help, stats.get(key))
    grammar = stats.get("grammar_compile_seconds")
    if isinstance(grammar, dict):
        with contextlib.suppress(ValueError):  # a malformed one is left out, not a failed scrape
            _histogram(
                out,
                "grammar_compile_seconds",
                "Time a constrained request waited for its grammar (a compile, or a cache hit).",
                Histogram.from_snapshot(grammar),
            )
    # any other number the engine reports, as a gauge (a running total belongs in _ENGINE_COUNTERS)
    known = {
        "num_running_reqs",
        "num_waiting_reqs",
        "kv_pool_capacity_tokens",
        "kv_pool_free_tokens",
        "cache_hit_rate",
        "radix_cache_tokens",
        "prompt_tokens",  # the server counts these itself, per request
        "cached_tokens",
        "generated_tokens",
        *_ENGINE_COUNTERS,
    }
    for key, value in sorted(stats.items()):
        if key not in known and _is_number(value):
            _gauge(out, "engine_" + _metric_name(key), f"Engine statistic {key}.", value)


def _histogram(out: list[str], name: str, help: str, hist: Histogram) -> None:
    data = hist.snapshot()
    out.append(f"# HELP {PREFIX}{name} {help}")
    out.append(f"# TYPE {PREFIX}{name} histogram")
    cumulative = 0
    for bound, n in zip((*data["buckets"], math.inf), data["counts"]):
        cumulative += n
        out.append(f'{PREFIX}{name}_bucket{{le="{_number(bound)}"}} {cumulative}')
    out.append(f"{PREFIX}{name}_sum {_number(data['sum'])}")
    out.append(f"{PREFIX}{name}_count {data['count']}")


def _counter(out: list[str], name: str, help: str, value: Any) -> None:
    _single(out, name, "counter", help, value)


def _gauge(out: list[str], name: str, help: str, value: Any) -> None:
    _single(out, name, "gauge", help, value)


def _single(out: list[str], name: str, kind: str, help: str, value: Any) -> None:
    if not _is_number(value):
        return
    out.append(f"# HELP {PREFIX}{name} {help}")
    out.append(f"# TYPE {PREFIX}{name} {kind}")
    out.append(f"{PREFIX}{name} {_number(value)}")


def _labelled(
    out: list[str], name: str, kind: str, help: str, label: str, values: dict[str, int]
) -> None:
    out.append(f"# HELP {PREFIX}{name} {help}")
    out.append(f"# TYPE {PREFIX}{name} {kind}")
    for key, value in sorted(values.items()):
        out.append(f'{PREFIX}{name}{{{label}="{_label_value(key)}"}} {_number(value)}')


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(value: float) -> str:
    if value == math.inf:
        return "+Inf"
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return repr(float(value))


def _label_value(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _metric_name(key: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in key)
