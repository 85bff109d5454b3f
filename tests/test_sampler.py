"""The sampler alone: its batched filters against a row-by-row reference, the counter-based noise,
and sampled frequencies against the distribution they sample from."""

from __future__ import annotations

import math

import pytest
import torch

from radixlm.kernels.sampling_ref import exponential_noise, filtered_probs
from radixlm.protocol.sampling_params import SamplingParams
from radixlm.runtime.sampler import Sampler, SamplingRow
from tests.sampling_cases import SETTINGS, params


def row(p: SamplingParams, seed: int = 0, step: int = 0, **kw) -> SamplingRow:
    return SamplingRow(params=p, seed=seed, step=step, input_ids=[1], output_ids=[], **kw)


def reference_filtered(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row, the textbook way: softmax at temperature, min-p, then top-k, then top-p."""
    probs = torch.softmax(logits / p.temperature, dim=-1)
    if p.min_p > 0:
        probs = torch.where(probs < p.min_p * probs.max(), 0.0, probs)
    total = probs.sum()
    vals, order = probs.sort(descending=True)
    out = torch.zeros_like(probs)
    mass = 0.0
    for rank, (v, i) in enumerate(zip(vals.tolist(), order.tolist())):
        if p.top_k > 0 and rank >= p.top_k:
            break
        if p.top_p < 1.0 and mass >= p.top_p * float(total):
            break
        out[i] = v
        mass += v
    return out


def test_batched_filters_match_the_row_by_row_reference():
    gen = torch.Generator().manual_seed(0)
    settings = SETTINGS[:6]
    ps = [params(**s) for s in settings]
    logits = torch.randn(len(ps), 300, generator=gen) * 3
    got = filtered_probs(logits, ps)
    for i, p in enumerate(ps):
        want = reference_filtered(logits[i], p)
        assert torch.equal(got[i] > 0, want > 0), settings[i]
        torch.testing.assert_close(got[i], want)


def test_noise_is_exponential_and_a_function_of_seed_and_token():
    seeds = torch.tensor([1, 2, 3, 1], dtype=torch.int64)
    q = exponential_noise(seeds, 50_000)
    assert torch.equal(q[0], q[3]) and not torch.equal(q[0], q[1])
    assert (q > 0).all() and torch.isfinite(q).all()
    assert abs(float(q.mean()) - 1.0) < 0.01  # mean of Exp(1); sd of the mean ~0.0022
    assert abs(float((q < math.log(2)).float().mean()) - 0.5) < 0.005  # the median is ln 2
    # neighbouring tokens are not correlated
    corr = torch.corrcoef(torch.stack([q[0, :-1], q[0, 1:]]))[0, 1]
    assert abs(float(corr)) < 0.02


def test_sampled_frequencies_follow_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    logits = probs.log().expand(4000, -1).contiguous()
    p = params(temperature=1.0)
    rows = [row(p, seed=s) for s in range(4000)]
    counts = torch.bincount(torch.tensor(Sampler()(logits, rows).token_ids), minlength=5)
    expected = probs * 4000
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 18.5, (counts.tolist(), chi2)  # p = 0.001 for 4 degrees of freedom


def test_sampling_is_the_same_whatever_else_is_in_the_batch():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 1000, generator=gen)
    p_sample, p_greedy = params(temperature=0.8, top_p=0.9), params(temperature=0)
    rows = [row(p_sample if i % 2 else p_greedy, seed=10 + i, step=3) for i in range(6)]
    together = Sampler()(logits, rows).token_ids
    alone = [Sampler()(logits[i : i + 1], [rows[i]]).token_ids[0] for i in range(6)]
    assert together == alone
    assert together[0] == int(logits[0].argmax())


def test_banned_tokens_and_plain_greedy():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 1.0, 2.0]])
    greedy = params(temperature=0)
    assert Sampler()(logits, [row(greedy), row(greedy)]).token_ids == [1, 0]
    out = Sampler()(logits, [row(greedy, banned_ids=(1,)), row(greedy, banned_ids=(0, 2))])
    assert out.token_ids == [2, 1]
    assert logits[0, 1] == 5.0  # the caller's logits are not modified


def test_logit_bias_moves_greedy_and_sampled_choices():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 1.0, 2.0]])
    banned = params(temperature=0, logit_bias={"1": -100})  # JSON's string keys
    forced = params(temperature=0, logit_bias={2: 100.0})
    assert not row(banned).is_plain_greedy
    assert Sampler()(logits, [row(banned), row(forced)]).token_ids == [2, 2]
    assert logits[0, 1] == 5.0  # the caller's logits are not modified
    # a sampled row: +100 leaves the other tokens e^-100 of the mass, never drawn in 64 seeds
    hot = params(temperature=1.0, logit_bias={0: 100})
    picks = {Sampler()(logits[1:], [row(hot, seed=s)]).token_ids[0] for s in range(64)}
    assert picks == {0}
    # the bias applies before the filters: banning the top token of a top-k=1 row
    top1 = params(temperature=1.0, top_k=1, logit_bias={1: -100})
    assert Sampler()(logits[:1], [row(top1)]).token_ids == [2]


def test_logit_bias_is_validated():
    for bad, needle in [
        ({"x": 1}, "token id"),
        ({-1: 1}, "token id"),
        ({3: 101}, r"\[-100, 100\]"),
        ({3: float("nan")}, "logit_bias"),
        ({3: True}, "logit_bias"),
        ([3, 1], "object"),
    ]:
        with pytest.raises(ValueError, match=needle):
            params(logit_bias=bad)
    assert params(logit_bias={}).logit_bias is None
    assert params(logit_bias={"7": -2}).logit_bias == {7: -2.0}


def test_a_uniform_that_rounds_to_one_leaves_masked_tokens_unchosen():
    # row seed 208044 draws 2**24 - 1 for token 49, and (2**24 - 1 + 0.5) / 2**24 rounds to 1 in
    # float32: the noise must stay positive, or a masked token's 0 / q is a NaN that argmax picks
    seeds = torch.tensor([208044], dtype=torch.int64)
    q = exponential_noise(seeds, 64)
    assert (q > 0).all()
    logits = torch.zeros(1, 64)
    logits[0, 49] = float("-inf")
    probs = filtered_probs(logits, [params(temperature=1.0)])
    assert int((probs / q).argmax()) != 49
