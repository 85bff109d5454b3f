"""Plain-torch attention over the per-token KV pool: the CPU path and the oracle of the kernels.

Layout shared by every attention implementation:
- `k_pool`, `v_pool`: (num_slots, num_kv_heads, head_dim) of one layer.
- `req_to_token`: (max_requests, max_context) int32; row r maps positions of request r to slots.
- A batch of B requests; request i has `prefix_lens[i]` tokens already in the pool and
  `extend_lens[i]` new tokens whose K/V have *already been written* to the pool, at positions
  prefix_lens[i] .. prefix_lens[i] + extend_lens[i] - 1. Queries are packed request after request:
  q is (sum(extend_lens), num_q_heads, head_dim). Each new token attends to the prefix and,
  causally, to the new tokens up to itself. Decode is the case extend_lens == 1.
- A pool may hold float8 (`kv_cache_dtype="fp8_e4m3"`): a stored value is x / scale rounded to
  float8_e4m3fn (to nearest even, saturated at +-448), read back as its float8 value times the
  layer's scale (`k_scale` for keys, `v_scale` for values; 1.0 unless a checkpoint gives them).
  Pools of the model's own dtype ignore the scales.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_E4M3_MAX = 448.0  # the largest finite float8_e4m3fn


def is_quantized(pool: torch.Tensor) -> bool:
    """Whether a KV pool holds float8 (read through its scale) rather than the model's dtype."""
    return pool.dtype == torch.float8_e4m3fn


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x as a pool of `dtype` stores it: float8 as x / scale, rounded to nearest even and
    saturated (a cast alone may give NaN past the range); any other dtype plain."""
    if dtype != torch.float8_e4m3fn:
        return x.to(dtype)
    # (times the inverse, in float32: the Triton stores compute exactly this)
    scaled = x.float() * (1.0 / scale)
    return scaled.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(dtype)


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Pool values as the model reads them, in `dtype`: float8 times its scale."""
    if x.dtype != torch.float8_e4m3fn:
        return x
    out = x.to(dtype)  # (exact: every float8_e4m3fn value is a float16/bfloat16/float32)
    return out if scale == 1.0 else out.mul_(scale)


def gather_kv(pool: torch.Tensor, slots, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """pool[slots] read back in `dtype` (float8 pools are gathered as bytes: not every torch
    build indexes float8 tensors)."""
    if not is_quantized(pool):
        return pool[slots]
    return dequantize_kv(pool.view(torch.uint8)[slots].view(pool.dtype), scale, dtype)


def extend_attention_ref(
    q: torch.Tensor,  # (T, Hq, D)
    k_pool: torch.Tensor,  # (S, Hkv, D)
    v_pool: torch.Tensor,  # (S, Hkv, D)
    req_to_token: torch.Tensor,  # (R, C) int32
    req_pool_indices: torch.Tensor,  # (B,) int
    prefix_lens: torch.Tensor,  # (B,) int
    extend_lens: torch.Tensor,  # (B,) int
    sm_scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # (T, Hq, D)
    """One request at a time: gather its keys and values, then masked SDPA."""
    out = torch.empty_like(q)
    start = 0
    for r, p, e in zip(req_pool_indices.tolist(), prefix_lens.tolist(), extend_lens.tolist()):
        slots = req_to_token[r, : p + e].long()
        k = (
            gather_kv(k_pool, slots, k_scale, q.dtype).transpose(0, 1).unsqueeze(0)
        )  # (1, Hkv, L, D)
        v = gather_kv(v_pool, slots, v_scale, q.dtype).transpose(0, 1).unsqueeze(0)
        qi = q[start : start + e].transpose(0, 1).unsqueeze(0)  # (1, Hq, e, D)
        # query j (absolute position p + j) sees keys at positions <= p + j; an additive mask
        # takes torch's fused CPU kernel, a boolean one a path several times slower
        visible = torch.ones(e, p + e, dtype=torch.bool, device=q.device).tril(diagonal=p)
        bias = torch.zeros(e, p + e, dtype=q.dtype, device=q.device).masked_fill_(
            ~visible, float("-inf")
        )
        o = F.scaled_dot_product_attention(
            qi, k, v, attn_mask=bias, scale=sm_scale, enable_gqa=True
        )
        out[start : start + e] = o[0].transpose(0, 1)
        start += e
    return out


def decode_attention_ref(
    q: torch.Tensor,  # (B, Hq, D)
    k_pool: torch.Tensor,  # (S, Hkv, D)
    v_pool: torch.Tensor,  # (S, Hkv, D)
    req_to_token: torch.Tensor,  # (R, C) int32
    req_pool_indices: torch.Tensor,  # (B,)
    seq_lens: torch.Tensor,  # (B,) lengths including the new token
    sm_scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # (B, Hq, D)
    """All requests at once: gather keys padded to the longest sequence, mask the padding."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    group = num_q_heads // num_kv_heads
    max_len = int(seq_lens.max())
    positions = torch.arange(max_len, device=q.device)
    valid = positions[None, :] < seq_lens[:, None].to(q.device)  # (B, L)
    slots = req_to_token[req_pool_indices.long(), :max_len].long()
    slots = torch.where(valid, slots, torch.zeros_like(slots))
    k = gather_kv(k_pool, slots, k_scale, q.dtype)  # (B, L, Hkv, D)
    v = gather_kv(v_pool, slots, v_scale, q.dtype)
    # a kv head's group of query heads acts as `group` queries against that head's keys: 4-D
    # attention with no broadcast copies of K/V
    qg = q.view(batch, num_kv_heads, group, head_dim)
    k = k.permute(0, 2, 1, 3)  # (B, Hkv, L, D)
    v = v.permute(0, 2, 1, 3)
    bias = torch.zeros(valid.shape, dtype=q.dtype, device=q.device).masked_fill_(
        ~valid, float("-inf")
    )
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=bias[:, None, None, :], scale=sm_scale)
    return o.reshape(batch, num_q_heads, head_dim)


def store_kv_ref(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write new keys/values (T, Hkv, D) into the pool at slots `loc` (T,), quantized to a float8
    pool's dtype with its scales."""
    for pool, x, scale in ((k_pool, k, k_scale), (v_pool, v, v_scale)):
        if is_quantized(pool):  # (as bytes: not every torch build index-puts float8)
            pool.view(torch.uint8)[loc] = quantize_kv(x, scale, pool.dtype).view(torch.uint8)
        else:
            pool[loc] = x
