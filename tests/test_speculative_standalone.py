"""STANDALONE speculative decoding (runtime/speculative/standalone.py): a draft model of the same
tokenizer drafts, the target verifies. On the CPU in float32: greedy outputs are plain decoding's
token for token whether the draft model is the target itself (nearly every draft token accepted)
or a tiny random model (nearly none); a grammar still holds; seeded samples repeat; the draft
model's own KV cache is whole again after a flush; a draft model of another tokenizer is refused
up front, and one that fails at run time turns drafting off without failing a request."""

from __future__ import annotations

import json
import shutil

import pytest

import radixlm
from tests.test_speculative_engine import _CODE, _NUMBERS, kv_whole, results, start, workload

DRAFTING = {"speculative_algorithm": "STANDALONE", "speculative_adaptive": False}


def draft_of(engine):
    return engine._core.speculative.draft_model


@pytest.fixture(scope="module")
def reference(engine, tokenizer):
    """The workload's plain greedy outputs (the shared default engine)."""
    prompts, params = workload(tokenizer)
    return prompts, params, engine.generate(prompts, params)


@pytest.fixture(scope="module")
def self_drafted(default_model_folder):
    with start(
        default_model_folder, speculative_draft_model_path=default_model_folder,
        speculative_num_draft_tokens=4, **DRAFTING,
    ) as eng:  # fmt: skip
        yield eng


def test_the_target_drafting_for_itself_gives_its_own_tokens_and_accepts_them(
    self_drafted, reference
):
    prompts, params, plain = reference
    outs = self_drafted.generate(prompts, params)
    assert results(outs) == results(plain)
    stats = self_drafted.get_stats()
    assert kv_whole(stats), stats
    assert stats["spec_verify_ct"] > 0
    # the same model on both sides: its drafts are what the target computes, but for rounding
    # where the draft's decode steps and the target's verify step differ at a near-tie
    assert stats["spec_accept_rate"] > 0.9, stats
    assert stats["spec_accept_length"] > 3.0, stats


def test_a_grammar_holds_and_seeded_samples_repeat_with_a_draft_model(
    self_drafted, default_model_folder
):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    constrained = {"temperature": 0, "max_new_tokens": 40, "json_schema": json.dumps(schema)}
    prompt = "<|im_start|>user\nA person as JSON.<|im_end|>\n<|im_start|>assistant\n"
    got = self_drafted.generate(prompt, constrained)
    # (against the loop without overlap, as every speculative step runs: with overlap, text that
    # jump-forward appends after a token already in flight is tokenized at another boundary)
    with start(default_model_folder, disable_overlap_schedule=True) as plain:
        assert results([got]) == results([plain.generate(prompt, constrained)])
    value = json.loads(got["text"])
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)
    assert got["meta_info"]["spec_verify_ct"] > 0
    sampled = {"temperature": 0.8, "max_new_tokens": 12, "seed": 3}
    first = self_drafted.generate([_NUMBERS, _CODE], sampled)
    again = self_drafted.generate([_CODE, _NUMBERS], sampled)
    assert results(first) == results(again[::-1])
    assert first[0]["meta_info"]["spec_verify_ct"] > 0


def test_a_random_draft_model_changes_nothing_but_speed_and_a_failing_one_fails_nothing(
    tiny_model_folder, default_model_folder, reference
):
    """A tiny random draft model: plain outputs, its cache empty after a flush; then, made to
    raise, it turns drafting off and no request fails."""
    prompts, params, plain = reference
    with start(
        default_model_folder, speculative_draft_model_path=tiny_model_folder, **DRAFTING
    ) as eng:
        outs = eng.generate(prompts, params)
        stats = eng.get_stats()
        draft = draft_of(eng)
        assert draft.allocator.num_free < draft.allocator.capacity  # (finished requests' KV
        assert eng.flush_cache()  # waits for their next draft, or a flush)
        assert draft.allocator.num_free == draft.allocator.capacity
        assert draft.rows.num_free == eng.config.max_running_requests

        def broken(reqs, num):
            raise RuntimeError("the draft model ran out of memory")

        draft.draft = broken
        worker = eng._core.speculative
        again = eng.generate(prompts[:3], params[:3])
        assert worker.draft_model is None  # drafting is off
        assert eng.generate(prompts[3], params[3])["output_ids"] == plain[3]["output_ids"]
        assert eng.get_stats()["spec_verify_ct"] == stats["spec_verify_ct"]
    assert results(outs) == results(plain)
    assert results(again) == results(plain[:3])
    assert kv_whole(stats), stats
    assert stats["spec_verify_ct"] > 0 and stats["spec_num_proposed_drafts"] > 0


def test_a_draft_model_of_another_tokenizer_is_refused(
    tiny_model_folder, default_model_folder, tmp_path
):
    other = tmp_path / "other-tokenizer"
    shutil.copytree(tiny_model_folder, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[1000:1002]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: another tokenizer
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="its tokenizer is not the target model's"):
        start(default_model_folder, speculative_draft_model_path=str(other), **DRAFTING)


def test_the_two_pools_split_the_room_the_target_alone_would_take(default_model_folder):
    """Every token a request holds needs a slot in both pools: with the draft model as large as
    the target, each pool gets half the slots the target alone would have, so that both fit."""
    with start(
        default_model_folder, speculative_draft_model_path=default_model_folder,
        mem_fraction_static=0.01, **DRAFTING,
    ) as eng, start(default_model_folder, mem_fraction_static=0.01) as alone:  # fmt: skip
        draft = draft_of(eng)
        both = eng.get_stats()["kv_pool_capacity_tokens"]
        assert draft.allocator.capacity == both
        assert both == pytest.approx(
            alone.get_stats()["kv_pool_capacity_tokens"] / 2, rel=0.25
        )  # (free memory moves)


def test_the_option_reaches_the_engine_from_the_cli():
    from radixlm import cli

    args = cli._build_parser().parse_args(
        ["serve", "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "x"]
    )
    assert args.speculative_algorithm == "STANDALONE" and args.speculative_draft_model_path == "x"
    assert (
        radixlm.EngineConfig(
            speculative_algorithm="standalone", speculative_draft_model_path="x"
        ).speculative_num_draft_tokens
        == 5
    )  # four draft model steps


def test_the_decode_step_path_drafts_what_the_eager_path_drafts(tiny_model_folder):
    """The GPU's path (decode steps replayed from graphs; here the same padded steps run eagerly)
    against the eager forwards, over rounds in which the target takes some of the draft (or all
    of it, and a token more), for a new prompt, a long catch-up and requests of several lengths;
    the caches hold the same tokens and end empty."""
    import torch

    from radixlm.protocol.sampling_params import SamplingParams
    from radixlm.runtime.config import EngineConfig
    from radixlm.runtime.model_loader import load_tokenizer
    from radixlm.runtime.request import Req
    from radixlm.runtime.speculative.standalone import DraftModel

    config = EngineConfig(
        model_path=tiny_model_folder, device="cpu", dtype="float32",
        speculative_algorithm="STANDALONE", speculative_draft_model_path=tiny_model_folder,
    )  # fmt: skip
    tok = load_tokenizer(tiny_model_folder)
    made = [DraftModel.load(config, tok, torch.float32, torch.device("cpu"), 256) for _ in range(2)]
    for m in made:
        m.make_cache(2048)
    eager, stepped = made
    stepped.use_graphs(8, capture=False)

    def reqs():
        return [
            Req(f"r{n}", list(range(100, 100 + n)), SamplingParams(max_new_tokens=64), 0, None)
            for n in (3, 9, 1)
        ]

    pairs = list(zip(reqs(), reqs()))
    taken = [2, 5, 0, 1]  # draft tokens the target takes each round (5: all, and the bonus)
    for round_, take in enumerate(taken):
        got = [m.draft(list(side), 4) for m, side in zip(made, zip(*pairs))]
        assert got[0] == got[1] and all(len(c) == 4 for c in got[0])
        for k, (a, b) in enumerate(pairs):
            more = got[0][k][:take] + [7 + round_ + k]  # (+ the target's own token)
            if k == 1 and round_ == 2:
                more += list(range(300, 310))  # (jump-forward text: a long catch-up)
            a.output_ids += more
            b.output_ids += more
    held = [[s.tokens for s in m._seen.values()] for m in made]
    assert held[0] == held[1] and len(held[0]) == 3
    for m in made:
        m.release_all()
        assert m.allocator.num_free == m.allocator.capacity
        assert m.rows.num_free == config.max_running_requests


def test_draft_trees_are_the_chain_and_each_steps_rivals_on_either_path(default_model_folder):
    """speculative_eagle_topk=2: each draft is a tree of at most num nodes, whose first path is
    the greedy chain of `speculative_draft_depth` steps (what topk=1 drafts) and whose other
    nodes are leaves, each a draft step's next candidate; the decode-step path (graphs' padded
    steps, run eagerly here) drafts the trees the eager forwards do, round after round."""
    import torch

    from radixlm.protocol.sampling_params import SamplingParams
    from radixlm.runtime.config import EngineConfig
    from radixlm.runtime.model_loader import load_tokenizer
    from radixlm.runtime.request import Req
    from radixlm.runtime.speculative.standalone import DraftModel
    from radixlm.runtime.speculative.tree import DraftTree

    def model(topk: int, graphs: bool) -> DraftModel:
        config = EngineConfig(
            model_path=default_model_folder, device="cpu", dtype="float32",
            speculative_algorithm="STANDALONE", speculative_draft_model_path=default_model_folder,
            speculative_eagle_topk=topk, speculative_num_steps=3,
            speculative_num_draft_tokens=6 if topk > 1 else 4,
        )  # fmt: skip
        m = DraftModel.load(config, tok, torch.float32, torch.device("cpu"), 256)
        m.make_cache(2048)
        if graphs:
            m.use_graphs(8, capture=False)
        return m

    tok = load_tokenizer(default_model_folder)
    made = [model(2, False), model(2, True), model(1, False)]

    texts = ["The capital of France is", "def fibonacci(n):\n    ", "1, 2, 3,"]

    def reqs():
        return [
            Req(f"r{k}", tok.encode(t), SamplingParams(max_new_tokens=64), 0, None)
            for k, t in enumerate(texts)
        ]

    sides = [reqs() for _ in made]
    trees = 0
    for round_, take in enumerate([1, 3, 0]):
        eager, stepped, chains = (
            m.draft(side, 5 if m.width > 1 else 3) for m, side in zip(made, sides)
        )
        assert eager == stepped
        for k, (tree, chain) in enumerate(zip(eager, chains)):
            assert 1 <= len(tree) <= 5 and len(chain) == 3
            if isinstance(tree, DraftTree):
                trees += 1
                first = tree.first_path()
                assert all(p == -1 or p < j for j, p in enumerate(tree.parents))
            else:
                first = tuple(tree)
            assert list(first) == chain[: len(first)]  # (the chain, cut where leaves rank above)
            more = chain[:take] + [9 + round_ + k]  # (+ the target's own token)
            for side in sides:
                side[k].output_ids += more
    assert trees > 0
    for m in made:
        m.release_all()
        assert m.allocator.num_free == m.allocator.capacity


def test_draft_trees_change_nothing_but_speed(tiny_model_folder, default_model_folder, reference):
    """speculative_eagle_topk=2 with a draft model: trees verified in one step each (a random
    draft model's, whose rivals differ from its chain), greedy outputs plain decoding's."""
    prompts, params, plain = reference
    with start(
        default_model_folder, speculative_draft_model_path=tiny_model_folder,
        speculative_eagle_topk=2, **DRAFTING,
    ) as eng:  # fmt: skip
        assert eng.config.speculative_num_draft_tokens == 7  # (a chain of 3 and its rivals)
        outs = eng.generate(prompts, params)
        stats = eng.get_stats()
    assert results(outs) == results(plain)
    assert kv_whole(stats), stats
    assert stats["spec_verify_ct"] > 0 and stats["spec_num_proposed_drafts"] > 0
