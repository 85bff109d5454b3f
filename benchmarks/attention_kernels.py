"""Triton paged attention vs the plain-torch reference, one layer of a model shape's attention.

    python benchmarks/attention_kernels.py [--shape llama-3.1-8b] [--dtype bf16] [--num-kv-splits N]
    python benchmarks/attention_kernels.py --shape smollm2-135m --extend-tiles

Decode is memory bound: the table gives the K/V bytes it must read divided by its time, against
the H200's ~4.2 TB/s. Extend is given in TFLOP/s (QK and PV matmuls, causal part counted once).
Slots are shuffled over the pool, as a long-running server leaves them. Each case is checked
against the reference before it is timed. Needs CUDA.

--extend-tiles times the extend cases instead under each tile of `extend_tiles` (the first is the
kernel's default for the shape), each checked against the reference ("wrong" where it is not,
"too big" where the tile does not fit the GPU), and, for the prompts without a prefix, torch's
own causal attention (`scaled_dot_product_attention` over the batch as dense tensors: what the
GPU's fused attention reaches on the same work, without the paging).
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from typing import NamedTuple

import torch

PEAK_BANDWIDTH = 4.2e12  # bytes/s, measured streaming read on the H200


class Heads(NamedTuple):
    q: int
    kv: int
    dim: int


def shape_heads(name: str) -> Heads:
    from benchmarks.common import SHAPES, head_dim

    s = SHAPES[name]
    return Heads(s["num_attention_heads"], s["num_key_value_heads"], head_dim(s))


DECODE_CASES = [(1, 1024), (1, 16384), (8, 4096), (32, 4096), (128, 2048), (64, 8192)]  # (B, len)
EXTEND_CASES = [  # name, prefix_lens, extend_lens
    ("prefill 1x4096", [0], [4096]),
    ("prefill 8x512", [0] * 8, [512] * 8),
    ("prefill 5x1500", [0] * 5, [1500] * 5),
    ("cached prefix 4x(3072+512)", [3072] * 4, [512] * 4),
    ("chunk 4x(1024+1024)", [1024] * 4, [1024] * 4),
    ("verify 64x(2048+4)", [2048] * 64, [4] * 64),
]


def extend_tiles(heads: Heads, dtype: torch.dtype) -> list:
    """The kernel's own tile for the shape first, then the others to compare (the engine's
    tiles before 2026-12-06's sweep among them: (128, 64, 4 warps, 2) at head_dim 64, 8 warps at
    128)."""
    from radixlm.kernels.triton_attention import TileConfig, _extend_config

    own = _extend_config(heads.dim, dtype, torch.device("cuda"))
    others = [
        TileConfig(128, 64, 4, 2),
        TileConfig(128, 64, 4, 2, k_rows=True),
        TileConfig(128, 64, 4, 3),
        TileConfig(128, 64, 8, 2),
        TileConfig(128, 128, 8, 2),
        TileConfig(64, 64, 4, 2),
        TileConfig(64, 64, 4, 3, k_rows=True),
        TileConfig(128, 32, 4, 2),
    ]
    return [own, *(t for t in others if t != own)]


def make_inputs(prefix_lens, extend_lens, dtype, gen, heads: Heads):
    """Pools just big enough for the batch, with each request's slots scattered over them."""
    totals = [p + e for p, e in zip(prefix_lens, extend_lens)]
    num_slots = sum(totals) + 1
    slots = torch.randperm(num_slots - 1, generator=gen, device="cuda").int() + 1
    req_to_token = torch.zeros(len(totals), max(totals), dtype=torch.int32, device="cuda")
    start = 0
    for r, total in enumerate(totals):
        req_to_token[r, :total] = slots[start : start + total]
        start += total
    shape = (num_slots, heads.kv, heads.dim)
    k_pool = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
    v_pool = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
    q = torch.randn(sum(extend_lens), heads.q, heads.dim, device="cuda", dtype=dtype)
    req_pool_indices = torch.randperm(len(totals), device="cuda")
    # request i lives in row req_pool_indices[i]
    req_to_token = req_to_token[torch.argsort(req_pool_indices)].contiguous()
    lens = (torch.tensor(x, device="cuda") for x in (prefix_lens, extend_lens))
    return q, k_pool, v_pool, req_to_token, req_pool_indices, *lens


def bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e-3  # seconds


def bench_decode(dtype, num_kv_splits, gen, heads: Heads) -> list[str]:
    from radixlm.kernels import triton_attention as ta
    from radixlm.kernels.attention_ref import decode_attention_ref

    rows = []
    for batch, length in DECODE_CASES:
        q, k_pool, v_pool, rtt, rpi, prefix, new = make_inputs(
            [length - 1] * batch, [1] * batch, dtype, gen, heads
        )
        seq_lens = prefix + new
        splits = num_kv_splits or ta.default_num_kv_splits(batch, heads.kv, q.device)
        scratch = ta.alloc_decode_scratch(batch, heads.q, heads.dim, splits, q.device)
        out = torch.empty_like(q)

        args = (q, k_pool, v_pool, rtt, rpi, seq_lens, heads.dim**-0.5)
        triton_fn = partial(ta.decode_attention, *args, out=out, scratch=scratch)
        ref_fn = partial(decode_attention_ref, *args)

        torch.testing.assert_close(triton_fn(), ref_fn(), atol=2e-2, rtol=2e-2)
        kv_bytes = 2 * batch * length * heads.kv * heads.dim * k_pool.element_size()
        t_triton, t_ref = bench(triton_fn), bench(ref_fn)
        bandwidth = kv_bytes / t_triton
        rows.append(
            f"| {batch} | {length} | {splits} | {t_triton * 1e6:.1f} | {t_ref * 1e6:.1f} | "
            f"{t_ref / t_triton:.1f}x | {bandwidth / 1e12:.2f} | {bandwidth / PEAK_BANDWIDTH:.0%} |"
        )
        del q, k_pool, v_pool, scratch
    return rows


def bench_extend(dtype, gen, heads: Heads) -> list[str]:
    from radixlm.kernels import triton_attention as ta
    from radixlm.kernels.attention_ref import extend_attention_ref

    rows = []
    for name, prefix_lens, extend_lens in EXTEND_CASES:
        inputs = make_inputs(prefix_lens, extend_lens, dtype, gen, heads)
        args = (*inputs, heads.dim**-0.5)
        triton_fn = partial(ta.extend_attention, *args, max_extend_len=max(extend_lens))
        ref_fn = partial(extend_attention_ref, *args)

        torch.testing.assert_close(triton_fn(), ref_fn(), atol=2e-2, rtol=2e-2)
        flops = extend_flops(prefix_lens, extend_lens, heads)
        t_triton, t_ref = bench(triton_fn), bench(ref_fn)
        rows.append(
            f"| {name} | {t_triton * 1e3:.3f} | {t_ref * 1e3:.3f} | {t_ref / t_triton:.1f}x | "
            f"{flops / t_triton / 1e12:.0f} |"
        )
        del inputs, args
    return rows


def extend_flops(prefix_lens, extend_lens, heads: Heads) -> float:
    pairs = sum(e * p + e * (e + 1) / 2 for p, e in zip(prefix_lens, extend_lens))
    return 4 * pairs * heads.q * heads.dim


def bench_extend_tiles(dtype, gen, heads: Heads) -> list[str]:
    """Each extend case under each tile (TFLOP/s), and torch's dense causal attention."""
    import torch.nn.functional as F
    from triton.runtime.errors import OutOfResources

    from radixlm.kernels import triton_attention as ta
    from radixlm.kernels.attention_ref import extend_attention_ref

    tiles = extend_tiles(heads, dtype)
    rows = [
        "| extend | "
        + " | ".join(
            f"({t.block_m}, {t.block_n}, {t.num_warps}, {t.num_stages}{', k rows' if t.k_rows else ''})"
            for t in tiles
        )
        + " | torch dense causal |",
        "|---" * (len(tiles) + 2) + "|",
    ]
    for name, prefix_lens, extend_lens in EXTEND_CASES:
        inputs = make_inputs(prefix_lens, extend_lens, dtype, gen, heads)
        args = (*inputs, heads.dim**-0.5)
        want = extend_attention_ref(*args)
        flops = extend_flops(prefix_lens, extend_lens, heads)
        cells = []
        for tile in tiles:
            fn = partial(ta.extend_attention, *args, max_extend_len=max(extend_lens), config=tile)
            try:
                got = fn()
            except OutOfResources:  # (a tile that does not fit this GPU's shared memory)
                cells.append("too big")
                continue
            if not torch.allclose(got, want, atol=2e-2, rtol=2e-2):
                cells.append("wrong")
                continue
            cells.append(f"{flops / bench(fn) / 1e12:.0f}")
        dense = "-"
        if not any(prefix_lens) and len(set(extend_lens)) == 1:
            b, t = len(extend_lens), extend_lens[0]
            q = torch.randn(b, heads.q, t, heads.dim, device="cuda", dtype=dtype, generator=gen)
            k = torch.randn(b, heads.kv, t, heads.dim, device="cuda", dtype=dtype, generator=gen)
            v = torch.randn_like(k)
            sdpa = partial(F.scaled_dot_product_attention, q, k, v, is_causal=True, enable_gqa=True)
            dense = f"{flops / bench(sdpa) / 1e12:.0f}"
        rows.append(f"| {name} | " + " | ".join(cells) + f" | {dense} |")
        del inputs, args, want
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--num-kv-splits", type=int, default=None, help="default: by shape")
    parser.add_argument("--extend-tiles", action="store_true", help="extend under each tile")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("attention_kernels: needs a CUDA GPU (none found); nothing measured.")
        return 1
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    heads = shape_heads(args.shape)
    gen = torch.Generator(device="cuda").manual_seed(0)
    device = torch.cuda.get_device_name()
    print(f"# {device}, torch {torch.__version__}, {args.dtype}, {args.shape}: Hq={heads.q}")
    print(
        f"# Hkv={heads.kv} D={heads.dim}, one layer; bandwidth = K/V bytes / time vs "
        f"{PEAK_BANDWIDTH / 1e12} TB/s"
    )
    print()
    if args.extend_tiles:
        print("TFLOP/s of each extend tile (block_m, block_n, warps, stages):\n")
        print("\n".join(bench_extend_tiles(dtype, gen, heads)))
        return 0
    print("| decode B | seq len | splits | triton µs | torch ref µs | speedup | TB/s | of peak |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(bench_decode(dtype, args.num_kv_splits, gen, heads)))
    print()
    print("| extend | triton ms | torch ref ms | speedup | TFLOP/s |")
    print("|---|---|---|---|---|")
    print("\n".join(bench_extend(dtype, gen, heads)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
