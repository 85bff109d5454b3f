"""Data parallelism: `radixlm serve --dp-size 1` against `--dp-size N` in one run, over HTTP.

    python -m benchmarks.data_parallel                     # N GPUs: Llama-3.1-8B shape, bf16
        [--shape llama-3.1-8b] [--dp 1,2] [--requests 1000] [--repeats 2]
    python -m benchmarks.data_parallel --device cpu --shape tiny --requests 16 --dp 1,2

For each dp_size a server starts (random weights of the shape, radix cache off: the workload has
no shared prefixes) and the GPU offline workload of benchmarks/common.py goes to its native
/generate, every request at once (--requests prompts of 100-400 tokens, 100-300 new tokens,
greedy, EOS ignored): output tokens/s over the wall time, the median of --repeats runs, and the
ratio to dp_size 1. Replica i runs on GPU i, so N needs N GPUs. Each server's start-up and a
warm-up run are not timed.

On the CPU it runs at a tiny size (every replica on the host's cores): that says it works, not
how fast; tests/test_data_parallel.py starts `radixlm serve --dp-size 2` itself.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import commit, offline_gpu_workload
from benchmarks.tensor_parallel import model_folder


def serve(args, folder: Path, dp: int, port: int, log: Path) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "radixlm.cli", "serve", "--model-path", str(folder),
        "--port", str(port), "--dp-size", str(dp), "--load-format", "dummy",
        "--disable-radix-cache", "--log-level", "warning",
        "--max-batch-size", str(args.requests),
    ]  # fmt: skip
    if args.device == "cpu":
        command += ["--device", "cpu", "--max-total-tokens", str(args.cpu_kv_tokens)]
    else:
        command += ["--max-running-requests", str(args.requests)]
    return subprocess.Popen(
        command, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ}
    )


async def run_workload(url: str, prompts: list[list[int]], params: list[dict]) -> tuple[int, float]:
    """Every request at once; (output tokens, wall seconds)."""
    import httpx

    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:

        async def one(ids, p):
            r = await client.post(url + "/generate", json={"input_ids": ids, "sampling_params": p})
            r.raise_for_status()
            return r.json()["meta_info"]["completion_tokens"]

        t = time.perf_counter()
        tokens = await asyncio.gather(*(one(i, p) for i, p in zip(prompts, params)))
        return sum(tokens), time.perf_counter() - t


def measure(args, folder: Path, dp: int, log_dir: Path) -> tuple[float, list[int]]:
    """Output tokens/s (median of --repeats runs) of a server of dp_size `dp`, and how many
    requests each replica served."""
    import httpx

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = serve(args, folder, dp, port, log_dir / f"dp{dp}.log")
    try:
        deadline = time.monotonic() + args.start_timeout
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the dp={dp} server did not start; its log: {log_dir}/dp{dp}.log")
            time.sleep(0.5)
        prompts, params = offline_gpu_workload(args.requests, args.prompt_lens, args.output_lens)
        asyncio.run(run_workload(url, prompts[: max(2, dp * 2)], params[: max(2, dp * 2)]))
        rates = []
        for _ in range(args.repeats):
            tokens, wall = asyncio.run(run_workload(url, prompts, params))
            assert tokens == sum(p["max_new_tokens"] for p in params)
            rates.append(tokens / wall)
        info = httpx.get(url + "/get_server_info", timeout=30).json()
        runs = ", ".join(f"{r:.0f}" for r in rates)
        print(f"dp_size {dp}: median {statistics.median(rates):.0f} output tok/s (runs: {runs})")
        return statistics.median(rates), info.get("engine_pids", [info.get("engine_pid")])
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _span(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split("-"))
    return lo, hi


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shape", default="llama-3.1-8b", help="tiny, or a shape of benchmarks/common")
    ap.add_argument("--dp", default="1,2", help="the dp_sizes to compare, the first the baseline")
    ap.add_argument("--device", default=None, help="cpu: every replica on the CPU")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompt-lens", type=_span, default=(100, 400))
    ap.add_argument("--output-lens", type=_span, default=(100, 300))
    ap.add_argument("--cpu-kv-tokens", type=int, default=16384)
    ap.add_argument("--start-timeout", type=float, default=600)
    args = ap.parse_args()
    sizes = [int(x) for x in args.dp.split(",")]
    folder = model_folder(args.shape)
    log_dir = Path(os.environ.get("RADIXLM_BENCH_LOGS", folder))
    print(f"commit: {commit()}  shape: {args.shape}  device: {args.device or 'cuda'}")
    print(f"{args.requests} requests, {args.prompt_lens} in / {args.output_lens} out, all at once")
    rows = [(dp, *measure(args, folder, dp, log_dir)) for dp in sizes]
    base = rows[0][1]
    print("\n| dp_size | output tok/s | vs first | engine processes |\n|---|---|---|---|")
    for dp, rate, pids in rows:
        print(f"| {dp} | {rate:.0f} | {rate / base:.2f}x | {len(pids)} |")


if __name__ == "__main__":
    main()
