"""Which quantization scheme a model's linear layers get, and setting it on them around loading.

Every linear layer of the decoder gets the scheme; the LM head (and the embedding) stays in the
model's dtype, as in SGLang and vLLM: it is one layer, the most sensitive one, and its logits are
computed in float32 (runtime/layers.py `float32_linear`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from radixlm.runtime.config import QUANTIZATION_METHODS
from radixlm.runtime.quantization.base import LinearScheme
from radixlm.runtime.quantization.checkpoint import StoredQuantization
from radixlm.runtime.quantization.fp8 import Fp8Linear
from radixlm.runtime.quantization.int4 import Int4Linear

# SGLang's names of a quantized checkpoint's own format: each runs such a checkpoint as stored
# (as leaving quantization unset does; the Marlin ones name CUDA kernels of SGLang and vLLM, here
# the INT4 kernels run) and refuses any other, saying what the checkpoint is
STORED_FORMATS = {
    "awq": ("AWQ", ("awq",)),
    "awq_marlin": ("AWQ", ("awq",)),
    "gptq": ("GPTQ", ("gptq", "gptq_v2")),
    "gptq_marlin": ("GPTQ", ("gptq", "gptq_v2")),
    "compressed-tensors": ("compressed-tensors", ("compressed-tensors",)),
}


@dataclass(frozen=True)
class QuantPlan:
    scheme: LinearScheme
    description: str  # for the start-up line
    unread_suffixes: tuple[str, ...] = ()  # checkpoint tensors not read (StoredQuantization)
    renames: tuple[tuple[str, str], ...] = ()  # checkpoint name endings -> the layer's names
    # a scheme of each layer's own (by module name), where layers differ (a GGUF's block types)
    schemes: dict[str, LinearScheme] | None = None
    gguf: Any = None  # quantization="gguf": the file's blocks (gguf.GgufWeights)


def plan_for(
    option: str | None, stored: StoredQuantization | None, gguf_file: str | Path | None = None
) -> QuantPlan | None:
    """The plan for `quantization=option` over a checkpoint that stores `stored` (None: plain
    weights), converted from the GGUF file `gguf_file` if one; None: no quantization."""
    if option == "gguf":
        return gguf_plan(gguf_file)
    if option == "none":
        if stored is not None:
            raise ValueError(
                f"quantization='none', but the checkpoint is quantized ({stored.description}): "
                "leave quantization unset to run it as stored"
            )
        return None
    if option in STORED_FORMATS:
        kind, layouts = STORED_FORMATS[option]
        if stored is None or stored.layout not in layouts:
            what = "not quantized" if stored is None else f"{stored.description}"
            hint = (
                "leave quantization unset to run it as stored"
                if stored is not None
                else "use quantization='fp8' or 'w4a16' to quantize it at load"
            )
            raise ValueError(
                f"quantization={option!r} runs a {kind} checkpoint as stored (its config.json's "
                f"quantization_config says so), but this one is {what}: {hint}"
            )
        option = None  # (as stored)
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


def default_gguf_plan(
    gguf_file: str | Path, device, dtype, tp=None, stage=None
) -> QuantPlan | None:
    """What a GGUF file runs as when `quantization` is unset: its blocks as stored (the "gguf"
    plan) where the CPU kernels run it, faster than the float conversion at every batch measured
    (benchmarks/gguf_cpu.py: 7.7x at batch 1, 1.7x at 32) in a quarter of the memory: on the
    CPU, in float32, on one rank, with the kernels built and every tensor of a type they read;
    None (the float32 conversion, as before) elsewhere: on a GPU the 4-bit layers' INT4 kernels
    measured 5-10% slower than bf16 at batch 1 (benchmarks/quant_gemv.py), so they run only where
    asked for (`quantization="gguf"`)."""
    import torch

    if device.type != "cpu" or dtype != torch.float32 or stage is not None:
        return None
    if (tp is not None and tp.size > 1) or not _cpu_kernels_built():
        return None
    try:
        return gguf_plan(gguf_file)  # (refuses a tensor type the kernels do not read)
    except ValueError:
        return None


def gguf_plan(gguf_file: str | Path | None) -> QuantPlan:
    """GGUF blocks as stored (runtime/quantization/gguf.py): each layer's scheme of its parts'
    block types; the LM head's too, where its tensor is of a supported type."""
    from radixlm.runtime.quantization.gguf import GgufLinear, GgufWeights, type_name

    if gguf_file is None:
        raise ValueError(
            "quantization='gguf' runs a GGUF file's blocks as stored, but the model is not a "
            ".gguf file: pass one, or leave quantization unset"
        )
    weights = GgufWeights(gguf_file)
    types = sorted({type_name(t.gtype) for t in weights.tensors.values()})
    head = ""
    if weights.head_supported():
        head = f", the LM head {type_name(weights.head.gtype)}"
    description = f"GGUF blocks as stored ({', '.join(types)}{head})"
    return QuantPlan(GgufLinear((0,)), description, schemes={}, gguf=weights)


def quantized_linears(model: nn.Module) -> list[nn.Linear]:
    """The linear layers a scheme applies to: all but the LM head."""
    return [
        m
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name.rpartition(".")[2] != "lm_head"
    ]


def prepare(model: nn.Module, plan: QuantPlan) -> None:
    """Before loading (on the meta device): give each layer its scheme and what it loads."""
    if plan.gguf is not None:
        _gguf_schemes(model, plan)
    for name, layer in _named_linears(model, plan):
        scheme = plan.schemes[name] if plan.schemes is not None else plan.scheme
        layer.quant_scheme = scheme
        scheme.create_weights(layer)
    if plan.gguf is not None:
        plan.gguf.share_embedding(model)


def _named_linears(model: nn.Module, plan: QuantPlan) -> list[tuple[str, nn.Linear]]:
    """The layers the plan quantizes: all but the LM head, and the head where it has a scheme."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear)
        and (name.rpartition(".")[2] != "lm_head" or (plan.schemes or {}).get(name) is not None)
    ]


def _gguf_schemes(model: nn.Module, plan: QuantPlan) -> None:
    from radixlm.runtime.quantization.gguf import GgufLinear

    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear):
            continue
        if name.rpartition(".")[2] == "lm_head":
            if plan.gguf.head_supported():
                plan.schemes[name] = GgufLinear((plan.gguf.head.gtype,))
        else:
            plan.schemes[name] = GgufLinear(plan.gguf.layer_types(name))


@torch.no_grad()
def finish(model: nn.Module, plan: QuantPlan) -> None:
    """After loading: each layer turns what it loaded into what it computes with. (The weights
    it replaced go back to the GPU, so that the KV pool, sized from free memory next, gets them.)"""
    for _, layer in _named_linears(model, plan):
        layer.quant_scheme.process_after_loading(layer)
    if plan.gguf is not None and not any(p.is_cuda for p in model.parameters()):
        from radixlm.runtime.quantization.gguf import wrap_cpu_forward

        if _cpu_kernels_built():
            wrap_cpu_forward(model)
    if any(p.is_cuda for p in model.parameters()):
        torch.cuda.empty_cache()


def _cpu_kernels_built() -> bool:
    from radixlm.kernels import gguf_cpu

    return gguf_cpu.load() is not None


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
