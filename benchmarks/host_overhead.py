"""The engine's host cost per request per step, with the model replaced by a stub.

    python -m benchmarks.host_overhead [--requests 512] [--new-tokens 100]

At large batches on a GPU the step is bounded by Python bookkeeping (scheduling, sampling rows,
applying tokens), not by the device. Here the model returns fixed logits at once, so the wall time
is all host work: the decode steps go through the CUDA-graph code path run eagerly (no GPU needed).
Prints microseconds per request per step; compare commits on the same machine.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

import radixlm
from benchmarks.common import commit, device_line, shape_folder
from radixlm.runtime.cuda_graph import DecodeGraphs


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=100)
    ap.add_argument("--prompt-len", type=int, default=300)
    args = ap.parse_args()
    n = args.requests
    eng = radixlm.Engine(
        str(shape_folder("smollm2-135m")), load_format="dummy", disable_radix_cache=True,
        max_running_requests=n, max_total_tokens=n * 420, device="cpu",
    )  # fmt: skip
    runner = eng._core.runner
    logits = torch.randn(n, 1000)
    runner.model = lambda batch, backend: logits[
        : batch.num_tokens if batch.logits_indices is None else len(batch.logits_indices)
    ]
    runner.graphs = DecodeGraphs(
        runner.model, runner.backend, runner.req_to_token, runner.token_buf, n, capture=False
    )
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 30000) for _ in range(args.prompt_len)] for _ in range(n)]
    params = {"max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True}
    t = time.perf_counter()
    eng.generate(input_ids=prompts, sampling_params=params)
    wall = time.perf_counter() - t
    steps = eng.get_stats()["num_steps"]
    eng.shutdown()
    print(f"device: {device_line()}  commit: {commit()}")
    print(f"{n} requests x {args.new_tokens} tokens: {wall:.2f} s, {steps} steps")
    print(f"host cost: {1e6 * wall / (n * args.new_tokens):.1f} us per request per step")


if __name__ == "__main__":
    main()
