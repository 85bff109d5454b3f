"""What an engine start says while it works: a line for each step that may take a while (on a
first start, converting the default model takes about a minute on a small CPU), with a progress bar
where the work is counted (de-quantizing, loading weights, capturing CUDA graphs).

Where the application has configured logging (`radixlm serve` does), the lines are log records of
the `radixlm.startup` logger at INFO; where it has not (a plain script, `radixlm generate`), they go
to stderr as `radixlm: ...`, so a first start is never silent. Setting the `radixlm` logger's level
above INFO silences them. Progress bars are drawn only on a terminal; elsewhere a step's last line
says how long it took. Nothing here is state: each call decides from the logging setup as it is.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

logger = logging.getLogger("radixlm.startup")

T = TypeVar("T")


def _to_log() -> bool:
    return logger.hasHandlers()


def enabled() -> bool:
    """Whether start-up lines are shown at all."""
    if _to_log():
        return logger.isEnabledFor(logging.INFO)
    level = logging.NOTSET  # the level set on radixlm.startup or radixlm, if any
    node: logging.Logger | None = logger
    while node is not None and node.name.startswith("radixlm") and level == logging.NOTSET:
        level = node.level
        node = node.parent
    return level <= logging.INFO


def say(message: str) -> None:
    """One line about what the start is doing (or has done)."""
    if _to_log():
        logger.info(message)
    elif enabled():
        print(f"radixlm: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def step(doing: str, done: str | None = None) -> Iterator[None]:
    """Say `doing` before the work; after it, `done` (if given) with the seconds it took."""
    say(doing)
    started = time.perf_counter()
    yield
    if done is not None:
        say(f"{done} in {time.perf_counter() - started:.1f}s")


def progress(items: Iterable[T], total: int, doing: str, unit: str = "it") -> Iterator[T]:
    """`items`, counted on a progress bar on a terminal; either way a line before and one after."""
    say(f"{doing} ...")
    started = time.perf_counter()
    bar = None
    if enabled() and total > 0 and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=total, desc=f"radixlm: {doing}", unit=unit, file=sys.stderr, leave=False)
    count = 0
    try:
        for item in items:
            yield item
            count += 1
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    say(f"{doing}: {count} {unit} in {time.perf_counter() - started:.1f}s")
