"""The attention interface the model calls, and the backends behind it.

A backend stores the step's new K/V into the pool and attends over each request's slots. The torch
backend is the CPU path and the oracle; the Triton backend (kernels/triton_attention.py) is the GPU
path and must give the same results.
"""

from __future__ import annotations

import os

import torch

from radixlm.kernels import attention_ref as ref
from radixlm.runtime.forward_batch import ForwardBatch
from radixlm.runtime.memory_pool import KVPool


class TorchAttentionBackend:
    def __init__(self, kv_pool: KVPool, req_to_token: torch.Tensor) -> None:
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token

    def forward(
        self,
        q: torch.Tensor,  # (T, Hq, D)
        k: torch.Tensor,  # (T, Hkv, D)
        v: torch.Tensor,  # (T, Hkv, D)
        layer_id: int,
        batch: ForwardBatch,
        sm_scale: float,
    ) -> torch.Tensor:  # (T, Hq, D)
        k_pool, v_pool = self.kv_pool.k[layer_id], self.kv_pool.v[layer_id]
        ref.store_kv_ref(k_pool, v_pool, batch.out_cache_loc, k, v)
        m = batch.num_multi
        split = sum(batch.extend_lens_cpu[:m])  # packed tokens of the multi-token requests
        out = torch.empty_like(q)
        if m:
            out[:split] = ref.extend_attention_ref(
                q[:split], k_pool, v_pool, self.req_to_token,
                batch.req_pool_indices[:m], batch.prefix_lens[:m], batch.extend_lens[:m], sm_scale,
            )  # fmt: skip
        if m < batch.batch_size:
            out[split:] = ref.decode_attention_ref(
                q[split:], k_pool, v_pool, self.req_to_token,
                batch.req_pool_indices[m:], batch.seq_lens[m:], sm_scale,
            )  # fmt: skip
        return out


class TritonAttentionBackend:
    """The GPU path: Triton kernels over the same pool layout (kernels/triton_attention.py)."""

    def __init__(
        self, kv_pool: KVPool, req_to_token: torch.Tensor, max_batch: int, num_q_heads: int
    ) -> None:
        from radixlm.kernels import triton_attention as ta

        self.ta = ta
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        device = kv_pool.k[0].device
        head_dim = kv_pool.k[0].shape[-1]
        self.num_kv_splits = ta.default_num_kv_splits(max_batch, kv_pool.k[0].shape[1], device)
        self.scratch = ta.alloc_decode_scratch(
            max_batch, num_q_heads, head_dim, self.num_kv_splits, device
        )

    def forward(self, q, k, v, layer_id: int, batch: ForwardBatch, sm_scale: float) -> torch.Tensor:
        ta = self.ta
        k_pool, v_pool = self.kv_pool.k[layer_id], self.kv_pool.v[layer_id]
        ta.store_kv(k_pool, v_pool, batch.out_cache_loc, k, v)
        if batch.is_decode:
            return ta.decode_attention(
                q, k_pool, v_pool, self.req_to_token, batch.req_pool_indices, batch.seq_lens, sm_scale,
                scratch=self.scratch,
            )  # fmt: skip
        # one launch for the whole ragged batch; single-token requests are extends of length 1
        return ta.extend_attention(
            q, k_pool, v_pool, self.req_to_token, batch.req_pool_indices, batch.prefix_lens,
            batch.extend_lens, sm_scale, max_extend_len=max(batch.extend_lens_cpu),
        )  # fmt: skip


def create_backend(
    name: str, kv_pool: KVPool, req_to_token, device: torch.device, max_batch: int, num_q_heads: int
):
    """`auto` takes Triton on a CUDA device and the torch oracle elsewhere."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchAttentionBackend(kv_pool, req_to_token)
    if name == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "the triton attention backend needs a CUDA device (or TRITON_INTERPRET=1)"
            )
        return TritonAttentionBackend(kv_pool, req_to_token, max_batch, num_q_heads)
    raise ValueError(f"attention backend {name!r} is not available; use auto, torch or triton")
