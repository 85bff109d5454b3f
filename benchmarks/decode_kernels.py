"""Where a decode step's GPU time goes: the kernels of the replayed graphs, per step, and the gaps
between replays, on random weights of a real shape.

    python -m benchmarks.decode_kernels [--shape smollm2-135m] [--batch 1] [--new-tokens 128]

One `generate` of `--batch` requests (32-token prompts, `--new-tokens` each, greedy, EOS ignored)
after a warm-up, three ways:

- untraced: wall time, tokens/s and microseconds a step;
- CUDA events around every graph replay: each replay's GPU time (from its first kernel to its last,
  the GPU's own gaps between kernels included) and the time from one replay's end to the next
  one's start (the GPU waiting for the host);
- the torch profiler (device activity only): kernels per step, and per kernel name its time a step,
  its launches a step and its mean duration; the sum is the kernel time without the gaps.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

import radixlm
from benchmarks.common import (
    commit,
    cuda_event_spans,
    device_line,
    random_prompts,
    shape_folder,
)


def replay_times(eng, prompts, params) -> tuple[list[float], list[float]]:
    """(GPU ms of each graph replay, ms from each replay's end to the next one's start)."""
    with cuda_event_spans(torch.cuda.CUDAGraph, "replay") as spans:
        eng.generate(input_ids=prompts, sampling_params=params)
    inside = [a.elapsed_time(b) for a, b, _ in spans]
    gaps = [spans[i][1].elapsed_time(spans[i + 1][0]) for i in range(len(spans) - 1)]
    return inside, gaps


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_kernels profiles GPU decode steps: no CUDA device here")
    from torch.profiler import ProfilerActivity, profile

    print(f"device: {device_line()}  commit: {commit()}  shape: {args.shape}  batch: {args.batch}")
    n = args.new_tokens
    prompts = random_prompts(args.batch, 32, 32, 32000, seed=5)
    params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    with radixlm.Engine(
        str(shape_folder(args.shape)), load_format="dummy", disable_radix_cache=True,
        max_running_requests=max(64, args.batch),
    ) as eng:  # fmt: skip
        eng.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": 8})
        t = time.perf_counter()
        eng.generate(input_ids=prompts, sampling_params=params)
        wall = time.perf_counter() - t
        print(
            f"untraced: {wall * 1e3:.1f} ms, {args.batch * n / wall:.0f} tok/s, "
            f"{wall / n * 1e6:.0f} us a step (the prompt step included)"
        )
        inside, gaps = replay_times(eng, prompts, params)
        print(
            f"graph replays: {len(inside)}, median {statistics.median(inside) * 1e3:.0f} us of GPU "
            f"time each; from one replay's end to the next one's start median "
            f"{statistics.median(gaps) * 1e3:.0f} us, sum {sum(gaps):.1f} ms"
        )
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            eng.generate(input_ids=prompts, sampling_params=params)
    total: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name[:80]
            total[name] += e.time_range.end - e.time_range.start
            count[name] += 1
    kernels = sum(count.values())
    print(
        f"profiler: {kernels / n:.0f} kernels a step, {sum(total.values()) / n:.0f} us of kernel "
        f"time a step\n\n| us a step | launches a step | us each | kernel |\n|---|---|---|---|"
    )
    for name, us in total.most_common(args.top):
        print(f"| {us / n:.1f} | {count[name] / n:.1f} | {us / count[name]:.2f} | `{name}` |")


if __name__ == "__main__":
    main()
