"""The prefix tree over KV slots: match, insert, lock/unlock, LRU eviction, cache-aware ordering."""

from __future__ import annotations

from .base import InsertResult, MatchResult, NoPrefixCache, PrefixCache
from .ordering import order_waiting
from .radix_tree import RadixCache

__all__ = [
    "InsertResult",
    "MatchResult",
    "NoPrefixCache",
    "PrefixCache",
    "RadixCache",
    "order_waiting",
]
