"""Tensor parallelism: TP=1 against TP=2 in one run, random weights of a real model's shape;
with --pp-size N, pipeline parallelism over N stages beside them.

    python -m benchmarks.tensor_parallel                  # two GPUs: Llama-3.1-8B shape, bf16
        [--shape llama-3.1-8b] [--tp 1,2] [--pp-size 2] [--new-tokens 128] [--requests 1000]
        [--repeats 2]
    python -m benchmarks.tensor_parallel --device cpu --shape tiny --requests 8 ...   # gloo

Three measurements for each tp_size:
- batch-1 decode: tokens/s of the decode steps alone (a 32-token prompt, then --new-tokens; the
  time of a one-token call taken off, as benchmarks/decode_latency.py does);
- offline throughput: the GPU offline workload of benchmarks/common.py (--requests requests of
  100-400 prompt tokens and 100-300 new tokens, greedy, EOS ignored, all submitted at once),
  output tokens/s, median of --repeats runs;
- the collectives of one step: a decode step of batch B runs 2 all-reduces a layer (o_proj,
  down_proj) and one for the embedding, of B x hidden values each, and one all-gather of the
  logits (B x vocab / tp float32 from each rank). They are timed alone on the same group kind
  (NCCL on GPUs, gloo on the CPU) between two processes: the median of many calls, CUDA events
  on the GPU, with the bus bandwidth NCCL's tests report (all-reduce: 2 (n-1)/n x bytes / time)
  against the same collective's at --peak-mib (64 MiB), where it runs at its full bandwidth. Their sum is the
  all-reduce time per step, shown beside the measured step time.

With --pp-size, the same two measurements for the pipeline of that many stages, and the
stage-to-stage messages of a batch-1 decode step timed alone the same way: the activations going
down (hidden states and residual, 2 x hidden) and the logits row coming back (vocab float32),
each a send and its recv (half a round trip).

On the CPU it runs at a tiny size so that it is known to start (tests/test_tensor_parallel.py,
tests/test_pipeline_parallel.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import SHAPES, commit, device_line, offline_gpu_workload, shape_folder

# NVLink multicast off in every process this starts (the two-GPU machine's rule)
for _name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_name, "0" if _name == "NCCL_NVLS_ENABLE" else "1")

TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=49152, tie_word_embeddings=True, rope_theta=10000.0,
)  # fmt: skip


def model_folder(shape: str) -> Path:
    if shape != "tiny":
        return shape_folder(shape)
    from radixlm.runtime.config import default_cache_dir
    from radixlm.runtime.model_loader import copy_tokenizer_files, resolve_model_folder

    out = Path(tempfile.mkdtemp(prefix="radixlm-tiny-"))
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5,
           "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2, **TINY}  # fmt: skip
    (out / "config.json").write_text(json.dumps(cfg))
    copy_tokenizer_files(resolve_model_folder(None, default_cache_dir()), out)
    return out


def engine_args(args, tp: int, pp: int = 1) -> dict:
    out = {"load_format": "dummy", "tp_size": tp, "pp_size": pp, "disable_radix_cache": True}
    if args.device == "cpu":
        out.update(device="cpu", max_total_tokens=args.cpu_kv_tokens)
    else:
        out.update(max_running_requests=args.requests, cuda_graph_max_bs=min(args.requests, 256))
    return out


def measure(args, folder: Path, tp: int, pp: int = 1) -> tuple[float, float, float]:
    """On one engine: batch-1 decode tokens/s (decode steps alone), the mean time of one such
    step, and the offline workload's output tokens/s (median of --repeats runs)."""
    import radixlm

    prompt = list(range(1000, 1032))
    params = {"max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True}
    prompts, offline = offline_gpu_workload(args.requests, args.prompt_lens, args.output_lens)
    with radixlm.Engine(str(folder), **engine_args(args, tp, pp)) as eng:
        eng.generate(input_ids=prompt, sampling_params={**params, "max_new_tokens": 8})
        first = []
        for _ in range(3):
            t = time.perf_counter()
            eng.generate(input_ids=prompt, sampling_params={**params, "max_new_tokens": 1})
            first.append(time.perf_counter() - t)
        t = time.perf_counter()
        eng.generate(input_ids=prompt, sampling_params=params)
        decode = max(time.perf_counter() - t - min(first), 1e-9)
        eng.generate(input_ids=prompts[:8], sampling_params=offline[:8])  # warm-up
        rates = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            results = eng.generate(input_ids=prompts, sampling_params=offline)
            wall = time.perf_counter() - t
            produced = sum(len(r["output_ids"]) for r in results)
            assert produced == sum(p["max_new_tokens"] for p in offline)
            rates.append(produced / wall)
    steps = args.new_tokens - 1
    return steps / decode, decode / steps, statistics.median(rates)


# ---- the collectives alone, between two processes --------------------------------------------


def _collectives_worker(rank: int, addr: str, device_kind: str, sizes: dict, iters: int, out):
    """Rank `rank` of 2: time each collective of `sizes` (name -> (kind, numel, dtype name))."""
    import datetime

    import torch.distributed as dist

    from radixlm.runtime.parallel import GroupComm
    from radixlm.runtime.tp_worker import _process_group, parse_addr

    host, port = parse_addr(addr)
    store = dist.TCPStore(host, port, 2, rank == 0, timeout=datetime.timedelta(seconds=120))
    device = torch.device("cuda", rank) if device_kind == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    comm = GroupComm(_process_group(store, rank, 2, device, 120.0), rank, 2)
    times = {}
    for name, (kind, numel, dtype) in sizes.items():
        x = torch.randn(numel, device=device).to(getattr(torch, dtype))
        if kind == "all_gather":
            x = x.view(1, -1)
        op = {"all_reduce": comm.all_reduce, "all_gather": comm.all_gather}.get(kind)
        if kind == "p2p":  # rank 0 sends, rank 1 sends it back: a round trip
            op = _round_trip(comm, rank)
        for _ in range(5):
            op(x)
        samples = []
        for _ in range(iters):
            if device.type == "cuda":
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                op(x)
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3)
            else:
                t = time.perf_counter()
                op(x)
                samples.append(time.perf_counter() - t)
        times[name] = statistics.median(samples)
    if rank == 0:
        out.put(times)


def _round_trip(comm, rank: int):
    def op(x):
        if rank == 0:
            comm.group.send([x], 1, 0).wait()
            comm.group.recv([x], 1, 0).wait()
        else:
            comm.group.recv([x], 0, 0).wait()
            comm.group.send([x], 0, 0).wait()

    return op


def time_collectives(device_kind: str, sizes: dict, iters: int) -> dict[str, float]:
    import multiprocessing as mp
    import socket

    with socket.socket() as sock:  # a free loopback port for the pair's store
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    addr = f"127.0.0.1:{port}"
    procs = [
        ctx.Process(target=_collectives_worker, args=(r, addr, device_kind, sizes, iters, out))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        return out.get(timeout=600)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def bus_bandwidth(kind: str, nbytes: int, seconds: float, n: int = 2) -> float:
    """NCCL tests' bus bandwidth: all-reduce 2 (n-1)/n x bytes / time; all-gather (n-1)/n x the
    gathered bytes / time."""
    factor = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
    return factor * nbytes / seconds


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shape", default="llama-3.1-8b", help=f"tiny or one of {', '.join(SHAPES)}")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tp", default="1,2", help="tp sizes to run (1 and 2)")
    ap.add_argument(
        "--pp-size", type=int, default=0, help="also run pipeline parallelism of this many stages"
    )
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompt-lens", default="100-400")
    ap.add_argument("--output-lens", default="100-300")
    ap.add_argument("--iters", type=int, default=200, help="calls per collective timed")
    ap.add_argument("--cpu-kv-tokens", type=int, default=16384)
    ap.add_argument(
        "--peak-mib", type=int, default=64, help="the large message the small ones are put against"
    )
    args = ap.parse_args()
    args.prompt_lens = tuple(int(x) for x in args.prompt_lens.split("-"))
    args.output_lens = tuple(int(x) for x in args.output_lens.split("-"))
    tps = [int(t) for t in args.tp.split(",")]
    gpus = max(*tps, args.pp_size)
    if args.device == "cuda" and torch.cuda.device_count() < gpus:
        raise SystemExit(
            f"tensor_parallel needs {gpus} GPUs, this machine has "
            f"{torch.cuda.device_count()}; --device cpu runs it on gloo"
        )
    shape = TINY if args.shape == "tiny" else SHAPES[args.shape]
    folder = model_folder(args.shape)
    print(f"device: {device_line()}  commit: {commit()}  shape: {args.shape}", flush=True)

    rows = {}
    for tp in tps:
        rows[tp] = decode, step, offline = measure(args, folder, tp)
        print(f"tp={tp}: batch-1 decode {decode:.1f} tok/s ({step * 1e3:.2f} ms a step), "
              f"offline {offline:.0f} out tok/s", flush=True)  # fmt: skip

    print(
        f"\n| tp | batch-1 decode tok/s | vs tp=1 | offline out tok/s ({args.requests} req) | vs tp=1 |"
    )
    print("|---|---|---|---|---|")
    base = rows.get(1)
    for tp, (decode, _, offline) in rows.items():
        d = f"{decode / base[0]:.2f}x" if base else "-"
        o = f"{offline / base[2]:.2f}x" if base else "-"
        print(f"| {tp} | {decode:.1f} | {d} | {offline:.0f} | {o} |")
    if args.pp_size > 1:
        report_pipeline(args, folder, shape, base)
    if 2 not in tps:
        return
    # one decode step of batch 1 at tp=2: what its collectives move, timed alone
    hidden, vocab, layers = shape["hidden_size"], shape["vocab_size"], shape["num_hidden_layers"]
    half = "bfloat16" if args.device == "cuda" else "float32"
    elem = 2 if half == "bfloat16" else 4
    sizes = {
        "all-reduce (1 x hidden)": ("all_reduce", hidden, half),
        "all-gather (1 x vocab/2 logits)": ("all_gather", -(-vocab // 2), "float32"),
        "all-reduce large": ("all_reduce", (args.peak_mib << 20) // elem, half),
        "all-gather large": ("all_gather", (args.peak_mib << 19) // 4, "float32"),
    }
    times = time_collectives(args.device, sizes, args.iters)
    bytes_of = {
        name: numel * (4 if dtype == "float32" else elem) * (2 if kind == "all_gather" else 1)
        for name, (kind, numel, dtype) in sizes.items()
    }
    print(
        f"\n| collective | bytes | median time | bus bandwidth | of a {args.peak_mib} MiB one's |"
    )
    print("|---|---|---|---|---|")
    for name in ("all-reduce (1 x hidden)", "all-gather (1 x vocab/2 logits)"):
        kind = sizes[name][0]
        big = "all-reduce large" if kind == "all_reduce" else "all-gather large"
        bw = bus_bandwidth(kind, bytes_of[name], times[name])
        peak = bus_bandwidth(kind, bytes_of[big], times[big])
        print(f"| {name} | {bytes_of[name]} | {times[name] * 1e6:.1f} us | {bw / 1e9:.2f} GB/s | "
              f"{bw / peak:.1%} ({peak / 1e9:.2f} GB/s) |")  # fmt: skip
    per_step = (2 * layers + 1) * times["all-reduce (1 x hidden)"]
    per_step += times["all-gather (1 x vocab/2 logits)"]
    step = rows[2][1]
    print(
        f"\nall-reduce time per batch-1 decode step at tp=2: {2 * layers + 1} all-reduces + 1 "
        f"all-gather = {per_step * 1e6:.0f} us, of a measured {step * 1e3:.2f} ms step "
        f"({per_step / step:.0%})"
    )


def report_pipeline(args, folder: Path, shape: dict, base) -> None:
    """The pipeline of --pp-size stages: its two measurements against tp=1, and the messages
    between the stages of one batch-1 decode step, timed alone."""
    pp = args.pp_size
    decode, step, offline = measure(args, folder, 1, pp)
    print(f"pp={pp}: batch-1 decode {decode:.1f} tok/s ({step * 1e3:.2f} ms a step), "
          f"offline {offline:.0f} out tok/s", flush=True)  # fmt: skip
    print(f"\n| pp | batch-1 decode tok/s | vs tp=1 | offline out tok/s ({args.requests} req) | "
          "vs tp=1 |\n|---|---|---|---|---|")  # fmt: skip
    d = f"{decode / base[0]:.2f}x" if base else "-"
    o = f"{offline / base[2]:.2f}x" if base else "-"
    print(f"| {pp} | {decode:.1f} | {d} | {offline:.0f} | {o} |")
    half = "bfloat16" if args.device == "cuda" else "float32"
    sizes = {
        "activations (2 x hidden)": ("p2p", 2 * shape["hidden_size"], half),
        "logits (1 x vocab float32)": ("p2p", shape["vocab_size"], "float32"),
    }
    times = time_collectives(args.device, sizes, args.iters)
    print("\n| stage-to-stage message | bytes | median one-way time |\n|---|---|---|")
    total = 0.0
    for name, (_, numel, dtype) in sizes.items():
        one_way = times[name] / 2
        total += one_way * (pp - 1 if name.startswith("activations") else 1)
        nbytes = numel * (4 if dtype == "float32" else 2)
        print(f"| {name} | {nbytes} | {one_way * 1e6:.1f} us |")
    print(
        f"\npipeline messages per batch-1 decode step at pp={pp}: {pp - 1} activation sends + 1 "
        f"logits send = {total * 1e6:.0f} us, of a measured {step * 1e3:.2f} ms step "
        f"({total / step:.0%})"
    )


if __name__ == "__main__":
    main()
