"""The FP8 KV cache (`kv_cache_dtype="fp8_e4m3"`): its sizing, its option, the engine over it on both
attention backends, and its quality on the real default model against the unquantized KV.

The kernels themselves are compared with the float8 torch reference in test_kernels_attention.py.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

import radixlm
from radixlm.runtime import engine_core
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.memory_pool import KVPool, kv_cache_storage_dtype

# the default model's KV shape (SmolLM2-135M) and Llama-3.1-8B's
SHAPES = [(30, 3, 64), (32, 8, 128)]


@pytest.mark.parametrize("layers,kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_pool_holds_twice_the_tokens_in_the_same_memory(
    monkeypatch, layers, kv_heads, head_dim, dtype
):
    """The sizing the engine runs (kv_pool_tokens over free memory) gives the float8 pool >= 1.9x
    the tokens of the model-dtype pool, and a pool of that many slots takes no more bytes."""
    budget = 3 << 30
    monkeypatch.setattr(engine_core, "free_memory", lambda device: budget)
    mc = types.SimpleNamespace(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim)
    tokens = {}
    for kv in ("auto", "fp8_e4m3"):
        config = EngineConfig(
            kv_cache_dtype=kv, mem_fraction_static=0.5, max_running_requests=10**6
        )
        tokens[kv] = engine_core.kv_pool_tokens(config, mc, dtype, torch.device("cpu"), 10**6)
        per_slot = KVPool.bytes_per_slot(
            layers, kv_heads, head_dim, kv_cache_storage_dtype(kv, dtype)
        )
        assert tokens[kv] * per_slot <= budget * 0.5
    assert tokens["fp8_e4m3"] >= 1.9 * tokens["auto"], tokens
    # what the pools really allocate per slot is what the sizing counted
    for kv in ("auto", "fp8_e4m3"):
        pool = KVPool(5, layers, kv_heads, head_dim, dtype, torch.device("meta"), kv_cache_dtype=kv)
        assert pool.nbytes == 5 * KVPool.bytes_per_slot(layers, kv_heads, head_dim, pool.dtype)
        assert pool.quantized == (kv == "fp8_e4m3")


def test_max_total_tokens_is_checked_against_the_fp8_size(monkeypatch):
    mc = types.SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64)
    per_bf16 = KVPool.bytes_per_slot(30, 3, 64, torch.bfloat16)
    monkeypatch.setattr(engine_core, "free_memory", lambda device: 1000 * per_bf16)
    cpu = torch.device("cpu")
    fits = EngineConfig(kv_cache_dtype="fp8_e4m3", max_total_tokens=1900)
    assert engine_core.kv_pool_tokens(fits, mc, torch.bfloat16, cpu, 4096) == 1900
    with pytest.raises(ValueError, match="ask for at most 1000"):
        engine_core.kv_pool_tokens(
            EngineConfig(max_total_tokens=1900), mc, torch.bfloat16, cpu, 4096
        )


@pytest.mark.parametrize("value", ["fp8_e5m2", "fp8", "int8", "bfloat16"])
def test_other_kv_cache_dtypes_are_refused_naming_the_supported_ones(value):
    with pytest.raises(ValueError, match=r"kv_cache_dtype=.*use one of auto, fp8_e4m3"):
        EngineConfig(kv_cache_dtype=value)
    with pytest.raises(ValueError, match="use one of auto, fp8_e4m3"):
        kv_cache_storage_dtype(value, torch.float32)


def test_kv_cache_dtype_is_a_command_line_option():
    import argparse

    from radixlm import cli

    parser = argparse.ArgumentParser()
    cli._add_engine_options(parser)
    args = parser.parse_args(["--kv-cache-dtype", "fp8_e4m3"])
    assert cli._engine_kwargs(args) == {"kv_cache_dtype": "fp8_e4m3"}


def test_pool_scales_are_checked():
    cpu = torch.device("cpu")
    pool = KVPool(4, 2, 1, 8, torch.float32, cpu, "fp8_e4m3", k_scale=[0.5, 2], v_scale=None)
    assert pool.k_scale == [0.5, 2.0] and pool.v_scale == [1.0, 1.0]
    assert pool.dtype == torch.float8_e4m3fn and pool.compute_dtype == torch.float32
    with pytest.raises(ValueError, match="k_scale has 1 values for 2 layers"):
        KVPool(4, 2, 1, 8, torch.float32, cpu, "fp8_e4m3", k_scale=[1.0])
    with pytest.raises(ValueError, match="positive and finite"):
        KVPool(4, 2, 1, 8, torch.float32, cpu, "fp8_e4m3", v_scale=[1.0, 0.0])
    with pytest.raises(ValueError, match="for a float8 pool"):
        KVPool(4, 2, 1, 8, torch.float32, cpu, "auto", k_scale=[0.5, 2])


def test_fp8_engine_on_triton_equals_fp8_engine_on_torch(tiny_model_folder):
    """The same float8 pool read by the Triton kernels (the interpreter here) and by the torch
    oracle: the same tokens, with chunked prompts, a cached shared prefix and decodes batched;
    and the pool really holds float8."""
    shared = list(range(500, 524))
    prompts = [shared + list(range(600 + 7 * i, 604 + 9 * i)) for i in range(3)]
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    outs = {}
    for backend in ("torch", "triton"):
        with radixlm.Engine(
            tiny_model_folder, dtype="float32", disable_cuda_graph=True,
            attention_backend=backend, kv_cache_dtype="fp8_e4m3", chunked_prefill_size=16,
        ) as eng:  # fmt: skip
            assert eng._core.kv_pool.k[0].dtype == torch.float8_e4m3fn
            first = eng.generate(input_ids=prompts[0], sampling_params=params)
            rest = eng.generate(input_ids=prompts[1:], sampling_params=params)
            outs[backend] = [o["output_ids"] for o in [first, *rest]]
            assert all(o["meta_info"]["cached_tokens"] >= 16 for o in rest)
    assert outs["torch"] == outs["triton"]


def _top1_per_position(engine, ids: list[int]) -> list[int]:
    out = engine.generate(
        input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0},
        return_logprob=True, logprob_start_len=0, top_logprobs_num=1,
    )  # fmt: skip
    return [top[0][1] for top in out["meta_info"]["input_top_logprobs"][1:]]


def test_fp8_kv_on_the_real_model_agrees_with_the_unquantized_kv(engine, default_model_folder):
    """The real default model with an FP8 KV pool, the radix cache on and prompts chunked: greedy
    generation runs (cached prefixes reused), and its teacher-forced top-1 next tokens agree with
    those of the unquantized pool (the shared default engine) on >= 96% of ~420 positions
    (benchmarks/quant_quality.py measures 98.8% over its whole text set)."""
    from tests.prompts import varied_prompts

    texts = [t for t in varied_prompts() if t.startswith(("Story:", "<|im_start|>system"))]
    shared = "<|im_start|>system\nYou are a careful assistant.<|im_end|>\n<|im_start|>user\n"
    questions = ["Name three rivers.", "What is 12 times 12?", "Write a haiku about rain."]
    chats = [f"{shared}{q}<|im_end|>\n<|im_start|>assistant\n" for q in questions]
    params = {"max_new_tokens": 12, "temperature": 0}
    ids = [engine.tokenizer.encode(t)[:210] for t in texts]
    want = [_top1_per_position(engine, x) for x in ids]
    want_greedy = [o["output_ids"] for o in engine.generate(chats, params)]
    with radixlm.Engine(
        default_model_folder, kv_cache_dtype="fp8_e4m3", chunked_prefill_size=64,
        max_total_tokens=2048,
    ) as eng:  # fmt: skip
        assert eng._core.kv_pool.k[0].dtype == torch.float8_e4m3fn
        got = [_top1_per_position(eng, x) for x in ids]
        eng.generate(chats[0], params)
        outs = eng.generate(chats, params)
    assert all(o["meta_info"]["cached_tokens"] > 10 for o in outs)  # the radix cache
    same = sum(a == b for x, y in zip(want, got) for a, b in zip(x, y))
    total = sum(len(x) for x in want)
    assert total > 400
    assert same / total >= 0.96, f"top-1 agreement {same}/{total}"
    # greedy answers stay close: their first tokens agree
    greedy = [o["output_ids"] for o in outs]
    assert sum(a[:4] == b[:4] for a, b in zip(want_greedy, greedy)) >= 2, (want_greedy, greedy)


def test_kv_cache_benchmark_runs_at_a_tiny_size(capsys):
    """benchmarks/kv_cache_fp8.py end to end on the CPU at a tiny size: both pools sized and
    allocated from the same free memory, both engines decoding over cached prompts."""
    from benchmarks import kv_cache_fp8

    result = kv_cache_fp8.main(
        ["--shape", "tiny", "--batch", "2", "--context", "16", "--steps", "2", "--repeats", "1",
         "--device", "cpu", "--mem-fraction", "0.0005"]
    )  # fmt: skip
    auto, fp8 = result["capacity"]
    # (the host's free memory moves between the two sizings a little)
    assert abs(auto.pool_bytes - fp8.pool_bytes) <= 0.01 * auto.pool_bytes
    assert result["capacity_ratio"] >= 1.9  # (float32 on the CPU: 4x)
    # (a few steps of a tiny model on a shared CPU: timings are noise, only that they were taken)
    assert [d.kv_cache_dtype for d in result["decode"]] == ["auto", "fp8_e4m3"]
    assert all(math.isfinite(d.step_seconds) for d in result["decode"])
    out = capsys.readouterr().out
    assert "fp8 / float32" in out and "decode tokens/s" in out


def test_fp8_kv_speculative_verify_gives_plain_decoding_tokens(tiny_model_folder):
    """NGRAM speculation over an FP8 pool: the verify steps (drafts read back from the float8
    pool as a prompt chunk) give the tokens of plain decoding over the same pool."""
    prompts = [[300 + i % 7 for i in range(40)], [900 + i % 5 for i in range(33)] + [5, 6]]
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    outs, stats = {}, {}
    for spec in (None, "NGRAM"):
        with radixlm.Engine(
            tiny_model_folder, kv_cache_dtype="fp8_e4m3", speculative_algorithm=spec,
            chunked_prefill_size=16,
        ) as eng:  # fmt: skip
            outs[spec] = [
                o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)
            ]
            stats[spec] = eng.get_stats()
    assert stats["NGRAM"]["spec_verify_ct"] > 0, stats["NGRAM"]
    assert outs["NGRAM"] == outs[None]


def test_quant_quality_benchmark_runs_its_rows(tiny_model_folder, capsys):
    """benchmarks/quant_quality.py on the tiny model (mechanics only: the figures are the real
    model's): the FP8 KV row, texts scored in chunks over the pool."""
    from benchmarks import quant_quality

    rows = quant_quality.main(
        ["--model-path", tiny_model_folder, "--device", "cpu", "--texts", "3", "--chunk", "4"]
    )  # fmt: skip
    assert [r.name for r in rows] == [s.name for s in quant_quality.SCHEMES.values()]
    assert all(0.5 <= r.top1 <= 1.0 and 0.0 <= r.mean_kl < 1.0 for r in rows), rows
    assert "FP8 KV cache" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        quant_quality.main(["--rows", "int3"])


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a GPU with float8 (compute capability 8.9 or later)",
)
def test_gpu_fp8_engine_with_cuda_graphs_matches_eager_and_the_torch_backend(tiny_model_folder):
    """On the GPU: decode and prompt steps replayed from CUDA graphs over an FP8 pool give the
    tokens of eager Triton steps, with overlap scheduling on; and the torch backend over the same
    pool agrees (float32; rope computed apart there, so a rotated key may round to the next
    float8 value now and then: all but one prompt identical)."""
    prompts = [list(range(100 + 9 * i, 100 + 9 * i + n)) for i, n in enumerate((3, 17, 40, 70))]
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    outs, stats = {}, {}
    for name, kwargs in {
        "graphs": {},
        "eager": {"disable_cuda_graph": True},
        "torch": {"attention_backend": "torch"},
    }.items():
        with radixlm.Engine(
            tiny_model_folder, dtype="float32", kv_cache_dtype="fp8_e4m3", chunked_prefill_size=32,
            **kwargs,
        ) as eng:  # fmt: skip
            outs[name] = [
                o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)
            ]
            stats[name] = eng.get_stats()
    assert stats["graphs"]["graph_steps"] > 0 and stats["graphs"]["overlapped_steps"] > 0
    assert outs["graphs"] == outs["eager"]
    assert sum(a == b for a, b in zip(outs["eager"], outs["torch"])) >= len(prompts) - 1
