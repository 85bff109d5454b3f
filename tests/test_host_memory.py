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
