"""Reading a checkpoint's `quantization_config` (config.json): what it stores, or why it is refused.

Supported: compressed-tensors (what llmcompressor writes), stored compressed, one config group
targeting every Linear, the LM head left out (`ignore`):
- FP8: float8 e4m3 weights (symmetric, static, a scale per output channel or per tensor:
  llmcompressor's FP8_DYNAMIC and FP8 schemes), float8 input activations (dynamic per token or
  static per tensor: radixlm always scales them per token at run time, so a static `input_scale`
  is not read);
- W4A16: 4-bit integer weights in groups (symmetric or with zero points: W4A16, W4A16_ASYM),
  packed eight to an int32 (`pack-quantized`), activations unquantized, no activation ordering.
And AWQ (AutoAWQ's GEMM layout: `qweight` (K, N / 8) int32 in AWQ's column order, `qzeros`,
`scales` per group) and GPTQ (`qweight` (K / 8, N) packed along K, `qzeros` stored minus one in
the original format, `scales`; without activation order, `desc_act: false`), 4-bit in groups.
Everything else is refused, naming what is supported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

SUPPORTED_CHECKPOINTS = (
    "compressed-tensors FP8 (float8_e4m3 weights with channel or tensor scales and float8 "
    "activations, as llmcompressor's FP8_DYNAMIC and FP8 schemes write them) and W4A16 (4-bit "
    "integer weights in groups, pack-quantized, as its W4A16 and W4A16_ASYM schemes write them); "
    "AWQ (4-bit, GEMM layout) and GPTQ (4-bit, desc_act false)"
)
_FORMATS = ("float-quantized", "naive-quantized")
_INT4_FORMATS = ("pack-quantized",)
# a Llama-family decoder layer's linear layers, as a Hugging Face checkpoint names them
_DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class StoredQuantization:
    """What a quantized checkpoint stores: its scheme (as `EngineConfig.quantization` names it)
    and how (for the start-up line)."""

    scheme: str
    description: str
    # checkpoint tensor names ending so are not read (a static input scale: see the module doc)
    unread_suffixes: tuple[str, ...] = ()
    # checkpoint tensor name endings -> the layer's parameter names (W4A16's packed tensors)
    renames: tuple[tuple[str, str], ...] = ()
    group: int = 0  # W4A16: columns a scale covers (-1: a row's all)
    zero_points: bool = False  # W4A16: stored zero points (else symmetric)
    layout: str = "compressed-tensors"  # W4A16: how the tensors pack: or "awq", "gptq", "gptq_v2"


def as_dict(quantization_config: Any) -> dict[str, Any]:
    """A config's quantization_config as a dict (transformers may hand an object)."""
    if isinstance(quantization_config, dict):
        return quantization_config
    to_dict = getattr(quantization_config, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    return {"quant_method": getattr(quantization_config, "quant_method", "?")}


def read_quantization_config(qc: dict[str, Any], num_layers: int) -> StoredQuantization:
    """The stored scheme of a checkpoint's quantization_config; ValueError saying what is
    supported for any other."""
    method = qc.get("quant_method", "?")
    if method in ("awq", "gptq"):
        return _read_awq_gptq(qc, method)
    if method != "compressed-tensors":
        _refuse(f"quantized checkpoints of quant_method {method!r} are not supported yet")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        _refuse(f"a compressed-tensors checkpoint with quantization_status {status!r}")
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if qc.get(key):
            _refuse(
                f"a compressed-tensors checkpoint with a {key} (for an FP8 KV cache use "
                "kv_cache_dtype='fp8_e4m3')"
            )
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        _refuse(f"a compressed-tensors checkpoint of {len(groups)} config groups (one is)")
    group = next(iter(groups.values()))
    if group.get("targets") != ["Linear"]:
        _refuse(f"a config group targeting {group.get('targets')!r} (['Linear'] is)")
    fmt = group.get("format") or qc.get("format")
    weights = group.get("weights") or {}
    if weights.get("type") == "int":
        _check_ignore(qc.get("ignore") or [], num_layers)
        return _read_w4a16(group, fmt)
    if fmt not in _FORMATS:
        _refuse(f"compressed-tensors format {fmt!r} (supported: {', '.join(_FORMATS)})")
    strategy = weights.get("strategy")
    if not (
        weights.get("type") == "float"
        and weights.get("num_bits") == 8
        and weights.get("symmetric", True)
        and not weights.get("dynamic", False)
        and strategy in ("channel", "tensor")
    ):
        _refuse(f"compressed-tensors weights {_args(weights)}")
    acts = group.get("input_activations")
    if not acts or acts.get("type") != "float" or acts.get("num_bits") != 8:
        _refuse(
            f"compressed-tensors input activations {_args(acts or {})} (float8 weights with "
            "unquantized activations among them)"
        )
    if group.get("output_activations"):
        _refuse("compressed-tensors output activations")
    _check_ignore(qc.get("ignore") or [], num_layers)
    static = not acts.get("dynamic", False)
    return StoredQuantization(
        "fp8",
        f"compressed-tensors FP8, {strategy} weight scales",
        unread_suffixes=(".input_scale",) if static else (),
    )


def _read_w4a16(group: dict[str, Any], fmt: str | None) -> StoredQuantization:
    weights = group["weights"]
    if fmt not in _INT4_FORMATS:
        _refuse(f"compressed-tensors integer weights in format {fmt!r} (pack-quantized is)")
    size = weights.get("group_size")
    if not (
        weights.get("num_bits") == 4
        and weights.get("strategy") == "group"
        and isinstance(size, int)
        and size >= 16
        and not weights.get("dynamic", False)
    ):
        _refuse(f"compressed-tensors weights {_args(weights)}, group_size {size!r}")
    if weights.get("actorder"):
        _refuse(f"compressed-tensors weights with actorder {weights['actorder']!r}")
    if group.get("input_activations") or group.get("output_activations"):
        _refuse("compressed-tensors 4-bit weights with quantized activations")
    zero_points = not weights.get("symmetric", True)
    return StoredQuantization(
        "w4a16",
        f"compressed-tensors W4A16, group {size}{', zero points' if zero_points else ''}",
        unread_suffixes=(".weight_shape",),
        renames=((".weight_packed", ".weight"), (".weight_zero_point", ".weight_zero")),
        group=size,
        zero_points=zero_points,
    )


def _read_awq_gptq(qc: dict[str, Any], method: str) -> StoredQuantization:
    bits, size = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
    if bits != 4 or not isinstance(size, int) or not (size == -1 or size >= 16):
        _refuse(f"{method} with bits {bits!r} and group_size {size!r} (4 bits in groups is)")
    if qc.get("modules_to_not_convert"):
        _refuse(f"{method} leaving modules unquantized ({qc['modules_to_not_convert']!r})")
    renames = ((".qweight", ".weight"), (".qzeros", ".weight_zero"), (".scales", ".weight_scale"))
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm" or not qc.get("zero_point", True):
            _refuse(f"AWQ version {version!r} (zero_point {qc.get('zero_point')!r}); GEMM is")
        return StoredQuantization(
            "w4a16", f"AWQ, group {size}", renames=renames, group=size, zero_points=True,
            layout="awq",
        )  # fmt: skip
    if qc.get("desc_act"):
        _refuse(
            "GPTQ with desc_act=true (activation order: the groups permute the columns); "
            "quantize with desc_act=false"
        )
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        _refuse(f"GPTQ checkpoint_format {fmt!r} (gptq and gptq_v2 are)")
    return StoredQuantization(
        "w4a16", f"GPTQ, group {size}", unread_suffixes=(".g_idx",), renames=renames,
        group=size, zero_points=True, layout=fmt,
    )  # fmt: skip


def _check_ignore(ignore: list[str], num_layers: int) -> None:
    """The LM head must be left out (it stays in the model's dtype) and no decoder linear layer."""

    def matches(entry: str, name: str) -> bool:
        if entry.startswith("re:"):
            return re.match(entry[3:], name) is not None
        return entry == name or name.endswith("." + entry)

    decoder = [
        f"model.layers.{i}.{'self_attn' if p in _DECODER_LINEARS[:4] else 'mlp'}.{p}"
        for i in range(num_layers)
        for p in _DECODER_LINEARS
    ]
    left_out = sorted({n for n in decoder for e in ignore if matches(e, n)})
    if left_out:
        _refuse(
            f"a compressed-tensors checkpoint leaving decoder layers unquantized ({left_out[:3]}"
            f"{' ...' if len(left_out) > 3 else ''}: every linear layer but the LM head quantized is)"
        )
    if not any(matches(e, "lm_head") for e in ignore):
        _refuse("a compressed-tensors checkpoint with a quantized LM head (lm_head not in ignore)")


def _args(args: dict[str, Any]) -> str:
    keys = ("type", "num_bits", "strategy", "symmetric", "dynamic")
    return "{" + ", ".join(f"{k}: {args.get(k)!r}" for k in keys if k in args) + "}"


def _refuse(what: str) -> None:
    raise ValueError(
        f"{what}: not supported. Supported quantized checkpoints: {SUPPORTED_CHECKPOINTS}; or "
        "quantization='fp8' or 'w4a16' on a bfloat16/float16/float32 checkpoint (quantized at "
        "load), or a GGUF file (dequantized at load)"
    )
