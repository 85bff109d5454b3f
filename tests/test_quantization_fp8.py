"""FP8 weights (runtime/quantization/fp8.py): the rounding against e4m3's own grid, the batch-1 GEMV
over float8 weights (kernels/gemv.py with `w_scale`, alone and with its norm / SiLU prologues)
against its torch oracle (kernels/quant_ref.py), the dispatch that routes a quantized layer, and
`quantization="fp8"` end to end: an engine's tokens against transformers' model with the same
float8 numerics, and against the unquantized engine on the real default model.
Kernels under TRITON_INTERPRET=1 on the CPU at small sizes; on a GPU at real sizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton is not installed")

from radixlm.kernels.fused import fp8_quantize_rows  # noqa: E402
from radixlm.kernels.gemv import GemvConfig, gemv, gemv_rms_norm, gemv_silu_and_mul  # noqa: E402
from radixlm.kernels.quant_ref import (  # noqa: E402
    FP8_DTYPE,
    FP8_MAX,
    dequantize_fp8_rows,
    fp8_linear_ref,
    quantize_fp8_rows,
)
from radixlm.runtime.layers import PlainMatmuls, RMSNorm, silu_and_mul  # noqa: E402
from radixlm.runtime.matmul_dispatch import LinearDispatch, choice_key  # noqa: E402
from radixlm.runtime.quantization.fp8 import Fp8Linear  # noqa: E402
from radixlm.runtime.quantization.plan import QuantPlan, finish, prepare  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
TOL = 2e-2 if ON_GPU else 1e-4  # the output rounded once to DTYPE; sums differ only in order
# make test-fast takes the rows counts that are not SLOW (on the CPU the interpreter takes seconds
# a case); make test takes them all
SLOW = (lambda v: v) if ON_GPU else (lambda v: pytest.param(v, marks=pytest.mark.slow))
SIZES = [(37, 100), (64, 96)] if not ON_GPU else [(6144, 4096), (4096, 14336), (960, 576)]
TILES = (
    [
        GemvConfig(8, 64, 4, 1, 1),
        GemvConfig(4, 64, 4, 1, 3),  # split-K: each split's partial sum scaled
        GemvConfig(4, 32, 1, 1, 2, late_sum=True, prefetch=True),
        GemvConfig(16, 32, 1, 2, 3, dot=True),  # float8 tiles converted to x's type for tl.dot
    ]
    if not ON_GPU
    else [
        GemvConfig(4, 2048, 4, 2, 1),
        GemvConfig(8, 512, 4, 3, 4),
        GemvConfig(16, 512, 8, 1, 1, late_sum=True, prefetch=True),
        GemvConfig(32, 128, 4, 4, 1, dot=True),
    ]
)


def fp8_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the float weight, its float8 rows, their scales), rows of very different magnitudes."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / k**0.5 * torch.logspace(-2, 1, n).reshape(-1, 1)
    values, scale = quantize_fp8_rows(w)
    return w.to(DEVICE), values.to(DEVICE), scale.reshape(-1).to(DEVICE)


# ---- the rounding ---------------------------------------------------------------------------


def test_rows_round_to_the_nearest_e4m3_value_at_amax_over_448():
    w, values, scale = (t.cpu() for t in fp8_weight(64, 96, seed=1))
    assert values.dtype == FP8_DTYPE and scale.shape == (64,)
    torch.testing.assert_close(scale, w.abs().amax(1) / FP8_MAX)
    # each row's largest magnitude lands on e4m3's largest value
    assert torch.equal(values.float().abs().amax(1), torch.full((64,), FP8_MAX))
    # every value is the nearest of e4m3's grid: the candidates either side are no closer
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    grid = grid[grid.isfinite()].unique()
    scaled = w / scale.reshape(-1, 1)
    nearest = grid[(scaled.reshape(-1, 1) - grid).abs().argmin(1)].reshape(scaled.shape)
    assert torch.equal((values.float() - scaled).abs(), (nearest - scaled).abs())
    back = dequantize_fp8_rows(values, scale)
    rel = ((back - w).abs() / w.abs().amax(1, keepdim=True)).max()
    assert rel <= 2**-4  # 3 mantissa bits: half a step of the top binade, relative to amax
    zero, zero_scale = quantize_fp8_rows(torch.zeros(2, 8))
    assert torch.equal(zero.float(), torch.zeros(2, 8)) and bool((zero_scale > 0).all())


def test_w8a8_oracle_rounds_each_token_at_its_own_scale():
    _, values, scale = (t.cpu() for t in fp8_weight(20, 32, seed=2))
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 32, generator=gen) * torch.tensor([[1e-3], [1.0], [1e3]])  # token scales
    got = fp8_linear_ref(x, values, scale, act_quant=True)
    for t in range(3):  # token by token: the same as a batch of one
        alone = fp8_linear_ref(x[t : t + 1], values, scale, act_quant=True)
        torch.testing.assert_close(got[t : t + 1], alone)
    xq, x_scale = quantize_fp8_rows(x)
    want = (xq.float() * x_scale) @ dequantize_fp8_rows(values, scale).t()
    size = want.abs().amax(-1, keepdim=True)  # (sums that cancel: error relative to the row's)
    torch.testing.assert_close(got / size, want / size, atol=1e-6, rtol=0)
    weight_only = fp8_linear_ref(x, values, scale, act_quant=False)
    torch.testing.assert_close(weight_only, x @ dequantize_fp8_rows(values, scale).t())


@pytest.mark.parametrize("one_pass", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_activation_kernel_rounds_each_token_as_the_oracle_does_bit_for_bit(
    dtype, one_pass, monkeypatch
):
    """The row in registers (rows up to 16k wide), or in tiles read twice (wider ones)."""
    from radixlm.kernels import fused

    if not one_pass:
        monkeypatch.setattr(fused, "_FP8_ONE_PASS_COLUMNS", 0)
    gen = torch.Generator().manual_seed(3)
    k = 4096 if ON_GPU else 300  # (wider than a tile on the GPU: two passes over the row)
    x = torch.randn(6, k + 5, generator=gen) * torch.logspace(-4, 4, k + 5)  # wide magnitudes
    x[1] = 0.0  # an all-zero token keeps its finite scale
    x = x.to(DEVICE, dtype)[:, :k]  # (a row stride beyond K)
    got, got_scale = fp8_quantize_rows(x)
    want, want_scale = quantize_fp8_rows(x)
    assert torch.equal(got_scale, want_scale)
    assert_same_float8(got, want)


# (the CPU interpreter computes bfloat16 wrongly: bfloat16 on a GPU only)
HALVES = [torch.float16, torch.bfloat16] if ON_GPU else [torch.float16]


@pytest.mark.parametrize("dtype", HALVES)
def test_the_norm_kernel_rounds_to_float8_as_the_oracle_does_bit_for_bit(dtype):
    """rms_norm_fp8: the norm's output (rounded to x's dtype), rounded to float8 at its row's
    scale, as quantize_fp8_rows of the norm's own output gives it."""
    from radixlm.kernels.fused import rms_norm_fp8
    from radixlm.kernels.fused_ref import rms_norm_ref

    gen = torch.Generator().manual_seed(5)
    k = 4096 if ON_GPU else 300
    x = (torch.randn(6, k, generator=gen) * torch.logspace(-3, 3, k)).to(DEVICE, dtype)
    x[1] = 0.0  # (an all-zero token keeps its finite scale)
    res = torch.randn(6, k, generator=gen).to(DEVICE, dtype)
    weight = (1 + 0.1 * torch.randn(k, generator=gen)).to(DEVICE, dtype)
    for residual in (None, res):
        got, got_scale, summed = rms_norm_fp8(x, weight, 1e-6, residual)
        normed, want_sum = rms_norm_ref(x, weight, 1e-6, residual)
        want, want_scale = quantize_fp8_rows(normed)
        assert torch.equal(got_scale, want_scale)
        assert_same_float8(got, want)
        assert summed is None if residual is None else torch.equal(summed, want_sum)
    with pytest.raises(ValueError, match="rms_norm_fp8 takes a norm weight of x's dtype"):
        rms_norm_fp8(x, weight.float(), 1e-6)


def test_rounding_to_float8_takes_every_value_to_the_nearest_once():
    """Each float8 value, the midpoints between neighbours (ties: to even) and a float32 step
    either side of them, subnormals included, at a row scale of 1: the kernel's values are
    torch's cast's. (Rounding a subnormal by adding 2^-6 first rounded twice: a value a step
    short of a midpoint went the midpoint's way.)"""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = values[torch.isfinite(values)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    near = [torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(1e3))]
    x = torch.cat([grid, mids, *near])
    x = torch.cat([x, -x])
    x = torch.cat([x, x.new_zeros((-x.numel()) % 255)]).view(-1, 255)
    x = torch.cat([x, x.new_full((x.shape[0], 1), 448.0)], dim=1).to(DEVICE)  # (scale 1)
    got, got_scale = fp8_quantize_rows(x)
    want, want_scale = quantize_fp8_rows(x)
    assert torch.equal(got_scale, want_scale)
    assert_same_float8(got, want)


def test_a_norm_before_an_fp8_layer_rounds_to_float8_in_its_kernel_on_a_gpu():
    """PlainMatmuls.norm_linear over an FP8 layer: on a GPU the norm's kernel rounds the
    activations to float8 (`norm_apply`), the result the norm then `apply`'s exactly; elsewhere
    it declines and the two run apart."""
    layer, _ = fp8_layer(256, 512, bias=True, seed=7)
    norm = RMSNorm(512, 1e-6).to(DEVICE, DTYPE)
    with torch.no_grad():
        norm.weight.add_(
            0.1 * torch.randn(512, generator=torch.Generator().manual_seed(7)).to(DEVICE)
        )
    x, res = (torch.randn(40, 512, device=DEVICE, dtype=DTYPE) for _ in range(2))
    scheme = layer.quant_scheme
    fused_norm = scheme.norm_apply(layer, x, res, norm)
    assert (fused_norm is not None) == ON_GPU
    normed, summed = norm(x, res)
    want = scheme.apply(layer, normed)
    got, got_sum = PlainMatmuls().norm_linear(x, res, norm, layer)
    assert torch.equal(got, want) and torch.equal(got_sum, summed)
    if ON_GPU:
        assert torch.equal(fused_norm[0], want)


def test_a_tuned_gemv_goes_before_the_norms_rounding(monkeypatch):
    """Where LinearDispatch has a GEMV tile for the layer at the step's rows, norm_linear runs
    the norm then that GEMV (weight-only numerics, x not rounded) and never asks the scheme to
    round in the norm's kernel; without a tile it asks (and on the CPU the scheme declines)."""
    layer, _ = fp8_layer(40, 96, bias=False, seed=8)
    norm = RMSNorm(96, 1e-6).to(DEVICE, DTYPE)
    x = torch.randn(1, 96, device=DEVICE, dtype=DTYPE)
    asked = []
    scheme = layer.quant_scheme
    monkeypatch.setattr(scheme, "norm_apply", lambda *a: asked.append(1))
    dispatch = LinearDispatch()
    dispatch.norm_linear(x, None, norm, layer)
    assert asked == [1]
    dispatch.choice[choice_key("linear", 1, layer)] = TILES[0]
    y, _ = dispatch.norm_linear(x, None, norm, layer)
    assert asked == [1]  # (the tuned GEMV took it)
    torch.testing.assert_close(y.float(), scheme.reference(layer, norm(x)), atol=TOL, rtol=TOL)


def assert_same_float8(got: torch.Tensor, want: torch.Tensor) -> None:
    """The same float8 values, bit for bit but for the sign of a zero (a GPU's conversion of a
    negative value that rounds to zero may give +0 where torch's gives -0: the same product)."""
    assert torch.equal(got.float(), want.float())
    nonzero = want.float() != 0
    assert torch.equal(got.view(torch.uint8)[nonzero], want.view(torch.uint8)[nonzero])


# ---- the GEMV over float8 weights -----------------------------------------------------------


@pytest.mark.parametrize("rows", [1, SLOW(3), 4])
@pytest.mark.parametrize("size", SIZES)
def test_gemv_reads_fp8_weights_as_the_oracle_does(size, rows):
    n, k = size
    _, values, scale = fp8_weight(n, k, seed=rows)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k + 3, generator=gen).to(DEVICE, DTYPE)[:, :k]  # strided rows
    b = torch.randn(n, generator=gen).to(DEVICE, DTYPE)
    want = fp8_linear_ref(x, values, scale, b, act_quant=False, out_dtype=torch.float32)
    for tile in TILES:
        got = gemv(x, values, b, tile, w_scale=scale)
        assert got.dtype == DTYPE
        torch.testing.assert_close(got.float(), want, atol=TOL, rtol=TOL)
    got = gemv(x, values, None, TILES[0], out_dtype=torch.float32, w_scale=scale)
    torch.testing.assert_close(got, want - b.float(), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("rows", [1, SLOW(3)])
def test_gemv_prologues_with_fp8_weights(rows, torch_path):
    n, k = SIZES[0]
    _, values, scale = fp8_weight(n, k, seed=10 + rows)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen).to(DEVICE, DTYPE)
    res = torch.randn(rows, k, generator=gen).to(DEVICE, DTYPE)
    norm = RMSNorm(k, 1e-5).to(DEVICE, DTYPE)
    gate_up = (torch.randn(rows, 2 * k, generator=gen) * 3).to(DEVICE, DTYPE)
    normed, summed = norm(x, res)
    want_norm = fp8_linear_ref(normed, values, scale, act_quant=False, out_dtype=torch.float32)
    want_silu = fp8_linear_ref(
        silu_and_mul(gate_up), values, scale, act_quant=False, out_dtype=torch.float32
    )
    for tile in TILES:
        y, got_sum = gemv_rms_norm(x, res, norm.weight, norm.eps, values, None, tile, w_scale=scale)
        assert torch.equal(got_sum, summed)
        torch.testing.assert_close(y.float(), want_norm, atol=TOL, rtol=TOL)
        y = gemv_silu_and_mul(gate_up, values, None, tile, w_scale=scale)
        torch.testing.assert_close(y.float(), want_silu, atol=TOL, rtol=TOL)


# dot tiles with x as float16 (`half`), on the CPU at the sizes the interpreter takes
HALF_TILES = (
    [GemvConfig(16, 64, 1, 2, 1, dot=True, half=True), GemvConfig(16, 32, 1, 2, 3, dot=True, half=True)]
    if not ON_GPU
    else [GemvConfig(32, 256, 4, 3, 1, dot=True, half=True), GemvConfig(64, 128, 4, 4, 4, dot=True, half=True)]
)  # fmt: skip


@pytest.mark.parametrize("magnitude", [1e-35, 1e-3, 1.0, 3e4, 1e30])
def test_half_tiles_give_the_oracles_sums_at_any_magnitude(magnitude):
    """x (values bfloat16 holds) goes into the MMA as float16 scaled a row at a time by a power of
    two: exact, so the sums are the oracle's up to their order, at magnitudes float16 alone would
    flush to zero (1e-35; 1e-3's smallest values fall below its normal range) or overflow
    (3e4 * 3, 1e30), and an all-zero row gives zeros."""
    n, k = SIZES[0]
    _, values, scale = fp8_weight(n, k, seed=21)
    gen = torch.Generator().manual_seed(21)
    x = (torch.randn(3, k, generator=gen) * magnitude).to(torch.bfloat16).to(DEVICE, DTYPE)
    x[1] = 0.0
    want = fp8_linear_ref(x, values, scale, act_quant=False, out_dtype=torch.float32)
    size = want.abs().amax()
    assert bool(torch.isfinite(size)) and size > 0
    for tile in HALF_TILES:
        got = gemv(x, values, None, tile, out_dtype=torch.float32, w_scale=scale)
        torch.testing.assert_close(got / size, want / size, atol=1e-5, rtol=0)
        assert torch.equal(got[1], torch.zeros_like(got[1]))


def test_half_tiles_round_float32_x_to_float16_and_run_the_prologues():
    """Float32 x of more bits than float16 holds (1 + 2**-13 + ...) comes out as the oracle over x
    rounded as the tile rounds it (scaled to [2**14, 2**15), to float16, back), not as the
    float32 oracle: the half path is the one that ran. The norm and SiLU prologues through the
    same tiles: within what rounding their output to float16 moves a sum."""
    n, k = SIZES[0]
    _, values, scale = fp8_weight(n, k, seed=22)
    gen = torch.Generator().manual_seed(22)
    x = 1 + (2.0**-13) * torch.randint(1, 8, (2, k), generator=gen).float()  # 14 bits
    x[1] *= -(2.0**-20)
    up = 2.0 ** (14 - torch.floor(torch.log2(x.abs().amax(1, keepdim=True))))
    rounded = (x * up).half().float() / up
    want = fp8_linear_ref(rounded, values, scale, act_quant=False, out_dtype=torch.float32)
    exact = fp8_linear_ref(x, values, scale, act_quant=False, out_dtype=torch.float32)
    size = want.abs().amax(1, keepdim=True).to(DEVICE)
    moved = float(((exact - want).abs().to(DEVICE) / size).max())
    assert moved > 1e-4  # (the rounding moves the sums well past the tolerance below)
    w = dequantize_fp8_rows(values, scale).float()
    gate_up = (torch.randn(1, 2 * k, generator=gen) * 3).to(DEVICE, DTYPE)
    norm = RMSNorm(k, 1e-5).to(DEVICE, DTYPE)

    def assert_near(y, act):
        """y against the oracle on the prologue's output `act`: within the output's rounding and,
        where act is float32, what rounding it to float16 moves a sum, three standard deviations
        of it."""
        act = act.detach()
        want = fp8_linear_ref(act, values, scale, act_quant=False, out_dtype=torch.float32)
        unit = 2.0**-11 if act.dtype == torch.float32 else 0.0
        spread = 3 * unit * ((act.float() ** 2) @ (w * w).t()).sqrt()
        off = (y.float() - want).abs() - (TOL + TOL * want.abs() + spread)
        assert float(off.max()) <= 0, float(off.max())

    for tile in HALF_TILES:
        got = gemv(x.to(DEVICE), values, None, tile, out_dtype=torch.float32, w_scale=scale)
        torch.testing.assert_close(got / size, want.to(DEVICE) / size, atol=1e-5, rtol=0)
        y, _ = gemv_rms_norm(
            x[:1].to(DEVICE, DTYPE), None, norm.weight, norm.eps, values, None, tile, w_scale=scale
        )
        assert_near(y, norm(x[:1].to(DEVICE, DTYPE)))
        y = gemv_silu_and_mul(gate_up, values, None, tile, w_scale=scale)
        assert_near(y, silu_and_mul(gate_up))


def test_a_half_tile_must_be_a_dot_tile():
    _, values, scale = fp8_weight(8, 32, seed=3)
    x = torch.randn(1, 32, device=DEVICE, dtype=DTYPE)
    with pytest.raises(ValueError, match="a half tile is a dot tile over float8 weights"):
        gemv(x, values, None, GemvConfig(8, 32, 1, 1, 1, half=True), w_scale=scale)
    with pytest.raises(ValueError, match="a half tile is a dot tile over float8 weights"):
        gemv(x, values.to(DTYPE), None, GemvConfig(16, 32, 1, 1, 1, dot=True, half=True))


def test_gemv_refuses_fp8_weights_without_scales_and_scales_without_fp8():
    _, values, scale = fp8_weight(8, 32, seed=3)
    torch.manual_seed(0)
    x = torch.randn(1, 32, device=DEVICE, dtype=DTYPE)
    with pytest.raises(ValueError, match="float8_e4m3fn weight with its scale per row"):
        gemv(x, values, None, TILES[0])
    with pytest.raises(ValueError, match="float8_e4m3fn weight with its scale per row"):
        gemv(x, values.to(DTYPE), None, TILES[0], w_scale=scale)
    with pytest.raises(ValueError, match=r"w_scale must be float32 of shape \(8,\)"):
        gemv(x, values, None, TILES[0], w_scale=scale[:4])


# ---- the scheme on a layer, and the dispatch ------------------------------------------------


def fp8_layer(n: int, k: int, bias: bool, seed: int) -> tuple[torch.nn.Linear, torch.Tensor]:
    """An nn.Linear quantized as `quantization="fp8"` does at load, and its float weight."""
    gen = torch.Generator().manual_seed(seed)
    layer = torch.nn.Linear(k, n, bias=bias).to(DEVICE, DTYPE)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=gen) / k**0.5)
        if bias:
            layer.bias.copy_(torch.randn(n, generator=gen))
    w = layer.weight.detach().clone()
    plan = QuantPlan(Fp8Linear(stored=False), "test")
    model = torch.nn.ModuleDict({"proj": layer})
    prepare(model, plan)
    finish(model, plan)
    return layer, w


def test_quantizing_at_load_keeps_float8_rows_and_their_scales():
    layer, w = fp8_layer(40, 96, bias=True, seed=4)
    assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.shape == (40,)
    assert not layer.weight.requires_grad
    values, scale = quantize_fp8_rows(w)
    assert torch.equal(layer.weight.view(torch.uint8), values.view(torch.uint8))
    # the layer multiplies (W8A8) close to the float weight: float8's error, not more
    torch.manual_seed(0)
    x = torch.randn(5, 96, device=DEVICE, dtype=DTYPE)
    got = PlainMatmuls()(x, layer)
    want = F.linear(x.float(), w.float(), layer.bias.float())
    assert got.dtype == DTYPE
    assert (got.float() - want).abs().max() < 0.1 * want.abs().max()
    # the plain torch path is the oracle's W8A8
    if not ON_GPU:
        torch.testing.assert_close(
            got, fp8_linear_ref(x, layer.weight, layer.weight_scale, layer.bias)
        )
    # rows looked up (an embedding in the head) are the dequantized weight's
    ids = torch.tensor([3, 0, 39], device=DEVICE)
    scheme = layer.quant_scheme
    assert torch.equal(scheme.dequantized_rows(layer, ids), scheme.dequantized_weight(layer)[ids])


def test_dispatch_runs_the_gemv_over_fp8_weights_where_chosen(count_launches):
    layer, _ = fp8_layer(40, 96, bias=True, seed=5)
    plain = torch.nn.Linear(96, 40, bias=True).to(DEVICE, DTYPE)
    dispatch = LinearDispatch()
    assert choice_key("linear", 1, layer) != choice_key("linear", 1, plain)  # the dtype tells
    dispatch.choice[choice_key("linear", 1, plain)] = TILES[0]
    torch.manual_seed(0)
    x = torch.randn(1, 96, device=DEVICE, dtype=DTYPE)
    scheme = layer.quant_scheme
    torch.testing.assert_close(dispatch(x, layer), scheme.apply(layer, x))
    assert count_launches == []  # the unquantized layer's choice is not the fp8 layer's
    dispatch.choice[choice_key("linear", 1, layer)] = TILES[0]
    got = dispatch(x, layer)
    assert count_launches == ["gemv"]
    torch.testing.assert_close(got.float(), scheme.reference(layer, x), atol=TOL, rtol=TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scaled_mm_path_matches_the_w8a8_oracle(dtype):
    for rows in (5, 64, 300):
        layer, _ = fp8_layer(4096, 4096, bias=False, seed=rows)
        x = torch.randn(rows, 4096, device=DEVICE, dtype=dtype)
        got = layer.quant_scheme.apply(layer, x)
        assert got.dtype == dtype
        want = fp8_linear_ref(x, layer.weight, layer.weight_scale, out_dtype=torch.float32)
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_tuning_an_fp8_layer_checks_each_tile_against_its_oracle():
    layer, _ = fp8_layer(6144, 4096, bias=False, seed=6)
    dispatch = LinearDispatch()
    plain_ms, chosen_ms = dispatch.tune(layer, rows=1)
    assert dispatch.timings[choice_key("linear", 1, layer)]  # tiles ran and matched the oracle
    assert chosen_ms <= plain_ms
