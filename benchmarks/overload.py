"""The server at ten times the load it can serve, and a disconnect storm (loopback, CPU or GPU).

    python -m benchmarks.overload [--model-path P] [--max-queued-requests 16] [--factor 10]
                                  [--capacity-seconds 20] [--overload-seconds 60]
                                  [--input-len 32 64] [--output-len 16] [--storm-clients 200]

1. **Capacity.** `radixlm serve --max-queued-requests Q` on a free port; Q closed-loop clients send
   POST /generate back to back (random prompts, `--output-len` tokens each, `ignore_eos`) for
   `--capacity-seconds`: the requests/s they complete is the rate the server sustains.
2. **Overload.** Requests arrive as a Poisson process at `--factor` times that rate for
   `--overload-seconds`. Every answer must be a 200 whose generation ran to its length (none
   lost) or a 503 with Retry-After; reported: how many of each, the latency of a rejection and of
   an accepted request (p50/p99), the server's and the engine process's RSS (sampled every
   0.25 s: idle before, then the highest so far at each quarter of the overload, and idle
   after: a bounded process levels off), and the engine's KV pool once idle again (every slot
   free or in the prefix cache, none locked, nothing running or waiting).
3. **Disconnect storm.** A fresh server (its queue bound above the storm) and a quiet run of a
   few greedy control requests; then, `--storm-rounds` times, `--storm-clients` streaming
   clients that each read a random number of chunks and vanish, while the same control requests
   run again: their outputs must be identical to the quiet run's, the KV pool whole again once
   the storm has passed, and the RSS after each round is reported (the first round raises the
   allocators' high-water marks; a leak would raise it again each round).

The script exits non-zero if any of these checks fails. Results print as Markdown rows for
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import httpx

from benchmarks.common import commit, device_line, random_prompts
from benchmarks.serving import pct, start_server, stop_server

VOCAB = 49152  # the default model's; random prompt ids stay below it


@dataclass
class Answer:
    status: int
    latency: float
    retry_after: str | None = None
    finish: str | None = None
    tokens: int = 0
    error: str | None = None


@dataclass
class RssSampler:
    """The resident memory (MiB) of some processes, sampled in a thread from /proc."""

    pids: dict[str, int]
    interval: float = 0.25
    samples: dict[str, list[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def now(self) -> dict[str, float]:
        return {name: rss_mib(pid) for name, pid in self.pids.items()}

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, value in self.now().items():
                self.samples.setdefault(name, []).append(value)
            self._stop.wait(self.interval)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def flushed_rss(url: str, sampler, engine_pid: int | None = None) -> float:
    """POST /flush_cache (the prefix cache emptied, its memory given back), then the engine
    process's RSS (MiB) a moment later: what it holds with nothing cached."""
    httpx.post(url + "/flush_cache", timeout=60).raise_for_status()
    time.sleep(1.0)
    return sampler.now()["engine"] if sampler is not None else rss_mib(engine_pid)


def engine_stats(url: str) -> dict:
    return httpx.get(url + "/server_info", timeout=30).json()["internal_states"][0]


def wait_idle(url: str, timeout: float = 120) -> dict:
    """The engine's stats once nothing runs or waits; a failure if that takes past `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine_stats(url)
        if stats["num_running_reqs"] + stats["num_waiting_reqs"] == 0:
            return stats
        if time.monotonic() > deadline:
            raise SystemExit(f"the engine is not idle {timeout:g} s after the load: {stats}")
        time.sleep(0.2)


def kv_whole(stats: dict) -> bool:
    """Every KV slot free or held by the prefix cache, and none of those locked."""
    return (
        stats["kv_pool_free_tokens"] + stats["radix_cache_tokens"]
        == stats["kv_pool_capacity_tokens"]
        and stats["radix_cache_protected_tokens"] == 0
    )


async def generate(client: httpx.AsyncClient, url: str, ids: list[int], params: dict) -> Answer:
    start = time.perf_counter()
    try:
        r = await client.post(url + "/generate", json={"input_ids": ids, "sampling_params": params})
    except httpx.HTTPError as e:
        return Answer(0, time.perf_counter() - start, error=f"{type(e).__name__}: {e}")
    latency = time.perf_counter() - start
    answer = Answer(r.status_code, latency, r.headers.get("retry-after"))
    if r.status_code == 200:
        meta = r.json()["meta_info"]
        reason = meta["finish_reason"]
        answer.finish = reason["type"] if isinstance(reason, dict) else reason
        answer.tokens = meta["completion_tokens"]
    elif r.status_code != 503:
        answer.error = r.text[:200]
    return answer


async def measure_capacity(url: str, prompts, params, clients: int, seconds: float) -> float:
    """Requests/s completed by `clients` closed-loop clients over `seconds`."""
    done = 0
    limits = httpx.Limits(max_connections=clients * 2, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        stop = time.perf_counter() + seconds

        async def loop(k: int) -> None:
            nonlocal done
            i = k
            while time.perf_counter() < stop:
                answer = await generate(client, url, prompts[i % len(prompts)], params)
                if answer.status == 503:  # (the slot of an answer is freed just after it)
                    await asyncio.sleep(0.01)
                    continue
                if answer.status != 200 or answer.finish != "length":
                    raise SystemExit(f"capacity run: a request failed: {answer}")
                done += 1
                i += clients

        start = time.perf_counter()
        await asyncio.gather(*(loop(k) for k in range(clients)))
        return done / (time.perf_counter() - start)


async def overload(url: str, prompts, params, rate: float, seconds: float) -> list[Answer]:
    rng = random.Random(7)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        tasks = []
        start = time.perf_counter()
        t, i = 0.0, 0
        while t < seconds:
            delay = start + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(
                asyncio.ensure_future(generate(client, url, prompts[i % len(prompts)], params))
            )
            i += 1
            t += rng.expovariate(rate)
        return list(await asyncio.gather(*tasks))


async def control_outputs(url: str, prompts, params) -> list[list[int]]:
    async with httpx.AsyncClient(timeout=600) as client:
        replies = await asyncio.gather(
            *(
                client.post(url + "/generate", json={"input_ids": p, "sampling_params": params})
                for p in prompts
            )
        )
    for r in replies:
        if r.status_code != 200:
            raise SystemExit(f"a control request failed: {r.status_code} {r.text[:200]}")
    return [r.json()["output_ids"] for r in replies]


async def vanish(url: str, ids: list[int], params: dict, chunks: int) -> int:
    """Stream a generation, read `chunks` events, then drop the connection. The events read."""
    read = 0
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        body = {"input_ids": ids, "sampling_params": params, "stream": True}
        async with client.stream("POST", url + "/generate", json=body) as r:
            if r.status_code != 200:
                raise SystemExit(f"a storm client was refused: {r.status_code}")
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    read += 1
                    if read >= chunks:
                        break
    return read


async def storm(url, storm_prompts, storm_params, controls, control_params, seed: int = 11):
    rng = random.Random(seed)
    cuts = [rng.randint(0, 12) for _ in storm_prompts]
    start = time.perf_counter()
    storm_tasks = [
        asyncio.ensure_future(vanish(url, p, storm_params, c)) for p, c in zip(storm_prompts, cuts)
    ]
    outputs = await control_outputs(url, controls, control_params)
    reads = await asyncio.gather(*storm_tasks)
    return outputs, reads, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, help="default: the embedded model")
    parser.add_argument("--max-queued-requests", type=int, default=16)
    parser.add_argument("--factor", type=float, default=10.0)
    parser.add_argument("--capacity-seconds", type=float, default=20.0)
    parser.add_argument("--overload-seconds", type=float, default=60.0)
    parser.add_argument("--input-len", type=int, nargs=2, default=(32, 64))
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--storm-clients", type=int, default=200)
    parser.add_argument("--storm-rounds", type=int, default=2)
    parser.add_argument("--storm-output-len", type=int, default=64)
    parser.add_argument("--controls", type=int, default=4)
    args = parser.parse_args()

    prompts = random_prompts(256, *args.input_len, VOCAB, seed=0)
    params = {"max_new_tokens": args.output_len, "ignore_eos": True, "temperature": 0.0}
    model = ["--model-path", args.model_path] if args.model_path else []
    failures: list[str] = []
    serve = SimpleNamespace(engine_in_process=False)

    # ---- 1 and 2: capacity, then overload -------------------------------------------------
    queued = args.max_queued_requests
    with tempfile.NamedTemporaryFile(
        "w", prefix="radixlm-overload-", suffix=".log", delete=False
    ) as log:
        proc, url = start_server(serve, [*model, "--max-queued-requests", str(queued)], log)
        try:
            info = httpx.get(url + "/server_info", timeout=30).json()
            pids = {"server": proc.pid, "engine": info["engine_pid"]}
            asyncio.run(control_outputs(url, prompts[:2], params))  # warm-up
            capacity = asyncio.run(
                measure_capacity(url, prompts, params, queued, args.capacity_seconds)
            )
            idle_before = wait_idle(url)
            rate = capacity * args.factor
            print(
                f"capacity {capacity:.2f} req/s; offering {rate:.1f} req/s for {args.overload_seconds:g} s",
                file=sys.stderr,
            )
            with RssSampler(pids) as rss:
                rss_idle = rss.now()
                answers = asyncio.run(overload(url, prompts, params, rate, args.overload_seconds))
                stats_after = wait_idle(url)
                time.sleep(1.0)
                rss_after = rss.now()
                rss_flushed = flushed_rss(url, rss)
        finally:
            stop_server(proc)

    accepted = [a for a in answers if a.status == 200]
    rejected = [a for a in answers if a.status == 503]
    other = [a for a in answers if a.status not in (200, 503)]
    lost = [a for a in accepted if a.finish != "length" or a.tokens != args.output_len]
    no_retry = [a for a in rejected if not a.retry_after]
    if other:
        failures.append(f"{len(other)} answers neither 200 nor 503, e.g. {other[0]}")
    if lost:
        failures.append(f"{len(lost)} accepted requests did not complete, e.g. {lost[0]}")
    if no_retry:
        failures.append(f"{len(no_retry)} 503s without Retry-After")
    if not kv_whole(stats_after):
        failures.append(f"KV not whole after the overload: {stats_after}")
    if not kv_whole(idle_before):
        failures.append(f"KV not whole before the overload: {idle_before}")

    # ---- 3: the disconnect storm ----------------------------------------------------------
    storm_params = {"max_new_tokens": args.storm_output_len, "ignore_eos": True, "temperature": 0.0}
    controls = random_prompts(args.controls, *args.input_len, VOCAB, seed=5)
    storm_prompts = random_prompts(args.storm_clients, *args.input_len, VOCAB, seed=6)
    control_params = {"max_new_tokens": 32, "ignore_eos": True, "temperature": 0.0}
    bound = str(args.storm_clients + args.controls + 8)
    with tempfile.NamedTemporaryFile(
        "w", prefix="radixlm-storm-", suffix=".log", delete=False
    ) as log:
        proc, url = start_server(serve, [*model, "--max-queued-requests", bound], log)
        try:
            engine_pid = httpx.get(url + "/server_info", timeout=30).json()["engine_pid"]
            quiet = asyncio.run(control_outputs(url, controls, control_params))
            storm_rss = [{"server": rss_mib(proc.pid), "engine": rss_mib(engine_pid)}]
            rounds = []
            for k in range(args.storm_rounds):
                loud, reads, storm_wall = asyncio.run(
                    storm(url, storm_prompts, storm_params, controls, control_params, seed=11 + k)
                )
                t0 = time.perf_counter()
                storm_stats = wait_idle(url)
                drain = time.perf_counter() - t0
                storm_rss.append({"server": rss_mib(proc.pid), "engine": rss_mib(engine_pid)})
                rounds.append((loud, reads, storm_wall, drain, storm_stats))
                if loud != quiet:
                    failures.append(f"storm {k + 1}: the control requests' outputs changed")
                if not kv_whole(storm_stats):
                    failures.append(f"storm {k + 1}: KV not whole afterwards: {storm_stats}")
            storm_flushed = flushed_rss(url, None, engine_pid)
        finally:
            stop_server(proc)

    # ---- report ---------------------------------------------------------------------------
    def ms(values, q):
        return f"{pct(values, q) * 1000:.0f}"

    def quarters(values: list[float]) -> str:  # the highest so far at each quarter
        marks = [max(values[: max(1, len(values) * q // 4)]) for q in (1, 2, 3, 4)]
        return " / ".join(f"{m:.0f}" for m in marks)

    def kv_line(stats: dict) -> str:
        return (
            f"{'whole' if kv_whole(stats) else 'NOT whole'} ({stats['kv_pool_free_tokens']} free"
            f" + {stats['radix_cache_tokens']} cached of {stats['kv_pool_capacity_tokens']})"
        )

    rejected_ms = [a.latency for a in rejected]
    accepted_ms = [a.latency for a in accepted]
    print(f"\n`python -m benchmarks.overload {' '.join(sys.argv[1:])}`".rstrip())
    print(f"{time.strftime('%Y-%m-%d')}, commit {commit()}, {device_line()}\n")
    print("| phase | value |\n|---|---|")
    print(f"| capacity (closed loop, {queued} clients) | {capacity:.2f} req/s |")
    print(
        f"| offered ({args.factor:g}x, Poisson, {args.overload_seconds:g} s) "
        f"| {rate:.1f} req/s, {len(answers)} requests |"
    )
    print(f"| accepted (200, ran to length) | {len(accepted)} ({len(lost)} lost) |")
    print(
        f"| rejected (503 + Retry-After) | {len(rejected)} ({len(no_retry)} without Retry-After) |"
    )
    print(f"| other answers | {len(other)} |")
    print(f"| rejection latency p50 / p99 | {ms(rejected_ms, 50)} / {ms(rejected_ms, 99)} ms |")
    print(f"| accepted latency p50 / p99 | {ms(accepted_ms, 50)} / {ms(accepted_ms, 99)} ms |")
    for name in ("server", "engine"):
        print(
            f"| {name} RSS idle; highest by each quarter of the overload; idle after "
            f"| {rss_idle[name]:.0f}; {quarters(rss.samples[name])}; {rss_after[name]:.0f} MiB |"
        )
    print(
        f"| engine RSS idle after, then with the prefix cache flushed | "
        f"{rss_after['engine']:.0f}, {rss_flushed:.0f} MiB |"
    )
    print(f"| KV after the overload | {kv_line(stats_after)} |")
    for k, (loud, reads, storm_wall, drain, stats) in enumerate(rounds, 1):
        print(
            f"| storm {k}: clients cut after 0-12 events | {len(reads)} (read {sum(reads)} "
            f"events) in {storm_wall:.1f} s, idle {drain:.1f} s later |"
        )
        print(
            f"| storm {k}: control outputs as in a quiet run | "
            f"{'yes' if loud == quiet else 'NO'} ({len(controls)} requests) |"
        )
        print(f"| storm {k}: KV after | {kv_line(stats)} |")
    for name in ("server", "engine"):
        values = " / ".join(f"{r[name]:.0f}" for r in storm_rss)
        print(f"| storm: {name} RSS before, after each round | {values} MiB |")
    print(f"| storm: engine RSS with the prefix cache flushed | {storm_flushed:.0f} MiB |")
    print(json.dumps({"failures": failures}))
    if failures:
        raise SystemExit("FAILED: " + "; ".join(failures))


if __name__ == "__main__":
    main()
