"""The CPU kernels over GGUF blocks as stored (gguf_cpu.cpp beside this file), built at first use.

`load()` compiles the C++ once per machine (torch.utils.cpp_extension: a C++ compiler and ninja,
-O3 -march=native; torch caches the build, so later processes only load it) and returns the module
with `matmul(x, w, type, k)` and `dequantize(w, type, k)`; None where it cannot be built (no
compiler), with one warning: the callers then run the plain-torch dequantization
(kernels/gguf_ref.py), correct and much slower.

The kernels run on threads of their own (`set_threads`; at first torch's count in the thread
that loads them), not torch's OpenMP threads: those serve every thread that runs torch ops (an
engine's main thread loads the model, its core thread runs the steps), and with more threads than
cores libgomp lets idle workers sleep at once, so that every parallel region of a decode step, a
few hundred, waits for a wake-up. Measured on the 2-core machine: 13.8 ms a decode step in the
matmuls on these threads against 18.9 ms on torch's.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("gguf_cpu.cpp")
# set to 1 to run the plain-torch path instead of the compiled kernels (tests, comparisons)
DISABLE_ENV = "RADIXLM_DISABLE_GGUF_CPU_KERNELS"


def _ninja_on_path() -> None:
    """torch's build runs `ninja` from PATH: the `ninja` package's (a dependency) put there when
    the machine has none of its own, as in a virtual environment that was not activated."""
    import shutil

    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


@functools.cache
def load() -> Any | None:
    """The compiled module, or None (not built: see the module doc)."""
    if os.environ.get(DISABLE_ENV) == "1":
        return None
    try:
        import torch
        from torch.utils.cpp_extension import load as build

        _ninja_on_path()

        module = build(
            name="radixlm_gguf_cpu",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-march=native"],
            verbose=False,
        )
        module.set_threads(torch.get_num_threads())  # (this thread's: the engine's setting)
        return module
    except Exception as e:  # no compiler, no ninja, a failed build
        logger.warning(
            "the GGUF CPU kernels could not be built (%s: %s): GGUF layers dequantize in plain "
            "torch at every step instead, correct but much slower",
            type(e).__name__,
            str(e).strip().splitlines()[-1] if str(e).strip() else "",
        )
        return None
