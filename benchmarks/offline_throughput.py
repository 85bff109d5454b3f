"""Offline generation throughput: radixlm against Hugging Face transformers, same weights, same
prompts, same machine, one run.

    python -m benchmarks.offline_throughput [--model-path P] [--batch 64] [--new-tokens 64]
    python -m benchmarks.offline_throughput --shape smollm2-135m   # GPU: random weights, bf16
        [--ablate pdl,prefill-graphs,cuda-graphs,overlap [--rounds 2]]
        [--prompt-lens 1000-2000 --output-lens 20-100] [--quantization fp8] [--peak-tflops 989]
        [--profile]

On the CPU, two workloads: batch 1 (decode speed: a short prompt, many new tokens) and a batch of prompts of
mixed lengths generated all at once (transformers pads them to the longest; radixlm batches them
continuously without padding). EOS is ignored so both produce exactly the same number of tokens.

With --shape (a GPU and random weights of a real model's shape): 1,000 requests with prompts of
100-400 tokens and 100-300 new tokens each, submitted at once, against transformers'
continuous-batching `generate_batch` on the same prompts (a subset, --hf-requests, since it is much
slower; its rate is output tokens per second of that subset). The rate is the median of
--repeats runs on one engine. --ablate compares all switches on with each named one off, one at a
time, instead: --rounds rounds of every configuration, interleaved (the first engine a process builds
runs slowest, so a configuration measured only first or only later would carry that).

With --shape it also prints the workload's FLOPs and the rate they allow at --peak-tflops.
--profile then says where the time goes (`profile_workload`): the stream time of decode-only
steps against their floor (FLOPs or bytes, step by step) and of steps with prompt tokens, the
stream idle between steps, the engine thread's host phases, and every kernel's time by group
under the torch profiler.

--quantization fp8 runs radixlm a second time with its linear layers quantized at load (FP8 W8A8,
from the same weights), in the same run, and prints both rates and their ratio (on the CPU the FP8
layers take the dequantizing torch path: a correctness path, not a fast one).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import radixlm
from benchmarks.common import (
    commit,
    copy_bandwidth,
    cuda_event_spans,
    device_line,
    head_dim,
    kernel_breakdown,
    kernel_group,
    offline_gpu_workload,
    random_hf_model,
    random_prompts,
    shape_folder,
)


def _span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


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
    ap.add_argument("--shape", default=None, help="GPU workload on random weights of this shape")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--hf-requests", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3, help="with --shape: runs, median taken")
    ap.add_argument(
        "--ablate",
        default="",
        help=f"with --shape: switches to turn off one at a time, of {','.join(ABLATIONS)}",
    )
    ap.add_argument(
        "--rounds", type=int, default=2,
        help="with --ablate: rounds of all the configurations, interleaved, each a fresh engine",
    )  # fmt: skip
    ap.add_argument(
        "--prompt-lens", type=_span, default=(100, 400), help="with --shape: LO-HI prompt tokens"
    )
    ap.add_argument(
        "--output-lens", type=_span, default=(100, 300), help="with --shape: LO-HI new tokens"
    )
    ap.add_argument(
        "--max-running", type=int, default=None,
        help="with --shape: concurrent requests (default: all of them, at once)",
    )  # fmt: skip
    ap.add_argument("--quantization", default=None, help="also run radixlm with this scheme (fp8)")
    ap.add_argument(
        "--peak-tflops", type=float, default=989.0,
        help="with --shape: the GPU's dense bf16 peak, for the FLOPs floor (H100/H200 SXM: 989)",
    )  # fmt: skip
    ap.add_argument(
        "--profile", action="store_true",
        help="with --shape: where the time goes, by step kind and by kernel (two more runs; "
        "with --quantization, of the quantized engine too)",
    )  # fmt: skip
    args = ap.parse_args()
    if args.shape:
        args.max_running = args.max_running or args.requests
        return gpu_workload(args)

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
    quantized = []
    if args.quantization:
        with radixlm.Engine(
            args.model_path, disable_radix_cache=True, quantization=args.quantization
        ) as engine:
            for (label, tokens, ours, _), workload, new in zip(
                rows, (single, mixed), (args.decode_tokens, args.new_tokens)
            ):
                quantized.append((label, tokens, ours, time_ours(engine, workload, new)))

    print("\n| workload | radixlm out tok/s | transformers out tok/s | ratio |\n|---|---|---|---|")
    for label, tokens, ours, theirs in rows:
        print(f"| {label} | {tokens / ours:.1f} | {tokens / theirs:.1f} | {theirs / ours:.2f}x |")
    if quantized:
        print(f"\n| workload | radixlm out tok/s | radixlm {args.quantization} out tok/s | ratio |")
        print("|---|---|---|---|")
        for label, tokens, ours, quant in quantized:
            print(f"| {label} | {tokens / ours:.1f} | {tokens / quant:.1f} | {ours / quant:.2f}x |")


# switches one run turns off, one at a time, to see what each is worth at this batch size
ABLATIONS = {
    "pdl": ({"RADIXLM_DISABLE_PDL": "1"}, {}),  # each Triton kernel launched after the last ends
    "prefill-graphs": ({}, {"cuda_graph_max_prefill_tokens": 0}),  # prompt steps run eagerly
    "cuda-graphs": ({}, {"disable_cuda_graph": True}),  # every step launched kernel by kernel
    "overlap": ({}, {"disable_overlap_schedule": True}),  # the host waits for each step
}


def ours_offline(
    args,
    folder,
    prompts,
    params,
    without: str = "",
    quantization: str | None = None,
    profile_bandwidth: float | None = None,
) -> tuple[list[float], dict]:
    """Output tokens/s of --repeats runs of the whole workload on one engine, and the engine's
    statistics; `without` names a switch of ABLATIONS to turn off; `quantization` a scheme;
    `profile_bandwidth`, the copy bandwidth (bytes a second): then where the time goes, from two
    more runs (`profile_workload`)."""
    import os

    env, engine_args = ABLATIONS[without] if without else ({}, {})
    if quantization:
        engine_args = {**engine_args, "quantization": quantization}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with radixlm.Engine(
            str(folder), load_format="dummy", disable_radix_cache=True,
            max_running_requests=args.max_running, cuda_graph_max_bs=args.max_running,
            **engine_args,
        ) as eng:  # fmt: skip
            eng.generate(input_ids=prompts[:64], sampling_params=params[:64])  # warm-up
            rates = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                results = eng.generate(input_ids=prompts, sampling_params=params)
                wall = time.perf_counter() - t
                produced = sum(len(r["output_ids"]) for r in results)
                assert produced == sum(p["max_new_tokens"] for p in params)
                rates.append(produced / wall)
            stats = eng.get_stats()
            if profile_bandwidth is not None:
                profile_workload(eng, folder, prompts, params, args.peak_tflops, profile_bandwidth)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        torch.cuda.empty_cache()
    label = f"without {without}" if without else "radixlm"
    label += f" ({quantization})" if quantization else ""
    runs = ", ".join(f"{r:.0f}" for r in rates)
    print(f"{label}: median {statistics.median(rates):.0f} output tok/s (runs: {runs})")
    return rates, stats


def ablation(args, folder, prompts, params, switches: list[str]) -> None:
    """Each switch off, one at a time, against all on: --rounds rounds of every configuration in
    turn, each run on a fresh engine, so that an order effect (the first engine of a process runs
    slowest) falls on every configuration alike; the medians are over all of a configuration's
    runs, beside the spread of its per-engine medians."""
    configs = ["", *switches]
    rates: dict[str, list[float]] = {c: [] for c in configs}
    per_engine: dict[str, list[float]] = {c: [] for c in configs}
    for r in range(args.rounds):
        order = configs if r % 2 == 0 else configs[::-1]  # (alternate who goes first)
        for c in order:
            runs = ours_offline(args, folder, prompts, params, c)[0]
            rates[c] += runs
            per_engine[c].append(statistics.median(runs))
    base = statistics.median(rates[""])
    print("\n| switched off | median out tok/s | per-engine medians | vs all on |")
    print("|---|---|---|---|")
    for c in configs:
        median = statistics.median(rates[c])
        engines = ", ".join(f"{m / 1000:.1f}k" for m in per_engine[c])
        print(f"| {c or '(nothing)'} | {median:.0f} | {engines} | {median / base:.2f}x |")


def gpu_workload(args) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("--shape measures the GPU: no CUDA device here")
    folder = shape_folder(args.shape)
    prompts, params = offline_gpu_workload(args.requests, args.prompt_lens, args.output_lens)
    outs = [p["max_new_tokens"] for p in params]
    print(f"device: {device_line()}  commit: {commit()}  shape: {args.shape}")
    lo, hi = args.prompt_lens
    print(
        f"{len(prompts)} requests, {lo}-{hi} in / {args.output_lens[0]}-{args.output_lens[1]} "
        f"out, {args.max_running} running, {sum(outs)} output tokens a run"
    )
    ablate = [a for a in args.ablate.split(",") if a]
    unknown = set(ablate) - set(ABLATIONS)
    if unknown:
        raise SystemExit(f"--ablate: no switch {sorted(unknown)}; the switches: {list(ABLATIONS)}")
    if ablate:
        return ablation(args, folder, prompts, params, ablate)
    bandwidth = None
    if args.profile:  # (measured before an engine holds the memory; what it took given back)
        bandwidth = copy_bandwidth()
        torch.cuda.empty_cache()
    rates, stats = ours_offline(args, folder, prompts, params, profile_bandwidth=bandwidth)
    ours = statistics.median(rates)
    print(f"  engine stats: {stats}")
    flops = workload_flops(folder, prompts, outs)
    floor_s = flops / (args.peak_tflops * 1e12)
    print(
        f"  FLOPs of the workload: {flops / 1e15:.2f} PFLOP (linear layers, LM head at sampled "
        f"positions, causal attention); at {args.peak_tflops:g} TFLOP/s (bf16 dense peak) "
        f"{floor_s:.2f} s, at most {sum(outs) / floor_s:.0f} output tok/s: radixlm reaches "
        f"{ours / (sum(outs) / floor_s):.1%} of it"
    )
    if args.quantization:
        q_rates, q_stats = ours_offline(
            args, folder, prompts, params, quantization=args.quantization,
            profile_bandwidth=bandwidth,
        )  # fmt: skip
        quant = statistics.median(q_rates)
        print(f"  engine stats ({args.quantization}): {q_stats}")
        print(
            f"\n| workload | radixlm bf16 out tok/s | radixlm {args.quantization} out tok/s | ratio |"
        )
        print("|---|---|---|---|")
        label = f"{args.shape}, {args.requests} req, {args.max_running} running"
        print(f"| {label} | {ours:.0f} | {quant:.0f} | {quant / ours:.2f}x |")

    if not args.hf_requests:
        return
    theirs = hf_generate_batch(folder, prompts[: args.hf_requests], outs[: args.hf_requests])
    print("\n| workload | radixlm out tok/s | transformers generate_batch out tok/s | ratio |")
    print("|---|---|---|---|")
    (lo, hi), (out_lo, out_hi) = args.prompt_lens, args.output_lens
    label = (
        f"{args.shape}, {args.requests} req, {lo}-{hi} in / {out_lo}-{out_hi} out, "
        f"{args.max_running} running"
    )
    print(f"| {label} | {ours:.0f} | {theirs:.0f} | {ours / theirs:.1f}x |")


def shape_numbers(folder) -> dict[str, int]:
    """What the costs of a step follow from, read from the shape's config.json: per token fed,
    the linear layers' multiply-adds (`linear`); the LM head's (`head`); per key a token attends
    to, attention's multiply-adds over all layers (`attend`) and the K and V bytes (bfloat16)
    read (`kv_bytes`); the weight bytes a step reads (`weight_bytes`: the linear layers and the
    LM head, bfloat16)."""
    import json

    c = json.loads((folder / "config.json").read_text())
    h, i, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    heads = c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads", heads)
    hd = head_dim(c)
    linear = layers * (h * heads * hd * 2 + 2 * h * kv_heads * hd + 3 * h * i)
    head = h * c["vocab_size"]
    return {
        "linear": linear,
        "head": head,
        "attend": layers * 2 * heads * hd,
        "kv_bytes": layers * 2 * kv_heads * hd * 2,
        "weight_bytes": 2 * (linear + head),
    }


def workload_flops(folder, prompts: list[list[int]], outs: list[int]) -> float:
    """The multiply-adds (x2) the workload cannot avoid: every linear layer once per token fed
    (each prompt token, each output token but the last), the LM head once per output token, and
    causal attention (q.k and p.v over the positions up to each token fed)."""
    n = shape_numbers(folder)
    fed = sum(len(p) + k - 1 for p, k in zip(prompts, outs))
    # positions attended: token at position t sees t + 1 keys
    attended = sum((len(p) + k - 1) * (len(p) + k) // 2 for p, k in zip(prompts, outs))
    return 2.0 * (n["linear"] * fed + n["head"] * sum(outs) + n["attend"] * attended)


def _step_note(_runner, plan, *args, **kwargs) -> tuple[bool, int, int]:
    """(decodes only, tokens computed, keys attended) of a step's plan."""
    keys = sum(plan.seq_lens) + sum(it.start + it.num_tokens for it in plan.items)
    return not plan.items, len(plan.decodes) + sum(it.num_tokens for it in plan.items), keys


def profile_workload(eng, folder, prompts, params, peak_tflops: float, bandwidth: float) -> None:
    """Where a run of the workload spends its time, from two more runs on the same engine.

    First untraced, with CUDA events around each step's launch:
    - the stream time of decode-only steps and of the others (prompt chunks, multi-token
      decodes), from each step's first work to its last (gaps inside a step, the device waiting
      for the host, included), and the rest of the wall time (the stream idle between steps);
    - each decode-only step's floor: the larger of its FLOPs at `peak_tflops` and its bytes (the
      weights once, the K and V of every key attended) at `bandwidth` (bytes a second);
    - the engine thread's host phases over the run (EngineStats.host_seconds_*).
    Then under the torch profiler (device activity only): the device's busy time (idle, inside
    steps and between them, is the rest), every kernel's time by group (benchmarks/common.py
    KERNEL_GROUPS), the largest kernels by name."""
    from torch.profiler import ProfilerActivity, profile

    from radixlm.runtime.model_runner import ModelRunner

    n = shape_numbers(folder)
    before = eng.get_stats()
    with cuda_event_spans(ModelRunner, "launch", note=_step_note) as spans:
        t = time.perf_counter()
        eng.generate(input_ids=prompts, sampling_params=params)
        wall = time.perf_counter() - t
    after = eng.get_stats()
    host = {
        k.removeprefix("host_seconds_"): after[k] - before[k]
        for k in after
        if k.startswith("host_seconds_") and isinstance(after[k], float)
    }
    decode_s = prompt_s = floor_s = 0.0
    decode_steps = decode_rows = prompt_steps = prompt_tokens = 0
    for start, end, (decodes_only, tokens, keys) in spans:
        seconds = start.elapsed_time(end) / 1e3
        if decodes_only:
            decode_s += seconds
            decode_steps += 1
            decode_rows += tokens
            flops = 2.0 * ((n["linear"] + n["head"]) * tokens + n["attend"] * keys)
            floor_s += max(
                flops / (peak_tflops * 1e12), (n["weight_bytes"] + n["kv_bytes"] * keys) / bandwidth
            )
        else:
            prompt_s += seconds
            prompt_steps += 1
            prompt_tokens += tokens
    idle = wall - decode_s - prompt_s
    print(
        f"\nWhere the time goes (an untraced run with events around each step: {wall:.2f} s):\n"
        f"  decode-only steps: {decode_steps}, {decode_rows / max(decode_steps, 1):.0f} rows "
        f"each on average, {decode_s:.2f} s on the stream ({decode_s / wall:.0%} of the wall); "
        f"their floor (FLOPs at {peak_tflops:g} TFLOP/s or bytes at {bandwidth / 1e12:.2f} TB/s, "
        f"the larger, step by step) {floor_s:.2f} s: {floor_s / max(decode_s, 1e-9):.0%} of it\n"
        f"  steps with prompt tokens (or multi-token decodes): {prompt_steps}, {prompt_tokens} "
        f"tokens, {prompt_s:.2f} s ({prompt_s / wall:.0%})\n"
        f"  the stream idle between steps: {idle:.2f} s ({idle / wall:.0%})\n"
        "  the engine thread's host phases (s): "
        + ", ".join(f"{k} {v:.2f}" for k, v in host.items())
        + " (wait: for the device)"
    )
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        eng.generate(input_ids=prompts, sampling_params=params)
        traced = time.perf_counter() - t
    kernels = [
        (e.name, e.time_range.start / 1e6, e.time_range.end / 1e6)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    ]
    groups, names, busy = kernel_breakdown(kernels)
    print(
        f"\nUnder the profiler ({traced:.2f} s, {wall / traced:.2f}x the untraced rate): the "
        f"device busy {busy:.2f} s ({busy / traced:.0%}), idle {traced - busy:.2f} s\n"
        "\n| kernel group | kernels | device s | of the busy time |\n|---|---|---|---|"
    )
    for group, (count, seconds) in groups.items():
        print(f"| {group} | {count} | {seconds:.3f} | {seconds / busy:.1%} |")
    print("\n| kernel | group | count | device s | mean us |\n|---|---|---|---|---|")
    for name, count, seconds in names[:15]:
        short = name if len(name) <= 70 else name[:67] + "..."
        print(
            f"| `{short}` | {kernel_group(name)} | {count} | {seconds:.3f} | "
            f"{seconds / count * 1e6:.1f} |"
        )


def hf_generate_batch(folder, prompts, outs) -> float:
    """transformers' continuous batching on the same weights' shape (bf16, random weights); every
    request gets the mean output length, EOS off. Output tokens per second."""
    from transformers import GenerationConfig

    model = random_hf_model(folder)
    n = round(sum(outs) / len(outs))
    gen = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                           pad_token_id=0)  # fmt: skip
    model.generate_batch(inputs=prompts[:8], generation_config=gen, progress_bar=False)
    t = time.perf_counter()
    res = model.generate_batch(inputs=prompts, generation_config=gen, progress_bar=False)
    wall = time.perf_counter() - t
    produced = sum(len(r.generated_tokens) for r in res.values())
    print(f"transformers generate_batch: {len(prompts)} requests, {produced} tokens in {wall:.1f}s")
    return produced / wall


if __name__ == "__main__":
    main()
