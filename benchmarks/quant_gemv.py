"""Batch-1 matmuls over quantized weights, one linear layer at a time, on the GPU: for each linear
shape of a model, unquantized (bf16), FP8 and INT4 (W4A16, group 128) weights, the plain path and
every GEMV tile timed in CUDA graphs as the engine's start-up tuning times them
(runtime/matmul_dispatch.py `LinearDispatch.tune`), in one run. Each row gives the bytes a call
reads (weights and their scales), the fastest tile's time, its bandwidth against the measured copy
bandwidth (the floor of a call that reads its weights once), and that tile; for packed INT4
weights also the fastest `words` tile (kernels/gemv.py INT4_CONFIGS: int32 words) and the fastest
of the tiles that read bytes, the A/B of the two ways to read the same weights; for float8 and
INT4 weights the fastest `half` tile (x into the MMA as float16) and the fastest other tile.

    python -m benchmarks.quant_gemv [--shapes llama-3.1-8b] [--schemes none,fp8,w4a16] [--rows 1]
    python -m benchmarks.quant_gemv --schemes none,q4_0,q4_1,q4_k,q8_0,q6_k   # GGUF blocks

GGUF blocks (random blocks with finite scales) are held as a GPU holds them
(runtime/quantization/gguf.py: the 4-bit types in the INT4 layout, groups of 32; q8_0 and q6_k
in the int8 layout, groups of 32 and 16); their rows also time the blocks dequantized to float32
at every call and multiplied ("dequantize us"), the path a GPU ran before those layouts. (Q8_0
and Q6_K layers ran as bf16 ones just before the int8 layout: the "none" rows.)
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import SHAPES, commit, copy_bandwidth, device_line
from radixlm.kernels import gguf_ref
from radixlm.runtime.matmul_dispatch import LinearDispatch, choice_key, graph_ms
from radixlm.runtime.quantization.fp8 import Fp8Linear
from radixlm.runtime.quantization.gguf import GgufLinear
from radixlm.runtime.quantization.int4 import Int4Linear

GGUF_TYPES = {"q4_0": 2, "q4_1": 3, "q4_k": 12, "q8_0": 8, "q6_k": 14}


def linear_shapes(name: str) -> list[tuple[str, int, int]]:
    """(layer, N, K) of each linear layer of a decoder layer of the shape."""
    s = SHAPES[name]
    h, inter = s["hidden_size"], s["intermediate_size"]
    head = h // s["num_attention_heads"]
    qkv = (s["num_attention_heads"] + 2 * s["num_key_value_heads"]) * head
    return [("qkv_proj", qkv, h), ("o_proj", h, h), ("gate_up_proj", 2 * inter, h),
            ("down_proj", h, inter)]  # fmt: skip


def gguf_blocks(gtype: int, n: int, k: int) -> torch.Tensor:
    """(n, row bytes) random blocks of `gtype` on the GPU, their float16 scales finite (~0.02)."""
    _, qk, nbytes = gguf_ref.BLOCK_TYPES[gtype]
    raw = torch.randint(0, 256, (n, k // qk, nbytes), dtype=torch.uint8, device="cuda")
    # d (and m, or dmin) lead each block; Q6_K's d ends it
    start, halves = (nbytes - 2, 2) if gtype == 14 else (0, 2 if gtype in (2, 8) else 4)
    scales = (torch.randn(n, k // qk, halves // 2, device="cuda") * 0.02).half()
    raw[..., start : start + halves] = scales.view(torch.uint8).view(n, k // qk, halves)
    return raw.view(n, -1)


def layer(n: int, k: int, scheme: str) -> nn.Linear:
    lin = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    nn.init.normal_(lin.weight, std=k**-0.5)
    if scheme in GGUF_TYPES:
        lin.quant_scheme = GgufLinear((GGUF_TYPES[scheme],))
        lin.quant_scheme.create_weights(lin)
        with torch.no_grad():
            lin.weight.copy_(gguf_blocks(GGUF_TYPES[scheme], n, k))
        lin.quant_scheme.process_after_loading(lin)  # (the INT4 layout: on a GPU)
    elif scheme != "none":
        lin.quant_scheme = Fp8Linear(stored=False) if scheme == "fp8" else Int4Linear()
        lin.quant_scheme.create_weights(lin)
        lin.quant_scheme.process_after_loading(lin)
    return lin


def bytes_read(lin: nn.Linear) -> int:
    return sum(p.numel() * p.element_size() for p in lin.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shapes", default="llama-3.1-8b")
    ap.add_argument("--schemes", default="none,fp8,w4a16")
    ap.add_argument("--rows", type=int, default=1)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("quant_gemv times GPU kernels: no CUDA device here")
    bw = copy_bandwidth()
    print(f"device: {device_line()}  commit: {commit()}  copy bandwidth: {bw / 1e12:.2f} TB/s")
    print(
        "\n| shape | layer | N x K | weights | MB read | plain us | best tile us | of copy "
        "bandwidth | tiles that ran | best tile | words / byte tiles us | half / other tiles us "
        "| dequantize us |"
        "\n|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    for name in args.shapes.split(","):
        for label, n, k in linear_shapes(name):
            for scheme in args.schemes.split(","):
                lin = layer(n, k, scheme)
                dispatch = LinearDispatch()
                plain_ms, best_ms = dispatch.tune(lin, args.rows)
                timed = dispatch.timings[choice_key("linear", args.rows, lin)]
                fastest = timed[0] if timed else (float("nan"), None)
                mb = bytes_read(lin) / 1e6
                print(
                    f"| {name} | {label} | {n} x {k} | {scheme} | {mb:.1f} | {plain_ms * 1e3:.1f} "
                    f"| {fastest[0] * 1e3:.1f} | {mb * 1e6 / (fastest[0] / 1e3) / bw:.0%} "
                    f"| {len(timed)} | {tuple(fastest[1]) if fastest[1] else '-'} "
                    f"| {fastest_with_and_without(timed, 'words')} "
                    f"| {fastest_with_and_without(timed, 'half')} "
                    f"| {dequantize_us(n, k, scheme, args.rows)} |",
                    flush=True,
                )
                del lin, dispatch
                torch.cuda.empty_cache()


def fastest_with_and_without(timed, flag: str) -> str:
    """The fastest tile's microseconds with `flag` set (`words`: packed INT4 read as int32 words;
    `half`: x into the MMA as float16) and the fastest without, the A/B of the two ways ("-"
    where a layer ran no tile with it: only quantized weights have such tiles)."""
    on = [ms for ms, c in timed if getattr(c, flag)]
    off = [ms for ms, c in timed if not getattr(c, flag)]
    if not on:
        return "-"
    return f"{min(on) * 1e3:.1f} / " + (f"{min(off) * 1e3:.1f}" if off else "-")


def dequantize_us(n: int, k: int, scheme: str, rows: int) -> str:
    """For GGUF blocks: microseconds a call of the path a GPU ran before the INT4 layout (the
    blocks dequantized to float32 at every call, then F.linear), timed as the tiles are."""
    if scheme not in GGUF_TYPES or GGUF_TYPES[scheme] not in gguf_ref.INT4_TYPES:
        return "-"  # (Q8_0 and Q6_K ran as bf16 layers before their int8 layout: the "none" rows)
    gtype = GGUF_TYPES[scheme]
    raw = nn.Linear(1, 1, bias=False)  # (a holder of the blocks graph_ms can copy)
    raw.weight = nn.Parameter(gguf_blocks(gtype, n, k), requires_grad=False)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    ms = graph_ms(lambda lin: F.linear(x.float(), gguf_ref.dequantize(lin.weight, gtype, k)), raw)
    return f"{ms * 1e3:.1f}"


if __name__ == "__main__":
    main()
