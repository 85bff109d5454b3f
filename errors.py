"""Exceptions of the engine that callers tell apart (torch-free: the server imports them)."""

from __future__ import annotations


class EngineShutDown(RuntimeError):
    """The engine was shut down (or its process was lost): it takes no more requests. The HTTP
    server answers 503 for it; any other RuntimeError from the engine is a failure (500). A
    RuntimeError, so code that caught that before still does."""
