"""The scheduler alone, driven by a simulated loop (no model): admission grouping under load."""

from __future__ import annotations

import random

import pytest
import torch

from radixlm.protocol.sampling_params import SamplingParams
from radixlm.radix_cache.base import NoPrefixCache
from radixlm.runtime.cache_manager import CacheManager
from radixlm.runtime.memory_pool import ReqToTokenPool, SlotAllocator
from radixlm.runtime.request import Req
from radixlm.runtime.scheduler import Scheduler


def make_scheduler(max_running: int, delay: int) -> Scheduler:
    rows = ReqToTokenPool(max_running + 1, 1024, torch.device("cpu"))
    cache = CacheManager(SlotAllocator(100_000), rows, NoPrefixCache())
    return Scheduler(
        cache, max_running_requests=max_running, chunked_prefill_size=4096,
        schedule_policy="fcfs", max_admission_delay=delay,
    )  # fmt: skip


def make_req(i: int, rng: random.Random) -> Req:
    params = SamplingParams(max_new_tokens=rng.randint(5, 40), ignore_eos=True)
    return Req(f"r{i}", [rng.randrange(1000) for _ in range(rng.randint(4, 30))], params, 0, None)


def simulate(max_running: int, delay: int, num_reqs: int = 200) -> dict:
    """Run every request to its length, a token a step; count steps that mix prompt chunks with
    decodes, and the longest run of steps that admitted nobody while a seat was free."""
    rng = random.Random(0)
    sched = make_scheduler(max_running, delay)
    reqs = [make_req(i, rng) for i in range(num_reqs)]
    for r in reqs:
        sched.add(r)
    steps = mixed = 0
    streak = worst = 0
    seat_free = False  # before this step: a seat free and a request waiting
    while sched.has_work():
        plan = sched.schedule()
        steps += 1
        assert plan, "a step with work must plan something"
        prompt_chunks = [it for it in plan if it.start < len(it.req.input_ids)]
        decodes = [it for it in plan if it.start >= len(it.req.input_ids)]
        mixed += bool(prompt_chunks) and bool(decodes)
        admitted = any(it.start == 0 for it in prompt_chunks)
        streak = 0 if admitted or not seat_free else streak + 1
        worst = max(worst, streak)
        for it in plan:
            if it.samples:
                it.req.output_ids.append(1)
                if len(it.req.output_ids) >= it.req.params.max_new_tokens:
                    sched.remove(it.req)
        seat_free = bool(sched.waiting) and len(sched.running) < max_running
    assert all(len(r.output_ids) == r.params.max_new_tokens for r in reqs)
    return {"steps": steps, "mixed": mixed, "worst_wait": worst}


def test_under_load_admissions_are_grouped_and_wait_a_bounded_number_of_steps():
    at_once = simulate(max_running=32, delay=0)
    grouped = simulate(max_running=32, delay=8)
    # far fewer steps mix prompt chunks into the decodes (those cannot replay a decode graph)
    assert grouped["mixed"] * 2 <= at_once["mixed"], (grouped, at_once)
    assert grouped["steps"] <= at_once["steps"] * 1.25, (grouped, at_once)
    # with a seat free, admission is put off for at most the delay
    assert 0 < grouped["worst_wait"] <= 8, grouped
    assert at_once["worst_wait"] == 0, at_once


def test_under_light_load_a_request_is_admitted_at_once():
    rng = random.Random(1)
    sched = make_scheduler(max_running=32, delay=100)
    first = [make_req(i, rng) for i in range(4)]  # 4 running: under a quarter of 32
    for r in first:
        sched.add(r)
    sched.schedule()
    assert len(sched.running) == 4
    late = make_req(99, rng)
    sched.add(late)
    plan = sched.schedule()
    assert late in [it.req for it in plan]


# ---- priorities (SGLang's enable_priority_scheduling) ---------------------------------------


def priority_scheduler(max_running: int, slots: int = 100_000, **options) -> Scheduler:
    rows = ReqToTokenPool(max_running + 1, 1024, torch.device("cpu"))
    cache = CacheManager(SlotAllocator(slots), rows, NoPrefixCache())
    return Scheduler(
        cache, max_running_requests=max_running, chunked_prefill_size=4096,
        schedule_policy="fcfs", max_admission_delay=0, **options,
    )  # fmt: skip


def prioritized(rid: str, priority: int | None, prompt_len: int = 8, max_new: int = 20) -> Req:
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    req = Req(rid, list(range(1, prompt_len + 1)), params, 0, None)
    req.priority = priority
    return req


def step(sched: Scheduler) -> list[Req]:
    """Plan one step and apply it as the engine would (a token for each request that samples;
    a request at its length finishes); the requests the step computed."""
    plan = sched.schedule()
    for item in plan:
        if item.samples:
            item.req.output_ids.append(7)
            if len(item.req.output_ids) >= item.req.params.max_new_tokens:
                sched.remove(item.req)
    return [item.req for item in plan]


@pytest.mark.parametrize(
    "options, order",
    [
        ({}, "abcd"),  # no priority scheduling: the priorities are ignored (arrival order)
        ({"enable_priority_scheduling": True}, "bcad"),  # larger values first
        (
            {"enable_priority_scheduling": True, "schedule_low_priority_values_first": True},
            "acbd",
        ),
    ],
)
def test_waiting_requests_are_admitted_most_urgent_first(options, order):
    # one seat: each is admitted when the one before it finishes. "d" has no priority: the
    # least urgent of all, whichever way the values go
    sched = priority_scheduler(max_running=1, **options)
    for rid, priority in (("a", 1), ("b", 50), ("c", 30), ("d", None)):
        sched.add(prioritized(rid, priority))
    admitted: list[str] = []
    while sched.has_work():
        for req in step(sched):
            if req.rid not in admitted:
                admitted.append(req.rid)
    assert "".join(admitted) == order
    assert sched.num_preemptions == 0


@pytest.mark.parametrize("low_first", [False, True])
def test_a_much_more_urgent_request_preempts_the_least_urgent_newest_running_one(low_first):
    sign = -1 if low_first else 1
    sched = priority_scheduler(
        max_running=2, enable_priority_scheduling=True, schedule_low_priority_values_first=low_first
    )
    old, new = prioritized("old", 0), prioritized("new", 0)
    sched.add(old)
    sched.add(new)
    step(sched)
    step(sched)
    assert sched.running == [old, new]
    # more urgent, but within the threshold (10): waits for a seat
    close = prioritized("close", sign * 10)
    sched.add(close)
    step(sched)
    assert close in sched.waiting and sched.num_priority_preemptions == 0
    # past the threshold: the newest of the equally urgent running requests makes way at once
    urgent = prioritized("urgent", sign * 11)
    sched.add(urgent)
    computed = step(sched)
    assert urgent in computed and urgent in sched.running
    assert new in sched.waiting and new.num_preemptions == 1
    assert old in sched.running
    assert sched.num_priority_preemptions == 1
    # the preempted request waits behind the more urgent ones, then resumes and completes
    while sched.has_work():
        step(sched)
    for req in (old, new, close, urgent):
        assert len(req.output_ids) == req.params.max_new_tokens


def test_without_priority_scheduling_nothing_is_preempted_for_a_priority():
    sched = priority_scheduler(max_running=1)
    low = prioritized("low", 0)
    sched.add(low)
    step(sched)
    sched.add(prioritized("high", 1000))
    step(sched)
    assert sched.running == [low] and sched.num_preemptions == 0


def test_preemption_for_memory_takes_only_what_the_urgent_request_needs():
    # seats enough, KV memory short: three low-priority requests of 100 tokens hold 300 slots
    sched = priority_scheduler(max_running=8, slots=420, enable_priority_scheduling=True)
    lows = [prioritized(f"low{i}", i, prompt_len=100, max_new=60) for i in range(3)]
    for r in lows:
        sched.add(r)
    step(sched)
    assert set(sched.running) == set(lows)
    urgent = prioritized("urgent", 100, prompt_len=150, max_new=5)
    sched.add(urgent)
    computed = step(sched)
    assert urgent in computed
    # one victim freed enough: the least urgent (priority 0) went, the others kept running
    assert [r.rid for r in sched.waiting] == ["low0"]
    assert sched.num_priority_preemptions == 1
    while sched.has_work():
        step(sched)
    assert all(len(r.output_ids) == r.params.max_new_tokens for r in [*lows, urgent])


def test_a_request_that_preemption_cannot_make_room_for_preempts_nothing():
    # the running request is not outranked enough (threshold 10): no room can be made
    sched = priority_scheduler(max_running=1, enable_priority_scheduling=True)
    running = prioritized("running", 5)
    sched.add(running)
    step(sched)
    sched.add(prioritized("urgent", 15))
    step(sched)
    assert sched.running == [running] and sched.num_preemptions == 0


def test_a_requests_id_slices_are_its_all_ids_slices():
    req = Req("s", [5, 6, 7], SamplingParams(max_new_tokens=8), 0, None)
    for out in ([], [8], [8, 9, 10]):
        req.output_ids = list(out)
        total = len(req.all_ids)
        for start in range(total + 2):
            assert req.ids_slice(start) == req.all_ids[start:]
            for end in range(start, total + 3):  # (past the end too: a token still pending)
                assert req.ids_slice(start, end) == req.all_ids[start:end], (out, start, end)


def test_a_steps_truncations_together_free_what_one_by_one_frees():
    """`truncate_many` (a verify step's rejected draft positions, freed together) leaves every
    request's length and the free slots as `truncate`, a request at a time, does; a length
    past a request's end frees nothing of it, one below its cached prefix is refused."""

    class R:
        def __init__(self, row: int, kv_len: int, locked_len: int) -> None:
            self.pool_row, self.kv_len, self.locked_len = row, kv_len, locked_len

    def setup():
        rows = ReqToTokenPool(6, 64, torch.device("cpu"))
        allocator = SlotAllocator(1000)
        cache = CacheManager(allocator, rows, NoPrefixCache())
        reqs = []
        for n in (12, 9, 20, 5):
            req = R(rows.allocate(), n, locked_len=2)
            rows.write(req.pool_row, 0, allocator.allocate(n))
            reqs.append(req)
        return cache, allocator, reqs

    lengths = [7, 9, 3, 40]
    one, one_slots, one_reqs = setup()
    for req, n in zip(one_reqs, lengths):
        one.truncate(req, n)
    many, many_slots, many_reqs = setup()
    many.truncate_many(many_reqs, lengths)
    assert [r.kv_len for r in many_reqs] == [r.kv_len for r in one_reqs] == [7, 9, 3, 5]
    assert many_slots.num_free == one_slots.num_free == 999 - 7 - 9 - 3 - 5
    freed = set(many_slots.allocate(5 + 17).tolist())  # (the freed ones come first)
    assert freed == set(one_slots.allocate(5 + 17).tolist())
    kept = {s for r in many_reqs for s in many.rows.read(r.pool_row, r.kv_len).tolist()}
    assert len(freed) == 22 and freed.isdisjoint(kept)
    with pytest.raises(ValueError, match="cached prefix"):
        many.truncate_many(many_reqs[:1], [1])


def test_a_steps_several_rows_are_written_at_once_as_one_by_one():
    """`write_many` (a verify step's requests, one copy to the device table) leaves the host
    and the device table as a `write` a row does; here the two tables are apart, as on a GPU."""
    rng = torch.Generator().manual_seed(0)
    one, many = (ReqToTokenPool(6, 64, torch.device("cpu")) for _ in range(2))
    for pool in (one, many):
        pool.host = pool.table.clone()  # (the host copy apart from the table, as on a GPU)
    rows, starts, counts = [4, 1, 3], [10, 0, 37], [3, 1, 8]
    slots = torch.randint(0, 10_000, (sum(counts),), generator=rng)
    at = 0
    for row, start, n in zip(rows, starts, counts):
        one.write(row, start, slots[at : at + n])
        at += n
    many.write_many(rows, starts, counts, slots)
    assert torch.equal(one.host, many.host) and torch.equal(one.table, many.table)
    assert many.table.count_nonzero() > 0


def test_the_speculation_gate_is_told_whether_a_prompt_chunk_may_join_the_step():
    """`drafting(batch, alone)`: alone is false while a prompt is being computed or a waiting
    request may be admitted, and true once every seat is taken, however many wait (an
    overloaded server's full batch must still be measurable)."""
    rng = random.Random(0)
    sched = make_scheduler(max_running=2, delay=0)
    told: list[tuple[int, bool]] = []
    sched.drafter = lambda req: []
    sched.drafting = lambda batch, alone: told.append((batch, alone)) or False
    for i in range(5):
        sched.add(make_req(i, rng))
    for _ in range(6):
        for it in sched.schedule():
            if it.samples:
                it.req.output_ids.append(1)
    assert sched.waiting and len(sched.running) == 2
    assert told and told[-1] == (2, True), told
    # a seat free again, a request waiting: not alone
    sched.remove(sched.running[0])
    sched.schedule()
    assert told[-1] == (1, False), told
