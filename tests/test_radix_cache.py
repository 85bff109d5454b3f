"""The RadixAttention prefix tree and cache-aware ordering: hand-written cases, then a randomized
comparison against a brute-force model that keeps every cached prefix in a dict."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from radixlm.radix_cache import (
    InsertResult,
    MatchResult,
    NoPrefixCache,
    PrefixCache,
    RadixCache,
    order_waiting,
)


def slots(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def node_tokens(node) -> tuple[int, ...]:
    """The tokens on the path root..node."""
    parts = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return tuple(t for key in reversed(parts) for t in key)


# ---- hand-written cases ----


def test_match_on_empty_cache_returns_root_and_no_slots():
    cache = RadixCache()
    result = cache.match_prefix([1, 2, 3])
    assert isinstance(result, MatchResult)
    assert result.slots.dtype == torch.int64 and result.slots.numel() == 0
    assert result.node is cache.root


def test_partial_match_splits_the_node():
    cache = RadixCache()
    cache.insert([1, 2, 3, 4], slots(10, 11, 12, 13))
    leaf = cache.match_prefix([1, 2, 3, 4]).node

    result = cache.match_prefix([1, 2, 9])
    assert result.slots.tolist() == [10, 11]
    assert result.node.key == (1, 2)
    assert list(result.node.children.values()) == [leaf]
    assert leaf.key == (3, 4) and leaf.parent is result.node
    assert cache.root.children[1] is result.node

    # the old handle still stands for the whole path, the split changed nothing cached
    assert cache.match_prefix([1, 2, 3, 4, 5]).node is leaf
    assert cache.match_prefix([1, 2, 3, 4, 5]).slots.tolist() == [10, 11, 12, 13]
    assert len(cache) == 4 and cache.evictable_size == 4


def test_match_ending_inside_the_query_or_inside_the_key():
    cache = RadixCache()
    cache.insert([5, 6, 7], slots(1, 2, 3))
    assert cache.match_prefix([5, 6]).slots.tolist() == [1, 2]  # query ends inside the key
    assert cache.match_prefix([5, 6]).node.key == (5, 6)
    assert cache.match_prefix([6, 5]).node is cache.root
    assert cache.match_prefix(torch.tensor([5, 6, 7, 8])).slots.tolist() == [1, 2, 3]


def test_insert_reports_the_cached_prefix_length():
    cache = RadixCache()
    first = cache.insert([1, 2, 3], slots(10, 11, 12))
    assert isinstance(first, InsertResult) and first.prefix_len == 0
    assert node_tokens(first.node) == (1, 2, 3)

    second = cache.insert([1, 2, 4, 5], slots(20, 21, 22, 23))
    assert second.prefix_len == 2
    assert node_tokens(second.node) == (1, 2, 4, 5)
    # the cache kept its own slots for the shared prefix and took 22, 23
    assert cache.match_prefix([1, 2, 4, 5]).slots.tolist() == [10, 11, 22, 23]
    assert len(cache) == 5

    again = cache.insert([1, 2], slots(30, 31))
    assert again.prefix_len == 2 and node_tokens(again.node) == (1, 2)
    assert len(cache) == 5

    empty = cache.insert([], slots())
    assert empty == (0, cache.root)


def test_insert_copies_the_callers_slots():
    cache = RadixCache()
    row = slots(10, 11, 12)
    cache.insert([1, 2, 3], row)
    row.fill_(-1)  # the caller reuses its req_to_token row
    assert cache.match_prefix([1, 2, 3]).slots.tolist() == [10, 11, 12]


def test_insert_rejects_mismatched_slots():
    cache = RadixCache()
    with pytest.raises(ValueError, match="one slot per token"):
        cache.insert([1, 2, 3], slots(1, 2))
    with pytest.raises(ValueError, match="one slot per token"):
        cache.insert([1, 2], torch.zeros(2, 1, dtype=torch.int64))


def test_lock_protects_the_whole_path_from_eviction():
    cache = RadixCache()
    cache.insert([1, 2, 3], slots(10, 11, 12))
    b = cache.insert([1, 2, 4], slots(20, 21, 22)).node
    cache.insert([7, 8], slots(30, 31))

    cache.lock(b)
    assert cache.protected_size == 3  # [1, 2] and [4]
    assert cache.evictable_size == 3  # [3] and [7, 8]

    freed = cache.evict(100)
    assert sorted(freed.tolist()) == [12, 30, 31]
    assert cache.evictable_size == 0 and cache.protected_size == 3
    assert cache.match_prefix([1, 2, 4]).slots.tolist() == [10, 11, 22]
    assert cache.evict(100).numel() == 0

    cache.unlock(b)
    assert cache.evictable_size == 3 and cache.protected_size == 0
    assert sorted(cache.evict(100).tolist()) == [10, 11, 22]
    assert len(cache) == 0


def test_locks_nest():
    cache = RadixCache()
    node = cache.insert([1, 2], slots(10, 11)).node
    cache.lock(node)
    cache.lock(node)
    cache.unlock(node)
    assert cache.evict(10).numel() == 0
    cache.unlock(node)
    assert cache.evict(10).tolist() == [10, 11]


def test_lock_of_a_split_node_survives_the_split():
    cache = RadixCache()
    leaf = cache.insert([1, 2, 3, 4], slots(10, 11, 12, 13)).node
    cache.lock(leaf)
    upper = cache.match_prefix([1, 2]).node  # splits the locked node
    assert upper.lock_ref == 1 and leaf.lock_ref == 1
    assert cache.protected_size == 4 and cache.evictable_size == 0
    cache.unlock(leaf)
    assert cache.protected_size == 0 and cache.evictable_size == 4


def test_unlock_errors_and_root_is_a_no_op():
    cache = RadixCache()
    node = cache.insert([1, 2], slots(10, 11)).node
    with pytest.raises(RuntimeError, match="not locked"):
        cache.unlock(node)

    cache.lock(cache.root)  # an empty match locks nothing
    cache.unlock(cache.root)
    cache.unlock(cache.root)
    assert cache.protected_size == 0

    cache.lock(node)
    cache.unlock(node)
    with pytest.raises(RuntimeError, match="not locked"):
        cache.unlock(node)

    cache.evict(10)
    with pytest.raises(RuntimeError, match="not in this cache"):
        cache.lock(node)  # an evicted handle


def test_reset_refuses_while_locked_then_returns_everything():
    cache = RadixCache()
    node = cache.insert([1, 2, 3], slots(10, 11, 12)).node
    cache.insert([1, 4], slots(10, 13))
    cache.lock(node)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    assert len(cache) == 4  # nothing was dropped

    cache.unlock(node)
    empty_match = cache.match_prefix([9]).node
    cache.lock(empty_match)  # locks nothing, so it does not block the reset
    assert sorted(cache.reset().tolist()) == [10, 11, 12, 13]
    cache.unlock(empty_match)  # the root survives a reset
    assert len(cache) == 0 and cache.evictable_size == 0 and cache.protected_size == 0
    assert cache.match_prefix([1, 2, 3]).node is cache.root
    assert cache.reset().numel() == 0
    with pytest.raises(RuntimeError, match="not in this cache"):
        cache.lock(node)  # handles from before the reset are dead


def test_evict_is_least_recently_used_and_frees_whole_nodes():
    cache = RadixCache()
    cache.insert([1, 1, 1], slots(10, 11, 12))
    cache.insert([2, 2, 2], slots(20, 21, 22))
    cache.insert([3, 3, 3], slots(30, 31, 32))
    cache.match_prefix([1, 1, 1])  # now [2, 2, 2] is the oldest

    assert cache.evict(1).tolist() == [20, 21, 22]  # one token asked, the whole leaf goes
    assert cache.evict(1).tolist() == [30, 31, 32]
    assert cache.evict(1).tolist() == [10, 11, 12]
    assert cache.evict(1).numel() == 0
    assert cache.evict(0).numel() == 0
    with pytest.raises(ValueError):
        cache.evict(-1)


def test_a_parent_becomes_evictable_when_its_last_child_goes():
    cache = RadixCache()
    cache.insert([1, 2, 3], slots(10, 11, 12))
    cache.insert([1, 2, 4], slots(10, 11, 14))  # touches [1, 2], adds [4]
    cache.insert([5], slots(50))  # the newest
    assert cache.evict(1).tolist() == [12]
    assert cache.evict(1).tolist() == [14]
    assert cache.evict(1).tolist() == [10, 11]  # [1, 2] is a leaf now, older than [5]
    assert cache.evict(1).tolist() == [50]


def test_evict_keeps_going_until_enough_is_freed():
    cache = RadixCache()
    cache.insert([1], slots(10))
    cache.insert([2, 2], slots(20, 21))
    cache.insert([3, 3, 3], slots(30, 31, 32))
    assert cache.evict(2).tolist() == [10, 20, 21]


def test_stale_heap_entries_stay_bounded_and_lru_survives_the_rebuilds():
    cache = RadixCache()
    for first in range(5):
        cache.insert([first, 9], slots(10 * first, 10 * first + 1))
    rng = random.Random(0)
    last_touch = {4: -1}  # [4, 9] is never touched again: its one entry must survive
    for step in range(2000):  # every touch of a leaf leaves a stale entry behind
        first = rng.randrange(4)
        cache.match_prefix([first, 9])
        last_touch[first] = step
        assert len(cache._heap) <= 2 * 5 + 64 + 1
    expected = sorted(last_touch, key=last_touch.__getitem__)
    freed = [cache.evict(1).tolist() for _ in range(5)]
    assert freed == [[10 * first, 10 * first + 1] for first in expected]


def test_pretty_lists_every_node():
    cache = RadixCache()
    cache.insert([1, 2, 3], slots(10, 11, 12))
    cache.insert([1, 2, 4], slots(10, 11, 14))
    text = cache.pretty()
    assert "[1, 2]" in text and "[3]" in text and "[4]" in text


def test_no_prefix_cache_keeps_nothing():
    cache = NoPrefixCache()
    assert isinstance(cache, PrefixCache)
    assert cache.match_prefix([1, 2]).slots.numel() == 0
    assert cache.insert([1, 2], slots(10, 11)).prefix_len == 2  # the caller frees all of them
    assert cache.total_size == 0 and cache.evict(10).numel() == 0


# ---- randomized comparison with a brute-force model ----


class Model:
    """Every cached prefix (a tuple) maps to the slot of its last token and to the time it was
    last touched; locks are the list of prefixes held. No tree, no splitting."""

    def __init__(self) -> None:
        self.slot: dict[tuple[int, ...], int] = {}
        self.time: dict[tuple[int, ...], int] = {}
        self.held: list[tuple[object, tuple[int, ...]]] = []  # (node handle, its prefix)
        self.clock = 0

    def longest(self, seq: tuple[int, ...]) -> int:
        k = 0
        while k < len(seq) and seq[: k + 1] in self.slot:
            k += 1
        return k

    def touch(self, seq: tuple[int, ...], k: int) -> None:
        self.clock += 1
        for i in range(1, k + 1):
            self.time[seq[:i]] = self.clock

    def locked(self) -> set[tuple[int, ...]]:
        return {p[:i] for _, p in self.held for i in range(1, len(p) + 1)}

    def eviction_order(self, limit: int) -> list[tuple[int, ...]]:
        """Up to `limit` prefixes in the order LRU eviction takes them, a token at a time: the
        least recently touched unlocked prefix that no cached prefix extends goes first."""
        locked = self.locked()
        remaining = set(self.slot)
        parents = {p[:-1] for p in remaining}
        leaves = {p for p in remaining if p not in parents and p not in locked}
        children = {}
        for p in remaining:
            children[p[:-1]] = children.get(p[:-1], 0) + 1
        order = []
        while leaves and len(order) < limit:
            p = min(leaves, key=lambda q: self.time[q])
            leaves.remove(p)
            order.append(p)
            parent = p[:-1]
            children[parent] -= 1
            if parent and children[parent] == 0 and parent not in locked:
                leaves.add(parent)
        return order


def tree_contents(cache: RadixCache, model: Model) -> dict[tuple[int, ...], int]:
    """Walk the tree checking its structural invariants; return prefix -> slot."""
    held = [p for _, p in model.held]
    found: dict[tuple[int, ...], int] = {}
    evictable = protected = 0
    stack = [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        for first, child in node.children.items():
            assert child.parent is node
            assert len(child.key) >= 1 and child.key[0] == first
            assert child.slots.dtype == torch.int64 and child.slots.shape == (len(child.key),)
            assert child.last_access <= node.last_access or node is cache.root
            full = prefix + child.key
            for i, s in enumerate(child.slots.tolist()):
                p = prefix + child.key[: i + 1]
                assert p not in found
                found[p] = s
                assert model.time[p] == child.last_access  # one time per node, the model's
            expected_locks = sum(1 for p in held if p[: len(full)] == full)
            assert child.lock_ref == expected_locks
            if child.lock_ref:
                protected += len(child.key)
            else:
                evictable += len(child.key)
            stack.append((child, full))
    assert (cache.evictable_size, cache.protected_size) == (evictable, protected)
    return found


class Ledger:
    """Where each slot ever handed to `insert` is: in the tree, back with the caller, or freed."""

    def __init__(self) -> None:
        self.issued: set[int] = set()
        self.caller: set[int] = set()
        self.freed: set[int] = set()

    def free(self, returned: torch.Tensor, model: Model) -> list[tuple[int, ...]]:
        values = returned.tolist()
        assert len(values) == len(set(values)), "a slot returned twice in one call"
        by_slot = {s: p for p, s in model.slot.items()}
        prefixes = []
        for s in values:
            assert s in by_slot, f"slot {s} returned but the cache did not own it"
            assert s not in self.freed
            self.freed.add(s)
            prefixes.append(by_slot[s])
        return prefixes

    def check(self, tree_slots: set[int]) -> None:
        assert not (tree_slots & self.caller) and not (tree_slots & self.freed)
        assert not (self.caller & self.freed)
        assert tree_slots | self.caller | self.freed == self.issued  # nothing lost


def run_random(seed: int, steps: int) -> None:
    rng = random.Random(seed)
    cache = RadixCache()
    model = Model()
    ledger = Ledger()
    fresh = itertools.count(1000)

    def new_slots(n: int) -> list[int]:
        values = [next(fresh) for _ in range(n)]
        ledger.issued.update(values)
        return values

    def random_seq() -> tuple[int, ...]:
        # a small alphabet and short sequences, so prefixes collide all the time
        return tuple(rng.randrange(3) for _ in range(rng.randint(0, 9)))

    def match(seq: tuple[int, ...]):
        result = cache.match_prefix(seq)
        k = model.longest(seq)
        model.touch(seq, k)
        assert result.slots.tolist() == [model.slot[seq[: i + 1]] for i in range(k)]
        assert node_tokens(result.node) == seq[:k]
        assert (result.node is cache.root) == (k == 0)
        return result

    def insert(seq: tuple[int, ...], values: list[int]):
        expected = model.longest(seq)
        result = cache.insert(seq, torch.tensor(values, dtype=torch.int64))
        model.touch(seq, len(seq))
        assert result.prefix_len == expected
        assert node_tokens(result.node) == seq
        for i in range(expected, len(seq)):
            model.slot[seq[: i + 1]] = values[i]
        return result

    def evict(want: int) -> None:
        before = len(cache)
        order = model.eviction_order(limit=before)
        gone = ledger.free(cache.evict(want), model)
        assert not (set(gone) & model.locked()), "a locked slot was evicted"
        # exactly the LRU order, cut at a node boundary at or after `want` tokens
        assert set(gone) == set(order[: len(gone)])
        assert len(gone) >= want or len(gone) == len(order)
        for p in gone:
            del model.slot[p]
            del model.time[p]
        assert len(cache) == before - len(gone)

    for _ in range(steps):
        op = rng.random()
        if 0.25 <= op < 0.52 and len(model.held) >= 8:
            op = 0.6  # a full batch: a request must finish before another can start
        if op < 0.25:  # insert with all-fresh slots: the caller frees its copy of the prefix
            seq = random_seq()
            values = new_slots(len(seq))
            result = insert(seq, values)
            ledger.caller.update(values[: result.prefix_len])
        elif op < 0.40:  # a request: match, lock, extend with fresh slots, move the lock
            seq = random_seq()
            matched = match(seq)
            cache.lock(matched.node)
            model.held.append((matched.node, seq[: len(matched.slots)]))
            full = seq + tuple(rng.randrange(3) for _ in range(rng.randint(0, 4)))
            values = matched.slots.tolist() + new_slots(len(full) - len(matched.slots))
            result = insert(full, values)
            assert result.prefix_len >= len(matched.slots)
            ledger.caller.update(values[len(matched.slots) : result.prefix_len])
            cache.lock(result.node)
            model.held.append((result.node, full))
            cache.unlock(matched.node)
            model.held.remove((matched.node, seq[: len(matched.slots)]))
        elif op < 0.52:  # lock whatever a query matches
            seq = random_seq()
            result = match(seq)
            cache.lock(result.node)
            model.held.append((result.node, node_tokens(result.node)))
        elif op < 0.64:  # a request finishes
            if model.held:
                node, prefix = model.held.pop(rng.randrange(len(model.held)))
                cache.unlock(node)
        elif op < 0.74:  # a plain query
            match(random_seq())
        elif op < 0.95:  # the pool runs short
            evict(rng.randint(0, 12))
        elif op < 0.97:  # unlock of a path nobody locked
            result = match(random_seq())
            if result.node is not cache.root and result.node.lock_ref == 0:
                with pytest.raises(RuntimeError):
                    cache.unlock(result.node)
        elif model.locked():  # a reset while requests run
            with pytest.raises(RuntimeError):
                cache.reset()
        else:
            ledger.free(cache.reset(), model)
            model.slot.clear()
            model.time.clear()

        found = tree_contents(cache, model)
        assert found == model.slot
        assert len(set(found.values())) == len(found), "a slot is owned twice"
        ledger.check(set(found.values()))
        locked = model.locked()
        assert locked <= set(model.slot)  # locked paths are always cached
        assert cache.protected_size == len(locked)
        assert cache.evictable_size == len(model.slot) - len(locked)
        for node, prefix in model.held:
            assert node_tokens(node) == prefix
        if len(cache) > 120:  # keep the tree small enough to check in full
            evict(len(cache) - 60)

    # drain: release every lock, evict everything, and every slot is accounted for
    for node, _ in model.held:
        cache.unlock(node)
    model.held.clear()
    ledger.free(cache.evict(len(cache) + 1), model)
    assert len(cache) == 0
    ledger.check(set())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_match_the_brute_force_model(seed: int):
    run_random(seed, steps=3000)


# ---- cache-aware ordering ----


def test_fcfs_keeps_arrival_order():
    requests = ["a", "b", "c"]
    ordered = order_waiting(requests, {"a": 0, "b": 5, "c": 9}.__getitem__, "fcfs")
    assert ordered == ["a", "b", "c"] and ordered is not requests


def test_lpm_puts_longest_cached_prefix_first_and_is_stable():
    lengths = {"a": 0, "b": 5, "c": 9, "d": 5, "e": 0}
    assert order_waiting(list("abcde"), lengths.__getitem__, "lpm") == list("cbdae")


def test_lpm_falls_back_to_arrival_order_on_a_long_queue():
    calls = []

    def prefix_len(request: int) -> int:
        calls.append(request)
        return request

    requests = list(range(5))
    assert order_waiting(requests, prefix_len, "lpm", fcfs_threshold=4) == requests
    assert calls == []  # no matching at all above the threshold
    assert order_waiting(requests, prefix_len, "lpm", fcfs_threshold=5) == [4, 3, 2, 1, 0]
    assert sorted(calls) == requests  # once per request


def test_unknown_policy_names_the_valid_ones():
    with pytest.raises(ValueError, match="fcfs, lpm"):
        order_waiting([], len, "random")


def test_lpm_over_a_real_cache():
    cache = RadixCache()
    cache.insert([1, 2, 3, 4], slots(10, 11, 12, 13))
    waiting = [(9, 9), (1, 2, 7), (1, 2, 3, 4, 5), (1, 8)]
    ordered = order_waiting(waiting, lambda t: len(cache.match_prefix(t).slots), "lpm")
    assert ordered == [(1, 2, 3, 4, 5), (1, 2, 7), (1, 8), (9, 9)]


def test_freed_slots_do_not_keep_the_rows_they_were_sliced_from():
    """A request's freed tail is a slice of its whole row of slots: the allocator keeps a compact
    copy (a view kept the row, e.g. 32 KB for a 4,000-token cached prompt, until the next merge),
    and joins many small pieces into one."""
    from radixlm.runtime.memory_pool import _MAX_PENDING_PIECES, SlotAllocator

    allocator = SlotAllocator(100_000)
    row = allocator.allocate(4000)
    allocator.free(row[3998:])
    assert allocator._pending[0].untyped_storage().nbytes() == 2 * 8
    for _ in range(_MAX_PENDING_PIECES + 1):
        allocator.free(allocator.allocate(2))
    assert len(allocator._pending) <= _MAX_PENDING_PIECES
    assert allocator.num_free == allocator.capacity - 3998
    assert len(set(allocator.allocate(allocator.num_free).tolist())) == allocator.capacity - 3998
