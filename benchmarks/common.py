"""Shared helpers of the benchmark scripts (run them from the repository root)."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import random
import subprocess
import tempfile
from pathlib import Path

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
def cuda_event_spans(owner: type, method: str):
    """While active, every call of `owner.method` is bracketed by CUDA events recorded on the
    current stream; yields the list the (start, end) pairs go into (read them after a sync)."""
    pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    real = getattr(owner, method)

    def timed(*args, **kwargs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = real(*args, **kwargs)
        end.record()
        pairs.append((start, end))
        return result

    setattr(owner, method, timed)
    try:
        yield pairs
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
