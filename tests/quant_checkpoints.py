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
