"""The CPU kernels over GGUF blocks as stored (gguf_cpu.cpp beside this file), built at first use.

`load()` compiles the C++ once per machine (torch.utils.cpp_extension: a C++ compiler and ninja,
-O3 -march=native; torch caches the build, so later processes only load it) and returns the module
with `matmul(x, w, type, k)` and `dequantize(w, type, k)`; None where it cannot be built (no
compiler), with one warning: the callers then run the plain-torch dequantization
(kernels/gguf_ref.py), correct and much slower.
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


@functools.cache
def load() -> Any | None:
    """The compiled module, or None (not built: see the module doc)."""
    if os.environ.get(DISABLE_ENV) == "1":
        return None
    try:
        from torch.utils.cpp_extension import load as build

        return build(
            name="radixlm_gguf_cpu",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, a failed build
        logger.warning(
            "the GGUF CPU kernels could not be built (%s: %s): GGUF layers dequantize in plain "
            "torch at every step instead, correct but much slower",
            type(e).__name__,
            str(e).strip().splitlines()[-1] if str(e).strip() else "",
        )
        return None
