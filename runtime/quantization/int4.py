"""INT4 W4A16: weights in groups of 128 columns (fewer where a layer's K is not a multiple of 128),
each group's values integers 0..15 with a float32 scale and zero point, two to a byte; activations
as they are.

Quantized at load (`quantization="w4a16"`) from the checkpoint's weights, min-max per group
(asymmetric, as AWQ's default); or read as stored from a compressed-tensors W4A16 checkpoint
(`pack-quantized`: eight signed 4-bit values to an int32, column 8j + i in bits 4i..4i+3 of word
j, each offset by 8: read as bytes, exactly this module's layout; zero points packed the same way
along the rows, or none, that is 8), an AWQ or a GPTQ one (unpacked and packed again, transposed:
`_awq_gptq_tensor`). At batch 1-4 the Triton GEMV (kernels/gemv.py with `w_scale` and `w_zero`)
reads the packed bytes, an eighth of float32's, and dequantizes in registers; larger
batches dequantize the layer and multiply (kernels/quant_ref.py `grouped_linear_ref`, also the
oracle) on the CPU; on a GPU the Triton matmul kernels/quant_gemm.py dequantizes tiles as it
reads them (an untuned tile for now).
"""

from __future__ import annotations

import torch
from torch import nn

from radixlm.kernels.quant_ref import (
    INT4_GROUP,
    dequantize_groups,
    grouped_linear_ref,
    pack_int4,
    quantize_int4_groups,
)
from radixlm.runtime.quantization.base import LinearScheme, replace_parameter
from radixlm.runtime.quantization.checkpoint import StoredQuantization


def int4_group(k: int) -> int:
    """The group of a layer of K input columns: 128, or the largest power of two that divides K
    (down to 16); ValueError for a K that none divides."""
    group = INT4_GROUP
    while group >= 16:
        if k % group == 0:
            return group
        group //= 2
    raise ValueError(
        f"quantization='w4a16' needs each linear layer's input size to be a multiple of 16; "
        f"one has {k}: use quantization='fp8' for this model"
    )


# AutoAWQ packs columns 8j + AWQ_ORDER[i] into bits 4i of word j: reading bits 4i gives column
# 8j + AWQ_ORDER[i]; AWQ_REVERSE_ORDER puts them back in column order
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def _nibbles(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their eight 4-bit values (bits 4i for i = 0..7), unpacked along `dim` (the
    values of a word adjacent, in bit order)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    if dim == 0:  # (R, C) -> (8 R, C)
        values = (words[:, None, :] >> shifts[None, :, None]) & 0xF
        return values.reshape(-1, words.shape[1])
    values = (words[:, :, None] >> shifts[None, None, :]) & 0xF  # (R, C, 8)
    return values.reshape(words.shape[0], -1)


def _awq_gptq_tensor(layout: str, leaf: str, tensor: torch.Tensor) -> torch.Tensor:
    """An AWQ or GPTQ tensor (the input dimension first) in this module's layout: the weight
    (N, K // 2) packed along K, scales and zero points (N, groups) float32."""
    if leaf == "weight_scale":
        return tensor.float().t().contiguous()
    if leaf == "weight_zero":  # (groups, N // 8), packed along N
        zeros = _nibbles(tensor, dim=1)
        if layout == "awq":
            zeros = zeros.view(zeros.shape[0], -1, 8)[:, :, AWQ_REVERSE_ORDER].reshape(zeros.shape)
        if layout == "gptq":  # the original GPTQ format stores each zero point minus one
            zeros = zeros + 1  # (a stored 15 is 16, as GPTQ's own kernels read it)
        return zeros.float().t().contiguous()
    if leaf == "weight":
        if layout == "awq":  # (K, N // 8), packed along N in AWQ's order
            q = _nibbles(tensor, dim=1)
            q = q.view(q.shape[0], -1, 8)[:, :, AWQ_REVERSE_ORDER].reshape(q.shape)
        else:  # GPTQ: (K // 8, N), packed along K
            q = _nibbles(tensor, dim=0)
        return pack_int4(q.t())
    return tensor


class Int4Linear(LinearScheme):
    name = "w4a16"
    quantized = True

    def __init__(self, stored: StoredQuantization | None = None) -> None:
        self.stored = stored  # the checkpoint's W4A16 (None: quantized at load)

    def create_weights(self, layer: nn.Linear) -> None:
        layer.compute_dtype = layer.weight.dtype  # (the model's: its inputs' and outputs')
        if self.stored is None:
            return
        n, k = layer.weight.shape
        group = k if self.stored.group == -1 else self.stored.group
        part = getattr(layer, "part", None)  # (a row-parallel layer's run of the input features)
        split = part is not None and part.length != part.size and self.stored.group != -1
        if split and (part.start % group or k % group):
            raise ValueError(
                f"tp_size={layer.comm.size}: a rank's input features of a layer, [{part.start}, "
                f"{part.end}) of {part.size}, are not whole groups of {group} of the "
                f"checkpoint's {self.stored.description}: use a tp_size whose split falls on "
                "whole groups"
            )
        if k % group:
            raise ValueError(f"a layer's {k} input columns are not whole groups of {group}")
        device = layer.weight.device
        replace_parameter(layer, "weight", torch.empty(n, k // 2, dtype=torch.uint8, device=device))
        replace_parameter(layer, "weight_scale", torch.empty(n, k // group, device=device))
        if self.stored.zero_points:
            replace_parameter(layer, "weight_zero", torch.empty(n, k // group, device=device))

    def checkpoint_tensor(self, layer, leaf, tensor, index):
        if self.stored is None or leaf == "bias":
            return tensor
        if leaf == "weight" and tensor.dtype != torch.int32:
            raise ValueError(
                "the checkpoint's quantization_config says packed 4-bit weights, but a weight "
                f"is {str(tensor.dtype).removeprefix('torch.')}: the checkpoint is not as its "
                "config.json describes it"
            )
        if self.stored.layout != "compressed-tensors":
            return _awq_gptq_tensor(self.stored.layout, leaf, tensor)
        if leaf == "weight":
            return tensor.contiguous().view(torch.uint8)  # (N, K // 8) int32 -> (N, K // 2)
        if leaf == "weight_scale":
            return tensor.float()
        if leaf == "weight_zero":  # (ceil(N / 8), groups) int32, rows packed as columns are
            rows = layer.part_size(index or 0) if hasattr(layer, "part_size") else None
            nibbles = torch.stack([(tensor >> (4 * i)) & 0xF for i in range(8)], dim=1)
            return nibbles.reshape(-1, tensor.shape[1])[:rows].float()
        return tensor

    def row_shard(self, layer: nn.Linear, tensor: torch.Tensor) -> torch.Tensor:
        """A row-parallel rank's columns of the packed weight (two input features a byte) and
        of the scales and zero points (a group's features a column; one column, a whole row's
        group, is every rank's)."""
        part = layer.part
        if part.length == part.size or tensor.shape[1] == 1:
            return tensor
        per = part.size // tensor.shape[1]  # (input features a column)
        return tensor[:, part.start // per : part.end // per]

    def process_after_loading(self, layer: nn.Linear) -> None:
        if self.stored is not None:
            if not self.stored.zero_points:  # symmetric: the offset of the stored values
                replace_parameter(layer, "weight_zero", torch.full_like(layer.weight_scale, 8.0))
            return
        w = layer.weight.data
        packed, scale, zero = quantize_int4_groups(w, int4_group(w.shape[1]))
        replace_parameter(layer, "weight", packed)
        replace_parameter(layer, "weight_scale", scale)
        replace_parameter(layer, "weight_zero", zero)

    def apply(self, layer, x, out_dtype=None):
        if x.is_cuda:  # the Triton matmul that dequantizes as it reads (kernels/quant_gemm.py)
            from radixlm.kernels.quant_gemm import grouped_gemm

            x2 = x.reshape(-1, x.shape[-1])
            x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
            w, s, z = layer.weight, layer.weight_scale, layer.weight_zero
            y = grouped_gemm(x2, w, s, z, layer.bias, out_dtype=out_dtype)
            return y.view(*x.shape[:-1], w.shape[0])
        return grouped_linear_ref(
            x, layer.weight, layer.weight_scale, layer.weight_zero, layer.bias, out_dtype
        )

    def reference(self, layer, x):
        return grouped_linear_ref(
            x, layer.weight, layer.weight_scale, layer.weight_zero, layer.bias, torch.float32
        )

    def gemv_operands(self, layer):
        return layer.weight, {"w_scale": layer.weight_scale, "w_zero": layer.weight_zero}

    def dequantized_weight(self, layer: nn.Linear):
        """The float32 weight the layer stands for (tests and quality checks)."""
        return dequantize_groups(layer.weight, layer.weight_scale, layer.weight_zero)

    def dequantized_rows(self, layer: nn.Linear, ids: torch.Tensor) -> torch.Tensor:
        zero = layer.weight_zero
        return dequantize_groups(
            layer.weight[ids], layer.weight_scale[ids], None if zero is None else zero[ids]
        )


class Int8GroupsLinear(Int4Linear):
    """Weights held as int8 integers with a float32 scale per group of columns, and a zero point
    where the groups are not symmetric (`weight_zero`, else None) (kernels/quant_ref.py's int8
    layout): GGUF's Q8_0 and Q6_K blocks on a GPU, put in it at load exactly
    (kernels/gguf_ref.py `as_int8`; runtime/quantization/gguf.py). Computed by INT4's paths,
    which read either layout: the Triton GEMV at batch 1-4, the dequantizing Triton matmul past
    that, the plain torch twin on the CPU. A byte a weight and 4 bytes a group (32 columns for
    Q8_0, 16 for Q6_K; 8 with zero points, a mixed layer's) against bf16's two bytes a weight.
    Never quantized here: a layer becomes one only by that conversion."""

    name = "w8a16"

    def process_after_loading(self, layer: nn.Linear) -> None:
        raise ValueError("int8 grouped weights are converted from GGUF blocks, not quantized here")
