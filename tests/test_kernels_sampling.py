"""The fused sampling kernel (kernels/sampling.py) against its torch oracle, kernels/sampling_ref.py
(`sample_ref`: `filtered_probs`, `exponential_noise`, argmax of p / q): the same token for the same
seeds.
Without CUDA under TRITON_INTERPRET=1 at small sizes; on a GPU also at 256 x 128256.

The logits are random normals: in them no two race scores are within float32 rounding of each
other and no token sits within rounding of a min-p or top-p boundary, the cases where the two
paths may differ by design. Exact ties at the top-k / top-p boundary have their own test: both
paths keep every tied token."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from radixlm.kernels import sampling  # noqa: E402
from radixlm.kernels.sampling_ref import (  # noqa: E402
    apply_token_bitmask_ref,
    argmax_rows_ref,
    filtered_probs,
    row_seed,
    sample_ref,
)
from radixlm.protocol.sampling_params import SamplingParams  # noqa: E402
from radixlm.runtime import sampler as sampler_module  # noqa: E402
from radixlm.runtime.sampler import Sampler, SamplingRow  # noqa: E402
from tests.sampling_cases import SETTINGS, params  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# small blocks on the CPU so that a row spans several of them (the running max and winner)
BLOCKS = dict(block=128, bisect_block=128) if DEVICE.type == "cpu" else {}


def oracle(logits: torch.Tensor, ps: list[SamplingParams], seeds: torch.Tensor) -> torch.Tensor:
    return sample_ref(logits, ps, seeds)


def fused(
    logits: torch.Tensor, ps: list[SamplingParams], seeds: torch.Tensor, **kw
) -> torch.Tensor:
    dev = logits.device

    def col(field: str, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([getattr(p, field) for p in ps], dtype=dtype, device=dev)

    rows = torch.arange(len(ps), device=dev)
    return sampling.sample(
        logits, rows, seeds, col("top_k", torch.int64), col("temperature", torch.float32),
        col("top_p", torch.float32), col("min_p", torch.float32), **BLOCKS, **kw,
    )  # fmt: skip


def seeds_for(count: int, offset: int = 0) -> torch.Tensor:
    return torch.tensor([row_seed(offset + i, 7) for i in range(count)], device=DEVICE)


def random_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[:, 3::11] = float("-inf")  # masked tokens, as a grammar or a banned token leaves them
    return logits.to(DEVICE)


@pytest.mark.parametrize("pivots", [4, 16])
def test_same_token_as_the_oracle(pivots):
    ps = [params(**s) for s in SETTINGS for _ in range(3)]
    logits = random_logits(len(ps), 700, seed=pivots)
    seeds = seeds_for(len(ps), offset=pivots)
    got = fused(logits, ps, seeds, pivots=pivots)
    assert got.tolist() == oracle(logits, ps, seeds).tolist()
    assert torch.isfinite(logits.gather(1, got[:, None])).all()


def test_without_scratch_the_same_token_even_where_rows_bisect():
    # bisects=False: no (R, capacity) scratch and no compaction, which only saves passes
    ps = [params(**s) for s in SETTINGS for _ in range(2)]
    logits = random_logits(len(ps), 600, seed=11)
    seeds = seeds_for(len(ps), offset=3)
    assert fused(logits, ps, seeds, bisects=False).tolist() == oracle(logits, ps, seeds).tolist()


def kept_by_threshold(
    logits: torch.Tensor, ps: list[SamplingParams], threshold: torch.Tensor
) -> torch.Tensor:
    """The tokens the fused path keeps: min-p survivors at or above the row's threshold on y."""
    temps = torch.tensor([p.temperature for p in ps], device=logits.device)[:, None]
    min_p = torch.tensor([p.min_p for p in ps], device=logits.device)[:, None]
    y = logits * (1.0 / temps)  # as the kernel computes it
    survivors = torch.exp(y - y.amax(dim=-1, keepdim=True)) >= min_p
    return survivors & (y >= threshold[:, None]) & (y > float("-inf"))


# capacity: the bracket size from which passes read a compacted copy (16: only late passes do)
@pytest.mark.parametrize("pivots,capacity", [(4, 16), (16, 16384)])
def test_kept_set_is_the_oracles(pivots, capacity):
    ps = [params(**s) for s in SETTINGS for _ in range(2)]
    logits = random_logits(len(ps), 600, seed=10 + pivots)
    threshold = torch.empty(len(ps), device=DEVICE)
    fused(logits, ps, seeds_for(len(ps)), pivots=pivots, capacity=capacity, threshold_out=threshold)
    want = filtered_probs(logits, ps) > 0
    assert torch.equal(kept_by_threshold(logits, ps, threshold), want)


def test_same_token_on_a_flat_row_where_filters_drop_the_unfiltered_winner():
    # at a high temperature the race winner over all tokens is rarely kept by a tight filter: the
    # last pass, the race over the kept tokens, decides almost every row
    settings = [dict(top_k=5), dict(top_p=0.3), dict(min_p=0.5), dict(top_k=40, top_p=0.2)]
    ps = [params(temperature=4.0, **s) for s in settings for _ in range(10)]
    logits = random_logits(1, 500, seed=3).expand(len(ps), -1)
    seeds = seeds_for(len(ps), offset=100)
    got = fused(logits, ps, seeds)
    assert got.tolist() == oracle(logits, ps, seeds).tolist()
    assert len(set(got.tolist())) > 10  # the seeds do pick different tokens


def test_a_single_allowed_token_is_always_chosen():
    ps = [params(**s) for s in SETTINGS]
    logits = torch.full((len(ps), 300), float("-inf"))
    allowed = torch.randint(0, 300, (len(ps),), generator=torch.Generator().manual_seed(4))
    logits[torch.arange(len(ps)), allowed] = torch.randn(len(ps)) * 5
    logits = logits.to(DEVICE)
    got = fused(logits, ps, seeds_for(len(ps)))
    assert got.tolist() == allowed.tolist()


def test_top_k_1_and_a_tiny_top_p_are_greedy():
    ps = [params(temperature=1.0, top_k=1), params(temperature=2.0, top_p=1e-6)] * 4
    logits = random_logits(len(ps), 400, seed=5)
    got = fused(logits, ps, seeds_for(len(ps), offset=9))
    assert got.tolist() == logits.argmax(dim=-1).tolist()


@pytest.mark.slow  # (64 rows through the interpreter on the CPU)
def test_exact_ties_at_the_top_k_boundary_keep_every_tied_token():
    logits = torch.full((1, 200), -10.0)
    logits[0, :4] = torch.tensor([4.0, 2.0, 2.0, 2.0])  # top_k=2 cuts inside the tie
    ps = [params(temperature=1.0, top_k=2)] * 64
    threshold = torch.empty(64, device=DEVICE)
    got = fused(logits.to(DEVICE).expand(64, -1), ps, seeds_for(64), threshold_out=threshold)
    assert threshold.tolist() == [2.0] * 64
    assert set(got.tolist()) == {0, 1, 2, 3}
    # the oracle keeps the same set, also where top-p cuts inside a tie (a flat row)
    assert (filtered_probs(logits, ps[:1]) > 0).nonzero()[:, 1].tolist() == [0, 1, 2, 3]
    flat = torch.zeros(1, 100)
    for p in (params(temperature=1.0, top_k=3), params(temperature=1.0, top_p=0.5)):
        assert int((filtered_probs(flat, [p]) > 0).sum()) == 100


def test_a_nan_logit_is_never_sampled_and_both_paths_agree():
    logits = random_logits(16, 300, seed=11)
    logits[:, 5] = float("nan")
    ps = [params(**SETTINGS[i % len(SETTINGS)]) for i in range(16)]
    seeds = seeds_for(16, offset=3)
    want = oracle(logits, ps, seeds)
    assert 5 not in want.tolist()
    assert fused(logits.to(DEVICE), ps, seeds).tolist() == want.tolist()
    # the oracle alone: a row of NaNs but one real logit
    row = torch.full((1, 300), float("nan"))
    row[0, 7] = 1.0
    assert oracle(row, ps[:1], seeds[:1].cpu()).tolist() == [7]


def test_a_masked_token_whose_uniform_rounds_to_one_is_not_chosen():
    # row seed 208044 draws a uniform that float32 rounds to 1 for token 49 (tests/test_sampler.py
    # checks that the oracle does not choose it): the kernel's noise must stay positive too
    seeds = torch.tensor([208044], device=DEVICE)
    logits = torch.zeros(1, 64, device=DEVICE)
    logits[0, 49] = float("-inf")
    ps = [params(temperature=1.0)]
    assert fused(logits, ps, seeds).tolist() == oracle(logits, ps, seeds).tolist()


def test_sampler_routes_sampled_rows_through_the_kernel(monkeypatch):
    """Sampler.sample_ids with the fused path (forced on for CPU tensors under the interpreter)
    against its torch path, on a batch of greedy, sampled and banned rows."""
    gen = torch.Generator().manual_seed(6)
    logits = (torch.randn(6, 500, generator=gen) * 2).to(DEVICE)
    kinds = [dict(temperature=0), dict(temperature=0.8, top_p=0.9), dict(temperature=1.2, top_k=7)]
    rows = [
        SamplingRow(params(**kinds[i % 3]), seed=40 + i, step=2, input_ids=[1], output_ids=[])
        for i in range(6)
    ]
    rows[4].banned_ids = (int(logits[4].argmax()),)
    monkeypatch.setenv("RADIXLM_DISABLE_FUSED", "1")
    want = Sampler().sample_ids(logits, rows).tolist()
    monkeypatch.setattr(sampler_module, "_use_fused", lambda x: True)
    launched = []
    block = _with_block(sampling.sample)
    monkeypatch.setattr(sampling, "sample", lambda *a, **kw: launched.append(1) or block(*a, **kw))
    assert Sampler().sample_ids(logits, rows).tolist() == want
    all_sampled = [r for r in rows if not r.params.is_greedy]
    assert Sampler().sample_ids(logits[1::3].contiguous(), all_sampled[::2]).tolist() == [
        want[1],
        want[4],
    ]
    assert len(launched) == 2  # both through the kernel


def _with_block(sample):
    return lambda *a, **kw: sample(*a, **BLOCKS, **kw)


@pytest.mark.gpu
def test_same_token_as_the_oracle_at_real_size():
    ps = [params(**SETTINGS[i % len(SETTINGS)]) for i in range(256)]
    logits = random_logits(256, 128256, seed=7)
    seeds = seeds_for(256, offset=1000)
    assert fused(logits, ps, seeds).tolist() == oracle(logits, ps, seeds).tolist()


@pytest.mark.gpu
def test_kept_set_is_the_oracles_at_real_size():
    ps = [params(**SETTINGS[i % len(SETTINGS)]) for i in range(256)]
    logits = random_logits(256, 128256, seed=9)
    threshold = torch.empty(256, device=DEVICE)
    fused(logits, ps, seeds_for(256), threshold_out=threshold)
    got = kept_by_threshold(logits, ps, threshold)
    want = filtered_probs(logits, ps) > 0
    # float32 sums in another order may move a top-p boundary by one token of tiny probability
    # (the module docstring); top-k and min-p sets are exact
    differ = (got != want).sum(dim=-1)
    top_p = torch.tensor([p.top_p < 1.0 for p in ps], device=DEVICE)
    assert int(differ.max()) <= 1 and not (differ > 0)[~top_p].any(), differ.nonzero().tolist()
    assert int((differ > 0).sum()) <= 32
    assert (filtered_probs(logits, ps)[got != want] < 1e-4).all()


@pytest.mark.gpu
def test_sampler_fused_and_torch_paths_agree_at_real_size(monkeypatch):
    logits = random_logits(64, 128256, seed=8)
    rows = [
        SamplingRow(
            params(**SETTINGS[i % len(SETTINGS)]), seed=i, step=5, input_ids=[1], output_ids=[]
        )
        for i in range(63)
    ] + [SamplingRow(params(temperature=0), seed=0, step=0, input_ids=[1], output_ids=[])]
    got = Sampler().sample_ids(logits, rows).tolist()
    monkeypatch.setenv("RADIXLM_DISABLE_FUSED", "1")
    assert got == Sampler().sample_ids(logits, rows).tolist()


@pytest.mark.parametrize("vocab,block", [(1000, 128), (257, 64), (49152, 4096)])
def test_argmax_rows_is_torchs_argmax_ties_included(vocab, block):
    """The first index of each row's max, as torch.argmax: ties within a chunk, across chunks
    (the earlier chunk wins), at a partial last chunk, a row of -inf but one, a NaN; with `into`
    and `rows` the result is also scattered."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab + 3, generator=gen)[:, :vocab]  # strided rows
    top = float(logits.max()) + 1.0
    logits[0, [5, 9]] = top  # a tie in one chunk
    logits[1, [vocab - 1, block + 1]] = top  # a tie across chunks, one in the last chunk
    logits[2, vocab - 1] = top  # the max in a partial last chunk
    logits[3] = float("-inf")
    logits[3, vocab // 2] = 0.0
    logits[4] = logits[4].round()  # many ties
    logits[5, 17] = float("nan")  # a NaN is the max, as in torch
    logits = logits.to(DEVICE)
    want = argmax_rows_ref(logits)
    assert torch.equal(sampling.argmax_rows(logits, block=block), want)
    into = torch.full((10,), -1, dtype=torch.int64, device=DEVICE)
    rows = torch.tensor([7, 0, 3, 9, 2, 5], device=DEVICE)
    got = sampling.argmax_rows(logits, into=into, rows=rows, block=block)
    assert torch.equal(got, want)
    assert torch.equal(into[rows], want) and (into[[1, 4, 6, 8]] == -1).all()


@pytest.mark.parametrize("vocab,words,block", [(300, 10, 64), (300, 8, 128), (1000, 32, 256)])
def test_masked_argmax_is_the_mask_then_the_argmax(vocab, words, block):
    """argmax_rows with a bitmask against apply_token_bitmask then torch's argmax (and its twin
    against the same): random bits, a row all clear (every token masked: the first index, as
    torch gives it over -inf), a row all set, a NaN in a masked lane (it must not win), a
    bitmask narrower than the vocabulary, rows read through mask_rows (-1: no mask), and the
    result scattered into a buffer."""
    gen = torch.Generator().manual_seed(vocab + words)
    logits = torch.randn(5, vocab + 1, generator=gen)[:, :vocab]  # strided rows
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, words), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[1] = 0
    bitmask[2] = -1
    blocked = next(i for i in range(vocab) if not (int(bitmask[0, i // 32]) >> (i % 32)) & 1)
    logits[0, blocked] = float("nan")
    mask_rows = torch.tensor([0, 1, -1, 2, 3], dtype=torch.int64)
    want = logits.clone()
    for i, m in enumerate(mask_rows.tolist()):
        if m >= 0:
            apply_token_bitmask_ref(want[i : i + 1], bitmask[m : m + 1])
    want = want.argmax(dim=-1)
    assert want[1] == 0 and want[0] != blocked
    assert torch.equal(argmax_rows_ref(logits, bitmask=bitmask, mask_rows=mask_rows), want)
    got = sampling.argmax_rows(
        logits.to(DEVICE), block=block, bitmask=bitmask.to(DEVICE), mask_rows=mask_rows.to(DEVICE)
    )
    assert torch.equal(got.cpu(), want)
    # one mask row per logits row, and the scatter
    every = logits[:4].clone()
    want = every.clone()
    apply_token_bitmask_ref(want, bitmask)
    want = want.argmax(dim=-1)
    into = torch.full((9,), -1, dtype=torch.int64, device=DEVICE)
    rows = torch.tensor([8, 0, 5, 2], device=DEVICE)
    on_device = every.to(DEVICE)
    got = sampling.argmax_rows(
        on_device, into=into, rows=rows, block=block, bitmask=bitmask.to(DEVICE)
    )
    assert torch.equal(got.cpu(), want) and torch.equal(into[rows].cpu(), want)
    assert torch.equal(argmax_rows_ref(every, bitmask=bitmask), want)
    # the logits are left as they were, by the kernel and by its twin
    torch.testing.assert_close(on_device.cpu(), logits[:4], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(every, logits[:4], rtol=0, atol=0, equal_nan=True)
    with pytest.raises(ValueError, match="int32"):
        sampling.argmax_rows(on_device, bitmask=bitmask.to(DEVICE, torch.int64))


@pytest.mark.parametrize("vocab,words", [(300, 10), (300, 8), (33, 2)])
def test_apply_token_bitmask_is_the_torch_path(vocab, words):
    """The one-kernel mask against its torch twin: random bits, a row all clear, a row all set,
    and a bitmask narrower than the vocabulary (columns past it are -inf)."""
    gen = torch.Generator().manual_seed(vocab + words)
    logits = torch.randn(4, vocab, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, words), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[1] = 0
    bitmask[2] = -1
    covered = min(vocab, 32 * words)
    want = logits.clone()
    apply_token_bitmask_ref(want, bitmask)
    got = logits.to(DEVICE)
    sampling.apply_token_bitmask(got, bitmask.to(DEVICE), block=64)
    assert torch.equal(got.cpu(), want)
    assert torch.isinf(got[1]).all() and torch.isfinite(got[2, :covered]).all()
