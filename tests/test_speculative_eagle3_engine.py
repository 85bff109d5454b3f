"""EAGLE-3 drafting in the engine (runtime/speculative/eagle3.py), and EAGLE-1/2 drafting (the
same machinery over the target's final hidden state: the engine tests below run both). The
drafter's cache, fed the target's features the way the model runner feeds them (prompt chunks,
verify steps that accept part of a draft, plain steps, a rewritten context, a prefix another
request computed), drafts at every round the chain its draft computes from scratch over the
whole context (training-time test's forward, itself checked against the draft layer in
test_speculative_eagle3.py). In the engine, on the default model: greedy outputs are plain
decoding's token for token, and the chains it drafts while a verifier accepts them are the ones
the draft computes from the target's own features."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from radixlm.runtime.speculative.eagle3 import Eagle3Drafter
from radixlm.runtime.speculative.eagle3_training import _draft_logits as draft_logits
from radixlm.runtime.speculative.eagle3_training import ttt_forward
from tests.test_speculative_eagle3 import TARGET_HIDDEN, load_draft, target_pair, write_draft
from tests.test_speculative_engine import kv_whole, results, start, workload

CPU = torch.device("cpu")


class FakeReq:
    """What the drafter reads of a request."""

    def __init__(self, prompt: list[int], row: int) -> None:
        self.input_ids, self.output_ids, self.pool_row = list(prompt), [], row
        self.is_finished = False

    def ids_slice(self, start: int, end: int | None = None) -> list[int]:
        return (self.input_ids + self.output_ids)[start:end]

    @property
    def newest(self) -> int:
        return len(self.input_ids) + len(self.output_ids) - 1


def _draft_logits(draft, ids: list[int], features: torch.Tensor, chain: list[int]):
    """The draft's logits (over its own vocabulary) at each step of `chain` after context `ids`
    (its newest token last), with the target's features at each position, each step fed the
    tokens of `chain` before it (teacher forcing)."""
    n = len(ids) - 1
    tokens = torch.tensor([ids + chain])
    padded = torch.zeros(1, tokens.shape[1], features.shape[-1])
    padded[0, :n] = features[:n]
    with torch.no_grad():
        outs = ttt_forward(draft, tokens, padded, steps=len(chain))
        rows = torch.stack([out[0, n - 1] for out in outs])
        return draft_logits(draft, rows)


def reference_chain(draft, ids: list[int], features: torch.Tensor, chain: list[int]) -> list[int]:
    """The draft's greedy tokens at each step of `chain` (`_draft_logits`): equal to `chain`
    exactly when the chain is the draft's own."""
    return draft.target_ids(_draft_logits(draft, ids, features, chain).argmax(-1)).tolist()


def assert_the_drafts_own(drafter, ids: list[int], features: torch.Tensor, chain: list[int]):
    """Each token of `chain`, drafted by the engine after `ids`, is the draft's best from
    scratch over `features` (`_draft_logits`), or within rounding of it."""
    logits = _draft_logits(drafter.model, ids, features, chain)[:, : drafter.sampled_vocab]
    by_target = torch.full((len(chain), drafter.sampled_vocab), float("-inf"))
    by_target[:, drafter.model.target_ids(torch.arange(logits.shape[-1]))] = logits
    best = by_target.max(-1).values
    took = by_target.gather(-1, torch.tensor(chain)[:, None])[:, 0]
    assert torch.all(best - took <= 1e-3 * best.abs().clamp(min=1)), (ids[-3:], chain)


@pytest.mark.parametrize("graphs", [False, True])
def test_the_cache_drafts_what_the_draft_computes_from_the_whole_context(tmp_path, graphs):
    """(graphs: short catch-ups as decode rows and the draft steps after the first as decode
    steps, through the graphs' padded steps, run eagerly on the CPU, replayed on a GPU, over the
    Triton backend they are captured with)"""
    _, target = target_pair()
    draft = load_draft(write_draft(tmp_path / "draft"), target)
    backend = "triton" if graphs else "torch"
    config = SimpleNamespace(
        max_total_tokens=None, attention_backend=backend, speculative_eagle_topk=1
    )
    drafter = Eagle3Drafter(draft, target, config, CPU, torch.float32)
    table = torch.zeros(4, 96, dtype=torch.int32)
    drafter.make_cache(400, table, max_steps=3, padding_row=3)
    rows_runs: list[int] = []  # (the catch-ups run as decode rows: their positions)
    if graphs:
        drafter.use_graphs(4, capture=False)
        run_rows = drafter.row_graphs.run
        drafter.row_graphs.run = lambda *a: rows_runs.append(len(a[0])) or run_rows(*a)
    gen = torch.Generator().manual_seed(0)
    features = {1: torch.randn(96, 3 * TARGET_HIDDEN, generator=gen)}  # by request row
    next_slot = [1]

    def slots(row: int, start: int, end: int) -> None:  # the target's slots for positions
        table[row, start:end] = torch.arange(next_slot[0], next_slot[0] + end - start)
        next_slot[0] += end - start

    def hand(req: FakeReq, start: int, count: int) -> None:  # as the model runner does
        rows = features[req.pool_row][start : start + count]
        drafter.keep_features([(req, start, 0, count)], rows)

    def check(*reqs: FakeReq, num: int = 4) -> list[int]:
        chains = drafter.draft(list(reqs), num)
        for req, chain in zip(reqs, chains):
            ids = req.input_ids + req.output_ids
            assert len(chain) == num
            assert chain == reference_chain(draft, ids, features[req.pool_row], chain)
        return chains[0]

    r = FakeReq(torch.randint(0, 96, (10,), generator=gen).tolist(), 1)
    slots(1, 0, 10)
    hand(r, 0, 10)  # the prompt, its first token sampled
    r.output_ids.append(5)
    chain = check(r)
    for accepted in (2, 0, 3):  # a verify step takes `accepted` draft tokens and its own
        at = r.newest
        slots(1, at, at + 1 + accepted)
        r.output_ids += chain[:accepted] + [int(torch.randint(0, 96, (1,), generator=gen))]
        hand(r, at, 1 + accepted)
        chain = check(r)
    for _ in range(20):  # plain steps (the gate's): caught up without drafts past 16 waiting
        at = r.newest
        slots(1, at, at + 1)
        r.output_ids.append(int(torch.randint(0, 96, (1,), generator=gen)))
        hand(r, at, 1)
    assert drafter._entries[id(r)].ctx > len(r.input_ids)
    check(r)
    # the last three outputs rewritten (jump-forward's retokenizing): run again from there
    del r.output_ids[-3:]
    at = r.newest
    features[1][at:] = torch.randn(96 - at, 3 * TARGET_HIDDEN, generator=gen)
    slots(1, at, at + 3)
    r.output_ids += [7, 8, 9]
    hand(r, at, 3)
    check(r, num=2)
    # another request shares r's first eight prompt tokens and their slots (the prefix cache):
    # its features start after them, and it drafts over the entries r made (the eighth, made
    # with r's ninth token, is right where the two agree on it)
    s = FakeReq(r.input_ids[:9] + [3, 1], 2)
    features[2] = torch.cat([features[1][:8], torch.randn(88, 3 * TARGET_HIDDEN, generator=gen)])
    table[2, :8] = table[1, :8]
    slots(2, 8, 11)
    hand(s, 8, 3)
    s.output_ids.append(11)
    at = r.newest  # (and r one step on: a draft of both, one position and three to catch up)
    slots(1, at, at + 1)
    r.output_ids.append(6)
    hand(r, at, 1)
    check(r, s)
    # a request without its features up to its newest token gets no draft
    s.output_ids.append(12)
    assert drafter.draft([s], 3) == [[]]
    r.is_finished = True
    drafter.draft([s], 3)
    assert id(r) not in drafter._entries and id(s) in drafter._entries
    # a request whose draft steps would pass the request table's last column gets no draft;
    # one that fits, up to there
    far = FakeReq(torch.randint(0, 96, (94,), generator=gen).tolist(), 0)
    features[0] = torch.randn(96, 3 * TARGET_HIDDEN, generator=gen)
    slots(0, 0, 94)
    hand(far, 0, 94)
    far.output_ids.append(5)  # (the newest token at position 94 of 0 .. 95)
    assert drafter.draft([far], 4) == [[]]
    check(far, num=2)
    if graphs:  # (short catch-ups as decode rows, the prompts' eagerly)
        assert rows_runs and max(rows_runs) > 1, rows_runs


# ---- in the engine, on the default model --------------------------------------------------------

EAGLE = {"speculative_algorithm": "EAGLE3", "speculative_adaptive": False}


@pytest.fixture(scope="module")
def random_draft(engine, tmp_path_factory) -> str:
    """An untrained EAGLE-3 draft for the default model (its LM head, random layer)."""
    from radixlm.runtime.speculative.eagle3_training import new_draft

    folder = tmp_path_factory.mktemp("eagle3-draft")
    draft, raw = new_draft(engine.model, seed=0)
    draft.save(folder, raw)
    return str(folder)


@pytest.fixture(scope="module")
def reference(engine):
    """The workload's plain greedy outputs (the shared default engine)."""
    prompts, params = workload(engine.tokenizer)
    return prompts, params, engine.generate(prompts, params)


@pytest.fixture(scope="module", params=["EAGLE3", "EAGLE"])
def eagle_engine(request, default_model_folder, random_draft, engine, tmp_path_factory):
    """The default model drafting with an untrained draft: EAGLE-3's (`random_draft`), or an
    EAGLE-1/2 one (the same machinery over the target's final hidden state)."""
    from radixlm.runtime.speculative.eagle3_training import new_draft

    folder = random_draft
    if request.param == "EAGLE":
        folder = tmp_path_factory.mktemp("eagle-draft")
        draft, raw = new_draft(engine.model, seed=0, algorithm="EAGLE")
        draft.save(folder, raw)
    kw = {**EAGLE, "speculative_algorithm": request.param}
    with start(default_model_folder, speculative_draft_model_path=str(folder), **kw) as eng:
        yield eng


def test_greedy_outputs_are_plain_decodings_and_a_grammar_holds(eagle_engine, reference):
    prompts, params, plain = reference
    outs = eagle_engine.generate(prompts, params)
    assert results(outs) == results(plain)
    assert eagle_engine._core.speculative.eagle is not None  # (drafting never failed)
    stats = eagle_engine.get_stats()
    assert stats["spec_verify_ct"] > 0 and stats["spec_num_proposed_drafts"] > 0, stats
    assert kv_whole(stats), stats
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    constrained = {"temperature": 0, "max_new_tokens": 20, "json_schema": json.dumps(schema)}
    got = eagle_engine.generate("A number as JSON: ", constrained)
    assert set(json.loads(got["text"])) == {"n"}
    sampled = {"temperature": 0.8, "max_new_tokens": 12, "seed": 3}
    first = eagle_engine.generate(prompts[:2], sampled)
    assert results(first) == results(eagle_engine.generate(prompts[:2], sampled))


def test_the_engine_drafts_from_the_targets_own_features(eagle_engine, engine):
    """The draft's chains are replaced by plain decoding's own next tokens (all of them, or the
    first half), so that verify steps accept drafts; each chain the draft made is then checked
    against the draft run from scratch over the target's features of the final sequence: its
    token is the reference's best, or within rounding of it."""
    from radixlm.runtime.speculative.draft_data import Conversation, target_features

    prompts, params = workload(eagle_engine.tokenizer)
    prompts, params = prompts[:3], [dict(p, max_new_tokens=24) for p in params[:3]]
    plain = engine.generate(prompts, params)
    tok = eagle_engine.tokenizer
    prompt_ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    wanted = {tuple(ids): out["output_ids"] for ids, out in zip(prompt_ids, plain)}
    drafter = eagle_engine._core.speculative.eagle
    made, rounds = [], [0]
    own = drafter.draft

    def drafting(reqs, num):
        chains = own(reqs, num)
        out = []
        for req, chain in zip(reqs, chains):
            made.append((tuple(req.input_ids), list(req.output_ids), chain))
            future = wanted[tuple(req.input_ids)][len(req.output_ids) :][: len(chain)]
            rounds[0] += 1
            out.append(
                future if rounds[0] % 3 else future[: len(future) // 2] + chain[len(future) // 2 :]
            )
        return out

    drafter.draft = drafting
    try:
        outs = eagle_engine.generate(prompts, params)
    finally:
        del drafter.draft
    assert results(outs) == results(plain)
    assert eagle_engine._core.speculative.eagle is not None
    assert sum(o["meta_info"]["spec_num_correct_drafts"] for o in outs) > 10
    model = eagle_engine.model
    convs = [Conversation(ids, out["output_ids"]) for ids, out in zip(prompt_ids, plain)]
    feats = target_features(model, model.cfg, convs, drafter.aux_layers, CPU)
    by_prompt = {tuple(c.prompt_ids): f for c, f in zip(convs, feats)}
    checked = 0
    for prompt, output, chain in made:
        if not chain:
            continue
        assert_the_drafts_own(drafter, list(prompt) + output, by_prompt[prompt], chain)
        checked += 1
    assert checked >= 10


def test_a_draft_made_for_another_model_is_refused_at_start(default_model_folder, tmp_path):
    from radixlm import EngineConfig, cli

    folder = write_draft(tmp_path / "tiny-draft")  # (a draft of a 48-wide target)
    with pytest.raises(ValueError, match="target model's is 576: a draft made for another model"):
        start(default_model_folder, speculative_draft_model_path=str(folder), **EAGLE)
    args = cli._build_parser().parse_args(
        ["serve", "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "d"]
    )
    assert (args.speculative_algorithm, args.speculative_draft_model_path) == ("EAGLE3", "d")
    config = EngineConfig(speculative_algorithm="eagle3", speculative_draft_model_path="d")
    assert config.speculative_num_draft_tokens == 4  # three draft steps


def test_a_draft_is_found_for_its_model_without_a_path(
    tiny_model_folder, random_draft, engine, tmp_path, monkeypatch
):
    """Without speculative_draft_model_path the engine takes the draft under draft_heads/ whose
    config records the model's LM head; a model none was made for is told how to make one."""
    from radixlm.runtime.speculative import eagle3, medusa

    shipped = tmp_path / "heads"
    (shipped / "other").mkdir(parents=True)  # (a folder of something else is passed over)
    monkeypatch.setattr(medusa, "shipped_heads_dir", lambda: shipped)
    with pytest.raises(ValueError, match="no EAGLE-3 draft ships for this model"):
        start(tiny_model_folder, **EAGLE)
    import shutil

    shutil.copytree(random_draft, shipped / "default-eagle3")
    config = json.loads((shipped / "default-eagle3" / "config.json").read_text())
    config[eagle3.SAMPLE_KEY] = eagle3.target_sample(engine.model)
    (shipped / "default-eagle3" / "config.json").write_text(json.dumps(config))
    assert eagle3.find_shipped_draft(engine.model) == shipped / "default-eagle3"
    with start(tiny_model_folder, disable_radix_cache=True) as tiny:
        assert eagle3.find_shipped_draft(tiny.model) is None


def test_the_default_model_drafts_with_the_draft_that_ships_for_it(default_model_folder, reference):
    """EAGLE3 without a path on the default model: the draft in draft_heads/ made for it, whose
    drafts verify steps accept, and outputs plain decoding's."""
    from radixlm.runtime.speculative.medusa import shipped_heads_dir

    with start(default_model_folder, **EAGLE) as eng:
        drafter = eng._core.speculative.eagle
        assert drafter.folder == shipped_heads_dir() / "smollm2-135m-instruct-eagle3"
        prompts, params, plain = reference
        outs = eng.generate(prompts, params)
        stats = eng.get_stats()
        assert eng._core.speculative.eagle is not None  # (drafting never failed)
    assert results(outs) == results(plain)
    assert stats["spec_verify_ct"] > 0 and stats["spec_accept_length"] > 1.1, stats


def test_preemption_and_requests_beside_that_decode_plainly(
    default_model_folder, reference, engine
):
    """A pool smaller than the workload's prompts, with requests that decode plainly (a
    penalty, min_new_tokens) or within a grammar beside: requests are preempted and run again
    (their features handed over again from where the prefix cache leaves them), and every
    output is plain decoding's."""
    from tests.test_speculative_engine import PLAIN_ONES

    prompts, params, _ = reference
    tok = engine.tokenizer
    pool = sum(len(tok.encode(p, add_special_tokens=False)) for p in prompts) - 8
    prompts, params = prompts + PLAIN_ONES[0], params + PLAIN_ONES[1]
    with start(default_model_folder, disable_overlap_schedule=True) as eng:
        plain = eng.generate(prompts, params)
    with start(
        default_model_folder, max_total_tokens=pool, max_running_requests=8, **EAGLE
    ) as eng:  # fmt: skip
        outs = eng.generate(prompts, params)
        stats = eng.get_stats()
        assert eng._core.speculative.eagle is not None  # (drafting never failed)
    assert results(outs) == results(plain)
    assert stats["num_preemptions"] > 0, stats
    assert kv_whole(stats), stats
    assert stats["spec_verify_ct"] > 0, stats


def test_trees_of_the_draft_s_likeliest_paths_give_plain_decoding_s_outputs(
    default_model_folder, reference, engine
):
    """speculative_eagle_topk=3 with the shipped draft: trees of its chain and, at each depth,
    its two likeliest rivals (the 9 likeliest nodes). Greedy outputs are plain decoding's;
    verify steps take trees and some accept a rival off the chain; and after those too the
    draft's chains are what it computes from scratch over the final sequence's features (the
    features kept along the path each verify took, not the tree's first rows). The requests
    run one at a time with the prefix cache on: the chat prompts share their template's
    beginning, cached by the first, and each later one computes its last position again and
    catches up on it with its own next token (the entry the first made there, with another
    token, gave other drafts). (Requests that compute a shared prefix in the same step still
    share its last entry, eagle3.py.) Then the same all at once beside a constrained request and
    seeded sampled ones: plain decoding's outputs, valid JSON, and samples that repeat."""
    from radixlm.runtime.speculative.draft_data import Conversation, target_features
    from radixlm.runtime.speculative.tree import Accepted, DraftTree

    prompts, params, plain = reference
    with start(default_model_folder, speculative_eagle_topk=3, **EAGLE) as eng:
        spec = eng._core.speculative
        drafter = spec.eagle
        made, own = [], drafter.draft

        def drafting(reqs, num):
            out = own(reqs, num)
            made.extend((tuple(r.input_ids), list(r.output_ids), d) for r, d in zip(reqs, out))
            return out

        verified, verify = [], spec.verify

        def verifying(*a, **k):
            out = verify(*a, **k)
            verified.extend(out)
            return out

        drafter.draft, spec.verify = drafting, verifying
        outs = [eng.generate(p, q) for p, q in zip(prompts, params)]  # (one at a time)
        stats = eng.get_stats()
        drafter.draft, spec.verify = own, verify
        # then all at once, beside a request within a grammar (drafted for as a chain) and
        # seeded sampled ones (trees verified by rejection sampling), which repeat
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        constrained = {"temperature": 0, "max_new_tokens": 20, "json_schema": json.dumps(schema)}
        sampled = {"temperature": 0.8, "max_new_tokens": 12, "seed": 3}
        extra = ["A number as JSON: ", prompts[0], prompts[2]]
        mixed = eng.generate(prompts + extra, params + [constrained, sampled, sampled])
        again = eng.generate(extra[1:], [sampled, sampled])
        assert spec.eagle is not None  # (drafting never failed)
    assert results(outs) == results(plain) == results(mixed[: len(prompts)])
    assert set(json.loads(mixed[len(prompts)]["text"])) == {"n"}
    assert results(mixed[len(prompts) + 1 :]) == results(again)
    assert kv_whole(stats), stats
    trees = [d for _, _, d in made if isinstance(d, DraftTree)]
    assert trees and all(len(d) <= 9 for _, _, d in made)
    # a rival accepted: a path off the tree's first path (its nodes 0, 1, ...)
    assert any(isinstance(v, Accepted) and v.nodes != list(range(len(v.nodes))) for v in verified)
    tok = eng.tokenizer
    convs = [
        Conversation(tok.encode(p, add_special_tokens=False), o["output_ids"])
        for p, o in zip(prompts, plain)
    ]
    feats = target_features(engine.model, engine.model.cfg, convs, drafter.aux_layers, CPU)
    by_prompt = {tuple(c.prompt_ids): f for c, f in zip(convs, feats)}
    checked = 0
    for prompt, output, draft in made:
        chain = list(draft.first_path()) if isinstance(draft, DraftTree) else list(draft)
        if not chain or prompt not in by_prompt:
            continue
        assert_the_drafts_own(drafter, list(prompt) + output, by_prompt[prompt], chain)
        checked += 1
    assert checked >= 10


@pytest.mark.parametrize("algorithm", ["EAGLE3", "MEDUSA"])
def test_the_gate_rests_the_drafter_while_drafting_does_not_pay(
    default_model_folder, reference, algorithm
):
    """EAGLE3 and MEDUSA with the gate on (the default) on the CPU, where a verify step costs about
    as many decode steps as its rows and drafting loses: once the gate keeps drafting off, the
    steps keep nothing for the drafter (EAGLE3's features, MEDUSA's hidden states: they run as
    plain decoding's) until a try of drafting is near, and the outputs are plain decoding's."""
    prompts, params, plain = reference
    with start(default_model_folder, speculative_algorithm=algorithm) as eng:
        spec = eng._core.speculative
        kept, in_flight = [], []
        if algorithm == "EAGLE3":
            own = spec.eagle.keep_features

            def keep(spans, f):
                kept.append(1)
                in_flight.extend(req.num_pending for req, *_ in spans)
                return own(spans, f)

            spec.eagle.keep_features = keep
        else:
            own = spec._draft

            def keep(hidden, reqs, taken):
                kept.append(1)
                in_flight.extend(r.num_pending for r in reqs)
                return own(hidden, reqs, taken)

            spec._draft = keep
        outs = [eng.generate(p, q) for p, q in zip(prompts, params)]
        stats = eng.get_stats()
        rates = spec.gate.rates()
        overlapped = eng._core.num_overlapped_steps
        drafter = spec.eagle if algorithm == "EAGLE3" else spec.medusa
    assert results(outs) == results(plain)
    assert rates[(1, False)] > rates[(1, True)], rates  # (drafting lost, as on this CPU)
    assert 0 < len(kept) < stats["num_steps"] / 2, (len(kept), stats["num_steps"])
    # the rested steps overlap as plain decoding's, and no step launched beside one in flight
    # kept anything for the drafter (which would have turned itself off on a failure)
    assert overlapped > 0 and drafter is not None
    assert not any(in_flight), in_flight
