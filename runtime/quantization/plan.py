"""Which quantization scheme a model's linear layers get, and setting it on them around loading.

Every linear layer of the decoder gets the scheme; the LM head (and the embedding) stays in the
model's dtype, as in SGLang and vLLM: it is one layer, the most sensitive one, and its logits are
computed in float32 (runtime/layers.py `float32_linear`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from radixlm.runtime.quantization.base import LinearScheme
from radixlm.runtime.quantization.checkpoint import StoredQuantization
from radixlm.runtime.quantization.fp8 import Fp8Linear
from radixlm.runtime.quantization.int4 import Int4Linear

QUANTIZATION_METHODS = (
    "fp8",
    "w4a16",
)  # EngineConfig.quantization's values (None: none; config.py)


@dataclass(frozen=True)
class QuantPlan:
    scheme: LinearScheme
    description: str  # for the start-up line
    unread_suffixes: tuple[str, ...] = ()  # checkpoint tensors not read (StoredQuantization)
    renames: tuple[tuple[str, str], ...] = ()  # checkpoint name endings -> the layer's names


def plan_for(option: str | None, stored: StoredQuantization | None) -> QuantPlan | None:
    """The plan for `quantization=option` over a checkpoint that stores `stored` (None: plain
    weights); None: no quantization."""
    if stored is not None:
        if option is not None and option != stored.scheme:
            raise ValueError(
                f"quantization={option!r}, but the checkpoint is already quantized "
                f"({stored.description}): leave quantization unset to run it as stored"
            )
        scheme = Int4Linear(stored=stored) if stored.scheme == "w4a16" else Fp8Linear(stored=True)
        return QuantPlan(scheme, stored.description, stored.unread_suffixes, stored.renames)
    if option is None:
        return None
    if option == "fp8":
        return QuantPlan(Fp8Linear(stored=False), "FP8 W8A8, quantized at load")
    if option == "w4a16":
        return QuantPlan(Int4Linear(), "INT4 W4A16, group 128, quantized at load")
    raise ValueError(f"quantization={option!r}; use one of {', '.join(QUANTIZATION_METHODS)}")


def quantized_linears(model: nn.Module) -> list[nn.Linear]:
    """The linear layers a scheme applies to: all but the LM head."""
    return [
        m
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name.rpartition(".")[2] != "lm_head"
    ]


def prepare(model: nn.Module, plan: QuantPlan) -> None:
    """Before loading (on the meta device): give each layer its scheme and what it loads."""
    for layer in quantized_linears(model):
        layer.quant_scheme = plan.scheme
        plan.scheme.create_weights(layer)


@torch.no_grad()
def finish(model: nn.Module, plan: QuantPlan) -> None:
    """After loading: each layer turns what it loaded into what it computes with. (The weights
    it replaced go back to the GPU, so that the KV pool, sized from free memory next, gets them.)"""
    for layer in quantized_linears(model):
        plan.scheme.process_after_loading(layer)
    if any(p.is_cuda for p in model.parameters()):
        torch.cuda.empty_cache()


def readable(
    weights: Iterable[tuple[str, torch.Tensor]], plan: QuantPlan
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors less those the plan does not read, named as the layers name them."""
    for name, tensor in weights:
        if name.endswith(plan.unread_suffixes):  # (none: an empty tuple)
            continue
        for end, ours in plan.renames:
            if name.endswith(end):
                name = name[: -len(end)] + ours
                break
        yield name, tensor
