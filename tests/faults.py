"""Faults injected into a running engine, for tests of how a failure stays contained."""

from __future__ import annotations

from typing import Any


def fail_model_call(engine: Any, call: int, message: str = "injected failure") -> None:
    """Make the engine's model raise RuntimeError(message) on its `call`-th forward (1-based)
    after this, and run normally on every other."""
    runner = engine._core.runner
    model, calls = runner.model, []

    def failing(batch, backend):
        calls.append(1)
        if len(calls) == call:
            raise RuntimeError(message)
        return model(batch, backend)

    runner.model = failing
