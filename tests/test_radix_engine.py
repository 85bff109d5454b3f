"""RadixAttention in the engine, on the real default model: reuse is reported, shared by forks,
and never changes an output."""

from __future__ import annotations

import pytest

import radixlm
from tests.prompts import varied_prompts

SYSTEM = (
    "<|im_start|>system\nYou are a careful assistant. Answer in one short sentence, and never "
    "invent facts. If you do not know, say so plainly.<|im_end|>\n"
)
QUESTIONS = [
    "What is the capital of Italy?",
    "Name a primary colour.",
    "What is 2 + 2?",
    "Who wrote Hamlet?",
]
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


def chat(q: str) -> str:
    return SYSTEM + f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def uncached_outputs(default_model_folder):
    prompts = [chat(q) for q in QUESTIONS] + varied_prompts()[:8]
    with radixlm.Engine(default_model_folder, disable_radix_cache=True) as eng:
        return prompts, [o["output_ids"] for o in eng.generate(prompts, GREEDY)]


def test_outputs_identical_with_cache_on_and_off_even_under_eviction(
    default_model_folder, uncached_outputs
):
    prompts, expected = uncached_outputs
    # a pool too small to keep everything: the tree must evict while prefixes are shared
    with radixlm.Engine(default_model_folder, max_total_tokens=400) as eng:
        first = [eng.generate(p, GREEDY)["output_ids"] for p in prompts]
        again = eng.generate(prompts, GREEDY)
        stats = eng.get_stats()
    assert first == expected
    assert [o["output_ids"] for o in again] == expected
    assert stats["cached_tokens"] > 0 and stats["radix_cache_tokens"] <= 400


def test_shared_system_prompt_is_reported_as_cached(engine, tokenizer):
    assert engine.flush_cache()
    outs = [engine.generate(chat(q), GREEDY) for q in QUESTIONS]
    system_len = len(tokenizer.encode(SYSTEM, add_special_tokens=False))
    assert outs[0]["meta_info"]["cached_tokens"] == 0
    for o in outs[1:]:
        assert o["meta_info"]["cached_tokens"] >= system_len - 1


def test_next_turn_reuses_the_whole_previous_turn(engine):
    assert engine.flush_cache()
    turn1 = chat(QUESTIONS[0])
    out1 = engine.generate(turn1, {"max_new_tokens": 12, "temperature": 0})
    history = (
        turn1
        + out1["text"]
        + "<|im_end|>\n<|im_start|>user\nAnd of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    out2 = engine.generate(history, {"max_new_tokens": 4, "temperature": 0})
    assert (
        out2["meta_info"]["cached_tokens"]
        >= out1["meta_info"]["prompt_tokens"] + len(out1["output_ids"]) - 2
    )


def test_forks_share_the_prefix_slots_and_match_independent_runs(engine):
    assert engine.flush_cache()
    prompt = chat("Write a tagline for a bakery.")
    params = {"max_new_tokens": 10, "temperature": 0.9, "seed": 100, "ignore_eos": True}
    forks = engine.generate(prompt, {**params, "n": 8})
    stats = engine.get_stats()
    # the tree holds the prompt once plus each branch: exactly the distinct prefixes of all requests
    ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
    seqs = [ids + f["output_ids"][:-1] for f in forks]  # the newest token of each has no KV
    distinct = {tuple(s[:k]) for s in seqs for k in range(1, len(s) + 1)}
    assert stats["radix_cache_tokens"] == len(distinct)
    assert sum(f["meta_info"]["cached_tokens"] >= len(ids) - 1 for f in forks) == 7
    assert len({tuple(f["output_ids"]) for f in forks}) > 1
    assert engine.flush_cache()
    for k, fork in enumerate(forks):
        alone = engine.generate(prompt, {**params, "seed": 100 + k})
        assert alone["output_ids"] == fork["output_ids"]


def test_flush_cache_refuses_while_requests_run(engine):
    stream = engine.generate(
        chat("Count to fifty."), {"max_new_tokens": 64, "ignore_eos": True}, stream=True
    )
    next(stream)
    assert engine.flush_cache() is False
    stream.close()
    assert engine.flush_cache() is True
    assert engine.get_stats()["radix_cache_tokens"] == 0
