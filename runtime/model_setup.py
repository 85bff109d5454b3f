"""A rank's model and KV pool, built from an engine's config: the `Engine` (rank 0, or the only
rank) and the other ranks of a tensor-parallel group (runtime/tp_worker.py) build theirs alike."""

from __future__ import annotations

import dataclasses
import itertools

import torch

from radixlm.runtime import startup
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.engine_core import free_memory, kv_pool_tokens
from radixlm.runtime.memory_pool import KVPool
from radixlm.runtime.model_config import ModelConfig


def build_model(
    config: EngineConfig,
    folder,
    mc: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    context_len: int,
    sampled_vocab: int,
    tp=None,
    comm=None,
    stage=None,
):
    """The model on `device`, its weights loaded (random ones for load_format dummy: under
    tensor parallelism each rank draws its part on its own, which makes no whole model of any
    seed; right for speed, not for outputs). `tp` and `comm`: this rank's part of the model and
    its group's collectives (runtime/parallel.py); None: the whole model. `stage`: a pipeline
    stage's layers (runtime/pipeline.py), which are all it builds and loads. Its linear layers are
    quantized as `config.quantization` and the checkpoint say (runtime/quantization/plan.py): a
    scheme set before loading, the loaded weights turned into the scheme's after."""
    from radixlm.runtime import model_loader
    from radixlm.runtime.models.llama import LlamaForCausalLM
    from radixlm.runtime.quantization import plan as quant

    gguf_file = model_loader.gguf_file(config.model_path)
    plan = None
    if config.quantization is None and gguf_file is not None:  # (its blocks where kernels run)
        plan = quant.default_gguf_plan(gguf_file, device, dtype, tp, stage)
    if plan is None:
        plan = quant.plan_for(config.quantization, mc.quantization, gguf_file)
    if plan is not None and plan.gguf is not None:
        startup.say(f"{plan.description}: {_gguf_path_line(device)}")
    elif plan is not None and device.type != "cuda":
        startup.say(
            f"{plan.description}: on the {device.type} the quantized layers run their "
            "dequantizing torch twins, correct but slower than unquantized weights"
        )
    with torch.device("meta"):
        model = LlamaForCausalLM(mc, context_len + 1, sampled_vocab, tp, comm)
        if stage is not None:  # a pipeline stage (runtime/pipeline.py): its own layers only
            model = stage.trim(model)
    model = model.to(dtype)
    if plan is not None:
        quant.prepare(model, plan)
    check_weights_fit(model, dtype, device)
    model = model.to_empty(device=device)
    if config.load_format == "dummy":
        model.tie_weights_if_needed()
        model_loader.init_dummy_weights(model, config.random_seed)
    else:
        weights = model_loader.iter_safetensors(folder)
        if stage is not None:
            weights = stage.own_weights(weights, mc)
        total = model_loader.count_safetensors(folder)
        if plan is not None:
            weights = quant.readable(weights, plan)
        if plan is not None and plan.gguf is not None:  # the linear layers' blocks from the GGUF
            weights = plan.gguf.weights(weights)
        model.load_weights(startup.progress(weights, total, "loading weights", "tensors"))
        if plan is not None and plan.gguf is not None:
            plan.gguf.load_head(model)
    if plan is not None:
        quant.finish(model, plan)
    model.rope.build_tables(device)
    return model.eval()


def _gguf_path_line(device: torch.device) -> str:
    if device.type == "cuda":
        return (
            "on the GPU the layers of 4-bit blocks (Q4_0, Q4_1, Q4_K) run the INT4 kernels; a "
            "layer with a Q8_0 or Q6_K part is dequantized once, to the model's dtype"
        )
    from radixlm.kernels import gguf_cpu

    if gguf_cpu.load() is None:
        return "no CPU kernels (they could not be built): dequantized at every step, slow"
    return "the CPU kernels read the blocks"


def rank_kv_tokens(
    config: EngineConfig,
    local: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    context_len: int,
) -> int:
    """The KV pool's slots this rank has room for (`local`: the heads it holds). The ranks of a
    CPU group share one host's memory: each takes its share of the fraction."""
    if config.world_size > 1 and device.type == "cpu" and config.max_total_tokens is None:
        share = (config.mem_fraction_static or 0.25) / (config.world_size // config.nnodes)
        config = dataclasses.replace(config, mem_fraction_static=share)
    return kv_pool_tokens(config, local, dtype, device, context_len)


def build_kv_pool(
    config: EngineConfig, local: ModelConfig, num_slots: int, dtype: torch.dtype, device
) -> KVPool:
    """The KV pool of `num_slots` slots (and the padding slot) for the heads `local` holds."""
    return KVPool(
        num_slots + 1, local.num_layers, local.num_kv_heads, local.head_dim, dtype, device,
        kv_cache_dtype=config.kv_cache_dtype,
    )  # fmt: skip


def check_weights_fit(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse a model (on the meta device, in `dtype`, a stored quantization's parameters in
    place) whose weights cannot fit in what `device` has free (it would be killed for memory
    part-way through loading instead)."""
    need = sum(
        t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers())
    )
    free = free_memory(device)
    if need > free:
        half = " or a half dtype (dtype='bfloat16')" if dtype == torch.float32 else ""
        raise ValueError(
            f"the model's weights take {need / 2**30:.1f} GiB in {str(dtype).split('.')[-1]}, "
            f"more than the {free / 2**30:.1f} GiB free on {device}: use a smaller model{half}, "
            "or another device"
        )
