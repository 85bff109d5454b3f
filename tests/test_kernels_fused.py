"""The fused RMSNorm / rotary / SiLU kernels (kernels/fused.py) against the torch code of
runtime/layers.py, which they replace on CUDA. Without CUDA they run under TRITON_INTERPRET=1 at
small sizes; on a GPU at real sizes in every dtype."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from radixlm.kernels import fused  # noqa: E402
from radixlm.runtime.layers import RMSNorm, RotaryEmbedding, silu_and_mul  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
SHAPES = [(3, 64), (5, 576)] if DEVICE.type == "cpu" else [(1, 576), (37, 576), (64, 4096)]


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    # same rounding steps as torch; only float32 summation order and fma may move the last bit
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_with_and_without_residual(dtype, shape, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    rows, n = shape
    x = (torch.randn(rows, n + 8, generator=gen) * 3).to(DEVICE, dtype)[:, :n]  # strided rows
    res = torch.randn(rows, n, generator=gen).to(DEVICE, dtype)
    norm = RMSNorm(n, 1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(n, generator=gen) + 0.5)
    out, new_res = fused.rms_norm(x, norm.weight, norm.eps, res)
    alone, none = fused.rms_norm(x, norm.weight, norm.eps)
    monkeypatch.setenv("RADIXLM_DISABLE_FUSED", "1")
    want_out, want_res = norm(x, res)
    close(out, want_out, dtype)
    assert torch.equal(new_res, want_res)  # the sum is rounded exactly as torch's add
    close(alone, norm(x), dtype)
    assert none is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 2), (9, 3), (32, 8)])
def test_rope_in_place_on_a_qkv_view(dtype, heads, torch_path):
    gen = torch.Generator().manual_seed(1)
    hq, hkv = heads
    head_dim, tokens = 64, 7
    rope = RotaryEmbedding(head_dim, 4096, 500000.0, None)
    rope.build_tables(DEVICE)
    positions = torch.tensor([0, 1, 5, 77, 1000, 4095, 3], device=DEVICE)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * head_dim, generator=gen).to(DEVICE, dtype)
    qk = qkv[:, : (hq + hkv) * head_dim].view(tokens, hq + hkv, head_dim)  # strided tokens
    want = RotaryEmbedding.apply(rope.lookup(positions), qk.clone())  # torch path (env set)
    v_before = qkv[:, (hq + hkv) * head_dim :].clone()
    got = fused.rope_(qk, positions, rope.cos, rope.sin)
    assert got.data_ptr() == qkv.data_ptr()  # rotated where it lies
    close(got, want, dtype)
    assert torch.equal(qkv[:, (hq + hkv) * head_dim :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 1536, 3000])
def test_silu_and_mul(dtype, width, torch_path):
    gen = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(5, 2 * width, generator=gen) * 4).to(DEVICE, dtype)
    close(fused.silu_and_mul(gate_up), silu_and_mul(gate_up), dtype)


def test_fused_path_is_taken_only_on_cuda(monkeypatch):
    x = torch.zeros(2, 4)
    assert not fused.enabled(x)
    if torch.cuda.is_available():
        assert fused.enabled(x.cuda())
        monkeypatch.setenv("RADIXLM_DISABLE_FUSED", "1")
        assert not fused.enabled(x.cuda())


def test_dependent_launches_only_on_hopper_and_later_unless_switched_off(monkeypatch):
    x = torch.zeros(2, 4)
    assert not fused.pdl_launch(x) and fused.pdl_options(x) == {"PDL": False}
    if torch.cuda.is_available():
        hopper = torch.cuda.get_device_capability() >= (9, 0)
        assert fused.pdl_launch(x.cuda()) == hopper
        on = {"PDL": True, "launch_pdl": True}
        assert fused.pdl_options(x.cuda()) == (on if hopper else {"PDL": False})
        big = torch.zeros(fused.pdl_max_tokens() + 1, 4, device="cuda")
        assert not fused.pdl_launch(big)  # a large step: PDL costs there
        monkeypatch.setenv("RADIXLM_PDL_MAX_TOKENS", str(big.shape[0]))
        assert fused.pdl_launch(big) == hopper
        monkeypatch.setenv("RADIXLM_DISABLE_PDL", "1")
        assert not fused.pdl_launch(x.cuda())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 2), (9, 3)])
def test_rope_store_kv_equals_rope_then_store(dtype, heads):
    from radixlm.kernels.attention_ref import store_kv_ref

    gen = torch.Generator().manual_seed(3)
    hq, hkv = heads
    head_dim, tokens, slots = 64, 5, 16
    rope = RotaryEmbedding(head_dim, 4096, 500000.0, None)
    rope.build_tables(DEVICE)
    positions = torch.tensor([0, 7, 77, 4095, 3], device=DEVICE)
    loc = torch.tensor([3, 9, 1, 15, 4], device=DEVICE)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * head_dim, generator=gen).to(DEVICE, dtype)
    pools = torch.randn(2, 2, slots, hkv, head_dim, generator=gen).to(DEVICE, dtype)

    def views(qkv):
        qk = qkv[:, : (hq + hkv) * head_dim].view(tokens, hq + hkv, head_dim)
        v = qkv[:, (hq + hkv) * head_dim :].view(tokens, hkv, head_dim)
        return qk, v

    qk, v = views(qkv.clone())
    fused.rope_(qk, positions, rope.cos, rope.sin)
    want_pools = pools.clone()
    store_kv_ref(want_pools[0, 0], want_pools[1, 0], loc, qk[:, hq:], v)
    got_qkv = qkv.clone()
    qk2, v2 = views(got_qkv)
    k_before = qk2[:, hq:].clone()
    got_pools = pools.clone()
    q = fused.rope_store_kv_(
        qk2[:, :hq], qk2[:, hq:], v2, positions, rope.cos, rope.sin,
        got_pools[0, 0], got_pools[1, 0], loc,
    )  # fmt: skip
    assert q.data_ptr() == got_qkv.data_ptr()  # q rotated where it lies
    assert torch.equal(q, qk[:, :hq])  # the same kernel code as rope_
    assert torch.equal(got_pools, want_pools)  # rotated k and v at their slots, nothing else
    assert torch.equal(qk2[:, hq:], k_before)  # k itself untouched


def test_decode_inputs_equal_the_torch_ops():
    """One kernel for a decode graph's inputs: the request-table write, the input tokens from
    token_buf and the positions, as the torch ops they replace (padding rows of length 0 too)."""
    gen = torch.Generator().manual_seed(3)
    table = torch.randint(0, 500, (9, 40), generator=gen, dtype=torch.int32).to(DEVICE)
    token_buf = torch.randint(0, 1000, (9,), generator=gen).to(DEVICE)
    rows = torch.tensor([4, 0, 7, 8, 8], device=DEVICE)  # the last two: padding (row 8, length 0)
    seq_lens = torch.tensor([5, 1, 40, 0, 0], device=DEVICE)
    slots = torch.tensor([101, 102, 103, 0, 0], device=DEVICE)
    want_table = table.clone()
    positions = (seq_lens - 1).clamp(min=0)
    want_table[rows, positions] = slots.to(torch.int32)
    ids, got_positions = fused.decode_inputs(rows, seq_lens, slots, table, token_buf)
    assert torch.equal(table, want_table)
    assert torch.equal(ids, token_buf[rows]) and torch.equal(got_positions, positions)
