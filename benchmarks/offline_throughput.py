"""Offline generation throughput: radixlm against Hugging Face transformers, same weights, same
prompts, same machine, one run.

    python -m benchmarks.offline_throughput [--model-path P] [--batch 64] [--new-tokens 64]

Two workloads: batch 1 (decode speed: a short prompt, many new tokens) and a batch of prompts of
mixed lengths generated all at once (transformers pads them to the longest; radixlm batches them
continuously without padding). EOS is ignored so both produce exactly the same number of tokens.
"""

from __future__ import annotations

import argparse
import time

import torch

import radixlm
from benchmarks.common import commit, device_line, random_prompts


def time_ours(engine, prompts, new_tokens):
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    engine.generate(
        input_ids=prompts[0][:8], sampling_params={**params, "max_new_tokens": 4}
    )  # warm-up
    t = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    wall = time.perf_counter() - t
    assert all(len(o["output_ids"]) == new_tokens for o in outs)
    return wall


@torch.inference_mode()
def time_hf(model, prompts, new_tokens, pad_id):
    """transformers' generate over one left-padded batch."""
    longest = max(map(len, prompts))
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p) :] = torch.tensor(p)
        mask[i, longest - len(p) :] = 1
    kwargs = {"do_sample": False, "pad_token_id": pad_id, "eos_token_id": None}
    model.generate(
        ids[:1, -8:], attention_mask=mask[:1, -8:], max_new_tokens=4, min_new_tokens=4, **kwargs
    )
    t = time.perf_counter()
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs
    )
    wall = time.perf_counter() - t
    assert out.shape[1] == longest + new_tokens
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct"
    )
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=128)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    engine = radixlm.Engine(
        args.model_path, disable_radix_cache=True
    )  # no prefix reuse: a fair fight
    hf = (
        AutoModelForCausalLM.from_pretrained(str(engine.model_folder), dtype=engine.dtype)
        .to(engine.device)
        .eval()
    )
    vocab = engine.model_config.vocab_size
    pad = engine.tokenizer.pad_token_id or 0
    print(f"device: {device_line()}  commit: {commit()}  model: {engine.model_folder.name}")

    rows = []
    single = random_prompts(1, 32, 32, vocab, seed=1)
    ours = time_ours(engine, single, args.decode_tokens)
    theirs = time_hf(hf, single, args.decode_tokens, pad)
    rows.append((f"batch 1, 32 in / {args.decode_tokens} out", args.decode_tokens, ours, theirs))

    mixed = random_prompts(args.batch, args.min_len, args.max_len, vocab, seed=2)
    ours = time_ours(engine, mixed, args.new_tokens)
    theirs = time_hf(hf, mixed, args.new_tokens, pad)
    label = f"batch {args.batch}, {args.min_len}-{args.max_len} in / {args.new_tokens} out"
    rows.append((label, args.batch * args.new_tokens, ours, theirs))
    engine.shutdown()

    print("\n| workload | radixlm out tok/s | transformers out tok/s | ratio |\n|---|---|---|---|")
    for label, tokens, ours, theirs in rows:
        print(f"| {label} | {tokens / ours:.1f} | {tokens / theirs:.1f} | {theirs / ours:.2f}x |")


if __name__ == "__main__":
    main()
