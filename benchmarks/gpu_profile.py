"""Prefill compute efficiency and GPU busy time, on the GPU with random weights of real shapes.

    python -m benchmarks.gpu_profile [--prefill-shape llama-3.1-8b] [--short-shape smollm2-135m]
        [--busy-shape smollm2-135m]

- Prefill: one 8,192-token prompt in one forward (chunked_prefill_size 8192), time to the first
  token, FLOPs counted (2 x parameters x tokens for the matmuls, 2 x layers x hidden x tokens^2 for
  causal attention) against the bf16 matmul rate measured in the same run; and the time to first
  token of a 1,024-token prompt.
- Short prompts: time to the first token of 32-token prompts, alone and 64 at once, with the prompt
  step run eagerly and replayed from a CUDA graph, in the same run.
- Busy: a decode-heavy batch of 64 requests (32-token prompts, 256 new tokens each) under the
  torch profiler, tracing device activity only; the union of GPU kernel and copy intervals over
  the wall time of the `generate` call, and over the span from the first GPU activity to the last
  (the call's own host work before and after, submitting the requests and assembling their
  outputs, left out). The same call untraced gives the rate without the profiler's overhead.
  Kernel intervals leave out the GPU's own gaps between the kernels of a graph (a few hundred
  kernels a step for a small model), which are not the host's doing; so, in one more untraced
  call, CUDA events as each step's launch begins and ends give the GPU time of every step, from
  its first work to its last, against the call's wall time: the GPU is idle for the host only
  between steps (and before the first and after the last).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import radixlm
from benchmarks.common import (
    SHAPES,
    commit,
    cuda_event_spans,
    device_line,
    random_prompts,
    shape_folder,
    union_length,
)


def matmul_rate() -> float:
    """bf16 FLOP/s of a large matmul (the ceiling prefill is compared with)."""
    import triton.testing

    a = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=200)
    return 2 * 8192 * 4096 * 14336 / (ms / 1e3)


def prefill(shape: str) -> list[str]:
    folder = shape_folder(shape)
    s = SHAPES[shape]
    lines = []
    with radixlm.Engine(
        str(folder), load_format="dummy", disable_radix_cache=True, chunked_prefill_size=8192
    ) as eng:
        params = {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}
        n_params = sum(p.numel() for p in eng.model.parameters())
        n_params -= eng.model.embed_tokens.weight.numel() if not s["tie_word_embeddings"] else 0
        peak = matmul_rate()
        for length in (1024, 8192):
            prompts = random_prompts(4, length, length, 32000, seed=length)
            eng.generate(input_ids=prompts[0], sampling_params=params)  # warm-up
            times = []
            for p in prompts[1:]:
                torch.cuda.synchronize()
                t = time.perf_counter()
                eng.generate(input_ids=p, sampling_params=params)
                times.append(time.perf_counter() - t)
            best = min(times)
            flops = (
                2 * n_params * length + 2 * s["num_hidden_layers"] * s["hidden_size"] * length**2
            )
            lines.append(
                f"| {shape} | {length} | {best * 1e3:.1f} ms | {flops / best / 1e12:.0f} TFLOP/s | "
                f"{peak / 1e12:.0f} TFLOP/s | {flops / best / peak:.1%} |"
            )
    return lines


def short_prompts(shape: str) -> list[str]:
    """Time to the first token of short prompts (32 tokens, one new token; alone, and 64 at once),
    with prompt steps run eagerly (`cuda_graph_max_prefill_tokens=0`) and replayed from graphs,
    in the same run: median of 7 calls after a warm-up."""
    folder = shape_folder(shape)
    params = {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}
    medians = {}
    for max_tokens in (0, 2048):
        with radixlm.Engine(
            str(folder), load_format="dummy", disable_radix_cache=True,
            cuda_graph_max_prefill_tokens=max_tokens,
        ) as eng:  # fmt: skip
            for n in (1, 64):
                prompts = random_prompts(n, 32, 32, 32000, seed=n)
                eng.generate(input_ids=prompts, sampling_params=params)
                times = []
                for _ in range(7):
                    t = time.perf_counter()
                    eng.generate(input_ids=prompts, sampling_params=params)
                    times.append(time.perf_counter() - t)
                medians[max_tokens, n] = statistics.median(times)
    return [
        f"| {shape} | {n} x 32 tokens | {medians[0, n] * 1e3:.2f} ms | "
        f"{medians[2048, n] * 1e3:.2f} ms | {medians[0, n] / medians[2048, n]:.1f}x |"
        for n in (1, 64)
    ]


def busy(shape: str) -> str:
    from torch.profiler import ProfilerActivity, profile

    folder = shape_folder(shape)
    prompts = random_prompts(64, 32, 32, 32000, seed=5)
    params = {"max_new_tokens": 256, "temperature": 0, "ignore_eos": True}
    with radixlm.Engine(str(folder), load_format="dummy", disable_radix_cache=True) as eng:
        eng.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": 8})
        t0 = time.perf_counter()
        eng.generate(input_ids=prompts, sampling_params=params)
        untraced = time.perf_counter() - t0
        steps, inside, events_wall = step_spans(eng, prompts, params)
        # device activity only: tracing every host-side op would slow the host being measured
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            eng.generate(input_ids=prompts, sampling_params=params)
            wall = time.perf_counter() - t0
    intervals = [
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    ]
    covered = union_length(intervals)
    span = (max(b for _, b in intervals) - min(a for a, _ in intervals)) / 1e6
    tokens = 64 * 256
    return (
        f"| {shape} | 64 x 256 tokens | {wall:.3f} s | {tokens / wall:.0f} tok/s "
        f"({tokens / untraced:.0f} untraced) | {covered / 1e6:.3f} s | {covered / 1e6 / wall:.1%} "
        f"| {span:.3f} s | {covered / 1e6 / span:.1%} | {steps} steps: {inside:.3f} s of "
        f"{events_wall:.3f} s = **{inside / events_wall:.1%}** |"
    )


def step_spans(eng, prompts, params) -> tuple[int, float, float]:
    """One untraced `generate` call with CUDA events recorded as each step's launch begins and
    ends: (steps, seconds of GPU time from each step's first work to its last, summed, wall
    seconds of the call). Steps run one after another on the stream, so the spans do not overlap;
    what lies between them is the GPU waiting for the host."""
    from radixlm.runtime.model_runner import ModelRunner

    with cuda_event_spans(ModelRunner, "launch") as spans:
        t0 = time.perf_counter()
        eng.generate(input_ids=prompts, sampling_params=params)
        wall = time.perf_counter() - t0
    return len(spans), sum(a.elapsed_time(b) for a, b, _ in spans) / 1e3, wall


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prefill-shape", default="llama-3.1-8b", help="a shape, or none")
    ap.add_argument("--busy-shape", default="smollm2-135m", help="a shape, or none")
    ap.add_argument("--short-shape", default="smollm2-135m", help="a shape, or none")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_profile measures the GPU: no CUDA device here")
    print(f"device: {device_line()}  commit: {commit()}")
    if args.prefill_shape != "none":
        print("\n| shape | prompt tokens | time to first token | achieved | bf16 matmul | share |")
        print("|---|---|---|---|---|---|")
        for line in prefill(args.prefill_shape):
            print(line, flush=True)
    if args.short_shape != "none":
        print("\n| shape | prompts | first token, eager prompt step | from a graph | speed-up |")
        print("|---|---|---|---|---|")
        for line in short_prompts(args.short_shape):
            print(line, flush=True)
    if args.busy_shape == "none":
        return
    print(
        "\n| shape | decode batch | wall | rate | GPU busy | share of wall | GPU span "
        "| share of span | GPU time in steps (CUDA events) over wall |"
        "\n|---|---|---|---|---|---|---|---|---|"
    )
    print(busy(args.busy_shape), flush=True)


if __name__ == "__main__":
    main()
