"""INT4 W4A16 weights (runtime/quantization/int4.py): packing and group-wise rounding against a
hand-worked example, the batch-1 GEMV over packed INT4 weights (kernels/gemv.py with `w_scale`
and `w_zero`, alone and with its prologues) against its torch oracle (kernels/quant_ref.py), the
dispatch, and `quantization="w4a16"` end to end against transformers' model with the same INT4
numerics; the matmul over packed INT4 weights for larger batches (kernels/quant_gemm.py) against
the same oracle. Kernels under TRITON_INTERPRET=1 on the CPU at small sizes; on a GPU at real sizes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

import radixlm  # noqa: E402
from radixlm.kernels.gemv import (  # noqa: E402
    GemvConfig,
    gemv,
    gemv_rms_norm,
    gemv_silu_and_mul,
    int4_mma,
)
from radixlm.kernels.quant_gemm import grouped_gemm  # noqa: E402
from radixlm.kernels.quant_ref import (  # noqa: E402
    dequantize_groups,
    grouped_linear_ref,
    pack_int4,
    quantize_int4_groups,
    unpack_int4,
)
from radixlm.runtime.layers import RMSNorm  # noqa: E402
from radixlm.runtime.matmul_dispatch import LinearDispatch, choice_key  # noqa: E402
from radixlm.runtime.quantization.int4 import Int4Linear, int4_group  # noqa: E402
from radixlm.runtime.quantization.plan import QuantPlan, finish, prepare  # noqa: E402
from tests.test_quantization_engine import (  # noqa: E402, F401
    GREEDY,
    PROMPTS,
    hf_greedy,
    sharp_tiny_folder,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
TOL = 2e-2 if ON_GPU else 1e-4
# make test-fast takes the cases that are not SLOW (the interpreter takes seconds a case)
SLOW = (lambda v: v) if ON_GPU else (lambda v: pytest.param(v, marks=pytest.mark.slow))
# (N, K, group): partial tiles and groups smaller than a tile on the CPU
SIZES = [(37, 128, 32), (20, 256, 128)] if not ON_GPU else [(6144, 4096, 128), (4096, 14336, 128)]
TILES = (
    [
        GemvConfig(8, 64, 4, 1, 1),
        GemvConfig(4, 64, 4, 1, 3),
        GemvConfig(4, 32, 1, 1, 2, late_sum=True, prefetch=True),
        GemvConfig(16, 32, 1, 2, 3, dot=True),
        GemvConfig(8, 128, 4, 1, 1, words=True),
        GemvConfig(4, 128, 1, 1, 2, prefetch=True, words=True),
    ]
    if not ON_GPU
    else [
        GemvConfig(4, 2048, 4, 2, 1),
        GemvConfig(8, 512, 4, 3, 4),
        GemvConfig(16, 512, 8, 1, 1, late_sum=True, prefetch=True),
        GemvConfig(32, 128, 4, 4, 1, dot=True),
        GemvConfig(256, 128, 4, 1, 4, words=True),
        GemvConfig(128, 128, 4, 1, 1, prefetch=True, words=True),
    ]
)


def int4_weight(n: int, k: int, group: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / k**0.5 + 0.01  # (an offset: zero points not 8)
    packed, scale, zero = quantize_int4_groups(w, group)
    return w, packed.to(DEVICE), scale.to(DEVICE), zero.to(DEVICE)


def test_packing_puts_even_columns_in_the_low_bits():
    q = torch.tensor([[1, 2, 15, 0], [7, 8, 9, 10]], dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.tolist() == [[0x21, 0x0F], [0x87, 0xA9]]
    assert torch.equal(unpack_int4(packed), q)


def test_groups_round_min_max_to_sixteen_levels():
    # one row, two groups of 4: [-1, 0, 0.65, 2] and [0, 0, 0, 3]
    w = torch.tensor([[-1.0, 0.0, 0.65, 2.0, 0.0, 0.0, 0.0, 3.0]])
    packed, scale, zero = quantize_int4_groups(w, group=4)
    torch.testing.assert_close(scale, torch.tensor([[3.0 / 15, 3.0 / 15]]))
    assert zero.tolist() == [[5.0, 0.0]]  # -min / scale = 5; a group >= 0 keeps 0 at level 0
    assert unpack_int4(packed).tolist() == [[0, 5, 8, 15, 0, 0, 0, 15]]  # 0.65 / 0.2 + 5 -> 8
    back = dequantize_groups(packed, scale, zero)
    torch.testing.assert_close(back, torch.tensor([[-1.0, 0.0, 0.6, 2.0, 0.0, 0.0, 0.0, 3.0]]))
    w, packed, scale, zero = (t.cpu() for t in int4_weight(16, 256, 128, seed=1))
    err = (dequantize_groups(packed, scale, zero) - w).abs().reshape(16, 2, 128)
    assert bool((err <= scale[..., None] / 2 + 1e-6).all())  # half a level at most


def test_group_of_a_layer():
    assert [int4_group(k) for k in (4096, 576, 64, 48)] == [128, 64, 64, 16]
    with pytest.raises(ValueError, match="multiple of 16; one has 100: use quantization='fp8'"):
        int4_group(100)


@pytest.mark.parametrize("rows", [1, SLOW(3)])
@pytest.mark.parametrize("size", SIZES)
def test_gemv_reads_packed_int4_weights_as_the_oracle_does(size, rows, torch_path):
    n, k, group = size
    _, packed, scale, zero = int4_weight(n, k, group, seed=rows)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k + 3, generator=gen).to(DEVICE, DTYPE)[:, :k]
    b = torch.randn(n, generator=gen).to(DEVICE, DTYPE)
    res = torch.randn(rows, k, generator=gen).to(DEVICE, DTYPE)
    norm = RMSNorm(k, 1e-5).to(DEVICE, DTYPE)
    gate_up = (torch.randn(rows, 2 * k, generator=gen) * 3).to(DEVICE, DTYPE)
    want = grouped_linear_ref(x, packed, scale, zero, b, out_dtype=torch.float32)
    normed, summed = norm(x, res)
    want_norm = grouped_linear_ref(normed, packed, scale, zero, out_dtype=torch.float32)
    # the fused prologue keeps silu(gate) * up in float32 (silu_and_mul would round it to x's
    # dtype): against that, within the output's rounding and what rounding the activation to
    # x's dtype moves a sum (a dot tile's operands are), three standard deviations of it
    gate, up = gate_up.float().chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate) * up
    want_silu = grouped_linear_ref(act, packed, scale, zero, out_dtype=torch.float32)
    unit = torch.finfo(DTYPE).eps / 2  # (the unit roundoff)
    w = dequantize_groups(packed, scale, zero).float()
    spread = 3 * unit * ((act * act) @ (w * w).t()).sqrt()
    quant = {"w_scale": scale, "w_zero": zero}
    for tile in TILES:
        torch.testing.assert_close(gemv(x, packed, b, tile, **quant).float(), want, atol=TOL, rtol=TOL)  # fmt: skip
        y, got_sum = gemv_rms_norm(x, res, norm.weight, norm.eps, packed, None, tile, **quant)
        assert torch.equal(got_sum, summed)
        torch.testing.assert_close(y.float(), want_norm, atol=TOL, rtol=TOL)
        y = gemv_silu_and_mul(gate_up, packed, None, tile, **quant).float()
        off = (y - want_silu).abs() - (TOL + TOL * want_silu.abs() + spread)
        assert float(off.max()) <= 0, (tile, float(off.max()))


# (the CPU interpreter computes bfloat16 wrongly: bfloat16 on a GPU only)
HALF = [torch.float16, torch.bfloat16] if ON_GPU else [torch.float16]


@pytest.mark.parametrize("dtype", HALF)
def test_int4_tiles_of_one_group_go_into_the_mma_as_stored(dtype):
    """A tl.dot tile of one group (or part of one) takes the stored integers as 1024 + q in
    float16 and applies scale and zero point to the sums; a tile of several groups, or bfloat16
    x, dequantizes. Both against the oracle, in the GEMV and in the matmul for more rows."""
    n, k, group = (4096, 4096, 128) if ON_GPU else (20, 256, 128)
    _, packed, scale, zero = int4_weight(n, k, group, seed=9)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(6, k, generator=gen).to(DEVICE, dtype)
    want = grouped_linear_ref(x, packed, scale, zero, out_dtype=torch.float32)
    size = want.abs().amax()
    tiles = [(16, 128, 1), (16, 64, 3), (16, 256, 1)] if not ON_GPU else [(32, 128, 1), (32, 64, 4), (32, 256, 1)]  # fmt: skip
    for block_n, block_k, split in tiles:
        tile = GemvConfig(block_n, block_k, 4, 2, split, dot=True)
        got = gemv(x[:3], packed, None, tile, torch.float32, w_scale=scale, w_zero=zero)
        torch.testing.assert_close(got / size, want[:3] / size, atol=1e-3, rtol=0)
    # the matmul: float16 x meets the stored integers (exact), bfloat16 x the weights dequantized
    # and rounded to bfloat16 (the oracle rounds them alike); its float32 sums, then rounded once
    block = (16, 16, 64) if not ON_GPU else (64, 64, 64)
    w = dequantize_groups(packed, scale, zero)
    used = x.float() @ (w if dtype == torch.float16 else w.to(dtype).float()).t()
    got = grouped_gemm(x, packed, scale, zero, None, block, out_dtype=torch.float32)
    torch.testing.assert_close(got / size, used / size, atol=1e-4, rtol=0)
    got = grouped_gemm(x, packed, scale, zero, None, block).float()
    half_ulp = torch.finfo(dtype).eps / 2 * used.abs()
    assert float(((got - used).abs() - half_ulp - 1e-4 * size).max()) <= 0


def test_half_tiles_take_bfloat16_x_into_the_mma_with_the_stored_integers():
    """A `half` dot tile of one group takes x (bfloat16's values) as float16, each row scaled by a
    power of two (exact: 1e-3 and 1e30 as well as 1), the integers as 1024 + q: against the
    oracle as the float16 tiles are (the sums less 1024 times x's cancel some bits); float32 x
    rounded as the tile rounds it; a tile of several groups is refused."""
    n, k, group = (4096, 4096, 128) if ON_GPU else (20, 256, 128)
    _, packed, scale, zero = int4_weight(n, k, group, seed=12)
    gen = torch.Generator().manual_seed(12)
    tiles = [(16, 128, 1), (16, 64, 3)] if not ON_GPU else [(64, 128, 1), (32, 128, 4)]
    for magnitude in (1e-3, 1.0, 1e30):
        x = (torch.randn(3, k, generator=gen) * magnitude).to(torch.bfloat16).to(DEVICE, DTYPE)
        want = grouped_linear_ref(x, packed, scale, zero, out_dtype=torch.float32)
        size = want.abs().amax()
        for block_n, block_k, split in tiles:
            tile = GemvConfig(block_n, block_k, 4, 2, split, dot=True, half=True)
            got = gemv(x, packed, None, tile, torch.float32, w_scale=scale, w_zero=zero)
            torch.testing.assert_close(got / size, want / size, atol=1e-3, rtol=0)
    # (bfloat16 x alone dequantizes a tile; a half tile takes the integers into the MMA)
    assert not int4_mma(group, 128, torch.bfloat16) and int4_mma(group, 128, torch.bfloat16, True)
    # float32 x of more bits than float16 holds: +-(1 + 2**-11 - 2**-20) goes in as +-1
    # (float16's step in [1, 2) is 2**-10), so the sums are those of the rounded x, ~5e-4 of them
    # from the float32 oracle's: the half path is the one that ran. (Signs alternate along K, so
    # that the sums of 1024 times x cancel little.)
    signs = torch.tensor([1.0, -1.0]).repeat(k // 2)
    x = torch.stack([signs, -signs]) * (1 + 2.0**-11 - 2.0**-20)
    rounded = x.sign()
    want = grouped_linear_ref(rounded.to(DEVICE), packed, scale, zero, out_dtype=torch.float32)
    exact = grouped_linear_ref(x.to(DEVICE), packed, scale, zero, out_dtype=torch.float32)
    size = want.abs().amax()
    assert float((exact - want).abs().max() / size) > 3e-4
    for block_n, block_k, split in tiles:
        tile = GemvConfig(block_n, block_k, 4, 2, split, dot=True, half=True)
        got = gemv(x.to(DEVICE), packed, None, tile, torch.float32, w_scale=scale, w_zero=zero)
        torch.testing.assert_close(got / size, want / size, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="INT4 ones a group or less a tile"):
        gemv(x, packed, None, GemvConfig(16, 256, 4, 2, 1, dot=True, half=True), w_scale=scale, w_zero=zero)  # fmt: skip


@pytest.mark.parametrize("rows", [5, SLOW(33)])
@pytest.mark.parametrize("size", SIZES)
def test_int4_gemm_for_larger_batches_matches_the_oracle(size, rows):
    n, k, group = size
    _, packed, scale, zero = int4_weight(n, k, group, seed=20 + rows)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k + 3, generator=gen).to(DEVICE, DTYPE)[:, :k]
    b = torch.randn(n, generator=gen).to(DEVICE, DTYPE)
    want = grouped_linear_ref(x, packed, scale, zero, b, out_dtype=torch.float32)
    block = (16, 16, 32) if not ON_GPU else (64, 64, 64)  # (the interpreter's time grows with it)
    got = grouped_gemm(x, packed, scale, zero, b, block)
    assert got.dtype == DTYPE
    torch.testing.assert_close(got.float(), want, atol=TOL, rtol=TOL)
    with pytest.raises(ValueError, match="grouped_gemm takes x"):
        grouped_gemm(x, packed, scale[:, :1].contiguous(), zero, b, block)


def int8_weight(n: int, k: int, group: int, seed: int):
    """int8 integers with a scale and zero point a group (the layout GGUF's Q8_0 and Q6_K run in
    on a GPU), zero points not 0 (as a mixed layer's 4-bit parts have them)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, k // group, generator=gen) * 0.02 / k**0.5 + 1e-4
    zero = torch.randint(-8, 9, (n, k // group), generator=gen).float()
    return q.to(DEVICE), scale.to(DEVICE), zero.to(DEVICE)


@pytest.mark.parametrize("rows", [1, SLOW(3), SLOW(6)])
@pytest.mark.parametrize("group, zeros", [(16, True), (32, True), (32, False)])
def test_gemv_and_matmul_read_int8_groups_as_the_oracle_does(group, zeros, rows):
    """The GEMV's tiles (plain, split, late sum, tl.dot; a prefetching tile reads as the plain
    one) alone and with the SiLU and norm prologues, and the matmul for more rows, over int8
    weights with zero points and without: each against the oracle. The words tiles, which read
    packed INT4, refuse them."""
    n, k = (37, 128) if not ON_GPU else (4096, 14336)
    q, scale, zero = int8_weight(n, k, group, seed=rows)
    zero = zero if zeros else None  # (symmetric groups: no zero points read)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k + 3, generator=gen).to(DEVICE, DTYPE)[:, :k]
    b = torch.randn(n, generator=gen).to(DEVICE, DTYPE)
    gate_up = torch.randn(rows, 2 * k, generator=gen).to(DEVICE, DTYPE)
    want = grouped_linear_ref(x, q, scale, zero, b, out_dtype=torch.float32)
    gate, up = gate_up.float().chunk(2, dim=-1)
    want_silu = grouped_linear_ref(
        torch.nn.functional.silu(gate) * up, q, scale, zero, out_dtype=torch.float32
    )
    norm = RMSNorm(k, 1e-5).to(DEVICE, DTYPE)
    want_norm = grouped_linear_ref(norm(x), q, scale, zero, out_dtype=torch.float32)
    size, size_silu = want.abs().amax(), want_silu.abs().amax()
    size_norm = want_norm.abs().amax()
    quant = {"w_scale": scale, "w_zero": zero}
    for tile in TILES:
        if tile.words:
            with pytest.raises(ValueError, match="a words tile reads packed INT4 weights"):
                gemv(x[:1], q, b, tile, **quant)
            continue
        if rows > 4 and not tile.dot:
            continue
        got = gemv(x, q, b, tile, torch.float32, **quant)
        torch.testing.assert_close(got / size, want / size, atol=TOL, rtol=0)
        got = gemv_silu_and_mul(gate_up, q, None, tile, **quant).float()
        torch.testing.assert_close(got / size_silu, want_silu / size_silu, atol=TOL, rtol=0)
        y, _ = gemv_rms_norm(x, None, norm.weight, norm.eps, q, None, tile, torch.float32, **quant)
        torch.testing.assert_close(y / size_norm, want_norm / size_norm, atol=TOL, rtol=0)
    block = (16, 16, 32) if not ON_GPU else (64, 64, 64)
    got = grouped_gemm(x, q, scale, zero, b, block)
    assert got.dtype == DTYPE
    torch.testing.assert_close(got.float() / size, want / size, atol=TOL, rtol=0)
    # float32 out (an LM head's logits): the sums unrounded
    got = grouped_gemm(x, q, scale, zero, b, block, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got / size, want / size, atol=1e-5 if not ON_GPU else TOL, rtol=0)
    with pytest.raises(ValueError, match="gemv takes a packed INT4 weight"):
        gemv(x[:1], q, None, TILES[0], w_scale=scale, w_zero=scale[:, :1])


def test_gemv_refuses_int4_weights_without_their_scales():
    _, packed, scale, zero = int4_weight(8, 64, 32, seed=2)
    x = torch.zeros(1, 64, device=DEVICE, dtype=DTYPE)
    with pytest.raises(ValueError, match="packed INT4 weight"):
        gemv(x, packed, None, TILES[0], w_zero=zero)
    with pytest.raises(ValueError, match="packed INT4 weight"):
        gemv(x, packed, None, TILES[0], w_scale=scale, w_zero=zero[:, :1])
    with pytest.raises(ValueError, match="packed INT4 weight"):  # (INT4 needs its zero points)
        gemv(x, packed, None, TILES[0], w_scale=scale)
    with pytest.raises(ValueError, match="grouped_gemm takes x"):
        grouped_gemm(x, packed, scale, None)


@pytest.mark.parametrize("rows", [1, SLOW(2)])
def test_words_tiles_take_layers_of_part_tiles_and_refuse_other_weights(rows):
    """K = 576 in groups of 64 is four and a half `words` tiles of 128 columns: split in two, the
    second split ends mid-tile (a split is whole tiles, a step one group); prefetching, the load
    after the last group lies past K. A float weight is refused."""
    _, packed, scale, zero = int4_weight(9, 576, 64, seed=3)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(3)).to(DEVICE, DTYPE)
    want = grouped_linear_ref(x, packed, scale, zero, out_dtype=torch.float32)
    for split, prefetch in ((1, False), (2, False), (2, True)):
        tile = GemvConfig(8, 128, 4, 1, split, prefetch=prefetch, words=True)
        got = gemv(x, packed, None, tile, torch.float32, w_scale=scale, w_zero=zero)
        torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)
    with pytest.raises(ValueError, match="a words tile reads packed INT4 weights"):
        gemv(x, torch.zeros(9, 576, device=DEVICE, dtype=DTYPE), None, tile)
    # rows 2 bytes apart from row to row over: not whole words (tuning passes it by, no copy)
    wide = torch.zeros(9, 288 + 2, dtype=torch.uint8, device=DEVICE)[:, :288]
    wide.copy_(packed)
    with pytest.raises(ValueError, match="whole int32 words a row from an aligned start"):
        gemv(x, wide, None, tile, w_scale=scale, w_zero=zero)


def test_dispatch_runs_the_gemv_over_int4_weights_where_chosen(count_launches):
    layer = torch.nn.Linear(128, 40, bias=True).to(DEVICE, DTYPE)
    plan = QuantPlan(Int4Linear(), "test")
    model = torch.nn.ModuleDict({"proj": layer})
    prepare(model, plan)
    finish(model, plan)
    assert layer.weight.dtype == torch.uint8 and layer.weight.shape == (40, 64)
    dispatch = LinearDispatch()
    torch.manual_seed(0)
    x = torch.randn(1, 128, device=DEVICE, dtype=DTYPE)
    want = layer.quant_scheme.reference(layer, x)
    torch.testing.assert_close(dispatch(x, layer).float(), want, atol=TOL, rtol=TOL)
    assert count_launches == []
    dispatch.choice[choice_key("linear", 1, layer)] = TILES[0]
    got = dispatch(x, layer)
    assert count_launches == ["gemv"]
    torch.testing.assert_close(got.float(), want, atol=TOL, rtol=TOL)


def hf_with_int4_oracle(folder: str):
    """transformers' model of `folder` (float32) whose decoder linear layers compute the W4A16
    oracle over their weights rounded as quantization="w4a16" rounds them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head"):
            w = module.weight.detach()
            packed, scale, zero = quantize_int4_groups(w, int4_group(w.shape[1]))

            def forward(x, _p=packed, _s=scale, _z=zero, _b=module.bias):
                return grouped_linear_ref(x, _p, _s, _z, _b)

            module.forward = forward
    return model


def test_w4a16_engine_computes_what_transformers_computes_with_int4_linears(sharp_tiny_folder):  # noqa: F811
    with radixlm.Engine(sharp_tiny_folder, dtype="float32", quantization="w4a16") as engine:
        mlp = engine.model.layers[0].mlp
        assert mlp.down_proj.weight.dtype == torch.uint8
        assert mlp.down_proj.weight_scale.shape == (64, 1)  # K 128: one group of 128 a row
        assert mlp.gate_up_proj.weight_scale.shape == (256, 1)  # K 64: one group of 64
        outs = [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]
        tokenizer = engine.tokenizer
    hf = hf_with_int4_oracle(sharp_tiny_folder)
    assert outs == hf_greedy(hf, tokenizer)
