"""The default model's GGUF run as stored (`quantization="gguf"`) against its float32
dequantization (`quantization="none"`, what a GGUF ran as before) on the CPU at batch 1, in one
run; with llama.cpp's own `llama-bench` on the same file and threads when given its path.

    python -m benchmarks.gguf_cpu [--threads 2] [--new-tokens 128] [--rounds 3] [--prompts 20]
        [--llama-bench PATH]

Both engines are loaded side by side and measured in turns, `--rounds` times (llama-bench, if
given, in the same turns), the best round of each kept: other work on a shared machine slows a
round, never speeds one up. A rate is `--new-tokens` greedy tokens after a short prompt at batch
1: "decode" counts the decode steps alone ((new - 1) tokens over the time past the first token,
as llama-bench's tg test counts its generation), "with prompt" the whole call. The gguf engine is
measured twice a round: as it runs (a decode step in one call of the kernels,
runtime/quantization/gguf.py FusedDecode) and layer by layer (that call switched off), the
model's own forward. Then greedy agreement: the first 32 tokens of `--prompts` prompts
(tests/prompts.py, `--prompts 100` for the full check), each prompt alone (batch 1, the step
that runs in one call), from each engine, equal or not. The load average is printed before and
after.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import time

import torch

import radixlm
from benchmarks.common import commit, device_line
from radixlm.runtime.model_loader import default_model_path
from tests.prompts import hundred_prompts

AGREEMENT_TOKENS = 32


def weight_bytes(eng) -> int:
    """The bytes of the model's parameters (a tied embedding once)."""
    return sum(p.numel() * p.element_size() for p in eng.model.parameters())


def step_bytes(eng) -> int:
    """The weight bytes a batch-1 decode step reads: all of them but an embedding's of its own,
    of which one row is read (a GGUF's tied embedding is the LM head's blocks, read whole)."""
    model = eng.model
    embed = getattr(model.embed_tokens, "weight", None)
    total = weight_bytes(eng)
    if embed is not None and model.lm_head.weight is not embed:
        total -= (embed.numel() - embed.shape[1]) * embed.element_size()
    return total


def rates(eng, prompt: str, new_tokens: int, batch: int = 1) -> tuple[float, float]:
    """(tok/s of the decode steps alone, tok/s of the whole call) for one generation of `batch`
    copies of the prompt at once."""
    prompt = [prompt] * batch if batch > 1 else prompt
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    first = []
    for _ in range(2):
        t = time.perf_counter()
        eng.generate(prompt, sampling_params={**params, "max_new_tokens": 1})
        first.append(time.perf_counter() - t)
    t = time.perf_counter()
    eng.generate(prompt, sampling_params=params)
    wall = time.perf_counter() - t
    return batch * (new_tokens - 1) / (wall - min(first)), batch * new_tokens / wall


def read_rate(threads: int) -> float:
    """Bytes a second this machine's memory gives a plain read (torch summing 400 MB of float32
    on `threads` threads, best of 5): the bandwidth that bounds a batch-1 step."""
    torch.set_num_threads(threads)
    a = torch.ones(100_000_000)
    a.sum()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t)
    return a.numel() * a.element_size() / best


def llama_bench(path: str, gguf: str, threads: int, new_tokens: int) -> float:
    out = subprocess.run(
        [path, "-m", gguf, "-t", str(threads), "-n", str(new_tokens), "-p", "0", "-r", "1",
         "-o", "json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    rows = json.loads(out.stdout)
    return float(rows[-1]["avg_ts"])


def greedy(eng, prompts: list[str]) -> list[list[int]]:
    """Each prompt's first AGREEMENT_TOKENS greedy tokens, one prompt at a time (batch 1)."""
    params = {"max_new_tokens": AGREEMENT_TOKENS, "temperature": 0, "ignore_eos": True}
    return [eng.generate(p, params)["output_ids"] for p in prompts]


@contextlib.contextmanager
def layer_by_layer():
    """The gguf engine's decode steps as the model's forward, layer by layer (the ablation)."""
    from radixlm.runtime.quantization.gguf import FusedDecode

    FusedDecode.enabled = False
    try:
        yield
    finally:
        FusedDecode.enabled = True


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--batch", type=int, default=1,
        help="requests decoding together (llama-bench's tg test, batch 1, runs at 1 only)",
    )  # fmt: skip
    ap.add_argument("--prompts", type=int, default=20, help="greedy agreement on this many")
    ap.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench binary")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gguf = default_model_path()
    print(f"device: {device_line()}  commit: {commit()}")
    print(f"model: {os.path.basename(gguf)}  load before: {os.getloadavg()}", flush=True)
    kw = {"device": "cpu", "max_total_tokens": 8192}
    names_gguf = "gguf (quantization='gguf')"
    engines = {
        "float32 (quantization='none')": radixlm.Engine(quantization="none", **kw),
        names_gguf: radixlm.Engine(quantization="gguf", **kw),
    }
    layers_name = "gguf, layer by layer (the one-call step off)"
    runs = [(name, eng, contextlib.nullcontext) for name, eng in engines.items()]
    runs.append((layers_name, engines[names_gguf], layer_by_layer))
    prompt = "Tell me a long story about a lighthouse keeper."
    best: dict[str, tuple[float, float]] = {}
    llama = None
    equal, prompts = 0, []
    try:
        for eng in engines.values():  # warm-up
            rates(eng, prompt, 8)
        for r in range(args.rounds):
            for name, eng, how in runs:
                with how():
                    got = rates(eng, prompt, args.new_tokens, args.batch)
                print(f"round {r}: {name}: decode {got[0]:.1f} tok/s, with prompt {got[1]:.1f}")
                best[name] = max(best.get(name, (0.0, 0.0)), got)
            if args.llama_bench and args.batch == 1:
                ts = llama_bench(args.llama_bench, gguf, args.threads, args.new_tokens)
                print(f"round {r}: llama-bench tg{args.new_tokens}: {ts:.1f} tok/s", flush=True)
                llama = max(llama or 0.0, ts)
        prompts = hundred_prompts()[: args.prompts]
        outs = {name: greedy(eng, prompts) for name, eng in engines.items()}
        want, got = outs.values()
        equal = sum(a == b for a, b in zip(want, got))
        sizes = {name: (weight_bytes(eng), step_bytes(eng)) for name, eng, _ in runs}
    finally:
        for eng in engines.values():
            eng.shutdown()
    print(f"load after: {os.getloadavg()}")
    print(
        f"\n| engine ({args.threads} threads, batch {args.batch}, {args.new_tokens} new tokens) | decode "
        "tok/s | with prompt tok/s | weights MB | MB read a step |"
    )
    print("|---|---|---|---|---|")
    for name, (dec, whole) in best.items():
        w, s = sizes[name]
        print(f"| radixlm {name} | {dec:.1f} | {whole:.1f} | {w / 1e6:.0f} | {s / 1e6:.0f} |")
    if llama is not None:
        print(f"| llama.cpp llama-bench tg{args.new_tokens} | {llama:.1f} | - | - | - |")
    f32, ours, layers = (best[name][0] for name in best)
    rate = read_rate(args.threads)
    floor_ms = sizes[names_gguf][1] / rate * 1e3
    if args.batch == 1:  # (a step's time is a token's at batch 1 only)
        print(
            f"\nbound: the gguf step reads {sizes[names_gguf][1] / 1e6:.0f} MB; at {rate / 1e9:.1f} GB/s "
            f"(a plain read here) that is {floor_ms:.2f} ms, {1e3 / floor_ms:.0f} tok/s; the step takes "
            f"{1e3 / ours:.2f} ms ({floor_ms * ours / 1e3:.0%} of the bound's rate)"
        )
    print(f"\ngguf / float32 (decode): {ours / f32:.2f}x; one-call step / layer by layer: "
          f"{ours / layers:.2f}x")  # fmt: skip
    if llama is not None:
        print(f"gguf / llama.cpp (decode): {ours / llama:.2f}x")
    if prompts:
        print(
            f"greedy agreement ({AGREEMENT_TOKENS} tokens, batch 1) with float32: "
            f"{equal}/{len(prompts)} prompts equal"
        )


if __name__ == "__main__":
    main()
