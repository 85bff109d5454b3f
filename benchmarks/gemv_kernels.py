"""The batch-1 matmuls of a decode step, kernel by kernel: for each weight shape of a model and the
op before it (none, RMSNorm with the residual add, SiLU-and-mul), the plain path (the separate
norm / SiLU kernel, then cuBLAS) against the Triton GEMV kernels (kernels/gemv.py), as the engine's
start-up tuning times them, and the achieved weight-read bandwidth of the chosen one.

    python -m benchmarks.gemv_kernels [--shapes smollm2-135m,llama-3.1-8b] [--rows 1] [--sweep]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import SHAPES, commit, device_line


def shape_matmuls(cfg: dict) -> list[tuple[str, str, int, int]]:
    """(name, op, N, K) of every distinct matmul of a decoder layer and the LM head."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    hd = h // cfg["num_attention_heads"]
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * hd
    return [
        ("qkv_proj", "rms_norm_residual", qkv, h),
        ("o_proj", "linear", h, cfg["num_attention_heads"] * hd),
        ("gate_up_proj", "rms_norm_residual", 2 * i, h),
        ("down_proj", "silu_and_mul", h, i),
        ("lm_head", "rms_norm_residual", cfg["vocab_size"], h),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shapes", default="smollm2-135m,llama-3.1-8b")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--sweep", action="store_true", help="also print every tile of the plain GEMV")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gemv_kernels times GPU kernels: no CUDA device here")

    from radixlm.kernels.gemv import CONFIGS, GemvConfig, gemv
    from radixlm.runtime.layers import RMSNorm
    from radixlm.runtime.matmul_dispatch import LinearDispatch, choice_key, graph_ms

    SWEEP = CONFIGS + [
        GemvConfig(bn, bk, nw, ns, sk)
        for bn, bk, nw, ns, sk in [
            (4, 4096, 4, 2, 1), (4, 4096, 8, 2, 1), (2, 4096, 4, 2, 1), (4, 2048, 4, 3, 1),
            (4, 2048, 4, 1, 1), (8, 2048, 4, 2, 1), (8, 2048, 8, 2, 1), (4, 2048, 2, 2, 1),
            (2, 2048, 2, 2, 1), (1, 2048, 2, 2, 1), (1, 4096, 4, 2, 1), (4, 2048, 4, 2, 2),
            (4, 1024, 2, 2, 1), (2, 1024, 2, 2, 1), (4, 512, 2, 2, 1), (8, 512, 2, 2, 1),
            (2, 512, 2, 2, 1), (8, 256, 2, 2, 1), (4, 256, 1, 2, 1), (8, 1024, 2, 2, 1),
        ]
    ]  # fmt: skip
    print(f"device: {device_line()}  commit: {commit()}  rows: {args.rows}")
    print("\n| shape | matmul | N x K | op | plain us | linear chosen | fused chosen us | GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        cfg = SHAPES[shape]
        for name, op, n, k in shape_matmuls(cfg):
            linear = torch.nn.Linear(k, n, bias=False).to("cuda", torch.bfloat16)
            norm = RMSNorm(k, 1e-5).to("cuda", torch.bfloat16)
            dispatch = LinearDispatch()
            base, chosen = dispatch.tune(linear, args.rows)
            tile = dispatch.choice[choice_key("linear", args.rows, linear)]
            fused = ""
            best = chosen
            if op != "linear":
                plain, best = dispatch.tune(linear, args.rows, op, norm)
                fused_tile = dispatch.choice[choice_key(op, args.rows, linear)]
                fused = f"{plain * 1e3:.1f} -> {best * 1e3:.1f} {fused_tile or 'plain'}"
                tried = dispatch.timings[choice_key(op, args.rows, linear)]
                fused += " (tried " + ", ".join(f"{t * 1e3:.1f}" for t, _ in tried) + ")"
            gbs = n * k * 2 / (best * 1e-3) / 1e9
            print(
                f"| {shape} | {name} | {n}x{k} | {op} | {base * 1e3:.1f} | "
                f"{chosen * 1e3:.1f} {tile or 'cuBLAS'} | {fused} | {gbs:.0f} |",
                flush=True,
            )
            if args.sweep:
                x = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16)
                for c in SWEEP:
                    try:
                        ms = graph_ms(lambda lin, c=c, x=x: gemv(x, lin.weight, None, c), linear)
                    except Exception as e:  # a tile this GPU cannot run
                        print(f"|   |   |   | {tuple(c)} | {type(e).__name__} |   |   |   |")
                        continue
                    print(f"|   |   |   | {tuple(c)} | {ms * 1e3:.1f} |   |   |   |", flush=True)
            del linear, norm
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
