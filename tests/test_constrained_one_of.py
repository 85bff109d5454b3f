"""oneOf with the llguidance backend: a oneOf whose branches provably exclude each other is
compiled as the anyOf it equals, and enforces exactly one branch; any other is refused with the
keyword and its place (or, lenient, noted there). The proof is one function for both backends
(json_schema.one_of_exclusivity; the DFA backend's _excludes), checked here against jsonschema:
wherever it says "exclusive", the schema with the oneOf written as anyOf accepts exactly the
values the schema accepts."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from radixlm.constrained import GrammarCompiler, GrammarError, dump_json_for_schema
from radixlm.constrained.json_schema import json_schema_to_regex, one_of_exclusivity
from radixlm.constrained.schema_rewrite import (
    close_objects,
    one_of_as_any_of,
    reachable_subschemas,
)
from radixlm.runtime.model_loader import default_tokenizer

OVERLAP = "branches 0 and 1 may both match; cannot enforce exactly one"


def tagged(kind: str, **properties: dict) -> dict:
    return {
        "type": "object",
        "properties": {"kind": {"const": kind}, **properties},
        "required": ["kind"],
    }


# Schemas whose oneOf is exclusive, each with values around its branches' edges
EXCLUSIVE = {
    "distinct types": (
        {"oneOf": [{"type": "string"}, {"type": "null"}, {"type": "array"}]},
        ["x", None, [], [1], 0, {}, True],
    ),
    "distinct types behind $refs": (
        {
            "$defs": {"when": {"type": "string", "maxLength": 3}, "none": {"type": "null"}},
            "oneOf": [{"$ref": "#/$defs/when"}, {"$ref": "#/$defs/none"}],
        },
        ["abc", "abcd", None, 1],
    ),
    "a const discriminator": (
        {"oneOf": [tagged("a", x={"type": "integer"}), tagged("b", y={"type": "string"})]},
        [
            {"kind": "a", "x": 1},
            {"kind": "b", "y": "s"},
            {"kind": "a", "y": "s"},
            {"kind": "b", "x": 1},
            {"kind": "a", "x": "s"},
            {"kind": "c"},
            {"x": 1},
            {},
            "a",
        ],
    ),
    "an enum discriminator, the type and required beside the oneOf": (
        {
            "type": "object",
            "required": ["shape"],
            "oneOf": [
                {"properties": {"shape": {"enum": ["circle"]}, "r": {"type": "number"}}},
                {"properties": {"shape": {"enum": ["square", "box"]}, "side": {"type": "number"}}},
            ],
        },
        [
            {"shape": "circle", "r": 1},
            {"shape": "box", "side": 2},
            {"shape": "circle", "side": "x"},
            {"shape": "square", "r": "x"},
            {"shape": "oval"},
            {"r": 1},
        ],
    ),
    "closed objects that require different keys": (
        {
            "oneOf": [
                {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}},
                    "required": ["a"],
                    "additionalProperties": False,
                },
                {
                    "type": "object",
                    "properties": {"b": {"type": "integer"}},
                    "required": ["b"],
                    "additionalProperties": False,
                },
            ]
        },
        [{"a": 1}, {"b": 2}, {"a": 1, "b": 2}, {}, {"c": 3}],
    ),
    "disjoint enums": (
        {"oneOf": [{"enum": [1, 2]}, {"enum": [3, "x"]}, {"const": None}]},
        [1, 2, 3, "x", None, 4, "y"],
    ),
    "a const against a schema it fails": (
        {"oneOf": [{"const": ""}, {"type": "string", "minLength": 2}]},
        ["", "ab", "a", 1],
    ),
    "one branch": ({"type": "object", "oneOf": [{"required": ["a"]}]}, [{"a": 1}, {}, 1]),
}

# Schemas whose oneOf must stay as written: a value can match two branches
OVERLAPPING = {
    "overlapping enums": {"oneOf": [{"enum": [1, 2]}, {"enum": [2, 3]}]},
    "integer and number": {"oneOf": [{"type": "integer"}, {"type": "number"}]},
    "no discriminator": {
        "type": "object",
        "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
        "oneOf": [{"required": ["a"]}, {"required": ["b"]}],
    },
    "a discriminator that is not required": {
        "oneOf": [
            {"type": "object", "properties": {"kind": {"const": "a"}}},
            {"type": "object", "properties": {"kind": {"const": "b"}}},
        ]
    },
    # {"a": 1, "b": 2} matches both; the DFA backend, which closes these objects (it generates
    # only the keys they list), proves its own oneOf exclusive
    "open objects that require different keys": {
        "oneOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]},
        ]
    },
    # a branch without `type` accepts every value of other types: "x" matches both
    "a branch whose keywords only speak of objects": {
        "oneOf": [{"properties": {"a": {"type": "string"}}, "required": ["a"]}, {"type": "string"}]
    },
    # drafts 3 to 7 read a $ref alone: the first branch accepts any value, 5 included
    "a $ref with a sibling, draft 7": {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "definitions": {"any": {}},
        "oneOf": [{"$ref": "#/definitions/any", "type": "string"}, {"type": "integer"}],
    },
    # beside a `not`, a value's check against a branch proves nothing (a wider part of a `not`
    # makes a narrower whole): no proof from checking "" against minLength
    "beside a not": {
        "not": {"const": 7},
        "oneOf": [{"const": ""}, {"type": "string", "minLength": 2}],
    },
}


def any_of_version(schema: dict) -> dict:
    exclusive = [w for w, why in one_of_exclusivity(schema).items() if why is None]
    return one_of_as_any_of(schema, exclusive)


def valid(schema: dict, value) -> bool:
    return jsonschema.validators.validator_for(schema)(schema).is_valid(value)


# -- the proof, against jsonschema ----------------------------------------------------------------


@pytest.mark.parametrize("name", EXCLUSIVE)
def test_an_exclusive_one_of_is_the_any_of_of_its_branches(name):
    schema, values = EXCLUSIVE[name]
    assert set(one_of_exclusivity(schema).values()) == {None}
    rewritten = any_of_version(schema)
    assert "oneOf" not in json.dumps(rewritten) and "anyOf" in json.dumps(rewritten)
    for value in values:
        assert valid(rewritten, value) == valid(schema, value), value
    assert any(valid(schema, v) for v in values) and not all(valid(schema, v) for v in values)


@pytest.mark.parametrize("name", OVERLAPPING)
def test_an_overlapping_one_of_is_left_as_written(name):
    schema = OVERLAPPING[name]
    assert one_of_exclusivity(schema) == {"#": OVERLAP}
    assert any_of_version(schema) == schema


KEYS = ["a", "b", "kind"]


def random_one_of(rng: random.Random) -> dict:
    """A small random schema with a oneOf: branches of types, enums, consts, bounds and objects
    (typed or not, properties, required keys, closed or open), maybe beside `type` and
    `required`, behind a $ref, or one property down."""
    values = [None, True, False, 0, 1, 2, 2.5, -1, "", "a", "b", "ab"]

    def leaf() -> dict:
        return rng.choice(
            [
                {"type": rng.choice(["string", "integer", "number", "boolean", "null", "object"])},
                {"enum": rng.sample(values, rng.randint(1, 3))},
                {"const": rng.choice(values)},
                {"type": "string", "minLength": rng.randint(0, 3)},
                {"type": rng.choice(["integer", "number"]), "minimum": rng.randint(-1, 2)},
                {},
            ]
        )

    def branch() -> dict:
        if rng.random() < 0.4:
            return leaf()
        node: dict = {"type": "object"} if rng.random() < 0.7 else {}
        node["properties"] = {k: leaf() for k in rng.sample(KEYS, rng.randint(0, 3))}
        if required := rng.sample(KEYS, rng.randint(0, 2)):
            node["required"] = required
        if rng.random() < 0.3:
            node["additionalProperties"] = False
        return node

    schema: dict = {"oneOf": [branch() for _ in range(rng.randint(2, 3))]}
    if rng.random() < 0.3:
        schema["type"] = "object"
    if rng.random() < 0.3:
        schema["required"] = rng.sample(KEYS, 1)
    if rng.random() < 0.2:
        schema["$defs"] = {"d": schema["oneOf"][0]}
        schema["oneOf"][0] = {"$ref": "#/$defs/d"}
    if rng.random() < 0.3:
        schema = {"type": "object", "properties": {"p": schema}, "required": ["p"]}
    return schema


def test_random_one_ofs_proven_exclusive_accept_only_valid_values():
    """Against jsonschema: where the proof holds, the anyOf version accepts what the schema does
    (and, proven on closed objects, the closed anyOf version nothing the schema refuses)."""
    rng = random.Random(7)
    pool = [None, True, 0, 1, 2, 2.5, -1, "", "a", "b", "ab", "abc"]
    proven = 0
    for _ in range(400):
        schema = random_one_of(rng)
        values = [rng.choice(pool) for _ in range(10)] + [
            {k: rng.choice(pool) for k in rng.sample([*KEYS, "x"], rng.randint(0, 3))}
            for _ in range(20)
        ]
        values += [{"p": v} for v in values]
        closed = close_objects(schema)
        for narrowed in (None, closed):
            exclusivity = one_of_exclusivity(schema, narrowed)
            if any(why is not None for why in exclusivity.values()):
                continue
            proven += 1
            rewritten = one_of_as_any_of(closed if narrowed else schema, list(exclusivity))
            for value in values:
                if narrowed is None:
                    assert valid(rewritten, value) == valid(schema, value), (schema, value)
                else:
                    assert valid(schema, value) or not valid(rewritten, value), (schema, value)
    assert proven > 100  # (the test proves something)


def test_the_dfa_backend_reasons_about_what_it_generates():
    """The same proof, reading what the regex generates: objects closed to the keys they list,
    so there this oneOf is exclusive."""
    schema = OVERLAPPING["open objects that require different keys"]
    regex = re.compile(json_schema_to_regex(schema))
    assert regex.fullmatch('{"a":1}') and regex.fullmatch('{"b":2}')
    assert not regex.fullmatch('{"a":1,"b":2}')
    # enum values it writes only where they pass the whole schema: 2 (in both) never
    enums = re.compile(json_schema_to_regex(OVERLAPPING["overlapping enums"]))
    assert [v for v in ("1", "2", "3") if enums.fullmatch(v)] == ["1", "3"]
    with pytest.raises(GrammarError, match="unsupported keyword 'oneOf' at #/oneOf"):
        json_schema_to_regex(OVERLAPPING["integer and number"])


def test_each_one_of_is_judged_where_it_is():
    schema = {
        "type": "object",
        "properties": {
            "id": {"oneOf": [{"type": "integer"}, {"type": "string"}]},
            "n": {"oneOf": [{"type": "integer"}, {"type": "number"}]},
            "tag": {"$ref": "#/$defs/tag"},
        },
        "$defs": {"tag": {"oneOf": [{"const": "x"}, {"const": "y"}], "anyOf": [{}]}},
    }
    assert one_of_exclusivity(schema) == {
        "#/properties/id": None,
        "#/properties/n": OVERLAP,
        "#/$defs/tag": None,
    }
    rewritten = any_of_version(schema)
    assert rewritten["properties"]["id"] == {"anyOf": [{"type": "integer"}, {"type": "string"}]}
    assert rewritten["properties"]["n"] == schema["properties"]["n"]
    # beside an anyOf of its own: one more allOf part
    assert rewritten["$defs"]["tag"] == {
        "anyOf": [{}],
        "allOf": [{"anyOf": [{"const": "x"}, {"const": "y"}]}],
    }
    assert "oneOf" in json.dumps(schema["properties"]["id"])  # the input is not changed


def test_nested_one_ofs_are_renamed_inside_out():
    inner = {"oneOf": [{"type": "integer"}, {"type": "string"}]}
    schema = {"oneOf": [{"type": "null"}, {"type": "array", "items": inner}]}
    assert one_of_exclusivity(schema) == {"#": None, "#/oneOf/1/items": None}
    assert any_of_version(schema) == {
        "anyOf": [
            {"type": "null"},
            {"type": "array", "items": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
        ]
    }


def test_a_ref_into_a_one_of_keeps_every_one_of():
    schema = {
        "properties": {"a": {"oneOf": [{"type": "integer"}, {"type": "string"}]}},
        "$defs": {"b": {"$ref": "#/properties/a/oneOf/0"}},
    }
    assert one_of_exclusivity(schema) == {"#/properties/a": "a $ref points inside a oneOf"}


# -- the llguidance backend enforces exactly one branch -------------------------------------------


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    try:
        tokenizer = default_tokenizer()
    except ValueError as e:  # the embedded model package is missing
        pytest.skip(str(e))
    return GrammarCompiler(tokenizer, compile_timeout=60)


def accepts(compiler: GrammarCompiler, schema: dict, value, lenient: bool = False) -> bool:
    """Whether `value`, written as compact JSON and tokenized as the model would, is a complete
    output of the grammar: walked token by token through its matcher."""
    matcher = compiler.compile("json_schema", schema, lenient=lenient).matcher()
    text = dump_json_for_schema(schema, value)
    ids = compiler._tokenizer.encode(text, add_special_tokens=False)
    return matcher.accept_tokens(ids) == len(ids) and matcher.is_accepting()


@pytest.mark.parametrize("name", EXCLUSIVE)
def test_an_exclusive_one_of_compiles_and_accepts_what_jsonschema_does(compiler, name):
    """Accepted: exactly what jsonschema accepts of the schema with its objects closed (the
    backend's default, generating only listed keys), all of it valid under the schema itself."""
    schema, values = EXCLUSIVE[name]
    assert compiler.backend == "llguidance"
    closed = close_objects(schema)
    for value in values:
        accepted = accepts(compiler, schema, value)
        assert accepted == valid(closed, value), value
        assert valid(schema, value) or not accepted, value


def test_the_branches_are_still_read_with_what_surrounds_them(compiler):
    schema, _ = EXCLUSIVE["an enum discriminator, the type and required beside the oneOf"]
    # the discriminator is required by the parent: without it, neither branch may be written
    matcher = compiler.compile("json_schema", schema).matcher()
    assert matcher.accept_string('{"')
    assert not matcher.accept_string('r"')  # objects are closed, so the first key is "shape"
    assert accepts(compiler, schema, {"shape": "square", "side": 1.5})


def test_an_overlapping_one_of_is_refused_with_keyword_and_place(compiler):
    schema = {
        "type": "object",
        "properties": {"name": {"oneOf": [{"type": "string"}, {"type": "string", "minLength": 3}]}},
    }
    with pytest.raises(GrammarError) as e:
        compiler.compile("json_schema", schema)
    message = str(e.value)
    assert f"unsupported keyword 'oneOf' at #/properties/name: {OVERLAP}" in message, message
    assert "json_schema_lenient" in message
    open_objects = "open objects that require different keys"
    for name, schema in OVERLAPPING.items():
        if name == open_objects:
            continue
        with pytest.raises(GrammarError, match=f"unsupported keyword 'oneOf' at #: {OVERLAP}"):
            compiler.compile("json_schema", schema)
            pytest.fail(f"{name}: compiled")
    # closed, as the backend writes objects by default, each writes only its own key
    schema = OVERLAPPING[open_objects]
    assert accepts(compiler, schema, {"a": 1}) and accepts(compiler, schema, {"b": 2})
    assert not accepts(compiler, schema, {"a": 1, "b": 2}) and not valid(schema, {"a": 1, "b": 2})


def test_a_one_of_in_an_unused_definition_is_not_refused(compiler):
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "$defs": {"unused": OVERLAPPING["integer and number"]},
    }
    assert accepts(compiler, schema, {"a": 1})
    used = {**schema, "properties": {"a": {"$ref": "#/$defs/unused"}}}
    with pytest.raises(GrammarError, match="'oneOf' at #/\\$defs/unused: branches"):
        compiler.compile("json_schema", used)


def test_reachable_subschemas_follow_local_refs_only():
    schema = {
        "properties": {"a": {"$ref": "#/$defs/used"}, "b": {"items": {"$ref": "#"}}},
        "$defs": {"used": {"anyOf": [{"type": "null"}]}, "unused": {"type": "string"}},
    }
    assert reachable_subschemas(schema) == {
        "#",
        "#/properties/a",
        "#/properties/b",
        "#/properties/b/items",
        "#/$defs/used",
        "#/$defs/used/anyOf/0",
    }
    assert reachable_subschemas({"$ref": "other.json#/a"}) is None  # cannot tell: all may be
    assert reachable_subschemas({"$defs": {"x": {"$id": "x.json"}}, "$ref": "#/$defs/x"}) is None


# Closed (the default), the first branch writes {"a": 1} only, which the second, open, accepts
# too: a oneOf whose closed branches exclude each other is not thereby exclusive (llguidance,
# judging the closed branches itself, compiled this and accepted {"a": 1})
CLOSING_IS_NO_PROOF = {
    "oneOf": [
        {"type": "object", "properties": {"a": {"const": 1}}, "required": ["a"]},
        {"type": "object", "properties": {"b": {"type": "integer"}}},
    ]
}
# Closed, each branch's `content` lacks a key the other's requires: exclusive as generated
CLOSED_CONTENT = {
    "type": "object",
    "oneOf": [
        {
            "properties": {
                "content": {
                    "type": "object",
                    "properties": {"image": {"type": "string"}},
                    "required": ["image"],
                }
            },
            "required": ["content"],
        },
        {
            "properties": {
                "content": {
                    "type": "object",
                    "properties": {"src": {"type": "string"}, "alt": {"type": "string"}},
                    "required": ["src"],
                }
            },
            "required": ["content"],
        },
    ],
}


def test_closing_objects_proves_nothing_of_the_branches_as_written(compiler):
    assert valid(close_objects(CLOSING_IS_NO_PROOF["oneOf"][0]), {"a": 1})
    assert not valid(CLOSING_IS_NO_PROOF, {"a": 1})  # it matches both branches
    with pytest.raises(GrammarError, match=f"'oneOf' at #: {OVERLAP}"):
        compiler.compile("json_schema", CLOSING_IS_NO_PROOF)


def test_closed_branches_whose_values_match_one_branch_as_written_compile(compiler):
    assert one_of_exclusivity(CLOSED_CONTENT) == {"#": OVERLAP}  # open: {image, src} is both
    assert one_of_exclusivity(CLOSED_CONTENT, close_objects(CLOSED_CONTENT)) == {"#": None}
    for value in [
        {"content": {"image": "x"}},
        {"content": {"src": "y", "alt": "z"}},
        {"content": {"src": "y", "image": "x"}},
        {"content": {}},
        {},
    ]:
        accepted = accepts(compiler, CLOSED_CONTENT, value)
        assert accepted == valid(close_objects(CLOSED_CONTENT), value), value
        assert valid(CLOSED_CONTENT, value) or not accepted, value


def test_lenient_notes_each_overlapping_one_of_and_the_output_check_catches_two(compiler):
    schema = {
        "type": "object",
        "properties": {
            "a": {"oneOf": [{"enum": [1, 2]}, {"enum": [2, 3]}]},
            "b": {"oneOf": [{"type": "integer"}, {"type": "null"}]},
        },
        "required": ["a"],
    }
    grammar = compiler.compile("json_schema", schema, lenient=True)
    assert grammar.notes == (f"unsupported keyword 'oneOf' at #/properties/a: {OVERLAP}",)
    assert accepts(compiler, schema, {"a": 2}, lenient=True)  # generated as anyOf ...
    assert grammar.validate_output('{"a":2}')["valid"] is False  # ... and caught after
    assert grammar.validate_output('{"a":1,"b":null}')["valid"] is True
