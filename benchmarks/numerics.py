"""Greedy agreement of half-precision runs with the float32 CPU path, on the real default model:
of 100 prompts (the end-to-end tests'), how many give the same first 32 (and 16) greedy tokens.

    python -m benchmarks.numerics [--device cpu] [--dtypes bfloat16,float16] [--what-if]

The reference is the CPU in float32. Each dtype runs on `--device` as shipped (the LM head's logits
in float32, `runtime.layers.float32_linear`). With `--what-if` (torch path only, so on the CPU) two
variants run as well, in the same run:

- `logits rounded`: the LM head's output rounded to the dtype before float32, as before
  2026-11-30: what computing the logits in float32 changed.
- `+ float32 residual`: also the residual stream kept in float32 between layers (each norm adds
  in float32 and rounds only its output), emulated by patching the torch RMSNorm; not shipped (the
  fused kernels keep the residual in the model's dtype): what it would add.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
import torch.nn.functional as F

import radixlm
from benchmarks.common import commit, device_line
from radixlm.runtime import layers
from tests.prompts import hundred_prompts

TOKENS = 32


@contextlib.contextmanager
def rounded_logits():
    real = layers.float32_linear
    layers.float32_linear = lambda x, linear: F.linear(x, linear.weight, linear.bias).float()
    try:
        yield
    finally:
        layers.float32_linear = real


@contextlib.contextmanager
def float32_residual():
    real = layers.RMSNorm.forward

    def forward(self, x, residual=None):
        if residual is not None:
            x = x.float() + residual.float()
            residual = x
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(self.weight.dtype)
        out = self.weight * h
        return out if residual is None else (out, residual)

    layers.RMSNorm.forward = forward
    try:
        yield
    finally:
        layers.RMSNorm.forward = real


def greedy(device: str, dtype: str) -> tuple[list[list[int]], float]:
    params = {"max_new_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    t = time.perf_counter()
    with radixlm.Engine(device=device, dtype=dtype) as eng:
        outs = eng.generate(hundred_prompts(), params)
    return [o["output_ids"] for o in outs], time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--what-if", action="store_true", help="also the variants (torch path only)")
    args = ap.parse_args()
    if args.what_if and args.device != "cpu":
        raise SystemExit("--what-if patches the torch path: use it with --device cpu")
    print(f"device: {device_line()}  commit: {commit()}")
    reference, seconds = greedy("cpu", "float32")
    print(f"reference: CPU float32, {seconds:.0f} s", flush=True)
    print(
        f"\n| device | dtype | variant | same {TOKENS} tokens | same first 16 |\n|---|---|---|---|---|"
    )
    for dtype in args.dtypes.split(","):
        variants = [("as shipped: logits in float32", contextlib.nullcontext)]
        if args.what_if:
            variants.append(("logits rounded to the dtype", rounded_logits))
            variants.append(("+ float32 residual (not shipped)", float32_residual))
        for name, patch in variants:
            with patch():
                outs, _ = greedy(args.device, dtype)
            same = sum(a == b for a, b in zip(reference, outs))
            same16 = sum(a[:16] == b[:16] for a, b in zip(reference, outs))
            print(
                f"| {args.device} | {dtype} | {name} | {same} / 100 | {same16} / 100 |", flush=True
            )


if __name__ == "__main__":
    with torch.inference_mode():
        main()
