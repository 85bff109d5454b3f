"""Batch-1 matmuls over quantized weights, one linear layer at a time, on the GPU: for each linear
shape of a model, unquantized (bf16), FP8 and INT4 (W4A16, group 128) weights, the plain path and
every GEMV tile timed in CUDA graphs as the engine's start-up tuning times them
(runtime/matmul_dispatch.py `LinearDispatch.tune`), in one run. Each row gives the bytes a call
reads (weights and their scales), the fastest tile's time, its bandwidth against the measured copy
bandwidth (the floor of a call that reads its weights once), and that tile.

    python -m benchmarks.quant_gemv [--shapes llama-3.1-8b] [--schemes none,fp8,w4a16] [--rows 1]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from benchmarks.common import SHAPES, commit, copy_bandwidth, device_line
from radixlm.runtime.matmul_dispatch import LinearDispatch, choice_key
from radixlm.runtime.quantization.fp8 import Fp8Linear
from radixlm.runtime.quantization.int4 import Int4Linear


def linear_shapes(name: str) -> list[tuple[str, int, int]]:
    """(layer, N, K) of each linear layer of a decoder layer of the shape."""
    s = SHAPES[name]
    h, inter = s["hidden_size"], s["intermediate_size"]
    head = h // s["num_attention_heads"]
    qkv = (s["num_attention_heads"] + 2 * s["num_key_value_heads"]) * head
    return [("qkv_proj", qkv, h), ("o_proj", h, h), ("gate_up_proj", 2 * inter, h),
            ("down_proj", h, inter)]  # fmt: skip


def layer(n: int, k: int, scheme: str) -> nn.Linear:
    lin = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    nn.init.normal_(lin.weight, std=k**-0.5)
    if scheme != "none":
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
        "bandwidth | tiles that ran | best tile |\n|---|---|---|---|---|---|---|---|---|---|"
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
                    f"| {len(timed)} | {tuple(fastest[1]) if fastest[1] else '-'} |",
                    flush=True,
                )
                del lin, dispatch
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
