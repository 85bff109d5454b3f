"""Grammar compiles beside a busy engine core: how long 96 distinct schemas take to compile in the
compiler's threads while another thread runs Python for `--busy-ms` at a time (the engine's core
thread when the host is the bound), at several switch intervals (how long a thread waiting for
the GIL waits before its holder is asked to let go), in one run; and how many "steps" the busy
thread made meanwhile. (A shorter interval while compiles ran measured faster here, and no faster
in the engine on an H100's host: benchmarks/RESULTS.md; the compiler leaves the interval alone.)

Then the same for tokenizing a prompt (the chat prompts of the 96-schema workload), alone and
beside the busy thread: Hugging Face's `encode`, which lets the GIL go inside, against the
engine's `text_ids` (protocol/prompt_tokens.py), which keeps it.

    python -m benchmarks.grammar_hand_over [--intervals 5,1,0.2] [--busy-ms 5] [--sleep-ms 0,0.1]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

from benchmarks.common import commit
from benchmarks.constrained_throughput import DEFAULT_SCHEMAS, distinct_schemas
from radixlm.constrained import GrammarCompiler
from radixlm.protocol.prompt_tokens import text_ids
from radixlm.runtime.model_loader import default_tokenizer


def core(stop: list, steps: list, busy_ms: float, sleep_ms: float) -> None:
    while not stop:
        t = time.perf_counter()
        while time.perf_counter() - t < busy_ms / 1000:
            pass
        if sleep_ms:
            time.sleep(sleep_ms / 1000)
        steps.append(1)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--intervals", default="5,1,0.2", help="switch intervals, ms")
    ap.add_argument("--busy-ms", type=float, default=5.0)
    ap.add_argument("--sleep-ms", default="0,0.1", help="the core's pause after each busy spell")
    ap.add_argument("--count", type=int, default=96)
    args = ap.parse_args()
    print(f"commit: {commit()}")
    picked = distinct_schemas(DEFAULT_SCHEMAS, args.count)
    specs = [json.dumps(schema) for _, schema in picked]
    own = sys.getswitchinterval()
    tokenizer = default_tokenizer()
    print(
        "\n| switch interval ms | core pause ms | compiles ms | core steps/s |\n|---|---|---|---|"
    )
    for interval in (float(v) for v in args.intervals.split(",")):
        for pause in (float(v) for v in args.sleep_ms.split(",")):
            compiler = GrammarCompiler(tokenizer, max_workers=8, cache_size=0)
            compiler.compile("json_schema", {"type": "string"})  # (its threads started)
            sys.setswitchinterval(interval / 1000)
            stop: list = []
            steps: list = []
            thread = threading.Thread(target=core, args=(stop, steps, args.busy_ms, pause))
            thread.start()
            time.sleep(0.05)
            before = len(steps)
            t0 = time.perf_counter()
            futures = [compiler.compile_async("json_schema", s) for s in specs]
            for f in futures:
                f.exception()  # (a refused schema counts as compiled: its refusal is the result)
            wall = time.perf_counter() - t0
            made = len(steps) - before
            stop.append(1)
            thread.join()
            sys.setswitchinterval(own)
            compiler.close()
            print(
                f"| {interval:g} | {pause:g} | {wall * 1e3:.0f} | {made / wall:.0f} |", flush=True
            )
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Write one JSON example of {name[:-5]}, as JSON."}],
            tokenize=False,
        )
        for name, _ in picked
    ]
    ways = {
        "Hugging Face's encode": lambda t: tokenizer.encode(t, add_special_tokens=False),
        "text_ids (the engine's)": lambda t: text_ids(tokenizer, t),
    }
    assert all(
        ways["text_ids (the engine's)"](t) == ways["Hugging Face's encode"](t) for t in prompts
    )
    print(
        f"\n{len(prompts)} prompts tokenized one by one, us a prompt (switch interval "
        f"{own * 1e3:g} ms, the busy thread's spells {args.busy_ms:g} ms)\n"
        "\n| way | alone | beside the busy thread |\n|---|---|---|"
    )
    for name, encode in ways.items():
        row = []
        for busy in (False, True):
            stop, steps = [], []
            thread = threading.Thread(target=core, args=(stop, steps, args.busy_ms, 0.0))
            if busy:
                thread.start()
                time.sleep(0.05)
            t0 = time.perf_counter()
            for text in prompts:
                encode(text)
            row.append((time.perf_counter() - t0) / len(prompts) * 1e6)
            stop.append(1)
            if busy:
                thread.join()
        print(f"| {name} | {row[0]:.0f} | {row[1]:.0f} |", flush=True)


if __name__ == "__main__":
    main()
