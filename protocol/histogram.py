"""A histogram of observed values (durations), kept by the engine and by the server's metrics.

Torch-free, so the HTTP side can import it without loading the engine.
"""

from __future__ import annotations

import bisect
import threading
from typing import Any


class Histogram:
    """Bucket counts of observed values, safe to observe from any thread.

    A value falls in the first bucket whose upper bound is >= it (Prometheus' `le`); the last
    count is the +Inf bucket.
    """

    def __init__(
        self, buckets: tuple[float, ...], counts: list[int] | None = None, total: float = 0.0
    ) -> None:
        self.buckets = buckets
        self._counts = list(counts) if counts is not None else [0] * (len(buckets) + 1)
        if len(self._counts) != len(buckets) + 1:
            raise ValueError(f"{len(self._counts)} counts for {len(buckets)} buckets and +Inf")
        self._sum = total
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        index = bisect.bisect_left(self.buckets, value)
        with self._lock:
            self._counts[index] += 1
            self._sum += value

    def snapshot(self) -> dict[str, Any]:
        """{"buckets", "counts" (per bucket, +Inf last), "sum", "count"}: plain data for stats."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        return {"buckets": list(self.buckets), "counts": counts, "sum": total, "count": sum(counts)}

    @classmethod
    def from_snapshot(cls, data: dict[str, Any]) -> Histogram:
        """The histogram a `snapshot()` describes; ValueError if it is malformed."""
        try:
            buckets = tuple(float(b) for b in data["buckets"])
            counts = [int(c) for c in data["counts"]]
            total = float(data["sum"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a histogram snapshot: {e!r}") from None
        return cls(buckets, counts, total)
