"""The engine core's grammar work in one decode step, by part, for B requests with B distinct
schemas (the schemas `constrained_throughput --distinct B` picks), without a model: each request
walks the tokens of one valid instance of its schema (then EOS, then starts again), and each step
does what the engine core does for its grammars, in its order:

    take     the step's tokens: together in llguidance's threads (accept_next_tokens, the
             engine's way), then each request's own `accept_token` (answered at once); or,
             with `--take one-by-one`, each `accept_token` taking its own
    begin    the next step's masks begin filling in another thread (begin_next_token_bitmasks)
    ask      each request's own questions as its token is applied (is_terminated,
             jump_forward_string), while the masks fill
    wait     the masks' result (the sampler's wait)

The first three run on the core thread holding the GIL (the host's work a step, on top of a
plain request's); `wait` is what the fill adds after them. Run once with each `--take` to
compare the two ways on a host (one process each: llguidance's threads spin a while after a
call).

    python -m benchmarks.grammar_step [--batch 96] [--steps 300]
        [--take together|one-by-one] [--tokenizer DIR] [--executor-threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from benchmarks.common import commit, device_line
from benchmarks.constrained_throughput import DEFAULT_SCHEMAS, distinct_schemas
from benchmarks.grammar import instance_tokens


def load_requests(
    compiler, tokenizer, eos: int, folder: Path, count: int
) -> list[tuple[str, object, list]]:
    """(name, grammar, instance tokens + EOS) of the picked schemas that compile and have a valid
    instance their grammar takes token by token."""
    picked = []
    for name, schema in distinct_schemas(folder, count):
        case = json.loads((folder / name).read_text())
        valid = [t for t in case.get("tests", []) if t.get("valid")]
        if not valid:
            continue
        try:
            grammar = compiler.compile("json_schema", json.dumps(schema))
        except ValueError:  # refused: it would fail alone in the engine
            continue
        tokens = instance_tokens(schema, valid[0]["data"], tokenizer)
        matcher = grammar.matcher()
        if all(matcher.accept_token(t) for t in tokens) and matcher.accept_token(eos):
            picked.append((name, grammar, [*tokens, eos]))
    return picked


def run(picked: list, steps: int, take: str, vocab_size: int) -> dict[str, list[float]]:
    from radixlm.constrained import (
        accept_next_tokens,
        allocate_token_bitmask,
        begin_next_token_bitmasks,
    )

    matchers = [grammar.matcher() for _, grammar, _ in picked]
    at = [0] * len(picked)
    bitmask = allocate_token_bitmask(len(picked), vocab_size)
    times: dict[str, list[float]] = {"take": [], "begin": [], "ask": [], "wait": []}
    for _ in range(steps):
        tokens = [picked[i][2][at[i]] for i in range(len(picked))]
        t0 = time.perf_counter()
        if take == "together":
            accept_next_tokens(matchers, tokens)
        for m, t in zip(matchers, tokens):
            if not m.accept_token(t):
                raise RuntimeError("a valid instance's token was refused")
        t1 = time.perf_counter()
        for i in range(len(picked)):  # (a finished request's seat goes to a new one)
            at[i] += 1
            if at[i] == len(picked[i][2]):
                matchers[i], at[i] = picked[i][1].matcher(), 0
        t2 = time.perf_counter()
        pending = begin_next_token_bitmasks(matchers, bitmask)
        t3 = time.perf_counter()
        for m in matchers:
            if not m.is_terminated():
                m.jump_forward_string()
        t4 = time.perf_counter()
        pending.result()
        t5 = time.perf_counter()
        times["take"].append(t1 - t0)
        times["begin"].append(t3 - t2)
        times["ask"].append(t4 - t3)
        times["wait"].append(t5 - t4)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batch", type=int, default=96, help="distinct schemas picked")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--take", choices=("together", "one-by-one"), default="together")
    ap.add_argument("--schemas-dir", type=Path, default=DEFAULT_SCHEMAS)
    ap.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: the model's)")
    ap.add_argument(
        "--executor-threads", type=int, default=None,
        help="llguidance's threads for the batches (default: its own choice)",
    )  # fmt: skip
    args = ap.parse_args()

    from radixlm.constrained import GrammarCompiler
    from radixlm.constrained.llguidance_backend import LLGuidanceBackend

    LLGuidanceBackend.executor_threads = args.executor_threads

    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        from radixlm.runtime.model_loader import default_tokenizer

        tokenizer = default_tokenizer()
    compiler = GrammarCompiler(tokenizer, eos_token_ids=[tokenizer.eos_token_id])
    picked = load_requests(
        compiler, tokenizer, tokenizer.eos_token_id, args.schemas_dir, args.batch
    )
    print(f"device: {device_line()}  commit: {commit()}")
    print(
        f"{len(picked)} requests (of {args.batch} schemas picked: those that compile and whose "
        f"first valid instance their grammar takes), {args.steps} steps, take={args.take}, "
        f"llguidance's threads: {args.executor_threads or 'its own choice'}"
    )
    run(picked, 20, args.take, compiler.vocab_size)  # (warm: lexer states, threads)
    times = run(picked, args.steps, args.take, compiler.vocab_size)
    total = [sum(parts) for parts in zip(*times.values())]
    core = [a + b + c for a, b, c in zip(times["take"], times["begin"], times["ask"])]
    print("\n| part | p50 ms | p90 ms | per request p50 us |\n|---|---|---|---|")
    for label, ts in [*times.items(), ("core thread (take + begin + ask)", core), ("all", total)]:
        ms = sorted(1e3 * t for t in ts)
        p50, p90 = statistics.median(ms), ms[int(0.9 * (len(ms) - 1))]
        print(f"| {label} | {p50:.3f} | {p90:.3f} | {1e3 * p50 / len(picked):.1f} |")


if __name__ == "__main__":
    main()
