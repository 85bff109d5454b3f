"""radixlm: structured generation and agent serving over a RadixAttention prefix cache.

`import radixlm` stays light (no torch): heavy parts load on first use, so a client that only
talks HTTP starts fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it (imported on first access)
_LAZY = {
    "Engine": "radixlm.runtime.engine",
    "EngineConfig": "radixlm.runtime.config",
    "SamplingParams": "radixlm.runtime.sampling_params",
}

if TYPE_CHECKING:
    from radixlm.runtime.config import EngineConfig
    from radixlm.runtime.engine import Engine
    from radixlm.runtime.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'radixlm' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = ["Engine", "EngineConfig", "SamplingParams", "__version__"]
