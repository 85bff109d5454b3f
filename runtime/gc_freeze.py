"""Python's garbage collector and a serving engine: the engine's host work is Python, and a full
pass of the collector walks every object of torch, transformers and the model (0.1-0.3 s on the
development machines), stopping every request meanwhile. Once an engine is ready the objects alive
then are frozen (gc.freeze: full passes skip them); the freeze is the whole process's, so it is
counted here by engine and kept while any frozen engine lives. Passes longer than a threshold
(`gc_warning_threshold_secs`, SGLang's option) are noted in the collector's callback and logged
later by `report` (logging inside a collection could write to a stream in the middle of a
write)."""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections import deque
from typing import Any

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_frozen_by = 0  # engines alive that froze the process's objects
_threshold = 0.0  # seconds; 0: no warning
_began = 0.0
_slow: deque[tuple[int, float, int]] = deque(maxlen=64)  # (generation, seconds, collected)


def freeze(counted: bool = True) -> int:
    """Collect, then freeze every object alive, for one more engine (`counted`; else again, for
    one that froze already); the count frozen."""
    global _frozen_by
    with _lock:
        gc.collect()
        gc.freeze()
        _frozen_by += counted
        return gc.get_freeze_count()


def release() -> None:
    """An engine that froze is going: its objects back in the collector's passes, collected
    (they refer to each other), and the rest frozen again while another frozen engine lives."""
    global _frozen_by
    with _lock:
        _frozen_by = max(0, _frozen_by - 1)
        gc.unfreeze()
        gc.collect()
        if _frozen_by:
            gc.freeze()


def watch(threshold: float) -> None:
    """Note collector passes longer than `threshold` seconds (the largest asked for wins; 0
    leaves an earlier engine's threshold as it was)."""
    global _threshold
    if threshold <= 0:
        return
    with _lock:
        _threshold = max(_threshold, threshold)
        if _note not in gc.callbacks:
            gc.callbacks.append(_note)


def _note(phase: str, info: dict[str, Any]) -> None:
    global _began
    if phase == "start":
        _began = time.perf_counter()
        return
    took = time.perf_counter() - _began
    if took > _threshold > 0:
        _slow.append((info.get("generation", -1), took, info.get("collected", 0)))


def report() -> None:
    """Log the long passes noted since the last call (the engine core calls it between steps)."""
    while True:
        try:  # (engines' core loops and callers may report at once)
            generation, took, collected = _slow.popleft()
        except IndexError:
            return
        logger.warning(
            "garbage collection of generation %d took %.3f s (collected %d objects; %d frozen): "
            "every request waited for it",
            generation, took, collected, gc.get_freeze_count(),
        )  # fmt: skip
