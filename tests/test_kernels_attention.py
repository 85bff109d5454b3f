"""Triton attention kernels against their plain-torch oracles in `kernels/attention_ref.py`.

Without CUDA the kernels run on the CPU under TRITON_INTERPRET=1, which must be set before triton
is first imported (tests/conftest.py does it); sizes here are tiny for that reason. Tests marked `gpu` use real sizes on CUDA.

Every batch is built to catch addressing mistakes: slots are shuffled and disjoint between requests
(except a deliberately shared prefix), request rows are out of order, q and the pools are strided
views, and every slot no request owns, as well as every req_to_token entry past a request's length,
points at NaN keys and values.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from radixlm.kernels import triton_attention as ta  # noqa: E402
from radixlm.kernels.attention_ref import (  # noqa: E402
    decode_attention_ref,
    extend_attention_ref,
    store_kv_ref,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
gpu = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# fp32 is exact up to summation order; half types are compared with an fp32 oracle
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


class Batch:
    """Pools, slot table and packed queries for one ragged batch (see the module docstring)."""

    def __init__(
        self,
        prefix_lens: list[int],
        new_lens: list[int],
        num_kv_heads: int,
        group: int,
        head_dim: int,
        dtype: torch.dtype,
        *,
        seed: int,
        share_prefix: int = 0,
        device: torch.device = DEVICE,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        batch = len(prefix_lens)
        totals = [p + e for p, e in zip(prefix_lens, new_lens)]
        num_rows = batch + 3
        context = max(totals) + 7
        owned = sum(totals)
        num_slots = owned + 1 + 9  # slot 0 stays finite (the decode oracle reads it as padding)
        order = torch.randperm(num_slots - 1, generator=gen) + 1
        slots, spare = order[:owned], order[owned:]
        poison = int(spare[0])

        req_to_token = torch.full((num_rows, context), poison, dtype=torch.int32)
        rows = torch.randperm(num_rows, generator=gen)[:batch]
        start = 0
        for i, (row, total) in enumerate(zip(rows.tolist(), totals)):
            req_to_token[row, :total] = slots[start : start + total].int()
            start += total
            if i > 0 and share_prefix:  # a radix-shared prefix: same slots as request 0
                shared = min(share_prefix, prefix_lens[0], prefix_lens[i])
                req_to_token[row, :shared] = req_to_token[rows[0], :shared]

        num_q_heads = num_kv_heads * group
        # the pools are strided views of one (slots, 2 * Hkv, D) tensor, like per-layer views
        kv = torch.randn(num_slots, 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
        kv[spare] = float("nan")
        self.k_pool, self.v_pool = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
        # q is a strided view of a fused qkv projection output
        num_tokens = sum(new_lens)
        qkv = torch.randn(num_tokens, num_q_heads + 2, head_dim, generator=gen).to(dtype)
        self.q = qkv[:, :num_q_heads]

        self.req_to_token = req_to_token
        self.req_pool_indices = rows
        self.prefix_lens = torch.tensor(prefix_lens)
        self.extend_lens = torch.tensor(new_lens)
        self.seq_lens = self.prefix_lens + self.extend_lens
        self.sm_scale = head_dim**-0.5
        for name in ("k_pool", "v_pool", "q", "req_to_token", "req_pool_indices"):
            setattr(self, name, getattr(self, name).to(device))
        for name in ("prefix_lens", "extend_lens", "seq_lens"):
            setattr(self, name, getattr(self, name).to(device))

    def pools32(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_pool.float(), self.v_pool.float()


def expected_extend(b: Batch) -> torch.Tensor:
    k32, v32 = b.pools32()
    return extend_attention_ref(
        b.q.float(),
        k32,
        v32,
        b.req_to_token,
        b.req_pool_indices,
        b.prefix_lens,
        b.extend_lens,
        b.sm_scale,
    )


def expected_decode(b: Batch) -> torch.Tensor:
    k32, v32 = b.pools32()
    return decode_attention_ref(
        b.q.float(), k32, v32, b.req_to_token, b.req_pool_indices, b.seq_lens, b.sm_scale
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not actual.isnan().any(), "NaN in the output: a poisoned slot was read"
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def run_extend(b: Batch, **kwargs) -> torch.Tensor:
    return ta.extend_attention(
        b.q,
        b.k_pool,
        b.v_pool,
        b.req_to_token,
        b.req_pool_indices,
        b.prefix_lens,
        b.extend_lens,
        b.sm_scale,
        **kwargs,
    )


def run_decode(b: Batch, **kwargs) -> torch.Tensor:
    return ta.decode_attention(
        b.q,
        b.k_pool,
        b.v_pool,
        b.req_to_token,
        b.req_pool_indices,
        b.seq_lens,
        b.sm_scale,
        **kwargs,
    )


# ---------------------------------------------------------------------------------------------
# extend

EXTEND_CASES = [
    # prefix_lens, extend_lens, num_kv_heads, group, head_dim
    ([0], [1], 1, 1, 64),
    ([0, 5, 17], [7, 1, 3], 2, 4, 64),
    ([30, 0, 3, 12], [2, 33, 1, 9], 1, 8, 128),
    ([40, 7], [20, 5], 2, 3, 64),
    ([1, 0], [1, 40], 3, 1, 128),
    ([9, 20], [6, 11], 2, 2, 80),  # a head dim that is not a power of two
    ([230], [4], 1, 4, 64),  # a prefix several tiles long
]


@pytest.mark.parametrize("case", EXTEND_CASES, ids=lambda c: f"p{c[0]}-e{c[1]}-g{c[3]}-d{c[4]}")
def test_extend_matches_reference_fp32(case) -> None:
    prefix_lens, new_lens, num_kv_heads, group, head_dim = case
    b = Batch(prefix_lens, new_lens, num_kv_heads, group, head_dim, torch.float32, seed=1)
    assert_close(run_extend(b), expected_extend(b), torch.float32)


@pytest.mark.parametrize("seed", range(6))
def test_extend_random_batches(seed: int) -> None:
    gen = torch.Generator().manual_seed(100 + seed)
    batch = int(torch.randint(1, 5, (1,), generator=gen))
    prefix_lens = torch.randint(0, 41, (batch,), generator=gen).tolist()
    new_lens = torch.randint(1, 25, (batch,), generator=gen).tolist()
    group = [1, 3, 4, 8][seed % 4]
    head_dim = [64, 128][seed % 2]
    b = Batch(prefix_lens, new_lens, 2, group, head_dim, torch.float32, seed=seed, share_prefix=8)
    assert_close(run_extend(b), expected_extend(b), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_extend_half_precision(dtype: torch.dtype) -> None:
    b = Batch([12, 0, 25], [5, 17, 2], 2, 4, 64, dtype, seed=2)
    out = run_extend(b)
    assert out.dtype == dtype
    assert_close(out, expected_extend(b), dtype)


@pytest.mark.parametrize("case", EXTEND_CASES[1:4], ids=lambda c: f"g{c[3]}-d{c[4]}")
def test_extend_with_key_rows_transposed_in_registers(case) -> None:
    """TileConfig.k_rows: K tiles loaded a key a row and transposed in the kernel, against the
    torch reference."""
    prefix_lens, new_lens, num_kv_heads, group, head_dim = case
    b = Batch(prefix_lens, new_lens, num_kv_heads, group, head_dim, torch.float32, seed=4)
    tile = ta.TileConfig(32, 32, 1, 1, k_rows=True) if DEVICE == "cpu" else ta.TileConfig(64, 32, 4, 2, k_rows=True)  # fmt: skip
    assert_close(run_extend(b, config=tile), expected_extend(b), torch.float32)


def test_extend_with_hints_and_strided_output() -> None:
    b = Batch([3, 11], [9, 4], 2, 2, 64, torch.float32, seed=3)
    starts = torch.cumsum(b.extend_lens, 0) - b.extend_lens
    wide = torch.full((b.q.shape[0], b.q.shape[1] + 3, 64), float("nan"), device=DEVICE)
    out = wide[:, 1 : 1 + b.q.shape[1]]
    returned = run_extend(b, max_extend_len=16, extend_starts=starts, out=out)
    assert returned.data_ptr() == out.data_ptr()
    assert_close(out, expected_extend(b), torch.float32)
    assert wide[:, 0].isnan().all() and wide[:, -2:].isnan().all(), "wrote outside `out`"


@pytest.mark.parametrize(
    "prefix_lens,new_lens,num_kv_heads,group,dtype",
    [
        ([3, 11, 0], [9, 4, 1], 2, 2, torch.float32),
        ([0, 40], [70, 1], 1, 3, torch.float32),  # several tiles of one request
        ([5], [1], 3, 1, torch.float32),
        ([2, 0], [33, 21], 1, 4, torch.bfloat16),
    ],
)
def test_extend_over_a_padded_block_map_equals_the_plain_grid(
    prefix_lens, new_lens, num_kv_heads, group, dtype
) -> None:
    """The grid of a CUDA graph: tiles listed in `blocks`, padded with request -1 past the batch's
    own, and the token rows past the batch (graph padding) left as they were in `out`."""
    b = Batch(prefix_lens, new_lens, num_kv_heads, group, 64, dtype, seed=len(new_lens))
    tpb = ta.extend_tokens_per_block(b.q.shape[1], num_kv_heads, 64, dtype, DEVICE)
    reqs, starts = ta.extend_blocks(new_lens, tpb)
    assert len(reqs) == sum(-(-n // tpb) for n in new_lens)
    pad = 5
    blocks = torch.tensor([reqs + [-1] * pad, starts + [0] * pad], device=DEVICE)
    rows = b.q.shape[0]
    out = torch.full((rows + 3, *b.q.shape[1:]), 7.0, device=DEVICE, dtype=dtype)
    q = torch.cat([b.q, torch.zeros(3, *b.q.shape[1:], device=DEVICE, dtype=dtype)])
    ta.extend_attention(
        q, b.k_pool, b.v_pool, b.req_to_token, b.req_pool_indices, b.prefix_lens,
        b.extend_lens, b.sm_scale, blocks=blocks, out=out,
    )  # fmt: skip
    assert_close(out[:rows], expected_extend(b), dtype)
    assert (out[rows:] == 7.0).all(), "wrote rows of no tile"
    with pytest.raises(ValueError, match="blocks"):
        ta.extend_attention(
            q, b.k_pool, b.v_pool, b.req_to_token, b.req_pool_indices, b.prefix_lens,
            b.extend_lens, b.sm_scale, blocks=blocks[0], out=out,
        )  # fmt: skip
    with pytest.raises(ValueError, match="tiles"):
        ta.extend_attention(
            q, b.k_pool, b.v_pool, b.req_to_token, b.req_pool_indices, b.prefix_lens,
            b.extend_lens, b.sm_scale, blocks=blocks, out=out, tokens_per_block=tpb + 1,
        )  # fmt: skip


def test_extend_rejects_mismatched_heads() -> None:
    b = Batch([2], [3], 3, 1, 64, torch.float32, seed=4)
    with pytest.raises(ValueError, match="multiple"):
        ta.extend_attention(
            b.q[:, :2],
            b.k_pool,
            b.v_pool,
            b.req_to_token,
            b.req_pool_indices,
            b.prefix_lens,
            b.extend_lens,
            b.sm_scale,
        )


# ---------------------------------------------------------------------------------------------
# decode

DECODE_CASES = [
    # seq_lens, num_kv_heads, group, head_dim, num_kv_splits
    ([1], 1, 1, 64, 1),
    ([9, 1, 40], 2, 4, 64, 4),
    ([33, 2, 17, 5], 1, 8, 128, 3),
    ([60, 12], 4, 1, 128, 8),
    ([7, 50, 21], 2, 3, 64, 2),
    ([3, 26], 2, 2, 96, 4),  # a head dim that is not a power of two
    ([250, 1], 1, 4, 64, 2),  # a split several tiles long
    ([9, 1, 40, 77], 2, 3, 64, 1),  # one split: written straight into the output
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"s{c[0]}-g{c[2]}-d{c[3]}-k{c[4]}")
def test_decode_matches_reference_fp32(case) -> None:
    seq_lens, num_kv_heads, group, head_dim, splits = case
    prefix_lens = [s - 1 for s in seq_lens]
    b = Batch(
        prefix_lens, [1] * len(seq_lens), num_kv_heads, group, head_dim, torch.float32, seed=5
    )
    assert_close(run_decode(b, num_kv_splits=splits), expected_decode(b), torch.float32)


@pytest.mark.parametrize("seed", range(4))
def test_decode_random_batches(seed: int) -> None:
    gen = torch.Generator().manual_seed(200 + seed)
    batch = int(torch.randint(1, 6, (1,), generator=gen))
    prefix_lens = torch.randint(0, 60, (batch,), generator=gen).tolist()
    group = [1, 3, 4, 8][seed]
    b = Batch(prefix_lens, [1] * batch, 2, group, [64, 128][seed % 2], torch.float32, seed=seed)
    splits = [1, 2, 4, 5][seed]
    assert_close(run_decode(b, num_kv_splits=splits), expected_decode(b), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_half_precision(dtype: torch.dtype, splits: int) -> None:
    b = Batch([8, 0, 44], [1, 1, 1], 2, 4, 128, dtype, seed=6)
    out = run_decode(b, num_kv_splits=splits)
    assert out.dtype == dtype
    assert_close(out, expected_decode(b), dtype)


def test_decode_into_preallocated_buffers_for_a_smaller_batch() -> None:
    b = Batch([5, 30], [1, 1], 2, 4, 64, torch.float32, seed=7)
    scratch = ta.alloc_decode_scratch(6, b.q.shape[1], 64, 4, DEVICE)
    out = torch.empty_like(b.q)
    returned = run_decode(b, out=out, scratch=scratch)
    assert returned.data_ptr() == out.data_ptr()
    assert_close(out, expected_decode(b), torch.float32)
    with pytest.raises(ValueError, match="num_kv_splits"):
        run_decode(b, scratch=scratch, num_kv_splits=2)


@pytest.mark.parametrize(
    "prefix_lens,num_kv_heads,group,head_dim,dtype,splits",
    [
        ([6, 0, 13], 2, 3, 64, torch.float32, 1),
        ([6, 0, 13], 2, 3, 64, torch.float32, 4),  # the new token in a later split
        ([40, 3], 1, 4, 128, torch.float32, 3),
        ([9, 21], 2, 2, 64, torch.bfloat16, 2),
        ([5, 12], 1, 72, 64, torch.float32, 2),  # two head blocks of one kv head both store
    ],
)
def test_decode_with_rope_equals_rope_store_then_decode(
    prefix_lens, num_kv_heads, group, head_dim, dtype, splits
) -> None:
    """DecodeRope: the decode kernel rotates q and stores the new token's rotated k and v itself,
    as kernels.fused.rope_store_kv_ followed by the plain decode kernel would; a padded request
    (seq_len 0) stores nothing."""
    from radixlm.kernels.fused import rope_store_kv_

    b = Batch(prefix_lens, [1] * len(prefix_lens), num_kv_heads, group, head_dim, dtype, seed=9)
    gen = torch.Generator().manual_seed(10)
    n = len(prefix_lens)
    rows = b.req_pool_indices
    loc = b.req_to_token[rows, b.seq_lens - 1].long()
    k_new = torch.randn(n, num_kv_heads + 1, head_dim, generator=gen).to(dtype).to(DEVICE)[:, 1:]
    v_new = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    angles = torch.arange(64)[:, None] * torch.rand(head_dim // 2, generator=gen)[None, :]
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    positions = (b.seq_lens - 1 + torch.tensor([3, 0, 5][:n], device=DEVICE)).contiguous()
    seq_lens = b.seq_lens.clone()
    padded_slot = None
    if n == 3:  # request 1 is a graph's padding row: seq_len 0, stores nothing
        seq_lens[1] = 0
        padded_slot = int(loc[1])

    ref_k, ref_v, q_ref = b.k_pool.clone(), b.v_pool.clone(), b.q.clone()
    rope_store_kv_(q_ref, k_new, v_new, positions, cos, sin, ref_k, ref_v, loc)
    want = ta.decode_attention(
        q_ref, ref_k, ref_v, b.req_to_token, rows, seq_lens, b.sm_scale, num_kv_splits=splits
    )
    b.k_pool[loc] = float("nan")  # the new token's K/V are not in the pool yet
    b.v_pool[loc] = float("nan")
    if padded_slot is not None:
        b.k_pool[padded_slot] = 0.5
        b.v_pool[padded_slot] = 0.5
    q_before = b.q.clone()
    got = ta.decode_attention(
        b.q, b.k_pool, b.v_pool, b.req_to_token, rows, seq_lens, b.sm_scale,
        num_kv_splits=splits, rope=ta.DecodeRope(k_new, v_new, positions, cos, sin, loc),
    )  # fmt: skip
    assert torch.equal(b.q, q_before), "q must be left unrotated"
    assert_close(got, want, dtype)
    for i in range(n):
        if i == 1 and padded_slot is not None:
            assert (b.k_pool[padded_slot] == 0.5).all() and (b.v_pool[padded_slot] == 0.5).all()
            continue
        torch.testing.assert_close(b.k_pool[loc[i]], ref_k[loc[i]], atol=1e-6, rtol=1e-6)
        assert torch.equal(b.v_pool[loc[i]], ref_v[loc[i]])


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_padded_request_with_no_tokens_gives_zeros(splits: int) -> None:
    # a CUDA-graph batch is padded with requests of seq_len 0; they must not produce NaN
    b = Batch([6, 0, 13], [1, 1, 1], 1, 4, 64, torch.float32, seed=8)
    seq_lens = b.seq_lens.clone()
    seq_lens[1] = 0
    out = torch.full_like(b.q, float("nan"))  # whatever the buffer held before
    ta.decode_attention(
        b.q,
        b.k_pool,
        b.v_pool,
        b.req_to_token,
        b.req_pool_indices,
        seq_lens,
        b.sm_scale,
        num_kv_splits=splits,
        out=out,
    )
    assert (out[1] == 0).all()
    assert_close(out[[0, 2]], expected_decode(b)[[0, 2]], torch.float32)


# ---------------------------------------------------------------------------------------------
# store


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_store_kv_matches_reference(pool_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(9)
    pools = [torch.randn(40, 2, 64, generator=gen).to(pool_dtype).to(DEVICE) for _ in range(2)]
    expected = [p.clone() for p in pools]
    loc = torch.randperm(40, generator=gen)[:11].int().to(DEVICE)
    k, v = (torch.randn(11, 2, 64, generator=gen).to(DEVICE) for _ in range(2))
    ta.store_kv(pools[0], pools[1], loc, k, v)
    store_kv_ref(expected[0], expected[1], loc.long(), k.to(pool_dtype), v.to(pool_dtype))
    assert torch.equal(pools[0], expected[0]) and torch.equal(pools[1], expected[1])


# ---------------------------------------------------------------------------------------------
# float8 pools (kv_cache_dtype="fp8_e4m3"): the kernels against the reference reading the same
# float8 pools through the same scales. Scales far from 1 so that a scale dropped or applied
# twice anywhere shows.

K_SCALE, V_SCALE = 0.04, 0.5
FP8 = torch.float8_e4m3fn


def to_fp8(b: Batch, k_scale: float = K_SCALE, v_scale: float = V_SCALE) -> Batch:
    """b with its pools quantized (the values stored are pool / scale) into float8 pools that are
    again strided views of one (slots, 2 * Hkv, D) tensor; NaN poison stays NaN."""
    from radixlm.kernels.attention_ref import quantize_kv

    kv = torch.cat([quantize_kv(b.k_pool, k_scale, FP8), quantize_kv(b.v_pool, v_scale, FP8)], 1)
    heads = b.k_pool.shape[1]
    b.k_pool, b.v_pool = kv[:, :heads], kv[:, heads:]
    return b


def expected_fp8_extend(b: Batch) -> torch.Tensor:
    return extend_attention_ref(
        b.q.float(), b.k_pool, b.v_pool, b.req_to_token, b.req_pool_indices, b.prefix_lens,
        b.extend_lens, b.sm_scale, K_SCALE, V_SCALE,
    )  # fmt: skip


def expected_fp8_decode(b: Batch) -> torch.Tensor:
    return decode_attention_ref(
        b.q.float(), b.k_pool, b.v_pool, b.req_to_token, b.req_pool_indices, b.seq_lens,
        b.sm_scale, K_SCALE, V_SCALE,
    )  # fmt: skip


def test_fp8_reference_reads_the_pool_times_its_scales() -> None:
    """The oracle itself: attention over a float8 pool is attention over its float8 values times
    the scales (and the pool stores x / scale, rounded: within float8's half step of x)."""
    b = Batch([7, 0, 20], [3, 9, 1], 2, 3, 64, torch.float32, seed=20)
    k32, v32 = b.k_pool.clone(), b.v_pool.clone()
    to_fp8(b)
    valid = ~k32.isnan()
    # float8 e4m3 keeps 3 mantissa bits: relative error at most 1/16 above its subnormals
    err = (b.k_pool.float() * K_SCALE - k32)[valid].abs()
    assert (err <= k32[valid].abs() / 16 + 2**-10 * K_SCALE).all()
    plain = extend_attention_ref(
        b.q, b.k_pool.float() * K_SCALE, b.v_pool.float() * V_SCALE, b.req_to_token,
        b.req_pool_indices, b.prefix_lens, b.extend_lens, b.sm_scale,
    )  # fmt: skip
    torch.testing.assert_close(expected_fp8_extend(b), plain, atol=1e-5, rtol=1e-5)
    # and it stays close to the unquantized attention
    unquantized = extend_attention_ref(
        b.q, k32, v32, b.req_to_token, b.req_pool_indices, b.prefix_lens, b.extend_lens,
        b.sm_scale,
    )  # fmt: skip
    torch.testing.assert_close(plain, unquantized, atol=0.1, rtol=0.1)


@pytest.mark.parametrize(
    "prefix_lens,new_lens,num_kv_heads,group,head_dim,q_dtype",
    [
        ([0, 5, 17], [7, 1, 3], 2, 4, 64, torch.float32),
        ([30, 0, 3], [2, 33, 9], 1, 8, 128, torch.float32),
        ([9, 20], [6, 11], 2, 2, 80, torch.float32),  # a head dim that is not a power of two
        ([12, 0, 25], [5, 17, 2], 2, 4, 64, torch.bfloat16),
    ],
)
def test_fp8_extend_matches_reference(
    prefix_lens, new_lens, num_kv_heads, group, head_dim, q_dtype
) -> None:
    b = to_fp8(
        Batch(
            prefix_lens, new_lens, num_kv_heads, group, head_dim, q_dtype, seed=21, share_prefix=4
        )
    )
    out = run_extend(b, k_scale=K_SCALE, v_scale=V_SCALE)
    assert out.dtype == q_dtype
    assert_close(out, expected_fp8_extend(b), q_dtype)


def test_fp8_extend_over_a_block_map_matches_reference() -> None:
    """The prompt-step CUDA graph's grid (tiles listed) over float8 pools."""
    b = to_fp8(Batch([3, 11, 0], [9, 4, 1], 2, 2, 64, torch.float32, seed=22))
    tpb = ta.extend_tokens_per_block(b.q.shape[1], 2, 64, torch.float32, DEVICE)
    reqs, starts = ta.extend_blocks([9, 4, 1], tpb)
    blocks = torch.tensor([reqs + [-1] * 3, starts + [0] * 3], device=DEVICE)
    out = run_extend(b, blocks=blocks, out=torch.zeros_like(b.q), k_scale=K_SCALE, v_scale=V_SCALE)
    assert_close(out, expected_fp8_extend(b), torch.float32)


@pytest.mark.parametrize(
    "seq_lens,num_kv_heads,group,head_dim,splits,q_dtype",
    [
        ([9, 1, 40], 2, 4, 64, 4, torch.float32),
        ([33, 2, 17, 5], 1, 8, 128, 1, torch.float32),  # one split: straight into the output
        ([3, 26], 2, 2, 96, 3, torch.float32),
        ([8, 1, 44], 2, 4, 128, 4, torch.bfloat16),
    ],
)
def test_fp8_decode_matches_reference(
    seq_lens, num_kv_heads, group, head_dim, splits, q_dtype
) -> None:
    prefix_lens = [s - 1 for s in seq_lens]
    b = to_fp8(
        Batch(prefix_lens, [1] * len(seq_lens), num_kv_heads, group, head_dim, q_dtype, seed=23)
    )
    out = run_decode(b, num_kv_splits=splits, k_scale=K_SCALE, v_scale=V_SCALE)
    assert out.dtype == q_dtype
    assert_close(out, expected_fp8_decode(b), q_dtype)


@pytest.mark.parametrize("bf16_dots", ["0", "1"])
def test_fp8_decode_with_bf16_queries_in_fp16_dots_or_bf16_ones(bf16_dots, monkeypatch) -> None:
    """bf16 queries over a float8 pool: the dots run in fp16 (float8 widens to fp16 cheaply, and
    holds in it exactly), or in bf16 with RADIXLM_FP8_BF16_DOTS=1; both read the reference."""
    monkeypatch.setenv("RADIXLM_FP8_BF16_DOTS", bf16_dots)
    seq_lens = [70, 3, 129]
    b = to_fp8(Batch([s - 1 for s in seq_lens], [1] * 3, 2, 4, 128, torch.bfloat16, seed=29))
    assert ta._f16_dots(b.q, b.k_pool) is (bf16_dots == "0")
    out = run_decode(b, num_kv_splits=2, k_scale=K_SCALE, v_scale=V_SCALE)
    assert_close(out, expected_fp8_decode(b), torch.bfloat16)


def test_scales_do_not_apply_to_a_pool_of_the_models_dtype() -> None:
    """As the reference reads such a pool: the scales are a float8 pool's."""
    b = Batch([5, 0], [3, 4], 2, 2, 64, torch.float32, seed=27)
    assert_close(run_extend(b, k_scale=K_SCALE, v_scale=V_SCALE), expected_extend(b), torch.float32)
    d = Batch([9, 30], [1, 1], 2, 2, 64, torch.float32, seed=28)
    assert_close(run_decode(d, k_scale=K_SCALE, v_scale=V_SCALE), expected_decode(d), torch.float32)


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal as numbers (a float8 -0 and +0 are one value)."""
    return torch.equal(a.float(), b.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_stores_round_as_the_reference(dtype: torch.dtype) -> None:
    """store_kv, rope_store_kv_ and the decode kernel's own store quantize K and V exactly as
    store_kv_ref does (to nearest even, saturated): values spanning float8's subnormals, its
    normal range, the rounding carries at each power of two and the saturation at 448."""
    from radixlm.kernels.fused import rope_store_kv_

    gen = torch.Generator().manual_seed(24)
    n, heads, dim = 12, 2, 64
    magnitudes = torch.tensor([1e-4, 3e-3, 0.02, 0.3, 1.0, 7.9, 60.0, 600.0])
    k = torch.randn(n, heads, dim, generator=gen) * magnitudes[torch.arange(n * heads) % 8].view(
        n, heads, 1
    )
    k[0, 0, :4] = torch.tensor([7.97, -15.9, 447.0, -1000.0])  # carries and saturation
    k, v = (k * K_SCALE).to(dtype).to(DEVICE), (k.flip(0) * V_SCALE).to(dtype).to(DEVICE)
    loc = (torch.randperm(30, generator=gen)[:n] + 1).to(DEVICE)

    def pools():
        return torch.zeros(31, heads, dim, dtype=FP8, device=DEVICE), torch.zeros(
            31, heads, dim, dtype=FP8, device=DEVICE
        )

    want_k, want_v = pools()
    store_kv_ref(want_k, want_v, loc, k, v, K_SCALE, V_SCALE)
    assert want_k.float().abs().max() == 448.0  # (saturated, not NaN)

    got_k, got_v = pools()
    ta.store_kv(got_k, got_v, loc.int(), k, v, K_SCALE, V_SCALE)
    assert _same_values(got_k, want_k) and _same_values(got_v, want_v)

    # rope_store_kv_ at position 0 (cos 1, sin 0) stores k unrotated
    cos, sin = torch.ones(4, dim // 2, device=DEVICE), torch.zeros(4, dim // 2, device=DEVICE)
    q = torch.zeros(n, heads, dim, dtype=dtype, device=DEVICE)
    got_k, got_v = pools()
    positions = torch.zeros(n, dtype=torch.int64, device=DEVICE)
    rope_store_kv_(q, k, v, positions, cos, sin, got_k, got_v, loc, K_SCALE, V_SCALE)
    assert _same_values(got_k, want_k) and _same_values(got_v, want_v)

    # the decode kernel's store (DecodeRope): one request per new token, each on its own row
    got_k, got_v = pools()
    req_to_token = loc.view(n, 1).int()
    seq_lens = torch.ones(n, dtype=torch.int64, device=DEVICE)
    ta.decode_attention(
        torch.zeros(n, heads, dim, dtype=dtype, device=DEVICE), got_k, got_v, req_to_token,
        torch.arange(n, device=DEVICE), seq_lens, dim**-0.5, num_kv_splits=1,
        rope=ta.DecodeRope(k, v, positions, cos, sin, loc), k_scale=K_SCALE, v_scale=V_SCALE,
    )  # fmt: skip
    assert _same_values(got_k, want_k) and _same_values(got_v, want_v)


@pytest.mark.parametrize("splits", [1, 4])
def test_fp8_decode_with_rope_equals_rope_store_then_decode(splits: int) -> None:
    """DecodeRope into a float8 pool: the kernel's own store and read equal rope_store_kv_
    (quantizing) then the plain decode kernel."""
    from radixlm.kernels.fused import rope_store_kv_

    b = to_fp8(Batch([6, 0, 13], [1, 1, 1], 2, 3, 64, torch.float32, seed=25))
    gen = torch.Generator().manual_seed(26)
    rows = b.req_pool_indices
    loc = b.req_to_token[rows, b.seq_lens - 1].long()
    k_new = torch.randn(3, 2, 64, generator=gen).to(DEVICE)
    v_new = torch.randn(3, 2, 64, generator=gen).to(DEVICE)
    angles = torch.arange(64)[:, None] * torch.rand(32, generator=gen)[None, :]
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    positions = (b.seq_lens - 1).contiguous()
    scales = {"k_scale": K_SCALE, "v_scale": V_SCALE}

    ref_k, ref_v, q_ref = b.k_pool.clone(), b.v_pool.clone(), b.q.clone()
    rope_store_kv_(q_ref, k_new, v_new, positions, cos, sin, ref_k, ref_v, loc, **scales)
    want = decode_attention_ref(
        q_ref, ref_k, ref_v, b.req_to_token, rows, b.seq_lens, b.sm_scale, K_SCALE, V_SCALE
    )
    got = ta.decode_attention(
        b.q, b.k_pool, b.v_pool, b.req_to_token, rows, b.seq_lens, b.sm_scale,
        num_kv_splits=splits, rope=ta.DecodeRope(k_new, v_new, positions, cos, sin, loc), **scales,
    )  # fmt: skip
    assert_close(got, want, torch.float32)
    assert _same_values(b.k_pool[loc], ref_k[loc]) and _same_values(b.v_pool[loc], ref_v[loc])


# ---------------------------------------------------------------------------------------------
# GPU: real sizes, bf16, CUDA graphs


@gpu
@requires_cuda
@pytest.mark.parametrize("group,head_dim", [(4, 128), (8, 128), (3, 64), (1, 64)])
def test_gpu_extend_long_prefixes_bf16(group: int, head_dim: int) -> None:
    b = Batch(
        [0, 3000, 517, 1999, 4095],
        [300, 1, 64, 129, 17],
        8 if group < 8 else 4,
        group,
        head_dim,
        torch.bfloat16,
        seed=10,
        share_prefix=400,
    )
    assert_close(run_extend(b), expected_extend(b), torch.bfloat16)


@gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_extend_other_dtypes(dtype: torch.dtype) -> None:
    b = Batch([1000, 0, 77], [200, 513, 1], 8, 4, 128, dtype, seed=11)
    assert_close(run_extend(b), expected_extend(b), dtype)


@gpu
@requires_cuda
@pytest.mark.parametrize(
    "group,head_dim,splits", [(4, 128, 8), (8, 128, 16), (1, 64, 4), (3, 96, 7)]
)
def test_gpu_decode_long_sequences_bf16(group: int, head_dim: int, splits: int) -> None:
    gen = torch.Generator().manual_seed(12)
    prefix_lens = torch.randint(0, 6000, (24,), generator=gen).tolist() + [0, 8191]
    b = Batch(prefix_lens, [1] * 26, 8, group, head_dim, torch.bfloat16, seed=12)
    assert_close(run_decode(b, num_kv_splits=splits), expected_decode(b), torch.bfloat16)
    assert_close(run_decode(b), expected_decode(b), torch.bfloat16)  # default split count


@gpu
@requires_cuda
def test_gpu_decode_replays_in_a_cuda_graph() -> None:
    b = Batch([100, 2000, 37, 900], [1, 1, 1, 1], 8, 4, 128, torch.bfloat16, seed=13)
    scratch = ta.alloc_decode_scratch(4, b.q.shape[1], 128, 8, DEVICE)
    q = b.q.clone()
    seq_lens = b.seq_lens.clone()
    out = torch.empty_like(q)

    def step() -> None:
        ta.decode_attention(
            q,
            b.k_pool,
            b.v_pool,
            b.req_to_token,
            b.req_pool_indices,
            seq_lens,
            b.sm_scale,
            out=out,
            scratch=scratch,
        )

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    # new inputs in the same buffers: shorter sequences and other queries
    seq_lens.copy_(torch.tensor([50, 1999, 1, 901], device=DEVICE))
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    b.q, b.seq_lens = q, seq_lens
    assert_close(out, expected_decode(b), torch.bfloat16)


@gpu
@requires_cuda
def test_gpu_extend_replays_in_a_cuda_graph_with_a_length_hint() -> None:
    # speculative verification: a fixed number of query tokens per request
    b = Batch([500, 1200, 3], [4, 4, 4], 8, 4, 128, torch.bfloat16, seed=14)
    out = torch.empty_like(b.q)
    starts = torch.cumsum(b.extend_lens, 0) - b.extend_lens

    def step() -> None:
        run_extend(b, max_extend_len=4, extend_starts=starts, out=out)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    b.prefix_lens.copy_(torch.tensor([499, 1000, 0], device=DEVICE))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, expected_extend(b), torch.bfloat16)


requires_fp8 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a GPU with float8 (compute capability 8.9 or later)",
)


@gpu
@requires_fp8
def test_gpu_fp8_extend_and_decode_long_sequences() -> None:
    """Float8 pools at real sizes, bf16 queries, against the float8 reference."""
    b = to_fp8(
        Batch([0, 3000, 517, 4095], [300, 1, 64, 17], 8, 4, 128, torch.bfloat16, seed=15,
              share_prefix=400)
    )  # fmt: skip
    assert_close(run_extend(b, k_scale=K_SCALE, v_scale=V_SCALE), expected_fp8_extend(b),
                 torch.bfloat16)  # fmt: skip
    gen = torch.Generator().manual_seed(16)
    prefix_lens = torch.randint(0, 6000, (24,), generator=gen).tolist() + [0, 8191]
    b = to_fp8(Batch(prefix_lens, [1] * 26, 8, 4, 128, torch.bfloat16, seed=16))
    for splits in (None, 8):
        out = run_decode(b, num_kv_splits=splits, k_scale=K_SCALE, v_scale=V_SCALE)
        assert_close(out, expected_fp8_decode(b), torch.bfloat16)
