"""The engine gives the host memory its steps freed back to the system once it is idle (glibc
keeps freed heap pages otherwise, and an idle engine's resident set wandered with the last batch
mix: tests/test_server_soak.py measures the whole effect)."""

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
