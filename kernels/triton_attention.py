"""Triton attention over the per-token KV pool: the GPU path of `kernels/attention_ref.py`.

Layout and semantics are those of the reference (read its module docstring): `k_pool`/`v_pool` are
(num_slots, num_kv_heads, head_dim) of one layer, `req_to_token` maps a request's positions to slots,
queries are packed request after request, and the new tokens' K/V are already in the pool.

- `decode_attention`: flash-decoding. Stage 1 runs one program per (request, kv head, kv split); it
  loads the whole query-head group of its kv head, so each K/V tile is read once for the group, and
  writes a partial output and its log-sum-exp to scratch. Stage 2 merges the splits per query head
  (with one split, stage 1 writes the output and stage 2 is skipped). Nothing in it reads a tensor
  on the host, so it can be captured in a CUDA graph. Given `DecodeRope`, stage 1 also does the
  rope and K/V store of the new token that would otherwise be a kernel of its own.
- `extend_attention`: a ragged batch of prefix + new tokens, one program per (block of new tokens,
  request, kv head). Rows of a tile are (token, query head of the group) pairs, so GQA again reads
  each K/V tile once per group. Online softmax in fp32; the prefix is visible to every new token,
  the new tokens are causal among themselves. For a CUDA graph, whose grid is fixed, the tiles can
  instead be listed (`extend_blocks`), one program each.
- `store_kv`: plain `index_copy_` (see its docstring for why).

Pools may be fp32, fp16 or bf16, or float8_e4m3fn read through per-layer scales (`k_scale`,
`v_scale`; see the reference's docstring): a float8 tile is widened to q's dtype in registers as it
is loaded, k_scale is folded into the softmax scale and v_scale into the output, so a step reads half
the bytes of a 16-bit pool and does no extra pass. Accumulation is fp32. Head dims that are not a
power of two are padded to the next one inside the kernels and masked.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from radixlm.kernels.attention_ref import is_quantized, quantize_kv
from radixlm.kernels.fused import kv_store_value, pdl_options, pdl_start

_LOG2E = 1.4426950408889634  # the kernels use exp2, so the softmax scale is folded with log2(e)


@dataclass(frozen=True, slots=True)
class TileConfig:
    """Launch parameters; `block_m` is the number of query rows of an extend tile (unused by decode)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # extend: K tiles loaded a key a row (unit stride along the head dim) and transposed in
    # registers, instead of loaded transposed through the pointers
    k_rows: bool = False


class DecodeScratch(NamedTuple):
    """fp32 buffers that stage 1 of decode writes and stage 2 reads.

    `partial_out` (max_batch, num_q_heads, num_kv_splits, head_dim) and `partial_lse`
    (max_batch, num_q_heads, num_kv_splits). Allocate once with `alloc_decode_scratch` and pass the
    same buffers to every call (a batch smaller than max_batch uses the leading rows).
    """

    partial_out: torch.Tensor
    partial_lse: torch.Tensor


class DecodeRope(NamedTuple):
    """The new token's unrotated k and v (B, Hkv, D), its position (B,), the rope tables
    cos/sin (positions, D // 2) and its KV slot (B,): with these `decode_attention` takes q
    unrotated and does what `kernels.fused.rope_store_kv_` would before it (rotating q, storing the
    rotated k and v), saving that kernel's launch."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    loc: torch.Tensor


def alloc_decode_scratch(
    max_batch: int,
    num_q_heads: int,
    head_dim: int,
    num_kv_splits: int,
    device: torch.device | str,
) -> DecodeScratch:
    """Scratch for `decode_attention` calls of up to `max_batch` requests."""
    return DecodeScratch(
        torch.empty(
            max_batch, num_q_heads, num_kv_splits, head_dim, dtype=torch.float32, device=device
        ),
        torch.empty(max_batch, num_q_heads, num_kv_splits, dtype=torch.float32, device=device),
    )


# ---------------------------------------------------------------------------------------------
# store


def store_kv(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write new keys/values (T, Hkv, D) into the pool at slots `loc` (T,) (a float8 pool: k /
    k_scale and v / v_scale, quantized as `attention_ref.quantize_kv`).

    Plain `index_copy_` rather than a kernel: it is one launch per pool, reads nothing on the host
    (graph-capturable), works on strided per-layer views, and a Triton version could only match it;
    the place where a kernel would pay off is fusing the store into the rope/qkv epilogue.
    """
    idx = loc if loc.dtype == torch.int64 else loc.long()
    for pool, x, scale in ((k_pool, k, k_scale), (v_pool, v, v_scale)):
        if is_quantized(pool):  # (as bytes: index_copy_ has no float8 kernel)
            pool.view(torch.uint8).index_copy_(
                0, idx, quantize_kv(x, scale, pool.dtype).view(torch.uint8)
            )
        else:
            pool.index_copy_(0, idx, x.to(pool.dtype))


# ---------------------------------------------------------------------------------------------
# decode


@triton.jit
def _decode_partial_kernel(
    Q,  # (B, Hq, D)
    K,  # (S, Hkv, D)
    V,  # (S, Hkv, D)
    ReqToToken,  # (R, C) int32
    ReqPoolIndices,  # (B,)
    SeqLens,  # (B,)
    PartialOut,  # (>=B, Hq, NUM_KV_SPLITS, D) fp32; with one split, the output (B, Hq, D)
    PartialLse,  # (>=B, Hq, NUM_KV_SPLITS) fp32, log2 units
    Knew,  # with ROPE: the new token's unrotated k (B, Hkv, D); v, position, tables, slot
    Vnew,
    Pos,
    Cos,  # (positions, HEAD_DIM // 2)
    Sin,
    Loc,
    qk_scale,  # sm_scale * log2(e) * k_scale
    v_scale,
    k_inv_scale,  # with ROPE, into a float8 pool: 1 / k_scale and 1 / v_scale
    v_inv_scale,
    num_kv_splits,
    stride_knb,
    stride_knh,
    stride_vnb,
    stride_vnh,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_rt,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    GROUP: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    ROPE: tl.constexpr,  # q unrotated; rotate it, and store the new k (rotated) and v first
    F16_DOTS: tl.constexpr,  # a float8 pool read with bf16 q: the dots in fp16 (see below)
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    batch = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_BLOCKS
    head_block = tl.program_id(1) % HEAD_BLOCKS
    split = tl.program_id(2)

    seq_len = tl.load(SeqLens + batch).to(tl.int32)
    req = tl.load(ReqPoolIndices + batch).to(tl.int64)
    # at least a tile a split: a short sequence uses only its first few splits (the rest are
    # empty and exit at once), as many splits of a few keys each cost more than they share
    split_len = tl.maximum(tl.cdiv(seq_len, num_kv_splits), BLOCK_N)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = head_block * BLOCK_H + tl.arange(0, BLOCK_H)  # query head within the group
    head_mask = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM

    q = tl.load(
        Q + batch * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=head_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # (BLOCK_H, BLOCK_D)
    if ROPE:
        # rotate-half rope as kernels/fused.py's rope_store_kv_ computes it (same expressions,
        # fp32, rounded to the input's dtype): dim d pairs with d +- HEAD_DIM // 2
        half: tl.constexpr = HEAD_DIM // 2
        first = offs_d < half
        partner = tl.where(first, offs_d + half, offs_d - half)
        pos = tl.load(Pos + batch).to(tl.int64)
        c = tl.load(Cos + pos * half + offs_d % half, mask=d_mask, other=0.0)
        sn = tl.load(Sin + pos * half + offs_d % half, mask=d_mask, other=0.0)
        qp = tl.load(
            Q + batch * stride_qb + heads[:, None] * stride_qh + partner[None, :],
            mask=head_mask[:, None] & d_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        qf = q.to(tl.float32)
        q = tl.where(
            first[None, :], qf * c[None, :] - qp * sn[None, :], qf * c[None, :] + qp * sn[None, :]
        ).to(q.dtype)
        # the programs whose split holds the new token's position store its K/V (each head block
        # of a kv head writes the same values, so each reads back its own store), and the
        # barrier makes the store visible to the program's loads below
        if (seq_len > 0) & ((seq_len - 1) // split_len == split):
            slot = tl.load(Loc + batch).to(tl.int64)
            kn = Knew + batch * stride_knb + kv_head * stride_knh
            kf = tl.load(kn + offs_d, mask=d_mask, other=0.0)
            kp = tl.load(kn + partner, mask=d_mask, other=0.0).to(tl.float32)
            k_rot = tl.where(
                first, kf.to(tl.float32) * c - kp * sn, kf.to(tl.float32) * c + kp * sn
            ).to(kf.dtype)
            k_ty: tl.constexpr = K.dtype.element_ty
            tl.store(
                K + slot * stride_ks + kv_head * stride_kh + offs_d,
                kv_store_value(k_rot, k_inv_scale, k_ty),
                mask=d_mask,
            )
            vn = tl.load(Vnew + batch * stride_vnb + kv_head * stride_vnh + offs_d, mask=d_mask)
            v_ty: tl.constexpr = V.dtype.element_ty
            tl.store(
                V + slot * stride_vs + kv_head * stride_vh + offs_d,
                kv_store_value(vn, v_inv_scale, v_ty),
                mask=d_mask,
            )
        tl.debug_barrier()
    if UPCAST_DOT:
        q = q.to(tl.float32)
    if F16_DOTS:
        # float8 widens to fp16 in one instruction for two values, to bf16 only through fp32:
        # widened to bf16, a float8 tile cost as much work per value as a bf16 one, and halving
        # the bytes read saved nothing. fp16 holds every float8 e4m3 value and every bf16 value
        # within its range exactly (q is clamped to it); the sums stay fp32
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

    m_i = tl.full([BLOCK_H], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        slots = tl.load(ReqToToken + req * stride_rt + offs_n, mask=n_mask, other=0).to(tl.int64)
        k = tl.load(
            K + slots[None, :] * stride_ks + kv_head * stride_kh + offs_d[:, None],
            mask=n_mask[None, :] & d_mask[:, None],
            other=0.0,
        )  # (BLOCK_D, BLOCK_N)
        qk = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale
        qk = tl.where(n_mask[None, :], qk, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))  # finite: every tile has a valid key
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            V + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # (BLOCK_N, BLOCK_D)
        acc = acc * alpha[:, None] + tl.dot(
            p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION
        )
        m_i = m_new

    # an empty split (short sequence, or seq_len 0 for a padded graph slot) leaves l_i == 0
    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None] * v_scale  # (v_scale 1.0: exact)
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), -float("inf"))
    tl.store(
        PartialOut
        + batch * stride_pob
        + heads[:, None] * stride_poh
        + split * stride_pos
        + offs_d[None, :],
        out,
        mask=head_mask[:, None] & d_mask[None, :],
    )
    tl.store(PartialLse + batch * stride_plb + heads * stride_plh + split, lse, mask=head_mask)


@triton.jit
def _decode_merge_kernel(
    PartialOut,
    PartialLse,
    Out,  # (B, Hq, D)
    num_kv_splits,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    batch = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(
        PartialLse + batch * stride_plb + head * stride_plh + offs_s,
        mask=offs_s < num_kv_splits,
        other=-float("inf"),
    )
    # empty splits have lse == -inf and were never written to: do not read their outputs
    used = lse > -float("inf")
    m = tl.max(lse, 0)
    m = tl.where(m > -float("inf"), m, 0.0)
    w = tl.where(used, tl.exp2(lse - m), 0.0)  # (BLOCK_S,)
    partial = tl.load(
        PartialOut
        + batch * stride_pob
        + head * stride_poh
        + offs_s[:, None] * stride_pos
        + offs_d[None, :],
        mask=used[:, None] & d_mask[None, :],
        other=0.0,
    )  # (BLOCK_S, BLOCK_D)
    denom = tl.sum(w, 0)
    out = tl.sum(partial * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(Out + batch * stride_ob + head * stride_oh + offs_d, out, mask=d_mask)


@functools.lru_cache(maxsize=8)
def _multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_kv_splits(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """Enough splits to give every SM about two programs; depends on shapes only (graph-safe).

    Elsewhere (Triton's CPU interpreter, which runs the programs one after another) two: the
    split-and-merge path, at the fewest programs that take it."""
    if device.type != "cuda":
        return 2
    sms = _multiprocessor_count(device.index if device.index is not None else 0)
    splits = triton.cdiv(2 * sms, max(1, batch * num_kv_heads))
    return max(1, min(32, triton.next_power_of_2(splits)))


def _decode_config(device: torch.device, k_pool: torch.Tensor | None = None) -> TileConfig:
    if device.type != "cuda":
        return TileConfig(block_m=0, block_n=32, num_warps=1, num_stages=1)
    if k_pool is not None and is_quantized(k_pool):
        # measured on the H200, one layer at batch 64 x 8192 keys (benchmarks/kv_cache_fp8.py):
        # a float8 pool 434 us with 128-key tiles, 526 us with 32 (bf16: 566 us with 32, its best)
        return TileConfig(block_m=0, block_n=128, num_warps=4, num_stages=2)
    return TileConfig(block_m=0, block_n=32, num_warps=4, num_stages=2)


def _f16_dots(q: torch.Tensor, k_pool: torch.Tensor) -> bool:
    """Whether decode attention over a float8 pool runs its dots in fp16 (bf16 queries; off with
    RADIXLM_FP8_BF16_DOTS=1, to compare)."""
    return (
        is_quantized(k_pool)
        and q.dtype == torch.bfloat16
        and os.environ.get("RADIXLM_FP8_BF16_DOTS") != "1"
    )


def decode_attention(
    q: torch.Tensor,  # (B, Hq, D)
    k_pool: torch.Tensor,  # (S, Hkv, D)
    v_pool: torch.Tensor,  # (S, Hkv, D)
    req_to_token: torch.Tensor,  # (R, C) int32
    req_pool_indices: torch.Tensor,  # (B,)
    seq_lens: torch.Tensor,  # (B,) lengths including the new token
    sm_scale: float,
    *,
    num_kv_splits: int | None = None,
    out: torch.Tensor | None = None,
    scratch: DecodeScratch | None = None,
    rope: DecodeRope | None = None,
    config: TileConfig | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # (B, Hq, D)
    """One new token per request attends to its whole sequence in the pool (flash-decoding).

    For CUDA-graph capture pass `out` (B, Hq, D) and a `scratch` from `alloc_decode_scratch`;
    `num_kv_splits` then defaults to the scratch's. A request with seq_len 0 (a padded graph slot)
    gets a zero output. With `rope` (DecodeRope) q comes unrotated (and is left so) and the new
    token's K/V are not in the pool yet: the kernel rotates and stores them first (a request with
    seq_len 0 stores nothing). Float8 pools are read (and, with `rope`, written) through the
    layer's `k_scale` and `v_scale`.
    """
    _check_pools(q, k_pool, v_pool)
    k_scale, v_scale = _scales(k_pool, k_scale, v_scale)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    group = num_q_heads // num_kv_heads
    if scratch is not None:
        if num_kv_splits is not None and num_kv_splits != scratch.partial_lse.shape[2]:
            raise ValueError(
                f"num_kv_splits={num_kv_splits} but the scratch was allocated for "
                f"{scratch.partial_lse.shape[2]}"
            )
        num_kv_splits = scratch.partial_lse.shape[2]
        if scratch.partial_out.shape[0] < batch or scratch.partial_out.shape[1] != num_q_heads:
            raise ValueError(
                f"scratch of shape {tuple(scratch.partial_out.shape)} is too small for "
                f"batch {batch} with {num_q_heads} query heads"
            )
    elif num_kv_splits is None:
        num_kv_splits = default_num_kv_splits(batch, num_kv_heads, q.device)
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    if scratch is None:
        scratch = alloc_decode_scratch(batch, num_q_heads, head_dim, num_kv_splits, q.device)
    if out is None:
        out = torch.empty_like(q)
    _check_out(out, q)
    if batch == 0:
        return out

    cfg = config or _decode_config(q.device, k_pool)
    block_d = triton.next_power_of_2(head_dim)
    block_h = max(16, min(64, triton.next_power_of_2(group)))
    head_blocks = triton.cdiv(group, block_h)
    partial_out, partial_lse = scratch
    # one split: its normalized output is the answer, written straight into `out` (the merge
    # kernel would only copy it)
    po, po_strides = partial_out, partial_out.stride()[:3]
    if num_kv_splits == 1:
        po, po_strides = out, (out.stride(0), out.stride(1), 0)
    if rope is not None:
        if rope.k.stride(-1) != 1 or rope.v.stride(-1) != 1 or head_dim % 2:
            raise ValueError("rope needs k and v with a unit last stride and an even head dim")
        k_new, v_new, pos, cos, sin, loc = rope
    else:  # (unused: any tensors of the right kinds)
        k_new, v_new, pos, cos, sin, loc = q, q, seq_lens, q, q, seq_lens
    pdl = pdl_options(q)  # (both kernels)
    _decode_partial_kernel[(batch, num_kv_heads * head_blocks, num_kv_splits)](
        q,
        k_pool,
        v_pool,
        req_to_token,
        req_pool_indices,
        seq_lens,
        po,
        partial_lse,
        k_new,
        v_new,
        pos,
        cos,
        sin,
        loc,
        sm_scale * _LOG2E * k_scale,
        v_scale,
        1.0 / k_scale,
        1.0 / v_scale,
        num_kv_splits,
        k_new.stride(0),
        k_new.stride(1),
        v_new.stride(0),
        v_new.stride(1),
        q.stride(0),
        q.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        v_pool.stride(0),
        v_pool.stride(1),
        req_to_token.stride(0),
        *po_strides,
        partial_lse.stride(0),
        partial_lse.stride(1),
        GROUP=group,
        HEAD_BLOCKS=head_blocks,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_H=block_h,
        BLOCK_N=cfg.block_n,
        DOT_PRECISION=_dot_precision(q),
        UPCAST_DOT=_upcast_dot(q),
        ROPE=rope is not None,
        F16_DOTS=_f16_dots(q, k_pool),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl,
    )
    if num_kv_splits == 1:
        return out
    _decode_merge_kernel[(batch, num_q_heads)](
        partial_out,
        partial_lse,
        out,
        num_kv_splits,
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_S=max(2, triton.next_power_of_2(num_kv_splits)),
        num_warps=4 if q.device.type == "cuda" else 1,
        **pdl,
    )
    return out


# ---------------------------------------------------------------------------------------------
# extend


@triton.jit
def _extend_kernel(
    Q,  # (T, Hq, D) packed
    K,  # (S, Hkv, D)
    V,  # (S, Hkv, D)
    Out,  # (T, Hq, D)
    ReqToToken,  # (R, C) int32
    ReqPoolIndices,  # (B,)
    PrefixLens,  # (B,)
    ExtendLens,  # (B,)
    ExtendStarts,  # (B,) row of each request's first query in Q
    Blocks,  # (2, NB) with BLOCK_MAP: each program's request and first new token
    qk_scale,  # sm_scale * log2(e) * k_scale
    v_scale,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_rt,
    stride_blocks,
    GROUP: tl.constexpr,
    GROUP_BLOCK: tl.constexpr,  # query heads of the group in one tile
    HEAD_BLOCKS: tl.constexpr,  # cdiv(GROUP, GROUP_BLOCK)
    TOKENS_PER_BLOCK: tl.constexpr,  # BLOCK_M // GROUP_BLOCK
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_MAP: tl.constexpr,  # program_id(0) indexes Blocks (request -1: nothing to do)
    K_ROWS: tl.constexpr,  # TileConfig.k_rows
):
    if BLOCK_MAP:
        batch = tl.load(Blocks + tl.program_id(0)).to(tl.int32)
        if batch < 0:
            return
        tok0 = tl.load(Blocks + stride_blocks + tl.program_id(0)).to(tl.int32)
    else:
        batch = tl.program_id(1)
        tok0 = tl.program_id(0) * TOKENS_PER_BLOCK
    extend_len = tl.load(ExtendLens + batch).to(tl.int32)
    if tok0 >= extend_len:
        return
    kv_head = tl.program_id(2) // HEAD_BLOCKS
    head_block = tl.program_id(2) % HEAD_BLOCKS
    prefix_len = tl.load(PrefixLens + batch).to(tl.int32)
    req = tl.load(ReqPoolIndices + batch).to(tl.int64)
    q_start = tl.load(ExtendStarts + batch).to(tl.int64)

    # row r of the tile is query token tok0 + r // GROUP_BLOCK, query head r % GROUP_BLOCK of the block
    offs_r = tl.arange(0, BLOCK_M)
    tok = tok0 + offs_r // GROUP_BLOCK
    offs_g = head_block * GROUP_BLOCK + offs_r % GROUP_BLOCK
    row_mask = (offs_r < TOKENS_PER_BLOCK * GROUP_BLOCK) & (tok < extend_len) & (offs_g < GROUP)
    heads = kv_head * GROUP + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM

    q = tl.load(
        Q + (q_start + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # (BLOCK_M, BLOCK_D)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    row_tokens = ReqToToken + req * stride_rt

    # the prefix: visible to every query, no causal mask
    for n0 in range(0, prefix_len, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < prefix_len
        slots = tl.load(row_tokens + offs_n, mask=n_mask, other=0).to(tl.int64)
        m_i, l_i, acc = _attend_tile(
            q,
            K,
            V,
            slots,
            n_mask,
            n_mask[None, :],
            kv_head,
            offs_d,
            d_mask,
            m_i,
            l_i,
            acc,
            qk_scale,
            stride_ks,
            stride_kh,
            stride_vs,
            stride_vh,
            DOT_PRECISION,
            K_ROWS,
        )

    # the new tokens, causal: the last query of this tile sees keys up to its own position
    new_end = tl.minimum(extend_len, tok0 + TOKENS_PER_BLOCK)
    for n0 in range(0, new_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < new_end
        slots = tl.load(row_tokens + prefix_len + offs_n, mask=n_mask, other=0).to(tl.int64)
        visible = n_mask[None, :] & (offs_n[None, :] <= tok[:, None])
        m_i, l_i, acc = _attend_tile(
            q,
            K,
            V,
            slots,
            n_mask,
            visible,
            kv_head,
            offs_d,
            d_mask,
            m_i,
            l_i,
            acc,
            qk_scale,
            stride_ks,
            stride_kh,
            stride_vs,
            stride_vh,
            DOT_PRECISION,
            K_ROWS,
        )

    # every valid row saw at least the key at its own position, so l_i > 0 there
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * v_scale
    tl.store(
        Out + (q_start + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
        out,
        mask=row_mask[:, None] & d_mask[None, :],
    )


@triton.jit
def _attend_tile(
    q,
    K,
    V,
    slots,
    n_mask,
    visible,
    kv_head,
    offs_d,
    d_mask,
    m_i,
    l_i,
    acc,
    qk_scale,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    DOT_PRECISION: tl.constexpr,
    K_ROWS: tl.constexpr,
):
    """One online-softmax step of the (BLOCK_M, BLOCK_D) queries over a tile of gathered keys."""
    if K_ROWS:
        k = tl.trans(
            tl.load(
                K + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
                mask=n_mask[:, None] & d_mask[None, :],
                other=0.0,
            )
        )  # (BLOCK_D, BLOCK_N)
    else:
        k = tl.load(
            K + slots[None, :] * stride_ks + kv_head * stride_kh + offs_d[:, None],
            mask=n_mask[None, :] & d_mask[:, None],
            other=0.0,
        )  # (BLOCK_D, BLOCK_N)
    qk = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale
    qk = tl.where(visible, qk, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # a row with nothing visible so far keeps m == -inf; keep its arithmetic finite
    m_safe = tl.where(m_new > -float("inf"), m_new, 0.0)
    p = tl.exp2(qk - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(
        V + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
        mask=n_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # (BLOCK_N, BLOCK_D)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return m_new, l_i, acc


def _extend_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> TileConfig:
    if device.type != "cuda":
        return TileConfig(block_m=32, block_n=32, num_warps=1, num_stages=1)
    if dtype == torch.float32:  # the exact path; fp32 tiles take twice the shared memory
        return TileConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    if head_dim <= 128:
        # 64 query rows, 64 keys, 3 stages, K a key a row: on an H100 1.4-2.0x the TFLOP/s of
        # (128, 64) at SmolLM2's head_dim 64 and 1.3-1.9x at the 8B shape's 128, on every
        # workload of benchmarks/attention_kernels.py --extend-tiles (benchmarks/RESULTS.md)
        return TileConfig(block_m=64, block_n=64, num_warps=4, num_stages=3, k_rows=True)
    return TileConfig(block_m=64, block_n=32, num_warps=8, num_stages=2)


def extend_attention(
    q: torch.Tensor,  # (T, Hq, D)
    k_pool: torch.Tensor,  # (S, Hkv, D)
    v_pool: torch.Tensor,  # (S, Hkv, D)
    req_to_token: torch.Tensor,  # (R, C) int32
    req_pool_indices: torch.Tensor,  # (B,) int
    prefix_lens: torch.Tensor,  # (B,) int
    extend_lens: torch.Tensor,  # (B,) int
    sm_scale: float,
    *,
    max_extend_len: int | None = None,
    extend_starts: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    blocks: torch.Tensor | None = None,
    tokens_per_block: int | None = None,
    config: TileConfig | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # (T, Hq, D)
    """New tokens of a ragged batch attend to their request's prefix and, causally, to each other.

    `max_extend_len` (an upper bound of `extend_lens`) sizes the grid; without it the call reads
    `extend_lens.max()` on the host, a sync that a CUDA graph cannot capture. `extend_starts`
    (B,), the row of each request's first query in `q`, defaults to the exclusive cumsum of
    `extend_lens`.

    `blocks` (2, NB) int, from `extend_blocks`, lists the tiles to compute instead: one program
    each, for the request in row 0 (-1: none) from its new token in row 1, `tokens_per_block` new
    tokens. The grid is then NB whatever the batch, so a CUDA graph of a fixed NB serves any batch
    whose tiles fit (query rows of no tile are left as they are in `out`). `tokens_per_block`, the
    tile length the list was made with, is checked against the kernel's. Float8 pools are read
    through the layer's `k_scale` and `v_scale`.
    """
    _check_pools(q, k_pool, v_pool)
    k_scale, v_scale = _scales(k_pool, k_scale, v_scale)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    group = num_q_heads // num_kv_heads
    batch = extend_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    _check_out(out, q)
    if num_tokens == 0 or batch == 0:
        return out
    if blocks is None and max_extend_len is None:
        max_extend_len = int(extend_lens.max())
    if blocks is None and max_extend_len <= 0:
        return out
    if extend_starts is None:
        extend_starts = torch.cumsum(extend_lens, 0) - extend_lens

    listed_per_block = tokens_per_block
    cfg = config or _extend_config(head_dim, q.dtype, q.device)
    group_block = min(group, cfg.block_m)
    head_blocks = triton.cdiv(group, group_block)
    tokens_per_block = cfg.block_m // group_block
    if blocks is not None:
        if listed_per_block is not None and listed_per_block != tokens_per_block:
            raise ValueError(
                f"blocks were listed in tiles of {listed_per_block} new tokens; the kernel's "
                f"tiles here hold {tokens_per_block}"
            )
        if blocks.dim() != 2 or blocks.shape[0] != 2 or blocks.stride(1) != 1:
            raise ValueError(
                f"blocks must be (2, NB) with a unit last stride, got {tuple(blocks.shape)}"
            )
        grid = (blocks.shape[1], 1, num_kv_heads * head_blocks)
    else:
        grid = (triton.cdiv(max_extend_len, tokens_per_block), batch, num_kv_heads * head_blocks)
    _extend_kernel[grid](
        q,
        k_pool,
        v_pool,
        out,
        req_to_token,
        req_pool_indices,
        prefix_lens,
        extend_lens,
        extend_starts,
        extend_lens if blocks is None else blocks,
        sm_scale * _LOG2E * k_scale,
        v_scale,
        q.stride(0),
        q.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        v_pool.stride(0),
        v_pool.stride(1),
        out.stride(0),
        out.stride(1),
        req_to_token.stride(0),
        0 if blocks is None else blocks.stride(0),
        GROUP=group,
        GROUP_BLOCK=group_block,
        HEAD_BLOCKS=head_blocks,
        TOKENS_PER_BLOCK=tokens_per_block,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        DOT_PRECISION=_dot_precision(q),
        UPCAST_DOT=_upcast_dot(q),
        BLOCK_MAP=blocks is not None,
        K_ROWS=cfg.k_rows,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def extend_tokens_per_block(
    num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> int:
    """New tokens per tile of `extend_attention` for these shapes (what `extend_blocks` needs)."""
    group = num_q_heads // num_kv_heads
    block_m = _extend_config(head_dim, dtype, device).block_m
    return block_m // min(group, block_m)


def extend_blocks(extend_lens: list[int], tokens_per_block: int) -> tuple[list[int], list[int]]:
    """The tiles of a ragged batch, for `extend_attention(blocks=...)`: the request of each and
    its first new token."""
    reqs: list[int] = []
    starts: list[int] = []
    for i, n in enumerate(extend_lens):
        first = range(0, n, tokens_per_block)
        reqs += [i] * len(first)
        starts += first
    return reqs, starts


# ---------------------------------------------------------------------------------------------
# shared


def _upcast_dot(q: torch.Tensor) -> bool:
    # The CPU interpreter (TRITON_INTERPRET=1) multiplies bf16 tiles as their raw uint16 bits;
    # there the dot operands go through fp32 instead.
    return q.device.type == "cpu" and q.dtype == torch.bfloat16


def _dot_precision(q: torch.Tensor) -> str:
    # fp32 is the exact path: no tf32 rounding inside tl.dot
    return "ieee" if q.dtype == torch.float32 or _upcast_dot(q) else "tf32"


def _scales(pool: torch.Tensor, k_scale: float, v_scale: float) -> tuple[float, float]:
    """The scales a pool is read through: a pool of the model's dtype has none (as the reference
    reads it)."""
    return (k_scale, v_scale) if is_quantized(pool) else (1.0, 1.0)


def _check_pools(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> None:
    if q.dim() != 3 or k_pool.dim() != 3 or v_pool.dim() != 3:
        raise ValueError(
            "expected q (tokens, q_heads, head_dim) and pools (slots, kv_heads, head_dim), got "
            f"{tuple(q.shape)}, {tuple(k_pool.shape)}, {tuple(v_pool.shape)}"
        )
    if k_pool.shape != v_pool.shape:
        raise ValueError(f"k_pool {tuple(k_pool.shape)} and v_pool {tuple(v_pool.shape)} differ")
    if q.shape[2] != k_pool.shape[2]:
        raise ValueError(f"q head_dim {q.shape[2]} != pool head_dim {k_pool.shape[2]}")
    if q.shape[1] % k_pool.shape[1] != 0:
        raise ValueError(
            f"{q.shape[1]} query heads are not a multiple of {k_pool.shape[1]} kv heads"
        )
    if q.stride(2) != 1 or k_pool.stride(2) != 1 or v_pool.stride(2) != 1:
        raise ValueError("q and the pools must be contiguous along head_dim")


def _check_out(out: torch.Tensor, q: torch.Tensor) -> None:
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(
            f"out must have q's shape {tuple(q.shape)} and dtype {q.dtype}, contiguous along "
            f"head_dim; got {tuple(out.shape)} {out.dtype} strides {out.stride()}"
        )
