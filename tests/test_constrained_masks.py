"""Filling a batch's masks at once (llguidance's threads) against each matcher's own mask."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from radixlm.constrained import (
    GrammarCompiler,
    accept_next_tokens,
    allocate_token_bitmask,
    fill_next_token_bitmasks,
)
from radixlm.runtime.model_loader import default_tokenizer

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
    {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
    {"enum": ["red", "green", "blue"]},
    {"type": "object", "properties": {"n": {"type": "number"}, "ok": {"type": "boolean"}}},
]


@pytest.fixture(scope="module")
def tokenizer():
    return default_tokenizer()


@pytest.mark.parametrize("backend", ["llguidance", "outlines"])
def test_batch_fill_equals_each_matchers_own_mask(tokenizer, backend):
    compiler = GrammarCompiler(tokenizer, vocab_size=49152 + 64, backend=backend)
    matchers = [compiler.compile("json_schema", json.dumps(s)).matcher() for s in SCHEMAS]
    # walk each one a few tokens into a valid instance, one of them to its end (EOS only)
    prefixes = ['{"name":"Bo', "[1,2", '"red"', '{"n":1.5']
    for m, text in zip(matchers, prefixes):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert m.accept_tokens(ids) == len(ids)
    assert matchers[2].accept_token(tokenizer.eos_token_id)  # terminated: only EOS may follow
    rows = list(range(len(matchers)))
    for _ in range(2):  # and again after each accepts its greedy-ish first allowed token
        bitmask = allocate_token_bitmask(len(matchers), 49152 + 64)
        bitmask.zero_()
        fill_next_token_bitmasks(matchers, bitmask)
        for i in rows:
            expected = matchers[i].next_token_mask()
            np.testing.assert_array_equal(bitmask[i].numpy(), expected)
        assert bitmask[2].numpy().view(np.uint32).sum() == 1 << (tokenizer.eos_token_id & 31)
        for m in matchers[:2]:
            allowed = [t for t in m.allowed_token_ids() if t != tokenizer.eos_token_id]
            assert m.accept_token(allowed[0])


def test_sampler_masks_every_grammar_row(tokenizer):
    """Masked rows can only choose allowed tokens, whatever the logits favour: greedy ones (one
    masked argmax, the logits left as they are, the tokens also written into a buffer) beside
    an unconstrained row, and with a sampled grammar row among them (masks applied, then the
    race); an unconstrained row chooses as it would alone."""
    from radixlm.protocol.sampling_params import SamplingParams
    from radixlm.runtime.sampler import Sampler, SamplingRow

    compiler = GrammarCompiler(tokenizer, vocab_size=49152)
    matchers = [compiler.compile("json_schema", json.dumps(s)).matcher() for s in SCHEMAS[:3]]
    greedy, hot = SamplingParams(temperature=0), SamplingParams(temperature=1.5, seed=3)

    def row(params, grammar):
        return SamplingRow(params=params, seed=7, step=0, input_ids=[1], output_ids=[],
                           grammar=grammar)  # fmt: skip

    logits = torch.randn(4, 49152, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    allowed = [set(m.allowed_token_ids()) for m in matchers]
    for params in (greedy, hot):
        rows = [row(greedy, matchers[0]), row(greedy, None), row(params, matchers[1]),
                row(greedy, matchers[2])]  # fmt: skip
        into = torch.full((6,), -1, dtype=torch.int64)
        at = torch.tensor([5, 0, 3, 1])
        ids = Sampler().sample_ids(logits, rows, into=into, into_rows=at).tolist()
        assert torch.equal(logits, before)
        assert into[at].tolist() == ids and into[[2, 4]].tolist() == [-1, -1]
        assert ids[1] == int(logits[1].argmax())  # the unconstrained row, as alone
        for i, ok in ((0, allowed[0]), (2, allowed[1]), (3, allowed[2])):
            assert ids[i] in ok
        masked = logits[0].clone()
        masked[[t for t in range(49152) if t not in allowed[0]]] = float("-inf")
        assert ids[0] == int(masked.argmax())


def test_tokens_taken_together_are_those_accept_token_takes(tokenizer):
    """accept_next_tokens then accept_token ends where accept_token alone does; a matcher used
    otherwise in between (a mask, a rollback) first gives the token back."""
    compiler = GrammarCompiler(tokenizer, vocab_size=49152)
    grammar = compiler.compile("json_schema", json.dumps(SCHEMAS[0]))
    ids = tokenizer.encode('{"name":"Bob"}', add_special_tokens=False)
    together, alone = grammar.matcher(), grammar.matcher()
    for t in ids:
        accept_next_tokens([together], [t])
        assert together.accept_token(t) and alone.accept_token(t)
        assert together.rollback_depth == alone.rollback_depth
        np.testing.assert_array_equal(together.next_token_mask(), alone.next_token_mask())
    assert together.is_accepting() and alone.is_accepting()

    m = grammar.matcher()
    first = ids[0]
    accept_next_tokens([m], [first])
    fresh = grammar.matcher().next_token_mask()
    np.testing.assert_array_equal(m.next_token_mask(), fresh)  # given back: the start again
    assert m.rollback_depth == 0 and m.accept_token(first) and m.rollback_depth == 1
    accept_next_tokens([m], [ids[1]])
    m.rollback(1)  # gives ids[1] back, then undoes `first`
    np.testing.assert_array_equal(m.next_token_mask(), fresh)


def test_masks_begun_in_the_background_match_the_matchers_after_their_step(tokenizer):
    """The engine's order: tokens taken together, masks begun, each token then applied (taken,
    complete?, forced text; one matcher rolled back and advanced otherwise, as jump-forward
    does): the bitmask it gets is every matcher's own mask after all of that."""
    from radixlm.constrained import begin_next_token_bitmasks

    compiler = GrammarCompiler(tokenizer, vocab_size=49152)
    texts = ['{"name":"Bo', "[1,2", '"re', '{"n":1.5']
    matchers = [compiler.compile("json_schema", json.dumps(s)).matcher() for s in SCHEMAS]
    steps = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    for step in range(max(len(ids) for ids in steps)):
        live = [(m, ids[step]) for m, ids in zip(matchers, steps) if step < len(ids)]
        accept_next_tokens([m for m, _ in live], [t for _, t in live])
        bitmask = allocate_token_bitmask(len(matchers), 49152)
        pending = begin_next_token_bitmasks(matchers, bitmask)
        for m, t in live:
            assert m.accept_token(t)
            m.is_terminated()
            m.jump_forward_string()
        if step == 1:  # changed while its mask was filling: filled again
            matchers[0].rollback(1)
            assert matchers[0].accept_token(steps[0][1])
        got = pending.result()
        for i, m in enumerate(matchers):
            np.testing.assert_array_equal(got[i].numpy(), m.next_token_mask())


def test_masks_begun_in_the_background_have_begun_when_the_call_returns(tokenizer, monkeypatch):
    """begin_next_token_bitmasks hands the GIL to the fill thread before it returns: the fill is
    running (or done) then, not waiting for the caller's Python to block. (It waits for the
    thread at most the interpreter's switch interval, made long here: a loaded machine may take
    more than the default 5 ms to run the thread, which is not what is checked.)"""
    import sys

    from radixlm.constrained import begin_next_token_bitmasks

    monkeypatch.setattr(sys, "getswitchinterval", lambda: 5.0)
    compiler = GrammarCompiler(tokenizer, vocab_size=49152)
    matchers = [compiler.compile("json_schema", json.dumps(s)).matcher() for s in SCHEMAS]
    for _ in range(20):
        bitmask = allocate_token_bitmask(len(matchers), 49152)
        pending = begin_next_token_bitmasks(matchers, bitmask)
        (fill,) = pending._pending
        assert fill._future.running() or fill._future.done()
        got = pending.result()
        for i, m in enumerate(matchers):
            np.testing.assert_array_equal(got[i].numpy(), m.next_token_mask())
