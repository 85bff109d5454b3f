"""The scheduler alone, driven by a simulated loop (no model): admission grouping under load."""

from __future__ import annotations

import random

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
