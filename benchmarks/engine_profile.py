"""Where the engine thread's time goes during the offline GPU workload (cProfile of that thread).

    python -m benchmarks.engine_profile --shape smollm2-135m [--top 35]

The workload of `benchmarks.offline_throughput --shape S --max-running 512`: 1,000 requests, prompts
of 100-400 tokens, 100-300 new tokens each, random weights. Prints the wall time, the steps and the
functions that took the most time on the engine thread (the warm-up included). Time in `Event.synchronize` is the host
waiting for the GPU; the rest is host work the GPU may be waiting for.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

import radixlm
from benchmarks.common import device_line, offline_gpu_workload, shape_folder
from radixlm.runtime import engine_core


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--top", type=int, default=35)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("engine_profile profiles the GPU workload: no CUDA device here")
    prof = cProfile.Profile()
    loop = engine_core.EngineCore._loop

    def profiled_loop(self) -> None:
        prof.enable()
        try:
            loop(self)
        finally:
            prof.disable()

    engine_core.EngineCore._loop = profiled_loop
    folder = shape_folder(args.shape)
    prompts, params = offline_gpu_workload(1000)
    with radixlm.Engine(
        str(folder), load_format="dummy", disable_radix_cache=True,
        max_running_requests=512, cuda_graph_max_bs=512,
    ) as eng:  # fmt: skip
        eng.generate(input_ids=prompts[:64], sampling_params=params[:64])  # warm-up
        before = eng.get_stats()
        t = time.perf_counter()
        eng.generate(input_ids=prompts, sampling_params=params)
        wall = time.perf_counter() - t
        after = eng.get_stats()
    print(f"device: {device_line()}  shape: {args.shape}")
    steps = after["num_steps"] - before["num_steps"]
    graph = after["graph_steps"] - before["graph_steps"]
    print(f"wall {wall:.2f} s (profiled), {steps} steps, {graph} replayed from graphs")
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
    print(out.getvalue())


if __name__ == "__main__":
    main()
