"""A step's matchers together: their masks filled, and their tokens taken, in the grammar
backend's own threads where it has them (llguidance's, without the GIL), one by one otherwise."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from radixlm.constrained.llguidance_backend import (
    LLGuidanceMatcher,
    accept_batch,
    begin_fill,
    fill_bitmasks,
)


def fill_next_token_bitmasks(matchers: list, bitmask: torch.Tensor) -> None:
    """Row i of the contiguous CPU (B, W) int32 `bitmask` := the next-token mask of matchers[i].
    llguidance's matchers are filled together in its own threads, without the GIL (one call for
    the batch); others one by one."""
    for backend, pairs in _by_parallel_backend(matchers, range(len(matchers))).items():
        if backend is None or not bitmask.is_contiguous():
            for matcher, row in pairs:
                matcher.fill_next_token_bitmask(bitmask, row)
        else:
            fill_bitmasks(pairs, bitmask, backend.executor)


class PendingMasks:
    """Masks filling (begin_next_token_bitmasks); `result()` gives the bitmask once filled."""

    def __init__(self, bitmask: torch.Tensor, pending: list, others: list) -> None:
        self._bitmask, self._pending, self._others = bitmask, pending, others

    def result(self) -> torch.Tensor:
        for fill in self._pending:
            fill.result()
        for matcher, row in self._others:
            matcher.fill_next_token_bitmask(self._bitmask, row)
        return self._bitmask


def begin_next_token_bitmasks(matchers: list, bitmask: torch.Tensor) -> PendingMasks:
    """fill_next_token_bitmasks, begun: llguidance's matchers fill in another thread while the
    caller goes on (the engine core applies the previous step's tokens meanwhile; a matcher that
    changes before `result()` is filled again then); others fill at `result()`."""
    pending, others = [], []
    for backend, pairs in _by_parallel_backend(matchers, range(len(matchers))).items():
        if backend is None or not bitmask.is_contiguous():
            others.extend(pairs)
        else:
            pending.append(begin_fill(pairs, bitmask))
    return PendingMasks(bitmask, pending, others)


def accept_next_tokens(matchers: list, tokens: list[int]) -> None:
    """Let matchers[i] take tokens[i] ahead of its `accept_token(tokens[i])`, all together where
    the backend can (llguidance's threads); `accept_token` then answers at once. Others wait for
    their `accept_token`."""
    for backend, pairs in _by_parallel_backend(matchers, tokens).items():
        if backend is not None:
            accept_batch(pairs, backend.executor)


def _by_parallel_backend(matchers: list, xs: Iterable) -> dict:
    """(matcher, x) pairs grouped by the llguidance backend of their matcher (None: others)."""
    groups: dict = {}
    for matcher, x in zip(matchers, xs):
        backend = matcher.grammar.backend if type(matcher) is LLGuidanceMatcher else None
        groups.setdefault(backend, []).append((matcher, x))
    return groups
