"""Quantized test checkpoints written offline by the tools users quantize with.

`write_compressed_tensors_fp8` writes a compressed-tensors FP8 checkpoint of a Hugging Face folder
as llmcompressor does for its FP8_DYNAMIC (channel weight scales, dynamic per-token activations)
and FP8 (tensor weight scales, static input scales) schemes: compressed-tensors' own
`apply_quantization_config`, scales from its `calculate_qparams` over each weight's min and max
(llmcompressor's min-max observer), its `ModelCompressor` compressing the weights and writing the
quantization_config into config.json. (llmcompressor itself pins other versions of transformers and
compressed-tensors than this project's: the observer is the only piece of it this replaces.)
"""

from __future__ import annotations

from pathlib import Path

import torch


def write_compressed_tensors_fp8(
    src: str | Path, out: str | Path, strategy: str = "channel"
) -> Path:
    """`src` (a Hugging Face folder) quantized to FP8 into `out`: strategy "channel"
    (FP8_DYNAMIC) or "tensor" (FP8, with input scales of 1/64 standing in for calibration)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.quant_scheme import FP8, FP8_DYNAMIC
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from transformers import AutoModelForCausalLM

    from radixlm.runtime.model_loader import copy_tokenizer_files

    preset = {"channel": FP8_DYNAMIC, "tensor": FP8}[strategy]
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], **preset)},
        ignore=["lm_head"],
    )
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            scheme = getattr(module, "quantization_scheme", None)
            if scheme is None:
                continue
            w = module.weight
            if scheme.weights.strategy == "channel":
                lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
            else:
                lo, hi = w.amin().reshape(1), w.amax().reshape(1)
            scale, _ = calculate_qparams(lo, hi, scheme.weights)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
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
