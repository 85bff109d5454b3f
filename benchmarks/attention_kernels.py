"""Triton paged attention vs the plain-torch reference, one layer of a Llama-3.1-8B shape.

    python benchmarks/attention_kernels.py [--dtype bf16] [--num-kv-splits N]

Decode is memory bound: the table gives the K/V bytes it must read divided by its time, against
the H200's ~4.2 TB/s. Extend is given in TFLOP/s (QK and PV matmuls, causal part counted once).
Slots are shuffled over the pool, as a long-running server leaves them. Each case is checked
against the reference before it is timed. Needs CUDA.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

import torch

PEAK_BANDWIDTH = 4.2e12  # bytes/s, measured streaming read on the H200
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
SCALE = HEAD_DIM**-0.5

DECODE_CASES = [(1, 1024), (1, 16384), (8, 4096), (32, 4096), (128, 2048), (64, 8192)]  # (B, len)
EXTEND_CASES = [  # name, prefix_lens, extend_lens
    ("prefill 1x4096", [0], [4096]),
    ("prefill 8x512", [0] * 8, [512] * 8),
    ("cached prefix 4x(3072+512)", [3072] * 4, [512] * 4),
    ("verify 64x(2048+4)", [2048] * 64, [4] * 64),
]


def make_inputs(prefix_lens, extend_lens, dtype, gen):
    """Pools just big enough for the batch, with each request's slots scattered over them."""
    totals = [p + e for p, e in zip(prefix_lens, extend_lens)]
    num_slots = sum(totals) + 1
    slots = torch.randperm(num_slots - 1, generator=gen, device="cuda").int() + 1
    req_to_token = torch.zeros(len(totals), max(totals), dtype=torch.int32, device="cuda")
    start = 0
    for r, total in enumerate(totals):
        req_to_token[r, :total] = slots[start : start + total]
        start += total
    shape = (num_slots, NUM_KV_HEADS, HEAD_DIM)
    k_pool = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
    v_pool = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
    q = torch.randn(sum(extend_lens), NUM_Q_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
    req_pool_indices = torch.randperm(len(totals), device="cuda")
    # request i lives in row req_pool_indices[i]
    req_to_token = req_to_token[torch.argsort(req_pool_indices)].contiguous()
    lens = (torch.tensor(x, device="cuda") for x in (prefix_lens, extend_lens))
    return q, k_pool, v_pool, req_to_token, req_pool_indices, *lens


def bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e-3  # seconds


def bench_decode(dtype, num_kv_splits, gen) -> list[str]:
    from radixlm.kernels import triton_attention as ta
    from radixlm.kernels.attention_ref import decode_attention_ref

    rows = []
    for batch, length in DECODE_CASES:
        q, k_pool, v_pool, rtt, rpi, prefix, new = make_inputs(
            [length - 1] * batch, [1] * batch, dtype, gen
        )
        seq_lens = prefix + new
        splits = num_kv_splits or ta.default_num_kv_splits(batch, NUM_KV_HEADS, q.device)
        scratch = ta.alloc_decode_scratch(batch, NUM_Q_HEADS, HEAD_DIM, splits, q.device)
        out = torch.empty_like(q)

        args = (q, k_pool, v_pool, rtt, rpi, seq_lens, SCALE)
        triton_fn = partial(ta.decode_attention, *args, out=out, scratch=scratch)
        ref_fn = partial(decode_attention_ref, *args)

        torch.testing.assert_close(triton_fn(), ref_fn(), atol=2e-2, rtol=2e-2)
        kv_bytes = 2 * batch * length * NUM_KV_HEADS * HEAD_DIM * k_pool.element_size()
        t_triton, t_ref = bench(triton_fn), bench(ref_fn)
        bandwidth = kv_bytes / t_triton
        rows.append(
            f"| {batch} | {length} | {splits} | {t_triton * 1e6:.1f} | {t_ref * 1e6:.1f} | "
            f"{t_ref / t_triton:.1f}x | {bandwidth / 1e12:.2f} | {bandwidth / PEAK_BANDWIDTH:.0%} |"
        )
        del q, k_pool, v_pool, scratch
    return rows


def bench_extend(dtype, gen) -> list[str]:
    from radixlm.kernels import triton_attention as ta
    from radixlm.kernels.attention_ref import extend_attention_ref

    rows = []
    for name, prefix_lens, extend_lens in EXTEND_CASES:
        q, k_pool, v_pool, rtt, rpi, prefix, new = make_inputs(prefix_lens, extend_lens, dtype, gen)

        args = (q, k_pool, v_pool, rtt, rpi, prefix, new, SCALE)
        triton_fn = partial(ta.extend_attention, *args, max_extend_len=max(extend_lens))
        ref_fn = partial(extend_attention_ref, *args)

        torch.testing.assert_close(triton_fn(), ref_fn(), atol=2e-2, rtol=2e-2)
        pairs = sum(e * p + e * (e + 1) / 2 for p, e in zip(prefix_lens, extend_lens))
        flops = 4 * pairs * NUM_Q_HEADS * HEAD_DIM
        t_triton, t_ref = bench(triton_fn), bench(ref_fn)
        rows.append(
            f"| {name} | {t_triton * 1e3:.3f} | {t_ref * 1e3:.3f} | {t_ref / t_triton:.1f}x | "
            f"{flops / t_triton / 1e12:.0f} |"
        )
        del q, k_pool, v_pool
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--num-kv-splits", type=int, default=None, help="default: by shape")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("attention_kernels: needs a CUDA GPU (none found); nothing measured.")
        return 1
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    gen = torch.Generator(device="cuda").manual_seed(0)
    device = torch.cuda.get_device_name()
    print(
        f"# {device}, torch {torch.__version__}, {args.dtype}, Hq={NUM_Q_HEADS} Hkv={NUM_KV_HEADS}"
    )
    print(
        f"# D={HEAD_DIM}, one layer; bandwidth = K/V bytes / time vs {PEAK_BANDWIDTH / 1e12} TB/s"
    )
    print()
    print("| decode B | seq len | splits | triton µs | torch ref µs | speedup | TB/s | of peak |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(bench_decode(dtype, args.num_kv_splits, gen)))
    print()
    print("| extend | triton ms | torch ref ms | speedup | TFLOP/s |")
    print("|---|---|---|---|---|")
    print("\n".join(bench_extend(dtype, gen)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
