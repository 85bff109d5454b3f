"""The attention interface the model calls, and the backends behind it.

A backend stores the step's new K/V into the pool and attends over each request's slots. The torch
backend is the CPU path and the oracle; the Triton backend (kernels/triton_attention.py) is the GPU
path and must give the same results. Both read a float8 pool (`kv_cache_dtype="fp8_e4m3"`) through
the pool's per-layer `k_scale` / `v_scale`, and quantize what they store with them.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from radixlm.kernels import attention_ref as ref
from radixlm.runtime.forward_batch import ForwardBatch
from radixlm.runtime.memory_pool import KVPool

# Temporaries above glibc's mmap threshold (32 MiB at most) are mapped and zero-filled afresh on
# every call; on the CPU that page-faulting, not arithmetic, dominated long-context attention. The
# torch backend therefore works in pieces whose gathered K/V and score matrices stay under this.
_CPU_PIECE_BYTES = 8 << 20


class TorchAttentionBackend:
    rotates_qk = False  # takes q and k rotated already (the model applies rope)
    pads_tokens = False  # prefill batches come unpadded (ForwardBatch.padding is 0)

    def __init__(self, kv_pool: KVPool, req_to_token: torch.Tensor) -> None:
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self._keys_for: ForwardBatch | None = None
        self._keys: slice | torch.Tensor = slice(0)

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
        scales = self.kv_pool.k_scale[layer_id], self.kv_pool.v_scale[layer_id]
        ref.store_kv_ref(k_pool, v_pool, batch.out_cache_loc, k, v, *scales)
        out = torch.empty_like(q)
        start = 0
        for i in range(batch.num_multi):  # prefill chunks, one request at a time
            p, e = batch.prefix_lens_cpu[i], batch.extend_lens_cpu[i]
            self._extend_one(q, out, start, i, p, e, k_pool, v_pool, batch, sm_scale, scales)
            start += e
        if batch.num_multi < batch.batch_size:  # decodes, batched in pieces
            self._decode(q[start:], out[start:], k_pool, v_pool, batch, sm_scale, scales)
        return out

    def _extend_one(self, q, out, start, i, p, e, k_pool, v_pool, batch, sm_scale, scales) -> None:
        row_bytes = (p + e) * q.shape[1] * q.element_size()  # one query's scores over all heads
        block = max(16, _CPU_PIECE_BYTES // max(row_bytes, 1))
        rows = batch.req_pool_indices[i : i + 1]
        for j in range(0, e, block):
            n = min(block, e - j)
            # queries j..j+n of the new tokens see the prefix and the new tokens up to themselves
            out[start + j : start + j + n] = ref.extend_attention_ref(
                q[start + j : start + j + n], k_pool, v_pool, self.req_to_token, rows,
                torch.tensor([p + j]), torch.tensor([n]), sm_scale, *scales,
            )  # fmt: skip

    def _single_request_keys(self, batch: ForwardBatch, i: int, length: int):
        """The slots of request i: a slice when they are consecutive (usual for a lone request,
        whose slots were allocated in runs), so each layer reads a view instead of gathering.
        Worked out once a step and reused by every layer."""
        if self._keys_for is not batch:
            slots = self.req_to_token[batch.req_pool_indices[i], :length].long()
            first = int(slots[0])
            consecutive = bool(
                (slots == torch.arange(first, first + length, device=slots.device)).all()
            )
            self._keys_for, self._keys = (
                batch,
                slice(first, first + length) if consecutive else slots,
            )
        return self._keys

    def _decode(self, q, out, k_pool, v_pool, batch, sm_scale, scales) -> None:
        m = batch.num_multi
        seq_lens = batch.seq_lens[m:]
        max_len = max(batch.prefix_lens_cpu[m:]) + 1
        per_req = max_len * k_pool.shape[1] * k_pool.shape[2] * q.element_size()  # (as read)
        piece = max(1, _CPU_PIECE_BYTES // per_req)
        if q.shape[0] == 1:  # nothing to mask: torch's fused CPU kernel, several times faster
            keys = self._single_request_keys(batch, m, max_len)
            k = ref.gather_kv(k_pool, keys, scales[0], q.dtype).transpose(0, 1).unsqueeze(0)
            v = ref.gather_kv(v_pool, keys, scales[1], q.dtype).transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                q.unsqueeze(2), k, v, scale=sm_scale, enable_gqa=True
            )
            out.copy_(o.squeeze(2))
            return
        for j in range(0, q.shape[0], piece):
            sl = slice(j, j + piece)
            out[sl] = ref.decode_attention_ref(
                q[sl], k_pool, v_pool, self.req_to_token,
                batch.req_pool_indices[m:][sl], seq_lens[sl], sm_scale, *scales,
            )  # fmt: skip


class TritonAttentionBackend:
    """The GPU path: Triton kernels over the same pool layout (kernels/triton_attention.py).

    Decode splits each sequence into as many pieces as keep the GPU busy at that batch size, so
    the split count and its scratch buffers are kept per power-of-two batch size; they are made on
    first use (for a CUDA graph, in its warm-up before capture) and reused afterwards.

    Where flash-attn is installed (2.1 or later; fp16 or bf16 on an Ampere or newer GPU, head dim
    up to 256), the prompt chunks of a step go through its varlen kernel instead of the Triton
    extend kernel: their keys, prefix included, are gathered from the pool once a step, and the
    causal mask is aligned to the last key, as a chunk after a cached prefix needs. The step's
    one-token requests (decodes) stay on the Triton decode kernel: gathering their keys would copy
    every running request's KV each step. RADIXLM_DISABLE_FLASH_ATTN=1 keeps Triton everywhere.
    """

    pads_tokens = True  # prefill batches may carry padding rows (ForwardBatch.padding)

    def __init__(self, kv_pool: KVPool, req_to_token: torch.Tensor, num_q_heads: int) -> None:
        from radixlm.kernels import fused
        from radixlm.kernels import triton_attention as ta

        self.ta = ta
        self.fused = fused
        # forward takes q and k unrotated with the fused kernels' rope inputs and rotates them as it
        # stores K/V: one kernel for rope and the store (RADIXLM_DISABLE_FUSED_ROPE_STORE=1: three)
        self.rotates_qk = os.environ.get("RADIXLM_DISABLE_FUSED_ROPE_STORE") != "1"
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.num_q_heads = num_q_heads
        self._scratch: dict[int, object] = {}
        self.flash = flash_varlen(kv_pool.k[0])  # flash_attn_varlen_func, or None
        self._keys_for: ForwardBatch | None = None
        self._keys: tuple = ()

    def extend_tokens_per_block(self) -> int:
        """New tokens per extend tile: what ForwardBatch.extend_blocks counts in."""
        k = self.kv_pool.k[0]
        return self.ta.extend_tokens_per_block(  # (the tiles follow q's dtype, not the pool's)
            self.num_q_heads, k.shape[1], k.shape[2], self.kv_pool.compute_dtype, k.device
        )

    def _decode_scratch(self, batch_size: int):
        ta = self.ta
        key = 1 << max(0, batch_size - 1).bit_length()  # the next power of two
        scratch = self._scratch.get(key)
        if scratch is None:
            k_pool = self.kv_pool.k[0]
            splits = ta.default_num_kv_splits(key, k_pool.shape[1], k_pool.device)
            scratch = ta.alloc_decode_scratch(
                key, self.num_q_heads, k_pool.shape[-1], splits, k_pool.device
            )
            self._scratch[key] = scratch
        return scratch

    def forward(
        self, q, k, v, layer_id: int, batch: ForwardBatch, sm_scale: float, rope=None
    ) -> torch.Tensor:
        """With `rope` (RopeInputs with positions, and `rotates_qk`), q and k are not rotated yet:
        q is rotated in place and k rotated into the pool."""
        ta = self.ta
        k_pool, v_pool = self.kv_pool.k[layer_id], self.kv_pool.v[layer_id]
        ks, vs = self.kv_pool.k_scale[layer_id], self.kv_pool.v_scale[layer_id]
        if batch.is_decode and not batch.store_kv_first:  # rope and the K/V store inside the
            fused = None  # decode kernel, when fused
            if rope is not None:
                fused = ta.DecodeRope(k, v, rope.positions, rope.cos, rope.sin, batch.out_cache_loc)
            else:
                ta.store_kv(k_pool, v_pool, batch.out_cache_loc, k, v, ks, vs)
            return ta.decode_attention(
                q, k_pool, v_pool, self.req_to_token, batch.req_pool_indices, batch.seq_lens, sm_scale,
                scratch=self._decode_scratch(batch.batch_size), rope=fused, k_scale=ks, v_scale=vs,
            )  # fmt: skip
        if rope is not None:
            self.fused.rope_store_kv_(
                q, k, v, rope.positions, rope.cos, rope.sin, k_pool, v_pool, batch.out_cache_loc,
                ks, vs,
            )  # fmt: skip
        else:
            ta.store_kv(k_pool, v_pool, batch.out_cache_loc, k, v, ks, vs)
        if batch.is_decode:  # rows of one request see each other's K/V, stored above
            return ta.decode_attention(
                q, k_pool, v_pool, self.req_to_token, batch.req_pool_indices, batch.seq_lens, sm_scale,
                scratch=self._decode_scratch(batch.batch_size), k_scale=ks, v_scale=vs,
            )  # fmt: skip
        if batch.extend_blocks is not None:  # a graph's step: tiles listed, padding rows zero
            return ta.extend_attention(
                q, k_pool, v_pool, self.req_to_token, batch.req_pool_indices, batch.prefix_lens,
                batch.extend_lens, sm_scale, blocks=batch.extend_blocks, out=torch.zeros_like(q),
                tokens_per_block=self.extend_tokens_per_block(), k_scale=ks, v_scale=vs,
            )  # fmt: skip
        out = torch.empty_like(q)
        if batch.padding:  # rows no request writes: zeros, not whatever the memory held (a NaN
            out[-batch.padding :].zero_()  # there would reach the padding slot's K/V)
        if self.flash is not None:
            return self._extend_flash(q, k_pool, v_pool, batch, sm_scale, out)
        # one launch for the whole ragged batch; single-token requests are extends of length 1
        # (splitting them off into a decode launch measured 6-8% slower on the 1,000-request
        # offline workload and no faster on the prefill-heavy one: H100, 2026-12-06)
        return ta.extend_attention(
            q, k_pool, v_pool, self.req_to_token, batch.req_pool_indices, batch.prefix_lens,
            batch.extend_lens, sm_scale, max_extend_len=max(batch.extend_lens_cpu), out=out,
            k_scale=ks, v_scale=vs,
        )  # fmt: skip

    def _extend_flash(self, q, k_pool, v_pool, batch: ForwardBatch, sm_scale: float, out):
        """The prompt chunks (the batch's first `num_multi` requests) through flash-attn, the
        one-token requests after them through the Triton decode kernel."""
        m, slots, cu_q, cu_k, max_q, max_k = self._flash_keys(batch)
        out[:m] = self.flash(
            q[:m], k_pool[slots], v_pool[slots], cu_q, cu_k, max_q, max_k,
            softmax_scale=sm_scale, causal=True,
        )  # fmt: skip
        n, multi = q.shape[0] - batch.padding, batch.num_multi
        if n > m:
            self.ta.decode_attention(
                q[m:n], k_pool, v_pool, self.req_to_token, batch.req_pool_indices[multi:],
                batch.seq_lens[multi:], sm_scale, out=out[m:n],
                scratch=self._decode_scratch(batch.batch_size - multi),
            )  # fmt: skip
        return out

    def _flash_keys(self, batch: ForwardBatch) -> tuple:
        """For the prompt chunks: their query rows, the pool slot of each of their keys (prefix,
        then new tokens) packed request after request, and the cumulative query and key lengths
        with their maxima. Once a step."""
        if self._keys_for is batch:
            return self._keys
        multi = batch.num_multi
        extend_cpu = batch.extend_lens_cpu[:multi]
        seq_cpu = [p + e for p, e in zip(batch.prefix_lens_cpu[:multi], extend_cpu)]
        seq_lens = batch.seq_lens[:multi]
        total, dev = sum(seq_cpu), seq_lens.device
        cu_q = F.pad(torch.cumsum(batch.extend_lens[:multi], 0), (1, 0)).to(torch.int32)
        cu_k = F.pad(torch.cumsum(seq_lens, 0), (1, 0))
        owner = torch.repeat_interleave(
            torch.arange(multi, device=dev), seq_lens, output_size=total
        )
        positions = torch.arange(total, device=dev) - cu_k[owner]
        slots = self.req_to_token[batch.req_pool_indices[owner], positions].long()
        self._keys_for = batch
        self._keys = (
            sum(extend_cpu),
            slots,
            cu_q,
            cu_k.to(torch.int32),
            max(extend_cpu),
            max(seq_cpu),
        )
        return self._keys


def flash_varlen(pool: torch.Tensor):
    """flash-attn's `flash_attn_varlen_func` for a KV pool (slots, heads, head_dim) when flash-attn
    is installed (2.1 or later: a causal mask with fewer queries than keys aligned to the last key)
    and runs there (fp16 or bf16, an Ampere or newer GPU, head dim up to 256), else None (a float8
    pool among them: its prompt chunks take the Triton extend kernel, which reads float8)."""
    if (
        os.environ.get("RADIXLM_DISABLE_FLASH_ATTN") == "1"
        or not pool.is_cuda
        or pool.dtype not in (torch.float16, torch.bfloat16)
        or pool.shape[-1] > 256
        or torch.cuda.get_device_capability(pool.device) < (8, 0)
    ):
        return None
    try:
        import flash_attn
        from flash_attn import flash_attn_varlen_func
    except Exception:  # not installed, or built for another torch or CUDA
        return None
    try:
        version = tuple(int(x) for x in flash_attn.__version__.split(".")[:2])
    except ValueError:
        return None
    return flash_attn_varlen_func if version >= (2, 1) else None


def create_backend(
    name: str, kv_pool: KVPool, req_to_token, device: torch.device, num_q_heads: int
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
        if (
            kv_pool.quantized
            and device.type == "cuda"
            and torch.cuda.get_device_capability(device) < (8, 9)
        ):
            raise ValueError(
                f"kv_cache_dtype={kv_pool.kv_cache_dtype} needs a GPU of compute capability 8.9 "
                "or later (Ada, Hopper) for the Triton kernels' float8 loads; use "
                "kv_cache_dtype=auto, or attention_backend=torch"
            )
        return TritonAttentionBackend(kv_pool, req_to_token, num_q_heads)
    raise ValueError(f"attention backend {name!r} is not available; use auto, torch or triton")
