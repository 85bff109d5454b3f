"""Plain-torch attention over the per-token KV pool: the CPU path and the oracle of the kernels.

Layout shared by every attention implementation:
- `k_pool`, `v_pool`: (num_slots, num_kv_heads, head_dim) of one layer.
- `req_to_token`: (max_requests, max_context) int32; row r maps positions of request r to slots.
- A batch of B requests; request i has `prefix_lens[i]` tokens already in the pool and
  `extend_lens[i]` new tokens whose K/V have *already been written* to the pool, at positions
  prefix_lens[i] .. prefix_lens[i] + extend_lens[i] - 1. Queries are packed request after request:
  q is (sum(extend_lens), num_q_heads, head_dim). Each new token attends to the prefix and,
  causally, to the new tokens up to itself. Decode is the case extend_lens == 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def extend_attention_ref(
    q: torch.Tensor,  # (T, Hq, D)
    k_pool: torch.Tensor,  # (S, Hkv, D)
    v_pool: torch.Tensor,  # (S, Hkv, D)
    req_to_token: torch.Tensor,  # (R, C) int32
    req_pool_indices: torch.Tensor,  # (B,) int
    prefix_lens: torch.Tensor,  # (B,) int
    extend_lens: torch.Tensor,  # (B,) int
    sm_scale: float,
) -> torch.Tensor:  # (T, Hq, D)
    """One request at a time: gather its keys and values, then masked SDPA."""
    out = torch.empty_like(q)
    start = 0
    for r, p, e in zip(req_pool_indices.tolist(), prefix_lens.tolist(), extend_lens.tolist()):
        slots = req_to_token[r, : p + e].long()
        k = k_pool[slots].transpose(0, 1).unsqueeze(0)  # (1, Hkv, L, D)
        v = v_pool[slots].transpose(0, 1).unsqueeze(0)
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
    k = k_pool[slots]  # (B, L, Hkv, D)
    v = v_pool[slots]
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
    k_pool: torch.Tensor, v_pool: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Write new keys/values (T, Hkv, D) into the pool at slots `loc` (T,)."""
    k_pool[loc] = k
    v_pool[loc] = v
