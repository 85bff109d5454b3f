"""Where the engine core's time goes, step by step, sampled from outside by py-spy: no
instrumentation, so the waits show (for llguidance's threads, the masks, the device, the GIL)
and, in a second pass, which thread holds the GIL.

The workload is constrained_throughput's schema diversity (N requests, N distinct schemas, all
streamed at once from an event loop in this process, as a server's HTTP layer would be), warmed
first (every grammar compiled), then run again and again through four windows of --seconds:

    constrained, every thread's samples (waits included)
    constrained, only samples that hold the GIL
    unconstrained twin (the same prompts and lengths), every thread's samples
    unconstrained twin, only samples that hold the GIL

For each window: each thread's samples, and the core thread's time by function (inclusive) and
by where it is (the innermost frames, with line numbers); its waits for work between two runs of
the workload are left out.

    python -m benchmarks.core_profile [--model-path DIR] [--engine-arg load_format=dummy]
        [--distinct 96] [--seconds 3] [--schemas-dir DIR] [--top 30]

Needs the py-spy command (pip install py-spy), allowed to attach to this process (as root, or
where the kernel lets a process name its tracer).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

import radixlm
from benchmarks.common import commit, device_line
from benchmarks.constrained_throughput import (
    DEFAULT_SCHEMAS,
    _engine_arg,
    _stream_all,
    distinct_schemas,
    distinct_workload,
    unconstrained_twins,
)

CORE_THREAD = "radixlm-core"
# the frames every sample of the core thread sits in: left out of the inclusive table
_OUTER = {"Thread._bootstrap", "Thread._bootstrap_inner", "Thread.run", "EngineCore._run",
          "EngineCore._loop"}  # fmt: skip


def read_raw(path: Path) -> list[tuple[str, list[str], int]]:
    """py-spy's raw output: (thread name, frames outermost first, samples) per line."""
    rows = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        thread, *frames = stack.split(";")
        name = thread.split(":", 1)[1].strip() if ":" in thread else thread
        rows.append((re.sub(r"_\d+$", "", name), frames, int(count)))
    return rows


def _function(frame: str) -> str:
    return frame.split(" (", 1)[0]


def _where(frame: str) -> str:
    """`function:line` of a frame written `function (file:line)`."""
    line = frame.rsplit(":", 1)[-1].rstrip(")")
    return f"{_function(frame)}:{line}"


def summarize(rows: list[tuple[str, list[str], int]], top: int) -> str:
    """Samples by thread; the core thread's busy samples by function and by innermost frames."""
    threads: Counter = Counter()
    for name, _, count in rows:
        threads[name] += count
    core = [(frames, n) for name, frames, n in rows if name == CORE_THREAD]
    busy = [(f, n) for f, n in core if not any("_drain_inbox" in x for x in f)]
    total = sum(n for _, n in busy)
    out = ["samples by thread: " + ", ".join(f"{k} {v}" for k, v in threads.most_common(10))]
    idle = sum(n for _, n in core) - total
    out.append(f"core thread: {total} samples busy ({idle} waiting for work left out)")
    if not total:
        return "\n".join(out)
    inclusive: Counter = Counter()
    leaves: Counter = Counter()
    for frames, n in busy:
        for name in {_function(f) for f in frames} - _OUTER:
            inclusive[name] += n
        leaves[" < ".join(_where(f) for f in reversed(frames[-2:]))] += n
    out.append("by function (inclusive):")
    out += [f"  {100 * n / total:5.1f}%  {k}" for k, n in inclusive.most_common(top)]
    out.append("where (innermost two frames):")
    out += [f"  {100 * n / total:5.1f}%  {k}" for k, n in leaves.most_common(top)]
    return "\n".join(out)


def _allow_tracing() -> None:
    """Let a child (py-spy) attach to this process where the kernel's Yama asks for it."""
    try:
        import ctypes

        pr_set_ptracer, any_process = 0x59616D61, ctypes.c_ulong(-1)  # (PR_SET_PTRACER_ANY)
        ctypes.CDLL(None).prctl(pr_set_ptracer, any_process, 0, 0, 0)
    except Exception:  # (not Linux, or no Yama: nothing to allow)
        pass


def sample_while(run, spy: str, seconds: float, gil: bool, into: Path) -> int:
    """Run `run()` again and again while py-spy samples this process for `seconds`; returns how
    many times it ran."""
    mode = "--gil" if gil else "--idle"
    cmd = [spy, "record", "--pid", str(os.getpid()), "--duration", f"{seconds:g}", mode,
           "--threads", "--nonblocking", "--rate", "1000", "--format", "raw", "-o", str(into)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    runs = 0
    time.sleep(0.2)  # (attached before the first run)
    while proc.poll() is None:
        run()
        runs += 1
    if proc.returncode or not into.exists():
        raise SystemExit(f"py-spy failed ({proc.returncode}): {proc.stderr.read().decode()[-500:]}")
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--distinct", type=int, default=96)
    ap.add_argument("--schemas-dir", type=Path, default=DEFAULT_SCHEMAS)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--seconds", type=float, default=3.0, help="each window's sampling")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--py-spy", default=shutil.which("py-spy") or "py-spy")
    ap.add_argument(
        "--engine-arg", action="append", default=[], metavar="NAME=VALUE",
        help="an engine option (VALUE read as JSON, else as text)",
    )  # fmt: skip
    args = ap.parse_args()
    if shutil.which(args.py_spy) is None and not Path(args.py_spy).exists():
        raise SystemExit("needs the py-spy command: pip install py-spy (or --py-spy PATH)")
    _allow_tracing()
    print(f"device: {device_line()}  commit: {commit()}")
    schemas = distinct_schemas(args.schemas_dir, args.distinct)
    engine_args = dict(_engine_arg(a) for a in args.engine_arg)
    with radixlm.Engine(args.model_path, **engine_args) as eng, tempfile.TemporaryDirectory() as d:
        prompts, cons = distinct_workload(eng, schemas, args.max_new_tokens)
        outs, _, _ = asyncio.run(_stream_all(eng, prompts, cons))  # (every grammar compiles)
        ok, free = unconstrained_twins(outs)
        free_prompts = [prompts[i] for i in ok]
        workloads = {
            "constrained": lambda: asyncio.run(_stream_all(eng, prompts, cons)),
            "unconstrained": lambda: asyncio.run(_stream_all(eng, free_prompts, free)),
        }
        print(f"{len(ok)} of {len(schemas)} schemas compiled; windows of {args.seconds:g} s")
        for label, run in workloads.items():
            for gil in (False, True):
                before = eng.get_stats()
                t0 = time.perf_counter()
                path = Path(d) / f"{label}-{gil}.txt"
                runs = sample_while(run, args.py_spy, args.seconds, gil, path)
                steps = eng.get_stats()["num_steps"] - before["num_steps"]
                wall = time.perf_counter() - t0
                what = "samples holding the GIL" if gil else "every sample, waits included"
                print(
                    f"\n## {label}: {what} ({runs} runs, {steps} steps, "
                    f"{1e3 * wall / max(1, steps):.2f} ms a step while sampled)"
                )
                print(summarize(read_raw(path), args.top))


if __name__ == "__main__":
    main()
