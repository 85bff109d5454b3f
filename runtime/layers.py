"""The building blocks of a Llama-family decoder, in plain torch.

On CUDA, RMSNorm (with its residual add), the rotary embedding and SiLU-and-multiply each run as one
fused Triton kernel (kernels/fused.py) with the same rounding; elsewhere their plain-torch twins in
kernels/fused_ref.py, beside the kernels, which are also the kernels' oracle. `PlainMatmuls` is every matmul of a layer with the op before it (a norm, SiLU):
on CUDA a tuned `runtime.matmul_dispatch.LinearDispatch` may run the two as one kernel.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.kernels.fused_ref import rms_norm_ref, rope_ref, silu_and_mul_ref
from radixlm.runtime.quantization.base import scheme_of

logger = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Normalize x; with a residual, first add it and also return the sum (the new residual)."""
        if _fused(x) and x.dim() == 2 and x.stride(-1) == 1:
            out, residual = _fused_kernels().rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, residual)
        out, residual = rms_norm_ref(x, self.weight, self.eps, residual)
        return out if residual is None else (out, residual)


def _fused(x: torch.Tensor) -> bool:
    return x.is_cuda and _fused_kernels().enabled(x)


def _fused_kernels():
    from radixlm.kernels import fused  # imports triton: only where CUDA is used

    return fused


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if _fused(gate_up) and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
        return _fused_kernels().silu_and_mul(gate_up)
    return silu_and_mul_ref(gate_up)


class PlainMatmuls:
    """The matmuls of a decoder in plain torch, each with the op that feeds it; the CPU path and
    the oracle of the kernels that fuse the op into the matmul (kernels/gemv.py). A linear layer
    multiplies as its quantization scheme says (runtime/quantization/: unquantized, F.linear)."""

    def __call__(self, x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
        return scheme_of(linear).apply(linear, x)

    def norm_linear(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm: RMSNorm,
        linear: nn.Linear,
        rows: torch.Tensor | None = None,
        float32: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(linear(norm(x + residual)), x + residual); without a residual, (linear(norm(x)), x).
        With `rows` (indices; the last norm, before the LM head) only those rows go through the
        linear layer, and no residual comes back (None). With `float32` the linear's output is
        float32, not rounded to x's dtype (`float32_linear`)."""
        if rows is not None:  # normalize only the rows that are used (a norm is per row)
            x = x[rows]
            residual = None if residual is None else residual[rows]
        scheme = scheme_of(linear)
        if scheme.quantized and rows is None and not float32 and not self.has_kernel(x, linear):
            # (FP8: the norm's kernel rounds to float8; a GEMV tuned for the layer goes first)
            done = scheme.norm_apply(linear, x, residual, norm)
            if done is not None:
                return done
        if residual is None:
            h, residual = norm(x), x
        else:
            h, residual = norm(x, residual)
        y = self.float32(h, linear) if float32 else self(h, linear)
        return y, None if rows is not None else residual

    def has_kernel(self, x: torch.Tensor, linear: nn.Linear) -> bool:
        """Whether `self(x, linear)` runs a kernel chosen for the layer (LinearDispatch's tuned
        GEMV) rather than the scheme's plain path."""
        return False

    def float32(self, x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
        """linear(x) with a float32 output (the LM head's logits): `float32_linear`."""
        return float32_linear(x, linear)

    def silu_linear(self, gate_up: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
        """linear(silu(gate) * up) for gate_up = [gate | up] along the last dimension."""
        return self(silu_and_mul(gate_up), linear)


def float32_linear(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """linear(x) as float32, from the products of x's and the weight's values summed in float32,
    without rounding the result to their half type: the LM head's logits. (Rounded to bf16, logits
    of 16-32 move in steps of 0.125, and greedy decoding flips between near-tied tokens.) On CUDA
    one matmul with a float32 output (a torch without one rounds, with a warning at start);
    elsewhere through float32 copies. (A quantized layer: its scheme's matmul, output float32.)"""
    scheme = scheme_of(linear)
    if scheme.quantized:
        return scheme.apply(linear, x, out_dtype=torch.float32)
    w, b = linear.weight, linear.bias
    if x.dtype == torch.float32 and w.dtype == torch.float32:
        return F.linear(x, w, b)
    if x.is_cuda:
        if not _mm_float32_output(x.device):  # (a weight copy a step would cost more): rounded
            return F.linear(x, w, b).float()
        y = torch.mm(x.reshape(-1, x.shape[-1]), w.t(), out_dtype=torch.float32)
        y = y.view(*x.shape[:-1], w.shape[0])
        return y if b is None else y + b.float()
    # float32 copies of the weight in pieces of the output (a whole LM head's copy is GBs)
    xf = x.float()
    pieces = [
        F.linear(xf, w[i : i + 8192].float(), None if b is None else b[i : i + 8192].float())
        for i in range(0, w.shape[0], 8192)
    ]
    return torch.cat(pieces, dim=-1)


@functools.cache
def _mm_float32_output(device: torch.device) -> bool:
    """Whether this torch's CUDA matmul writes half-precision products as float32 (out_dtype).
    (First asked by a model's first forward: an engine's warm-up, before any graph capture.)"""
    try:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError):
        logger.warning("this torch has no float32-output matmul: logits rounded to bf16/fp16")
        return False


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
        inv_freq, attention_factor = _scale_inv_freq(inv_freq, self.scaling, self.theta)
        t = torch.arange(self.max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)  # (max_positions, head_dim // 2)
        self.cos = (freqs.cos() * attention_factor).float().to(device)
        self.sin = (freqs.sin() * attention_factor).float().to(device)

    def lookup(self, positions: torch.Tensor) -> RopeInputs:
        """What `apply` needs for these positions, worked out once a step for all layers: the
        positions themselves for the fused kernel, else (cos, cos) and (-sin, sin) per token,
        (T, 1, head_dim) each."""
        if _fused(positions):
            return RopeInputs(self.cos, self.sin, positions)
        cos, sin = self.cos[positions], self.sin[positions]
        return RopeInputs(
            torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((-sin, sin), -1).unsqueeze(1), None
        )

    @staticmethod
    def apply(rope: RopeInputs, x: torch.Tensor) -> torch.Tensor:
        """Rotate x (T, H, head_dim): with halves x1, x2 it gives (x1 cos - x2 sin, x2 cos + x1 sin),
        computed as x * (cos, cos) + (x2, x1) * (-sin, sin); the fused kernel rotates x in place."""
        if rope.positions is not None:
            return _fused_kernels().rope_(x, rope.positions, rope.cos, rope.sin)
        return rope_ref(x, rope.cos, rope.sin)


class RopeInputs(NamedTuple):
    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor | None  # set for the fused kernel: cos/sin are then the tables


def _scale_inv_freq(
    inv_freq: torch.Tensor, scaling: dict[str, Any] | None, theta: float = 10000.0
) -> tuple[torch.Tensor, float]:
    """The rotary frequencies as `scaling` (a config's rope_scaling) changes them, and the factor
    on cos and sin (YaRN's attention scaling; 1 for the others)."""
    if not scaling:
        return inv_freq, 1.0
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "yarn":
        return _yarn(inv_freq, scaling, theta)
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
        f"rope scaling {kind!r} is not supported yet; supported: default, linear, llama3, yarn"
    )


def _yarn(
    inv_freq: torch.Tensor, scaling: dict[str, Any], theta: float
) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al., 2023): the frequencies that turn fewer than `beta_slow` times over the
    original context are interpolated (divided by `factor`), those that turn more than
    `beta_fast` times are kept, a linear ramp over the dimensions between; cos and sin are scaled
    by `attention_factor` (given, or 0.1 ln(factor) + 1, or DeepSeek's ratio of two such with
    `mscale` and `mscale_all_dim`)."""
    factor = float(scaling["factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    dim = 2 * inv_freq.shape[0]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def turns_dim(turns: float) -> float:  # the dimension whose frequency turns so often
        return dim * math.log(old_context / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low = turns_dim(float(scaling.get("beta_fast") or 32))
    high = turns_dim(float(scaling.get("beta_slow") or 1))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (no zero-width ramp)
    ramp = ((torch.arange(dim // 2, dtype=inv_freq.dtype) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # (1: the frequency as it is; 0: interpolated)
    return inv_freq / factor * (1 - kept) + inv_freq * kept, float(attention)
