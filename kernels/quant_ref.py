"""Plain-torch twins of the quantized matmuls: FP8 e4m3 weights with a scale per output row, and
activations scaled per token at run time (W8A8). The CPU path of a quantized linear layer
(runtime/quantization/) and the oracle its kernels are tested against: `torch._scaled_mm` on a GPU
(the same W8A8 numerics), and the batch-1 Triton GEMV (kernels/gemv.py with `w_scale`), which
reads the FP8 weights and multiplies by x as it is (weight-only numerics: `act_quant=False`).

A stored value is round(w / scale) in float8_e4m3fn, its scale amax / 448 of its row (of its token,
for activations), so the row's largest magnitude lands on e4m3's largest finite value.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_MIN_SCALE = 1e-12  # an all-zero row keeps a finite scale (its values stay 0)


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., K) -> (float8 values (..., K), float32 scales (..., 1)), one scale per row (a
    weight's output channel, or an activation's token): x ~ values * scales."""
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize_fp8_rows(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """values (N, K) float8 and scale (N,) float32 -> float32 (N, K)."""
    return values.float() * scale.float().reshape(-1, 1)


def fp8_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    act_quant: bool = True,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x (..., K) @ dequantize(weight (N, K) float8, weight_scale (N,)).T + bias, in `out_dtype`
    (default x's). With `act_quant` x is first rounded to float8 at a scale per token (W8A8, as
    `torch._scaled_mm` computes it: float8 products summed in float32, then both scales); without,
    x's own values (the GEMV's weight-only numerics). The weight is dequantized in float32 pieces of
    the output (never a whole float32 copy of a large layer)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if act_quant:
        xq, x_scale = quantize_fp8_rows(x2)
        a = xq.float()
    else:
        a, x_scale = x2.float(), None
    pieces = []
    for i in range(0, weight.shape[0], 8192):
        w = weight[i : i + 8192].float()
        y = a @ w.t() * weight_scale[i : i + 8192].float().reshape(1, -1)
        pieces.append(y)
    y = torch.cat(pieces, dim=-1) if len(pieces) > 1 else pieces[0]
    if x_scale is not None:
        y = y * x_scale
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype).reshape(*shape[:-1], weight.shape[0])
