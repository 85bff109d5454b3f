"""Allocation policy over the KV memory: prefix reuse, slot allocation with eviction, release.

The cache manager is the only place that moves slots between the allocator, the request rows and
the prefix cache, so that a slot always has exactly one owner: the free list, one request, or the
prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from radixlm.radix_cache.base import MatchResult, PrefixCache
from radixlm.runtime.memory_pool import ReqToTokenPool, SlotAllocator
from radixlm.runtime.request import Req


@dataclass
class CacheStats:
    prompt_tokens: int = 0  # prompt tokens admitted (first admission of each request)
    cached_tokens: int = 0  # of which served from the prefix cache

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class CacheManager:
    def __init__(
        self, allocator: SlotAllocator, rows: ReqToTokenPool, prefix_cache: PrefixCache
    ) -> None:
        self.allocator = allocator
        self.rows = rows
        self.prefix_cache = prefix_cache
        self.stats = CacheStats()
        # the last positions of a cached prefix a request computes again: 1 for an EAGLE-3
        # draft, whose entry at a prefix's last position is made with the token after it, which
        # the request that cached the prefix may not share (speculative/eagle3.py)
        self.recompute_cached = 0

    # ---- queries --------------------------------------------------------------------------

    @property
    def available_slots(self) -> int:
        """Slots that can be had now: free ones plus those eviction could free."""
        return self.allocator.num_free + self.prefix_cache.evictable_size

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    def match(self, req: Req) -> MatchResult:
        """The longest cached prefix of what `req` must have computed, leaving at least one token
        to compute (its logits give the next token) and every position whose input log-probability
        was asked for."""
        limit = req.num_tokens - 1
        if req.wants_input_logprobs:
            limit = min(limit, max(req.logprob.logprob_start_len - 1, 0))
        found = self.prefix_cache.match_prefix(req.all_ids[:limit])
        if self.recompute_cached and len(found.slots):
            found = self.prefix_cache.match_prefix(
                req.all_ids[: max(0, len(found.slots) - self.recompute_cached)]
            )
        return found

    # ---- commands -------------------------------------------------------------------------

    def admit(self, req: Req, match: MatchResult) -> None:
        """Give `req` a row holding the matched prefix, and lock that prefix for it."""
        req.pool_row = self.rows.allocate()
        req.token_in_buf = False  # a new row: nothing sampled into its token_buf entry yet
        self.prefix_cache.lock(match.node)
        req.locked_node = match.node
        req.locked_len = req.kv_len = len(match.slots)
        if len(match.slots):
            self.rows.write(req.pool_row, 0, match.slots)

    def record_first_admission(self, req: Req) -> None:
        req.cached_tokens = req.locked_len
        self.stats.prompt_tokens += len(req.input_ids)
        self.stats.cached_tokens += req.locked_len

    def can_extend(self, num_tokens: int) -> bool:
        return num_tokens <= self.available_slots

    def extend(self, req: Req, num_tokens: int) -> None:
        """Reserve slots for the next `num_tokens` positions of `req` (evicting cached prefixes if
        needed) and advance `req.kv_len` over them; the step being planned computes their K/V."""
        slots = self._allocate(num_tokens)
        self.rows.write(req.pool_row, req.kv_len, slots)
        req.kv_len += num_tokens

    def extend_many(self, reqs: list[Req], counts: list[int]) -> None:
        """`extend` for each of `reqs` by its count, with one allocation and one write into the
        device table (a verify step's requests: one small copy each cost ~40 us on an H100's
        host, 5 ms for 128 requests)."""
        slots = self._allocate(sum(counts))
        self.rows.write_many([r.pool_row for r in reqs], [r.kv_len for r in reqs], counts, slots)
        for req, n in zip(reqs, counts):
            req.kv_len += n

    def extend_decodes(self, reqs: list[Req]) -> tuple[list[int], list[int], torch.Tensor]:
        """`extend` by one token for each of `reqs` (a step's decodes) with one allocation and one
        write into the request table's host copy; returns their rows, their new lengths and the
        new tokens' slots. The step that computes them writes the slots into the device table."""
        slots = self._allocate(len(reqs))
        rows: list[int] = []
        seq_lens: list[int] = []
        for req in reqs:
            n = req.kv_len + 1
            req.kv_len = n
            rows.append(req.pool_row)
            seq_lens.append(n)
        self.rows.write_next_host(rows, seq_lens, slots)
        return rows, seq_lens, slots

    def truncate(self, req: Req, length: int) -> None:
        """Forget the K/V of positions `length..kv_len` of `req` (its own slots, not the cache's)."""
        self.truncate_many([req], [length])

    def truncate_many(self, reqs: list[Req], lengths: list[int]) -> None:
        """`truncate(reqs[i], lengths[i])` for each i, the slots freed together (a verify step's
        rejected draft positions: a few torch calls a step instead of a few a request)."""
        for req, length in zip(reqs, lengths):
            if length < req.locked_len:
                raise ValueError(
                    f"cannot truncate below the cached prefix ({req.locked_len} tokens)"
                )
        view = self.rows.view
        dropped = [
            view(req.pool_row, length, req.kv_len)
            for req, length in zip(reqs, lengths)
            if length < req.kv_len
        ]
        if dropped:
            self.allocator.free(torch.from_numpy(np.concatenate(dropped)))  # (int64 there)
        for req, length in zip(reqs, lengths):
            req.kv_len = min(req.kv_len, length)

    def keep_path(self, req: Req, root: int, num_nodes: int, path: list[int]) -> None:
        """After a draft tree's verify: of the `num_nodes` slots after position `root` (the tree's
        nodes in node order), keep those of the accepted `path` (node indices) at positions
        root + 1, root + 2, ... and free the others."""
        slots = self.rows.read(req.pool_row, root + 1 + num_nodes)[root + 1 :]
        kept = slots[path] if path else slots[:0]
        dropped = torch.ones(num_nodes, dtype=torch.bool)
        dropped[path] = False
        self.allocator.free(slots[dropped])
        if path != list(range(len(path))):  # (the first path's are in place already)
            self.rows.write(req.pool_row, root + 1, kept)
        req.kv_len = root + 1 + len(path)

    def release(self, req: Req) -> None:
        """Hand the request's computed tokens to the prefix cache and free what it does not keep.

        Used when a request finishes and when it is preempted (its prefix may then be reused
        when it resumes)."""
        if req.pool_row is None:
            return
        if req.kv_len > req.num_tokens:
            # a verified draft that a stop string cut short computed K/V past the output's end
            self.truncate(req, req.num_tokens)
        slots = self.rows.read(req.pool_row, req.kv_len)
        inserted = self.prefix_cache.insert(req.all_ids[: req.kv_len], slots)
        # slots[:locked_len] are the cache's own; slots[locked_len:prefix_len] duplicate what the
        # cache already held, so they return to the free list
        self.allocator.free(slots[req.locked_len : inserted.prefix_len])
        self.prefix_cache.unlock(req.locked_node)
        self.rows.free(req.pool_row)
        req.pool_row, req.locked_node, req.locked_len, req.kv_len = None, None, 0, 0

    def cache_prefix(self, req: Req) -> None:
        """Mid-prefill: hand the tokens computed so far to the prefix cache, so that requests sharing
        this prompt reuse them at once. The request keeps them locked and continues."""
        if not self.prefix_cache.enabled or req.kv_len <= req.locked_len:
            return
        tokens = req.all_ids[: req.kv_len]
        slots = self.rows.read(req.pool_row, req.kv_len)
        inserted = self.prefix_cache.insert(tokens, slots)
        self.allocator.free(slots[req.locked_len : inserted.prefix_len])
        match = self.prefix_cache.match_prefix(tokens)
        self.rows.write(req.pool_row, 0, match.slots)
        self.prefix_cache.lock(match.node)
        self.prefix_cache.unlock(req.locked_node)
        req.locked_node, req.locked_len = match.node, req.kv_len

    def flush(self) -> bool:
        """Empty the prefix cache; False (and nothing done) while any of it is in use."""
        if self.prefix_cache.protected_size:
            return False
        self.allocator.free(self.prefix_cache.reset())
        return True

    def _allocate(self, n: int) -> torch.Tensor:
        short = n - self.allocator.num_free
        if short > 0:
            self.allocator.free(self.prefix_cache.evict(short))
        return self.allocator.allocate(n)

    def slots_in_use(self) -> int:
        """Slots owned by running requests (for invariant checks)."""
        return self.allocator.capacity - self.allocator.num_free - self.prefix_cache.total_size
