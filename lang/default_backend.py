"""Which backend a program runs on: the one given as `backend=`, or the process-wide default.

A user passes a `Backend`, a `radixlm.Engine` (wrapped once per engine in an `EngineBackend`) or
an object with an `endpoint` (SGLang's `Runtime`). This module sits above the backends it
names, so `lang/backend.py` stays free of them.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from radixlm.lang.backend import Backend
from radixlm.lang.engine_backend import EngineBackend

# SGLang's `set_default_backend` makes this one process-wide setting; everything else takes an
# explicit `backend=`.
_default: list[Backend] = []
_engine_backends: weakref.WeakKeyDictionary[Any, Backend] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def set_default_backend(backend: Any) -> None:
    """The backend `run` / `run_batch` use when given none: a `radixlm.Engine`, a
    `RuntimeEndpoint` or an `OpenAI` backend; None clears it."""
    resolved = None if backend is None else resolve_backend(backend)
    with _lock:
        _default[:] = [] if resolved is None else [resolved]


def get_default_backend() -> Backend | None:
    with _lock:
        return _default[0] if _default else None


def resolve_backend(backend: Any) -> Backend:
    """A backend object from what a user passes: a Backend, an Engine (wrapped once per engine),
    or an object with an `endpoint` (SGLang's `Runtime`); None is the default backend."""
    if backend is None:
        default = get_default_backend()
        if default is None:
            raise RuntimeError(
                "no backend: call radixlm.set_default_backend(radixlm.Engine()) (or a "
                "radixlm.RuntimeEndpoint(url)), or pass backend= to run()"
            )
        return default
    if isinstance(backend, Backend):
        return backend
    if isinstance(getattr(backend, "endpoint", None), Backend):
        return backend.endpoint
    if _is_engine(backend):
        with _lock:
            wrapped = _engine_backends.get(backend)
        if wrapped is None:
            wrapped = EngineBackend(backend)
            with _lock:
                wrapped = _engine_backends.setdefault(backend, wrapped)
        return wrapped
    raise TypeError(
        f"unknown backend {backend!r}: use a radixlm.Engine, radixlm.RuntimeEndpoint(url) or "
        "radixlm.OpenAI(...)"
    )


def _is_engine(obj: Any) -> bool:
    return all(
        callable(getattr(obj, name, None)) for name in ("generate", "apply_chat_template")
    ) and hasattr(obj, "tokenizer")
