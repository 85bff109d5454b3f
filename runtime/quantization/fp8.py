"""FP8 W8A8: float8 e4m3 weights with a float32 scale per output row, activations rounded to
float8 at a scale per token as each matmul runs.

- The plain path (`apply`): on a CUDA GPU that has it, `torch._scaled_mm` with row-wise scales
  (float8 products summed in float32; Hopper's FP8 tensor cores), the activations rounded by one
  Triton kernel (kernels/fused.py `fp8_quantize_rows`); elsewhere its plain-torch twin
  (kernels/quant_ref.py `fp8_linear_ref`), which computes the same W8A8 numerics.
- At batch 1-4, where a step's time is reading the weights, the Triton GEMV (kernels/gemv.py with
  `w_scale`) reads the float8 weights once and dequantizes them in registers; it multiplies by x
  as it is (rounding x to float8 would save nothing there and only lose precision).

A layer quantized at load (`Fp8Linear(stored=False)`, `quantization="fp8"`) loads its
checkpoint's weights in the model's dtype and rounds them afterwards, a scale per row from the
row's largest magnitude; one loaded as stored (`stored=True`, a compressed-tensors checkpoint)
takes the float8 weights and their scales from the checkpoint, a scale per tensor (of each part
of a fused projection) widened to one per row.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from radixlm.kernels.quant_ref import (
    FP8_DTYPE,
    dequantize_fp8_rows,
    fp8_linear_ref,
    quantize_fp8_rows,
)
from radixlm.runtime.quantization.base import LinearScheme, replace_parameter

logger = logging.getLogger(__name__)


class Fp8Linear(LinearScheme):
    name = "fp8"
    quantized = True

    def __init__(self, stored: bool) -> None:
        self.stored = stored  # the checkpoint holds float8 weights and scales

    def create_weights(self, layer: nn.Linear) -> None:
        layer.compute_dtype = layer.weight.dtype  # (the model's: its inputs' and outputs')
        if not self.stored:  # quantized after loading, from the model-dtype weights
            return
        n, k = layer.weight.shape
        device = layer.weight.device
        replace_parameter(layer, "weight", torch.empty(n, k, dtype=FP8_DTYPE, device=device))
        replace_parameter(layer, "weight_scale", torch.empty(n, dtype=torch.float32, device=device))

    def checkpoint_tensor(self, layer, leaf, tensor, index):
        if not self.stored or leaf == "bias":
            return tensor
        if leaf == "weight":
            if tensor.dtype != FP8_DTYPE:
                raise ValueError(
                    f"the checkpoint's quantization_config says float8 weights, but a weight is "
                    f"{str(tensor.dtype).removeprefix('torch.')}: the checkpoint is not as its "
                    "config.json describes it"
                )
            return tensor
        if leaf == "weight_scale":
            scale = tensor.float().reshape(-1)
            if scale.numel() == 1:  # one per tensor: the same for each of its rows
                scale = scale.expand(layer.part_size(index or 0)).contiguous()
            return scale
        return tensor

    def process_after_loading(self, layer: nn.Linear) -> None:
        if self.stored:
            return
        values, scale = quantize_fp8_rows(layer.weight.data)
        replace_parameter(layer, "weight", values)
        replace_parameter(layer, "weight_scale", scale.reshape(-1))

    def apply(self, layer, x, out_dtype=None):
        w, scale, b = layer.weight, layer.weight_scale, layer.bias
        out = out_dtype or x.dtype
        if x.is_cuda and out in _HALF and _scaled_mm_fits(x, w):
            x2 = x.reshape(-1, x.shape[-1])
            xq, x_scale = _activation_rows(x2)  # (T, K) float8, (T, 1) float32
            return _scaled(layer, xq, x_scale, out).view(*x.shape[:-1], w.shape[0])
        return fp8_linear_ref(x, w, scale, b, act_quant=True, out_dtype=out)

    def norm_apply(self, layer, x, residual, norm):
        """`apply` after `norm` (an RMSNorm) of x + residual, the norm's output rounded to float8
        by the norm's kernel (kernels/fused.py `rms_norm_fp8`, bit for bit what `apply` would
        round it to): (y, x + residual, or x without a residual). None where that kernel does
        not run (then the norm runs, then `apply`)."""
        if not (_fused_rows(x, layer) and norm.weight.dtype == x.dtype):
            return None
        from radixlm.kernels.fused import rms_norm_fp8

        xq, x_scale, summed = rms_norm_fp8(x, norm.weight, norm.eps, residual)
        return _scaled(layer, xq, x_scale, x.dtype), x if summed is None else summed

    def reference(self, layer, x):
        return fp8_linear_ref(
            x, layer.weight, layer.weight_scale, layer.bias, act_quant=False,
            out_dtype=torch.float32,
        )  # fmt: skip

    def gemv_operands(self, layer):
        return layer.weight, {"w_scale": layer.weight_scale}

    def dequantized_weight(self, layer: nn.Linear) -> torch.Tensor:
        """The float32 weight the layer stands for (tests and quality checks)."""
        return dequantize_fp8_rows(layer.weight, layer.weight_scale)

    def dequantized_rows(self, layer: nn.Linear, ids: torch.Tensor) -> torch.Tensor:
        return dequantize_fp8_rows(layer.weight[ids], layer.weight_scale[ids])


_HALF = (torch.bfloat16, torch.float16)


def _scaled(layer, xq: torch.Tensor, x_scale: torch.Tensor, out: torch.dtype) -> torch.Tensor:
    """xq (T, K) float8 at scales x_scale (T, 1) times the layer's float8 weight, through
    `torch._scaled_mm` (row-wise scales write bfloat16: a float16 model's output is rounded once
    more), plus its bias: (T, N) in `out`."""
    w, b = layer.weight, layer.bias
    y = torch._scaled_mm(
        xq, w.t(), scale_a=x_scale, scale_b=layer.weight_scale.view(1, -1), out_dtype=torch.bfloat16
    ).to(out)
    return y if b is None else y + b


def _fused_rows(x: torch.Tensor, layer) -> bool:
    """Whether x (T, K), of a half dtype on a GPU that runs row-wise scaled float8 matmuls,
    goes into an FP8 layer through a kernel that rounds it to float8 as it makes it."""
    from radixlm.kernels import fused

    return (
        x.is_cuda
        and x.dim() == 2
        and x.stride(-1) == 1
        and x.dtype in _HALF
        and fused.enabled(x)
        and _scaled_mm_fits(x, layer.weight)
    )


def _activation_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x's tokens rounded to float8 at a scale each: the one-kernel Triton twin of
    `quantize_fp8_rows` (bit for bit), unless the fused kernels are switched off."""
    from radixlm.kernels import fused

    if fused.switched_off() or x.stride(-1) != 1:
        return quantize_fp8_rows(x)
    return fused.fp8_quantize_rows(x)


def _scaled_mm_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    # cuBLASLt's float8 matmul takes K and N in multiples of 16
    return w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0 and _rowwise_scaled_mm(x.device)


@functools.cache
def _rowwise_scaled_mm(device: torch.device) -> bool:
    """Whether this torch and GPU run `torch._scaled_mm` with a scale per row of x and per column
    of W (Hopper and newer); else the plain-torch twin runs, much slower, with a warning. (First
    asked by a model's first forward: an engine's warm-up, before any graph capture.)"""
    try:
        a = torch.zeros(16, 32, device=device).to(FP8_DTYPE)
        ones_a = torch.ones(16, 1, device=device)
        ones_b = torch.ones(1, 16, device=device)
        torch._scaled_mm(a, a.t(), scale_a=ones_a, scale_b=ones_b, out_dtype=torch.bfloat16)
        return True
    except (RuntimeError, TypeError, AttributeError) as e:
        logger.warning(
            "this GPU or torch has no row-wise scaled float8 matmul (%s): FP8 layers run the "
            "dequantizing torch path, much slower; FP8 W8A8 needs a GPU of compute capability 9.0",
            e,
        )
        return False
