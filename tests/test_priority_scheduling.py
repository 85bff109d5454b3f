"""Priority scheduling in the engine (SGLang's `enable_priority_scheduling` and a request's
`priority`), with the tiny random model: a much more urgent request preempts a running one,
which resumes and ends with exactly the output it has when run alone; without the option the
same priorities change nothing. The scheduler's rules alone are tests/test_scheduler.py's."""

from __future__ import annotations

import threading

import pytest

LONG = {"max_new_tokens": 200, "ignore_eos": True, "temperature": 0.0}
SHORT = {"max_new_tokens": 8, "ignore_eos": True, "temperature": 0.0}
LOW_PROMPT, HIGH_PROMPT = "Once upon a time", "The capital of France is"


def engine_of(folder: str, **options):
    import radixlm

    # one seat: a second request runs only by preempting the first
    return radixlm.Engine(folder, max_running_requests=1, max_total_tokens=2048, **options)


def race(engine) -> tuple[dict, dict, bool]:
    """Start the low-priority request; once it has output, send the urgent one. Returns both
    results and whether the urgent one finished while the low one was still running."""
    low_started, low_done = threading.Event(), threading.Event()
    results: dict[str, dict] = {}

    def run_low() -> None:
        for snapshot in engine.generate(LOW_PROMPT, LONG, stream=True, priority=0):
            if len(snapshot["output_ids"]) >= 5:
                low_started.set()
            results["low"] = snapshot
        low_done.set()

    thread = threading.Thread(target=run_low)
    thread.start()
    try:
        assert low_started.wait(60), "the low-priority request never started"
        results["high"] = engine.generate(HIGH_PROMPT, SHORT, priority=100)
        overtook = not low_done.is_set()
    finally:
        thread.join(120)
    return results["low"], results["high"], overtook


@pytest.fixture(scope="module")
def priority_engine(tiny_model_folder):
    with engine_of(tiny_model_folder, enable_priority_scheduling=True) as engine:
        yield engine


def test_a_preempted_low_priority_request_resumes_and_ends_as_when_run_alone(priority_engine):
    engine = priority_engine
    alone_low = engine.generate(LOW_PROMPT, LONG)
    alone_high = engine.generate(HIGH_PROMPT, SHORT)
    before = engine.get_stats()["num_priority_preemptions"]
    low, high, overtook = race(engine)
    stats = engine.get_stats()
    assert overtook, "the urgent request waited for the running one to finish"
    assert stats["num_priority_preemptions"] > before
    assert low["meta_info"]["finish_reason"]["type"] == "length"
    assert low["output_ids"] == alone_low["output_ids"]
    assert low["text"] == alone_low["text"]
    assert high["output_ids"] == alone_high["output_ids"]
    # nothing left holding KV: every slot free or in the prefix cache, none locked
    assert stats["radix_cache_protected_tokens"] == 0
    assert (
        stats["kv_pool_free_tokens"] + stats["radix_cache_tokens"]
        == stats["kv_pool_capacity_tokens"]
    )


def test_without_priority_scheduling_a_priority_is_accepted_and_ignored(tiny_model_folder):
    with engine_of(tiny_model_folder) as engine:
        low, high, overtook = race(engine)
        stats = engine.get_stats()
    assert not overtook  # it waited for the seat
    assert stats["num_priority_preemptions"] == 0 and stats["num_preemptions"] == 0
    assert len(low["output_ids"]) == LONG["max_new_tokens"]
    assert len(high["output_ids"]) == SHORT["max_new_tokens"]


def test_a_priority_that_is_not_an_integer_is_refused(priority_engine):
    for bad in ("high", 1.5, True, 2**63):
        with pytest.raises(ValueError, match="priority must be an integer"):
            priority_engine.generate(HIGH_PROMPT, SHORT, priority=bad)
