"""What a speculative verify step costs against a plain decode step, on random weights of a real
shape (acceptance means nothing there; the cost of checking k tokens at once is what is measured).

    python -m benchmarks.verify_cost [--shape llama-3.1-8b] [--batch 1 16] [--tokens 8 16]
        [--context 1024] [--dtype bfloat16]
    python -m benchmarks.verify_cost --shape smollm2-135m --device cpu --batch 1 --tokens 4 \
        --context 32 --reps 2      # (checks the script; the graphs then run eagerly)

One engine with speculation on (NGRAM, `--tokens` the most a request verifies), so it captures
the decode graphs, the prompt-step graphs and the verify graphs that run every token as a decode
row (runtime/cuda_graph.py RowGraphs). For each batch size B, B request rows of the request table
get `--context` cached positions over distinct KV slots, then, timed with CUDA events (median of
`--reps` replays, inputs fixed):
- **decode**: one plain decode step of the B requests (DecodeGraphs);
- **verify as rows**: a verify step of k tokens per request (its newest and k - 1 draft tokens),
  every token a decode row (RowGraphs), which is what the engine runs;
- **verify as extend**: the same step through the prompt-step graphs (PrefillGraphs), the path
  verify steps took before, where it fits.
The table gives each step's milliseconds and its ratio to the decode step. The floor: at batch 1
a step reads the weights once whatever its rows, so a verify step's floor is the decode step
(ratio 1.0) plus its extra K/V reads (each row reads the context again, `kv_extra` below).
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

import torch

import radixlm
from benchmarks.common import commit, device_line, shape_folder


def _time(fn, reps: int, device: torch.device) -> float:
    """Median milliseconds of `fn()` over `reps` calls (CUDA events; wall time on the CPU)."""
    import time

    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def _kernels(fn, top: int, steps: int = 20) -> str:
    """The `top` kernels of `steps` calls of `fn` by device time (torch.profiler), a step each."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in rows) / steps
    lines = [f"  total {total:.1f} us"]
    for e in rows[:top]:
        lines.append(
            f"  {e.device_time_total / steps:8.1f} us {e.count / steps:5.1f}  {e.key[:90]}"
        )
    return "\n".join(lines)


def _uncaptured_graphs(core, max_bs: int, k: int, max_tokens: int) -> None:
    """The engine's graphs built without capture (their forwards run eagerly): on the CPU."""
    from radixlm.runtime.cuda_graph import DecodeGraphs, PrefillGraphs, RowGraphs

    runner, pad = core.runner, core.rows.padding_row
    parts = (runner.model, runner.backend, runner.req_to_token, runner.token_buf)
    runner.graphs = DecodeGraphs(*parts, max_bs, capture=False, padding_row=pad)
    runner.row_graphs = RowGraphs(*parts, max_bs * k, k, capture=False, padding_row=pad)
    if hasattr(runner.backend, "extend_tokens_per_block"):  # (the Triton backend's tiles)
        runner.prefill_graphs = PrefillGraphs(
            *parts, max_bs * max_tokens, max_bs, capture=False, padding_row=pad
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument(
        "--profile", type=int, default=0, metavar="N",
        help="then each step once more under the profiler (CUDA): its N kernels with the most "
        "device time, in us a step",
    )  # fmt: skip
    args = ap.parse_args()
    device = torch.device(args.device)
    most_rows = max(args.batch)
    k_max = max(args.tokens)
    folder = shape_folder(args.shape)
    with radixlm.Engine(
        str(folder), load_format="dummy", device=args.device, dtype=args.dtype,
        speculative_algorithm="NGRAM", speculative_num_draft_tokens=k_max,
        max_running_requests=max(most_rows, 2), cuda_graph_max_bs=max(most_rows, 2),
        max_total_tokens=most_rows * (args.context + k_max + 8) + 64,
        context_length=args.context + k_max + 8,
    ) as eng:  # fmt: skip
        core = eng._core
        runner = core.runner
        table = runner.req_to_token
        pool = core.kv_pool
        if runner.graphs is None:  # (the CPU: the same graphs' inputs, run eagerly)
            _uncaptured_graphs(core, max(most_rows, 2), k_max, args.context + k_max)
        span = args.context + k_max
        gen = torch.Generator().manual_seed(0)
        # distinct KV slots for every position of every row (shuffled, as a busy pool's are)
        slots = torch.randperm(most_rows * span, generator=gen) + 1
        for r in range(most_rows):
            table[r, :span] = slots[r * span : (r + 1) * span].to(table.dtype).to(table.device)
        kv_row_bytes = pool.bytes_per_slot(
            len(pool.k), pool.k[0].shape[1], pool.k[0].shape[2], pool.dtype
        )
        results, profiles = [], []
        rg, pg = runner.row_graphs, runner.prefill_graphs
        for b in args.batch:
            rows = list(range(b))
            slots_b = table[rows, args.context].long().cpu()
            decode_step = partial(runner.graphs.run, rows, [args.context + 1] * b, slots_b)
            decode_ms = _time(decode_step, args.reps, device)
            if args.profile and device.type == "cuda":
                profiles.append((f"batch {b}, decode", _kernels(decode_step, args.profile)))
            for k in args.tokens:
                ids = torch.randint(100, 32000, (b * k,), generator=gen).tolist()
                positions = [args.context + j for _ in rows for j in range(k)]
                token_rows = [r for r in rows for _ in range(k)]
                as_rows = as_extend = None
                rows_step = None
                if rg is not None and rg.can_run(b * k, k):
                    rows_step = partial(rg.run, ids, positions, token_rows, [])
                    as_rows = _time(rows_step, args.reps, device)
                if pg is not None and pg.can_run(b * k, b, b * k):
                    extend_step = partial(
                        pg.run, ids, positions, token_rows, [], rows, [args.context] * b,
                        [k] * b, list(range(b * k)),
                    )  # fmt: skip
                    as_extend = _time(extend_step, args.reps, device)
                # each row reads its context again: beyond the decode step's B contexts
                kv_extra = b * (k - 1) * args.context * kv_row_bytes
                results.append((b, k, decode_ms, as_rows, as_extend, kv_extra))
                if args.profile and device.type == "cuda" and rows_step is not None:
                    profiles.append(
                        (f"batch {b}, verify {k} as rows", _kernels(rows_step, args.profile))
                    )
        weight_bytes = sum(p.numel() * p.element_size() for p in eng.model.parameters())
        dispatch = getattr(eng.model, "matmul", None)
        tuned = [
            (key, dispatch.plain_ms[key], dispatch.timings.get(key, []), dispatch.choice.get(key))
            for key in getattr(dispatch, "plain_ms", {})
            if key[0] == "linear"
        ]

    def ratio(x, base):
        return "-" if x is None else f"{x:.3f} ms ({x / base:.2f}x)"

    print(
        f"\n{device_line()}, {args.shape}, {args.dtype}, context {args.context}, commit {commit()}"
    )
    print(f"weights {weight_bytes / 1e9:.2f} GB a step; K/V {kv_row_bytes} bytes a position")
    print(
        "| batch | tokens a request | decode step | verify as rows | verify as extend | extra K/V read |"
    )
    print("|---|---|---|---|---|---|")
    for b, k, dec, rows_ms, ext_ms, kv_extra in results:
        print(
            f"| {b} | {k} | {dec:.3f} ms | {ratio(rows_ms, dec)} | {ratio(ext_ms, dec)} "
            f"| {kv_extra / 1e6:.1f} MB |"
        )
    # what the start-up tuning chose for each row count a step may run at (runtime/
    # matmul_dispatch.py): a verify step's rows above 4 take only the tl.dot tiles or cuBLAS
    print("\n| rows | weight (N, K) | cuBLAS | fastest tile | chosen |\n|---|---|---|---|---|")
    for (_, rows, n, k, *_), plain_ms, timed, chosen in sorted(tuned, key=lambda t: t[0][1:4]):
        tile = f"{timed[0][0] * 1e3:.1f} us" if timed else "-"
        print(
            f"| {rows} | ({n}, {k}) | {plain_ms * 1e3:.1f} us | {tile} | "
            f"{'cuBLAS' if chosen is None else chosen} |"
        )
    for label, table in profiles:
        print(f"\n{label}: kernels by device time (us a step, calls a step)\n{table}")


if __name__ == "__main__":
    main()
