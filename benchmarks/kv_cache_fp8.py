"""The FP8 KV cache against the model-dtype one, in one run: pool capacity in the same memory, and
decode speed at a large batch over long contexts (random weights of a real shape).

    python -m benchmarks.kv_cache_fp8 [--shape llama-3.1-8b] [--batch 64] [--context 8192]
        [--steps 64] [--mem-fraction 0.85]
    python -m benchmarks.kv_cache_fp8 --shape tiny --batch 2 --context 48 --steps 3   # CPU check

1. **Capacity**: the engine's own sizing (`kv_pool_tokens`) over the device's free memory, for
   `kv_cache_dtype` auto and fp8_e4m3 in turn, each pool then allocated for real (its bytes are
   what the device's allocator handed out: the same memory for both).
2. **Decode**: an engine per KV dtype (`load_format="dummy"`, the same pool size in tokens for
   both; on CUDA the baseline runs before and after the fp8 engine, `--order`), `--batch` requests of `--context` random tokens each. The prompts are computed once and
   cached (the radix cache); then two generations over the cached prompts, of `--steps` tokens
   apart in length, are timed (the fastest of `--repeats` runs each), so their difference is
   `--steps` decode steps of the whole batch (each reading every request's full context) and
   nothing else. With the KV bytes and weight
   bytes a step reads, the achieved bandwidth.
3. **Kernel** (CUDA only): the Triton decode kernel alone over one layer of the shape at the same
   batch and context, slots shuffled over the pool, model-dtype pool against float8 pool, for a
   few key-tile lengths (`block_n`; the engine uses 32, and 128 for a float8 pool): where the
   step's time goes, and whether float8 wants longer tiles.

The table comes last, with the ratios fp8 / auto (targets on the H200, Llama-3.1-8B shape: capacity
>= 1.9x, decode at batch 64 over 8k-token contexts >= 1.3x).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import radixlm
from benchmarks.common import SHAPES, commit, device_line, random_prompts

# a shape for checking the script on the CPU in seconds (the default model's vocabulary)
TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=49152, tie_word_embeddings=True, rope_theta=10000.0,
)  # fmt: skip
KV_DTYPES = ("auto", "fp8_e4m3")


def shape_folder(name: str, context: int) -> Path:
    """A config.json (the shape, a context long enough) beside the default model's tokenizer."""
    from radixlm.runtime.config import default_cache_dir
    from radixlm.runtime.model_loader import copy_tokenizer_files, resolve_model_folder

    shape = TINY if name == "tiny" else SHAPES[name]
    out = Path(tempfile.mkdtemp(prefix=f"radixlm-kvfp8-{name}-"))
    cfg = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5,
        "max_position_embeddings": max(16384, 2 * context), "bos_token_id": 1, "eos_token_id": 2,
        **shape,
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(cfg))
    # (RADIXLM_BENCH_TOKENIZER names a tokenizer folder, as for benchmarks.common.shape_folder)
    tokenizer = os.environ.get("RADIXLM_BENCH_TOKENIZER")
    copy_tokenizer_files(tokenizer or resolve_model_folder(None, default_cache_dir()), out)
    return out


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


@dataclass
class Capacity:
    kv_cache_dtype: str
    tokens: int
    pool_bytes: int  # as allocated (the device's allocator; on the CPU the tensor's bytes)


def capacity(folder: Path, device: torch.device, dtype: torch.dtype, fraction: float):
    """Each KV dtype's pool as the engine sizes it from the free memory now, allocated."""
    from radixlm.runtime.config import EngineConfig
    from radixlm.runtime.engine_core import kv_pool_tokens
    from radixlm.runtime.memory_pool import KVPool
    from radixlm.runtime.model_config import ModelConfig
    from radixlm.runtime.model_loader import load_hf_config

    mc = ModelConfig.from_hf(load_hf_config(folder))
    out = []
    for kv in KV_DTYPES:
        _release()
        # (no cap from requests x context: the memory alone decides)
        config = EngineConfig(
            kv_cache_dtype=kv, mem_fraction_static=fraction, max_running_requests=2**40
        )
        tokens = kv_pool_tokens(config, mc, dtype, device, 1)
        before = _allocated(device)
        pool = KVPool(tokens + 1, mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype, device, kv)
        used = _allocated(device) - before if device.type == "cuda" else pool.nbytes
        out.append(Capacity(kv, tokens, used))
        del pool
    _release()
    return out


@dataclass
class Decode:
    kv_cache_dtype: str
    step_seconds: float
    batch: int
    kv_bytes_per_step: int
    weight_bytes: int

    @property
    def tokens_per_second(self) -> float:
        return self.batch / self.step_seconds

    @property
    def bandwidth(self) -> float:
        return (self.kv_bytes_per_step + self.weight_bytes) / self.step_seconds


def decode(folder: Path, kv: str, args, device: torch.device) -> Decode:
    batch, context, steps = args.batch, args.context, args.steps
    short = 4
    pool_tokens = batch * (context + short + steps + 8) + 64
    prompts = random_prompts(batch, context, context, 32000 if args.shape != "tiny" else 4000, 5)
    params = {"temperature": 0, "ignore_eos": True}
    with radixlm.Engine(
        str(folder), load_format="dummy", device=str(device), kv_cache_dtype=kv,
        max_total_tokens=pool_tokens, max_running_requests=max(batch, 8),
        context_length=context + short + steps + 8,
    ) as eng:  # fmt: skip
        pool = eng._core.kv_pool
        weight_bytes = sum(p.numel() * p.element_size() for p in eng.model.parameters())
        per_token = pool.bytes_per_slot(
            len(pool.k), pool.k[0].shape[1], pool.k[0].shape[2], pool.dtype
        )
        del pool
        eng.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": 1})
        times = {short: float("inf"), short + steps: float("inf")}
        for _ in range(args.repeats):  # (alternating; the fastest of each counts)
            for n in times:
                t0 = time.perf_counter()
                outs = eng.generate(
                    input_ids=prompts, sampling_params={**params, "max_new_tokens": n}
                )
                times[n] = min(times[n], time.perf_counter() - t0)
                if not all(len(o["output_ids"]) == n for o in outs):
                    raise RuntimeError("a request stopped early: the timing would be wrong")
                if min(o["meta_info"]["cached_tokens"] for o in outs) < context - 1:
                    raise RuntimeError("prompts were computed again: the pool is too small")
    del eng, outs  # (the engine's memory back to the device before the next one sizes its pool)
    _release()
    step = (times[short + steps] - times[short]) / steps
    # each step reads, per request, its whole context's K/V (about context + short + steps / 2)
    kv_bytes = batch * (context + short + steps // 2) * per_token
    return Decode(kv, step, batch, kv_bytes, weight_bytes)


def kernel_decode(folder: Path, args, dtype: torch.dtype) -> list[tuple[str, int, float, float]]:
    """(pool, block_n, seconds, K/V bytes) of one layer's decode attention at --batch x --context."""
    from triton.testing import do_bench

    from radixlm.kernels import triton_attention as ta
    from radixlm.kernels.attention_ref import quantize_kv
    from radixlm.runtime.model_config import ModelConfig
    from radixlm.runtime.model_loader import load_hf_config

    mc = ModelConfig.from_hf(load_hf_config(folder))
    batch, length, dev = args.batch, args.context, torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    slots = batch * length + 1
    req_to_token = (torch.randperm(slots - 1, device=dev, generator=gen) + 1).int()
    req_to_token = req_to_token.view(batch, length)
    rows = torch.arange(batch, device=dev)
    seq_lens = torch.full((batch,), length, device=dev)
    q = torch.randn(batch, mc.num_heads, mc.head_dim, device=dev, dtype=dtype, generator=gen)
    shape = (slots, mc.num_kv_heads, mc.head_dim)
    out = []
    for pool_name in (str(dtype).removeprefix("torch."), "fp8_e4m3"):
        k = torch.randn(shape, device=dev, dtype=dtype, generator=gen)
        v = torch.randn(shape, device=dev, dtype=dtype, generator=gen)
        if pool_name == "fp8_e4m3":
            k, v = (
                quantize_kv(k, 1.0, torch.float8_e4m3fn),
                quantize_kv(v, 1.0, torch.float8_e4m3fn),
            )
        splits = ta.default_num_kv_splits(batch, mc.num_kv_heads, dev)
        scratch = ta.alloc_decode_scratch(batch, mc.num_heads, mc.head_dim, splits, dev)
        result = torch.empty_like(q)
        for block_n in (32, 64, 128):
            cfg = ta.TileConfig(block_m=0, block_n=block_n, num_warps=4, num_stages=2)

            def run(cfg=cfg, k=k, v=v, scratch=scratch, result=result):
                ta.decode_attention(
                    q, k, v, req_to_token, rows, seq_lens, mc.head_dim**-0.5, out=result,
                    scratch=scratch, config=cfg,
                )  # fmt: skip

            seconds = do_bench(run, warmup=25, rep=200, return_mode="median") * 1e-3
            out.append((pool_name, block_n, seconds, k.nbytes + v.nbytes))
        del k, v
        _release()
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b", choices=[*SHAPES, "tiny"])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=8192, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each length (fastest)")
    ap.add_argument(
        "--order", default=None,
        help="the decode engines, in turn (default on CUDA auto,fp8_e4m3,auto: an engine that "
        "runs first in a process may run slower, so the baseline runs first and last and its "
        "faster run counts; elsewhere auto,fp8_e4m3)",
    )  # fmt: skip
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--mem-fraction", type=float, default=None,
        help="the share of free memory the capacity pools are sized to (engine default: 0.85 on "
        "a GPU, 0.25 on the CPU)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.order is not None and set(args.order.split(",")) != set(KV_DTYPES):
        ap.error(f"--order lists each of {', '.join(KV_DTYPES)} at least once, and nothing else")
    if args.batch < 1 or args.context < 2 or args.steps < 1 or args.repeats < 1:
        ap.error("--batch, --steps and --repeats must be at least 1, --context at least 2")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    fraction = args.mem_fraction or (0.85 if device.type == "cuda" else 0.25)
    print(f"# kv_cache_fp8: {device_line()}, commit {commit()}", flush=True)
    folder = shape_folder(args.shape, args.context)

    caps = capacity(folder, device, dtype, fraction)
    order = args.order or ("auto,fp8_e4m3,auto" if device.type == "cuda" else "auto,fp8_e4m3")
    runs = [decode(folder, kv, args, device) for kv in order.split(",")]
    speeds = [min((r for r in runs if r.kv_cache_dtype == kv), key=lambda r: r.step_seconds)
              for kv in KV_DTYPES]  # fmt: skip
    kernels = kernel_decode(folder, args, dtype) if device.type == "cuda" else []

    name = str(dtype).removeprefix("torch.")
    print(f"\n{args.shape}, {name} model, {device}")
    print(f"capacity at {fraction:g} of free memory:")
    for c in caps:
        label = name if c.kv_cache_dtype == "auto" else c.kv_cache_dtype
        print(f"  {label:>9}: {c.tokens:>12,} tokens in {c.pool_bytes / 2**30:8.2f} GiB")
    cap_ratio = caps[1].tokens / caps[0].tokens
    print(f"  fp8 / {name}: {cap_ratio:.2f}x the tokens")
    print(f"decode, batch {args.batch}, {args.context}-token contexts, {args.steps} steps timed:")
    if len(runs) > len(KV_DTYPES):
        each = ", ".join(f"{r.kv_cache_dtype} {r.step_seconds * 1e3:.2f}" for r in runs)
        print(f"  (ms/step of each engine, in order: {each}; the faster of a kind counts)")
    for d in speeds:
        label = name if d.kv_cache_dtype == "auto" else d.kv_cache_dtype
        print(
            f"  {label:>9}: {d.step_seconds * 1e3:9.2f} ms/step, {d.tokens_per_second:10.1f} "
            f"tok/s, {d.bandwidth / 1e9:7.1f} GB/s (KV {d.kv_bytes_per_step / 1e9:.2f} GB + "
            f"weights {d.weight_bytes / 1e9:.2f} GB a step)"
        )
    speed_ratio = speeds[1].tokens_per_second / speeds[0].tokens_per_second
    print(f"  fp8 / {name}: {speed_ratio:.2f}x decode tokens/s")
    if kernels:
        print(f"decode kernel alone, one layer, batch {args.batch} x {args.context} keys:")
        for pool_name, block_n, seconds, nbytes in kernels:
            print(
                f"  {pool_name:>9} block_n {block_n:>3}: {seconds * 1e6:9.1f} us, "
                f"{nbytes / seconds / 1e12:5.2f} TB/s of K/V"
            )
    return {
        "capacity": caps,
        "decode": speeds,
        "capacity_ratio": cap_ratio,
        "decode_ratio": speed_ratio,
    }


if __name__ == "__main__":
    main()
