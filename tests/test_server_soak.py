"""The server soaked: thousands of mixed requests (streams and not, grammars, n > 1, clients that
vanish, deadlines, priorities, bad requests) against a small KV pool, over HTTP on loopback. After
it nothing may be left behind: no 5xx on the way, every KV slot free or in the prefix cache, no
prefix-cache node locked, the processes' memory flat, and no Python object kept per request.
benchmarks/soak.py is the workload and its checks; these tests run it on the tiny model.

`make test` soaks with 1,000 requests; the full 5,000 (issue #22's proof, about three minutes on
two cores) run where RADIXLM_FULL_SOAK=1 is set, as `make soak` does."""

from __future__ import annotations

import asyncio
import gc
import os
import time
import types
import weakref
from collections import Counter
from types import SimpleNamespace

import httpx
import pytest

from benchmarks import soak
from benchmarks.serving import start_server, stop_server

FULL_SOAK = os.environ.get("RADIXLM_FULL_SOAK") == "1"
# The same workload, pool and checks either way: the shorter soak's prompts still come to over
# 50 times the pool (about 43,000 tokens), and it too ends each of its eleven rounds (the warm-up
# and ten tenths) idle, with the KV whole and the RSS read.
SOAK_REQUESTS = 5000 if FULL_SOAK else 1000
# The idle RSS may grow by less than this from the warm-up's end. The allocator's state moves it
# by tens of MB whatever the count of requests (the short soak once read the engine at +5.5% on
# CI, 601 -> 634 MiB; here it stays within 1-2%): a share of the RSS that only the full soak's
# 5,000 requests can hold to 5%. The short soak's 10% still catches a leak of a logits row
# (49,152 floats, about 200 KB) a request: 160 MB over its 800 requests.
MAX_RSS_GROWTH = 0.05 if FULL_SOAK else 0.10


@pytest.mark.slow
def test_mixed_requests_on_a_small_kv_pool_leave_no_5xx_no_leak_and_flat_memory(
    tiny_model_folder, tmp_path
):
    requests = SOAK_REQUESTS
    capacity = 600  # tokens: a fraction of what 24 clients ask for at once
    with open(tmp_path / "server.log", "w") as log:
        proc, url = start_server(
            SimpleNamespace(engine_in_process=False),
            soak.serve_options(tiny_model_folder, capacity),
            log,
        )
        try:
            engine_pid = httpx.get(url + "/server_info", timeout=30).json()["engine_pid"]
            pids = {"server": proc.pid, "engine": engine_pid}
            result = soak.soak(
                url, pids, requests=requests, concurrency=24, seed=0, max_growth=MAX_RSS_GROWTH
            )
        finally:
            stop_server(proc)
    # the checks of the soak itself: no 5xx, each answer as its kind expects, KV whole and
    # unlocked, nothing running or waiting, RSS growth under MAX_RSS_GROWTH in both processes
    assert result.failures == [], result.failures
    kinds = Counter(o.kind for o in result.outcomes)
    assert set(kinds) == {name for name, _ in soak.KINDS}
    assert len(result.outcomes) == requests
    statuses = Counter(o.status for o in result.outcomes)
    assert statuses[400] == kinds["bad"]
    assert statuses[None] > (kinds["drop_stream"] + kinds["give_up"]) / 2  # most cut short
    finish = Counter(f for o in result.outcomes if o.kind == "deadline" for f in o.finish)
    assert finish["abort"] > kinds["deadline"] / 2  # most ran into their deadline
    stats = result.stats_after
    assert stats["kv_pool_capacity_tokens"] == capacity
    # the pool was too small for the load: requests were preempted (for priority too) and the
    # prefix cache, which served a share of the prompts, evicted many times its size
    assert stats["num_preemptions"] > 0 and stats["num_priority_preemptions"] > 0
    assert stats["cached_tokens"] > 0 and stats["prompt_tokens"] > 50 * capacity


def census() -> tuple[Counter, set[int]]:
    """The objects the collector tracks, counted by type, and their ids; but the entries of the
    `abc` module's caches (which classes are or are not instances of an abstract class: a weak
    reference to the class and a bound `_destroy` a pair), bounded by the classes there are, and
    filled by whichever code paths the requests' timing takes first."""
    gc.collect()
    objects = [o for o in gc.get_objects() if not _abc_cache_entry(o)]
    return Counter(type(o).__qualname__ for o in objects), {id(o) for o in objects}


def _abc_cache_entry(obj: object) -> bool:
    if type(obj) is weakref.ref:
        obj = obj.__callback__
    return (
        type(obj) is types.BuiltinMethodType
        and obj.__name__ == "_destroy"
        and type(obj.__self__) is weakref.ref
    )


def growth(before: Counter) -> dict[str, int]:
    """The types of which the collector now tracks over 50 objects more than in `before`."""
    after, _ = census()
    return {name: after[name] - before[name] for name in after if after[name] - before[name] > 50}


def described(obj: object) -> str:
    """What an object is, for a failure's message: a weak reference with its referent and
    callback, a bound built-in with the object it is bound to."""
    if isinstance(obj, weakref.ref):
        return f"weakref to {type(obj()).__qualname__} (callback {obj.__callback__!r:.80})"
    bound = getattr(obj, "__self__", None)
    if bound is not None:
        return f"{obj!r:.60} bound to {type(bound).__qualname__}"
    return f"{obj!r:.100}"


def new_objects(before_ids: set[int], types: set[str]) -> list[str]:
    """Descriptions of the tracked objects of `types` not there when `before_ids` was taken."""
    gc.collect()
    found = Counter(
        described(o)
        for o in gc.get_objects()
        if type(o).__qualname__ in types and id(o) not in before_ids
    )
    return [f"{n} x {what}" for what, n in found.most_common(12)]


@pytest.mark.slow
def test_mixed_requests_keep_no_python_object_per_request(tiny_model_folder):
    """The engine and the server in this process: after a warm-up, 600 more mixed requests
    leave no more objects of any type than a handful (a leak of one object a request would add
    600), and the tables of requests in flight are empty."""
    import radixlm
    from tests.live_server import serve_in_thread, wait_idle

    specs = soak.workload(1100, seed=3, max_new=16)
    with radixlm.Engine(
        tiny_model_folder, max_total_tokens=600, enable_priority_scheduling=True
    ) as engine:
        with serve_in_thread(engine) as url:
            asyncio.run(soak.run_requests(url, specs[:500], 24))
            wait_idle(engine.get_stats, 60)
            time.sleep(1.5)
            before, before_ids = census()
            outcomes = asyncio.run(soak.run_requests(url, specs[500:], 24))
            wrong = [o for o in outcomes if o.problem or (o.status or 0) >= 500]
            del outcomes  # (the test's own objects, one a request)
            wait_idle(engine.get_stats, 60)
            time.sleep(1.5)
            grown = growth(before)
            if grown:  # settled yet? (on a loaded machine connections may still be closing)
                time.sleep(5)
                grown = growth(before)
            new = new_objects(before_ids, set(grown)) if grown else []
        core = engine._core
        assert not core.output.reqs and not core.output.sinks and not core.output.progress
    assert wrong == []
    assert grown == {}, (grown, new)


# ---- the soak's own checks can fail ------------------------------------------------------------


def spec_of(kind: str, **body) -> soak.Spec:
    return soak.Spec(kind, "/generate", body)


def generated(text: str, reason) -> str:
    import json

    return json.dumps({"text": text, "meta_info": {"finish_reason": reason}})


@pytest.mark.parametrize(
    "spec, status, text, problem",
    [
        (spec_of("plain"), 500, "boom", "answered 500"),
        (spec_of("plain"), 503, "busy", "answered 503"),
        (spec_of("bad"), 200, generated("x", "stop"), "a bad request answered 200"),
        (spec_of("plain"), 200, generated("x", {"type": "abort"}), "aborted though nobody"),
        (
            spec_of("regex", sampling_params={"regex": soak.REGEX}),
            200,
            generated("perhaps", {"type": "stop"}),
            "off the regex",
        ),
        (
            spec_of("json", sampling_params={"json_schema": "{}"}),
            200,
            generated("{oops", {"type": "stop"}),
            "not JSON",
        ),
        (
            spec_of("deadline", request_timeout=0.1),
            200,
            generated("x", {"type": "abort", "message": "aborted by /abort_request"}),
            "without its reason",
        ),
    ],
)
def test_the_soak_flags_an_answer_its_kind_does_not_expect(spec, status, text, problem):
    outcome = soak.judge(spec, status, text)
    assert outcome.problem is not None and problem in outcome.problem


def test_the_soak_accepts_the_answers_its_kinds_expect():
    regex = spec_of("regex", sampling_params={"regex": soak.REGEX})
    assert soak.judge(regex, 200, generated("maybe 12", {"type": "stop"})).problem is None
    assert soak.judge(regex, 200, generated("ye", {"type": "length"})).problem is None
    assert soak.judge(spec_of("bad"), 400, "{}").problem is None
    deadline = spec_of("deadline", request_timeout=0.1)
    reason = {"type": "abort", "message": "the request timed out after 0.1 s"}
    assert soak.judge(deadline, 200, generated("x", reason)).problem is None


def test_the_workload_is_reproducible_and_mixes_every_kind():
    a, b = soak.workload(400, seed=1, max_new=8), soak.workload(400, seed=1, max_new=8)
    assert [(s.kind, s.body) for s in a] == [(s.kind, s.body) for s in b]
    assert {s.kind for s in a} == {name for name, _ in soak.KINDS}
    streamed = [s for s in a if s.stream]
    assert streamed and all(s.body.get("stream") is True for s in streamed)
