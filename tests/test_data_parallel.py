"""Data parallelism (--dp-size): the router's choices, the replicas' statistics merged, and two
tiny engines behind one app: requests of one prefix group land on one replica, outputs are a
single engine's."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from radixlm.protocol.stats import EngineStats
from radixlm.server.data_parallel import (
    BLOCK_TOKENS,
    DataParallelBackend,
    PrefixRouter,
    merge_stats,
    prefix_hashes,
)


def group(seed: int, n: int, shared: int = 3 * BLOCK_TOKENS) -> list[list[int]]:
    """n prompts sharing a prefix of `shared` tokens, each with its own tail."""
    prefix = [1000 + 97 * seed + i for i in range(shared)]
    return [prefix + [5000 + 31 * seed + 7 * j + k for k in range(5)] for j in range(n)]


def test_prefix_hashes_are_per_whole_block_and_chained():
    ids = list(range(2 * BLOCK_TOKENS + 3))
    hashes = prefix_hashes(ids)
    assert len(hashes) == 2
    assert prefix_hashes(ids[:BLOCK_TOKENS]) == hashes[:1]
    other = [99] + ids[1:]  # the first block differs: so does every prefix after it
    assert not set(prefix_hashes(other)) & set(hashes)


def test_cache_aware_keeps_a_prefix_group_on_one_replica_and_spreads_new_ones():
    router = PrefixRouter(2)
    a, b = group(1, 4), group(2, 4)
    first_a = router.choose(a[0])
    router.in_flight[first_a] += 1  # (it is running there)
    first_b = router.choose(b[0])
    assert first_b != first_a  # a new prefix goes to the least loaded replica
    router.in_flight[first_b] += 1
    for prompt in a[1:]:
        assert router.choose(prompt) == first_a
    for prompt in b[1:]:
        assert router.choose(prompt) == first_b
    assert router.matched_blocks(first_a, a[0]) == 3 and router.matched_blocks(first_b, a[0]) == 0


def test_cache_aware_gives_way_to_a_far_less_loaded_replica():
    router = PrefixRouter(2, balance_abs_threshold=4)
    prompts = group(3, 2)
    home = router.choose(prompts[0])
    router.in_flight[home] = 4
    assert router.choose(prompts[1]) == home  # busier by the threshold: still worth its cache
    router.in_flight[home] = 5
    assert router.choose(prompts[1]) == 1 - home


def test_round_robin_and_shortest_queue():
    rr = PrefixRouter(3, "round_robin")
    assert [rr.choose([1] * 20) for _ in range(4)] == [0, 1, 2, 0]
    sq = PrefixRouter(3, "shortest_queue")
    sq.in_flight[:] = [2, 0, 1]
    assert sq.choose(group(1, 1)[0]) == 1


def test_the_router_forgets_the_oldest_prefixes_past_its_bound():
    router = PrefixRouter(1, max_blocks=4)
    old, new = group(4, 1)[0], group(5, 1)[0]  # three blocks each
    router.choose(old)
    router.choose(new)
    assert router.matched_blocks(0, new) == 3 and router.matched_blocks(0, old) == 0


def test_a_bad_method_or_size_says_what_to_use():
    with pytest.raises(ValueError, match="use one of cache_aware, round_robin, shortest_queue"):
        PrefixRouter(2, "random")
    with pytest.raises(ValueError, match="at least 1"):
        PrefixRouter(0)


def test_merged_stats_sum_counts_and_recompute_ratios():
    hist = {"buckets": [0.1, 1.0], "counts": [1, 0, 2], "sum": 4.0, "count": 3}
    a = EngineStats(
        num_running_reqs=2, prompt_tokens=100, cached_tokens=50, cache_hit_rate=0.5,
        spec_verify_ct=10, spec_num_proposed_drafts=40, spec_num_correct_drafts=20,
        spec_accept_length=3.0, spec_accept_rate=0.5, grammar_compile_seconds=hist,
    )  # fmt: skip
    b = EngineStats(
        num_running_reqs=1, prompt_tokens=300, cached_tokens=0, cache_hit_rate=0.0,
        spec_verify_ct=30, spec_num_proposed_drafts=60, spec_num_correct_drafts=15,
        spec_accept_length=1.5, spec_accept_rate=0.25, grammar_compile_seconds=hist,
    )  # fmt: skip
    merged = merge_stats([a, b])
    assert merged.num_running_reqs == 3 and merged.prompt_tokens == 400
    assert merged.cache_hit_rate == pytest.approx(50 / 400)
    assert merged.spec_verify_ct == 40 and merged.spec_accept_rate == pytest.approx(35 / 100)
    assert merged.spec_accept_length == pytest.approx((30 + 45) / 40)
    assert merged.grammar_compile_seconds["counts"] == [2, 0, 4]
    assert merge_stats([EngineStats(), EngineStats()]).spec_verify_ct is None  # (off: absent)


def test_two_tiny_replicas_behind_one_app(tiny_model_folder):
    from fastapi.testclient import TestClient

    import radixlm
    from radixlm.server.app import create_app
    from radixlm.server.backend import LocalEngineBackend

    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    prompts = group(6, 3) + group(7, 3)
    with radixlm.Engine(tiny_model_folder) as single:
        want = [single.generate(input_ids=p, sampling_params=params)["output_ids"] for p in prompts]
    engines = [radixlm.Engine(tiny_model_folder) for _ in range(2)]
    try:
        backend = DataParallelBackend([LocalEngineBackend(e) for e in engines])
        with TestClient(create_app(backend, owns_engine=False)) as client:
            got = []
            for p in prompts:  # one at a time: each group's first finds the replicas idle
                r = client.post("/generate", json={"input_ids": p, "sampling_params": params})
                assert r.status_code == 200, r.text
                got.append(r.json()["output_ids"])
            info = client.get("/get_server_info").json()
            assert client.post("/flush_cache").status_code == 200
        per_replica = [e.get_stats() for e in engines]
    finally:
        for e in engines:
            e.shutdown()
    assert got == want
    assert info["dp_size"] == 2 and info["load_balance_method"] == "cache_aware"
    assert info["internal_states"][0]["prompt_tokens"] == sum(s.prompt_tokens for s in per_replica)
    # each group on one replica: its later prompts found the shared prefix cached there
    assert sorted(backend.routed) == [3, 3]
    assert [s.cached_tokens for s in per_replica] == [2 * 3 * BLOCK_TOKENS] * 2
    assert all(s.radix_cache_tokens == 0 for s in per_replica)  # both flushed


def test_dp_size_options_are_checked(monkeypatch):
    from radixlm import cli

    args = argparse.Namespace(dp_size=2, engine_in_process=True, load_balance_method="cache_aware")
    monkeypatch.setattr(cli, "_engine_kwargs", lambda a: {})
    with pytest.raises(ValueError, match="drop --engine-in-process"):
        cli._start_replicas(args)
    args.engine_in_process = False
    monkeypatch.setattr(cli, "_engine_kwargs", lambda a: {"tp_size": 2, "nnodes": 2})
    with pytest.raises(ValueError, match="--dp-size with --nnodes or --dist-init-addr"):
        cli._start_replicas(args)
    assert cli._replica_devices(3, "cpu") == ["cpu"] * 3
    with pytest.raises(ValueError, match="places replica i on GPU i"):
        cli._replica_devices(2, "cuda:1")
    # replica i's ranks (tensor-parallel ranks x stages) on the GPUs from i x that onwards
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert cli._replica_devices(2, None, 2) == ["cuda:0", "cuda:2"]
    assert cli._replica_devices(4, None) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    with pytest.raises(
        ValueError, match="--dp-size 3 needs 6 GPUs, 2 a replica; this machine has 4"
    ):
        cli._replica_devices(3, None, 2)


def test_a_replica_that_fails_to_start_stops_the_others(monkeypatch):
    from radixlm import cli
    from radixlm.server import engine_process

    started, stopped = [], []

    class Fake:
        def __init__(self, kwargs, log_level):
            if len(started) == 1:
                started.append(None)
                raise RuntimeError("out of memory on the second")
            started.append(self)

        def shutdown(self):
            stopped.append(self)

    monkeypatch.setattr(engine_process, "EngineProcessBackend", Fake)
    monkeypatch.setattr(cli, "_engine_kwargs", lambda a: {"device": "cpu"})
    args = argparse.Namespace(
        dp_size=2, engine_in_process=False, load_balance_method="cache_aware", log_level="info"
    )
    with pytest.raises(cli._EngineStartFailed, match="out of memory"):
        cli._start_replicas(args)
    assert stopped == [s for s in started if s is not None] and len(stopped) == 1


def test_a_stream_closed_early_is_no_longer_counted_in_flight():
    class Replica:
        async def stream(self, input_ids, sampling_params, **kw):
            async def gen():
                for i in range(3):
                    yield {"output_ids": [i]}

            return gen()

    for name in ("tokenize", "decode", "token_texts", "render_chat"):
        setattr(Replica, name, lambda self, *a, **k: None)
    backend = DataParallelBackend([Replica(), Replica()])

    async def run():
        stream = await backend.stream(group(8, 1)[0], {})
        assert sum(backend.router.in_flight) == 1
        await stream.__anext__()
        await stream.aclose()
        assert sum(backend.router.in_flight) == 0
        done = await backend.stream(group(8, 1)[0], {})
        assert [x async for x in done] == [{"output_ids": [i]} for i in range(3)]
        assert sum(backend.router.in_flight) == 0

    asyncio.run(run())


@pytest.mark.slow  # (two engine processes start: tens of seconds)
def test_radixlm_serve_with_two_replicas(tiny_model_folder, tmp_path):
    """`radixlm serve --dp-size 2`: two engine processes behind one server; one of them killed
    makes the server unhealthy instead of hanging its requests."""
    import os
    import signal
    import time

    import httpx

    from tests.test_server_process import Server

    server = Server(tiny_model_folder, tmp_path / "log", "--dp-size", "2")
    try:
        info = httpx.get(server.url + "/get_server_info", timeout=10).json()
        assert info["dp_size"] == 2 and len(set(info["engine_pids"])) == 2
        body = {"input_ids": group(9, 1)[0], "sampling_params": {"max_new_tokens": 3}}
        r = httpx.post(server.url + "/generate", json=body, timeout=60)
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 3
        os.kill(info["engine_pids"][1], signal.SIGKILL)
        deadline = time.monotonic() + 20
        while httpx.get(server.url + "/health", timeout=5).status_code == 200:
            assert time.monotonic() < deadline, "still healthy with a replica gone"
            time.sleep(0.2)
    finally:
        server.stop()


@pytest.mark.slow  # (two replicas of two tensor-parallel ranks each: four processes)
def test_radixlm_serve_with_two_replicas_of_two_tensor_parallel_ranks(tiny_model_folder, tmp_path):
    """`radixlm serve --dp-size 2 --tp-size 2`: each replica an engine of two ranks (rank 0 in
    the replica's engine process, rank 1 in one it starts); the answers are tp_size=2's alone."""
    import httpx

    import radixlm
    from tests.test_server_process import Server

    prompts = group(10, 2) + group(11, 2)
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    with radixlm.Engine(tiny_model_folder, tp_size=2) as alone:
        want = [alone.generate(input_ids=p, sampling_params=params)["output_ids"] for p in prompts]
    server = Server(tiny_model_folder, tmp_path / "log", "--dp-size", "2", "--tp-size", "2")
    try:
        info = httpx.get(server.url + "/get_server_info", timeout=10).json()
        assert info["dp_size"] == 2 and len(set(info["engine_pids"])) == 2
        got = []
        for p in prompts:
            body = {"input_ids": p, "sampling_params": params}
            r = httpx.post(server.url + "/generate", json=body, timeout=60)
            assert r.status_code == 200, r.text
            got.append(r.json()["output_ids"])
    finally:
        server.stop()
    assert got == want
