"""radixlm: structured generation and agent serving over a RadixAttention prefix cache.

`import radixlm` stays light (no torch): heavy parts load on first use, so a client that only
talks HTTP starts fast.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"


def _package_folder_last_on_path() -> None:
    """This folder is the package, so run from it (`python -m pytest`, `python -m benchmarks.x`)
    its subpackages are also top-level names, and `kernels` would hide the Hugging Face package
    of that name, which transformers imports (from 5.2x on, when loading a checkpoint): the folder
    moves to the end of sys.path, where it only finds what nothing installed is called."""
    here = os.path.dirname(os.path.abspath(__file__))
    ours = [p for p in sys.path if os.path.abspath(p or os.curdir) == here]
    if ours:
        sys.path[:] = [p for p in sys.path if p not in ours] + ours


_package_folder_last_on_path()

# public name -> module that defines it (imported on first access)
_LAZY = {
    "Engine": "radixlm.runtime.engine",
    "EngineConfig": "radixlm.runtime.config",
    "EngineShutDown": "radixlm.errors",
    "SamplingParams": "radixlm.protocol.sampling_params",
}
# the program language (radixlm.lang, torch-free): `import radixlm as sgl` runs SGLang programs
_LANG_NAMES = (
    "function", "gen", "gen_int", "gen_string", "select", "separate_reasoning", "image", "video",
    "system", "user", "assistant", "system_begin", "system_end", "user_begin", "user_end",
    "assistant_begin", "assistant_end", "set_default_backend", "get_default_backend",
    "flush_cache", "get_server_info", "RuntimeEndpoint", "OpenAI", "EngineBackend",
    "ProgramState", "ProgramError", "BackendError", "ChatTemplate", "ChoicesSamplingMethod",
    "token_length_normalized", "greedy_token_selection", "unconditional_likelihood_normalized",
)  # fmt: skip
_LAZY.update(dict.fromkeys(_LANG_NAMES, "radixlm.lang"))

if TYPE_CHECKING:
    from radixlm.errors import EngineShutDown
    from radixlm.protocol.sampling_params import SamplingParams
    from radixlm.runtime.config import EngineConfig
    from radixlm.runtime.engine import Engine


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'radixlm' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "Engine",
    "EngineConfig",
    "EngineShutDown",
    "SamplingParams",
    "__version__",
    *_LANG_NAMES,
]
