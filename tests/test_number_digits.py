"""Digit limits on JSON numbers held by the mask (constrained/number_digits.py): the reader's
tables against a byte-by-byte reading, the matcher's masks and answers against llguidance's
own, every way a mask is filled alike, and the real model held to them."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import radixlm
from radixlm.constrained import GrammarCompiler
from radixlm.constrained.batch import begin_next_token_bitmasks, fill_next_token_bitmasks
from radixlm.constrained.bitmask import allocate_token_bitmask, ids_from_bitmask
from radixlm.constrained.number_digits import (
    ESC,
    EXP,
    FRAC,
    INT,
    OUT,
    STR,
    DigitLimits,
    NumberDigits,
    TokenTable,
    hold,
    schema_digits,
)

# tokens of several digits and of a number's other bytes (the default model's vocabulary has
# digits one a token only)
TOKENS = [
    b"1", b"12", b"123", b"1234", b".", b".5", b".25", b"e", b"E", b"e+", b"e-1", b"E12",
    b"-", b"-1", b"0", b'"', b'"1', b"\\", b'\\"', b"a", b"en", b" ", b",", b"}", b"1,", b"1,234",
    b"5}", b"9.99e9", b"x1", b"", None, b"true", b"1\"", b'":123', b'\\":12',
]  # fmt: skip


def reference_after(state: int, data: bytes, limits: DigitLimits) -> tuple[int, bool]:
    """A plain reading of JSON text, for comparing with NumberDigits: (phase, digits) as a
    state, and whether some part of a number got more digits than allowed."""
    phase, digits, refused = state & 7, state >> 3, False
    most = {INT: limits.integer or 10**9, FRAC: 10**9 if limits.fraction < 0 else limits.fraction,
            EXP: 10**9 if limits.exponent <= 0 else limits.exponent}  # fmt: skip
    for c in data:
        ch = chr(c)
        if phase == STR:
            phase = ESC if ch == "\\" else OUT if ch == '"' else STR
        elif phase == ESC:
            phase = STR
        else:
            if phase in (INT, FRAC, EXP):
                if ch.isdigit():
                    digits += 1
                    refused |= digits > most[phase]
                    continue
                if ch == "." and phase == INT:
                    phase, digits = FRAC, 0
                    continue
                if ch in "eE" and phase != EXP:
                    phase, digits = EXP, 0
                    refused |= limits.exponent == 0
                    continue
                if ch in "+-" and phase == EXP and digits == 0:
                    continue
                phase, digits = OUT, 0
            if ch == '"':
                phase = STR
            elif ch == "-" or ch.isdigit():
                phase, digits = INT, int(ch.isdigit())
                refused |= digits > most[INT]
    return phase, refused


@pytest.mark.parametrize(
    "limits", [DigitLimits(2, 1, 1), DigitLimits(3, 0, 0), DigitLimits(1, -1, -1)]
)
def test_the_readers_tables_are_the_byte_by_byte_reading(limits):
    """`after` (a fast path for tokens with no byte that matters, then a memo) and `keep` (the
    masks, from the tokens that can matter alone) against reading every token's bytes."""
    table = TokenTable(TOKENS)
    digits = NumberDigits(table, limits)
    states = [OUT, STR, ESC] + [p | (d << 3) for p in (INT, FRAC, EXP) for d in range(5)]
    for state in states:
        keep = digits.keep(state)
        for t, data in enumerate(table.bytes):
            phase, refused = reference_after(state, data, limits)
            got, got_refused = digits.after(state, t)
            assert (got & 7, got_refused) == (phase, refused), (state, data)
            allowed = keep is None or bool((int(keep[t >> 5]) >> (t & 31)) & 1)
            assert allowed == (not refused), (state, data)


def test_schema_numbers_raise_the_limits():
    schema = {
        "properties": {
            "a": {"type": "integer", "maximum": 5 * 10**20},
            "b": {"multipleOf": 1e-12},
            "c": {"enum": [1, {"x": [123.4567]}]},
            "minimum": {"type": "string"},  # (a property's name, not a keyword)
        }
    }
    assert schema_digits(schema) == (21, 12)
    # under a property or a definition named like a keyword, numbers are read all the same
    named = {
        "properties": {"minimum": {"enum": [0.12345678911]}},
        "$defs": {"maximum": {"const": 12345678901234567890}},
    }
    assert schema_digits(named) == (20, 11)
    assert schema_digits({"maximum": 10**400, "minimum": float("inf")}) == (401, 0)
    assert DigitLimits(18, 10, 2).covering(schema) == DigitLimits(21, 12, 2)
    assert DigitLimits(0, -1, 2).covering(schema) == DigitLimits(0, -1, 2)  # (no limit stays)


def test_hold_keeps_a_row_that_would_allow_nothing():
    keep = np.array([0b0110], dtype=np.int32)
    row = np.array([0b0011], dtype=np.int32)
    hold(row, keep)
    assert row[0] == 0b0010
    only = np.array([0b1001], dtype=np.int32)
    hold(only, keep)
    assert only[0] == 0b1001


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:  # (tokenizer: conftest's, the default model's)
    return GrammarCompiler(tokenizer, eos_token_ids=[tokenizer.eos_token_id], cache_size=0)


POPULATION = {
    "type": "object",
    "properties": {"population": {"type": "integer"}, "area": {"type": "number"}},
    "required": ["population", "area"],
}


def digit_ids(tokenizer) -> set[int]:
    return {tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)}


def test_the_mask_is_llguidances_less_the_digits_past_the_limit(compiler, tokenizer):
    """Below the limit the mask is llguidance's own; at it, llguidance's without the digits;
    a rollback gives the digits back; in a string digits are free."""
    grammar = compiler.compile("json_schema", POPULATION)
    row = grammar.matcher()
    plain = grammar._template.deep_copy()  # (llguidance's matcher alone, no limits)

    def llguidance_ids() -> set[int]:
        mask = np.zeros(grammar._words, dtype=np.int32)
        plain.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        return set(ids_from_bitmask(mask, grammar.vocab_size))

    digits = digit_ids(tokenizer)
    for i, text in enumerate(['{"population":'] + ["7"] * 18):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert row.accept_tokens(ids) == len(ids)
        assert plain.try_consume_tokens(ids) == len(ids)
        want = llguidance_ids() - (digits if i == 18 else set())
        assert set(row.allowed_token_ids()) == want, i
    assert not row.accept_token(tokenizer.convert_tokens_to_ids("7"))  # a 19th digit
    row.rollback(1)
    assert digits <= set(row.allowed_token_ids()) and row.accept_string("7")
    assert row.accept_string(',"area":' + "1" * 18 + "." + "2" * 10)
    assert not set(row.allowed_token_ids()) & digits  # (11 fraction digits: no)
    assert row.accept_string("e-12}") and row.is_accepting()


def test_rollbacks_one_after_another_go_as_far_as_without_limits(compiler, tokenizer):
    """Each rollback may go back max_rollback tokens from where the last one left: the reader
    goes back with llguidance, however far."""
    grammar = compiler.compile("json_schema", {"type": "array", "items": {"type": "integer"}})
    row = grammar.matcher(max_rollback=2)
    ids = tokenizer.encode("[1,2,3,4,5,6,7", add_special_tokens=False)
    assert row.accept_tokens(ids) == len(ids)
    for _ in range(4):
        row.rollback(2)
    ids = ids[:-8]
    fresh = grammar.matcher()
    assert fresh.accept_tokens(ids) == len(ids)
    assert row._num == fresh._num and row.allowed_token_ids() == fresh.allowed_token_ids()


def test_a_constant_longer_than_the_limits_is_allowed(compiler, tokenizer):
    """Where the grammar allows nothing but more digits, the mask keeps them and the matcher
    takes them (a grammar's limits also rise to its schema's numbers: forced here)."""
    grammar = compiler.compile("json_schema", {"const": 123456})
    grammar.digits = grammar.backend._number_digits(DigitLimits(2, -1, -1))
    row = grammar.matcher()
    assert not row.accept_string("123456")  # (all at once: refused, no jump-forward)
    for d in "123456":
        t = tokenizer.convert_tokens_to_ids(d)
        assert row.allowed_token_ids() == [t]
        assert row.accept_token(t)
    assert row.is_accepting()


def test_every_way_of_filling_masks_holds_the_digits(compiler, tokenizer):
    """A batch filled together (llguidance's threads) and one begun in the background read as
    each matcher's own mask, with matchers at, below and past the limits."""
    grammar = compiler.compile("json_schema", POPULATION)
    rows = []
    for n in (3, 17, 18):
        row = grammar.matcher()
        assert row.accept_string('{"population":' + "5" * n)
        rows.append(row)
    row = grammar.matcher()
    assert row.accept_string('{"population":1,"area":2.' + "3" * 10)
    rows.append(row)
    want = [r.next_token_mask().copy() for r in rows]
    together = allocate_token_bitmask(len(rows), grammar.vocab_size)
    fill_next_token_bitmasks(rows, together)
    background = allocate_token_bitmask(len(rows), grammar.vocab_size)
    begun = begin_next_token_bitmasks(rows, background).result()
    for i, mask in enumerate(want):
        assert np.array_equal(together[i].numpy(), mask), i
        assert np.array_equal(begun[i].numpy(), mask), i
    digits = digit_ids(tokenizer)
    held = [bool(set(ids_from_bitmask(m, grammar.vocab_size)) & digits) for m in want]
    assert held == [True, True, False, False]


def test_a_model_writing_a_number_stops_at_the_limit(engine, default_model_folder):
    """The real model, greedy, asked for a large number: with the default limit it writes more
    digits than the limit set here, and with that limit it writes that many at most."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    prompt = [{"role": "user", "content": "Write a very large number, in JSON as n."}]
    params = {"temperature": 0, "max_new_tokens": 40, "json_schema": json.dumps(schema)}
    free = engine.generate(engine.apply_chat_template(prompt), params)["text"]
    assert len(re.search(r'"n":\s*-?(\d+)', free).group(1)) > 4, free
    with radixlm.Engine(default_model_folder, json_integer_digits=4) as eng:
        held = eng.generate(eng.apply_chat_template(prompt), params)["text"]
    assert len(str(abs(json.loads(held)["n"]))) <= 4, held
