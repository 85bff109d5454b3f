"""The attention interface the model calls, and the backends behind it.

A backend stores the step's new K/V into the pool and attends over each request's slots. The torch
backend is the CPU path and the oracle; the Triton backend (kernels/triton_attention.py) is the GPU
path and must give the same results.
"""

from __future__ import annotations

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


def create_backend(name: str, kv_pool: KVPool, req_to_token: torch.Tensor, device: torch.device):
    if name == "auto":
        name = "torch"  # the Triton backend is wired in once the GPU path lands
    if name == "torch":
        return TorchAttentionBackend(kv_pool, req_to_token)
    raise ValueError(f"attention backend {name!r} is not available; use 'torch'")
