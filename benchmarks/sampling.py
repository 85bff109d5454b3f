"""Sampling on the GPU: runtime/sampler.py's torch path against the fused kernel of
kernels/sampling.py, in the same run, for batch sizes x vocabularies x filter settings.

Each cell times `Sampler.sample_ids` end to end (the host work of building the per-row parameters
included), median of triton.testing.do_bench, which clears the L2 cache before every call, so the
logits come from device memory as they do after a forward. The floor is reading the logits once
(B x V x 4 bytes) at the measured copy bandwidth. The logits are random normals times 3 (a flatter
distribution than a trained model's: top-p keeps more tokens, and the bisection has more of them
near its threshold).

    python -m benchmarks.sampling [--batches 1,64,256] [--vocabs 49152,128256]
"""

from __future__ import annotations

import argparse
import os

import torch

from benchmarks.common import commit, copy_bandwidth, device_line

FILTERS = {
    "temperature only": dict(temperature=0.8),
    "top-k 50": dict(temperature=0.8, top_k=50),
    "top-p 0.9": dict(temperature=0.8, top_p=0.9),
    "min-p 0.05": dict(temperature=0.8, min_p=0.05),
    "all": dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05),
}


def sample_ms(logits: torch.Tensor, rows: list, fused: bool) -> float:
    from triton.testing import do_bench

    from radixlm.runtime.sampler import Sampler

    sampler = Sampler()
    if fused:
        os.environ.pop("RADIXLM_DISABLE_FUSED", None)
    else:
        os.environ["RADIXLM_DISABLE_FUSED"] = "1"
    try:
        return do_bench(lambda: sampler.sample_ids(logits, rows), return_mode="median")
    finally:
        os.environ.pop("RADIXLM_DISABLE_FUSED", None)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--vocabs", default="49152,128256")
    ap.add_argument("--filters", default=",".join(FILTERS), help="names from FILTERS")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit(
            "benchmarks/sampling.py times the CUDA sampling paths: no CUDA device here"
        )
    from radixlm.protocol.sampling_params import SamplingParams
    from radixlm.runtime.sampler import SamplingRow

    bw = copy_bandwidth()
    print(f"device: {device_line()}  commit: {commit()}  copy bandwidth: {bw / 1e12:.2f} TB/s")
    print(
        "\n| batch | vocab | filters | torch ms | fused ms | torch / fused | "
        "floor us (read logits once) | fused / floor |"
    )
    print("|---|---|---|---|---|---|---|---|")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for vocab in [int(v) for v in args.vocabs.split(",")]:
        for batch in [int(b) for b in args.batches.split(",")]:
            logits = torch.randn(batch, vocab, device="cuda", generator=gen) * 3
            floor_us = batch * vocab * 4 / bw * 1e6
            for name in args.filters.split(","):
                params = SamplingParams.from_dict({"max_new_tokens": 16, **FILTERS[name]})
                rows = [
                    SamplingRow(params, seed=i, step=0, input_ids=[1], output_ids=[])
                    for i in range(batch)
                ]
                torch_ms = sample_ms(logits, rows, fused=False)
                fused_ms = sample_ms(logits, rows, fused=True)
                print(
                    f"| {batch} | {vocab} | {name} | {torch_ms:.3f} | {fused_ms:.3f} | "
                    f"{torch_ms / fused_ms:.1f}x | {floor_us:.2f} | {fused_ms * 1e3 / floor_us:.0f}x |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
