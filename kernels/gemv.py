"""Skinny matmuls for small decode batches: y = x @ W.T (+ b) for x of a few rows.

At batch 1-4 a linear layer is a pass over its weights; the work is reading W once at full
bandwidth. Each program here owns a few output rows and streams their weights along K, reusing each
weight tile for every row of x. Whether it beats cuBLAS depends on the shape and the GPU, so the
engine times both once per weight shape at start-up (`LinearDispatch`) and keeps the faster; the
torch `F.linear` stays the oracle and the default.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

MAX_ROWS = 4  # x rows the kernel takes; more go to cuBLAS


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rows_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    rows_m = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + cols
        w = tl.load(
            w_ptr + rows_n[:, None] * stride_wn + k[None, :],
            mask=(rows_n[:, None] < N) & (k[None, :] < K), other=0.0,
        ).to(tl.float32)  # fmt: skip
        x = tl.load(
            x_ptr + rows_m[:, None] * stride_xm + k[None, :],
            mask=(rows_m[:, None] < M) & (k[None, :] < K), other=0.0,
        ).to(tl.float32)  # fmt: skip
        # (BLOCK_M, 1, BLOCK_K) * (1, BLOCK_N, BLOCK_K) summed over K
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows_n, mask=rows_n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + rows_m[:, None] * stride_ym + rows_n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=(rows_m[:, None] < M) & (rows_n[None, :] < N),
    )


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    block_n: int = 8,
    block_k: int = 512,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """x (M, K) with M <= MAX_ROWS, weight (N, K), unit stride along K -> (M, N)."""
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS or x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(f"gemv takes up to {MAX_ROWS} rows with unit stride along K")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, m, n, k,
        x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=max(1, triton.next_power_of_2(m)),
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return y


CONFIGS = [  # (block_n, block_k, num_warps, num_stages)
    (4, 512, 4, 3), (8, 256, 4, 3), (8, 512, 4, 3), (8, 512, 8, 3), (16, 256, 4, 3),
    (16, 512, 8, 2), (4, 1024, 4, 2), (8, 1024, 8, 2),
]  # fmt: skip


class LinearDispatch:
    """Per (weight shape, rows of x): cuBLAS or the Triton kernel with its best tile, whichever
    measured faster. Empty (everything to cuBLAS) until `tune` has run for a shape."""

    def __init__(self) -> None:
        self.choice: dict[tuple[int, int, int], tuple | None] = {}

    def __call__(self, x: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= MAX_ROWS:
            config = self.choice.get((x.shape[0], *linear.weight.shape))
            if config is not None:
                return gemv(x, linear.weight, linear.bias, *config)
        return F.linear(x, linear.weight, linear.bias)

    def tune(self, linear: torch.nn.Linear, rows: int) -> tuple[float, float]:
        """Time cuBLAS and every tile on random input of `rows` rows; keep the fastest. Returns
        (cuBLAS ms, chosen ms)."""
        from triton.testing import do_bench

        w, b = linear.weight, linear.bias
        x = torch.randn(rows, w.shape[1], device=w.device, dtype=w.dtype)
        base = do_bench(lambda: F.linear(x, w, b), warmup=5, rep=20)
        best, best_ms = None, base
        want = F.linear(x, w, b).float()
        for config in CONFIGS:
            try:
                got = gemv(x, w, b, *config)
            except Exception:  # a tile this GPU cannot run (shared memory, registers)
                continue
            if not torch.allclose(got.float(), want, atol=2e-2, rtol=2e-2):
                continue
            ms = do_bench(lambda config=config: gemv(x, w, b, *config), warmup=5, rep=20)
            if ms < best_ms * 0.97:  # a clear win only
                best, best_ms = config, ms
        self.choice[(rows, *w.shape)] = best
        return base, best_ms
