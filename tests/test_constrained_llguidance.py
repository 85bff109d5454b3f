"""The llguidance backend (the default) end to end: recursion enforced as written, refusals that
name keyword and place, a refused or slow grammar failing only its own items, number bounds, and
one build per spec however many ask at once. CPU-only; the real default model where a model is
needed."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import jsonschema
import pytest

import radixlm
from radixlm.constrained import GrammarCompiler, GrammarError
from radixlm.constrained.llguidance_backend import LLGuidanceBackend, keyword_locations
from radixlm.runtime.model_loader import default_tokenizer

TREE = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "value": {"type": "integer"},
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
            },
            "required": ["value", "children"],
        }
    },
    "$ref": "#/$defs/node",
}
NESTED_LISTS = 'root ::= "[" (value ("," value)*)? "]"\nvalue ::= [0-9] | root'
REFUSED = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}, "required": ["a"]}
COLOR = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}},
    "required": ["color"],
}
DIGIT = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["n"],
}
# measured here: about 2 s to build (the lexer states of a 10**6-character repetition)
SLOW_REGEX = "(ab){500000}"


@pytest.fixture(scope="module")
def tokenizer():
    try:
        return default_tokenizer()
    except ValueError as e:  # the embedded model package is missing
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, compile_timeout=60)


@pytest.fixture(scope="module")
def engine():
    with radixlm.Engine(max_total_tokens=4096) as eng:
        yield eng


def accepts(compiler: GrammarCompiler, spec, text: str, kind: str = "json_schema") -> bool:
    """Whether `text`, tokenized as the model would write it, is a complete output."""
    matcher = compiler.compile(kind, spec).matcher()
    ids = compiler._tokenizer.encode(text, add_special_tokens=False)
    return matcher.accept_tokens(ids) == len(ids) and matcher.is_accepting()


def chat(engine, text: str) -> str:
    return engine.apply_chat_template([{"role": "user", "content": text}])


def tree_depth(node: dict) -> int:
    return 1 + max((tree_depth(c) for c in node["children"]), default=0)


def nested_list_depth(text: str) -> int:
    """The nesting depth of `text` in NESTED_LISTS's language; ValueError if it is not in it."""
    at = 0

    def value() -> int:
        nonlocal at
        if text[at : at + 1].isdigit() and text[at].isascii():
            at += 1
            return 0
        if text[at : at + 1] != "[":
            raise ValueError(text)
        at += 1
        depth = 0
        if text[at : at + 1] != "]":
            depth = value()
            while text[at : at + 1] == ",":
                at += 1
                depth = max(depth, value())
        if text[at : at + 1] != "]":
            raise ValueError(text)
        at += 1
        return depth + 1

    if text[:1] != "[":
        raise ValueError(text)
    depth = value()
    if at != len(text):
        raise ValueError(text)
    return depth


# -- refusals name the keyword and where it is -------------------------------------------------


def test_keyword_locations_are_json_pointers_in_schema_order():
    schema = {
        "$defs": {"a/b": {"not": {"const": 1}}},
        "properties": {
            "x": {"anyOf": [{"type": "string"}, {"items": {"not": {}}}]},
            "y": {"enum": [{"not": 1}]},  # data, not a schema
        },
        "not": {"type": "null"},
    }
    assert keyword_locations(schema, "not") == [
        "#",
        "#/$defs/a~1b",
        "#/properties/x/anyOf/1/items",
    ]
    assert keyword_locations(schema, "uniqueItems") == []
    assert keyword_locations(True, "not") == []


def test_a_refusal_names_the_keyword_and_its_place(compiler):
    with pytest.raises(GrammarError) as e:
        compiler.compile("json_schema", REFUSED)
    message = str(e.value)
    assert "unsupported keyword 'not' at #/properties/a" in message, message
    assert "json_schema_lenient" in message  # and how to go on without it
    nested = {"$defs": {"n": {"type": "array", "uniqueItems": True}}, "$ref": "#/$defs/n"}
    with pytest.raises(GrammarError, match="'uniqueItems' at #/\\$defs/n"):
        compiler.compile("json_schema", nested)


def test_lenient_notes_name_each_skipped_keyword_where_it_is(compiler):
    schema = {
        "type": "object",
        "properties": {"a": {"not": {"type": "string"}}, "b": {"not": {"type": "null"}}},
    }
    grammar = compiler.compile("json_schema", schema, lenient=True)
    assert grammar.notes == (
        "unsupported keyword 'not' at #/properties/a",
        "unsupported keyword 'not' at #/properties/b",
    )
    assert grammar.validate_output('{"a":"x"}')["valid"] is False


def test_other_refusals_say_what_to_change(compiler):
    with pytest.raises(GrammarError, match="^invalid regex: (?s:.*)unclosed group"):
        compiler.compile("regex", "(ab")
    with pytest.raises(GrammarError, match="allows no text"):
        compiler.compile("regex", "[^\\s\\S]")  # matches nothing at all


# -- recursion as written ----------------------------------------------------------------------


def test_a_recursive_schema_is_enforced_at_any_depth(compiler):
    def chain(depth: int) -> dict:
        node: dict = {"value": depth, "children": []}
        for d in range(depth - 1, 0, -1):
            node = {"value": d, "children": [node]}
        return node

    deep = json.dumps(chain(12), separators=(",", ":"))
    assert accepts(compiler, TREE, deep)
    leaf = {"value": 1, "children": []}
    three = json.dumps({"value": 0, "children": [leaf] * 3}, separators=(",", ":"))
    assert not accepts(compiler, TREE, three)  # maxItems, at every level
    assert not accepts(compiler, TREE, '{"value":1,"children":[{"value":2}]}')  # required


def test_the_model_writes_a_tree_that_validates(engine):
    example = json.dumps(
        {"value": 7, "children": [{"value": 8, "children": []}]}, separators=(",", ":")
    )
    prompt = f"A tree as JSON: {example}\nAnother tree as JSON: "
    out = engine.generate(prompt, {"max_new_tokens": 60, "temperature": 0, "json_schema": TREE})
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    tree = json.loads(out["text"])
    jsonschema.validate(tree, TREE)
    assert tree_depth(tree) >= 2, out["text"]  # a node inside a node: the recursion was used


def test_the_model_writes_nested_lists_in_a_recursive_ebnf(engine):
    prompt = chat(engine, "Write a nested list of digits like [1,[2,[3]],4].")
    out = engine.generate(prompt, {"max_new_tokens": 40, "temperature": 0, "ebnf": NESTED_LISTS})
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    assert nested_list_depth(out["text"]) >= 2, out["text"]


# -- a refused or slow grammar fails only its own items ---------------------------------------

BATCH_PARAMS = [
    {"max_new_tokens": 16, "temperature": 0.7, "seed": 1, "n": 2, "json_schema": COLOR},
    {"max_new_tokens": 16, "n": 2, "json_schema": REFUSED},
    {"max_new_tokens": 16, "temperature": 0.7, "seed": 2, "n": 2, "json_schema": DIGIT},
]


def check_batch(outs: list[dict]) -> None:
    assert len(outs) == 6  # n outputs per prompt, in prompt order
    for out, schema in zip(outs[:2] + outs[4:], [COLOR, COLOR, DIGIT, DIGIT], strict=True):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]
        jsonschema.validate(json.loads(out["text"]), schema)
    for out in outs[2:4]:
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort", reason
        assert "unsupported keyword 'not' at #/properties/a" in reason["message"], reason
        assert out["output_ids"] == []


def test_a_refused_schema_in_a_list_fails_only_its_items(engine):
    prompts = [chat(engine, f"A {what} as JSON.") for what in ("colour", "thing", "digit")]
    check_batch(engine.generate(prompts, BATCH_PARAMS))


def test_a_refused_schema_in_a_list_fails_only_its_items_async(engine):
    prompts = [chat(engine, f"A {what} as JSON.") for what in ("colour", "thing", "digit")]
    check_batch(asyncio.run(engine.async_generate(prompts, BATCH_PARAMS)))


def test_a_single_refused_schema_raises(engine):
    with pytest.raises(ValueError, match="unsupported keyword 'not' at #/properties/a"):
        engine.generate("Hi", {"max_new_tokens": 4, "json_schema": REFUSED})
    assert engine.generate("Hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


def test_a_single_refused_schema_raises_from_async_generate_too(engine):
    params = {"max_new_tokens": 4, "json_schema": REFUSED}
    with pytest.raises(ValueError, match="unsupported keyword 'not' at #/properties/a"):
        asyncio.run(engine.async_generate("Hi", params))
    with pytest.raises(ValueError, match="unsupported keyword 'not' at #/properties/a"):
        asyncio.run(engine.async_generate("Hi", params, stream=True))


def test_single_requests_waiting_for_their_grammars_hold_no_thread(engine, monkeypatch):
    """Each async single request waits for its grammar on the event loop, not in a worker
    thread: with one thread for all the blocking work, 8 requests whose compiles are held back
    all reach the compiler before any compile is let go (a request holding the thread while its
    grammar compiled would keep the next from submitting its compile)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    compiler = engine.grammar_compiler()
    real = compiler.compile_async
    submitted, gate = [], threading.Event()

    def held(kind, spec, **kw):
        submitted.append(spec)
        inner = real(kind, spec, **kw)
        return _after(gate, inner)

    monkeypatch.setattr(compiler, "compile_async", held)
    schemas = [
        json.dumps({"type": "object", "properties": {f"k{i}": {"type": "boolean"}},
                    "required": [f"k{i}"]})
        for i in range(8)
    ]  # fmt: skip

    async def main():
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(1))
        calls = [
            engine.async_generate("Hi", {"max_new_tokens": 24, "json_schema": s, "temperature": 0})
            for s in schemas
        ]
        tasks = [asyncio.ensure_future(c) for c in calls]
        for _ in range(200):
            if len(submitted) == len(schemas):
                break
            await asyncio.sleep(0.01)
        seen = len(submitted)
        gate.set()
        return seen, await asyncio.gather(*tasks)

    seen, outs = asyncio.run(main())
    assert seen == len(schemas)
    for i, out in enumerate(outs):
        assert list(json.loads(out["text"])) == [f"k{i}"]


def _after(gate, inner):
    """A future with `inner`'s outcome, given only once `gate` is set."""
    import threading
    from concurrent.futures import Future

    outer = Future()

    def relay():
        gate.wait(10)
        exc = inner.exception()
        if exc is not None:
            outer.set_exception(exc)
        else:
            outer.set_result(inner.result())

    threading.Thread(target=relay, daemon=True).start()
    return outer


def test_a_slow_compile_times_out_its_own_request_only():
    """llguidance builds a long counted repetition's lexer states slowly (SLOW_REGEX: ~0.4 s with
    llguidance 1.9 on the 2-core machine, ~2 s with earlier versions; the others a few ms; see
    the compile's first mask in llguidance_backend.build): that request fails at a
    grammar_compile_timeout of 0.1 s, the others in its list finish. (At 0.5 s the slow one
    sometimes finished in time.)"""
    with radixlm.Engine(max_total_tokens=4096, grammar_compile_timeout=0.1) as eng:
        params = [
            {"max_new_tokens": 16, "temperature": 0, "json_schema": COLOR},
            {"max_new_tokens": 16, "regex": SLOW_REGEX},
            {"max_new_tokens": 8, "temperature": 0, "regex": "(yes|no)"},
        ]
        start = time.perf_counter()
        outs = eng.generate([chat(eng, "Pick one.")] * 3, params)
        assert time.perf_counter() - start < 30
    reason = outs[1]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "took longer than 0.1 s" in reason["message"], reason
    jsonschema.validate(json.loads(outs[0]["text"]), COLOR)
    assert outs[2]["text"] in ("yes", "no")
    assert all(o["meta_info"]["finish_reason"]["type"] == "stop" for o in (outs[0], outs[2]))


# -- numbers -----------------------------------------------------------------------------------


def test_an_unbounded_integer_is_held_to_the_default_bound(compiler):
    population = {
        "type": "object",
        "properties": {"population": {"type": "integer"}},
        "required": ["population"],
    }
    for digits, ok in [
        ("9" * 18, True),
        ("1" + "0" * 18, False),  # 19 digits: past 18, the default
        ("1" + "0" * 17 + "1", False),
        ("1" * 20, False),
        ("-" + "9" * 18, True),
    ]:
        assert accepts(compiler, population, f'{{"population":{digits}}}') is ok, digits
    row = compiler.compile("json_schema", population).matcher()
    assert row.accept_string('{"population":' + "1" * 18)
    assert not row.accept_string("11")  # no 19th digit
    decode = row.grammar.backend.tokenizer.decode_bytes
    allowed = [decode([t]) for t in row.allowed_token_ids()]
    assert allowed and not any(b[:1].isdigit() for b in allowed), allowed
    # in a string, digits are free
    text = compiler.compile("json_schema", {"type": "string"}).matcher()
    assert text.accept_string('"' + "1" * 40 + '"') and text.is_accepting()


def test_a_schemas_own_bounds_are_never_narrowed(compiler):
    wide = {"type": "integer", "maximum": 5 * 10**18}  # above the default bound
    assert accepts(compiler, wide, str(5 * 10**18))
    assert not accepts(compiler, wide, str(5 * 10**18 + 1))
    tight = {"type": "integer", "minimum": -3, "exclusiveMaximum": 12}
    assert accepts(compiler, tight, "-3") and accepts(compiler, tight, "11")
    assert not accepts(compiler, tight, "12") and not accepts(compiler, tight, "-4")
    # past what llguidance reads (64 bits): brought inside instead of refused
    huge = {"type": "integer", "minimum": -(10**19), "maximum": 10**20}
    assert accepts(compiler, huge, str(9 * 10**18)) and accepts(compiler, huge, "-7")


def test_integer_bounds_past_2_53_hold_though_llguidance_reads_doubles(compiler):
    """llguidance reads a bound as a double: `minimum: 2**53 + 1` became 2**53 (allowed), an
    exclusive bound's own value was allowed. Each such bound now goes in as an inclusive bound
    on the nearest double inside it: what the grammar allows is valid, at the cost of the
    integers between (never wider than the schema)."""
    from radixlm.constrained.schema_rewrite import fit_bounds

    n = 2**53
    assert fit_bounds({"type": "integer", "minimum": n + 1}, 9 * 10**18, 10**18) == {
        "type": "integer",
        "minimum": n + 2,
    }
    both = {"type": "integer", "minimum": n + 8, "exclusiveMinimum": n + 1, "maximum": 10}
    assert fit_bounds(both, 9 * 10**18, 10**18)["minimum"] == n + 8  # (the tighter of the two)
    small = {"type": "integer", "exclusiveMinimum": 3, "maximum": n}  # (exact: left as written)
    assert fit_bounds(dict(small), 9 * 10**18, 10**18) == small
    cases = [
        ({"minimum": n + 1}, [n + 2, n + 4], [n, n + 1]),
        ({"exclusiveMinimum": n + 1}, [n + 2, n + 3], [n, n + 1]),
        ({"maximum": n + 3}, [n + 2, n], [n + 4]),
        ({"exclusiveMaximum": n + 3}, [n + 2], [n + 3, n + 4]),
        ({"minimum": -(n + 1)}, [-n, 0], [-(n + 2)]),
        ({"exclusiveMaximum": -(n + 1)}, [-(n + 2), -(n + 4)], [-(n + 1), -n]),
    ]
    for bounds, allowed, refused in cases:
        schema = {"type": "integer", **bounds}
        for value in allowed:
            assert accepts(compiler, schema, str(value)), (bounds, value)
        for value in refused:
            assert not accepts(compiler, schema, str(value)), (bounds, value)


def expect_same_values(compiler, schema, bounded, shared, values, validator) -> None:
    """`values[0]` valid and the rest not under `bounded` (the schema with its number bounds),
    and each read the same under `shared` (its rewrite) and by the grammar compiled from
    `schema`."""
    references = [validator(bounded).is_valid(v) for v in values]
    assert references == [True] + [False] * (len(values) - 1)
    for value, reference in zip(values, references, strict=True):
        assert validator(shared).is_valid(value) == reference, value
        text = json.dumps(value, separators=(",", ":"))
        assert accepts(compiler, schema, text) == reference, value


def test_alike_bounded_numbers_are_shared_and_each_keeps_its_bounds(compiler):
    """share_leaves (one `$ref` for alike bounded numbers, which llguidance builds once) leaves
    the schema what it was: jsonschema reads the same, and each place keeps its bounds."""
    from radixlm.constrained.schema_rewrite import NumberLimits, bound_numbers, share_leaves

    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "description": "twice alike"},
            "b": {"type": "integer"},
            "c": {"type": "integer", "minimum": 0},  # its own bound: not like the others
            "d": {"type": "number"},
            "e": {"type": "number"},
            "tags": {"type": "array", "items": {"type": "integer"}},
        },
        "required": ["a", "b", "c", "d"],
    }
    bounded = bound_numbers(schema, NumberLimits())
    shared = share_leaves(bounded)
    assert (
        shared["properties"]["a"]
        == shared["properties"]["b"]
        == {"$ref": "#/$defs/radixlm-shared-0"}
    )
    assert shared["properties"]["c"] == bounded["properties"]["c"]
    assert (
        shared["properties"]["d"]
        == shared["properties"]["e"]
        == {"$ref": "#/$defs/radixlm-shared-1"}
    )
    big, fraction = 10**18 - 1, 0.1234567890  # (18 digits: the default)
    values = [
        {"a": big, "b": -big, "c": 0, "d": 10**15, "e": fraction, "tags": [big]},
        {"a": big + 1, "b": 1, "c": 0, "d": 1},
        {"a": 1, "b": -big - 1, "c": 0, "d": 1},
        {"a": 1, "b": 1, "c": -1, "d": 1},
        {"a": 1, "b": 1, "c": 1, "d": fraction, "e": -big - 1},
        {"a": 1, "b": 1, "c": 1, "d": 1, "tags": [1, big + 1]},
    ]
    expect_same_values(compiler, schema, bounded, shared, values, jsonschema.Draft202012Validator)


def test_alike_enums_are_shared_and_each_place_keeps_its_values(compiler):
    """Alike enums of a few values or more (with their type) point to one copy; an enum with
    other keywords, a short one, or one unlike the others stays where it is. jsonschema reads
    the rewrite as the schema, and the grammar accepts what the schema does."""
    from radixlm.constrained.schema_rewrite import NumberLimits, bound_numbers, share_leaves

    codes = ["AD", "AE", "AF", "AG", "AI"]
    schema = {
        "type": "object",
        "properties": {
            "home": {"type": "string", "enum": codes, "description": "alike"},
            "away": {"type": "string", "enum": codes},
            "any": {"enum": [1, "one", None, True]},
            "again": {"enum": [1, "one", None, True]},
            "short": {"enum": ["x", "y"]},
            "short2": {"enum": ["x", "y"]},
            "long": {"type": "string", "enum": codes, "maxLength": 2},
            "other": {"type": "string", "enum": codes[:4]},
        },
        "required": ["home", "away"],
        "additionalProperties": False,
    }
    bounded = bound_numbers(schema, NumberLimits())
    shared = share_leaves(bounded)
    props = shared["properties"]
    assert props["home"] == props["away"] == {"$ref": "#/$defs/radixlm-shared-0"}
    assert props["any"] == props["again"] == {"$ref": "#/$defs/radixlm-shared-1"}
    for kept in ("short", "short2", "long", "other"):
        assert props[kept] == bounded["properties"][kept], kept
    values = [
        {"home": "AD", "away": "AI", "any": None, "again": True, "short": "y", "other": "AG"},
        {"home": "AD", "away": "ZZ"},
        {"home": "ad", "away": "AD"},
        {"home": "AD", "away": "AD", "again": 2},
        {"home": "AD", "away": "AD", "other": "AI"},
        {"home": "AD"},
    ]
    expect_same_values(compiler, schema, bounded, shared, values, jsonschema.Draft202012Validator)


def test_numbers_in_type_lists_and_under_ids_are_shared_too(compiler):
    """A type list with one numeric type shares its number as an anyOf branch; identifiers below
    the root that name nothing are left out so the shared `$ref`s read from the root; unknown
    keys are annotations. jsonschema reads each rewrite as the schema it came from, and the
    compiled grammar accepts what it accepts."""
    from radixlm.constrained.schema_rewrite import NumberLimits, bound_numbers, share_leaves

    schema = {
        "type": "object",
        "properties": {
            "a": {"id": "http://x.test/a", "type": ["integer", "null"], "_format": "int32"},
            "b": {"type": ["null", "integer"], "description": "b"},
            "c": {"type": ["number", "string"], "maxLength": 3},
            "d": {"type": "number", "x-note": 1},
            "e": {"type": ["number", "string"], "format": "date"},
        },
    }
    bounded = bound_numbers(schema, NumberLimits())
    shared = share_leaves(bounded)
    props = shared["properties"]
    assert props["a"]["anyOf"][0] == props["b"]["anyOf"][0] == {"$ref": "#/$defs/radixlm-shared-0"}
    assert props["a"]["anyOf"][1] == {"type": "null"} and "id" not in props["a"]
    assert props["c"]["anyOf"][1] == {"type": "string", "maxLength": 3}
    assert props["d"] == bounded["properties"]["d"]  # an `x-` key is not an annotation
    assert props["e"]["anyOf"][1] == {"type": "string", "format": "date"}
    big = 10**18 - 1
    values = [
        {"a": big, "b": None, "c": "abc", "d": 1.5, "e": 2},
        {"a": big + 1},
        {"b": -big - 1},
        {"c": "abcd"},
        {"c": big + 1},
        {"a": "1"},
        {"b": 1.5},
        {"e": -big - 1},
    ]
    expect_same_values(compiler, schema, bounded, shared, values, jsonschema.Draft7Validator)


def test_identifiers_that_scope_a_ref_keep_numbers_unshared():
    """A `$ref` under a subschema with an identifier reads against that identifier: there the
    schema is left as it is (sharing would point its numbers elsewhere)."""
    from radixlm.constrained.schema_rewrite import NumberLimits, bound_numbers, share_leaves

    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "b": {"$id": "http://x.test/b", "type": "object",
                  "properties": {"n": {"type": "integer"}, "m": {"$ref": "#/properties/n"}}},
        },
    }  # fmt: skip
    bounded = bound_numbers(schema, NumberLimits())
    assert share_leaves(bounded) == bounded
    remote = {"type": "array", "items": [{"type": "integer"}, {"type": "integer"},
              {"$ref": "other.json#/x"}]}  # fmt: skip
    bounded = bound_numbers(remote, NumberLimits())
    assert share_leaves(bounded)["items"][0] == {"$ref": "#/$defs/radixlm-shared-0"}
    with_id = {**remote, "items": [{"id": "i0", "type": "integer"}, *remote["items"][1:]]}
    bounded = bound_numbers(with_id, NumberLimits())
    assert share_leaves(bounded) == bounded  # (a reference to another document: ids may matter)
    # the root's own $ref may name an identifier below it (draft 7's "#name")
    named = {
        "$ref": "#item",
        "definitions": {"item": {"$id": "#item", "type": "object",
                                 "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}},
    }  # fmt: skip
    bounded = bound_numbers(named, NumberLimits())
    assert share_leaves(bounded) == bounded
    # nothing to share: the schema as it came, its identifiers too
    lone = bound_numbers({"properties": {"a": {"$id": "x", "type": "integer"}}}, NumberLimits())
    assert share_leaves(lone) is lone
    # an unknown key holding a schema (a $ref may point into it) is no annotation to drop
    kept = {
        "properties": {
            "a": {"type": "integer", "minimum": 0, "myDefs": {"s": {"type": "string"}}},
            "b": {"type": "integer", "minimum": 0},
            "c": {"$ref": "#/properties/a/myDefs/s"},
        }
    }
    shared = share_leaves(kept)
    assert shared["properties"]["a"] == kept["properties"]["a"]


def test_alike_strings_with_string_keywords_are_shared(compiler):
    """Strings with formats, patterns and lengths are leaves llguidance builds a lexeme for
    each (a `uri` ~1 ms): alike ones point to one copy too, the string branch of a type list
    as well; a oneOf's branch keeps its keywords (llguidance reads its branches itself).
    jsonschema reads the rewrite as the schema, and the grammar accepts what it accepts."""
    from radixlm.constrained.schema_rewrite import NumberLimits, bound_numbers, share_leaves

    stamp = {"type": "string", "format": "date"}
    code = {"type": "string", "pattern": "^[A-Z]{3}$", "title": "a code"}
    schema = {
        "type": "object",
        "properties": {
            "created": stamp,
            "updated": {**stamp, "description": "alike, annotations aside"},
            "deleted": {"type": ["string", "null"], "format": "date"},
            "from": code,
            "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "note": {"type": "string", "maxLength": 5},
            "either": {"oneOf": [{"type": "string", "pattern": "^[A-Z]{3}$"}, {"type": "null"}]},
        },
        "required": ["created", "from"],
    }
    bounded = bound_numbers(schema, NumberLimits())
    shared = share_leaves(bounded)
    props = shared["properties"]
    assert props["created"] == props["updated"] == props["deleted"]["anyOf"][0]
    assert props["deleted"]["anyOf"][1] == {"type": "null"}
    assert props["from"] == props["to"] and props["from"] != props["created"]
    assert props["note"] == schema["properties"]["note"]  # alone: nothing to share
    assert props["either"] == schema["properties"]["either"]
    assert set(shared["$defs"]) == {"radixlm-shared-0", "radixlm-shared-1"}
    values = [
        {"created": "2024-01-02", "deleted": None, "from": "ABC", "to": "XYZ",
         "note": "hello", "either": "DEF"},
        {"created": "2024-13-02", "from": "ABC"},
        {"created": "2024-01-02", "updated": "yesterday", "from": "ABC"},
        {"created": "2024-01-02", "deleted": 5, "from": "ABC"},
        {"created": "2024-01-02", "from": "ABCD"},
        {"created": "2024-01-02", "from": "ABC", "to": "abc"},
        {"created": "2024-01-02", "from": "ABC", "either": "abc"},
        {"created": "2024-01-02", "from": "ABC", "note": "too long"},
    ]  # fmt: skip
    checker = jsonschema.Draft202012Validator
    expect_same_values(
        compiler, schema, bounded, shared, values,
        lambda s: checker(s, format_checker=checker.FORMAT_CHECKER),
    )  # fmt: skip


MASKBENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "schemas"


def test_one_pass_preparation_is_the_passes_it_replaces():
    """prepare_schema (the closing, the bounds and the sharing in one copying pass and one in
    place) makes what the five passes make, on every real-world schema of the shared sample
    (with objects closed and left open), and declines the ones with a oneOf or `dependencies`
    (their passes apart, one_of_exclusivity's among them); the schema it was given is left as it
    was."""
    from radixlm.constrained.schema_rewrite import (
        NumberLimits,
        bound_numbers,
        close_objects,
        prepare_schema,
        share_leaves,
    )  # fmt: skip

    paths = sorted(MASKBENCH.glob("*.json"))
    if not paths:
        pytest.skip(f"no schemas at {MASKBENCH}")
    in_defs = {
        "$defs": {"a": {"type": "object", "properties": {"n": {"type": "integer"}}},
                  "b": {"type": "array", "items": {"type": "integer"}}},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/a"}, "b": {"$ref": "#/$defs/b"}},
    }  # fmt: skip
    limits, fit, checked, declined = NumberLimits(), (2**63 - 1, 2**53), 0, 0
    for path in [*paths, None]:
        schema = json.loads(path.read_text())["schema"] if path else in_defs
        if not isinstance(schema, dict):
            continue
        text = json.dumps(schema, sort_keys=True)
        for close in (True, False):
            got = prepare_schema(schema, close, limits, fit)
            if got is None:  # (the passes apart: a oneOf, or dependencies)
                assert {"oneOf", "dependencies"} & set(json.dumps(schema).split('"')), path
                declined += 1
                continue
            want = share_leaves(
                bound_numbers(close_objects(schema) if close else schema, limits, fit=fit)
            )
            assert got == want, path
            checked += 1
        assert json.dumps(schema, sort_keys=True) == text, path
    assert checked > 50 and declined > 0
    # a oneOf under `dependencies`, which the one-pass walk does not enter: declined too
    hidden = {"dependencies": {"a": {"oneOf": [{"required": ["b"]}, {"required": ["c"]}]}}}
    assert prepare_schema(hidden, True, limits, fit) is None


def test_numbers_keep_their_fraction_digits_bounded(compiler):
    number = {"type": "number"}
    assert accepts(compiler, number, "0.1234567890")
    assert not accepts(compiler, number, "0.12345678901")
    assert accepts(compiler, number, "1e5") and accepts(compiler, number, "-2.5E-12")
    assert not accepts(compiler, number, "1e123")  # two exponent digits at most


def test_a_constant_integer_past_2_53_is_refused_not_rounded(compiler):
    """llguidance reads a `const` or `enum` integer as a double: 2**53 + 1 would be forced as
    2**53. Refused with where it sits; one within 2**53, or such digits in a string, compile."""
    wide = 2**53 + 1
    for schema, where in [
        ({"const": wide}, "#/const"),
        ({"properties": {"id": {"enum": ["a", {"n": [-wide]}]}}}, "#/properties/id/enum"),
    ]:
        with pytest.raises(GrammarError) as e:
            compiler.compile("json_schema", schema)
        assert where in str(e.value) and "2**53" in str(e.value)
    for schema, text in [
        ({"const": 2**53}, str(2**53)),
        ({"const": str(wide)}, json.dumps(str(wide))),
        ({"properties": {"const": {"type": "integer", "maximum": wide}}}, '{"const":5}'),
    ]:
        assert accepts(compiler, schema, text), schema
    # past a double's range: llguidance's own refusal, not a Python error
    with pytest.raises(GrammarError) as e:
        compiler.compile("json_schema", {"type": "string", "maximum": 10**400})
    assert "OverflowError" not in str(e.value), e.value


# -- regexes read as the DFA backend reads them ------------------------------------------------


def test_regex_classes_are_ascii_and_slashes_are_plain(compiler):
    date = r"\d{4}-\d{2}"
    assert accepts(compiler, date, "2024-05", kind="regex")
    assert not accepts(compiler, date, "٢٠٢٤-05", kind="regex")  # Arabic-Indic digits
    url = r"https?://[a-z]+\.com/\w+"
    assert accepts(compiler, url, "https://abc.com/x_1", kind="regex")


# -- one build per spec ------------------------------------------------------------------------


def test_eight_threads_compiling_one_spec_build_it_once(compiler, monkeypatch):
    builds = []
    real_build = LLGuidanceBackend.build

    def counted(self, kind, spec, lenient):
        builds.append(spec)
        time.sleep(0.2)  # long enough for every thread to ask while it runs
        return real_build(self, kind, spec, lenient)

    monkeypatch.setattr(LLGuidanceBackend, "build", counted)
    spec = {"type": "object", "properties": {"threads": {"const": 8}}, "required": ["threads"]}
    barrier = threading.Barrier(8)
    grammars: list = []

    def ask() -> None:
        barrier.wait()
        grammars.append(compiler.compile("json_schema", spec))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(grammars) == 8 and len(builds) == 1
    assert all(g is grammars[0] for g in grammars)
    assert compiler.compile("json_schema", spec) is grammars[0]  # a cache hit
    assert compiler.compile_async("json_schema", spec).result(timeout=5) is grammars[0]
    assert len(builds) == 1


def test_a_tokenizer_llguidance_cannot_read_is_a_clear_error():
    """A token past llguidance's 1024 bytes panics in its Rust code (a BaseException): it is a
    GrammarError that names the other backend."""
    from radixlm.constrained import TokenVocabulary

    vocab = TokenVocabulary([b"a", b"b", b"x" * 1100, None], [3])
    with pytest.raises(GrammarError, match="grammar_backend='outlines'"):
        GrammarCompiler(vocab)


def test_an_object_requiring_a_key_it_does_not_list_stays_open():
    """Closing objects must not make a schema unsatisfiable: one that requires a key it does not
    list in `properties` is left open."""
    from radixlm.constrained.schema_rewrite import close_objects

    schema = {"type": "object", "properties": {"guid": {"type": "string"}}, "required": ["gid"]}
    assert "additionalProperties" not in close_objects(schema)
    listed = {"type": "object", "properties": {"gid": {"type": "string"}}, "required": ["gid"]}
    assert close_objects(listed)["additionalProperties"] is False
