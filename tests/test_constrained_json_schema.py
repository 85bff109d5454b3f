"""JSON Schema -> regex, checked with Python's `re` as the oracle (our regexes read the same in
both dialects) and `jsonschema` as the judge: everything the regex accepts must validate."""

from __future__ import annotations

import datetime
import itertools
import json
import re
from decimal import Decimal
from pathlib import Path

import pytest

from radixlm.constrained import (
    GrammarError,
    JsonSchemaOptions,
    dump_json_for_schema,
    json_schema_to_regex,
    schema_validator,
    validate_json_output,
)
from radixlm.constrained.numeric import decimal_range, int_range
from radixlm.constrained.pattern import pattern_language


def compiled(schema, **options) -> re.Pattern:
    return re.compile(json_schema_to_regex(schema, JsonSchemaOptions(**options)))


def check(schema, accepted, rejected=(), **options):
    """`accepted` values (written in schema order) match; `rejected` ones do not; and every
    value that matches validates."""
    rx = compiled(schema, **options)
    validator = schema_validator(schema)
    for v in accepted:
        text = v if isinstance(v, str) and v.startswith("RAW:") else dump_json_for_schema(schema, v)
        text = text.removeprefix("RAW:")
        assert rx.fullmatch(text), f"should accept {text}"
        assert validator.is_valid(json.loads(text)), f"test value not valid: {text}"
    for v in rejected:
        text = (
            v.removeprefix("RAW:")
            if isinstance(v, str) and v.startswith("RAW:")
            else json.dumps(v, separators=(",", ":"))
        )
        if rx.fullmatch(text):
            pytest.fail(f"should reject {text}")


def refused(schema, keyword: str, path: str | None = None):
    with pytest.raises(GrammarError) as e:
        json_schema_to_regex(schema)
    assert f"'{keyword}'" in str(e.value), str(e.value)
    if path is not None:
        assert f"at {path}" in str(e.value), str(e.value)


# -- numbers ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lo,hi", [(None, None), (0, None), (None, -3), (-120, 45), (7, 7), (99, 1001), (-1000, -999)]
)
def test_integer_ranges_are_exact(lo, hi):
    rx = re.compile(int_range(lo, hi))
    for n in range(-1300, 1300):
        inside = (lo is None or n >= lo) and (hi is None or n <= hi)
        assert bool(rx.fullmatch(str(n))) == inside, n
    assert not rx.fullmatch("-0") and not rx.fullmatch("007")


def test_decimal_ranges_are_exact():
    texts = [
        f"{i}{f}" for i in range(-12, 13) for f in ["", ".0", ".5", ".05", ".25", ".99", ".001"]
    ]
    texts = [t for t in texts if not re.fullmatch(r"-0(\.0*)?", t)] + ["-0.5", "-0.05", "0.0"]
    bounds = [None, "0", "0.5", "-1.25", "3", "10.05"]
    for lo, hi in itertools.product(bounds, repeat=2):
        for lo_strict, hi_strict in itertools.product([False, True], repeat=2):
            L = None if lo is None else Decimal(lo)
            H = None if hi is None else Decimal(hi)
            r = decimal_range(L, lo_strict, H, hi_strict, None)
            rx = re.compile(r) if r is not None else None
            for t in texts:
                x = Decimal(t)
                inside = (L is None or (x > L if lo_strict else x >= L)) and (
                    H is None or (x < H if hi_strict else x <= H)
                )
                assert bool(rx and rx.fullmatch(t)) == inside, (lo, lo_strict, hi, hi_strict, t)


def test_number_keywords():
    check(
        {"type": "integer", "minimum": -5, "exclusiveMaximum": 20},
        [-5, 0, 19],
        [-6, 20, 1.5, "x"],
    )
    check({"type": "number", "minimum": 0.5, "maximum": 2}, [0.5, 1, 1.25, 2], [0.49, 2.01, -1])
    # bounded numbers are generated without exponent (1e-400 would round to 0)
    check({"type": "number", "exclusiveMinimum": 0}, [0.001, 3], [0, -0.5, "RAW:1e-400"])
    check({"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 30}, [0, 5, 30], [3, 35])
    # draft 4 boolean exclusiveMinimum
    check(
        {
            "$schema": "http://json-schema.org/draft-04/schema#",
            "type": "integer",
            "minimum": 3,
            "exclusiveMinimum": True,
        },
        [4],
        [3],
    )


# -- strings ----------------------------------------------------------------------------------


def test_string_lengths_count_characters_not_bytes():
    check(
        {"type": "string", "minLength": 2, "maxLength": 3},
        ["ab", "é€😀", 'a"b', "a\nb"],
        ["a", "abcd"],
    )
    # escapes count as one character each
    check({"type": "string", "maxLength": 2}, ["RAW:" + '"\\"\\n"'], ["RAW:" + '"\\"\\nx"'])


def test_patterns_use_search_semantics_and_json_escaping():
    check({"type": "string", "pattern": "^[a-z]+$"}, ["abc"], ["", "aB", "RAW:" + '"a\\u0062"'])
    check({"type": "string", "pattern": "b+"}, ["abbc", "b"], ["ac"])
    check({"type": "string", "pattern": '^a"b$'}, ['a"b'])
    check({"type": "string", "pattern": r"^\d{3}$"}, ["123"], ["12", "1234", "١٢٣"])
    check({"type": "string", "pattern": "^[a-z]*$", "maxLength": 3}, ["", "abc"], ["abcd"])
    # U+001C..U+001F are whitespace to Python's re (the validator's): outside [^\s] and \S too
    for pattern in (r"^[^\s]+$", r"^\S+$", r"^[^\d\s]+$"):
        check({"type": "string", "pattern": pattern}, ["ab"], ["a\u001eb", "a\u001fb", "a b"])
    # a pattern of varied length, split by length to meet min/maxLength
    check(
        {"type": "string", "pattern": r"\d{2}-?\d{0,4}", "minLength": 2, "maxLength": 6},
        ["12", "12-345", "x12-3", "123456"],
        ["1", "1234567", "12-3456"],
    )


def test_pattern_translation_refuses_what_it_cannot_enforce():
    for bad in [r"(?=a)b", r"(a)\1", r"\bword", r"(?i)abc", r"a^b"]:
        with pytest.raises(GrammarError):
            pattern_language(bad)
    refused({"type": "string", "pattern": "(?=x)"}, "pattern", "#")


def test_formats():
    check(
        {"type": "string", "format": "date-time"},
        ["2024-02-29T12:30:00Z", "1999-12-31T23:59:59.5+01:00"],
        ["2023-02-29T12:30:00Z", "2024-01-01 12:00:00Z", "2024-13-01T00:00:00Z"],
    )
    check({"type": "string", "format": "ipv4"}, ["10.0.0.255"], ["256.1.1.1", "01.2.3.4"])
    # every year against Python's own date parser (the validator's): no year 0, leap years right
    date = compiled({"type": "string", "format": "date"})
    for year in range(10000):
        for month_day in ("02-29", "02-28", "04-30", "04-31", "12-31"):
            text = f"{year:04d}-{month_day}"
            try:
                valid = bool(datetime.date.fromisoformat(text))
            except ValueError:
                valid = False
            assert bool(date.fullmatch(json.dumps(text))) == valid, text
    check({"type": "string", "format": "uuid"}, ["123e4567-e89b-12d3-a456-426614174000"], ["123"])
    check({"type": "string", "format": "email"}, ["a.b@example.org"], ["a@@b", "@b.c"])
    check({"type": "string", "format": "x-unknown-format"}, ["anything"])  # annotation only
    refused({"type": "string", "format": "uri-template"}, "format")


# -- objects ----------------------------------------------------------------------------------


def test_properties_in_schema_order_required_and_optional():
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "string"}, "c": {"type": "boolean"}},
        "required": ["b"],
    }
    check(
        schema,
        [{"b": "x"}, {"a": 1, "b": "x"}, {"a": 1, "b": "", "c": True}, {"b": "x", "c": False}],
        ["RAW:{}", "RAW:" + '{"a":1}', "RAW:" + '{"b":"x","a":1}', "RAW:" + '{"b":"x","d":1}'],
    )


def test_all_optional_properties():
    props = {k: {"type": "integer"} for k in "abcd"}
    check(
        {"type": "object", "properties": props},
        [{}, {"c": 1}, {"a": 1, "d": 2}, {"a": 1, "b": 2, "c": 3, "d": 4}],
        ["RAW:{,}"],
    )
    check({"type": "object", "properties": props, "minProperties": 1}, [{"b": 1}], ["RAW:{}"])


def test_additional_properties():
    base = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    check({**base, "additionalProperties": False}, [{"a": 1}], ["RAW:" + '{"a":1,"b":2}'])
    check(
        {**base, "additionalProperties": {"type": "string"}},
        [{"a": 1}, {"a": 1, "x": "y", "zz": ""}],
        ["RAW:" + '{"a":1,"x":2}', "RAW:" + '{"a":1,"a":"x"}'],  # a listed key is no extra
    )
    check({"type": "object"}, [{}, {"k": [1, {"n": None}]}])
    # unspecified additionalProperties: only the listed keys are generated by default ...
    check(base, [{"a": 1}], ["RAW:" + '{"a":1,"b":2}'])
    # ... or any extra key when asked
    check(base, [{"a": 1, "b": [2]}], allow_unlisted_properties=True)


def test_pattern_properties_map():
    schema = {
        "type": "object",
        "patternProperties": {"^[a-z]+$": {"type": "integer"}},
        "additionalProperties": False,
    }
    check(schema, [{}, {"ab": 1, "c": 2}], ["RAW:" + '{"A":1}', "RAW:" + '{"ab":"x"}'])


def test_property_names_on_maps():
    schema = {
        "type": "object",
        "additionalProperties": {"type": "integer"},
        "propertyNames": {"pattern": "^[a-z]+$", "maxLength": 3},
    }
    check(schema, [{}, {"ab": 1, "c": 2}], ["RAW:" + '{"abcd":1}', "RAW:" + '{"A":1}'])
    listed = {
        "type": "object",
        "properties": {"Ok": {"type": "integer"}, "no": {"type": "integer"}},
        "propertyNames": {"pattern": "^[A-Z]"},
    }
    check(listed, [{"Ok": 1}], ["RAW:" + '{"no":1}'])


def test_dependent_required():
    schema = {
        "type": "object",
        "properties": {"card": {"type": "string"}, "address": {"type": "string"}},
        "dependentRequired": {"card": ["address"]},
        "additionalProperties": False,
    }
    check(schema, [{}, {"address": "x"}, {"card": "1", "address": "x"}], ["RAW:" + '{"card":"1"}'])


# -- arrays -----------------------------------------------------------------------------------


def test_arrays():
    check(
        {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
        [[1], [1, 2, 3]],
        [[], [1, 2, 3, 4]],
    )
    check(
        {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
        [[], ["a"], ["a", 1]],
        [["a", 1, 2], [1]],
    )
    check(
        {"type": "array", "items": {"enum": ["x", "y", "z"]}, "uniqueItems": True},
        [[], ["x", "z"], ["x", "y", "z"]],
        [["x", "x"]],
    )
    refused(
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems", "#"
    )
    refused({"type": "array", "contains": {"type": "integer"}}, "contains")


# -- composition --------------------------------------------------------------------------------


def test_enum_const_nullable_anyof():
    check({"enum": ["a", 1, None, {"k": [1]}]}, ["a", 1, None, {"k": [1]}], ["b", 2])
    check({"const": "fixed"}, ["fixed"], ["other"])
    check({"type": ["string", "null"], "maxLength": 2}, ["ab", None], ["abc", 1])
    check({"anyOf": [{"type": "integer", "minimum": 10}, {"type": "string"}]}, [10, "s"], [9, True])
    # enum values are filtered by every sibling keyword
    check({"type": "string", "enum": ["a", 1, "bb"], "maxLength": 1}, ["a"], ["bb", 1])


def test_one_of_only_when_branches_exclude_each_other():
    check({"oneOf": [{"type": "integer"}, {"type": "string"}]}, [1, "x"], [None])
    tagged = {
        "oneOf": [
            {
                "type": "object",
                "properties": {"kind": {"const": "a"}, "x": {"type": "integer"}},
                "required": ["kind"],
            },
            {
                "type": "object",
                "properties": {"kind": {"const": "b"}, "y": {"type": "string"}},
                "required": ["kind"],
            },
        ]
    }
    check(tagged, [{"kind": "a", "x": 1}, {"kind": "b"}], ["RAW:" + '{"kind":"c"}'])
    refused({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf", "#/oneOf")


def test_all_of_merges_and_ref_resolves():
    schema = {
        "$defs": {
            "named": {
                "type": "object",
                "properties": {"name": {"type": "string"}},
                "required": ["name"],
            }
        },
        "allOf": [
            {"$ref": "#/$defs/named"},
            {"properties": {"age": {"type": "integer", "minimum": 0}}, "required": ["age"]},
        ],
    }
    check(
        schema,
        [{"name": "x", "age": 3}],
        ["RAW:" + '{"name":"x"}', "RAW:" + '{"name":"x","age":-1}'],
    )


def test_recursive_ref_is_unrolled_soundly():
    tree = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "v": {"type": "integer"},
                    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                },
                "required": ["v"],
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/node",
    }
    check(tree, [{"v": 1}, {"v": 1, "kids": [{"v": 2, "kids": []}]}], ["RAW:" + '{"kids":[]}'])


def test_not():
    check({"type": ["integer", "string"], "not": {"type": "string"}}, [3], ["x"])
    refused({"not": {"minimum": 3}}, "not", "#/not")


def test_refusals_name_keyword_and_path():
    refused(
        {
            "type": "object",
            "properties": {"a": {"if": {"type": "string"}, "then": {"minLength": 2}}},
        },
        "if",
        "#/properties/a",
    )
    refused(
        {"properties": {"n": {"type": "number", "multipleOf": 0.1}}}, "multipleOf", "#/properties/n"
    )
    refused(
        {
            "type": "object",
            "properties": {"s": {"type": "string", "pattern": "^a+b*$", "maxLength": 100}},
        },
        "maxLength",
    )
    with pytest.raises(GrammarError, match="external"):
        json_schema_to_regex({"$ref": "other.json#/x"})


def test_lenient_skips_and_validate_reports():
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    rx = compiled(schema, lenient=True)
    assert rx.fullmatch("[1,1]")  # generated, so the caller must validate
    assert "non-unique" in validate_json_output(schema, "[1,1]")
    assert validate_json_output(schema, "[1,2]") is None
    assert "not valid JSON" in validate_json_output(schema, "[1,")


def test_pydantic_model_schema():
    pydantic = pytest.importorskip("pydantic")

    class Address(pydantic.BaseModel):
        street: str
        zip: str = pydantic.Field(pattern=r"^\d{5}$")

    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        age: int = pydantic.Field(ge=0, le=150)
        email: str | None = None
        tags: list[str] = []
        address: Address

    schema = Person.model_json_schema()
    person = {
        "name": "Ann",
        "age": 31,
        "email": None,
        "tags": ["x"],
        "address": {"street": "Main", "zip": "12345"},
    }
    check(
        schema,
        [person, {**person, "email": "a@b.c", "tags": []}],
        ["RAW:" + json.dumps({**person, "age": -1}, separators=(",", ":"))],
    )


SUITE = Path(__file__).resolve().parents[2] / "shared" / "data" / "json-schema-test-suite"


def test_json_schema_test_suite_has_no_false_accept():
    """Every group of the official JSON-Schema-Test-Suite (draft 2020-12) is either refused or
    rejects every invalid instance (Python's `re` reads our regexes alike: the oracle)."""
    if not SUITE.exists():
        pytest.skip(f"no JSON-Schema-Test-Suite at {SUITE}")
    false_accepts, compiled_groups = [], 0
    for path in sorted(SUITE.glob("*.json")):
        for i, group in enumerate(json.loads(path.read_text())):
            try:
                rx = compiled(group["schema"])
            except GrammarError:
                continue
            compiled_groups += 1
            for test in group["tests"]:
                try:
                    text = dump_json_for_schema(group["schema"], test["data"])
                except Exception:
                    text = json.dumps(test["data"], ensure_ascii=False, separators=(",", ":"))
                if not test["valid"] and rx.fullmatch(text):
                    false_accepts.append((path.name, i, group["description"], text))
    assert not false_accepts
    assert compiled_groups >= 200  # refusing everything would pass the check above
