"""Plain-torch twins of the fused kernels (kernels/fused.py, and the prologues kernels/gemv.py
fuses into its matmuls): the CPU path of the model's layers (runtime/layers.py calls these) and
the kernels' oracle. Each computes in float32 and rounds to the activation dtype where Hugging
Face's Llama does, which is where the kernels round too."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight * rms_norm(x + residual), x + residual): the sum rounded to x's dtype, normalized
    in float32, rounded again before the weight; without a residual, (weight * rms_norm(x),
    None)."""
    if residual is not None:
        x = x + residual
        residual = x
    h = F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
    return weight * h, residual


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dimension."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (T, H, head_dim), half-split layout: with halves x1, x2, (x1 cos - x2 sin,
    x2 cos + x1 sin), in float32, rounded to x's dtype. `cos` is (cos, cos) and `sin` (-sin, sin)
    per token, (T, 1, head_dim) each (runtime.layers.RotaryEmbedding.lookup)."""
    h = x.float()
    out = h * cos + torch.roll(h, x.shape[-1] // 2, dims=-1) * sin
    return out.to(x.dtype)
