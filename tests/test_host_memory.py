"""The engine process's resident memory follows what it holds: the host memory its steps freed
goes back to the system once it is idle (glibc keeps freed heap pages otherwise, and an idle
engine's resident set wandered with the last batch mix), and the KV slots freed last are reused
first (fresh ones would make more of the lazily mapped pool resident with every token served).
tests/test_server_soak.py and benchmarks/soak.py measure the whole effect."""

from __future__ import annotations

import sys
import time

import pytest

import radixlm
from radixlm.runtime import engine_core, host_memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_trim_free_heap_calls_malloc_trim_on_glibc():
    assert host_memory.trim_free_heap() is True


def test_the_engine_gives_memory_back_once_idle_and_never_while_it_works(
    tiny_model_folder, monkeypatch
):
    trims: list[int] = []  # the step count at each trim

    with radixlm.Engine(tiny_model_folder, max_total_tokens=512) as eng:
        core = eng._core
        monkeypatch.setattr(engine_core, "trim_free_heap", lambda: trims.append(core.num_steps))
        time.sleep(1.2)
        assert trims == []  # no step ran since start-up: nothing to give back
        params = {"max_new_tokens": 40, "ignore_eos": True}
        eng.generate(input_ids=[[10 + k, 20, 30] for k in range(4)], sampling_params=params)
        steps = core.num_steps
        deadline = time.monotonic() + 10
        while not trims and time.monotonic() < deadline:
            time.sleep(0.05)
        assert trims == [steps]  # after the work, not during it
        time.sleep(1.2)
        assert trims == [steps]  # once per idle spell
        eng.generate(input_ids=[10, 20, 30], sampling_params=params)
        deadline = time.monotonic() + 10
        while len(trims) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert trims == [steps, core.num_steps]


# ---- the KV pool's slots: freed ones first -------------------------------------------------------


def test_the_allocator_hands_out_the_slots_freed_last_before_fresh_ones():
    from radixlm.runtime.memory_pool import SlotAllocator

    alloc = SlotAllocator(10_000)
    first = alloc.allocate(30)
    alloc.free(first[:10])
    alloc.free(first[10:20])
    again = alloc.allocate(15)  # the newest piece whole, then the tail of the one before
    assert again.tolist() == [*range(11, 21), *range(6, 11)]
    assert alloc.allocate(5).tolist() == list(range(1, 6))
    assert alloc.allocate(2).tolist() == [31, 32]  # none freed left: fresh ones
    assert alloc.num_free == alloc.capacity - 32  # 30 + 22 taken, 20 given back
    with pytest.raises(RuntimeError, match="exhausted"):
        alloc.allocate(alloc.num_free + 1)
    assert alloc.allocate(0).numel() == 0


def test_sequential_requests_reuse_the_same_kv_slots(tiny_model_folder):
    """A pool's pages become resident when first written (on a CPU): requests one after another
    must not walk through the whole pool, or the engine's RSS grows with every token served."""
    with radixlm.Engine(tiny_model_folder, max_total_tokens=4096, disable_radix_cache=True) as eng:
        params = {"max_new_tokens": 10, "ignore_eos": True}
        for k in range(30):
            eng.generate(input_ids=[100 + k + i for i in range(60)], sampling_params=params)
        untouched = len(eng._core.allocator._free)
    assert untouched >= 4096 - 2 * 70  # (30 requests of 70 tokens would have taken 2,100)


# ---- the KV pool's slots a burst used: released when idle -------------------------------------


def test_the_allocator_reclaims_the_free_slots_above_the_highest_in_use():
    from radixlm.runtime.memory_pool import SlotAllocator

    alloc = SlotAllocator(1_000)
    assert alloc.reclaim_free_tail()[0] == alloc.reclaim_free_tail()[1]  # nothing used yet
    burst = alloc.allocate(300)  # slots 1..300
    keep = burst[:40]
    alloc.free(burst[200:])
    alloc.free(burst[40:200])
    free_before = alloc.num_free
    assert alloc.reclaim_free_tail() == (41, 301)  # above slot 40 (in use), up to the burst's top
    assert alloc.num_free == free_before
    assert alloc.allocate(5).tolist() == [41, 42, 43, 44, 45]  # handed out from the bottom again
    alloc.free(keep[:20])  # slots 1..20 free, 21..40 and 41..45 in use: nothing above to reclaim
    assert alloc.reclaim_free_tail() == (46, 46)
    # the runs of free slots between those in use (the pool releases the pages inside them)
    assert alloc.free_runs(1) == [(1, 21)]
    middle = alloc.allocate(50)  # 20 freed ones (1..20), then fresh 46..75
    alloc.free(middle[25:40])  # slots 51..65 free again, between 46..50 and 66..75 in use
    assert alloc.free_runs(1) == [(51, 66)] and alloc.free_runs(16) == []
    every = alloc.allocate(alloc.num_free)  # the whole pool, each slot once
    in_use = {*range(1, 51), *range(66, 76)} - set(middle[25:40].tolist())
    assert sorted(every.tolist()) == sorted(set(range(1, 1_000)) - in_use)


def test_the_kv_pool_releases_the_memory_of_free_slots_once_idle(tiny_model_folder):
    """After a burst that used many KV slots (every prompt computed, none cached), the engine,
    once idle, gives those slots' pages back: they read zero again, and the resident set shrinks
    by about their size, where before it kept every page the burst touched."""
    import torch

    from radixlm.runtime.memory_pool import KVPool

    pool = KVPool(40_001, 2, 4, 64, torch.float32, torch.device("cpu"))
    pool._buffer[:, :, 1:].fill_(1.0)  # every slot touched: 40,000 x 2 KiB = 78 MiB resident
    before = _rss()
    released = pool.release_slots(1_000, 40_001)
    assert released > 0.9 * 39_001 * pool.bytes_per_slot(2, 4, 64, torch.float32)
    assert before - _rss() > 0.8 * released
    assert float(pool.k[1][5_000:39_000].abs().sum()) == 0.0  # (released: zero when read)
    assert float(pool.k[0][1:1_000].sum()) == 999 * 4 * 64  # below `first`: untouched

    with radixlm.Engine(
        tiny_model_folder, max_total_tokens=20_000, disable_radix_cache=True
    ) as eng:  # fmt: skip
        core = eng._core
        prompts = [[10 + (k * 7 + j) % 900 for j in range(400)] for k in range(32)]
        eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 2})
        assert len(core.allocator._free) < core.allocator.capacity - 2_000  # (the burst's)
        deadline = time.monotonic() + 10
        while len(core.allocator._free) != core.allocator.capacity and time.monotonic() < deadline:
            time.sleep(0.1)
        # idle: every slot the burst used is free and back among the never-used ones
        assert len(core.allocator._free) == core.allocator.capacity == core.allocator.num_free
    # with the prefix cache on, what it holds stays until it is flushed; then all comes back
    with radixlm.Engine(tiny_model_folder, max_total_tokens=20_000) as eng:
        core = eng._core
        eng.generate(input_ids=prompts[:8], sampling_params={"max_new_tokens": 2})
        assert eng.get_stats()["radix_cache_tokens"] > 3_000
        assert eng.flush_cache()
        assert len(core.allocator._free) == core.allocator.capacity == core.allocator.num_free


def _rss() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
