"""The building blocks of a Llama-family decoder, in plain torch."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Normalize x; with a residual, first add it and also return the sum (the new residual)."""
        if residual is not None:
            x = x + residual
            residual = x
        # in float32, then back to x's dtype before the weight, as Hugging Face Llama does
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        out = self.weight * h
        return out if residual is None else (out, residual)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (the half-split layout of Hugging Face Llama) with a cos/sin table."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
    ) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = (
            head_dim,
            max_positions,
            theta,
            scaling,
        )
        self.cos = self.sin = torch.empty(0)  # built by build_tables once the device is known

    def build_tables(self, device: torch.device) -> None:
        """(Re)compute the float32 cos/sin tables on `device` (after a model built on `meta`)."""
        d = self.head_dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        inv_freq, attention_factor = _scale_inv_freq(inv_freq, self.scaling)
        t = torch.arange(self.max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)  # (max_positions, head_dim // 2)
        self.cos = (freqs.cos() * attention_factor).float().to(device)
        self.sin = (freqs.sin() * attention_factor).float().to(device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, cos) and (-sin, sin) of the positions, (T, 1, head_dim) each: looked up once a
        step and shared by all layers."""
        cos, sin = self.cos[positions], self.sin[positions]
        return torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((-sin, sin), -1).unsqueeze(1)

    @staticmethod
    def apply(cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """Rotate x (T, H, head_dim): with halves x1, x2 it gives (x1 cos - x2 sin, x2 cos + x1 sin),
        computed as x * (cos, cos) + (x2, x1) * (-sin, sin)."""
        cos, sin = cos_sin
        h = x.float()
        out = h * cos + torch.roll(h, x.shape[-1] // 2, dims=-1) * sin
        return out.to(x.dtype)


def _scale_inv_freq(
    inv_freq: torch.Tensor, scaling: dict[str, Any] | None
) -> tuple[torch.Tensor, float]:
    if not scaling:
        return inv_freq, 1.0
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
        high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
        old_context = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context / low_freq_factor
        high_freq_wavelen = old_context / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    raise ValueError(
        f"rope scaling {kind!r} is not supported yet; supported: default, linear, llama3"
    )
