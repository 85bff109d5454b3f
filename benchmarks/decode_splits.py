"""Decode attention time by batch, sequence length and split count, as a CUDA graph runs it.

    python -m benchmarks.decode_splits

For the head shapes of SmolLM2-135M (9 query heads, 3 KV heads, dim 64) and Llama-3.1-8B (32, 8,
128), bf16: each (batch, length) is timed with the split count the engine uses at that batch
(`default_num_kv_splits`), with one split, and with 2-32 splits, 20 calls captured in one graph
and replayed (the per-call time, host launches excluded). Since a split covers at least one tile
of keys, a count above length / 32 leaves the extra splits empty.
"""

from __future__ import annotations

import functools

import torch

from benchmarks.common import commit, device_line
from radixlm.kernels import triton_attention as ta

SHAPES = {"smollm2-135m": (9, 3, 64), "llama-3.1-8b": (32, 8, 128)}
BATCHES = (1, 2, 4, 8, 16, 64)
LENGTHS = (32, 64, 128, 256, 512, 1024, 2048, 4096)


def graph_us(fn, calls: int = 20) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / calls * 1e3)
    return best


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("decode_splits times GPU kernels: no CUDA device here")
    print(f"device: {device_line()}  commit: {commit()}")
    dev = torch.device("cuda")
    for name, (hq, hkv, d) in SHAPES.items():
        print(f"\n{name}: us a call, the engine's split count [in brackets]\n")
        print("| batch | " + " | ".join(f"{n} keys" for n in LENGTHS) + " |")
        print("|---|" + "---|" * len(LENGTHS))
        for b in BATCHES:
            cells = []
            for n in LENGTHS:
                slots = b * n + 1
                k = torch.randn(slots, hkv, d, device=dev, dtype=torch.bfloat16)
                v = torch.randn_like(k)
                q = torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16)
                table = torch.arange(1, slots, device=dev, dtype=torch.int32).view(b, n)
                rows = torch.arange(b, device=dev)
                seq = torch.full((b,), n, device=dev)
                out = torch.empty_like(q)
                default = ta.default_num_kv_splits(b, hkv, dev)
                times = {}
                for splits in sorted({1, 2, 4, 8, 16, 32, default}):
                    scratch = ta.alloc_decode_scratch(b, hq, d, splits, dev)
                    call = functools.partial(
                        ta.decode_attention, q, k, v, table, rows, seq, d**-0.5,
                        out=out, scratch=scratch,
                    )  # fmt: skip
                    times[splits] = graph_us(call)
                fastest = min(times, key=times.get)
                cells.append(
                    f"[{default}] {times[default]:.1f}, 1: {times[1]:.1f}, "
                    f"best {fastest}: {times[fastest]:.1f}"
                )
            print(f"| {b} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
