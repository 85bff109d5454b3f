"""RadixAttention's payoff: requests sharing a long system prompt, and a multi-turn chat, run with the
prefix cache on and off in the same process.

    python -m benchmarks.shared_prefix [--groups 4] [--per-group 16] [--prefix 1000]

Prints the prefix-hit fraction against the ideal (every request but the first of each group hits
the whole shared prefix), the wall-time ratio, and the time per turn of a chat that resends its
whole history each turn.
"""

from __future__ import annotations

import argparse
import random
import time

import radixlm
from benchmarks.common import commit, device_line


def shared_prefix_workload(args, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    prompts = []
    for _ in range(args.groups):
        prefix = [rng.randrange(100, vocab) for _ in range(args.prefix)]
        for _ in range(args.per_group):
            prompts.append(prefix + [rng.randrange(100, vocab) for _ in range(args.question)])
    rng.shuffle(prompts)
    return prompts


def run_shared(engine, prompts, answer: int) -> tuple[float, int]:
    before = engine.get_stats()["cached_tokens"]
    t = time.perf_counter()
    engine.generate(
        input_ids=prompts,
        sampling_params={"max_new_tokens": answer, "temperature": 0, "ignore_eos": True},
    )
    return time.perf_counter() - t, engine.get_stats()["cached_tokens"] - before


def run_chat(engine, turns: int, turn_len: int, answer: int, vocab: int) -> list[float]:
    rng = random.Random(1)
    history: list[int] = []
    times = []
    for _ in range(turns):
        history += [rng.randrange(100, vocab) for _ in range(turn_len)]
        t = time.perf_counter()
        out = engine.generate(
            input_ids=history,
            sampling_params={"max_new_tokens": answer, "temperature": 0, "ignore_eos": True},
        )
        times.append(time.perf_counter() - t)
        history += out["output_ids"]
    return times


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--per-group", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=1000)
    ap.add_argument("--question", type=int, default=64)
    ap.add_argument("--answer", type=int, default=32)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--turn-len", type=int, default=200)
    args = ap.parse_args()

    print(f"device: {device_line()}  commit: {commit()}")
    results = {}
    for cache in (True, False):
        with radixlm.Engine(args.model_path, disable_radix_cache=not cache) as engine:
            vocab = engine.model_config.vocab_size
            prompts = shared_prefix_workload(args, vocab)
            engine.generate(
                input_ids=[[1000, 1001, 1002]], sampling_params={"max_new_tokens": 2}
            )  # warm-up
            wall, hit = run_shared(engine, prompts, args.answer)
            chat = run_chat(engine, args.turns, args.turn_len, args.answer, vocab)
            results[cache] = (wall, hit, chat)

    ideal = args.groups * (args.per_group - 1) * args.prefix
    (wall_on, hit_on, chat_on), (wall_off, _, chat_off) = results[True], results[False]
    n = args.groups * args.per_group
    print(f"\nshared prefix: {n} requests in {args.groups} groups, {args.prefix}-token prefix, "
          f"{args.question}-token questions, {args.answer}-token answers")  # fmt: skip
    print("| cache | wall s | prefix tokens hit | of ideal |\n|---|---|---|---|")
    print(f"| on | {wall_on:.2f} | {hit_on} | {hit_on / ideal:.1%} |")
    print(f"| off | {wall_off:.2f} | 0 | 0% |")
    print(f"speed-up with the cache: {wall_off / wall_on:.2f}x")
    print(
        f"\nmulti-turn chat: {args.turns} turns of {args.turn_len} new tokens + {args.answer}-token answers"
    )
    print("| turn | history tokens | cache on s | cache off s |\n|---|---|---|---|")
    for i, (a, b) in enumerate(zip(chat_on, chat_off)):
        print(f"| {i + 1} | {(i + 1) * (args.turn_len + args.answer)} | {a:.2f} | {b:.2f} |")
    print(
        f"last/first turn time: cache on {chat_on[-1] / chat_on[0]:.2f}x, off {chat_off[-1] / chat_off[0]:.2f}x"
    )


if __name__ == "__main__":
    main()
