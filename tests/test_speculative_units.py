"""Speculative decoding's parts without a model: the n-gram drafter against its scanning twin,
greedy acceptance, rejection sampling against the target distribution, and the options."""

from __future__ import annotations

import random

import pytest
import torch

from radixlm import cli
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.speculative.ngram import NgramIndex, propose_by_scan, propose_many_by_scan
from radixlm.runtime.speculative.verify import greedy_accept, rejection_sample

# ---- the drafter ------------------------------------------------------------------------------


def test_the_longest_window_wins_and_the_latest_occurrence_is_copied():
    index = NgramIndex(1, 3)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 1, 2, 9, 7, 1, 2, 3, 4, 1, 2]
    index.update(tokens)
    # the ending (1, 2) occurs at 1 and 5; the window of 3 (4, 1, 2) never earlier: the latest
    # occurrence of (1, 2) is at 5, followed by 3, 4, 1, 2, then (repeating) 3, 4
    assert index.propose(4) == [3, 4, 1, 2]
    assert index.propose(6) == [3, 4, 1, 2, 3, 4]
    index.update(tokens + [9])  # (2, 9) occurs at 2: 7, 1, 2, 3
    assert index.propose(4) == [7, 1, 2, 3]


def test_no_match_no_draft_and_a_repeating_text_keeps_repeating():
    index = NgramIndex(2, 4)
    index.update([1, 2, 3, 4])
    assert index.propose(5) == []
    index.update([7, 8], [7, 8])  # prompt and output: the ending (7, 8) occurred at 0
    assert index.propose(5) == [7, 8, 7, 8, 7]
    assert index.propose(0) == []


def test_the_index_grown_token_by_token_proposes_what_a_scan_does():
    rng = random.Random(0)
    for trial in range(30):
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 6)
        prompt = [rng.randint(0, 4) for _ in range(rng.randint(1, 40))]
        output: list[int] = []
        index = NgramIndex(lo, hi)
        for _ in range(40):
            index.update(prompt, output)
            k = rng.randint(1, 8)
            context = prompt + output
            assert index.propose(k) == propose_by_scan(context, lo, hi, k), (trial, context)
            count = rng.randint(1, 4)
            assert index.propose_many(k, count) == propose_many_by_scan(
                context, lo, hi, k, count
            ), (trial, context, count)
            output.extend(rng.randint(0, 4) for _ in range(rng.randint(1, 3)))


def test_both_ways_of_drafting_propose_what_a_scan_does():
    """A draft by byte search (contexts up to _BYTE_SEARCH_MAX tokens) and by the vectorized
    match (longer ones), over token ids small and large (a byte search must not match across
    tokens), repeating and not: what the scan finds."""
    from radixlm.runtime.speculative.ngram import _BYTE_SEARCH_MAX

    rng = random.Random(2)
    for trial in range(40):
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 14)
        vocab = rng.choice([3, 300, 70_000, 2**31 - 1])
        length = rng.choice([rng.randint(2, 200), _BYTE_SEARCH_MAX, _BYTE_SEARCH_MAX + 300])
        base = [rng.randint(0, vocab) for _ in range(rng.randint(2, 400))]
        context = (base * (length // len(base) + 1))[: length - 3]
        context += [rng.randint(0, vocab) for _ in range(3)]
        index = NgramIndex(lo, hi)
        index.update(context)
        k = rng.randint(1, 9)
        assert index.propose(k) == propose_by_scan(context, lo, hi, k), (trial, lo, hi, vocab)
    # 256's eight bytes (00 01 00 ...) also lie across the tokens 0, 1: no occurrence of it
    index = NgramIndex(1, 4)
    index.update([256, 5, 0, 1, 256])
    assert index.propose(3) == propose_by_scan([256, 5, 0, 1, 256], 1, 4, 3) == [5, 0, 1]


def test_an_index_that_went_many_steps_without_a_draft_catches_up_in_one_update():
    """(What a request the gate kept plain does: no update for a while, then one; the context
    long enough that the array grows.)"""
    rng = random.Random(1)
    prompt = [rng.randint(0, 9) for _ in range(300)]
    output = [rng.randint(0, 9) for _ in range(500)]
    index = NgramIndex(1, 12)
    index.update(prompt, output[:3])
    index.update(prompt, output)
    context = prompt + output
    assert index.tokens.tolist() == context
    assert index.propose_many(8, 3) == propose_many_by_scan(context, 1, 12, 8, 3)
    # windows longer than the index's precomputed offsets (64), over a text that repeats
    index = NgramIndex(1, 80)
    index.update(context * 2)
    assert index.propose(8) == propose_by_scan(context * 2, 1, 80, 8) == context[:8]


def test_a_context_that_changed_behind_the_index_is_indexed_afresh():
    index = NgramIndex(1, 2)
    index.update([1, 2, 3, 1])
    assert index.propose(2) == [2, 3]
    index.update([4, 5, 4])  # shorter: rebuilt
    assert index.propose(2) == [5, 4]
    index.update([4, 6, 5])  # the last token indexed differs: rebuilt
    assert index.propose(2) == []
    index.update([4, 6, 5, 4])
    assert index.propose(2) == [6, 5]


# ---- verification -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "targets, draft, out",
    [
        ([4, 5, 6, 7], [4, 5, 6], [4, 5, 6, 7]),  # all accepted, then the bonus token
        ([4, 9, 6, 7], [4, 5, 6], [4, 9]),  # the second differs: the target's own instead
        ([8, 5, 6, 7], [4, 5, 6], [8]),  # nothing accepted: as a plain step
        ([3], [], [3]),
    ],
)
def test_greedy_accepts_the_prefix_that_equals_the_argmax(targets, draft, out):
    assert greedy_accept(targets, draft) == out


# a target of 5 tokens at 3 positions (row j: the distribution after draft token j)
_TARGET = torch.tensor(
    [
        [0.10, 0.45, 0.25, 0.15, 0.05],
        [0.30, 0.05, 0.40, 0.05, 0.20],
        [0.20, 0.20, 0.20, 0.20, 0.20],
    ]
)


def test_rejection_sampling_draws_each_token_from_the_target():
    """Over many seeds, the first token is distributed as row 0, and the second, after the first
    draft token was accepted (so it follows it), as row 1, whatever the draft proposes."""
    draft = [2, 3]  # p(2) = 0.25 at row 0, p(3) = 0.05 at row 1: mostly rejected
    trials = 6000
    first = torch.zeros(5)
    second = torch.zeros(5)
    lengths = []
    for seed in range(trials):
        out = rejection_sample(_TARGET, draft, seed, step=7)
        lengths.append(len(out))
        assert 1 <= len(out) <= 3 and out[: len(out) - 1] == draft[: len(out) - 1]
        first[out[0]] += 1
        if out[0] == draft[0]:
            second[out[1]] += 1
    for counts, p in ((first, _TARGET[0]), (second, _TARGET[1])):
        n = counts.sum()
        chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
        assert chi2 < 18.5, (counts / n, p)  # chi-square, 4 degrees of freedom, p < 0.001
        assert float((counts / n - p).abs().sum()) / 2 < 0.03
    # the acceptance rate of the first draft token is p(2) = 0.25
    assert abs(sum(n > 1 for n in lengths) / trials - 0.25) < 0.03


def test_a_seeded_rejection_sample_repeats_and_a_certain_draft_is_always_accepted():
    assert rejection_sample(_TARGET, [1, 0], 42, 0) == rejection_sample(_TARGET, [1, 0], 42, 0)
    certain = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    for seed in range(50):
        assert rejection_sample(certain, [1, 2], seed, 3) == [1, 2, 0]
        assert rejection_sample(certain, [0, 2], seed, 3) == [1]  # p(0) = 0: never accepted


def test_tree_rejection_sampling_draws_each_token_from_the_target():
    """A tree whose root has children 2 (with child 3) and 4: over many seeds the first token is
    distributed as the root's row, and the second as the row of the node the first reached (2 or
    4), whatever the tree proposes; seeded draws repeat."""
    from radixlm.runtime.speculative.tree import DraftTree
    from radixlm.runtime.speculative.verify import rejection_sample_tree

    tree = DraftTree([2, 3, 4], [-1, 0, -1])  # rows: root, node 0 (2), node 1 (3), node 2 (4)
    probs = torch.tensor(
        [
            [0.10, 0.20, 0.30, 0.15, 0.25],
            [0.30, 0.10, 0.20, 0.05, 0.35],
            [0.20, 0.20, 0.20, 0.20, 0.20],
            [0.05, 0.45, 0.10, 0.30, 0.10],
        ]
    )
    trials = 8000
    first, after2, after4 = torch.zeros(5), torch.zeros(5), torch.zeros(5)
    for seed in range(trials):
        out, path = rejection_sample_tree(probs, tree, seed, step=3)
        assert [tree[j] for j in path] == out[: len(path)] and len(out) == len(path) + 1
        first[out[0]] += 1
        if path[:1] == [0]:  # (a first token 2 or 4 is always its node's: refused, it is
            after2[out[1]] += 1  # out of the residual)
        elif path[:1] == [2]:
            after4[out[1]] += 1
    for counts, p in ((first, probs[0]), (after2, probs[1]), (after4, probs[3])):
        n = counts.sum()
        chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
        assert chi2 < 18.5, (counts / n, p)  # chi-square, 4 degrees of freedom, p < 0.001
    # the second candidate is tried only after the first was refused: accepted with probability
    # (1 - 0.30) * 0.25 / (1 - 0.30)
    assert abs(float(after4.sum()) / trials - 0.25) < 0.03
    assert rejection_sample_tree(probs, tree, 9, 3) == rejection_sample_tree(probs, tree, 9, 3)


# ---- options ----------------------------------------------------------------------------------


def test_ngram_takes_sglangs_defaults_and_any_case():
    config = EngineConfig(speculative_algorithm="ngram")
    assert config.speculative_algorithm == "NGRAM"
    assert config.speculative_num_draft_tokens == 12
    assert config.speculative_ngram_min_match_window_size == 1
    assert config.speculative_ngram_max_match_window_size == 12
    assert EngineConfig().speculative_algorithm is None


@pytest.mark.parametrize(
    "kw, says",
    [
        ({"speculative_algorithm": "NEXTN"}, "not available yet"),
        ({"speculative_algorithm": "STANDALONE"}, "needs speculative_draft_model_path"),
        ({"speculative_algorithm": "LOOKAHEAD"}, "unknown"),
        ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 1}, "at least 2"),
        ({"speculative_num_draft_tokens": 4}, "needs speculative_algorithm"),
        (
            {
                "speculative_algorithm": "NGRAM",
                "speculative_ngram_min_match_window_size": 5,
                "speculative_ngram_max_match_window_size": 3,
            },
            "1 <= min <= max",
        ),  # fmt: skip
    ],
)
def test_bad_speculative_options_are_refused_saying_what_to_change(kw, says):
    with pytest.raises(ValueError, match=says):
        EngineConfig(**kw)


def test_the_cli_takes_the_speculative_options():
    p = cli._build_parser()
    args = p.parse_args(
        ["serve", "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "6",
         "--speculative-ngram-max-match-window-size", "4", "--speculative-eagle-topk", "3",
         "--no-speculative-adaptive"]
    )  # fmt: skip
    config = EngineConfig(**cli._engine_kwargs(args))
    assert config.speculative_algorithm == "NGRAM"
    assert config.speculative_num_draft_tokens == 6
    assert config.speculative_ngram_max_match_window_size == 4
    assert config.speculative_eagle_topk == 3 and config.speculative_adaptive is False
    assert EngineConfig(speculative_algorithm="NGRAM").speculative_adaptive is True
    with pytest.raises(ValueError, match="speculative_eagle_topk"):
        EngineConfig(speculative_algorithm="NGRAM", speculative_eagle_topk=0)
    EngineConfig(speculative_algorithm="NGRAM", speculative_eagle_topk=2, pp_size=2)  # (trees too)


def test_speculative_num_steps_sets_a_chain_s_positions_as_in_sglang():
    args = cli._build_parser().parse_args(
        ["serve", "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "d",
         "--speculative-num-steps", "3"]
    )  # fmt: skip
    config = EngineConfig(**cli._engine_kwargs(args))
    assert config.speculative_num_steps == 3 and config.speculative_num_draft_tokens == 4
    medusa = EngineConfig(speculative_algorithm="MEDUSA", speculative_num_steps=2)
    assert medusa.speculative_num_draft_tokens == 3
    for kw, says in [
        ({"speculative_algorithm": "NGRAM", "speculative_num_steps": 2}, "NGRAM drafts from"),
        ({"speculative_num_steps": 2}, "needs speculative_algorithm"),
        ({"speculative_algorithm": "MEDUSA", "speculative_num_steps": 0}, "at least 1"),
        (
            {
                "speculative_algorithm": "MEDUSA",
                "speculative_num_steps": 2,
                "speculative_num_draft_tokens": 5,
            },
            "verifies at most 3 positions",
        ),  # fmt: skip
    ]:
        with pytest.raises(ValueError, match=says):
            EngineConfig(**kw)


# ---- the gate: drafting where it measured faster ------------------------------------------------


def test_the_gate_measures_each_way_twice_then_drafts_where_tokens_come_faster():
    from radixlm.runtime.speculative.gate import SpeculationGate

    gate = SpeculationGate(explore=4)
    # measuring: drafting and plain in turn, the way measured less first; of a way's first two
    # measurements the faster counts (a first step that compiled kernels is slow once)
    assert gate.drafting(1) is True
    gate.observe(1, True, 30, 0.01)  # 3,000 tokens/s verifying
    assert gate.drafting(1) is False
    gate.observe(1, False, 1, 0.01)  # 100 plain: a slow first step
    assert gate.drafting(1) is True
    gate.observe(1, True, 20, 0.01)  # 2,000: the first 3,000 still counts
    assert gate.drafting(1) is False
    gate.observe(1, False, 10, 0.01)  # 1,000: counts over the slow 100
    assert gate.rates() == {(1, True): 3000.0, (1, False): 1000.0}
    # deciding: drafting, trying plain explore x (3,000 / 1,000) = 12 steps after measuring
    assert [gate.drafting(1) for _ in range(12)] == [True] * 11 + [False]  # steps 5-16
    gate.observe(1, False, 9, 0.01)  # 900: plain lost again, so it is tried half as often
    assert gate.rates()[(1, False)] == 975.0  # (moving by the weight, 0.25, from now on)
    assert [gate.drafting(1) for _ in range(24)] == [True] * 23 + [False]  # step 40
    gate.observe(1, False, 9, 0.01)
    assert [gate.drafting(1) for _ in range(48)] == [True] * 47 + [False]  # step 88
    # a bucket of its own for 2-3 requests
    for verified, tokens in ((True, 2), (False, 3), (True, 2), (False, 3)):
        assert gate.drafting(2) is verified
        gate.observe(3, verified, tokens, 0.001)
    assert gate.drafting(2) is False
    # the estimates follow new measurements: verifying turned slow at batch 1
    for _ in range(20):
        gate.observe(1, True, 4, 0.01)
    assert gate.rates()[(1, True)] < gate.rates()[(1, False)]
    assert gate.drafting(1) is False
    with pytest.raises(ValueError, match="explore"):
        SpeculationGate(explore=0)
    # nothing measured from a step that gave nothing
    before = gate.rates()
    gate.observe(1, True, 0, 0.01)
    gate.observe(1, False, 5, 0.0)
    assert gate.rates() == before


def test_a_plain_step_run_in_lockstep_counts_at_what_it_costs_overlapped():
    """The gate measures the plain way as it runs once kept plain, overlapped: a plain step the
    loop waited for at once counts at the longer of its host work and its wait (the engine
    core's estimate); a verify step, which never overlaps, at all of it; a step that did
    overlap, at what it took."""
    from radixlm.runtime.model_runner import StepResults
    from radixlm.runtime.scheduler import ScheduledReq, StepPlan
    from radixlm.runtime.speculative.worker import SpeculativeWorker

    worker = SpeculativeWorker(EngineConfig(speculative_algorithm="NGRAM"))
    gate = worker.gate

    def step(verified: bool, seconds: float, overlapped: float | None) -> None:
        plan = StepPlan()
        plan.batch = 4
        draft = (7, 8) if verified else ()
        plan.items = [ScheduledReq(object(), 10, 1 + len(draft), True, draft) for _ in range(4)]
        if verified:
            results = StepResults([None] * 4, {}, {i: [7, 8, 9] for i in range(4)})
        else:
            results = StepResults([5] * 4, {})
        worker.observe_step(plan, results, seconds, overlapped)

    step(False, 0.004, 0.003)  # lockstep: host 1 ms + wait 3 ms would overlap to 3 ms
    assert gate.rates()[(3, False)] == pytest.approx(4 / 0.003)
    step(True, 0.004, 0.003)  # a verify step: all of it (12 tokens)
    assert gate.rates()[(3, True)] == pytest.approx(12 / 0.004)
    step(False, 0.002, None)  # overlapped already: what it took (the faster of the first two)
    assert gate.rates()[(3, False)] == pytest.approx(4 / 0.002)


def test_the_gate_says_when_no_draft_comes_for_a_while():
    """`quiet`: while plain decoding leads and the next try of drafting is more than `ahead`
    steps away (EAGLE3 then keeps no features); never while measuring or where drafting leads."""
    from radixlm.runtime.speculative.gate import SpeculationGate

    gate = SpeculationGate(explore=4)
    for verified, rate in ((True, 1000), (False, 3000), (True, 1000), (False, 3000)):
        assert not gate.quiet(1, 2)  # (measuring)
        assert gate.drafting(1) is verified
        gate.observe(1, verified, 10, 10 / rate)
    # plain leads 3x: drafting is tried 4 x 3 = 12 steps after measuring ended (step 16)
    decisions, quiet = [], []
    for _ in range(12):
        quiet.append(gate.quiet(1, 2))  # (before the step: the gate's last decision's step)
        decisions.append(gate.drafting(1))
    assert decisions == [False] * 11 + [True]
    # quiet while the try is more than 2 steps away: before steps 6 .. 14 (before step 5 the
    # gate has not decided yet; before 15 and 16 the try is near)
    assert quiet == [False] + [True] * 9 + [False] * 2
    # a bucket where drafting leads is never quiet
    for verified, rate in ((True, 3000), (False, 1000), (True, 3000), (False, 1000)):
        gate.drafting(8)
        gate.observe(8, verified, 10, 10 / rate)
    assert not gate.quiet(8, 2)


def test_the_gate_drafts_in_no_step_it_cannot_measure_while_measuring():
    """Steps that also compute a prompt chunk (a batch's admission) are not measured: while a
    bucket is being measured they go plain and count for nothing, so the measuring steps come
    once the batch decodes alone; a decided bucket's way holds in them too."""
    from radixlm.runtime.speculative.gate import SpeculationGate

    gate = SpeculationGate(explore=4)
    assert [gate.drafting(128, measured=False) for _ in range(10)] == [False] * 10
    assert (gate.draft_steps, gate.plain_steps) == (0, 10)
    # the measuring steps, as if the ramp had not been
    for verified, rate in ((True, 3000), (False, 1000), (True, 3000), (False, 1000)):
        assert gate.drafting(128) is verified
        gate.observe(128, verified, 10, 10 / rate)
    # decided: drafting leads, and holds in a step with a prompt chunk
    assert gate.drafting(128, measured=False) is True
    assert gate.draft_steps == 3


def test_the_gate_at_a_large_batch_where_verifying_costs_many_plain_steps():
    """A batch of 128 where a verify step gives 256 tokens at 9k tokens/s and a plain one 128 at
    90k (what the H100 measured), its first plain step slow (5k, a first replay): the gate
    drafts the two measuring steps and no more in 128 steps (it drafted 21 before: explored every
    16th step, and judged plain by its slow first step for 16 steps), so the time stays within
    1.5x of plain decoding's."""
    from radixlm.runtime.speculative.gate import SpeculationGate

    gate, seconds, drafted, seen_plain = SpeculationGate(), 0.0, 0, False
    for _ in range(128):
        draft = gate.drafting(128)
        tokens, rate = (256, 9_000) if draft else (128, 90_000 if seen_plain else 5_000)
        seen_plain = seen_plain or not draft
        gate.observe(128, draft, tokens, tokens / rate)
        seconds += tokens / rate
        drafted += draft
    assert drafted == 2
    assert seconds < 1.5 * 128 * 128 / 90_000
    # and where verifying pays (180k against 90k), nearly every step drafts
    gate, drafted = SpeculationGate(), 0
    for _ in range(128):
        draft = gate.drafting(128)
        gate.observe(
            128,
            draft,
            256 if draft else 128,
            (256 if draft else 128) / (180_000 if draft else 90_000),
        )
        drafted += draft
    assert drafted >= 120


def test_the_engine_drafts_only_where_the_gate_measured_it_pays(tiny_model_folder):
    """With the gate's measurements saying plain decoding is faster at batch 1, the engine's
    steps go plain (exploring a verify step now and then), and those steps overlap as plain
    decoding's do (the next step launched before this one's tokens are applied); the tokens are
    the same as with drafting at every step (the gate off), for requests that finish at other
    steps, by length and by a stop string, while later steps are in flight."""
    import radixlm

    prompts = [[300 + (j % 5) for j in range(30)], [400 + (j % 7) for j in range(20)]]
    prompts.append(prompts[0])  # (with a stop string from its answer)
    params = [
        {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True},
        {"max_new_tokens": 23, "temperature": 0, "ignore_eos": True},
        {"max_new_tokens": 31, "temperature": 0, "ignore_eos": True},
    ]
    outs, verifies = [], []
    for adaptive in (False, True):
        with radixlm.Engine(
            tiny_model_folder, speculative_algorithm="NGRAM", speculative_num_draft_tokens=4,
            speculative_adaptive=adaptive,
        ) as eng:  # fmt: skip
            gate = eng._core.speculative.gate
            if adaptive:  # (measured: verifying far slower than plain decoding)

                def seed(gate=gate):
                    gate._rate.update({(b, True): 1.0 for b in range(1, 4)})
                    gate._rate.update({(b, False): 1e12 for b in range(1, 4)})

                eng._core.call(seed)
            single = eng.generate(input_ids=prompts[0], sampling_params=params[0])
            first = single["output_ids"]
            # a stop string cut from the first answer's text, reached mid-answer
            stop = eng.tokenizer.decode(first[12:14])
            batch = eng.generate(
                input_ids=prompts, sampling_params=[*params[:2], {**params[2], "stop": [stop]}]
            )
            outs.append([first] + [o["output_ids"] for o in batch] + [batch[2]["text"]])
            assert batch[2]["meta_info"]["finish_reason"]["type"] == "stop"
            assert len(batch[2]["output_ids"]) < 31
            stats = eng.get_stats()
            verifies.append(stats["spec_verify_ct"])
            # each verify step's tokens, in the acceptance-length histogram (/metrics)
            lengths = stats["spec_accept_length_histogram"]
            assert lengths["count"] == stats["spec_verify_ct"]
            assert lengths["sum"] == pytest.approx(stats["spec_accept_length"] * lengths["count"])
            if adaptive:
                assert gate.plain_steps > 20
                assert eng._core.num_overlapped_steps > 20
            else:
                assert eng._core.num_overlapped_steps == 0
    assert outs[0] == outs[1]
    assert [len(o) for o in outs[1][1:3]] == [40, 23]
    assert verifies[0] >= 5 and verifies[1] <= 8, verifies


# ---- draft trees -----------------------------------------------------------------------------


def test_chains_merge_into_a_depth_first_tree_whose_first_path_comes_first():
    from radixlm.runtime.speculative.tree import DraftTree, merge_chains

    assert merge_chains([[5, 6, 7]], 8) == (5, 6, 7)  # one chain: a chain
    assert not isinstance(merge_chains([[5, 6], [5, 6]], 8), DraftTree)
    tree = merge_chains([[5, 6, 7], [5, 8], [9]], 8)
    assert isinstance(tree, DraftTree)
    assert list(tree) == [5, 6, 7, 8, 9] and tree.parents == (-1, 0, 1, 0, -1)
    assert tree.depths() == [1, 2, 3, 2, 1]
    assert tree.paths() == [[0, 1, 2], [0, 3], [4]]
    assert tree.first_path() == (5, 6, 7)
    cut = merge_chains([[5, 6, 7], [5, 8], [9]], 4)  # the budget keeps a depth-first prefix
    assert list(cut) == [5, 6, 7, 8] and cut.parents == (-1, 0, 1, 0)
    with pytest.raises(ValueError, match="parent"):
        DraftTree([1, 2], [-1, 1])


def test_greedy_tree_acceptance_follows_the_argmax_down_any_branch():
    from radixlm.runtime.speculative.tree import accept_greedy, merge_chains

    tree = merge_chains([[5, 6, 7], [5, 8], [9]], 8)  # nodes 5 6 7 8 9
    # rows: root, then node order; the root's argmax 5, node 0's 8 (its second child), node 3's 4
    targets = [5, 8, 0, 0, 4, 0]
    assert accept_greedy(targets, tree) == ([5, 8, 4], [0, 3])
    assert accept_greedy([9, 0, 0, 0, 0, 2], tree) == ([9, 2], [4])
    assert accept_greedy([1, 0, 0, 0, 0, 0], tree) == ([1], [])
    assert accept_greedy([5, 6, 7, 3, 0, 0], tree) == ([5, 6, 7, 3], [0, 1, 2])


def test_a_tree_is_laid_out_on_lent_rows_and_its_accepted_path_kept():
    """The request's row holds the nodes in node order after the root; each further path gets a
    lent row with the prefix and its own slots at their depths; after the verify the accepted
    path's slots sit at the positions after the root and the other nodes' slots are free."""
    from radixlm.radix_cache.base import NoPrefixCache
    from radixlm.runtime.cache_manager import CacheManager
    from radixlm.runtime.memory_pool import ReqToTokenPool, SlotAllocator
    from radixlm.runtime.speculative.tree import lay_out, merge_chains

    rows = ReqToTokenPool(4, 32, torch.device("cpu"), spare_rows=2)
    allocator = SlotAllocator(64)
    cache = CacheManager(allocator, rows, NoPrefixCache())
    row = rows.allocate()
    tree = merge_chains([[5, 6, 7], [5, 8], [9]], 8)
    prefix = allocator.allocate(4)  # positions 0..3, the root (newest token) at 3
    rows.write(row, 0, prefix)
    nodes = allocator.allocate(len(tree))
    rows.write(row, 4, nodes)
    node_rows, lent = lay_out(tree, rows, row, 3)
    assert len(lent) == 2 and rows.num_spare == 0
    assert node_rows[:3] == [row] * 3 and node_rows[3] == lent[0] and node_rows[4] == lent[1]
    for j, depth in enumerate(tree.depths()):  # every node at its depth on its row, with
        assert int(rows.table[node_rows[j], 3 + depth]) == int(nodes[j])  # the prefix before
        assert rows.table[node_rows[j], :4].tolist() == prefix.tolist()
    assert rows.table[lent[0], 4].item() == int(nodes[0])  # (its path's ancestor)

    class R:
        pool_row, kv_len = row, 4 + len(tree)

    free_before = allocator.num_free
    cache.keep_path(R, 3, len(tree), [0, 3])  # accepted: 5 then 8
    assert R.kv_len == 6
    assert rows.read(row, 6).tolist() == [*prefix.tolist(), int(nodes[0]), int(nodes[3])]
    assert allocator.num_free == free_before + 3
    for r in lent:
        rows.give_back(r)
    assert rows.num_spare == 2


def test_a_constrained_draft_is_cut_to_what_its_matcher_can_undo():
    """A grammar allowing every token of a long draft: the draft is cut to the matcher's
    max_rollback (undoing more would raise in the scheduler), and the matcher is left where it
    was."""
    from radixlm.runtime.speculative.worker import _grammar_prefix

    class Matcher:
        max_rollback = 3

        def __init__(self) -> None:
            self.taken: list[int] = []

        def is_terminated(self) -> bool:
            return False

        def accept_token(self, token: int) -> bool:
            if token == 99:
                return False
            self.taken.append(token)
            return True

        def rollback(self, n: int) -> None:
            assert n <= self.max_rollback
            del self.taken[len(self.taken) - n :]

    m = Matcher()
    assert _grammar_prefix(m, list(range(10))) == [0, 1, 2] and m.taken == []
    assert _grammar_prefix(m, [5, 99, 6]) == [5] and m.taken == []


def test_drafts_are_cut_to_the_rows_a_verify_graph_holds():
    from radixlm.runtime.scheduler import _fit_rows
    from radixlm.runtime.speculative.tree import merge_chains

    chains = [(1, 2, 3, 4), (5, 6), (), (7, 8, 9)]
    assert _fit_rows(chains, 13) is chains  # 4 newest tokens + 9 draft tokens: they fit
    assert _fit_rows(chains, 12) == [(1, 2), (5, 6), (), (7, 8)]  # 12 // 4 - 1 = 2 each
    assert _fit_rows(chains, 7) == [(), (), (), ()]  # no room for one draft token each
    tree = merge_chains([[1, 2, 3], [4, 5]], 5)  # two paths: cut, it is its first path
    assert _fit_rows([tree, (6, 7, 8)], 6) == [(1, 2), (6, 7)]
    rows = [len(d) + 1 for d in _fit_rows([(1,) * 7] * 128, 256)]
    assert sum(rows) <= 256 and set(rows) == {2}


def test_an_eagle3_tree_takes_its_depth_and_its_size_from_sglangs_options():
    tree = EngineConfig(speculative_algorithm="EAGLE3", speculative_eagle_topk=2)
    assert (tree.speculative_draft_depth, tree.speculative_num_draft_tokens) == (3, 7)
    wide = EngineConfig(
        speculative_algorithm="EAGLE3", speculative_eagle_topk=8, speculative_num_steps=4
    )
    assert (wide.speculative_draft_depth, wide.speculative_num_draft_tokens) == (4, 16)
    chain = EngineConfig(speculative_algorithm="EAGLE3")
    assert (chain.speculative_draft_depth, chain.speculative_num_draft_tokens) == (3, 4)
    small = EngineConfig(
        speculative_algorithm="EAGLE3", speculative_eagle_topk=4, speculative_num_draft_tokens=3
    )
    assert small.speculative_draft_depth == 2
    # EAGLE (EAGLE-1/2 drafts) takes the same defaults
    eagle = EngineConfig(speculative_algorithm="eagle", speculative_eagle_topk=2)
    assert eagle.speculative_algorithm == "EAGLE"
    assert (eagle.speculative_draft_depth, eagle.speculative_num_draft_tokens) == (3, 7)
    assert EngineConfig(speculative_algorithm="EAGLE").speculative_num_draft_tokens == 4


def test_an_eagle3_tree_keeps_the_likeliest_paths_of_its_chain_and_rivals():
    from radixlm.runtime.speculative.eagle3 import draft_tree
    from radixlm.runtime.speculative.tree import DraftTree

    chain = [10, 11, 12]
    probs = [[0.5, 0.4, 0.1], [0.9, 0.05, 0.05], [0.3, 0.2, 0.1]]
    ids = [[10, 20, 30], [11, 21, 31], [12, 22, 32]]
    # path scores: chain 0.5, 0.45, 0.135; rivals 0.4 (20), 0.1 (30), 0.025 (21, 31), 0.09 (22)
    tree = draft_tree(chain, probs, ids, width=3, budget=5)
    assert isinstance(tree, DraftTree)
    # the chain's three nodes, then the rivals at depth 1 (0.4, 0.1); 22 (0.09) left out
    assert list(tree) == [10, 11, 12, 20, 30]
    assert tree.parents == (-1, 0, 1, -1, -1)
    # with the budget of the chain alone, a likelier rival displaces the chain's last node
    assert draft_tree(chain, probs, ids, width=3, budget=3) == DraftTree([10, 11, 20], [-1, 0, -1])
    # one candidate a position: the chain, as a list
    assert draft_tree(chain, probs, ids, width=1, budget=3) == [10, 11, 12]
    # a rival that ties the chain's own token does not come before its parent
    flat = draft_tree([1, 2], [[0.5, 0.5], [0.5, 0.5]], [[1, 9], [2, 8]], width=2, budget=4)
    assert list(flat) == [1, 2, 8, 9] and flat.parents == (-1, 0, 0, -1)


def test_a_tree_is_cut_to_a_requests_room_in_depth_first_order():
    from radixlm.runtime.speculative.tree import DraftTree
    from radixlm.runtime.speculative.worker import cut_tree

    tree = DraftTree([10, 11, 12, 20, 30], [-1, 0, 1, -1, -1])
    assert cut_tree(tree, 9) is tree
    assert cut_tree(tree, 4) == DraftTree([10, 11, 12, 20], [-1, 0, 1, -1])
    cut = cut_tree(tree, 2)
    assert cut == (10, 11) and not isinstance(cut, DraftTree)


def _vocab_target(vocab: int, hidden: int, tied: bool):
    from types import SimpleNamespace

    cfg = SimpleNamespace(vocab_size=vocab, hidden_size=hidden, tie_word_embeddings=tied)
    return SimpleNamespace(cfg=cfg, num_layers=2, lm_head="the rank's part")


@pytest.mark.parametrize("tied", [True, False])
def test_a_drafter_beside_ranks_reads_the_whole_embedding_and_lm_head(tmp_path, tied):
    """Under tensor parallelism a drafter in rank 0's process reads whole copies of the target's
    token embedding and LM head from the checkpoint (its other attributes are the target's); a
    tied model's two are one tensor; a float8 one is refused, saying what."""
    from safetensors.torch import save_file

    from radixlm.runtime.speculative.whole_vocab import whole_vocab_target

    embed, head = torch.randn(10, 4), torch.randn(10, 4)
    tensors = {"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(4)}
    if not tied:
        tensors["lm_head.weight"] = head
    save_file(tensors, str(tmp_path / "model.safetensors"))
    seen = whole_vocab_target(_vocab_target(10, 4, tied), tmp_path, "auto", torch.float32, "cpu")
    assert seen.num_layers == 2  # (the target's own)
    assert torch.equal(seen.embed_tokens(torch.tensor([3, 9])), embed[[3, 9]])
    assert torch.equal(seen.lm_head.weight, embed if tied else head)
    assert (seen.lm_head.weight is seen.embed_tokens.weight) == tied
    save_file(
        {"model.embed_tokens.weight": embed.to(torch.float8_e4m3fn)},
        str(tmp_path / "model.safetensors"),
    )
    with pytest.raises(ValueError, match="needs the checkpoint's embed_tokens unquantized"):
        whole_vocab_target(_vocab_target(10, 4, True), tmp_path, "auto", torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"whole embed_tokens .* \(10, 5\) in floats"):
        whole_vocab_target(_vocab_target(10, 5, True), tmp_path, "auto", torch.float32, "cpu")
    save_file({"model.embed_tokens.weight": embed}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="whole lm_head .*: absent"):  # (untied: its own needed)
        whole_vocab_target(_vocab_target(10, 4, False), tmp_path, "auto", torch.float32, "cpu")
    # what a drafter does not read is not made (Medusa's heads: the LM head alone), and the
    # names are read with or without the "model." prefix
    save_file({"embed_tokens.weight": embed, "model.lm_head.weight": head},
              str(tmp_path / "model.safetensors"))  # fmt: skip
    seen = whole_vocab_target(
        _vocab_target(10, 4, False), tmp_path, "auto", torch.float32, "cpu", parts=("lm_head",)
    )
    assert seen.embed_tokens is None and torch.equal(seen.lm_head.weight, head)
    seen = whole_vocab_target(
        _vocab_target(10, 4, False), tmp_path, "auto", torch.float32, "cpu",
        parts=("embed_tokens",),
    )  # fmt: skip
    assert seen.lm_head is None and torch.equal(seen.embed_tokens.weight, embed)


def test_a_tree_budget_under_its_chain_still_leaves_rows_for_its_paths():
    """speculative_num_draft_tokens at or under speculative_num_steps with trees: the request
    table's spare rows for further paths are never negative (a table shorter than its requests
    failed at the first write)."""
    from radixlm.runtime.engine_core import tree_rows

    for algorithm in ("STANDALONE", "EAGLE3"):
        config = EngineConfig(
            speculative_algorithm=algorithm, speculative_draft_model_path="x",
            speculative_eagle_topk=2, speculative_num_steps=5, speculative_num_draft_tokens=3,
        )  # fmt: skip
        assert tree_rows(config) > 0
