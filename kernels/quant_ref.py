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


# ---- INT4 group-wise (W4A16) ------------------------------------------------------------------
# A weight (N, K) in groups of `group` columns per row: each group's values are integers q in
# [0, 15] with a float32 scale s and zero point z (an integer in [0, 15], kept as float32), so
# w ~ (q - z) * s. Stored packed along K: byte j of a row holds column 2j in its low four bits and
# column 2j + 1 in its high four, (N, K // 2) uint8; scales and zeros (N, K // group).
# The same with a byte a value: an int8 weight (N, K) of integers with float32 scales and zero
# points (N, K // group), or no zero points (None: symmetric groups, w = q * s): the layout
# GGUF's blocks are run in on a GPU where a layer has Q8_0 or Q6_K ones (kernels/gguf_ref.py
# `as_int8`). The functions below that take a grouped weight take either.

INT4_GROUP = 128


def quantize_int4_groups(
    w: torch.Tensor, group: int = INT4_GROUP
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w (N, K), K a multiple of `group` (even) -> (packed (N, K // 2) uint8, scales, zeros), each
    group's range [min, max] (widened to hold 0) spread over the 16 levels (asymmetric, min-max)."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo = g.amin(-1).clamp(max=0.0)
    hi = g.amax(-1).clamp(min=0.0)
    scale = ((hi - lo) / 15).clamp(min=_MIN_SCALE)
    zero = (-lo / scale).round().clamp(0, 15)
    q = (g / scale[..., None] + zero[..., None]).round().clamp(0, 15).to(torch.uint8)
    return pack_int4(q.reshape(n, k)), scale, zero


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(N, K) integers in [0, 15] -> (N, K // 2) uint8, column 2j low, 2j + 1 high."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """(N, K // 2) uint8 -> (N, K) uint8 integers in [0, 15]."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def group_integers(weight: torch.Tensor) -> torch.Tensor:
    """A grouped weight's integers (N, K): a packed INT4 weight's unpacked, an int8 one's own."""
    if weight.dtype == torch.uint8:
        return unpack_int4(weight)
    if weight.dtype == torch.int8:
        return weight
    raise ValueError(f"a grouped weight is packed INT4 (uint8) or int8; got {weight.dtype}")


def dequantize_groups(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None
) -> torch.Tensor:
    """The float32 weight (N, K) of a grouped one (packed INT4 or int8): (q - zero) * scale, group
    by group (q * scale without zero points)."""
    q = group_integers(packed).float()
    n, k = q.shape
    group = k // scale.shape[1]
    g = q.reshape(n, -1, group)
    if zero is not None:
        g = g - zero.float()[..., None]
    return (g * scale.float()[..., None]).reshape(n, k)


def grouped_linear_ref(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x (..., K) @ dequantize(packed, scale, zero).T + bias in float32, then `out_dtype` (default
    x's): W4A16 (or W8A16 for an int8 weight), x as it is. The weight is dequantized in pieces of
    the output."""
    shape = x.shape
    a = x.reshape(-1, shape[-1]).float()
    pieces = [
        a @ dequantize_groups(packed[i : i + 8192], scale[i : i + 8192], _rows(zero, i)).t()
        for i in range(0, packed.shape[0], 8192)
    ]
    y = torch.cat(pieces, dim=-1) if len(pieces) > 1 else pieces[0]
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype).reshape(*shape[:-1], packed.shape[0])


def _rows(t: torch.Tensor | None, i: int) -> torch.Tensor | None:
    """Rows i .. i + 8192 of t (None: None)."""
    return None if t is None else t[i : i + 8192]
