"""Grammars over the real SmolLM2 tokenizer: random walks over allowed tokens must only ever
produce valid outputs, and the MaskBench soundness sample must have no false accept."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import pytest

from radixlm.constrained import (
    GRAMMAR_BACKENDS,
    GrammarCompiler,
    GrammarError,
    allocate_token_bitmask,
    dump_json_for_schema,
    schema_validator,
)
from radixlm.runtime.model_loader import default_tokenizer

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(scope="module")
def tokenizer():
    try:
        return default_tokenizer()
    except ValueError as e:  # the embedded model package is missing
        pytest.skip(str(e))


@pytest.fixture(scope="module", params=GRAMMAR_BACKENDS)
def compiler(request, tokenizer) -> GrammarCompiler:
    """Each backend in turn (what a user sees holds on both); logits wider than the tokenizer."""
    return GrammarCompiler(
        tokenizer, vocab_size=49152 + 64, compile_timeout=60, backend=request.param
    )


@pytest.fixture(scope="module")
def outlines(tokenizer) -> GrammarCompiler:
    """The DFA backend alone: for its automaton's own checks."""
    return GrammarCompiler(tokenizer, vocab_size=49152 + 64, compile_timeout=60, backend="outlines")


_STRUCTURAL = np.frombuffer(b'{}[],:"@.', dtype=np.uint8)


def random_walk(grammar, vocab, rng: random.Random, max_tokens: int = 400) -> str | None:
    """Sample allowed tokens until EOS; the text, or None if the walk ran too long. `vocab`: the
    compiler's TokenVocabulary (token bytes, first bytes).

    Picks a first byte uniformly among those allowed (structural ones more often), then a
    short token starting with it, so that strings close and walks end.
    """
    first = vocab.first_byte
    lengths = np.array([len(b) if b else 0 for b in vocab.token_bytes])
    matcher = grammar.matcher()
    row = allocate_token_bitmask(1, vocab.size)[0]
    out = bytearray()
    eos = vocab.eos_token_ids[0]
    for step in range(max_tokens):
        matcher.fill_next_token_bitmask(row)
        flags = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")[: vocab.size]
        allowed = np.flatnonzero(flags)
        assert allowed.size, "a live state must allow some token"
        if eos in allowed and (rng.random() < 0.3 or step > max_tokens // 2 or allowed.size == 1):
            assert matcher.accept_token(eos)
            assert matcher.is_terminated()
            return out.decode("utf-8")
        choices = allowed[allowed != eos]
        assert (lengths[choices] > 0).all()
        bytes_ = np.unique(first[choices])
        structural = np.intersect1d(bytes_, _STRUCTURAL)
        b = rng.choice((structural if structural.size and rng.random() < 0.6 else bytes_).tolist())
        group = choices[first[choices] == b]
        short = group[lengths[group] <= 2]
        pick = int(rng.choice((short if short.size else group).tolist()))
        assert matcher.accept_token(pick)
        out += vocab.token_bytes[pick]
    return None


def walks(grammar, vocab, n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    texts = [random_walk(grammar, vocab, rng) for _ in range(n)]
    done = [t for t in texts if t is not None]
    assert len(done) >= n // 2, "random walks should mostly terminate"
    return done


# -- regexes ----------------------------------------------------------------------------------

REGEXES = {
    "date": r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    "email": r"[a-z0-9._%+-]+@[a-z0-9-]+(\.[a-z0-9-]+)*\.[a-z]{2,6}",
    "ipv4": r"((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)",
    "enum": r"(red|green|blue|light blue)",
    "decimal": r"-?\d+(\.\d+)?",
}


@pytest.mark.parametrize("name", sorted(REGEXES))
def test_random_walks_full_match_the_regex(compiler, name):
    grammar = compiler.compile("regex", REGEXES[name])
    for text in walks(grammar, compiler.vocab, 12):
        assert re.fullmatch(REGEXES[name], text), (name, text)


def test_regex_continues_after_an_accepting_state(compiler):
    # "12" is complete, yet ".5" may still follow (outlines-core alone drops such tokens)
    m = compiler.compile("regex", REGEXES["decimal"]).matcher()
    assert m.accept_string("12") and m.is_accepting()
    dot = compiler.vocab.token_of_bytes[b"."]
    assert dot in m.allowed_token_ids()
    assert m.accept_string(".5") and m.accept_token(compiler.vocab.eos_token_ids[0])


def test_canonical_tokenizations_are_accepted(compiler, tokenizer):
    grammar = compiler.compile("regex", REGEXES["email"])
    for text in ["john.doe@example.com", "a+b@mail.co.uk"]:
        m = grammar.matcher()
        for t in tokenizer.encode(text, add_special_tokens=False):
            assert m.accept_token(t), text
        assert m.is_accepting()


def _oracle_allowed(index, state: int, skip: set[int]) -> set[int]:
    return {t for t in index.get_allowed_tokens(state) if t not in skip}


@pytest.mark.parametrize(
    "kind,spec",
    [
        ("regex", REGEXES["email"]),
        ("regex", REGEXES["decimal"]),
        ("regex", r"[^\n]{0,12}(\n|ab+c)"),
        ("regex", r"\w+ \p{Greek}{1,3}"),
        (
            "json_schema",
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 20},
                    "tags": {"type": "array", "items": {"enum": ["a", "b c", "é"]}},
                    "n": {"type": "number"},
                },
                "required": ["name"],
            },
        ),
    ],
)
def test_lazy_masks_equal_outlines_cores_precomputed_index(outlines, kind, spec):
    """The plain twin: outlines-core's Index over the whole vocabulary, built up front for every
    state, must allow exactly the tokens our lazily built masks allow, state by state."""
    from outlines_core import Guide, Index

    compiler = outlines
    grammar = compiler.compile(kind, spec)
    index = Index(grammar.regex, compiler.vocab.outlines_vocabulary())
    skip = {*compiler.vocab.eos_token_ids, compiler.vocab.sentinel_id}
    sentinel = compiler.vocab.sentinel_id
    rng = random.Random(0)
    for _ in range(6):
        matcher, guide = grammar.matcher(), Guide(index)
        for _ in range(60):
            ours = set(matcher.allowed_token_ids())
            theirs = _oracle_allowed(index, guide.get_state(), skip)
            assert ours - skip == theirs
            accepting = index.get_next_state(guide.get_state(), sentinel) is not None
            assert matcher.is_accepting() == accepting
            if not theirs or (accepting and rng.random() < 0.2):
                break
            token = rng.choice(sorted(theirs))
            assert matcher.accept_token(token)
            guide.advance(token, return_tokens=False)


NESTED_LISTS = 'root ::= "[" (value ("," value)*)? "]"\nvalue ::= "0" | [1-9] [0-9]* | root'


def _nested_list_depth(text: str) -> int:
    """Nesting depth of a list of numbers and lists (ValueError if it is not one)."""
    value = json.loads(text)

    def depth(v) -> int:
        if not isinstance(v, list):
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(text)
            return 0
        return 1 + max((depth(x) for x in v), default=0)

    if not isinstance(value, list):
        raise ValueError(text)
    return depth(value)


def test_recursive_ebnf_walks_stay_in_the_grammar(tokenizer):
    compiler = GrammarCompiler(
        tokenizer, compile_timeout=60, ebnf_recursion_depth=3, backend="outlines"
    )
    grammar = compiler.compile("ebnf", NESTED_LISTS)
    depths = [_nested_list_depth(t) for t in walks(grammar, compiler.vocab, 16, seed=3)]
    assert max(depths) <= 4 and max(depths) >= 2  # root plus at most 3 nested levels
    assert grammar.matcher().accept_string("[1,[2,[3,[4]]]]")
    assert not grammar.matcher().accept_string("[1,[2,[3,[4,[")


def test_recursive_ebnf_is_enforced_as_written_by_llguidance(tokenizer):
    compiler = GrammarCompiler(tokenizer, compile_timeout=60)  # no recursion depth to set
    grammar = compiler.compile("ebnf", NESTED_LISTS)
    depths = [_nested_list_depth(t) for t in walks(grammar, compiler.vocab, 16, seed=3)]
    assert max(depths) >= 2
    deep = "[1," * 12 + "[]" + "]" * 12
    m = grammar.matcher()
    assert m.accept_string(deep) and m.is_accepting()
    m = grammar.matcher()
    assert m.accept_string("[1,[2,[3,[4,[") and not m.is_accepting()
    assert not grammar.matcher().accept_string("[1,]")


# -- JSON schemas -----------------------------------------------------------------------------

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "arrays": {
        "type": "object",
        "properties": {
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 100},
                "minItems": 1,
                "maxItems": 4,
            },
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2},
        },
        "required": ["scores"],
    },
    "enum_const_nullable": {
        "type": "object",
        "properties": {
            "kind": {"const": "event"},
            "level": {"enum": ["low", "high", 3, None]},
            "note": {"type": ["string", "null"]},
            "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        },
        "required": ["kind", "level", "note"],
    },
    "anyof_ref": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
            },
        },
        "type": "object",
        "properties": {
            "shape": {
                "anyOf": [
                    {"$ref": "#/$defs/point"},
                    {"type": "array", "items": {"$ref": "#/$defs/point"}},
                    {"type": "null"},
                ]
            },
            "when": {"type": "string", "format": "date"},
        },
        "required": ["shape"],
    },
    "recursive": {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                },
                "required": ["id"],
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/node",
    },
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_random_walks_validate_against_the_schema(compiler, name):
    schema = SCHEMAS[name]
    grammar = compiler.compile("json_schema", json.dumps(schema))
    validator = schema_validator(schema)
    for text in walks(grammar, compiler.vocab, 10):
        value = json.loads(text)
        errors = list(validator.iter_errors(value))
        assert not errors, (text, errors[0].message)


def test_pydantic_model(compiler):
    pydantic = pytest.importorskip("pydantic")

    class Item(pydantic.BaseModel):
        sku: str = pydantic.Field(pattern=r"^[A-Z]{3}-\d{3}$")
        qty: int = pydantic.Field(ge=1, le=99)

    class Order(pydantic.BaseModel):
        id: int
        items: list[Item] = pydantic.Field(min_length=1, max_length=3)
        note: str | None = None

    schema = Order.model_json_schema()
    grammar = compiler.compile("json_schema", json.dumps(schema))
    for text in walks(grammar, compiler.vocab, 8):
        Order.model_validate_json(text)
        schema_validator(schema).validate(json.loads(text))


@pytest.mark.parametrize("backend", GRAMMAR_BACKENDS)
def test_flexible_whitespace_accepts_pretty_printed_json(tokenizer, backend):
    flexible = GrammarCompiler(tokenizer, whitespace="flexible", backend=backend)
    schema = SCHEMAS["nested"]
    value = {"name": "Bo", "address": {"city": "Oslo", "zip": "01234"}}
    grammar = flexible.compile("json_schema", json.dumps(schema))
    for text in [
        json.dumps(value, indent=2),
        json.dumps(value),
        json.dumps(value, separators=(",", ":")),
    ]:
        assert accepts(grammar, tokenizer.encode(text, add_special_tokens=False)), text
    # bounded (a model must not write whitespace until max_new_tokens): 20 in a row, not 21
    for n, ok in [(20, True), (21, False)]:
        text = "{" + " " * n + '"name":"Bo","address":{"city":"Oslo"}}'
        assert accepts(grammar, tokenizer.encode(text, add_special_tokens=False)) is ok, n
    for text in walks(grammar, flexible.vocab, 5):
        schema_validator(schema).validate(json.loads(text))


def test_jump_forward_gives_the_forced_keys(compiler):
    schema = SCHEMAS["nested"]
    m = compiler.compile("json_schema", json.dumps(schema)).matcher()
    assert m.jump_forward_string() == '{"name":"'
    assert m.accept_string('{"name":"')
    assert m.jump_forward_string() is None  # the name itself is free
    assert m.accept_string('Bo"')
    assert m.jump_forward_string() == ',"address":{"city":"'


def test_refused_schemas_name_the_keyword(compiler):
    cases = [
        ("uniqueItems", "#", {"type": "array", "items": {"type": "string"}, "uniqueItems": True}),
        ("if", "#", {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}),
        ("contains", "#", {"type": "array", "contains": {"const": 1}}),
        (
            "if",
            "#/properties/a",
            {"type": "object", "properties": {"a": {"if": {"type": "string"}, "then": {}}}},
        ),
    ]
    if compiler.backend == "outlines":  # (llguidance enforces a fractional multipleOf)
        cases.append(("multipleOf", "#", {"type": "number", "multipleOf": 0.01}))
    for keyword, where, schema in cases:
        with pytest.raises(
            GrammarError, match=f"unsupported keyword '{keyword}' at {where}(?![/\\w])"
        ):
            compiler.compile("json_schema", json.dumps(schema))


def test_mask_is_cached_and_fast(compiler):
    import time

    grammar = compiler.compile("json_schema", json.dumps(SCHEMAS["arrays"]))
    m = grammar.matcher()
    row = allocate_token_bitmask(1, compiler.vocab_size)[0]
    m.fill_next_token_bitmask(row)  # cold
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(row)
        times.append(time.perf_counter() - t0)
    assert sorted(times)[100] < 100e-6  # warm fills are copies of a cached row


# -- soundness sample from MaskBench ----------------------------------------------------------

SOUNDNESS_SAMPLE = [
    "BFCL_multiple_31.json",
    "BFCL_parallel_181.json",
    "BFCL_simple_219.json",
    "Github_easy---o17678.json",
    "Github_easy---o59284.json",
    "Github_easy---o69916.json",
    "Github_easy---o75860.json",
    "Github_easy---o82257.json",
    "Github_easy---o9963.json",
    "Github_hard---o41290.json",
    "Glaiveai2K---analyze_health_data_4ad104b4.json",
    "Glaiveai2K---calculate_area_256c8d1a.json",
    "Handwritten---oneofpr2.json",
    "JME_11.json",
    "JME_23.json",
    "Kubernetes---kb_745_Normalized.json",
    "Kubernetes---kb_981_Normalized.json",
    "WashingtonPost---wp_69_Normalized.json",
    "WashingtonPost---wp_77_Normalized.json",
    "WashingtonPost---wp_86_Normalized.json",
]


def accepts(grammar, token_ids: list[int]) -> bool:
    m = grammar.matcher()
    return all(m.accept_token(t) for t in token_ids) and m.is_accepting()


@pytest.mark.skipif(not (DATA / "schemas").exists(), reason="shared data not present")
@pytest.mark.parametrize("backend", GRAMMAR_BACKENDS)
def test_soundness_sample(tokenizer, backend):
    # unlisted properties allowed, as the JSON Schema semantics say (some valid instances
    # carry keys the schema does not list)
    compiler = GrammarCompiler(
        tokenizer,
        compile_timeout=60,
        allow_unlisted_properties=True,
        any_depth=1,
        backend=backend,
    )
    false_accepts, false_rejects, refused = [], [], []
    for name in SOUNDNESS_SAMPLE:
        data = json.loads((DATA / "schemas" / name).read_text())
        try:
            grammar = compiler.compile("json_schema", json.dumps(data["schema"]))
        except GrammarError:
            refused.append(name)
            continue
        for test in data["tests"]:
            text = dump_json_for_schema(data["schema"], test["data"])
            ok = accepts(grammar, tokenizer.encode(text, add_special_tokens=False))
            if ok and not test["valid"]:
                false_accepts.append((name, text))
            if not ok and test["valid"]:
                false_rejects.append((name, text))
    assert not false_accepts
    assert not false_rejects
    assert len(refused) <= 3, refused
