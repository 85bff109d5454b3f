"""The contract of a prefix cache over KV slots, written once.

A prefix cache maps token sequences to the KV-cache slots that hold their keys and values, so that
a request whose prompt starts with tokens some earlier request already computed reuses those slots
instead of recomputing them. Slots are 1-D int64 tensors of pool indices (page size 1: one slot a
token). The cache never allocates or frees slots itself: it takes ownership of the slots handed to
`insert` and gives them back from `evict`; the caller returns those to its allocator.

Nodes are opaque handles. A node returned by `match_prefix` or `insert` stands for the whole path
from the root to it; `lock(node)` protects every slot on that path from eviction until the matching
`unlock(node)`. Locks nest (they are reference counts).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch


class MatchResult(NamedTuple):
    slots: torch.Tensor  # (n,) int64: the KV slots of the longest cached prefix of the query
    node: Any  # handle of the node that ends exactly at that prefix (the root when n == 0)


class InsertResult(NamedTuple):
    prefix_len: int  # leading tokens the cache held before this insert
    node: Any  # handle of the node that ends exactly at the inserted sequence


class PrefixCache(ABC):
    enabled = True  # False for the null cache, which keeps nothing

    @abstractmethod
    def match_prefix(self, tokens: Sequence[int]) -> MatchResult:
        """Return the longest cached prefix of `tokens` and its node.

        A match that ends inside a node splits that node, so the returned node covers exactly the
        matched prefix. Touches the path (it becomes most recently used). Does not lock.
        """

    @abstractmethod
    def insert(self, tokens: Sequence[int], slots: torch.Tensor) -> InsertResult:
        """Cache `tokens` with their `slots` (same length).

        The cache already held the first `prefix_len` tokens: it keeps its own slots for them, so the
        caller still owns `slots[:prefix_len]` and must free those of them it did not get from this
        cache. The cache takes ownership of `slots[prefix_len:]`.
        """

    @abstractmethod
    def lock(self, node: Any) -> None:
        """Protect every slot on the path root..node from eviction (reference counted)."""

    @abstractmethod
    def unlock(self, node: Any) -> None:
        """Undo one `lock(node)`. Raises RuntimeError if the path is not locked."""

    @abstractmethod
    def evict(self, num_tokens: int) -> torch.Tensor:
        """Drop least-recently-used unlocked leaves until at least `num_tokens` slots are freed or
        nothing evictable is left; return the freed slots (int64) for the caller to free."""

    @abstractmethod
    def reset(self) -> torch.Tensor:
        """Empty the cache and return every slot it owned. Raises RuntimeError if any node is locked."""

    @property
    @abstractmethod
    def evictable_size(self) -> int:
        """Slots owned by the cache that no lock protects."""

    @property
    @abstractmethod
    def protected_size(self) -> int:
        """Slots owned by the cache on some locked path."""

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size


class NoPrefixCache(PrefixCache):
    """The null cache, for `disable_radix_cache=True`: it never matches and never keeps anything.

    `insert` reports the whole sequence as already held, so the caller frees every slot itself.
    """

    enabled = False
    _EMPTY = torch.empty(0, dtype=torch.int64)

    def match_prefix(self, tokens: Sequence[int]) -> MatchResult:
        return MatchResult(self._EMPTY, None)

    def insert(self, tokens: Sequence[int], slots: torch.Tensor) -> InsertResult:
        return InsertResult(len(tokens), None)

    def lock(self, node: Any) -> None:
        pass

    def unlock(self, node: Any) -> None:
        pass

    def evict(self, num_tokens: int) -> torch.Tensor:
        return self._EMPTY

    def reset(self) -> torch.Tensor:
        return self._EMPTY

    @property
    def evictable_size(self) -> int:
        return 0

    @property
    def protected_size(self) -> int:
        return 0
