"""The GEMV kernels with a prologue (kernels/gemv.py: RMSNorm with the residual add, SiLU-and-mul)
against the torch code of runtime/layers.py they replace, the dispatch that picks them, and a Llama
forward with them on against the plain one (and, on a GPU, with rope fused into the KV store).
Under TRITON_INTERPRET=1 on the CPU at small sizes; on a GPU at real sizes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

import torch.nn.functional as F  # noqa: E402

from radixlm.kernels.gemv import (  # noqa: E402
    GemvConfig,
    gemv,
    gemv_rms_norm,
    gemv_silu_and_mul,
)
from radixlm.runtime.layers import PlainMatmuls, RMSNorm, silu_and_mul  # noqa: E402
from radixlm.runtime.matmul_dispatch import LinearDispatch, choice_key  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
# the interpreter does not round to bfloat16 as CUDA does: bfloat16 only on a GPU
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
# (N, K): odd sizes that leave partial tiles on the CPU; the Llama-3.1-8B and SmolLM2 shapes on a GPU
# make test-fast takes the rows counts that are not SLOW (on the CPU the interpreter takes seconds
# a case); make test takes them all
SLOW = (lambda v: v) if ON_GPU else (lambda v: pytest.param(v, marks=pytest.mark.slow))
SIZES = [(37, 100), (20, 300)] if not ON_GPU else [(6144, 4096), (4096, 14336), (960, 576)]
# small tiles keep the interpreter fast; split_k 3 leaves a short last split
TILES = (
    [
        GemvConfig(8, 64, 4, 1, 1),
        GemvConfig(4, 64, 4, 1, 3),
        # one warp: the norm's pass over x takes several tiles at 3-4 rows
        GemvConfig(4, 32, 1, 1, 2, late_sum=True, prefetch=True),
        GemvConfig(16, 32, 1, 2, 3, dot=True),  # x padded to 16 rows, the norm's as well
    ]
    if not ON_GPU
    else [
        GemvConfig(4, 2048, 4, 2, 1),
        GemvConfig(8, 512, 4, 3, 4),
        GemvConfig(16, 512, 8, 1, 1, late_sum=True, prefetch=True),
        GemvConfig(8, 512, 4, 1, 4, late_sum=True, prefetch=True),
        GemvConfig(32, 128, 4, 4, 1, dot=True),
        GemvConfig(32, 256, 4, 3, 4, dot=True),
    ]
)


def tol(dtype: torch.dtype) -> float:
    # y is rounded to the dtype once; the float32 sums differ from torch's only in order
    return {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]


def inputs(rows: int, size: tuple[int, int], dtype: torch.dtype, seed: int):
    n, k = size
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype)
    x = (torch.randn(rows, k + 5, generator=gen) * 2).to(DEVICE, dtype)[:, :k]  # strided rows
    res = torch.randn(rows, k, generator=gen).to(DEVICE, dtype)
    norm = RMSNorm(k, 1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(k, generator=gen) + 0.5)
    return w, b, x, res, norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, SLOW(2), 3, SLOW(4)])
@pytest.mark.parametrize("size", SIZES)
def test_gemv_rms_norm_matches_norm_then_linear(size, rows, dtype, torch_path):
    w, b, x, res, norm = inputs(rows, size, dtype, seed=rows)
    want, want_sum = norm(x, res)
    want_alone = norm(x)
    for tile in TILES:
        y, summed = gemv_rms_norm(x, res, norm.weight, norm.eps, w, b, tile)
        assert torch.equal(summed, want_sum)  # the sum is rounded exactly as torch's add
        torch.testing.assert_close(
            y.float(),
            F.linear(want.float(), w.float(), b.float()),
            atol=tol(dtype),
            rtol=tol(dtype),
        )
        y, none = gemv_rms_norm(x, None, norm.weight, norm.eps, w, None, tile)
        assert none is None
        torch.testing.assert_close(
            y.float(), F.linear(want_alone.float(), w.float()), atol=tol(dtype), rtol=tol(dtype)
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, SLOW(2), 3, SLOW(4)])
@pytest.mark.parametrize("size", SIZES)
def test_gemv_silu_and_mul_matches_silu_then_linear(size, rows, dtype, torch_path):
    n, k = size
    w, b, _, _, _ = inputs(rows, size, dtype, seed=10 + rows)
    gen = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * k + 3, generator=gen) * 3).to(DEVICE, dtype)[:, : 2 * k]
    want = F.linear(silu_and_mul(gate_up).float(), w.float())
    for tile in TILES:
        got = gemv_silu_and_mul(gate_up, w, None, tile)
        torch.testing.assert_close(got.float(), want, atol=tol(dtype), rtol=tol(dtype))
    got = gemv_silu_and_mul(gate_up, w, b, TILES[-1])
    torch.testing.assert_close(got.float(), want + b.float(), atol=tol(dtype), rtol=tol(dtype))


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("size", SIZES)
def test_split_k_matches_linear(size, rows):
    w, b, x, _, _ = inputs(rows, size, torch.float32, seed=20 + rows)
    want = F.linear(x, w, b)
    for split in (2, 3, 8):
        got = gemv(x, w, b, GemvConfig(8, 64 if not ON_GPU else 512, 4, 1, split))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_kernels_refuse_what_they_cannot_take():
    w, b, x, res, norm = inputs(2, (16, 32), torch.float32, seed=0)
    with pytest.raises(ValueError, match="rows"):
        gemv(torch.zeros(5, 32, device=DEVICE), w)
    with pytest.raises(ValueError, match="gate_up"):
        gemv_silu_and_mul(torch.zeros(2, 30, device=DEVICE), w)
    with pytest.raises(ValueError, match="norm weight"):
        gemv_rms_norm(x, res, norm.weight.half(), norm.eps, w)


def test_dispatch_fuses_only_what_was_chosen(count_launches, torch_path):
    k, n = 64, 40
    w, b, x, res, norm = inputs(2, (n, k), torch.float32, seed=3)
    linear = torch.nn.Linear(k, n).to(DEVICE)
    down = torch.nn.Linear(k // 2, n, bias=False).to(DEVICE)
    tile = TILES[0]
    plain = PlainMatmuls()
    dispatch = LinearDispatch()
    # nothing chosen: the plain path (norm, then cuBLAS / F.linear)
    y, summed = dispatch.norm_linear(x, res, norm, linear)
    assert count_launches == []
    dispatch.choice[choice_key("rms_norm_residual", 2, linear)] = tile
    dispatch.choice[choice_key("silu_and_mul", 2, down)] = tile
    got, got_sum = dispatch.norm_linear(x, res, norm, linear)
    assert count_launches == ["gemv_rms_norm"]
    torch.testing.assert_close(got, y, atol=1e-4, rtol=1e-4)
    assert torch.equal(got_sum, summed)
    # without a residual (the first layer) nothing was chosen: plain, and x comes back
    got, same = dispatch.norm_linear(x, None, norm, linear)
    assert same is x and count_launches == ["gemv_rms_norm"]
    # more rows than tuned, or than the kernels take: plain
    x5, res5 = torch.randn(5, k, device=DEVICE), torch.randn(5, k, device=DEVICE)
    dispatch.norm_linear(x5, res5, norm, linear)
    assert count_launches == ["gemv_rms_norm"]
    gate_up = torch.randn(2, k, device=DEVICE)
    torch.testing.assert_close(
        dispatch.silu_linear(gate_up, down), plain.silu_linear(gate_up, down), atol=1e-4, rtol=1e-4
    )
    assert count_launches == ["gemv_rms_norm", "gemv_silu_and_mul"]


def test_dispatch_norm_of_selected_rows(count_launches, torch_path):
    """The last norm before the LM head: only the rows that give logits go through."""
    k, n = 64, 40
    _, _, _, _, norm = inputs(1, (n, k), torch.float32, seed=4)
    x, res = torch.randn(6, k, device=DEVICE), torch.randn(6, k, device=DEVICE)
    rows = torch.tensor([5, 2], device=DEVICE)
    head = torch.nn.Linear(k, n, bias=False).to(DEVICE)
    want, none = PlainMatmuls().norm_linear(x, res, norm, head, rows=rows)
    assert none is None
    dispatch = LinearDispatch()
    dispatch.choice[choice_key("rms_norm_residual", 2, head)] = TILES[0]
    got, none = dispatch.norm_linear(x, res, norm, head, rows=rows)
    assert none is None and count_launches == ["gemv_rms_norm"]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


class SelfAttention:
    """A stand-in attention backend: each token attends to itself only (its own v per q head)."""

    rotates_qk = False

    def forward(self, q, k, v, layer_id, batch, scale):
        return v.repeat_interleave(q.shape[1] // v.shape[1], dim=1) + 0.1 * q  # (T, Hq, D)


def small_llama(dtype: torch.dtype, bias: bool):
    from radixlm.runtime.model_config import ModelConfig
    from radixlm.runtime.models.llama import LlamaForCausalLM

    cfg = ModelConfig(
        model_type="llama", vocab_size=97, hidden_size=72, intermediate_size=100, num_layers=2,
        num_heads=6, num_kv_heads=2, head_dim=12, rms_norm_eps=1e-5, rope_theta=10000.0,
        rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=False,
        attention_bias=bias, qk_norm=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg, 64)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model = model.to(DEVICE, dtype)
    model.rope.build_tables(DEVICE)
    return model


def decode_batch(tokens: list[int]):
    from radixlm.runtime.forward_batch import ForwardBatch

    t = len(tokens)
    ids = torch.tensor(tokens, device=DEVICE)
    ones = torch.ones(t, dtype=torch.int64, device=DEVICE)
    return ForwardBatch(
        input_ids=ids, positions=torch.arange(t, device=DEVICE) * 7, out_cache_loc=ones,
        req_pool_indices=ones, prefix_lens=ones, extend_lens=ones, seq_lens=ones,
        logits_indices=torch.arange(t, device=DEVICE), extend_lens_cpu=[1] * t,
        prefix_lens_cpu=[1] * t, num_multi=0,
    )  # fmt: skip


def fuse_everything(model, rows: int) -> LinearDispatch:
    """A dispatch that runs every matmul of `model` at `rows` rows as a Triton kernel, each fusable
    one with the op before it (what tuning could choose at most)."""
    dispatch = LinearDispatch()
    for linear in model.linears():
        dispatch.choice[choice_key("linear", rows, linear)] = TILES[0]
    for op, linear, _ in model.fusable_matmuls():
        dispatch.choice[choice_key(op, rows, linear)] = TILES[-1]
    return dispatch


@pytest.mark.parametrize(("rows", "bias"), [(1, True), (3, False)])
def test_llama_forward_with_fused_matmuls_equals_plain(rows, bias, torch_path):
    dtype = torch.float32 if not ON_GPU else torch.bfloat16
    model = small_llama(dtype, bias)
    batch = decode_batch([5, 17, 96][:rows])
    want = model(batch, SelfAttention())
    fused = fuse_everything(model, rows)
    model.use_matmul(fused)
    assert {m.matmul for m in model.modules() if hasattr(m, "matmul")} == {fused}
    got = model(batch, SelfAttention())
    torch.testing.assert_close(got, want, atol=tol(dtype) * 5, rtol=tol(dtype))
    ops = [op for op, _, _ in model.fusable_matmuls()]
    assert ops == ["rms_norm", "rms_norm_residual", "silu_and_mul"] + [
        "rms_norm_residual", "rms_norm_residual", "silu_and_mul", "rms_norm_residual"
    ]  # fmt: skip


@pytest.mark.gpu
def test_tuning_keeps_the_plain_path_unless_a_kernel_wins():
    from radixlm.runtime.engine_core import tune_small_matmuls

    model = small_llama(torch.bfloat16, bias=False)
    tune_small_matmuls(model)
    dispatch = model.matmul
    assert isinstance(dispatch, LinearDispatch)
    batch = decode_batch([5])
    got = model(batch, SelfAttention())
    model.use_matmul(PlainMatmuls())
    torch.testing.assert_close(got, model(batch, SelfAttention()), atol=0.1, rtol=0.05)


@pytest.mark.gpu
def test_fused_gemv_is_captured_in_a_cuda_graph():
    model = small_llama(torch.bfloat16, bias=False)
    batch = decode_batch([5])
    want = model(batch, SelfAttention())
    model.use_matmul(fuse_everything(model, 1))
    model(batch, SelfAttention())  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model(batch, SelfAttention())
    graph.replay()
    torch.testing.assert_close(out, want, atol=0.1, rtol=0.05)


@pytest.mark.gpu
def test_llama_decode_with_rope_fused_into_the_kv_store_equals_separate():
    """The Triton backend's one-kernel rope + KV store against rope_ then store_kv: same logits,
    same pool."""
    from radixlm.runtime.attention import create_backend
    from radixlm.runtime.forward_batch import ForwardBatch
    from radixlm.runtime.memory_pool import KVPool

    model = small_llama(torch.bfloat16, bias=True)
    cfg = model.cfg
    outs = []
    for rotates in (False, True):
        pool = KVPool(32, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, DEVICE)
        table = torch.zeros(4, 8, dtype=torch.int32, device=DEVICE)
        table[1, :4] = torch.tensor([3, 7, 11, 20])
        table[2, :6] = torch.tensor([4, 8, 12, 21, 22, 30])
        backend = create_backend("triton", pool, table, DEVICE, num_q_heads=cfg.num_heads)
        backend.rotates_qk = rotates
        batch = ForwardBatch(
            input_ids=torch.tensor([5, 17], device=DEVICE),
            positions=torch.tensor([3, 5], device=DEVICE),
            out_cache_loc=torch.tensor([20, 30], device=DEVICE),
            req_pool_indices=torch.tensor([1, 2], device=DEVICE),
            prefix_lens=torch.tensor([3, 5], device=DEVICE),
            extend_lens=torch.tensor([1, 1], device=DEVICE),
            seq_lens=torch.tensor([4, 6], device=DEVICE),
            logits_indices=torch.arange(2, device=DEVICE),
            extend_lens_cpu=[1, 1], prefix_lens_cpu=[3, 5], num_multi=0,
        )  # fmt: skip
        torch.manual_seed(1)
        pool._buffer[:, :, 1:].normal_()  # earlier tokens' K/V, the same in both runs
        outs.append((model(batch, backend), pool._buffer.clone()))
    (want, want_pool), (got, got_pool) = outs
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got_pool, want_pool, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32])
def test_lm_head_logits_in_float32_are_the_unrounded_sums(dtype, torch_path, count_launches):
    """The LM head's logits come out float32, the sums of the half-precision products not rounded
    to the half type, on the kernel path (a float32 output) and on the plain path
    (`float32_linear`), for the rows that need logits."""
    n, k = SIZES[0]
    w, b, x, res, norm = inputs(3, (n, k), dtype, seed=31)
    h, _ = norm(x, res)
    want = F.linear(h.float(), w.float(), b.float())
    y, _ = gemv_rms_norm(x, res, norm.weight, norm.eps, w, b, TILES[0], out_dtype=torch.float32)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-4)
    rounded = F.linear(h, w, b).float()  # what the float32 output avoids
    assert (rounded - want).abs().max() > 10 * (y - want).abs().max()

    linear = torch.nn.Linear(k, n).to(DEVICE, dtype)
    with torch.no_grad():
        linear.weight.copy_(w)
        linear.bias.copy_(b)
    rows = torch.tensor([2, 0], device=DEVICE)
    fused, plain_gemv = LinearDispatch(), LinearDispatch()
    fused.choice[choice_key("rms_norm_residual", 2, linear)] = TILES[0]
    plain_gemv.choice[choice_key("linear", 2, linear)] = TILES[1]  # the norm apart, then the GEMV
    for matmul, launched in ((PlainMatmuls(), []), (fused, ["gemv_rms_norm"]), (plain_gemv, ["gemv"])):  # fmt: skip
        count_launches.clear()
        got, none = matmul.norm_linear(x, res, norm, linear, rows=rows, float32=True)
        assert count_launches == launched
        assert got.dtype == torch.float32 and none is None
        torch.testing.assert_close(got, want[rows], atol=1e-4, rtol=1e-4)


def test_lm_head_tuning_times_the_float32_output_on_both_paths(torch_path):
    """The LM head is tuned as it runs: its plain path and its kernels write float32."""
    dtype = DTYPES[-1]  # a half type
    n, k = SIZES[0]
    w, _, _, _, norm = inputs(1, (n, k), dtype, seed=41)
    linear = torch.nn.Linear(k, n, bias=False).to(DEVICE, dtype)
    with torch.no_grad():
        linear.weight.copy_(w)
    dispatch = LinearDispatch()
    for op in ("linear", "rms_norm_residual"):
        plain, kernel, _ = dispatch._candidate_calls(op, linear, 1, norm, float32=True)
        want, got = plain(linear), kernel(TILES[0], linear)
        assert want.dtype == got.dtype == torch.float32, op
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
