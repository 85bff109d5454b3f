"""Fused Triton kernels for the small per-layer operations of a decoder.

At small batches a decode step is launch-bound: each of these replaces several torch kernels
(casts, a reduction, elementwise ops) with one, with the same rounding as their plain-torch twins
beside them in kernels/fused_ref.py (compute in float32, round to the activation dtype where torch
rounds), which are the CPU path and the oracle.

- `rms_norm(x, weight, eps, residual)`: optionally add the residual (rounded to x's dtype), then
  RMSNorm in float32, round, multiply by the weight. Returns (out, new residual).
- `rope_(qk, positions, cos, sin)`: rotate the q and k heads of each token in place (half-split
  layout), cos/sin looked up from the (max_positions, head_dim / 2) float32 tables.
- `rope_store_kv_(q, k, v, positions, cos, sin, k_pool, v_pool, loc)`: rotate q in place and
  write the rotated k and v into the KV pool at slots `loc`, in place of `rope_` and the two
  `index_copy_` of the store (a float8 pool: quantized with its scales, `kv_store_value`).
- `silu_and_mul(gate_up)`: silu(gate) * up over the two halves of the last dimension.
- `fp8_quantize_rows(x)`: each row rounded to float8 e4m3 at a scale of its own (FP8 W8A8's
  activations; its twin is kernels/quant_ref.py `quantize_fp8_rows`).

The rounding recipes are small @triton.jit helpers (`add_rounded`, `norm_then_weight`,
`silu_mul_rounded`) that kernels/gemv.py's prologues call too, so the two cannot drift apart.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


def switched_off() -> bool:
    """RADIXLM_DISABLE_FUSED=1: every fused kernel off, the torch code on CUDA too."""
    return os.environ.get("RADIXLM_DISABLE_FUSED") == "1"


def pdl_launch(x: torch.Tensor) -> bool:
    """Launch the kernels on x's device as programmatic dependent launches: on CUDA GPUs of
    compute capability 9.0 and later (Hopper), for steps of at most `pdl_max_tokens()` tokens
    (x's first dimension), unless RADIXLM_DISABLE_PDL=1. A kernel so launched may start while the
    one before it still runs (inside a CUDA graph too), so it lets the next one start as early
    (`pdl_start`) and waits (`gdc_wait`) before it reads or writes anything but weights. In a
    small decode step this hides most of each launch's latency."""
    return (
        x.is_cuda
        and x.dim() > 0
        and x.shape[0] <= pdl_max_tokens()
        and os.environ.get("RADIXLM_DISABLE_PDL") != "1"
        and _HAS_GDC
        and _capability(x.device.index) >= (9, 0)
    )


def pdl_max_tokens() -> int:
    """The largest step (in tokens) launched with PDL: RADIXLM_PDL_MAX_TOKENS, else 32. PDL pays
    in small steps (batch-1 decode on an H200: 2,020 against 1,639 tok/s on the SmolLM2 shape,
    234 against 223 on the Llama-3.1-8B one) and costs in large ones (1,000 requests offline on
    the SmolLM2 shape: 92.6k against 100.9k output tok/s): there the next kernel's programs,
    launched early, wait on SMs that the running kernel's programs need."""
    return int(os.environ.get("RADIXLM_PDL_MAX_TOKENS", "32"))


# grid dependency control (gdc_wait, launch_pdl) is in recent Tritons only: without it, no PDL
_HAS_GDC = hasattr(getattr(getattr(tl, "extra", None), "cuda", None), "gdc_wait")


def pdl_options(x: torch.Tensor) -> dict:
    """The keywords of a launch of a kernel taking `PDL: tl.constexpr` (see `pdl_start`) for
    tensors like x: its PDL flag, and the launch option when it is on."""
    return {"PDL": True, "launch_pdl": True} if pdl_launch(x) else {"PDL": False}


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """Under a programmatic dependent launch: let the next kernel launch, then wait for the one
    before to finish (its writes visible). Every program of a PDL kernel calls this before its
    first read of activations: a program that skipped it could finish before the kernel before
    it, and the kernel after would then no longer wait for that one."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


def enabled(x: torch.Tensor) -> bool:
    """Use the fused kernels for this tensor: on CUDA, unless RADIXLM_DISABLE_FUSED=1."""
    return x.is_cuda and not switched_off()


@triton.jit
def add_rounded(x, r):
    """x + r in float32, rounded to x's dtype as torch's add rounds it."""
    return (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)


@triton.jit
def norm_then_weight(x, rstd, w):
    """x * rstd rounded to x's dtype (as RMSNorm rounds before its weight), times w: float32."""
    h = (x.to(tl.float32) * rstd).to(x.dtype)
    return h.to(tl.float32) * w.to(tl.float32)


@triton.jit
def silu_mul_rounded(gate, up):
    """silu(gate) * up, each rounded to gate's dtype as torch's F.silu and mul round them."""
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    return (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def fp8_e4m3_round(x):
    """float32 x rounded to the nearest float8_e4m3fn value (ties to even, saturated at +-448),
    still float32: the cast to float8 after it is then exact. Done on the bits rather than left
    to the cast because Triton's CPU interpreter rounds float8 casts wrongly (a carry out of the
    mantissa is dropped: 7.95 becomes 4)."""
    a = tl.minimum(tl.abs(x), 448.0)
    bits = a.to(tl.int32, bitcast=True)
    # keep 3 of float32's 23 mantissa bits, to nearest even (a carry moves into the exponent)
    bits = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) << 20
    r = bits.to(tl.float32, bitcast=True)
    # below float8's smallest normal (2^-6) its step is a fixed 2^-9: a * 512 (exact) rounded to
    # an integer, to nearest even, by float32's own addition at 2^23, where the step is 1 (one
    # rounding: adding 2^-6 first, as this did before, rounded twice, and a value just short of
    # a tie went the tie's way)
    steps = (a * 512.0 + 8388608.0) - 8388608.0
    r = tl.where(a < 0.015625, steps * 0.001953125, r)
    # (the sign bit, so that -0.0 stays -0.0 as torch's cast keeps it: a norm's output can be one)
    return tl.where(x.to(tl.int32, bitcast=True) < 0, -r, r)


@triton.jit
def kv_store_value(x, inv_scale, ty: tl.constexpr):
    """x as a KV pool of element type `ty` stores it: a float8 pool x * inv_scale (1 / the
    layer's scale), rounded as `fp8_e4m3_round`; any other pool x cast (kernels/attention_ref.py
    `quantize_kv` is the twin)."""
    if ty == tl.float8e4nv:
        return fp8_e4m3_round(x.to(tl.float32) * inv_scale).to(ty)
    else:
        return x.to(ty)


@triton.jit
def _rotate_half_split(base, c, s, mask, HALF: tl.constexpr):
    """The heads at `base` (half-split layout) rotated by cos c and sin s: the two halves, each
    rounded to the heads' dtype."""
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    return (x1f * c - x2f * s).to(x1.dtype), (x2f * c + x1f * s).to(x1.dtype)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, s_ptr,
    stride_x, stride_res, stride_out, stride_res_out,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr, FP8_OUT: tl.constexpr,
):  # fmt: skip
    """FP8_OUT: the normed row, rounded to x's dtype, is stored rounded to float8 at a scale of
    its own (s_ptr), as `fp8_quantize_rows` would store it: out_ptr is then float8."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    pdl_start(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = add_rounded(x, r)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    out = norm_then_weight(x, rstd, w)
    if FP8_OUT:
        normed = out.to(x.dtype).to(tl.float32)
        _fp8_row_store(normed, mask, out_ptr + row * stride_out + cols, s_ptr + row)
    else:
        tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x (T, N) with unit stride in the last dimension; returns (out, x + residual or None)."""
    rows, n = x.shape
    out = torch.empty(rows, n, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res_out = torch.empty_like(x) if residual is not None else None
    if rows == 0:
        return out, res_out
    _launch_rms_norm(x, weight, eps, residual, out, res_out, None)
    return out, res_out


def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`rms_norm` whose output, rounded to x's dtype as it would be, is stored rounded to float8
    with a float32 scale per row, as `fp8_quantize_rows` of it gives them, bit for bit: (values
    (T, N) float8_e4m3fn, scales (T, 1), x + residual or None). The activations of an FP8 W8A8
    matmul after a norm, without the norm's output in memory between two kernels. The weight
    is of x's dtype."""
    rows, n = x.shape
    if weight.dtype != x.dtype:
        raise ValueError("rms_norm_fp8 takes a norm weight of x's dtype")
    q = torch.empty(rows, n, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else None
    if rows:
        _launch_rms_norm(x, weight, eps, residual, q, res_out, scale)
    return q, scale, res_out


def _launch_rms_norm(x, weight, eps, residual, out, res_out, scale) -> None:
    """`_rms_norm_kernel` over x's rows into `out` (with `scale`: float8 values and their scales)."""
    rows, n = x.shape
    res = residual if residual is not None else x
    _rms_norm_kernel[(rows,)](
        x, res, weight, out, res_out if res_out is not None else out,
        scale if scale is not None else weight,
        x.stride(0), res.stride(0), out.stride(0),
        res_out.stride(0) if res_out is not None else 0,
        n, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n),
        num_warps=4 if n <= 2048 else 8, FP8_OUT=scale is not None, **pdl_options(x),
    )  # fmt: skip


@triton.jit
def _rope_kernel(
    qk_ptr, pos_ptr, cos_ptr, sin_ptr,
    stride_t, stride_h, n_heads,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < n_heads) & (dims < HALF)
    pos = tl.load(pos_ptr + t)
    c = tl.load(cos_ptr + pos * HALF + dims, mask=dims < HALF, other=0.0)
    s = tl.load(sin_ptr + pos * HALF + dims, mask=dims < HALF, other=0.0)
    base = qk_ptr + t * stride_t + heads * stride_h + dims
    out1, out2 = _rotate_half_split(base, c, s, mask, HALF)
    tl.store(base, out1, mask=mask)
    tl.store(base + HALF, out2, mask=mask)


def rope_(
    qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Rotate qk (T, H, D) in place (unit stride in D; any token and head strides)."""
    tokens, heads, dim = qk.shape
    if tokens:
        half = dim // 2
        _rope_kernel[(tokens,)](
            qk, positions, cos, sin, qk.stride(0), qk.stride(1), heads,
            HALF=half, BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(half),
            num_warps=4,
        )  # fmt: skip
    return qk


@triton.jit
def _rope_store_kv_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, k_pool_ptr, v_pool_ptr, loc_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ks, stride_kph, stride_vs, stride_vph, n_q_heads, n_kv_heads, k_inv_scale, v_inv_scale,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl_start(PDL)
    t = tl.program_id(0)
    dims = tl.arange(0, BLOCK_D)[None, :]
    pos = tl.load(pos_ptr + t)
    c = tl.load(cos_ptr + pos * HALF + dims, mask=dims < HALF, other=0.0)
    s = tl.load(sin_ptr + pos * HALF + dims, mask=dims < HALF, other=0.0)
    # q: rotated where it lies, as rope_
    heads = tl.arange(0, BLOCK_HQ)[:, None]
    mask = (heads < n_q_heads) & (dims < HALF)
    base = q_ptr + t * stride_qt + heads * stride_qh + dims
    out1, out2 = _rotate_half_split(base, c, s, mask, HALF)
    tl.store(base, out1, mask=mask)
    tl.store(base + HALF, out2, mask=mask)
    # k: rotated (rounded to k's dtype, as rope_ leaves it) into the pool; v copied
    slot = tl.load(loc_ptr + t).to(tl.int64)
    heads = tl.arange(0, BLOCK_HKV)[:, None]
    mask = (heads < n_kv_heads) & (dims < HALF)
    base = k_ptr + t * stride_kt + heads * stride_kh + dims
    out1, out2 = _rotate_half_split(base, c, s, mask, HALF)
    pool_ty: tl.constexpr = k_pool_ptr.dtype.element_ty
    out = k_pool_ptr + slot * stride_ks + heads * stride_kph + dims
    tl.store(out, kv_store_value(out1, k_inv_scale, pool_ty), mask=mask)
    tl.store(out + HALF, kv_store_value(out2, k_inv_scale, pool_ty), mask=mask)
    v_ty: tl.constexpr = v_pool_ptr.dtype.element_ty
    for half in tl.static_range(2):  # v in two halves: BLOCK_D covers half a head
        val = tl.load(v_ptr + t * stride_vt + heads * stride_vh + half * HALF + dims, mask=mask)
        out = v_pool_ptr + slot * stride_vs + heads * stride_vph + half * HALF + dims
        tl.store(out, kv_store_value(val, v_inv_scale, v_ty), mask=mask)


def rope_store_kv_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    loc: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Rotate q (T, Hq, D) in place and write rotated k and v (T, Hkv, D) into the pools
    (S, Hkv, D) at slots `loc` (T,); k itself is left as it was. Unit stride in D everywhere.
    Float8 pools store k / k_scale and v / v_scale. Returns q."""
    tokens, q_heads, dim = q.shape
    kv_heads = k.shape[1]
    if tokens:
        half = dim // 2
        _rope_store_kv_kernel[(tokens,)](
            q, k, v, positions, cos, sin, k_pool, v_pool, loc,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
            q_heads, kv_heads, 1.0 / k_scale, 1.0 / v_scale,
            HALF=half, BLOCK_HQ=triton.next_power_of_2(q_heads),
            BLOCK_HKV=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(half),
            num_warps=4, **pdl_options(q),
        )  # fmt: skip
    return q


@triton.jit
def _silu_and_mul_kernel(
    gu_ptr, out_ptr, stride_gu, stride_out, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    pdl_start(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0)
    up = tl.load(gu_ptr + row * stride_gu + n_cols + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, silu_mul_rounded(gate, up), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (T, 2I) -> silu(gate_up[:, :I]) * gate_up[:, I:] (T, I)."""
    rows, width = gate_up.shape
    n = width // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block,
            num_warps=4, **pdl_options(gate_up),
        )  # fmt: skip
    return out


@triton.jit
def _fp8_row_store(x, mask, q_at, s_at):
    """Store a row of float32 values `x` (masked columns 0) as float8 at the row's scale (its
    largest magnitude / 448, at least 1e-12), as kernels/quant_ref.py `quantize_fp8_rows`
    rounds: the values at q_at, the scale at s_at."""
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / 448.0, 1e-12)
    q = fp8_e4m3_round(tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0))
    tl.store(q_at, q.to(q_at.dtype.element_ty), mask=mask)
    tl.store(s_at, scale)


@triton.jit
def _fp8_rows_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr, PDL: tl.constexpr,
    ONE_PASS: tl.constexpr,
):  # fmt: skip
    """A row a program. ONE_PASS: the whole row in one tile, read once and kept in registers;
    else tiles of BLOCK, read twice (for the scale, then the values: the second time from L2)."""
    pdl_start(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    if ONE_PASS:
        whole = cols < K
        values = tl.load(x_ptr + row * stride_x + cols, mask=whole, other=0.0).to(tl.float32)
        _fp8_row_store(values, whole, q_ptr + row * stride_q + cols, s_ptr + row)
        return
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_x + k0 + cols, mask=k0 + cols < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.maximum(tl.max(amax, axis=0) / 448.0, 1e-12)
    for k0 in range(0, K, BLOCK):  # (the row again, from L2)
        mask = k0 + cols < K
        x = tl.load(x_ptr + row * stride_x + k0 + cols, mask=mask, other=0.0).to(tl.float32)
        q = fp8_e4m3_round(tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0))
        tl.store(q_ptr + row * stride_q + k0 + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


def fp8_quantize_rows(
    x: torch.Tensor, one_pass_columns: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (T, K) -> (float8_e4m3fn values (T, K), float32 scales (T, 1)), a scale per row (a
    token's): kernels/quant_ref.py `quantize_fp8_rows` in one kernel instead of seven (the
    activations of an FP8 W8A8 matmul), with its results bit for bit. `one_pass_columns`: rows
    up to this wide (rounded up to a power of two) are read once (default
    `_FP8_ONE_PASS_COLUMNS`; benchmarks/fp8_rows.py compares)."""
    rows, k = x.shape
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        width = triton.next_power_of_2(k)
        limit = _FP8_ONE_PASS_COLUMNS if one_pass_columns is None else one_pass_columns
        one_pass = width <= limit
        _fp8_rows_kernel[(rows,)](
            x, q, scale, k, x.stride(0), q.stride(0), BLOCK=width if one_pass else 2048,
            ONE_PASS=one_pass, num_warps=min(max(width // 1024, 4), 16) if one_pass else 4,
            **pdl_options(x),
        )  # fmt: skip
    return q, scale


# rows up to this wide are quantized in one pass, the row in registers (32 values a thread, 4-8
# warps); wider ones in tiles, read twice. Not 16,384: on an H200 (benchmarks/fp8_rows.py)
# 600 rows of 14,336 took 32.3 us in one pass (16 warps a program, 32 values a thread: most
# likely too many registers for more than a program an SM) against 25.3 us in two; 4,096-wide
# rows measured alike either way (both near the launch's own time there)
_FP8_ONE_PASS_COLUMNS = 8192


@triton.jit
def _decode_inputs_kernel(
    rows_ptr, seq_lens_ptr, slots_ptr, table_ptr, stride_table, token_buf_ptr,
    ids_ptr, positions_ptr, n, BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    row = tl.load(rows_ptr + i, mask=mask, other=0)
    pos = tl.maximum(tl.load(seq_lens_ptr + i, mask=mask, other=1) - 1, 0)
    slot = tl.load(slots_ptr + i, mask=mask, other=0)
    tl.store(table_ptr + row * stride_table + pos, slot.to(table_ptr.dtype.element_ty), mask=mask)
    tl.store(ids_ptr + i, tl.load(token_buf_ptr + row, mask=mask, other=0), mask=mask)
    tl.store(positions_ptr + i, pos, mask=mask)


def decode_inputs(
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    slots: torch.Tensor,
    req_to_token: torch.Tensor,
    token_buf: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's inputs in one kernel: each request (row `rows[i]`, sequence length
    `seq_lens[i]` with its new token, whose KV slot is `slots[i]`) writes the slot into
    `req_to_token[row, position]` and reads its input token from `token_buf[row]`, position being
    seq_len - 1 (0 for a padding row of length 0). Returns (input ids, positions), int64, as
    `token_buf[rows]` and `(seq_lens - 1).clamp(min=0)` would."""
    n = rows.shape[0]
    ids = torch.empty(n, dtype=torch.int64, device=rows.device)
    positions = torch.empty(n, dtype=torch.int64, device=rows.device)
    if n:
        block = min(1024, triton.next_power_of_2(n))
        _decode_inputs_kernel[(triton.cdiv(n, block),)](
            rows, seq_lens, slots, req_to_token, req_to_token.stride(0), token_buf,
            ids, positions, n, BLOCK=block, num_warps=4,
        )  # fmt: skip
    return ids, positions
