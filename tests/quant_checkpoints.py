"""Quantized test checkpoints written offline by the tools users quantize with.

`write_compressed_tensors` writes a compressed-tensors checkpoint of a Hugging Face folder as
llmcompressor does for its FP8_DYNAMIC (channel weight scales, dynamic per-token activations), FP8
(tensor weight scales, static input scales), W4A16 and W4A16_ASYM (4-bit weights in groups,
pack-quantized) schemes: compressed-tensors' own `apply_quantization_config`, scales (and zero
points) from its `calculate_qparams` over each weight's (each group's) min and max (llmcompressor's
min-max observer), its `ModelCompressor` compressing the weights and writing the
quantization_config into config.json. (llmcompressor itself pins other versions of transformers and
compressed-tensors than this project's: the observer is the only piece of it this replaces.)
"""

from __future__ import annotations

from pathlib import Path

import torch


def write_compressed_tensors(src: str | Path, out: str | Path, scheme: str = "channel") -> Path:
    """`src` (a Hugging Face folder) quantized into `out`: FP8 with scheme "channel" (FP8_DYNAMIC)
    or "tensor" (FP8, with input scales of 1/64 standing in for calibration); "w4a16" or
    "w4a16-asym" (W4A16 and W4A16_ASYM, in groups of 32 so that a tiny model's layers divide)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.quant_scheme import FP8, FP8_DYNAMIC, W4A16, W4A16_ASYM
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from transformers import AutoModelForCausalLM

    from radixlm.runtime.model_loader import copy_tokenizer_files

    preset = {"channel": FP8_DYNAMIC, "tensor": FP8, "w4a16": W4A16, "w4a16-asym": W4A16_ASYM}
    preset = dict(preset[scheme])
    if scheme.startswith("w4a16"):
        preset["weights"] = preset["weights"].model_copy(update={"group_size": 32})
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], **preset)},
        ignore=["lm_head"],
    )
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            applied = getattr(module, "quantization_scheme", None)
            if applied is None:
                continue
            w, args = module.weight, applied.weights
            if args.strategy == "channel":
                lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
            elif args.strategy == "group":
                groups = w.reshape(w.shape[0], -1, args.group_size)
                lo, hi = groups.amin(-1), groups.amax(-1)
            else:
                lo, hi = w.amin().reshape(1), w.amax().reshape(1)
            scale, zero = calculate_qparams(lo, hi, args)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if not args.symmetric:
                module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
            if hasattr(module, "input_scale"):
                module.input_scale.fill_(1 / 64)
            module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    out = Path(out)
    model.save_pretrained(str(out))
    compressor.update_config(str(out))
    copy_tokenizer_files(src, out)
    return out


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's pack: column 8j + AWQ_ORDER[i] in bits 4i


def _int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words of 32 bits -> int32 with the same bits."""
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)


def _pack_rows_of_eight(values: torch.Tensor, order: list[int]) -> torch.Tensor:
    """(R, C) 4-bit values -> (R, C // 8) int32, value 8j + order[i] of a row in bits 4i of word j."""
    v = values.to(torch.int64).reshape(values.shape[0], -1, 8)[:, :, order]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    return _int32((v << shifts).sum(-1))


def write_awq_gptq(src: str | Path, out: str | Path, layout: str, group: int = 32) -> Path:
    """`src` (a Hugging Face folder, float weights) as an AWQ (AutoAWQ GEMM) or GPTQ (the original
    format, zero points stored minus one; desc_act false) checkpoint, written here from the
    formats' documented layouts: each decoder linear's weight rounded to 4 bits in groups
    (radixlm's min-max rounding), then packed as that format packs it, scales in float16."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from radixlm.kernels.quant_ref import quantize_int4_groups, unpack_int4

    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    written = {}
    for name, w in tensors.items():
        if not (name.endswith("_proj.weight") and ".layers." in name):
            written[name] = w
            continue
        module = name.removesuffix(".weight")
        packed, scale, zero = quantize_int4_groups(w, group)
        q_t = unpack_int4(packed).t()  # (K, N)
        zero_t = zero.t().to(torch.int64)  # (groups, N)
        if layout == "awq":
            qweight = _pack_rows_of_eight(q_t, AWQ_ORDER)  # (K, N // 8)
            qzeros = _pack_rows_of_eight(zero_t, AWQ_ORDER)
        else:  # along K: k = 8i + j in bits 4j of word (i, n); zero points minus one
            qweight = _pack_rows_of_eight(q_t.t(), list(range(8))).t().contiguous()
            qzeros = _pack_rows_of_eight((zero_t - 1) & 0xF, list(range(8)))
            k = w.shape[1]
            written[f"{module}.g_idx"] = torch.arange(k, dtype=torch.int32) // group
        written[f"{module}.qweight"] = qweight
        written[f"{module}.qzeros"] = qzeros
        written[f"{module}.scales"] = scale.t().contiguous().half()
    save_file(written, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
         "version": "gemm"}
        if layout == "awq"
        else {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
              "sym": False, "checkpoint_format": "gptq"}
    )  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors") and f.is_file():
            shutil.copy(f, out / f.name)
    return out


def reference_awq_gptq_dequantize(
    layout: str, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """The float32 weight (N, K) of an AWQ or GPTQ layer, element by element as the formats
    define it: w[n, k] = (q[k, n] - z[g, n]) * s[g, n], g the group of k; AWQ's q and z at bit
    4 * AWQ_ORDER.index(n % 8) of word n // 8 of their row; GPTQ's q at bit 4 * (k % 8) of word
    (k // 8, n), its z at bit 4 * (n % 8) of word (g, n // 8), plus one."""
    groups, n = scales.shape
    k = qweight.shape[0] if layout == "awq" else qweight.shape[0] * 8
    kk = torch.arange(k)[:, None]  # (K, 1)
    nn_ = torch.arange(n)[None, :]  # (1, N)
    g = kk // (k // groups)
    if layout == "awq":
        pos = torch.tensor([AWQ_ORDER.index(c) for c in range(8)])[nn_ % 8]
        q = (qweight.to(torch.int64)[kk, nn_ // 8] >> (4 * pos)) & 0xF
        z = (qzeros.to(torch.int64)[g, nn_ // 8] >> (4 * pos)) & 0xF
    else:
        q = (qweight.to(torch.int64)[kk // 8, nn_] >> (4 * (kk % 8))) & 0xF
        z = ((qzeros.to(torch.int64)[g, nn_ // 8] >> (4 * (nn_ % 8))) & 0xF) + 1
    return ((q - z).float() * scales.float()[g, nn_]).t()
