"""Shared helpers of the benchmark scripts (run them from the repository root)."""

from __future__ import annotations

import platform
import random
import subprocess

import torch


def device_line() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    return f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads (torch {torch.__version__})"


def commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        return "unknown"


def random_prompts(count: int, low: int, high: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Random token-id prompts with lengths uniform in [low, high] (ids avoid the special tokens)."""
    rng = random.Random(seed)
    return [
        [rng.randrange(100, vocab) for _ in range(rng.randint(low, high))] for _ in range(count)
    ]
