"""The interface between a linear layer and its quantization scheme.

A linear layer of the model (runtime/parallel.py's column- and row-parallel layers, or any
nn.Linear) keeps its scheme as `layer.quant_scheme`; a layer without one is unquantized. The
model's matmul hook (runtime/layers.py `PlainMatmuls`, runtime/matmul_dispatch.py
`LinearDispatch`) asks the scheme to multiply, so the model code never learns which scheme a layer
has. A scheme owns what the layer stores (`create_weights`, `checkpoint_tensor`,
`process_after_loading`) and how it multiplies (`apply`: the plain path; `gemv_operands`: what the
batch-1 Triton GEMV reads; `reference`: the oracle that GEMV is checked against).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LinearScheme:
    """How a linear layer stores its weight and multiplies by it: one subclass per scheme. This
    base is the unquantized layer (the weight as a tensor of the model's dtype)."""

    name = "none"
    quantized = False
    has_gemv = True  # kernels/gemv.py reads its weights (`gemv_operands`)

    def create_weights(self, layer: nn.Linear) -> None:
        """Before loading (on the meta device): replace the layer's parameters by what the
        scheme loads from a checkpoint."""

    def checkpoint_tensor(
        self, layer: nn.Linear, leaf: str, tensor: torch.Tensor, index: int | None
    ) -> torch.Tensor:
        """A checkpoint's tensor for the layer's parameter `leaf` (part `index` of a fused
        projection), in the shape the unsharded parameter has; ValueError for one the scheme
        cannot take."""
        return tensor

    def row_shard(self, layer: nn.Linear, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of `tensor` (a 2-D parameter in its unsharded shape) for a
        row-parallel layer, which holds a run of the input features: their columns."""
        return layer.shard(tensor)

    def process_after_loading(self, layer: nn.Linear) -> None:
        """After loading: turn what was loaded into what the layer computes with."""

    def apply(
        self, layer: nn.Linear, x: torch.Tensor, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """layer(x) (..., N) on the plain path, in `out_dtype` (default x's)."""
        y = F.linear(x, layer.weight, layer.bias)
        return y if out_dtype is None else y.to(out_dtype)

    def norm_apply(self, layer: nn.Linear, x, residual, norm):
        """`apply` after `norm` (an RMSNorm) of x + residual, where the scheme has a kernel that
        does both better than the two apart: (y, x + residual, or x without one); None (the
        default): the norm runs, then `apply` (runtime/layers.py PlainMatmuls.norm_linear)."""
        return None

    def reference(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """The float32 result the batch-1 GEMV must match (its oracle, with its numerics)."""
        b = layer.bias
        return F.linear(x.float(), layer.weight.float(), None if b is None else b.float())

    def gemv_operands(self, layer: nn.Linear) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(weight, the keyword arguments of kernels/gemv.py that describe it: its scales)."""
        return layer.weight, {}

    def dequantized_rows(self, layer: nn.Linear, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight the layer stands for, float32 (T, K): an embedding looked
        up in a GGUF LM head (runtime/quantization/gguf.py `GgufEmbedding`)."""
        return layer.weight[ids].float()


UNQUANTIZED = LinearScheme()


def scheme_of(layer: nn.Module) -> LinearScheme:
    """The layer's quantization scheme (unquantized unless one was set)."""
    return getattr(layer, "quant_scheme", None) or UNQUANTIZED


def replace_parameter(layer: nn.Module, name: str, value: torch.Tensor) -> None:
    """Set (or add) the layer's parameter `name` to `value`, which it then owns; no gradient."""
    layer.register_parameter(name, nn.Parameter(value, requires_grad=False))
