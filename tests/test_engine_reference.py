"""The engine against Hugging Face transformers on the real default model: same greedy tokens,
same log-probabilities, alone, batched, chunked and under preemption."""

from __future__ import annotations

import pytest
import torch

import radixlm
from tests.prompts import varied_prompts

NEW_TOKENS = 16
TIE_MARGIN = 1e-4  # a top-2 logit gap below this may flip with floating-point order


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in varied_prompts()]
    assert min(map(len, ids)) == 1 and max(map(len, ids)) > 1000
    return ids


@pytest.fixture(scope="module")
def reference(hf_model, prompt_ids):
    """transformers' greedy decoding with its own KV cache: tokens and per-step logits."""
    out = []
    with torch.inference_mode():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            past, tokens, logits = None, [], []
            for _ in range(NEW_TOKENS):
                res = hf_model(input_ids=x, past_key_values=past, use_cache=True)
                past = res.past_key_values
                step = res.logits[0, -1].float()
                token = int(step.argmax())
                tokens.append(token)
                logits.append(step)
                x = torch.tensor([[token]])
            out.append((tokens, torch.stack(logits)))
    return out


def check_against_reference(outputs, reference, check_logprobs: bool = False) -> list[str]:
    """Assert token-for-token equality; return the near-tie divergences (reported, not failed)."""
    near_ties = []
    for i, (out, (ref_tokens, ref_logits)) in enumerate(zip(outputs, reference)):
        ours = out["output_ids"]
        assert len(ours) == NEW_TOKENS, out["meta_info"]
        for j, (a, b) in enumerate(zip(ours, ref_tokens)):
            if a != b:
                top2 = ref_logits[j].topk(2).values
                margin = float(top2[0] - top2[1])
                assert margin < TIE_MARGIN, (
                    f"prompt {i}: token {j} differs ({a} vs {b}), margin {margin}"
                )
                near_ties.append(f"prompt {i} token {j}: margin {margin:.2e}")
                break
            if check_logprobs:
                ref_lp = torch.log_softmax(ref_logits[j], -1)[b].item()
                lp = out["meta_info"]["output_token_logprobs"][j][0]
                assert abs(lp - ref_lp) < 1e-3, f"prompt {i} token {j}: logprob {lp} vs {ref_lp}"
    return near_ties


GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}


def test_greedy_one_at_a_time_matches_transformers(engine, prompt_ids, reference):
    outputs = [
        engine.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True)
        for ids in prompt_ids
    ]
    ties = check_against_reference(outputs, reference, check_logprobs=True)
    assert len(ties) <= 1, ties


def test_greedy_in_a_mixed_batch_of_32_matches_transformers(engine, prompt_ids, reference):
    # the 24 greedy prompts share their batch with 8 sampled, penalized, longer requests
    noise = {
        "max_new_tokens": 24,
        "temperature": 0.9,
        "top_k": 40,
        "frequency_penalty": 0.5,
        "seed": 3,
    }
    outputs = engine.generate(
        input_ids=prompt_ids + prompt_ids[:8], sampling_params=[GREEDY] * 24 + [noise] * 8
    )
    ties = check_against_reference(outputs[:24], reference)
    assert len(ties) <= 1, ties


def test_chunked_prefill_matches_transformers(default_model_folder, prompt_ids, reference):
    # small prefill chunks and a pool barely larger than the longest request: long prompts are
    # computed in many chunks, interleaved with other requests' decodes. The prompts up to ~1,100
    # tokens (12 chunks): the two longer ones would only add chunks of the same kind, at nearly
    # half the test's time.
    subset = [i for i, ids in enumerate(prompt_ids) if len(ids) <= 1100]
    assert len(subset) == len(prompt_ids) - 2 and max(len(prompt_ids[i]) for i in subset) > 1000
    longest = max(len(prompt_ids[i]) for i in subset) + NEW_TOKENS
    with radixlm.Engine(
        default_model_folder, max_total_tokens=longest + 200, chunked_prefill_size=96
    ) as eng:
        outputs = eng.generate(input_ids=[prompt_ids[i] for i in subset], sampling_params=GREEDY)
        stats = eng.get_stats()
    ties = check_against_reference(outputs, [reference[i] for i in subset])
    assert len(ties) <= 1, ties
    assert (
        stats["kv_pool_free_tokens"] + stats["radix_cache_tokens"]
        == stats["kv_pool_capacity_tokens"]
    )


@pytest.mark.parametrize("disable_radix_cache", [False, True])
def test_preemption_matches_transformers(
    default_model_folder, prompt_ids, reference, disable_radix_cache
):
    # every short prompt is admitted in the first step into a pool with room for only a few
    # decode steps: running requests must be preempted and resumed
    subset = range(12)
    pool = sum(len(prompt_ids[i]) for i in subset) + 24
    with radixlm.Engine(
        default_model_folder, max_total_tokens=pool, disable_radix_cache=disable_radix_cache
    ) as eng:
        outputs = eng.generate(input_ids=[prompt_ids[i] for i in subset], sampling_params=GREEDY)
        stats = eng.get_stats()
    assert stats["num_preemptions"] > 0, stats
    ties = check_against_reference(outputs, [reference[i] for i in subset])
    assert len(ties) <= 1, ties
    assert (
        stats["kv_pool_free_tokens"] + stats["radix_cache_tokens"]
        == stats["kv_pool_capacity_tokens"]
    )


def test_input_logprobs_match_transformers(engine, hf_model, prompt_ids):
    ids = prompt_ids[13][:200]
    out = engine.generate(
        input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0},
        return_logprob=True, logprob_start_len=0, top_logprobs_num=3,
    )  # fmt: skip
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    got = out["meta_info"]["input_token_logprobs"]
    assert len(got) == len(ids) and got[0][0] is None
    for pos in range(1, len(ids)):
        lp, token, _ = got[pos]
        assert token == ids[pos]
        assert abs(lp - ref[pos - 1, token].item()) < 1e-3
    tops = out["meta_info"]["input_top_logprobs"]
    assert [t for _, t, _ in tops[5]] == ref[4].topk(3).indices.tolist()
