"""Batch-1 decode speed on the GPU: radixlm against transformers (eager, and static cache + compile),
random weights of real model shapes, bf16, in one run; with the achieved weight-read bandwidth
against the measured copy bandwidth (at batch 1 every step reads the weights once, so bytes /
bandwidth is the floor; an untied input embedding counts one row, as a step reads only that). The
headline rate counts the prompt step (a 32-token prompt) with the decode steps; the last column
leaves it out.

    python -m benchmarks.decode_latency [--shapes smollm2-135m,llama-3.1-8b] [--new-tokens 128]
        [--ablate fused,gemv,...] [--no-hf-compiled] [--quantization fp8,w4a16 [--quant-ablate half]]

With --quantization, radixlm also runs each scheme on the same shape (the weights quantized at
load from the same random bf16 ones), with bf16 in the same run: each one's weight bytes a step
(float8 weights and their scales; the LM head and norms in bf16), its bandwidth floor and its rate;
--quant-ablate runs each scheme again without each named switch (half: the GEMV's float16-operand
tiles), in the same run.
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import torch

from benchmarks.common import commit, copy_bandwidth, device_line, random_hf_model, shape_folder


def bytes_read_per_step(model) -> int:
    """The weight bytes a batch-1 decode step reads: every parameter once (`parameters()` lists
    a tied embedding once), except an input embedding of its own, of which a step reads one row."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    if head is None or head.weight is not embed:
        total -= embed.numel() * embed.element_size() - embed.shape[1] * embed.element_size()
    return total


@torch.inference_mode()
def hf_eager_tok_s(folder: Path, prompt: list[int], new_tokens: int) -> tuple[float, int]:
    model = random_hf_model(folder)
    weight_bytes = bytes_read_per_step(model)
    ids = torch.tensor([prompt], device="cuda")
    kw = {
        "do_sample": False,
        "min_new_tokens": new_tokens,
        "max_new_tokens": new_tokens,
        "eos_token_id": None,
        "pad_token_id": 0,
    }
    model.generate(ids, **{**kw, "min_new_tokens": 8, "max_new_tokens": 8})
    torch.cuda.synchronize()
    t = time.perf_counter()
    model.generate(ids, **kw)
    torch.cuda.synchronize()
    rate = new_tokens / (time.perf_counter() - t)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return rate, weight_bytes


ABLATIONS = {
    "fused": "RADIXLM_DISABLE_FUSED",  # every fused kernel (norm, rope, SiLU, and into the GEMV)
    "gemv": "RADIXLM_DISABLE_GEMV",  # no start-up tuning: cuBLAS and separate kernels
    "fusedgemv": "RADIXLM_DISABLE_FUSED_GEMV",  # only the norm / SiLU fused into the GEMV
    "ropestore": "RADIXLM_DISABLE_FUSED_ROPE_STORE",  # only rope fused into the KV store
    "pdl": "RADIXLM_DISABLE_PDL",  # each Triton kernel launched after the last ends (Hopper on)
    "half": "RADIXLM_DISABLE_HALF_TILES",  # no float16-operand tiles over float8 / INT4 weights
}


def engine_bytes_per_step(model) -> int:
    """`bytes_read_per_step` for radixlm's own model (what a quantized one stores: float8 weights
    and their scales): every parameter once, an untied input embedding one row."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed_tokens.weight
    if model.lm_head.weight is not embed:
        total -= (embed.numel() - embed.shape[1]) * embed.element_size()
    return total


def ours_tok_s(
    folder: Path, prompt: list[int], new_tokens: int, without: str = "", **engine_kwargs
) -> tuple[float, float]:
    """radixlm's batch-1 rate, the prompt step included, and the rate of its decode steps alone
    ((new_tokens - 1) over the time beyond a one-token call's, the fastest of three of those);
    `without` names an optimization to switch off (see ABLATIONS); `engine_kwargs` more engine
    options (quantization). The engine's weight bytes a step go to `ours_tok_s.weight_bytes`."""
    import os

    import radixlm

    if without:
        os.environ[ABLATIONS[without]] = "1"
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    with radixlm.Engine(
        str(folder), load_format="dummy", max_running_requests=64, **engine_kwargs
    ) as eng:
        ours_tok_s.weight_bytes = engine_bytes_per_step(eng.model)
        eng.generate(input_ids=prompt, sampling_params={**params, "max_new_tokens": 8})
        first = []
        for _ in range(3):
            t = time.perf_counter()
            eng.generate(input_ids=prompt, sampling_params={**params, "max_new_tokens": 1})
            first.append(time.perf_counter() - t)
        t = time.perf_counter()
        eng.generate(input_ids=prompt, sampling_params=params)
        wall = time.perf_counter() - t
    if without:
        os.environ.pop(ABLATIONS[without])
    gc.collect()
    torch.cuda.empty_cache()
    return new_tokens / wall, (new_tokens - 1) / (wall - min(first))


def hf_compiled_tok_s(folder: Path, prompt: list[int], new_tokens: int) -> float:
    """transformers with a static KV cache, its fastest batch-1 configuration: on CUDA `generate`
    compiles the decode forward itself (fullgraph, mode reduce-overhead: CUDA graphs). Wrapping
    `model.forward` in torch.compile on top of that, as this once did, failed on the H200 with a
    CUDA-graph output overwritten between invocations."""
    model = random_hf_model(folder)
    ids = torch.tensor([prompt], device="cuda")
    kw = {"do_sample": False, "min_new_tokens": new_tokens, "max_new_tokens": new_tokens,
          "eos_token_id": None, "pad_token_id": 0, "cache_implementation": "static"}  # fmt: skip
    try:
        with torch.inference_mode():
            for _ in range(3):  # compile, capture, then once more to be sure it settled
                model.generate(ids, **kw)
            torch.cuda.synchronize()
            t = time.perf_counter()
            model.generate(ids, **kw)
            torch.cuda.synchronize()
        return new_tokens / (time.perf_counter() - t)
    finally:
        del model
        gc.collect()
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shapes", default="smollm2-135m,llama-3.1-8b")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument(
        "--no-hf-compiled", action="store_true", help="skip transformers' static cache + compile"
    )
    ap.add_argument(
        "--ablate",
        default="fused,gemv,fusedgemv,ropestore,pdl",
        help="also run without each of these",
    )
    ap.add_argument(
        "--quantization",
        default="",
        help="also run radixlm with these schemes (comma-separated: fp8, w4a16)",
    )
    ap.add_argument(
        "--quant-ablate",
        default="",
        help="with --quantization: also run each scheme without each of these (e.g. half)",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_latency measures GPU decode speed: no CUDA device here")
    bw = copy_bandwidth()
    print(f"device: {device_line()}  commit: {commit()}  copy bandwidth: {bw / 1e12:.2f} TB/s")
    prompt = list(range(1000, 1032))
    ablate = [a for a in args.ablate.split(",") if a]
    schemes = [q for q in args.quantization.split(",") if q]
    quant_ablate = [a for a in args.quant_ablate.split(",") if a]
    unknown = set(ablate + quant_ablate) - set(ABLATIONS)
    if unknown:
        raise SystemExit(f"no switch {sorted(unknown)}; the switches: {list(ABLATIONS)}")
    rows, quant_rows = [], []
    for name in args.shapes.split(","):
        folder = shape_folder(name)
        hf, weight_bytes = hf_eager_tok_s(folder, prompt, args.new_tokens)
        compiled, missing = None, "not run"  # (missing: what the table says without a rate)
        if not args.no_hf_compiled:
            try:
                compiled = hf_compiled_tok_s(folder, prompt, args.new_tokens)
            except Exception as e:  # a baseline that breaks is reported, not fatal to ours
                print(f"transformers static+compile failed: {type(e).__name__}: {e}", flush=True)
                missing = "failed"
        without = [ours_tok_s(folder, prompt, args.new_tokens, a)[0] for a in ablate]
        ours, decode_only = ours_tok_s(folder, prompt, args.new_tokens)
        floor = bw / weight_bytes  # tokens/s if each step only read the weights at copy speed
        rows.append((name, ours, decode_only, without, hf, compiled, missing, floor, weight_bytes))
        print(rows[-1], flush=True)
        if schemes:
            quant_rows.append((name, "bf16", ours, decode_only, ours_tok_s.weight_bytes, None))
        for scheme in schemes:
            # (each switch off, then all on: the A/B on one machine, minutes apart at most)
            off = [
                ours_tok_s(folder, prompt, args.new_tokens, a, quantization=scheme)[0]
                for a in quant_ablate
            ]
            rate, alone = ours_tok_s(folder, prompt, args.new_tokens, quantization=scheme)
            quant_rows.append((name, scheme, rate, alone, ours_tok_s.weight_bytes, off))
            print(quant_rows[-1], flush=True)
    cols = "".join(f" without {a} |" for a in ablate)
    print(
        f"\n| shape | radixlm tok/s |{cols} HF eager | HF static+compile | "
        "radixlm / best HF | GB read a step | bandwidth floor tok/s | radixlm of floor | "
        "radixlm decode steps alone (of floor) |"
    )
    print("|---|---|" + "---|" * len(ablate) + "---|---|---|---|---|---|---|")
    for name, ours, decode_only, without, hf, compiled, missing, floor, wb in rows:
        best = max(hf, compiled or 0)
        comp = missing if compiled is None else f"{compiled:.1f}"
        ab = "".join(f" {w:.1f} |" for w in without)
        print(
            f"| {name} | {ours:.1f} |{ab} {hf:.1f} | {comp} | {ours / best:.2f}x | "
            f"{wb / 1e9:.2f} | {floor:.0f} | {ours / floor:.1%} | "
            f"{decode_only:.1f} ({decode_only / floor:.1%}) |"
        )
    if quant_rows:
        cols = "".join(f" without {a}: tok/s (all on over that) |" for a in quant_ablate)
        print(
            "\n| shape | weights | radixlm tok/s | GB read a step | bandwidth floor tok/s | "
            f"radixlm of floor | decode steps alone (of floor) | vs bf16 |{cols}\n"
            "|---|---|---|---|---|---|---|---|" + "---|" * len(quant_ablate)
        )
        base = {row[0]: row[2] for row in quant_rows if row[1] == "bf16"}
        for name, scheme, rate, alone, wb, off in quant_rows:
            floor = bw / wb
            if off is None:  # (bf16: the switches are the quantized layers')
                ab = " - |" * len(quant_ablate)
            else:
                ab = "".join(f" {o:.1f} ({rate / o:.2f}x) |" for o in off)
            print(
                f"| {name} | {scheme} | {rate:.1f} | {wb / 1e9:.2f} | {floor:.0f} | "
                f"{rate / floor:.1%} | {alone:.1f} ({alone / floor:.1%}) | "
                f"{rate / base[name]:.2f}x |{ab}"
            )


if __name__ == "__main__":
    main()
