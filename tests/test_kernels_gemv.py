"""The batch-1..4 GEMV kernel (kernels/gemv.py) against F.linear, and the per-shape dispatch.
Under TRITON_INTERPRET=1 on the CPU at small sizes; on a GPU at real sizes with tuning."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

import torch.nn.functional as F  # noqa: E402

from radixlm.kernels import fused  # noqa: E402
from radixlm.kernels.gemv import CONFIGS, GemvConfig, gemv  # noqa: E402
from radixlm.runtime.matmul_dispatch import LinearDispatch, choice_key, graph_ms  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
TOL = 2e-2 if DEVICE.type == "cuda" else 1e-4
# make test-fast takes the rows counts that are not SLOW (on the CPU the interpreter takes seconds
# a case); make test takes them all
SLOW = (
    (lambda v: pytest.param(v, marks=pytest.mark.slow)) if DEVICE.type == "cpu" else (lambda v: v)
)
SIZES = (
    [(37, 100), (64, 576)] if DEVICE.type == "cpu" else [(6144, 4096), (4096, 14336), (49152, 576)]
)


@pytest.mark.parametrize("rows", [1, SLOW(2), 3, SLOW(4)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("size", SIZES)
def test_gemv_matches_linear(rows, bias, size):
    n, k = size
    gen = torch.Generator().manual_seed(rows * 7 + n)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE, DTYPE)
    b = torch.randn(n, generator=gen).to(DEVICE, DTYPE) if bias else None
    x = torch.randn(rows, k + 3, generator=gen).to(DEVICE, DTYPE)[:, :k]  # strided rows
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    # on the CPU, small tiles (the interpreter's time grows with the tile), one of them split-K;
    # on a GPU the first candidate of each kind (tuning also checks every candidate it times)
    configs = (
        [
            GemvConfig(8, 64, 4, 1, 1),
            GemvConfig(4, 128, 4, 1, 2),
            GemvConfig(4, 32, 4, 1, 1, late_sum=True, prefetch=True),
            GemvConfig(8, 32, 4, 1, 3, late_sum=True),
            GemvConfig(4, 64, 4, 1, 2, prefetch=True),
            GemvConfig(16, 32, 4, 2, 1, dot=True),
            GemvConfig(16, 64, 4, 2, 3, dot=True),
        ]
        if DEVICE.type == "cpu"
        else list(
            {(c.late_sum, c.prefetch, c.dot, c.split_k > 1): c for c in CONFIGS[::-1]}.values()
        )
    )
    for config in configs:
        torch.testing.assert_close(gemv(x, w, b, config).float(), want, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("rows", [SLOW(5), 8, SLOW(12), 16])
@pytest.mark.parametrize("size", SIZES[:2])
def test_gemv_dot_tiles_take_a_verify_steps_rows(rows, size):
    """Above 4 rows (a speculative verify step's) only the tl.dot tiles run, up to 16 rows; a
    tile without tl.dot is refused there."""
    n, k = size
    gen = torch.Generator().manual_seed(rows * 11 + n)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE, DTYPE)
    b = torch.randn(n, generator=gen).to(DEVICE, DTYPE)
    x = torch.randn(rows, k, generator=gen).to(DEVICE, DTYPE)
    want = F.linear(x.float(), w.float(), b.float())
    configs = (
        [GemvConfig(16, 32, 4, 2, 1, dot=True), GemvConfig(16, 64, 4, 2, 3, dot=True)]
        if DEVICE.type == "cpu"
        else [c for c in CONFIGS if c.dot]
    )
    for config in configs:
        torch.testing.assert_close(gemv(x, w, b, config).float(), want, atol=TOL, rtol=TOL)
    with pytest.raises(ValueError, match="dot tile"):
        gemv(x, w, b, GemvConfig(8, 64, 4, 1, 1))


def test_dispatch_routes_by_rows_and_choice(count_launches):
    linear = torch.nn.Linear(96, 40, bias=True).to(DEVICE, DTYPE)
    dispatch = LinearDispatch()
    x1 = torch.randn(1, 96, device=DEVICE, dtype=DTYPE)
    x8 = torch.randn(8, 96, device=DEVICE, dtype=DTYPE)
    x17 = torch.randn(17, 96, device=DEVICE, dtype=DTYPE)
    dispatch(x1, linear)
    assert count_launches == []  # nothing tuned: cuBLAS
    # a choice for the same shape without a bias is not this layer's
    dispatch.choice[("linear", 1, 40, 96, False)] = CONFIGS[0]
    dispatch(x1, linear)
    assert count_launches == []
    dispatch.choice[choice_key("linear", 1, linear)] = CONFIGS[0]
    out1 = dispatch(x1, linear)
    assert count_launches == ["gemv"]
    dispatch.choice[choice_key("linear", 8, linear)] = CONFIGS[0]
    out8 = dispatch(x8, linear)  # more rows than a tile without tl.dot takes: cuBLAS
    assert count_launches == ["gemv"]
    dot = next(c for c in CONFIGS if c.dot)
    dispatch.choice[choice_key("linear", 17, linear)] = dot
    out17 = dispatch(x17, linear)  # more rows than the kernel takes: cuBLAS
    assert count_launches == ["gemv"]
    torch.testing.assert_close(out1, F.linear(x1, linear.weight, linear.bias), atol=TOL, rtol=TOL)
    torch.testing.assert_close(out8, F.linear(x8, linear.weight, linear.bias))
    torch.testing.assert_close(out17, F.linear(x17, linear.weight, linear.bias))


@pytest.mark.gpu
def test_tuning_finds_working_tiles_and_routes_to_a_path_no_slower_than_cublas():
    linear = torch.nn.Linear(4096, 4096, bias=False).to("cuda", torch.bfloat16)
    dispatch = LinearDispatch()
    base, _ = dispatch.tune(linear, rows=1)
    # at least one tile compiled and matched F.linear on this GPU
    assert dispatch.timings[choice_key("linear", 1, linear)]
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(dispatch(x, linear), F.linear(x, linear.weight), atol=TOL, rtol=TOL)
    # the routed path, timed again, is as fast as cuBLAS or faster (within timing noise)
    assert graph_ms(lambda lin: dispatch(x, lin), linear) < base * 1.1
    # an LM head (float32 output) tunes and routes as it runs
    head = LinearDispatch()
    head.tune(linear, rows=1, float32=True)
    logits = head.float32(x, linear)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(
        logits, F.linear(x.float(), linear.weight.float()), atol=1e-2, rtol=1e-2
    )


@pytest.mark.gpu
def test_dependent_gemvs_replayed_from_a_cuda_graph_wait_for_each_other(monkeypatch):
    """A chain of GEMVs, each reading the one before's output, in a CUDA graph: on a GPU that
    launches them as programmatic dependent launches, each starts before the one before it ends,
    and a read before its wait would see the last replay's values. Fresh input each replay."""
    if not fused.pdl_launch(torch.empty(0, device="cuda")):
        pytest.skip("this GPU does not launch dependent kernels early (before Hopper)")
    gen = torch.Generator().manual_seed(3)
    weights = [(torch.randn(n, k, generator=gen) / k**0.5) for n, k in CHAIN]
    weights = [w.to("cuda", torch.bfloat16) for w in weights]
    tiles = [
        GemvConfig(4, 512, 4, 1, 1, late_sum=True, prefetch=True),
        GemvConfig(32, 256, 4, 3, 4, dot=True),  # split-K: the summing kernel in the chain too
        GemvConfig(8, 1024, 4, 2, 1),
    ]
    x = torch.empty(1, CHAIN[0][1], device="cuda", dtype=torch.bfloat16)

    def chain():
        h = x
        for i, w in enumerate(weights):
            h = gemv(h, w, None, tiles[i % len(tiles)])
        return h

    chain()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    monkeypatch.setenv("RADIXLM_DISABLE_PDL", "1")
    for _ in range(5):
        x.copy_(torch.randn(x.shape, generator=gen).to("cuda", torch.bfloat16))
        graph.replay()
        assert torch.equal(out, chain())  # the same kernels launched one after another


# (N, K) of each GEMV in the chain: the output of one is the input of the next
CHAIN = [(4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096), (4096, 6144)] * 2
