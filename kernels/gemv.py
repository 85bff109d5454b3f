"""Skinny matmuls for small decode batches: y = op(x) @ W.T (+ b) for x of a few rows.

At batch 1-4 (and a speculative verify step's few rows: up to 16, through the tl.dot tiles) a
linear layer is a pass over its weights; the work is reading W once at full
bandwidth, and at small models the launches between the matmuls cost as much. Each program here owns
a few output rows and streams their weights along K (or a slice of K: split-K, with a second small
kernel summing the slices), reusing each weight tile for every row of x. The op before the matmul
may run inside it, as the prologue of every K tile:

- none: y = x @ W.T
- `gemv_rms_norm`: y = rmsnorm(x + residual) @ W.T, the sum also written out (the next residual);
  every program first reduces the whole row for its 1/rms (x is small next to W and read from L2).
- `gemv_silu_and_mul`: y = (silu(gate) * up) @ W.T over the two halves of gate_up.

A float8_e4m3fn weight (runtime/quantization/fp8.py) comes with a float32 scale per output row
(`w_scale`): its tiles are read as stored, a quarter of a float32 weight's bytes, converted in
registers (exactly, to float32 or to x's type for tl.dot) and each output multiplied by its row's
scale; x is not rounded (the oracle: kernels/quant_ref.py `fp8_linear_ref(..., act_quant=False)`),
but for the `half` tiles' float16 operands (`_half_rows`).
A packed INT4 weight (runtime/quantization/int4.py: two values a byte, a float32 scale and zero
point per group of columns) is read as stored too; its `words` tiles (INT4_CONFIGS) read it as int32
words of eight values: about six instructions a weight in the sm_90 code Triton 3.9 builds for
256 rows by a group, against about eighteen for the byte tiles (8 x 512), whose nibbles are
reshaped and shuffled (the oracle: `grouped_linear_ref`). An int8 weight with a scale and zero
point per group (GGUF's Q8_0 and Q6_K on a GPU: kernels/gguf_ref.py `as_int8`) is read a byte a
value and dequantized in registers (`_int8_tile`).

The prologues round as their plain-torch twins in kernels/fused_ref.py do: the sum to x's dtype,
the norm in float32 rounded to x's dtype before the weight, the product rounded again. They call the rounding helpers of
kernels/fused.py (their one-kernel twins), so the two round alike.

Whether a kernel beats cuBLAS (and the separate norm / SiLU kernel before it) depends on the shape
and the GPU, so `runtime.matmul_dispatch.LinearDispatch` times every candidate in CONFIGS /
FUSED_CONFIGS once per weight shape at start-up and keeps the fastest; the plain torch path
(`runtime.layers.PlainMatmuls`: F.linear after those twins) stays the oracle and the default.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from radixlm.kernels import fused
from radixlm.kernels.fused import add_rounded, norm_then_weight, pdl_start, silu_mul_rounded

MAX_ROWS = 16  # x rows the kernel takes; more go to cuBLAS
# above this many rows only the tl.dot tiles (`GemvConfig.dot`): the others keep a register per
# row, output row and column of their tile
MAX_ROWS_WITHOUT_DOT = 4

# the op run as the prologue of each K tile
_NONE: tl.constexpr = tl.constexpr(0)
_RMS_NORM: tl.constexpr = tl.constexpr(1)
_SILU_AND_MUL: tl.constexpr = tl.constexpr(2)


class GemvConfig(NamedTuple):
    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1  # programs along K; >1 adds a kernel summing their float32 partial sums
    # products kept per lane and summed across the tile once, after the loop (no cross-warp sum,
    # with its barrier, in every step); costs BLOCK_M * block_n * block_k float32 registers
    late_sum: bool = False
    # the next weight tile's load issued before this tile's products, and the first one before
    # the norm prologue's pass over x: two tiles in flight per program
    prefetch: bool = False
    # each tile's products through tl.dot, x's rows padded to 16: the weight loads feed an MMA,
    # so Triton's software pipeline keeps `num_stages` tiles in flight (late_sum and prefetch
    # do not apply)
    dot: bool = False
    # packed INT4 weights only: read as int32 words of eight values, each value turned into a
    # float by two instructions and multiplied by x as stored, a group's scale and zero point
    # applied to its sums (`_int4_word_sums`); block_k a multiple of the group
    words: bool = False
    # dot tiles over float8 or INT4 weights only: x goes into the MMA as float16, each row of a
    # tile first scaled by a power of two that puts its largest magnitude in [2**14, 2**15)
    # (bfloat16 x exact but for values below 2**-29 of their row's largest, float32 x rounded
    # to float16's 11 bits: `_half_rows`; the sums scaled back), so the weights become
    # float16 operands cheaply: float8 by one conversion per two values (to bfloat16 it takes
    # four), INT4 as 1024 + q by one OR (`_int4_mma_operand`)
    half: bool = False


@triton.jit
def _rms_norm_rstd(
    x_ptr, res_ptr, res_out_ptr, stride_xm, stride_rm, K, eps, write_sum,
    HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    M,
):  # fmt: skip
    """1 / rms of each row of x (+ residual), (BLOCK_M,) float32; with `write_sum` the program also
    stores the rounded sum to res_out (one program does, so no two write it). BLOCK_K here is as
    wide as registers allow, so that a row of a model's width is one round of loads."""
    rows_m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_K)
    sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + cols
        mask = (rows_m[:, None] < M) & (k[None, :] < K)
        x = tl.load(x_ptr + rows_m[:, None] * stride_xm + k[None, :], mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + rows_m[:, None] * stride_rm + k[None, :], mask=mask, other=0.0)
            x = add_rounded(x, r)
            if write_sum:
                tl.store(res_out_ptr + rows_m[:, None] * K + k[None, :], x, mask=mask)
        xf = x.to(tl.float32)
        sq += tl.sum(xf * xf, axis=1)
    return tl.rsqrt(sq / K + eps)


@triton.jit
def _tile_operand(
    x_ptr, res_ptr, norm_w_ptr, rstd, rows_m, k, k_end, M, K, stride_xm, stride_rm,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """x's columns `k` after the prologue: (BLOCK_M, BLOCK_K), x's dtype."""
    x_mask = (rows_m[:, None] < M) & (k[None, :] < k_end)
    x_at = x_ptr + rows_m[:, None] * stride_xm + k[None, :]
    if PROLOGUE == _RMS_NORM:
        x = tl.load(x_at, mask=x_mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + rows_m[:, None] * stride_rm + k[None, :], mask=x_mask, other=0.0)
            x = add_rounded(x, r)
        nw = tl.load(norm_w_ptr + k, mask=k < k_end, other=0.0)
        a = norm_then_weight(x, rstd[:, None], nw[None, :]).to(x.dtype)
    elif PROLOGUE == _SILU_AND_MUL:
        gate = tl.load(x_at, mask=x_mask, other=0.0)
        up = tl.load(x_at + K, mask=x_mask, other=0.0)
        a = silu_mul_rounded(gate, up)
    else:
        a = tl.load(x_at, mask=x_mask, other=0.0)
    return a


@triton.jit
def _accumulate(
    acc, a, w_tile, DOT: tl.constexpr, LATE_SUM: tl.constexpr, W_CONVERT: tl.constexpr
):  # fmt: skip
    """acc plus a tile's products: (BLOCK_M, BLOCK_N) float32 sums, or with LATE_SUM the
    (BLOCK_M, BLOCK_N, BLOCK_K) products summed over K after the loop. With W_CONVERT the weight
    tile (float8, exactly; dequantized INT4, rounded) is converted to x's type for tl.dot."""
    if DOT and W_CONVERT:  # (BLOCK_M, BLOCK_K) @ (BLOCK_K, BLOCK_N) in x's type, float32 sums
        acc = tl.dot(a, tl.trans(w_tile.to(a.dtype)), acc, input_precision="ieee")
    elif DOT:
        acc = tl.dot(a.to(w_tile.dtype), tl.trans(w_tile), acc, input_precision="ieee")
    else:  # (BLOCK_M, 1, BLOCK_K) * (1, BLOCK_N, BLOCK_K)
        prod = a.to(tl.float32)[:, None, :] * w_tile.to(tl.float32)[None, :, :]
        if LATE_SUM:
            acc += prod
        else:
            acc += tl.sum(prod, axis=2)
    return acc


@triton.jit
def _half_scales(amax):
    """For rows whose largest magnitude is `amax` ((BLOCK_M,) float32): the power of two that
    puts it in [2**14, 2**15) (below float16's largest, 65504) and the one back, both float32.
    Built from amax's exponent bits: no log, no division. A row whose largest is below 2**-112
    is scaled by 2**126 only (the factor back stays a normal float)."""
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # the biased exponent of amax
    up = tl.minimum(268 - e, 253)  # biased exponent of 2 ** (141 - e) (13 .. 253)
    down = ((254 - up) << 23).to(tl.float32, bitcast=True)  # 2 ** (e - 141)
    return (up << 23).to(tl.float32, bitcast=True), down


@triton.jit
def _half_rows(a):
    """x's tile as a float16 MMA operand, each row scaled by `_half_scales`, and the factor that
    turns its sums back. A bfloat16 or float16 value down to 2**-29 of its row's largest converts
    exactly (float16's normal range); smaller ones round to float16's subnormal step, 2**-38 of
    the largest or finer; float32 values keep float16's 11 bits."""
    af = a.to(tl.float32)
    up, down = _half_scales(tl.max(tl.abs(af), axis=1))
    return (af * up[:, None]).to(tl.float16), down


@triton.jit
def _half_pair(a, b):
    """`_half_rows` of x's even and odd columns (`a`, `b`) at one scale a row: theirs together."""
    af = a.to(tl.float32)
    bf = b.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(af), axis=1), tl.max(tl.abs(bf), axis=1))
    up, down = _half_scales(amax)
    return (af * up[:, None]).to(tl.float16), (bf * up[:, None]).to(tl.float16), down


@triton.jit
def _weight_tile(w_ptr, rows_n, k, k_end, N, stride_wn):
    """The weight's (BLOCK_N, BLOCK_K) tile at columns k, as stored."""
    mask = (rows_n[:, None] < N) & (k[None, :] < k_end)
    return tl.load(w_ptr + rows_n[:, None] * stride_wn + k[None, :], mask=mask, other=0.0)


@triton.jit
def _int4_tile(
    w_ptr, ws_ptr, wz_ptr, rows_n, k0, k_end, N, stride_wn, stride_sn,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    TILE_GROUPS: tl.constexpr, GROUP_COLS: tl.constexpr,
):  # fmt: skip
    """A packed INT4 weight's tile at columns k0 .. k0 + BLOCK_K, read as stored (column k in
    byte k // 2, low four bits for even k): its low and high nibbles, the even and the odd
    columns, (BLOCK_N, TILE_GROUPS, GROUP_COLS // 2) int32 each, and its groups' scales and zero
    points (BLOCK_N, TILE_GROUPS) float32, one load per group (a tile holds TILE_GROUPS whole
    groups, or GROUP_COLS columns of one)."""
    at = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    mask = (rows_n[:, None] < N) & (at[None, :] < k_end // 2)
    packed = tl.load(w_ptr + rows_n[:, None] * stride_wn + at[None, :], mask=mask, other=0)
    packed = tl.reshape(packed.to(tl.int32), (BLOCK_N, TILE_GROUPS, GROUP_COLS // 2))
    groups = k0 // GROUP + tl.arange(0, TILE_GROUPS)
    g_mask = (rows_n[:, None] < N) & (groups[None, :] * GROUP < k_end)
    g_at = rows_n[:, None] * stride_sn + groups[None, :]
    scale = tl.load(ws_ptr + g_at, mask=g_mask, other=0.0)
    zero = tl.load(wz_ptr + g_at, mask=g_mask, other=0.0)
    return packed & 0xF, packed >> 4, scale, zero


@triton.jit
def _nibble_float(q):
    """int32 values 0..15 -> float32, exactly, without an integer-to-float conversion (a
    quarter-rate instruction on recent GPUs, which a 4-bit GEMV would run once per weight): the
    float whose bits are those of 2**23 + q, less 2**23 (two full-rate instructions)."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _word_field(words, FIELD: tl.constexpr):
    """The 4-bit values at bits 4 * FIELD .. 4 * FIELD + 3 (FIELD 0..3) of int32 `words`, times
    16 ** FIELD, in float32, exactly: the field kept in place and OR'd into the mantissa of 2**23
    (one instruction), less 2**23 (values below 2**16 fit the mantissa)."""
    field = (words & (0xF << (4 * FIELD))) | 0x4B000000
    return field.to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _word_tile(w_ptr, rows_n, kg, k_end, N, stride_wn, WORDS: tl.constexpr):
    """The int32 words (BLOCK_N, WORDS) of one group of a packed INT4 weight, columns kg ..
    kg + 8 * WORDS (all or none of them before k_end: splits are whole groups)."""
    at = tl.multiple_of(kg // 8, WORDS) + tl.arange(0, WORDS)
    mask = (rows_n[:, None] < N) & (rows_n[:, None] * 0 + kg < k_end)
    return tl.load(w_ptr + rows_n[:, None] * stride_wn + at[None, :], mask=mask, other=0)


@triton.jit
def _int4_word_sums(
    acc, x_ptr, res_ptr, norm_w_ptr, rstd, w_ptr, ws_ptr, wz_ptr, rows_m, rows_n,
    k_start, k_end, M, N, K, stride_xm, stride_rm, stride_wn, stride_sn,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    """acc (BLOCK_M, BLOCK_N) plus x's columns k_start .. k_end times a packed INT4 weight read
    as int32 words (w_ptr, stride_wn in words): value i of word j (bits 4i .. 4i + 3, as bytes
    store them little-endian) is column 8j + i. A group a step (with PREFETCH the next group's
    words loaded before this one's products): value i of every word meets x's column 8j + i
    (scaled by 16 ** -(i % 4), exactly, to undo `_word_field`'s), the products summed per word,
    then scale * (sum q x - zero * sum x) per word, summed across words once, after the loop.
    Three instructions a weight of its own (a field masked into a float, a subtraction, a fused
    multiply-add), the rest (x's loads, scaled and summed) shared by the rows a thread holds; no
    weight crosses threads."""
    WORDS: tl.constexpr = GROUP // 8
    words_at = tl.arange(0, WORDS)
    # one row of x: the sums (BLOCK_N, WORDS) in the layout the words are loaded in (a third
    # dimension would move every value through shared memory to a layout of its own)
    acc3 = tl.zeros((BLOCK_N, WORDS) if BLOCK_M == 1 else (BLOCK_M, BLOCK_N, WORDS), tl.float32)
    if PREFETCH:
        following = _word_tile(w_ptr, rows_n, k_start, k_end, N, stride_wn, WORDS)
    for kg in range(k_start, k_end, GROUP):
        if PREFETCH:
            lo = following
            following = _word_tile(w_ptr, rows_n, kg + GROUP, k_end, N, stride_wn, WORDS)
        else:
            lo = _word_tile(w_ptr, rows_n, kg, k_end, N, stride_wn, WORDS)
        hi = lo >> 16
        g_at = rows_n * stride_sn + kg // GROUP
        scale = tl.load(ws_ptr + g_at, mask=rows_n < N, other=0.0)
        zero = tl.load(wz_ptr + g_at, mask=rows_n < N, other=0.0)
        for i in tl.static_range(8):
            a = _tile_operand(
                x_ptr, res_ptr, norm_w_ptr, rstd, rows_m, kg + 8 * words_at + i, k_end, M, K,
                stride_xm, stride_rm, PROLOGUE, HAS_RESIDUAL,
            ).to(tl.float32)  # fmt: skip
            if i < 4:
                q = _word_field(lo, i)
            else:
                q = _word_field(hi, i - 4)
            scaled = a * (1.0 / (1 << (4 * (i % 4))))
            if BLOCK_M == 1:
                products = tl.sum(scaled, axis=0)[None, :] * q
            else:
                products = scaled[:, None, :] * q[None, :, :]
            if i == 0:  # (the sums start at the first products: no zeros to add to)
                dots = products
                x_sums = a
            else:
                dots += products
                x_sums += a
        if BLOCK_M == 1:
            x_sum = tl.sum(x_sums, axis=0)[None, :]
            acc3 += scale[:, None] * (dots - zero[:, None] * x_sum)
        else:
            acc3 += scale[None, :, None] * (dots - zero[None, :, None] * x_sums[:, None, :])
    if BLOCK_M == 1:
        acc += tl.sum(acc3, axis=1)[None, :]
    else:
        acc += tl.sum(acc3, axis=2)
    return acc


@triton.jit
def _int4_dequantized(lo, hi, scale, zero, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """An `_int4_tile`'s weights in float32, (BLOCK_N, BLOCK_K): (q - zero) * scale."""
    q = _nibble_float(tl.interleave(lo, hi))  # the columns back in order
    return tl.reshape((q - zero[:, :, None]) * scale[:, :, None], (BLOCK_N, BLOCK_K))


@triton.jit
def _int4_mma_operand(q, dtype: tl.constexpr):
    """int32 values 0..15 -> (c + q in `dtype`, c): float16 1024 + q by one OR into the bits of
    1024 (where float16's step is 1); in float32 q itself, c = 0. (bfloat16's 128 + q, the same
    trick, failed its check against the oracle on an H100: bfloat16 x takes the dequantizing
    tiles, `int4_mma`.)"""
    if dtype == tl.float16:
        return (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True), 1024.0
    else:
        return _nibble_float(q).to(dtype), 0.0


@triton.jit
def _int4_dot_accumulate(
    acc, a_even, a_odd, lo, hi, scale, zero, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):  # fmt: skip
    """acc (BLOCK_M, BLOCK_N) plus x's tile times an `_int4_tile` of one group (TILE_GROUPS 1)
    through tl.dot, x's even columns `a_even` against the low nibbles and its odd ones against
    the high (BLOCK_M, BLOCK_K // 2 each: no reordering of the weights), the stored integers the
    MMA's operand as c + q (`_int4_mma_operand`; float16 and float32 x), and the group's scale
    and zero point (and c)
    applied to the sums, scale * (sum (c + q) x - (c + zero) sum x), not to each weight."""
    w_lo, c = _int4_mma_operand(tl.reshape(lo, (BLOCK_N, BLOCK_K // 2)), a_even.dtype)
    w_hi, _ = _int4_mma_operand(tl.reshape(hi, (BLOCK_N, BLOCK_K // 2)), a_even.dtype)
    sums = tl.dot(a_even, tl.trans(w_lo), input_precision="ieee")  # (BLOCK_M, BLOCK_N) float32
    sums = tl.dot(a_odd, tl.trans(w_hi), sums, input_precision="ieee")
    x_sums = tl.sum(a_even.to(tl.float32), axis=1) + tl.sum(a_odd.to(tl.float32), axis=1)
    s = tl.reshape(scale, (BLOCK_N,))
    z = tl.reshape(zero, (BLOCK_N,))
    return acc + s[None, :] * (sums - (c + z)[None, :] * x_sums[:, None])


@triton.jit
def _int8_tile(
    w_ptr, ws_ptr, wz_ptr, rows_n, k0, k_end, N, stride_wn, stride_sn,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    TILE_GROUPS: tl.constexpr, GROUP_COLS: tl.constexpr, HAS_ZERO: tl.constexpr,
):  # fmt: skip
    """An int8 grouped weight's tile at columns k0 .. k0 + BLOCK_K, read as stored (a byte a
    value) and dequantized, (q - zero) * scale group by group (without HAS_ZERO, q * scale: no
    zero points are read): (BLOCK_N, BLOCK_K) float32."""
    k = k0 + tl.arange(0, BLOCK_K)
    mask = (rows_n[:, None] < N) & (k[None, :] < k_end)
    q = tl.load(w_ptr + rows_n[:, None] * stride_wn + k[None, :], mask=mask, other=0)
    q = tl.reshape(q.to(tl.float32), (BLOCK_N, TILE_GROUPS, GROUP_COLS))
    groups = k0 // GROUP + tl.arange(0, TILE_GROUPS)
    g_mask = (rows_n[:, None] < N) & (groups[None, :] * GROUP < k_end)
    g_at = rows_n[:, None] * stride_sn + groups[None, :]
    scale = tl.load(ws_ptr + g_at, mask=g_mask, other=0.0)
    if HAS_ZERO:
        q = q - tl.load(wz_ptr + g_at, mask=g_mask, other=0.0)[:, :, None]
    return tl.reshape(q * scale[:, :, None], (BLOCK_N, BLOCK_K))


@triton.jit
def _int4_accumulate(
    acc, a, lo, hi, scale, zero,
    BLOCK_M: tl.constexpr, TILE_GROUPS: tl.constexpr, GROUP_COLS: tl.constexpr,
):  # fmt: skip
    """acc (BLOCK_M, BLOCK_N) plus x's tile `a` (BLOCK_M, BLOCK_K) times an `_int4_tile`, group
    by group as scale * (sum q x - zero * sum x): the stored integers multiply x as they are,
    and each group's scale and zero point are applied once per output instead of once per
    weight."""
    pairs = tl.reshape(a.to(tl.float32), (BLOCK_M, TILE_GROUPS, GROUP_COLS // 2, 2))
    even, odd = tl.split(pairs)  # (BLOCK_M, TILE_GROUPS, GROUP_COLS // 2)
    qx = even[:, None] * _nibble_float(lo)[None] + odd[:, None] * _nibble_float(hi)[None]
    dots = tl.sum(qx, axis=3)  # (BLOCK_M, BLOCK_N, TILE_GROUPS)
    x_sums = tl.sum(even + odd, axis=2)  # (BLOCK_M, TILE_GROUPS)
    return acc + tl.sum(scale[None] * (dots - zero[None] * x_sums[:, None, :]), axis=2)


@triton.jit
def _gemv_kernel(
    x_ptr, res_ptr, norm_w_ptr, res_out_ptr, w_ptr, ws_ptr, wz_ptr, b_ptr, y_ptr,
    M, N, K, k_per_split, eps,
    stride_xm, stride_rm, stride_wn, stride_sn, stride_ym,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    W_SCALED: tl.constexpr, W_INT4: tl.constexpr, W_INT8: tl.constexpr, GROUP: tl.constexpr,
    W_CONVERT: tl.constexpr, HAS_ZERO: tl.constexpr,
    TILE_GROUPS: tl.constexpr, GROUP_COLS: tl.constexpr, INT4_MMA: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NORM_BLOCK: tl.constexpr, LATE_SUM: tl.constexpr, PREFETCH: tl.constexpr,
    DOT: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr, WORDS: tl.constexpr,
    HALF: tl.constexpr,
):  # fmt: skip
    """With DOT, BLOCK_M is the MMA's 16 rows and ROWS the rows (a power of two) of x; else they
    are the same. With PDL (launched as a programmatic dependent launch, `fused.pdl_launch`) the
    program lets the next kernel launch at once and waits for the kernel before it to finish
    before it touches x; a prefetching tile's first weight load is issued before that wait
    (weights do not change during a step). With W_SCALED the weights are float8 with a float32
    scale per row (ws_ptr), by which each output's sum (each split's partial sum) is multiplied:
    the weights are read as stored and dequantized in registers. With W_INT4 they are packed INT4
    with a float32 scale and zero point per GROUP columns of a row (ws_ptr, wz_ptr: `_int4_tile`),
    through tl.dot as stored where a tile is one group and x is not bfloat16 (INT4_MMA,
    `_int4_dot_accumulate`), dequantized otherwise, else multiplied group by group (`_int4_accumulate`; no prefetch or
    late sum), or with WORDS read as int32 words (`_int4_word_sums`). With W_INT8 they are int8
    with a scale and zero point per GROUP columns as INT4's, dequantized as read (`_int8_tile`; no
    prefetch). W_CONVERT: a weight tile is turned into x's type for tl.dot (float8, INT4 and int8
    weights). HALF (DOT over float8 or INT4 weights): x's tile goes into the MMA as float16,
    scaled row by row by a power of two (`_half_rows`), the float8 weights converted to
    float16, the INT4 ones as 1024 + q (INT4_MMA)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_K)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if PREFETCH and not WORDS:  # the first tile on its way before the wait and the norm's pass
        w_next = _weight_tile(w_ptr, rows_n, k_start + cols, k_end, N, stride_wn)
    if PDL:
        tl.extra.cuda.gdc_wait()
    rstd = 0.0
    if PROLOGUE == _RMS_NORM:
        write_sum = (pid_n == 0) & (pid_k == 0)
        rstd = _rms_norm_rstd(
            x_ptr, res_ptr, res_out_ptr, stride_xm, stride_rm, K, eps, write_sum,
            HAS_RESIDUAL, ROWS, NORM_BLOCK, M,
        )  # fmt: skip
        if ROWS != BLOCK_M:  # (ROWS,) -> (BLOCK_M,), the padding rows' 0
            pick = rows_m[:, None] == tl.arange(0, ROWS)[None, :]
            rstd = tl.sum(tl.where(pick, rstd[None, :], 0.0), axis=1)
    if LATE_SUM:
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if WORDS:
        acc = _int4_word_sums(
            acc, x_ptr, res_ptr, norm_w_ptr, rstd, w_ptr, ws_ptr, wz_ptr, rows_m, rows_n,
            k_start, k_end, M, N, K, stride_xm, stride_rm, stride_wn, stride_sn,
            PROLOGUE, HAS_RESIDUAL, GROUP, BLOCK_M, BLOCK_N, PREFETCH,
        )  # fmt: skip
    else:
        for k0 in range(k_start, k_end, BLOCK_K):
            k = k0 + cols
            if W_INT4:
                lo, hi, scale, zero = _int4_tile(
                    w_ptr, ws_ptr, wz_ptr, rows_n, k0, k_end, N, stride_wn, stride_sn,
                    GROUP, BLOCK_N, BLOCK_K, TILE_GROUPS, GROUP_COLS,
                )  # fmt: skip
            elif W_INT8:
                w_tile = _int8_tile(
                    w_ptr, ws_ptr, wz_ptr, rows_n, k0, k_end, N, stride_wn, stride_sn,
                    GROUP, BLOCK_N, BLOCK_K, TILE_GROUPS, GROUP_COLS, HAS_ZERO,
                )  # fmt: skip
            elif PREFETCH:
                w_tile = w_next
                w_next = _weight_tile(w_ptr, rows_n, k + BLOCK_K, k_end, N, stride_wn)
            else:
                w_tile = _weight_tile(w_ptr, rows_n, k, k_end, N, stride_wn)
            if INT4_MMA:  # x's even and odd columns, for the nibbles
                even = k0 + 2 * tl.arange(0, BLOCK_K // 2)
                a_even = _tile_operand(
                    x_ptr, res_ptr, norm_w_ptr, rstd, rows_m, even, k_end, M, K, stride_xm,
                    stride_rm, PROLOGUE, HAS_RESIDUAL,
                )  # fmt: skip
                a_odd = _tile_operand(
                    x_ptr, res_ptr, norm_w_ptr, rstd, rows_m, even + 1, k_end, M, K, stride_xm,
                    stride_rm, PROLOGUE, HAS_RESIDUAL,
                )  # fmt: skip
                if HALF:
                    a_even, a_odd, down = _half_pair(a_even, a_odd)
                    part = _int4_dot_accumulate(
                        tl.zeros_like(acc), a_even, a_odd, lo, hi, scale, zero, BLOCK_N, BLOCK_K
                    )  # fmt: skip
                    acc += part * down[:, None]
                else:
                    acc = _int4_dot_accumulate(
                        acc, a_even, a_odd, lo, hi, scale, zero, BLOCK_N, BLOCK_K
                    )  # fmt: skip
            else:
                a = _tile_operand(
                    x_ptr, res_ptr, norm_w_ptr, rstd, rows_m, k, k_end, M, K, stride_xm, stride_rm,
                    PROLOGUE, HAS_RESIDUAL,
                )  # fmt: skip
                if W_INT4 and not DOT:
                    acc = _int4_accumulate(
                        acc, a, lo, hi, scale, zero, BLOCK_M, TILE_GROUPS, GROUP_COLS
                    )  # fmt: skip
                elif W_INT4:
                    w_tile = _int4_dequantized(lo, hi, scale, zero, BLOCK_N, BLOCK_K)
                    acc = _accumulate(acc, a, w_tile, DOT, False, True)
                elif HALF:  # float8 weights, converted exactly to float16
                    a, down = _half_rows(a)
                    part = tl.dot(a, tl.trans(w_tile.to(tl.float16)), input_precision="ieee")
                    acc += part * down[:, None]
                else:
                    acc = _accumulate(acc, a, w_tile, DOT, LATE_SUM, W_CONVERT)
    if LATE_SUM:
        acc = tl.sum(acc, axis=2)
    if W_SCALED:
        acc *= tl.load(ws_ptr + rows_n, mask=rows_n < N, other=0.0)[None, :]
    out_mask = (rows_m[:, None] < M) & (rows_n[None, :] < N)
    if SPLIT:  # float32 partial sums (split, M, N); _sum_splits_kernel finishes
        out = y_ptr + pid_k * M * N + rows_m[:, None] * N + rows_n[None, :]
        tl.store(out, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows_n, mask=rows_n < N, other=0.0).to(tl.float32)[None, :]
        out = y_ptr + rows_m[:, None] * stride_ym + rows_n[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _sum_splits_kernel(
    part_ptr, b_ptr, y_ptr, M, N, splits, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_start(PDL)
    rows_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_m = tl.arange(0, BLOCK_M)
    mask = (rows_m[:, None] < M) & (rows_n[None, :] < N)
    at = rows_m[:, None] * N + rows_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(0, splits):  # in split order: the result does not depend on timing
        acc += tl.load(part_ptr + s * M * N + at, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows_n, mask=rows_n < N, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rows_m[:, None] * stride_ym + rows_n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)


def _norm_block(k: int, block_m: int, config: GemvConfig) -> int:
    """The tile of the norm prologue's pass over x: as wide as 32 float32 values a thread allow,
    so that a row of a model's width is one round of loads."""
    room = 32 * 32 * config.num_warps // block_m
    return min(triton.next_power_of_2(k), room)


def _launch(
    prologue: int,
    x: torch.Tensor,
    k: int,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemvConfig,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    res_out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    w_scale: torch.Tensor | None = None,
    w_zero: torch.Tensor | None = None,
) -> torch.Tensor:
    m = x.shape[0]
    n = weight.shape[0]
    # packed INT4 or int8: a scale (and a zero point) a group
    grouped = weight.dtype in (torch.uint8, torch.int8)
    int4 = weight.dtype == torch.uint8
    if (
        m > (MAX_ROWS if config.dot else MAX_ROWS_WITHOUT_DOT)
        or x.stride(-1) != 1
        or weight.stride(-1) != 1
        or weight.shape[1] != (k // 2 if int4 else k)
    ):
        raise ValueError(
            f"gemv takes up to {MAX_ROWS_WITHOUT_DOT} rows of x ({MAX_ROWS} with a dot tile) and "
            f"a weight (N, {k}) (packed INT4: (N, {k // 2})), unit stride along K; got x "
            f"{tuple(x.shape)}, weight {tuple(weight.shape)}, {config}"
        )
    group = _check_w_scale(weight, k, w_scale, w_zero)
    if config.half and not (
        config.dot
        and (
            weight.dtype == torch.float8_e4m3fn
            or (int4 and int4_mma(group, config.block_k, x.dtype, half=True))
        )
    ):
        raise ValueError(
            f"a half tile is a dot tile over float8 weights or INT4 ones a group or less a tile "
            f"(block_k <= group); got a {weight.dtype} weight, group {group}, {config}"
        )
    if config.words:
        weight = _int4_words(weight, group, config)
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return y
    rows = max(1, triton.next_power_of_2(m))
    block_m = 16 if config.dot else rows
    # whole K tiles per split, and no empty split
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    splits = triton.cdiv(k, k_per_split)
    part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else y
    launch = fused.pdl_options(x)
    _gemv_kernel[(triton.cdiv(n, config.block_n), splits)](
        x, residual if residual is not None else x,
        norm_weight if norm_weight is not None else weight,
        res_out if res_out is not None else y,
        weight, w_scale if w_scale is not None else weight,
        w_zero if w_zero is not None else weight, bias if bias is not None else weight,
        part, m, n, k, k_per_split, eps,
        x.stride(0), residual.stride(0) if residual is not None else 0, weight.stride(0),
        w_scale.stride(0) if grouped else 0, y.stride(0),
        PROLOGUE=prologue, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        W_SCALED=w_scale is not None and not grouped, W_INT4=int4, W_INT8=grouped and not int4,
        GROUP=group, HAS_ZERO=w_zero is not None,
        W_CONVERT=w_scale is not None, **_int4_tiling(group, config.block_k),
        INT4_MMA=int4 and config.dot and int4_mma(group, config.block_k, x.dtype, config.half),
        SPLIT=splits > 1, BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        NORM_BLOCK=_norm_block(k, rows, config),
        LATE_SUM=config.late_sum and not (config.dot or int4),
        PREFETCH=config.prefetch and not config.dot and (config.words or not grouped),
        DOT=config.dot, ROWS=rows, WORDS=config.words, HALF=config.half,
        num_warps=config.num_warps, num_stages=config.num_stages, **launch,
    )  # fmt: skip
    if splits > 1:
        _sum_splits_kernel[(triton.cdiv(n, 128),)](
            part, bias if bias is not None else weight, y, m, n, splits, y.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=rows, BLOCK_N=128, num_warps=4,
            **launch,
        )  # fmt: skip
    return y


def _int4_words(weight: torch.Tensor, group: int, config: GemvConfig) -> torch.Tensor:
    """A packed INT4 weight (uint8, N x K/2) as the int32 words a `words` tile reads (the same
    bytes); ValueError for another weight or a tile that is not whole groups."""
    if (
        weight.dtype != torch.uint8
        or not group
        or config.dot
        or config.block_k % group
        or group % 8
    ):
        raise ValueError(
            f"a words tile reads packed INT4 weights in whole groups of a multiple of 8 columns "
            f"(block_k a multiple of the group, no dot); got a {weight.dtype} weight, group "
            f"{group}, {config}"
        )
    if weight.stride(0) % 4 or weight.storage_offset() % 4 or weight.shape[1] % 4:
        # (no copy here: this runs at every call; tuning passes such a weight by)
        raise ValueError(
            f"a words tile reads whole int32 words a row from an aligned start; got a weight "
            f"{tuple(weight.shape)} of row stride {weight.stride(0)}, offset "
            f"{weight.storage_offset()}"
        )
    return weight.view(torch.int32)


def int4_mma(group: int, block_k: int, dtype: torch.dtype, half: bool = False) -> bool:
    """Whether an INT4 tl.dot tile of `block_k` columns takes the stored integers into the MMA
    (`_int4_dot_accumulate`): a tile within one group, x not bfloat16 or a `half` tile (x made
    float16)."""
    return block_k <= group and (dtype != torch.bfloat16 or half)


def _int4_tiling(group: int, block_k: int) -> dict[str, int]:
    """How a tile of `block_k` columns holds an INT4 weight's groups: TILE_GROUPS whole groups,
    or GROUP_COLS columns of one (the kernel's constants; 1 and block_k for other weights)."""
    if not group:
        return {"TILE_GROUPS": 1, "GROUP_COLS": block_k}
    if block_k % group and group % block_k:
        raise ValueError(
            f"an INT4 tile of {block_k} columns must split or fit in groups of {group}"
        )
    return {"TILE_GROUPS": max(block_k // group, 1), "GROUP_COLS": min(group, block_k)}


def _check_w_scale(
    weight: torch.Tensor, k: int, w_scale: torch.Tensor | None, w_zero: torch.Tensor | None
) -> int:
    """A float8 weight comes with its float32 scale per row (N,); a packed INT4 one (uint8) with
    float32 scales and zero points (N, K // group); an int8 one with scales and, where its
    groups are not symmetric, zero points; a weight of x's type with neither. Returns the
    group (0 for other weights)."""
    if weight.dtype in (torch.uint8, torch.int8) or w_zero is not None:
        n = weight.shape[0]
        groups = w_scale.shape[1] if w_scale is not None and w_scale.dim() == 2 else 0
        zeros = w_zero if w_zero is not None else w_scale
        ok = (
            weight.dtype in (torch.uint8, torch.int8)
            and w_scale is not None
            and (w_zero is not None or weight.dtype == torch.int8)
            and groups > 0
            and k % groups == 0
            and w_scale.shape == zeros.shape == (n, groups)
            and w_scale.dtype == zeros.dtype == torch.float32
            and w_scale.stride() == zeros.stride() == (groups, 1)
        )
        if not ok:
            raise ValueError(
                "gemv takes a packed INT4 weight (uint8, N x K/2) or an int8 one (N x K) with "
                "float32 scales and zero points (an int8 one's optional), contiguous, (N, K // "
                "group) each; got a "
                f"{weight.dtype} weight, "
                f"w_scale {None if w_scale is None else tuple(w_scale.shape)}, "
                f"w_zero {None if w_zero is None else tuple(w_zero.shape)}"
            )
        return k // groups
    fp8 = weight.dtype == torch.float8_e4m3fn
    if fp8 != (w_scale is not None):
        raise ValueError(
            "gemv takes a float8_e4m3fn weight with its scale per row (w_scale), and any other "
            f"weight without one; got a {weight.dtype} weight and "
            f"{'a' if w_scale is not None else 'no'} w_scale"
        )
    if w_scale is not None and (
        w_scale.shape != (weight.shape[0],)
        or w_scale.dtype != torch.float32
        or w_scale.stride(0) != 1
    ):
        raise ValueError(
            f"w_scale must be float32 of shape ({weight.shape[0]},), contiguous; got "
            f"{w_scale.dtype} {tuple(w_scale.shape)}"
        )
    return 0


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig = GemvConfig(),
    out_dtype: torch.dtype | None = None,
    w_scale: torch.Tensor | None = None,
    w_zero: torch.Tensor | None = None,
) -> torch.Tensor:
    """x (M, K) with M <= MAX_ROWS (MAX_ROWS_WITHOUT_DOT unless `config.dot`), weight (N, K),
    unit stride along K -> x @ W.T + b (M, N), in `out_dtype` (default x's; float32: the float32
    sums unrounded). A float8_e4m3fn weight comes
    with `w_scale` (N,) float32: x @ (W * w_scale[:, None]).T, x unquantized (the oracle:
    kernels/quant_ref.py `fp8_linear_ref(..., act_quant=False)`). A packed INT4 weight (uint8,
    (N, K // 2)) or an int8 one (N, K) comes with `w_scale` and `w_zero` (N, K // group) float32
    (the oracle: `grouped_linear_ref`)."""
    return _launch(
        _NONE.value, x, x.shape[1], weight, bias, config, out_dtype=out_dtype, w_scale=w_scale,
        w_zero=w_zero,
    )  # fmt: skip


def gemv_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig = GemvConfig(),
    out_dtype: torch.dtype | None = None,
    w_scale: torch.Tensor | None = None,
    w_zero: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rmsnorm(x + residual) * norm_weight) @ W.T + b, and x + residual (None without a residual),
    as RMSNorm then a linear layer would give them. x and residual (M, K), norm_weight (K,) of x's
    dtype. The product is in `out_dtype` (default x's; float32: the float32 sums unrounded). A
    float8, INT4 or int8 weight comes with `w_scale` (and `w_zero`), as in `gemv`."""
    if norm_weight.dtype != x.dtype or (residual is not None and residual.shape != x.shape):
        raise ValueError(
            "gemv_rms_norm takes a norm weight of x's dtype and a residual of its shape"
        )
    if residual is not None and residual.stride(-1) != 1:
        raise ValueError("gemv_rms_norm takes a residual with unit stride along K")
    res_out = (
        torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    )
    y = _launch(
        _RMS_NORM.value, x, x.shape[1], weight, bias, config,
        residual=residual, norm_weight=norm_weight, eps=eps, res_out=res_out, out_dtype=out_dtype,
        w_scale=w_scale, w_zero=w_zero,
    )  # fmt: skip
    return y, res_out


def gemv_silu_and_mul(
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig = GemvConfig(),
    w_scale: torch.Tensor | None = None,
    w_zero: torch.Tensor | None = None,
) -> torch.Tensor:
    """(silu(gate) * up) @ W.T + b for gate_up (M, 2K) = [gate | up], weight (N, K); a float8,
    INT4 or int8 weight comes with `w_scale` (and `w_zero`), as in `gemv`."""
    k = weight.shape[1] * (2 if weight.dtype == torch.uint8 else 1)
    if gate_up.shape[1] != 2 * k:
        raise ValueError(
            f"gemv_silu_and_mul takes gate_up (M, 2K) for a weight (N, K); got "
            f"{tuple(gate_up.shape)} and {tuple(weight.shape)}"
        )
    return _launch(
        _SILU_AND_MUL.value, gate_up, k, weight, bias, config, w_scale=w_scale, w_zero=w_zero
    )


# Candidate tiles (block_n, block_k, num_warps, num_stages, split_k[, late_sum, prefetch, dot]):
# short tiles for many programs on short weights, split-K for long K over few output rows
# (down_proj); the late-sum, prefetching ones hold two weight tiles and a float32 product a weight
# element; the dot ones pipeline `num_stages` weight tiles through shared memory (128 columns:
# one INT4 group a tile, whose integers go into the MMA as stored for float16 x).
_T, _F = True, False
CONFIGS = [
    GemvConfig(*c)
    for c in [
        (4, 2048, 4, 2, 1), (4, 1024, 2, 2, 1), (8, 1024, 4, 2, 1), (4, 2048, 8, 2, 1),
        (4, 1024, 4, 2, 1), (2, 1024, 4, 2, 1), (8, 512, 4, 3, 1), (8, 256, 4, 3, 1),
        (16, 256, 4, 3, 1), (4, 512, 2, 2, 1), (8, 512, 4, 3, 4), (4, 1024, 4, 2, 4),
        (4, 512, 4, 1, 1, _T, _T), (8, 512, 4, 1, 1, _T, _T), (8, 256, 4, 1, 1, _T, _T),
        (16, 256, 4, 1, 1, _T, _T), (4, 1024, 8, 1, 1, _T, _T), (8, 1024, 8, 1, 1, _T, _T),
        (8, 512, 4, 1, 1, _T, _F), (4, 2048, 4, 1, 1, _F, _T), (8, 512, 4, 1, 4, _T, _T),
        (4, 1024, 4, 1, 4, _T, _T),
        (32, 128, 4, 4, 1, _F, _F, _T), (32, 256, 4, 3, 1, _F, _F, _T),
        (64, 128, 4, 4, 1, _F, _F, _T), (64, 128, 4, 6, 1, _F, _F, _T),
        (16, 256, 4, 4, 1, _F, _F, _T), (32, 128, 4, 4, 2, _F, _F, _T),
        (32, 256, 4, 3, 4, _F, _F, _T), (64, 128, 4, 4, 4, _F, _F, _T),
        (16, 128, 4, 4, 4, _F, _F, _T), (128, 128, 8, 4, 1, _F, _F, _T),
    ]
]  # fmt: skip
# Packed INT4 weights also try these `words` tiles (a group a step; block_k the unit of a split):
# more rows a program (block_n over 8 rows a warp) share each load of x among more weights, and
# split-K gives the layers of few rows enough programs.
INT4_CONFIGS = [
    GemvConfig(*c, words=True)
    for c in [
        (128, 128, 4, 1, 1), (256, 128, 4, 1, 1), (128, 128, 2, 1, 1), (256, 128, 8, 1, 1),
        (128, 128, 4, 1, 4), (256, 128, 4, 1, 4), (128, 128, 2, 1, 4), (256, 128, 4, 1, 8),
        (128, 128, 4, 1, 1, _F, _T), (256, 128, 4, 1, 1, _F, _T), (256, 128, 4, 1, 4, _F, _T),
        (128, 128, 2, 1, 4, _F, _T), (128, 128, 4, 3, 1), (256, 128, 4, 2, 4),
        (512, 128, 4, 1, 1), (512, 128, 4, 1, 4), (512, 128, 8, 1, 2),
    ]
]  # fmt: skip
# Float8 weights also try these: a byte a weight, so a tile of CONFIGS' block_k has half a bf16
# tile's bytes in flight; wider tiles (and more of them a program) load as much as bf16's do.
FP8_CONFIGS = [
    GemvConfig(*c)
    for c in [
        (4, 4096, 4, 2, 1), (4, 4096, 8, 2, 1), (8, 4096, 8, 2, 1), (2, 4096, 4, 2, 1),
        (4, 4096, 4, 3, 1), (8, 2048, 4, 3, 1), (4, 4096, 4, 2, 2), (8, 4096, 8, 2, 4),
        (4, 2048, 4, 3, 2), (4, 2048, 4, 1, 1, _T, _T), (8, 2048, 8, 1, 1, _T, _T),
        (4, 4096, 8, 1, 1, _F, _T),
    ]
]  # fmt: skip
# Float8 and packed INT4 weights also try these dot tiles with x as float16 (`half`): an INT4 tile
# is a group or less (128 columns; 64 and 32 for smaller groups, GGUF's 4-bit blocks' 32), a
# float8 one up to 512 (a byte a weight).
HALF_CONFIGS = [
    GemvConfig(*c, dot=True, half=True)
    for c in [
        (32, 128, 4, 4, 1), (64, 128, 4, 4, 1), (64, 128, 4, 6, 1), (128, 128, 8, 4, 1),
        (32, 128, 4, 4, 2), (64, 128, 4, 4, 4), (16, 128, 4, 4, 4), (128, 128, 4, 3, 1),
        (32, 256, 4, 3, 1), (64, 256, 4, 3, 1), (32, 256, 4, 3, 4), (64, 256, 8, 4, 1),
        (32, 512, 4, 3, 1), (64, 512, 8, 3, 1), (16, 512, 4, 3, 2), (64, 64, 4, 4, 1),
        (128, 64, 4, 4, 1), (64, 32, 4, 4, 1),
    ]
]  # fmt: skip
# The fused kernels try the fastest two tiles of the plain kernel for the shape, and these: more
# output rows per program spread the prologue's work (a norm, exp) over more weight rows.
FUSED_CONFIGS = [
    GemvConfig(*c)
    for c in [
        (8, 1024, 4, 2, 1), (8, 2048, 8, 2, 1), (16, 1024, 8, 2, 1), (16, 2048, 8, 2, 1),
        (32, 512, 8, 2, 1), (8, 1024, 4, 2, 4), (16, 512, 8, 1, 1, _T, _T),
        (32, 256, 8, 1, 1, _T, _T), (16, 256, 4, 1, 1, _T, _T), (8, 1024, 8, 1, 1, _T, _T),
        (32, 128, 4, 4, 1, _F, _F, _T), (64, 128, 4, 4, 1, _F, _F, _T),
        (32, 256, 4, 3, 4, _F, _F, _T),
    ]
]  # fmt: skip

OPS = ("linear", "rms_norm", "rms_norm_residual", "silu_and_mul")


def fused_gemv_enabled() -> bool:
    """Tune the norm / SiLU prologue kernels, unless RADIXLM_DISABLE_FUSED=1 (every fused kernel
    off) or RADIXLM_DISABLE_FUSED_GEMV=1 (only these)."""
    return not fused.switched_off() and os.environ.get("RADIXLM_DISABLE_FUSED_GEMV") != "1"
