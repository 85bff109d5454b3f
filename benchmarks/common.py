"""Shared helpers of the benchmark scripts (run them from the repository root)."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import random
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def device_line() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    return f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads (torch {torch.__version__})"


def commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        return "unknown"


def random_prompts(count: int, low: int, high: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Random token-id prompts with lengths uniform in [low, high] (ids avoid the special tokens)."""
    rng = random.Random(seed)
    return [
        [rng.randrange(100, vocab) for _ in range(rng.randint(low, high))] for _ in range(count)
    ]


# Real model shapes for random-weight (load_format='dummy') GPU benchmarks.
SHAPES = {
    "smollm2-135m": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
    ),
    "llama-3.1-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
    ),
}  # fmt: skip


def head_dim(config: dict) -> int:
    """A model config's (or SHAPES entry's) attention head size."""
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def shape_folder(name: str, tokenizer_folder: Path | None = None) -> Path:
    """A folder with config.json and a tokenizer: enough for load_format='dummy'. The tokenizer
    comes from `tokenizer_folder`, else the folder named by RADIXLM_BENCH_TOKENIZER, else the
    embedded default model."""
    if tokenizer_folder is None and os.environ.get("RADIXLM_BENCH_TOKENIZER"):
        tokenizer_folder = Path(os.environ["RADIXLM_BENCH_TOKENIZER"])
    if tokenizer_folder is None:
        from radixlm.runtime.config import default_cache_dir
        from radixlm.runtime.model_loader import resolve_model_folder

        tokenizer_folder = resolve_model_folder(None, default_cache_dir())
    out = Path(tempfile.mkdtemp(prefix=f"radixlm-{name}-"))
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5,
           "max_position_embeddings": 16384, "bos_token_id": 1, "eos_token_id": 2, **SHAPES[name]}  # fmt: skip
    (out / "config.json").write_text(json.dumps(cfg))
    from radixlm.runtime.model_loader import copy_tokenizer_files

    copy_tokenizer_files(tokenizer_folder, out)
    return out


def random_hf_model(folder: Path):
    """transformers' own model for a shape folder, random weights, bf16, on the GPU (the baseline
    of the GPU benchmarks)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            return AutoModelForCausalLM.from_config(config).eval()
    finally:
        torch.set_default_dtype(torch.float32)


def offline_gpu_workload(
    requests: int,
    prompt_lens: tuple[int, int] = (100, 400),
    output_lens: tuple[int, int] = (100, 300),
) -> tuple[list[list[int]], list[dict]]:
    """The GPU offline workload: prompts of 100-400 random tokens, 100-300 new tokens each (or
    the spans given), greedy, EOS ignored (so every request produces exactly its length)."""
    rng = random.Random(0)
    prompts = random_prompts(requests, *prompt_lens, 32000, seed=3)
    params = [
        {"max_new_tokens": rng.randint(*output_lens), "temperature": 0, "ignore_eos": True}
        for _ in prompts
    ]
    return prompts, params


def copy_bandwidth() -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    import time

    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 20 / (time.perf_counter() - t)


@contextlib.contextmanager
def cuda_event_spans(owner: type, method: str, note: Callable[..., Any] | None = None):
    """While active, every call of `owner.method` is bracketed by CUDA events recorded on the
    current stream; yields the list the (start, end, note) triples go into (read them after a
    sync): `note(*args, **kwargs)` of the call, None without `note`."""
    spans: list[tuple[torch.cuda.Event, torch.cuda.Event, Any]] = []
    real = getattr(owner, method)

    def timed(*args, **kwargs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = real(*args, **kwargs)
        end.record()
        spans.append((start, end, note(*args, **kwargs) if note is not None else None))
        return result

    setattr(owner, method, timed)
    try:
        yield spans
    finally:
        setattr(owner, method, real)
        torch.cuda.synchronize()


def write_tiny_llama(out: Path, tokenizer_folder: str | Path | None = None) -> Path:
    """The tests' tiny random Llama (2 layers, hidden 64, seed 0) with the tokenizer of
    `tokenizer_folder` (default: the embedded default model's), saved in `out`: for mechanics,
    not for quality."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from radixlm.runtime.model_loader import copy_tokenizer_files

    if tokenizer_folder is None:
        from radixlm.runtime.config import default_cache_dir
        from radixlm.runtime.model_loader import resolve_model_folder

        tokenizer_folder = resolve_model_folder(None, default_cache_dir())
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        eos_token_id=2, bos_token_id=1, tie_word_embeddings=True,
    )  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(out)
    copy_tokenizer_files(tokenizer_folder, out)
    return out


# what each of the engine's device kernels is, by its name: (group, name fragments), first match
# wins; the Triton kernels by their function names (kernels/*.py), the rest by what the libraries
# call theirs. Anything unmatched is "other". (For the Triton attention backend, the GPU's: with
# torch's attention its softmax would count as sampling.)
KERNEL_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention, decode rows", ("_decode_partial_kernel", "_decode_merge_kernel")),
    ("attention, prompt rows", ("_extend_kernel", "flash", "fmha", "attention")),
    ("Triton GEMV, INT4 matmul", ("_gemv_kernel", "_sum_splits_kernel", "_grouped_gemm_kernel")),
    ("matmul (cuBLAS)", ("gemm", "xmma", "nvjet", "cutlass", "cublas", "splitkreduce")),
    (
        "norm, rotary, SiLU, KV store",
        (
            "_rms_norm_kernel",
            "_rope",
            "_silu_and_mul_kernel",
            "_fp8_rows_kernel",
            "_decode_inputs_kernel",
        ),
    ),
    (
        "sampling",
        (
            "_sample_kernel",
            "_argmax",
            "_apply_bitmask_kernel",
            "argmax",
            "topk",
            "softmax",
            "sort",
            "multinomial",
        ),
    ),
    ("copies and fills", ("memcpy", "memset", "copy", "fill", "index", "scatter", "gather", "cat")),
)


def kernel_group(name: str) -> str:
    low = name.lower()
    for group, fragments in KERNEL_GROUPS:
        if any(f.lower() in low for f in fragments):
            return group
    return "other"


def union_length(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals (in the intervals' own unit)."""
    covered, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            covered += b - max(a, end)
            end = b
    return covered


def kernel_breakdown(
    kernels: list[tuple[str, float, float]],
) -> tuple[dict[str, tuple[int, float]], list[tuple[str, int, float]], float]:
    """From (name, start, end) of each device kernel or copy: per group of KERNEL_GROUPS,
    (count, summed time); every name's (name, count, summed time), the largest first; and the
    time the device was busy with any of them (their union: kernels of two streams may overlap)."""
    groups: dict[str, list[float]] = {}
    names: dict[str, list[float]] = {}
    for name, start, end in kernels:
        for table, key in ((groups, kernel_group(name)), (names, name)):
            entry = table.setdefault(key, [0, 0.0])
            entry[0] += 1
            entry[1] += end - start
    by_group = {g: (int(c), t) for g, (c, t) in sorted(groups.items(), key=lambda kv: -kv[1][1])}
    by_name = sorted(((n, int(c), t) for n, (c, t) in names.items()), key=lambda r: -r[2])
    return by_group, by_name, union_length([(s, e) for _, s, e in kernels])
