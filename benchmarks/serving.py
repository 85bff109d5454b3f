"""Serving throughput and latency (like SGLang's bench_serving): the real `radixlm serve` against
the offline `radixlm.Engine` on the same requests, in one run.

    python -m benchmarks.serving [--clients 32] [--requests 32] [--input-len 64 256]
                                 [--output-len 64] [--prompts random|shared-prefix]
                                 [--request-rate R] [--engine-in-process]

The server runs as a subprocess on a free port with the default engine options (the engine in a
process of its own, unless --engine-in-process). `--clients` streaming clients (httpx, asyncio)
send the requests to POST /generate with `stream: true` and fixed output lengths (`ignore_eos`);
they arrive all at once, or as a Poisson process of `--request-rate` requests/s. Reported: request
and output-token throughput, and time to first token, inter-token latency and end-to-end latency at
p50/p90/p99. Then the offline engine, in this process with the same options, generates the same
requests, submitted together, and the ratio of output tokens/s is printed (the issue's target on
the CPU: serving at least 0.9x offline).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx

from benchmarks.common import commit, device_line, random_prompts


@dataclass
class RequestResult:
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None


def make_prompts(kind: str, count: int, low: int, high: int, vocab: int) -> list[list[int]]:
    if kind == "random":
        return random_prompts(count, low, high, vocab, seed=0)
    # shared-prefix: 4 groups, each sharing a prefix of `high` tokens, then a question of `low`
    prefixes = random_prompts(4, high, high, vocab, seed=1)
    questions = random_prompts(count, low, low, vocab, seed=2)
    return [prefixes[i % 4] + q for i, q in enumerate(questions)]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, engine_options: list[str], log) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "radixlm.cli", "serve", "--port", str(port), *engine_options]
    if args.engine_in_process:
        command.append("--engine-in-process")
    proc = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "RADIXLM_API_KEY": ""}
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the server did not start; its log is {log.name}")
        time.sleep(0.2)


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def one_request(client, url, ids, params, result: RequestResult) -> None:
    body = {"input_ids": ids, "sampling_params": params, "stream": True}
    start = last = time.perf_counter()
    tokens = 0
    async with client.stream("POST", url + "/generate", json=body) as r:
        if r.status_code != 200:
            result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                result.error = str(event["error"])
                return
            count = event["meta_info"]["completion_tokens"]
            if count > tokens:
                now = time.perf_counter()
                if tokens == 0:
                    result.ttft = now - start
                else:
                    gap = (now - last) / (count - tokens)
                    result.itls.extend([gap] * (count - tokens))
                tokens, last = count, now
    result.e2e = time.perf_counter() - start
    result.output_tokens = tokens


async def run_clients(url, prompts, params, clients: int, rate: float | None):
    results = [RequestResult() for _ in prompts]
    slots = asyncio.Semaphore(clients)
    rng = random.Random(3)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def go(i: int, delay: float) -> None:
            await asyncio.sleep(delay)
            async with slots:
                await one_request(client, url, prompts[i], params, results[i])

        delays, t = [], 0.0
        for _ in prompts:
            delays.append(t)
            if rate:
                t += rng.expovariate(rate)
        start = time.perf_counter()
        await asyncio.gather(*(go(i, d) for i, d in enumerate(delays)))
        wall = time.perf_counter() - start
    return results, wall


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def serving_phase(args, prompts, params, engine_options) -> dict:
    with tempfile.NamedTemporaryFile(
        "w", prefix="radixlm-serve-", suffix=".log", delete=False
    ) as log:
        proc, url = start_server(args, engine_options, log)
        try:
            # warm-up: one short request, as the offline phase does
            httpx.post(
                url + "/generate",
                json={
                    "input_ids": prompts[0][:8],
                    "sampling_params": {**params, "max_new_tokens": 4},
                },
                timeout=120,
            )
            results, wall = asyncio.run(
                run_clients(url, prompts, params, args.clients, args.request_rate)
            )
        finally:
            stop_server(proc)
    errors = [r.error for r in results if r.error]
    if errors:
        raise SystemExit(f"{len(errors)} requests failed, e.g. {errors[0]}")
    produced = sum(r.output_tokens for r in results)
    assert produced == len(prompts) * args.output_len, produced
    return {
        "wall": wall,
        "tokens": produced,
        "ttft": [r.ttft for r in results],
        "itl": [x for r in results for x in r.itls],
        "e2e": [r.e2e for r in results],
    }


def offline_phase(args, prompts, params, engine_kwargs) -> dict:
    import radixlm

    with radixlm.Engine(**engine_kwargs) as engine:
        engine.generate(input_ids=prompts[0][:8], sampling_params={**params, "max_new_tokens": 4})
        t = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        wall = time.perf_counter() - t
    produced = sum(len(o["output_ids"]) for o in outs)
    assert produced == len(prompts) * args.output_len, produced
    return {"wall": wall, "tokens": produced}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct"
    )
    ap.add_argument("--clients", type=int, default=32, help="concurrent streaming clients")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--input-len", type=int, nargs=2, default=(64, 256), metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prompts", choices=("random", "shared-prefix"), default="random")
    ap.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="Poisson arrivals per second (default: all at once)",
    )
    ap.add_argument(
        "--max-total-tokens", type=int, default=None, help="the KV pool's size in tokens"
    )
    ap.add_argument(
        "--engine-in-process",
        action="store_true",
        help="serve with the engine in the server's process",
    )
    ap.add_argument("--rounds", type=int, default=1, help="serving/offline pairs, alternated")
    args = ap.parse_args()

    from radixlm.runtime.config import default_cache_dir
    from radixlm.runtime.model_loader import load_hf_config, resolve_model_folder

    folder = resolve_model_folder(args.model_path, default_cache_dir())
    vocab = load_hf_config(folder).vocab_size
    prompts = make_prompts(args.prompts, args.requests, *args.input_len, vocab)
    params = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
    engine_kwargs: dict = {"model_path": str(folder)}
    engine_options = ["--model-path", str(folder)]
    if args.max_total_tokens:
        engine_kwargs["max_total_tokens"] = args.max_total_tokens
        engine_options += ["--max-total-tokens", str(args.max_total_tokens)]
    print(f"device: {device_line()}  commit: {commit()}  model: {folder.name}")
    arrival = f"Poisson {args.request_rate}/s" if args.request_rate else "all at once"
    print(
        f"workload: {args.requests} requests ({args.prompts} prompts, "
        f"{args.input_len[0]}-{args.input_len[1]} tokens in, {args.output_len} out, ignore_eos), "
        f"{args.clients} streaming clients, arrivals {arrival}"
    )

    serving, offline = [], []
    for _ in range(args.rounds):
        serving.append(serving_phase(args, prompts, params, engine_options))
        offline.append(offline_phase(args, prompts, params, engine_kwargs))

    backend = "in-process engine" if args.engine_in_process else "engine process"
    print("\n| run | wall s | req/s | out tok/s |\n|---|---|---|---|")
    for i, (s, o) in enumerate(zip(serving, offline)):
        for name, r in ((f"server ({backend})", s), ("offline Engine", o)):
            print(
                f"| {name} #{i + 1} | {r['wall']:.2f} | {args.requests / r['wall']:.2f} "
                f"| {r['tokens'] / r['wall']:.1f} |"
            )
    ttft = [x for s in serving for x in s["ttft"]]
    itl = [x for s in serving for x in s["itl"]]
    e2e = [x for s in serving for x in s["e2e"]]
    print("\n| server latency | mean ms | p50 ms | p90 ms | p99 ms |\n|---|---|---|---|---|")
    for name, values in (("TTFT", ttft), ("ITL", itl), ("end-to-end", e2e)):
        print(
            f"| {name} | {statistics.fmean(values) * 1e3:.1f} | {pct(values, 50) * 1e3:.1f} "
            f"| {pct(values, 90) * 1e3:.1f} | {pct(values, 99) * 1e3:.1f} |"
        )
    served = sum(s["tokens"] for s in serving) / sum(s["wall"] for s in serving)
    local = sum(o["tokens"] for o in offline) / sum(o["wall"] for o in offline)
    print(
        f"\nserver {served:.1f} out tok/s vs offline {local:.1f} out tok/s: "
        f"ratio {served / local:.2f}x (target: at least 0.9x)"
    )


if __name__ == "__main__":
    main()
