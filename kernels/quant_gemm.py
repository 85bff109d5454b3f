"""A matmul over grouped integer weights (packed INT4, or int8: GGUF's Q8_0 and Q6_K on a GPU) for
more rows than the GEMV takes (kernels/gemv.py, batch 1-4): y = x @ dequantize(W).T (+ b), the
weight's tiles unpacked and dequantized in registers (`gemv._int4_tile` and `_int4_dequantized`,
or `_int8_tile`: the GEMV's own) and fed to tl.dot in x's type, so the weight is read once per row
block instead of being written out dequantized first. Its oracle is kernels/quant_ref.py
`grouped_linear_ref` (runtime/quantization/int4.py calls this on CUDA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlm.kernels.gemv import (
    _int4_dequantized,
    _int4_dot_accumulate,
    _int4_tile,
    _int4_tiling,
    _int8_tile,
    int4_mma,
)


@triton.jit
def _grouped_gemm_kernel(
    x_ptr, w_ptr, ws_ptr, wz_ptr, b_ptr, y_ptr,
    M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    TILE_GROUPS: tl.constexpr, GROUP_COLS: tl.constexpr, INT4_MMA: tl.constexpr,
    W_INT8: tl.constexpr, HAS_ZERO: tl.constexpr,
):  # fmt: skip
    rows_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if not W_INT8:
            lo, hi, scale, zero = _int4_tile(
                w_ptr, ws_ptr, wz_ptr, rows_n, k0, K, N, stride_wn, stride_sn,
                GROUP, BLOCK_N, BLOCK_K, TILE_GROUPS, GROUP_COLS,
            )  # fmt: skip
        if INT4_MMA:  # the stored integers into the MMA, scaled after (as the GEMV)
            even = k0 + 2 * tl.arange(0, BLOCK_K // 2)
            mask = (rows_m[:, None] < M) & (even[None, :] < K)
            at = x_ptr + rows_m[:, None] * stride_xm + even[None, :]
            a_even = tl.load(at, mask=mask, other=0.0)
            a_odd = tl.load(at + 1, mask=mask, other=0.0)
            acc = _int4_dot_accumulate(
                acc, a_even, a_odd, lo, hi, scale, zero, BLOCK_N, BLOCK_K
            )  # fmt: skip
        else:
            k = k0 + cols
            mask = (rows_m[:, None] < M) & (k[None, :] < K)
            a = tl.load(x_ptr + rows_m[:, None] * stride_xm + k[None, :], mask=mask, other=0.0)
            if W_INT8:
                w = _int8_tile(
                    w_ptr, ws_ptr, wz_ptr, rows_n, k0, K, N, stride_wn, stride_sn,
                    GROUP, BLOCK_N, BLOCK_K, TILE_GROUPS, GROUP_COLS, HAS_ZERO,
                )  # fmt: skip
            else:
                w = _int4_dequantized(lo, hi, scale, zero, BLOCK_N, BLOCK_K)  # float32
            acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows_n, mask=rows_n < N, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rows_m[:, None] * stride_ym + rows_n[None, :]
    tl.store(
        out, acc.to(y_ptr.dtype.element_ty), mask=(rows_m[:, None] < M) & (rows_n[None, :] < N)
    )


def grouped_gemm(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    block: tuple[int, int, int] = (64, 64, 64),
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x (M, K), unit stride along K, @ the packed INT4 weight (N, K // 2) uint8, or the int8 one
    (N, K), with float32 scales and zero points (N, K // group; an int8 weight's may be None:
    symmetric groups) -> (M, N) in `out_dtype` (default
    x's; float32: the float32 sums unrounded, an LM head's logits). `block`:
    (BLOCK_M, BLOCK_N, BLOCK_K), powers of two (each column of a tile reads its own group's
    scale)."""
    m, k = x.shape
    n = packed.shape[0]
    groups = scale.shape[1]
    int8 = packed.dtype == torch.int8
    zeros = zero if zero is not None else scale
    if (
        (zero is None and not int8)
        or x.stride(-1) != 1
        or packed.dtype not in (torch.uint8, torch.int8)
        or packed.shape[1] * (1 if int8 else 2) != k
        or packed.stride(-1) != 1
        or k % groups
        or scale.shape != (n, groups)
        or zeros.shape != (n, groups)
        or not scale.is_contiguous()
        or not zeros.is_contiguous()
    ):
        raise ValueError(
            f"grouped_gemm takes x (M, K) and a packed weight (N, K // 2) uint8 or an int8 one "
            f"(N, K), with contiguous scales and zeros (N, K // group); got x {tuple(x.shape)}, weight "
            f"{tuple(packed.shape)} {packed.dtype}, scales {tuple(scale.shape)}"
        )
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return y
    bm, bn, bk = block
    _grouped_gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x, packed, scale, zeros, bias if bias is not None else scale, y,
        m, n, k, x.stride(0), packed.stride(0), scale.stride(0), y.stride(0),
        GROUP=k // groups, HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        **_int4_tiling(k // groups, bk), INT4_MMA=not int8 and int4_mma(k // groups, bk, x.dtype),
        HAS_ZERO=zero is not None,
        W_INT8=int8,
        num_warps=4, num_stages=3,
    )  # fmt: skip
    return y
