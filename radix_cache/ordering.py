"""Cache-aware ordering of a scheduler's waiting queue."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

POLICIES = ("fcfs", "lpm")


def order_waiting(
    requests: list[T],
    prefix_len: Callable[[T], int],
    policy: str,
    fcfs_threshold: int = 128,
) -> list[T]:
    """Return the waiting requests in the order the scheduler should admit them (a new list).

    - "fcfs": arrival order.
    - "lpm" (longest prefix match): longest cached prefix first, so requests that share a cached
      prefix run while it is still cached; ties keep arrival order. When more than `fcfs_threshold`
      requests wait, arrival order is used instead, as in SGLang: that bounds the cost of matching
      every waiting request against the tree, and once the queue backs up it admits the oldest
      requests first, so a request with no cached prefix cannot be passed over indefinitely by a
      steady stream of ones that have (below the threshold "lpm" gives no such guarantee).

    `prefix_len(request)` is called once per request, and only when "lpm" actually sorts.
    """
    if policy not in POLICIES:
        raise ValueError(
            f"unknown scheduling policy {policy!r}; valid policies: {', '.join(POLICIES)}"
        )
    if policy == "fcfs" or len(requests) > fcfs_threshold:
        return list(requests)
    return sorted(requests, key=lambda request: -prefix_len(request))  # sorted() is stable
