"""Programs through the DSL with prefix reuse, against the same calls sent one by one without it.

    python -m benchmarks.programs [--programs 16] [--fork 8]

1. Few-shot: --programs programs share a long few-shot prefix and each asks its own question
   (`run_batch`); the baseline sends the same prompts one at a time to an engine with the radix
   cache off.
2. Fork: one program with a ~1,000-token context forks --fork ways (`s.fork`); the baseline sends each
   branch's full prompt one at a time to an engine with the radix cache off.
Greedy, fixed lengths; prints wall times and the speed-up.
"""

from __future__ import annotations

import argparse
import time

import radixlm
import radixlm as sgl
from benchmarks.common import commit, device_line

SHOT = (
    "Q: Which planet is known as the red planet?\nA: Mars\n"
    "Q: What is the largest ocean on Earth?\nA: The Pacific Ocean\n"
    "Q: Who painted the Mona Lisa?\nA: Leonardo da Vinci\n"
)
FEW_SHOT = SHOT * 12  # ~600 tokens of shared prefix
CONTEXT = (
    "Report. The river valley was settled early; farms spread along both banks, and the town grew "
    "around the bridge that joined them. Trade followed the water, and so did floods. "
) * 28  # ~1,000 tokens
QUESTIONS = [f"What is {a} plus {b}?" for a, b in zip(range(3, 40, 2), range(5, 60, 3))]
ANSWER = 16


@sgl.function
def few_shot(s, question):
    s += FEW_SHOT + "Q: " + question + "\nA:"
    s += sgl.gen("answer", max_tokens=ANSWER, temperature=0, ignore_eos=True)


@sgl.function
def forked(s, ways):
    s += CONTEXT + "\nThree different one-line summaries:\n"
    forks = s.fork(ways)
    for i, f in enumerate(forks):
        f += f"{i + 1}."
        f += sgl.gen("summary", max_tokens=ANSWER, temperature=0, ignore_eos=True)
    forks.join()


def one_by_one(engine, prompts):
    params = {"max_new_tokens": ANSWER, "temperature": 0, "ignore_eos": True}
    t = time.perf_counter()
    for p in prompts:
        engine.generate(p, params)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--programs", type=int, default=16)
    ap.add_argument("--fork", type=int, default=8)
    args = ap.parse_args()
    print(f"device: {device_line()}  commit: {commit()}")
    questions = (QUESTIONS * (args.programs // len(QUESTIONS) + 1))[: args.programs]

    with radixlm.Engine(args.model_path) as engine:
        engine.generate("warm-up", {"max_new_tokens": 2})
        t = time.perf_counter()
        states = few_shot.run_batch(
            [{"question": q} for q in questions], backend=engine, num_threads=args.programs
        )
        dsl_few = time.perf_counter() - t
        assert all(st["answer"] for st in states)
        engine.flush_cache()
        t = time.perf_counter()
        state = forked.run(ways=args.fork, backend=engine)
        state.sync()
        dsl_fork = time.perf_counter() - t
        stats = engine.get_stats()

    with radixlm.Engine(args.model_path, disable_radix_cache=True) as engine:
        engine.generate("warm-up", {"max_new_tokens": 2})
        base_few = one_by_one(engine, [FEW_SHOT + "Q: " + q + "\nA:" for q in questions])
        branch = CONTEXT + "\nThree different one-line summaries:\n"
        base_fork = one_by_one(engine, [branch + f"{i + 1}." for i in range(args.fork)])

    print(
        "\n| workload | DSL with prefix reuse s | one by one, no reuse s | speed-up |\n|---|---|---|---|"
    )
    print(
        f"| few-shot, {args.programs} programs | {dsl_few:.2f} | {base_few:.2f} | {base_few / dsl_few:.2f}x |"
    )
    print(
        f"| fork {args.fork} ways, ~1,000-token context | {dsl_fork:.2f} | {base_fork:.2f} | {base_fork / dsl_fork:.2f}x |"
    )
    print(
        f"(DSL engine: {stats['prompt_tokens']} prompt tokens admitted, {stats['cached_tokens']} from the cache)"
    )


if __name__ == "__main__":
    main()
