"""How the engine sizes its KV pool on a GPU (runtime/engine_core.py `kv_pool_tokens`): from the
free memory less what the CUDA graphs captured after it keep (`graph_output_bytes`), checked with
the free memory stubbed (no GPU needed)."""

from __future__ import annotations

import types

import pytest
import torch

from radixlm.runtime import engine_core
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.memory_pool import KVPool

LLAMA_8B = types.SimpleNamespace(num_layers=32, num_kv_heads=8, head_dim=128, vocab_size=128256)


def test_the_pool_leaves_the_graphs_their_outputs(monkeypatch):
    """An 8B model on an 80 GB GPU with 1,000 requests at once (the case that ran out of memory
    while capturing): the graphs' logits alone need more than the 15% the pool used to leave."""
    free = 62 << 30  # an 80 GB GPU less the 8B model's weights
    monkeypatch.setattr(engine_core, "free_memory", lambda device: free)
    cuda = torch.device("cuda")
    config = EngineConfig(
        max_running_requests=1000, cuda_graph_max_bs=1000, chunked_prefill_size=8192
    )
    kept = engine_core.graph_output_bytes(config, LLAMA_8B.vocab_size)
    assert kept > 0.15 * free
    with_graphs = engine_core.kv_pool_tokens(config, LLAMA_8B, torch.bfloat16, cuda, 10**6)
    per_slot = KVPool.bytes_per_slot(32, 8, 128, torch.bfloat16)
    assert with_graphs * per_slot + kept <= free
    eager = EngineConfig(max_running_requests=1000, disable_cuda_graph=True)
    assert engine_core.graph_output_bytes(eager, LLAMA_8B.vocab_size) == 0
    assert (
        engine_core.kv_pool_tokens(eager, LLAMA_8B, torch.bfloat16, cuda, 10**6)
        == int(free * 0.85) // per_slot
    )
    # on the CPU there are no graphs: nothing is set aside
    cpu_config = EngineConfig(max_running_requests=1000, mem_fraction_static=0.5)
    cpu = engine_core.kv_pool_tokens(
        cpu_config, LLAMA_8B, torch.float32, torch.device("cpu"), 10**6
    )
    assert cpu == int(free * 0.5) // KVPool.bytes_per_slot(32, 8, 128, torch.float32)


def test_max_total_tokens_must_fit_beside_the_graphs(monkeypatch):
    """A pool asked for by size that fits the free memory but not beside the graphs' outputs is
    refused, saying what the graphs keep and what to lower."""
    per_slot = KVPool.bytes_per_slot(32, 8, 128, torch.bfloat16)
    config = EngineConfig(
        max_running_requests=1000, cuda_graph_max_bs=1000, max_total_tokens=10_000
    )
    kept = engine_core.graph_output_bytes(config, LLAMA_8B.vocab_size)
    monkeypatch.setattr(engine_core, "free_memory", lambda device: kept + 5_000 * per_slot)
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match="CUDA graphs' outputs keep.*ask for at most 5000"):
        engine_core.kv_pool_tokens(config, LLAMA_8B, torch.bfloat16, cuda, 10**6)
    eager = EngineConfig(max_total_tokens=10_000, disable_cuda_graph=True)
    assert engine_core.kv_pool_tokens(eager, LLAMA_8B, torch.bfloat16, cuda, 10**6) == 10_000
