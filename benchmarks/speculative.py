"""Speculative decoding against plain decoding in one run, greedy, each request alone (batch 1),
or with `--batch N` the prompts repeated to N requests submitted at once.
NGRAM runs extraction prompts whose answers copy from their input; MEDUSA (the heads shipped for
the default model, or --draft-model-path) runs chat prompts unlike any the heads trained on (the
built-in set of `radixlm train-draft` is instruction templates over a list of subjects), and so
does STANDALONE (--draft-model-path; by default the default model drafting for itself, which
shows what a drafting round costs: no smaller model of its tokenizer ships), and EAGLE3 too
(the draft shipped for the default model, or --draft-model-path). Prints
tokens/s with speculation off and on, the mean accepted length (tokens per verify step: accepted
draft tokens and the bonus token), the speed-up, and whether the outputs are token-for-token equal
(they must be).

    python -m benchmarks.speculative [--algorithm NGRAM|MEDUSA|STANDALONE|EAGLE3] [--device cpu] [--new-tokens 64]
        [--num-draft-tokens 8] [--draft-model-path DIR] [--dtype float32] [--batch 32]
        [--eagle-topk 2] [--no-adaptive] [--prompts builtin]
"""

from __future__ import annotations

import argparse
import time

import radixlm
from benchmarks.common import commit, device_line

_RECORDS = [
    "Name: Alice Johnson\nEmail: alice.johnson@example.com\nPhone: 555-0142\nCity: Springfield\n"
    "Order: #88213, two blue notebooks, shipped 2026-11-28",
    "Invoice 4471 from Northwind Traders to Contoso Ltd, dated 2026-10-02: 12 units of part "
    "XK-200 at 14.50 each, total 174.00, due within 30 days.",
    "def parse_config(path):\n    with open(path) as f:\n        data = json.load(f)\n    "
    "return Config(host=data['host'], port=int(data['port']), debug=data.get('debug', False))",
    "Meeting notes, 2 December: Maria will send the draft budget by Friday; Tom books the room "
    "for the review on the 9th; the launch moves to January 15.",
]
_ASKS = [
    "Repeat this record exactly, line by line:",
    "Copy the invoice text below word for word:",
    "Rewrite this function exactly as it is:",
    "Quote these notes verbatim:",
]


# chat prompts for MEDUSA: none of them an instance of train-draft's built-in templates
_CHATS = [
    "My sourdough starter smells like nail polish remover. Is it ruined, and what should I do?",
    "Draft a polite message to my landlord asking when the broken heater will be repaired.",
    "Why do cats knead blankets with their paws?",
    "I have 40 minutes a day. Suggest a realistic plan to get better at drawing.",
    "What is the difference between a virus and a bacterium?",
    "Tell my daughter a bedtime tale, under 150 words, of a turtle who fears the dark.",
    "How do I reverse a string in JavaScript? Show two ways.",
    "Give me tips for staying focused when working from home.",
]


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def prompts(algorithm: str = "NGRAM", prompt_set: str = "default") -> list[str]:
    """The run's prompts: extraction prompts for NGRAM, chat prompts for the drafts, or with
    prompt_set="builtin" 8 of `radixlm train-draft`'s built-in instructions (a seeded sample:
    the distribution the shipped drafts trained on, some of them perhaps among their prompts)."""
    if prompt_set == "builtin":
        import random

        from radixlm.runtime.speculative.draft_data import builtin_prompts

        return [chat(text) for text in builtin_prompts(8, random.Random(12345))]
    if algorithm in ("MEDUSA", "STANDALONE", "EAGLE", "EAGLE3"):
        return [chat(text) for text in _CHATS]
    return [chat(f"{ask}\n{record}") for ask, record in zip(_ASKS, _RECORDS)]


def run(
    device: str,
    new_tokens: int,
    algorithm: str,
    dtype: str = "float32",
    profile: int = 0,
    batch: int = 1,
    prompt_set: str = "default",
    **spec,
) -> tuple[float, list[list[int]], list[float], int | None]:
    """(tokens/s over all prompts one at a time, each output, each accepted length, the
    positions a verify step computes); with
    `profile`, then all the prompts again (the batch again) under cProfile, whose top functions
    it prints. With
    `batch` above 1, the prompts repeated to that many requests, submitted at once."""
    params = {"max_new_tokens": new_tokens, "temperature": 0}
    with radixlm.Engine(device=device, dtype=dtype, **spec) as eng:
        # warm-up: a whole request, so that the kernels of every step shape a round takes
        # (prompt, draft, verify) compile and capture here, not inside the timed run
        texts = prompts(algorithm, prompt_set)
        eng.generate(texts[0], params)
        outs, tokens, seconds = [], 0, 0.0
        before = eng.get_stats()
        gate = eng._core.speculative.gate if eng._core.speculative is not None else None
        many = [texts[i % len(texts)] for i in range(batch)]
        if batch > 1:
            # once untimed: the kernels of this batch's step shapes compile now (a verify step at
            # a new shape compiled for seconds inside the timed run), as a server's would have
            eng.generate(many, params)
            counted = (gate.draft_steps, gate.plain_steps) if gate is not None else None
            t = time.perf_counter()
            outs = eng.generate(many, params)
            seconds = time.perf_counter() - t
            tokens = sum(len(o["output_ids"]) for o in outs)
            if counted is not None:
                print(
                    f"timed batch: {gate.draft_steps - counted[0]} steps drafted, "
                    f"{gate.plain_steps - counted[1]} kept plain by the gate"
                )
        for prompt in texts if batch == 1 else ():
            t = time.perf_counter()
            out = eng.generate(prompt, params)
            seconds += time.perf_counter() - t
            tokens += len(out["output_ids"])
            outs.append(out)
        print(f"{spec.get('speculative_algorithm', 'plain')}: {_phases(before, eng.get_stats())}")
        if profile:
            if batch > 1:
                _profiled(eng, lambda: eng.generate(many, params), profile)
            else:
                _profiled(eng, lambda: [eng.generate(p, params) for p in texts], profile)
        spec = eng._core.speculative
        verify_rows = spec.num_draft_tokens if spec is not None else None
        if gate is not None:
            print(
                f"the gate kept {gate.plain_steps} steps from drafting and let "
                f"{gate.draft_steps} draft (warm-up included); "
                f"its tokens/s by "
                f"(batch bucket, verified): {gate.rates()}"
            )
    return (
        tokens / seconds,
        [o["output_ids"] for o in outs],
        [o["meta_info"].get("spec_accept_length", 1.0) for o in outs],
        verify_rows,
    )


def _profiled(engine, work, top: int) -> None:
    """Run `work()` under cProfile (enabled on the engine core's thread, between two steps) and
    print the `top` functions by own time, with the engine's host time per step by phase."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    before = engine.get_stats()
    engine._core.call(prof.enable)
    work()
    engine._core.call(prof.disable)
    print(f"\nprofiled: {_phases(before, engine.get_stats())}")
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def _phases(before: dict, after: dict) -> str:
    """The engine core's steps between two stats snapshots and its host time a step by phase."""
    steps = max(1, after["num_steps"] - before["num_steps"])
    phases = ", ".join(
        f"{k.removeprefix('host_seconds_')} {(after[k] - before[k]) / steps * 1e3:.2f}"
        for k in after
        if k.startswith("host_seconds_")
    )
    return f"{steps} steps; host ms/step: {phases}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--algorithm", default="NGRAM", choices=["NGRAM", "MEDUSA", "STANDALONE", "EAGLE", "EAGLE3"]
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", help="float32: exact; bfloat16 on a GPU")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument(
        "--num-draft-tokens", type=int, default=None, help="default: 8 (NGRAM), the heads + 1"
    )
    ap.add_argument(
        "--draft-model-path", default=None,
        help="MEDUSA: the heads' folder; STANDALONE: the draft model; EAGLE3: the draft's folder",
    )  # fmt: skip
    ap.add_argument(
        "--batch", type=int, default=1,
        help="the prompts repeated to this many requests, submitted at once (default: one at "
        "a time)",
    )  # fmt: skip
    ap.add_argument(
        "--eagle-topk", type=int, default=1,
        help="speculative_eagle_topk: candidate paths of a draft (above 1: a tree)",
    )  # fmt: skip
    ap.add_argument(
        "--no-adaptive", action="store_true",
        help="draft at every step (speculative_adaptive off): the verify path alone",
    )  # fmt: skip
    ap.add_argument(
        "--prompts", default="default", choices=["default", "builtin"],
        help="builtin: 8 of train-draft's built-in instructions (the drafts' training "
        "distribution) instead of the extraction or chat prompts",
    )  # fmt: skip
    ap.add_argument(
        "--profile", type=int, default=0, metavar="N",
        help="then the speculative run once more under cProfile: its N costliest functions",
    )  # fmt: skip
    args = ap.parse_args()
    algorithm = args.algorithm
    plain_rate, plain_ids, _, _ = run(
        args.device, args.new_tokens, algorithm, args.dtype, batch=args.batch,
        prompt_set=args.prompts,
    )  # fmt: skip
    spec = {"speculative_algorithm": algorithm}
    k = args.num_draft_tokens or (8 if algorithm == "NGRAM" else None)
    if k is not None:
        spec["speculative_num_draft_tokens"] = k
    if args.draft_model_path:
        spec["speculative_draft_model_path"] = args.draft_model_path
    elif algorithm == "STANDALONE":  # (no smaller model of its tokenizer ships: the model itself)
        from radixlm.runtime.config import default_cache_dir
        from radixlm.runtime.model_loader import resolve_model_folder

        spec["speculative_draft_model_path"] = str(resolve_model_folder(None, default_cache_dir()))
    if args.no_adaptive:
        spec["speculative_adaptive"] = False
    if args.eagle_topk > 1:
        spec["speculative_eagle_topk"] = args.eagle_topk
    spec_rate, spec_ids, accepted, verify_rows = run(
        args.device, args.new_tokens, algorithm, args.dtype, args.profile, args.batch,
        args.prompts, **spec,
    )  # fmt: skip
    kind = "extraction" if algorithm == "NGRAM" else "chat"
    if args.prompts == "builtin":
        kind = "built-in instruction"
    print(f"device: {device_line()}; commit {commit()}")
    print(
        f"{len(plain_ids)} {kind} prompts, batch {args.batch}, greedy, {args.new_tokens} new "
        "tokens, "
        f"{args.dtype}"
    )
    print(f"plain:        {plain_rate:7.1f} tok/s")
    print(
        f"{algorithm} (k={verify_rows}, topk {args.eagle_topk}): {spec_rate:7.1f} tok/s, "
        "mean accepted length "
        f"{sum(accepted) / len(accepted):.2f} ({', '.join(f'{a:.2f}' for a in accepted)})"
    )
    print(f"speed-up: {spec_rate / plain_rate:.2f}x; outputs equal: {spec_ids == plain_ids}")
    if spec_ids != plain_ids:  # (in bf16 a verify of k rows rounds apart from a decode step)
        firsts = [_first_difference(a, b) for a, b in zip(plain_ids, spec_ids)]
        print(
            "first differing token per prompt (None: equal): "
            + ", ".join(f"{f} of {len(a)}" for f, a in zip(firsts, plain_ids))
        )
        if args.dtype != "float32" and args.batch == 1:
            texts = prompts(algorithm, args.prompts)
            _near_ties(args.device, texts, plain_ids, spec_ids, firsts)


def _near_ties(device: str, texts: list[str], plain_ids, spec_ids, firsts) -> None:
    """Where bf16 outputs first differ, the float32 model's log-probabilities of the two tokens
    after the common prefix: a divergence the exactness rule allows sits at a near-tie of the
    float32 logits (the two tokens its top two, close together)."""
    params = {"max_new_tokens": 1, "temperature": 0}
    rows = []
    with radixlm.Engine(device=device, dtype="float32") as eng:
        for i, at in enumerate(firsts):
            if at is None:
                continue
            ids = eng.tokenizer.encode(texts[i], add_special_tokens=False)
            out = eng.generate(
                input_ids=ids + plain_ids[i][:at], sampling_params=params, return_logprob=True,
                top_logprobs_num=2,
            )  # fmt: skip
            top = out["meta_info"]["output_top_logprobs"][0]  # [(logprob, id, text), ...]
            pair = {plain_ids[i][at], spec_ids[i][at]}
            gap = top[0][0] - top[1][0]
            rows.append((i, at, gap, {t[1] for t in top} == pair))
    print("float32 at each first difference (prompt, token, top-2 log-prob gap, the two tokens "
          "are float32's top two): " + "; ".join(f"{i}, {at}, {gap:.4f}, {both}"
                                                for i, at, gap, both in rows))  # fmt: skip


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


if __name__ == "__main__":
    main()
