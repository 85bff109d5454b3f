"""The per-token float8 rounding of activations (kernels/fused.py `fp8_quantize_rows`, before
each FP8 W8A8 matmul of more than 16 rows): its two ways, a row read once into registers (one
pass, the whole row a program) or in tiles of 2,048 read twice (the second time from L2), over
the activation shapes of the Llama-3.1-8B layers, against the bytes it must move. Both ways
must give torch's rounding (kernels/quant_ref.py `quantize_fp8_rows`) bit for bit.

    python -m benchmarks.fp8_rows [--rows 1,64,600] [--widths 4096,14336]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import commit, copy_bandwidth, device_line


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rows", default="1,64,600")
    ap.add_argument("--widths", default="4096,14336")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/fp8_rows.py times GPU kernels: no CUDA device here")
    import triton.testing

    from radixlm.kernels.fused import fp8_quantize_rows
    from radixlm.kernels.quant_ref import quantize_fp8_rows

    bandwidth = copy_bandwidth()
    print(
        f"device: {device_line()}  commit: {commit()}  copy bandwidth: {bandwidth / 1e12:.2f} TB/s"
    )
    print(
        "\n| rows x width | MB moved | one pass us (of bandwidth) | two passes us (of bandwidth) "
        "| faster |\n|---|---|---|---|---|"
    )
    gen = torch.Generator(device="cuda").manual_seed(0)
    for width in (int(w) for w in args.widths.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, width, device="cuda", generator=gen).to(torch.bfloat16) * 4
            want_q, want_s = quantize_fp8_rows(x)
            moved = rows * width * 3 + rows * 4  # bf16 in, float8 out, a scale a row
            times = []
            for limit in (1 << 30, 0):  # every width in one pass; none
                q, s = fp8_quantize_rows(x, one_pass_columns=limit)
                if not (
                    torch.equal(q.float(), want_q.float()) and torch.equal(s, want_s)
                ):  # (zeros' signs aside)
                    raise SystemExit(f"{rows} x {width}: not torch's rounding (limit {limit})")
                times.append(
                    triton.testing.do_bench(
                        lambda x=x, limit=limit: fp8_quantize_rows(x, one_pass_columns=limit),
                        warmup=50,
                        rep=300,
                    )  # fmt: skip
                    * 1e3
                )
            one, two = times
            print(
                f"| {rows} x {width} | {moved / 1e6:.2f} | {one:.1f} ({moved / one / 1e-6 / bandwidth:.0%}) "
                f"| {two:.1f} ({moved / two / 1e-6 / bandwidth:.0%}) | {'one' if one <= two else 'two'} |"
            )


if __name__ == "__main__":
    main()
