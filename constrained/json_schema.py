"""JSON Schema to regex, sound first.

Every string the regex matches parses to a JSON value the schema accepts: each keyword is either
enforced exactly by the regex, or the schema is refused with a GrammarError naming the keyword
and where it is (`unsupported keyword 'uniqueItems' at #/properties/tags`). The regex may be
*narrower* than the schema (a subset is still sound): objects keep the schema's property order,
JSON is written compactly (or with bounded whitespace), recursion is unrolled to a fixed depth,
some rare spellings (exponents in bounded numbers, non-canonical escapes in keys) are not
generated.

Pipeline: a schema node is *flattened* (`$ref` resolved, `allOf` merged into one keyword set
whose subschemas stay lazy `Loc`s), then *emitted* per JSON type. `enum`/`const` nodes are
emitted by validating each candidate value against the node's source schemas with `jsonschema`,
which makes them exact whatever other keywords sit beside them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction
from typing import Any
from urllib.parse import unquote, urldefrag, urljoin

from radixlm.constrained import regex_text as rt
from radixlm.constrained.errors import GrammarError
from radixlm.constrained.formats import FORMATS, UNSUPPORTED_FORMATS
from radixlm.constrained.numeric import JSON_NUMBER, decimal_range, int_range
from radixlm.constrained.pattern import PatternError, pattern_language, pattern_with_length

L = rt.lit

# How JSON whitespace may appear between tokens in "flexible" mode: bounded, so that a model
# cannot spin on whitespace forever (20 covers a newline and deep indentation).
FLEXIBLE_WHITESPACE = "[\\x20\\x09\\x0a\\x0d]{0,20}"
MAX_REGEX_CHARS = 1_000_000
_COUNT_BUDGET = 12_000  # regex chars a bounded repetition may copy

ANNOTATIONS = frozenset(
    {
        "title", "description", "default", "examples", "$comment", "$schema", "$id", "id",
        "$anchor", "$dynamicAnchor", "$recursiveAnchor", "$vocabulary", "deprecated", "readOnly",
        "writeOnly", "contentEncoding", "contentMediaType", "contentSchema", "definitions",
        "$defs", "then", "else", "minContains", "maxContains",
    }
)  # fmt: skip
# Validation keywords of drafts 3 to 2020-12. Anything else is an unknown keyword, which
# validators ignore, and so do we.
KEYWORDS = frozenset(
    {
        "type", "enum", "const", "allOf", "anyOf", "oneOf", "not", "if", "$ref", "$dynamicRef",
        "$recursiveRef", "properties", "required", "additionalProperties", "patternProperties",
        "propertyNames", "minProperties", "maxProperties", "dependencies", "dependentRequired",
        "dependentSchemas", "unevaluatedProperties", "items", "prefixItems", "additionalItems",
        "minItems", "maxItems", "uniqueItems", "contains", "unevaluatedItems", "minLength",
        "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum",
        "exclusiveMaximum", "multipleOf", "divisibleBy", "extends", "disallow",
    }
)  # fmt: skip
_TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")
_OBJECT_KW = frozenset(
    {"properties", "required", "additionalProperties", "patternProperties", "propertyNames",
     "minProperties", "maxProperties", "dependencies", "dependentRequired", "dependentSchemas",
     "unevaluatedProperties"}
)  # fmt: skip
_ARRAY_KW = frozenset(
    {"items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems", "contains",
     "unevaluatedItems"}
)  # fmt: skip
_STRING_KW = frozenset({"minLength", "maxLength", "pattern", "format"})
_NUMBER_KW = frozenset(
    {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "divisibleBy"}
)
_EXACT_FLOAT_LIMIT = 2**53
_SIGNIFICANT_DIGITS = 15  # decimals this short round-trip through a double


@dataclass(frozen=True)
class JsonSchemaOptions:
    """How a schema becomes a regex.

    whitespace: "compact" (none between tokens), "flexible" (bounded optional whitespace) or a
        regex for the whitespace allowed between tokens.
    lenient: skip keywords we cannot enforce instead of refusing the schema; the caller must then
        check the finished output with `validate_json_output`.
    max_ref_depth: how many times one `$ref` may be open at once (unrolled recursion depth).
    any_depth: nesting depth generated for values the schema leaves unconstrained.
    allow_unlisted_properties: let objects that list `properties` but say nothing about
        `additionalProperties` carry extra keys (off: only the listed keys are generated).
    max_counted: bounded repetitions (maxLength, maxItems) above this many are narrowed to it
        when they would make the automaton large (a sound narrowing).
    """

    whitespace: str = "compact"
    lenient: bool = False
    max_ref_depth: int = 3
    any_depth: int = 2
    allow_unlisted_properties: bool = False
    max_counted: int = 32


class OutputCheck:
    """A finished output checked against a JSON schema given as text (what lenient mode owes the
    caller), the validator built on the first check: {"valid", "error" (None or what is wrong),
    "ignored_keywords" (`notes`: what the grammar did not enforce)}. A schema that cannot be
    checked is reported, never raised into the engine."""

    def __init__(self, spec: str, notes: tuple[str, ...] = ()) -> None:
        self.spec, self.notes = spec, notes
        self._schema: Any = None
        self._validator: Any = None

    def __call__(self, text: str) -> dict[str, Any]:
        if self._validator is None:
            try:
                self._schema = json.loads(self.spec)
                self._validator = schema_validator(self._schema)
            except Exception as e:
                error = f"the schema could not be checked: {type(e).__name__}: {e}"
                return {"valid": False, "error": error, "ignored_keywords": list(self.notes)}
        error = validate_json_output(self._schema, text, self._validator)
        return {"valid": error is None, "error": error, "ignored_keywords": list(self.notes)}


def schema_validator(schema: Any):
    """A `jsonschema` validator for `schema`, with format checking; the draft from `$schema`.

    Without `$schema`, draft 2020-12, or 2019-09 when the schema uses the array form of `items`
    (which 2020-12 no longer reads).
    """
    import jsonschema
    from jsonschema.validators import validator_for

    default = jsonschema.Draft202012Validator
    if isinstance(schema, dict) and "$schema" not in schema and _uses_item_arrays(schema):
        default = jsonschema.Draft201909Validator
    cls = validator_for(schema, default=default)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def _uses_item_arrays(node: Any) -> bool:
    if isinstance(node, dict):
        if isinstance(node.get("items"), list):
            return True
        return any(_uses_item_arrays(v) for v in node.values())
    if isinstance(node, list):
        return any(_uses_item_arrays(v) for v in node)
    return False


def validate_json_output(schema: Any, text: str, validator: Any = None) -> str | None:
    """Check a finished output against its schema: None if valid, else what is wrong.
    `validator`: one made by `schema_validator(schema)` already (it is the costly part)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        return f"output is not valid JSON: {e}"
    try:
        validator = validator or schema_validator(schema)
        error = next(iter(sorted(validator.iter_errors(value), key=lambda e: e.path)), None)
    except Exception as e:  # a broken schema is reported, never raised into the caller
        return f"schema could not be checked: {e}"
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    return f"{error.message} (at /{where})"


def json_schema_to_regex(schema: Any, options: JsonSchemaOptions | None = None) -> str:
    """The regex of the JSON documents that satisfy `schema`; GrammarError if not enforceable."""
    return json_schema_regex(schema, options)[0]


def json_schema_regex(
    schema: Any, options: JsonSchemaOptions | None = None
) -> tuple[str, list[str]]:
    """(regex, what lenient mode skipped) for a schema given as text or as parsed JSON."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("a JSON schema must be an object or a boolean")
    options = options or JsonSchemaOptions()
    # Recursion and free-form values are unrolled; when that makes the regex too large, unroll
    # less (a narrower language is still sound) before giving up.
    ladder = [(options.max_ref_depth, options.any_depth)]
    for ref_depth, any_depth in ((2, 1), (1, 1), (1, 0)):
        if ref_depth <= options.max_ref_depth and any_depth <= options.any_depth:
            ladder.append((ref_depth, any_depth))
    too_large = False
    for ref_depth, any_depth in dict.fromkeys(ladder):
        step = dataclasses.replace(options, max_ref_depth=ref_depth, any_depth=any_depth)
        compiler = _SchemaCompiler(schema, step)
        try:
            regex = compiler.value(compiler.root_loc())
        except _TooLarge:
            too_large = True
            continue
        except RecursionError:
            raise GrammarError("the JSON schema is nested too deeply") from None
        if regex is not None:
            return regex, compiler.skipped
        if not too_large:
            break
    if not too_large:
        raise GrammarError(
            "no JSON value satisfies this schema (recursive references are unrolled "
            f"{options.max_ref_depth} levels deep)"
        )
    raise GrammarError(
        f"the JSON schema expands to a regex of more than {MAX_REGEX_CHARS} characters; simplify it"
    )


class _TooLarge(Exception):
    pass


def dump_json_for_schema(schema: Any, value: Any) -> str:
    """`value` as compact JSON with object keys in the schema's property order (then the rest in
    their own order): the spelling the compact grammar generates."""
    if isinstance(schema, str):
        schema = json.loads(schema)
    sc = _SchemaCompiler(schema, JsonSchemaOptions())
    return json.dumps(
        sc.ordered(value, sc.root_loc(), 0), ensure_ascii=False, separators=(",", ":")
    )


# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Loc:
    """A subschema where it was found: its JSON pointer, base URI and the refs open above it."""

    schema: Any
    path: str
    base: str
    refs: tuple[str, ...] = ()


@dataclass(frozen=True, eq=False)
class Conj:
    """Subschemas that must all hold (what allOf and merged keywords become)."""

    parts: tuple[Any, ...]  # Loc | Conj


Sub = Loc | Conj


@dataclass
class Flat:
    """A schema node with $ref and allOf resolved: keyword -> value, subschemas kept lazy."""

    kw: dict[str, Any] = field(default_factory=dict)
    at: dict[str, str] = field(default_factory=dict)  # keyword -> where it came from
    sources: list[Loc] = field(default_factory=list)  # raw schemas whose conjunction this is
    anyof: list[tuple[str, list[Sub], str]] = field(
        default_factory=list
    )  # (anyOf|oneOf, alts, path)
    nots: list[tuple[Sub, str]] = field(default_factory=list)
    unsupported: list[tuple[str, str]] = field(default_factory=list)  # (keyword, path)
    false: bool = False  # no value satisfies it


def _pointer(path: str, *parts: Any) -> str:
    return path + "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


class _SchemaCompiler:
    def __init__(self, root: Any, options: JsonSchemaOptions) -> None:
        self.root = root
        self.options = options
        if options.whitespace == "compact":
            self.ws = ""
        elif options.whitespace == "flexible":
            self.ws = FLEXIBLE_WHITESPACE
        else:
            self.ws = options.whitespace
        self.resources: dict[str, Any] = {}
        draft = root.get("$schema", "") if isinstance(root, dict) else ""
        old = isinstance(draft, str) and ("draft-03" in draft or "draft-04" in draft)
        self.id_keys = ("$id", "id") if old else ("$id",)
        self.anchors: dict[str, tuple[Any, str]] = {}
        self.root_base = ""
        root_id = next(
            (
                root[k]
                for k in self.id_keys
                if isinstance(root, dict) and isinstance(root.get(k), str)
            ),
            None,
        )
        if root_id is not None:
            self.root_base = urldefrag(root_id)[0]
        self._collect(root, self.root_base, "#")
        self._validator: Any = None
        self.skipped: list[str] = []

    def root_loc(self) -> Loc:
        return Loc(self.root, "#", self.root_base)

    # -- references ----------------------------------------------------------------------------

    def _collect(self, node: Any, base: str, path: str) -> None:
        """Index the resources ($id) and anchors of the document."""
        if isinstance(node, list):
            for i, v in enumerate(node):
                self._collect(v, base, _pointer(path, i))
            return
        if not isinstance(node, dict):
            return
        ident = next((node[k] for k in self.id_keys if isinstance(node.get(k), str)), None)
        if isinstance(ident, str):
            if ident.startswith("#"):  # draft 6/7 plain-name anchor
                self.anchors[base + ident] = (node, path)
            else:
                base = urldefrag(urljoin(base, ident))[0]
                self.resources.setdefault(base, node)
        if isinstance(node.get("$anchor"), str):
            self.anchors[base + "#" + node["$anchor"]] = (node, path)
        self.resources.setdefault(base, node) if path == "#" else None
        for k, v in node.items():
            if k in ("enum", "const", "examples", "default"):
                continue
            if isinstance(v, (dict, list)):
                self._collect(v, base, _pointer(path, k))

    def _resolve(self, ref: str, loc: Loc) -> Loc:
        uri, fragment = urldefrag(urljoin(loc.base, ref) if loc.base else ref)
        if uri in ("", self.root_base):
            doc, path = self.root, "#"
        elif uri in self.resources:
            doc, path = self.resources[uri], uri + "#"
        else:
            raise GrammarError(f"external $ref {ref!r} at {loc.path} is not supported")
        key = uri + "#" + fragment
        if fragment and not fragment.startswith("/"):
            if key not in self.anchors:
                raise GrammarError(f"$ref {ref!r} at {loc.path}: anchor not found")
            node, path = self.anchors[key]
            return Loc(node, path, uri, loc.refs + (key,))
        node = doc
        for part in fragment.split("/")[1:]:
            part = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise GrammarError(f"$ref {ref!r} at {loc.path} does not resolve")
            path = _pointer(path, part)
        return Loc(node, path, uri, loc.refs + (key,))

    # -- flattening ----------------------------------------------------------------------------

    def flat(self, sub: Sub | bool) -> Flat:
        if isinstance(sub, bool):
            return Flat(false=not sub)
        if isinstance(sub, Conj):
            out = Flat()
            for p in sub.parts:
                out = self._merge(out, self.flat(p), in_place=False)
            return out
        return self._flat_loc(sub)

    def _flat_loc(self, loc: Loc) -> Flat:
        schema, path = loc.schema, loc.path
        if schema is True:
            return Flat(sources=[loc])
        if schema is False:
            return Flat(false=True, sources=[loc])
        if not isinstance(schema, dict):
            raise GrammarError(f"schema at {path} must be an object or a boolean")
        base = loc.base
        ident = next((schema[k] for k in self.id_keys if isinstance(schema.get(k), str)), None)
        if ident is not None and not ident.startswith("#") and path != "#":
            base = urldefrag(urljoin(base, ident))[0]
        here = Loc(schema, path, base, loc.refs)
        out = Flat(sources=[here])
        parts: list[Flat] = []
        for k, v in schema.items():
            if k in ANNOTATIONS or k not in KEYWORDS:
                continue
            at = _pointer(path, k)
            if k == "$ref":
                if not isinstance(v, str):
                    raise GrammarError(f"$ref at {path} must be a string")
                target = self._resolve(v, here)
                if target.refs.count(target.refs[-1]) > self.options.max_ref_depth:
                    parts.append(Flat(false=True))  # recursion unrolled as deep as allowed
                else:
                    parts.append(self._flat_loc(target))
            elif k == "allOf":
                for i, s in enumerate(_schema_list(v, at)):
                    parts.append(self._flat_loc(Loc(s, _pointer(at, i), base, loc.refs)))
            elif k in ("anyOf", "oneOf"):
                alts = [
                    Loc(s, _pointer(at, i), base, loc.refs)
                    for i, s in enumerate(_schema_list(v, at))
                ]
                out.anyof.append((k, alts, at))  # type: ignore[arg-type]
            elif k == "not":
                out.nots.append((Loc(v, at, base, loc.refs), at))
            elif k in ("$dynamicRef", "$recursiveRef", "extends", "disallow"):
                out.unsupported.append((k, path))
            elif k == "if":
                if "then" in schema or "else" in schema:
                    out.unsupported.append(("if", path))
            else:
                self._keyword(out, k, v, at, path, base, loc.refs, schema)
        for i, p in enumerate(parts):
            # a part's unevaluated* must not see its parent's or its siblings' annotations
            if _unevaluated(p) and (
                _evaluates(out) or any(_evaluates(q) for j, q in enumerate(parts) if j != i)
            ):
                k = _unevaluated(p)
                out.unsupported.append((k, p.at.get(k, "#") + ": merged with siblings"))
            out = self._merge(out, p, in_place=True)
        return out

    def _keyword(
        self, out: Flat, k: str, v: Any, at: str, path: str, base: str, refs: tuple, schema: dict
    ) -> None:
        def sub(s: Any, p: str) -> Loc:
            return Loc(s, p, base, refs)

        out.at[k] = path
        if k == "type":
            names = [v] if isinstance(v, str) else v
            if not isinstance(names, list) or not all(isinstance(t, str) for t in names):
                raise GrammarError(f"'type' at {path} must be a string or a list of strings")
            types: set[str] = set()
            for t in names:
                if t == "any":
                    types.update(_TYPES)
                elif t in _TYPES:
                    types.add(t)
                else:
                    raise GrammarError(f"unknown type {t!r} at {path}")
            out.kw["type"] = types
        elif k in ("enum", "const"):
            values = [v] if k == "const" else v
            if not isinstance(values, list):
                raise GrammarError(f"'enum' at {path} must be an array")
            out.kw["enum"] = list(values)
            out.at["enum"] = path
        elif k in ("properties", "patternProperties", "dependentSchemas"):
            if not isinstance(v, dict):
                raise GrammarError(f"'{k}' at {path} must be an object")
            out.kw[k] = {name: sub(s, _pointer(at, name)) for name, s in v.items()}
        elif k == "dependencies":
            if not isinstance(v, dict):
                raise GrammarError(f"'dependencies' at {path} must be an object")
            for name, d in v.items():
                if isinstance(d, list):
                    out.kw.setdefault("dependentRequired", {})[name] = list(d)
                    out.at["dependentRequired"] = path
                else:
                    out.kw.setdefault("dependentSchemas", {})[name] = sub(d, _pointer(at, name))
                    out.at["dependentSchemas"] = path
        elif k == "dependentRequired":
            if not isinstance(v, dict):
                raise GrammarError(f"'dependentRequired' at {path} must be an object")
            out.kw.setdefault("dependentRequired", {}).update({n: list(d) for n, d in v.items()})
        elif k == "required":
            if isinstance(v, bool):  # draft 3: required inside the property
                out.unsupported.append(("required", path)) if v else None
                return
            if not isinstance(v, list):
                raise GrammarError(f"'required' at {path} must be an array")
            out.kw["required"] = list(dict.fromkeys(v))
        elif k in (
            "additionalProperties",
            "propertyNames",
            "unevaluatedProperties",
            "contains",
            "unevaluatedItems",
        ):
            out.kw[k] = v if isinstance(v, bool) else sub(v, at)
        elif k == "items":
            if isinstance(v, list):  # tuple form (drafts before 2020-12)
                out.kw["prefixItems"] = [sub(s, _pointer(at, i)) for i, s in enumerate(v)]
                out.at["prefixItems"] = path
                rest = schema.get("additionalItems", True)
                out.kw["items"] = (
                    rest if isinstance(rest, bool) else sub(rest, _pointer(path, "additionalItems"))
                )
            else:
                out.kw["items"] = v if isinstance(v, bool) else sub(v, at)
        elif k == "prefixItems":
            if not isinstance(v, list):
                raise GrammarError(f"'prefixItems' at {path} must be an array")
            out.kw["prefixItems"] = [sub(s, _pointer(at, i)) for i, s in enumerate(v)]
        elif k == "additionalItems":
            return  # read together with the array form of `items`
        elif k in ("pattern", "format"):
            out.kw[k] = [v]
        elif k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if isinstance(v, bool):  # draft 4: a flag making minimum/maximum exclusive
                bound = "minimum" if k == "exclusiveMinimum" else "maximum"
                if v and bound in schema:
                    out.kw[k] = _number(schema[bound], path, bound)
                return
            out.kw[k] = _number(v, path, k)
        elif k in ("multipleOf", "divisibleBy"):
            m = _number(v, path, k)
            if m <= 0:
                raise GrammarError(f"'{k}' at {path} must be positive")
            out.kw["multipleOf"] = m
            out.at["multipleOf"] = path
        elif k in (
            "minLength",
            "maxLength",
            "minItems",
            "maxItems",
            "minProperties",
            "maxProperties",
        ):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0 or v != int(v):
                raise GrammarError(f"'{k}' at {path} must be a non-negative integer")
            out.kw[k] = int(v)
        elif k == "uniqueItems":
            if v is True:
                out.kw[k] = True
        else:  # pragma: no cover - every keyword in KEYWORDS is handled above
            out.unsupported.append((k, path))

    def _merge(self, a: Flat, b: Flat, in_place: bool = True) -> Flat:
        """The conjunction of two flattened schemas.

        in_place: `b` is an in-place applicator of `a`'s schema object (allOf, $ref, an anyOf
        branch), so `a`'s unevaluatedProperties/Items sees what `b` evaluates; otherwise the two
        are cousins and neither sees the other's annotations.
        """
        out = Flat(
            kw=dict(a.kw),
            at={**b.at, **a.at},
            sources=a.sources + b.sources,
            anyof=a.anyof + b.anyof,
            nots=a.nots + b.nots,
            unsupported=a.unsupported + b.unsupported,
            false=a.false or b.false,
        )
        # unevaluated* only sees the annotations of its own object and what it applies in place:
        # `b`'s must not see `a`'s, nor (between cousins) `a`'s see `b`'s
        for inner, other in ((b, a),) if in_place else ((b, a), (a, b)):
            k = _unevaluated(inner)
            if k and _evaluates(other):
                out.unsupported.append((k, inner.at.get(k, "#") + ": merged with siblings"))
        for k, v in b.kw.items():
            if k not in out.kw:
                out.kw[k] = v
                continue
            u = out.kw[k]
            where = b.at.get(k, "#")
            if k == "type":
                t = _intersect_types(u, v)
                out.kw[k] = t
                out.false |= not t
            elif k == "enum":
                out.kw[k] = [x for x in u if any(_json_equal(x, y) for y in v)]
            elif k in ("properties", "dependentSchemas"):
                merged = dict(u)
                for name, s in v.items():
                    merged[name] = Conj((merged[name], s)) if name in merged else s
                out.kw[k] = merged
            elif k == "patternProperties":
                out.unsupported.append(("patternProperties", where))
            elif k == "required":
                out.kw[k] = list(dict.fromkeys(u + v))
            elif k == "dependentRequired":
                merged = dict(u)
                for name, d in v.items():
                    merged[name] = list(dict.fromkeys(merged.get(name, []) + d))
                out.kw[k] = merged
            elif k in (
                "additionalProperties",
                "propertyNames",
                "unevaluatedProperties",
                "items",
                "unevaluatedItems",
                "contains",
            ):
                if k == "contains":
                    out.unsupported.append(("contains", where))
                out.kw[k] = _conj(u, v)
            elif k == "prefixItems":
                rest_a, rest_b = a.kw.get("items", True), b.kw.get("items", True)
                n = max(len(u), len(v))
                out.kw[k] = [
                    _conj(u[i] if i < len(u) else rest_a, v[i] if i < len(v) else rest_b)
                    for i in range(n)
                ]
            elif k in ("minLength", "minItems", "minProperties", "minimum", "exclusiveMinimum"):
                out.kw[k] = max(u, v)
            elif k in ("maxLength", "maxItems", "maxProperties", "maximum", "exclusiveMaximum"):
                out.kw[k] = min(u, v)
            elif k in ("pattern", "format"):
                out.kw[k] = u + [x for x in v if x not in u]
            elif k == "multipleOf":
                if u != v:
                    if (
                        isinstance(u, Fraction)
                        and isinstance(v, Fraction)
                        and u.denominator == v.denominator == 1
                    ):
                        out.kw[k] = Fraction(math.lcm(int(u), int(v)))
                    else:
                        out.unsupported.append(("multipleOf", where))
            elif k == "uniqueItems":
                out.kw[k] = True
        # additionalProperties of one side applies to the properties only the other side lists
        if "properties" in a.kw or "properties" in b.kw:
            props = dict(out.kw.get("properties", {}))
            for side, other in ((a, b), (b, a)):
                extra = other.kw.get("additionalProperties")
                if extra is None and "patternProperties" not in other.kw:
                    continue
                if "patternProperties" in other.kw and "properties" in side.kw:
                    out.unsupported.append(
                        ("patternProperties", other.at.get("patternProperties", "#"))
                    )
                for name in side.kw.get("properties", {}):
                    if name not in other.kw.get("properties", {}) and extra is not None:
                        props[name] = _conj(props[name], extra)
            out.kw["properties"] = props
        # likewise `items` of a side without prefixItems applies from the first item on
        if ("prefixItems" in a.kw) != ("prefixItems" in b.kw):
            pa, pb = a.kw.get("prefixItems", []), b.kw.get("prefixItems", [])
            rest_a, rest_b = a.kw.get("items", True), b.kw.get("items", True)
            out.kw["prefixItems"] = [
                _conj(pa[i] if i < len(pa) else rest_a, pb[i] if i < len(pb) else rest_b)
                for i in range(max(len(pa), len(pb)))
            ]
        return out

    # -- emission ------------------------------------------------------------------------------

    def value(self, sub: Sub | bool) -> rt.Regex:
        """The regex of the JSON values valid under `sub`."""
        return self.emit(self.flat(sub))

    def emit(self, f: Flat) -> rt.Regex:
        r = self._emit(f)
        if r is not None and len(r) > MAX_REGEX_CHARS:
            raise _TooLarge
        return r

    def _emit(self, f: Flat) -> rt.Regex:
        if f.false:
            return None
        if "enum" in f.kw:
            return self._enum(f)
        if f.anyof:
            return self._any_of(f)
        for kw, path in f.unsupported:
            self._refuse(kw, path)
        if not f.kw and not f.nots:
            return self.any_value(self.options.any_depth)
        types: set[str] | None = self._types(f)
        if f.nots:
            types = self._apply_nots(f, types)  # type: ignore[arg-type]
            if types is None:
                return None
        parts: list[rt.Regex] = []
        for t in _TYPES:
            if t not in types or (t == "integer" and "number" in types):
                continue
            parts.append(getattr(self, "_" + t)(f))
        return rt.alt(parts)

    def _refuse(self, keyword: str, path: str, why: str = "") -> None:
        message = f"unsupported keyword '{keyword}' at {path}" + (f": {why}" if why else "")
        if not self.options.lenient:
            raise GrammarError(message)
        self.skipped.append(message)

    def _types(self, f: Flat) -> set[str]:
        if "type" in f.kw:
            return set(f.kw["type"])
        inferred: set[str] = set()
        keys = set(f.kw)
        if keys & _OBJECT_KW:
            inferred.add("object")
        if keys & _ARRAY_KW:
            inferred.add("array")
        if keys & _STRING_KW:
            inferred.add("string")
        if keys & _NUMBER_KW:
            inferred.add("number")
        # Without `type`, values of the other types are valid too; generating only the types the
        # keywords talk about is a (sound) narrowing. With no such keyword: any value.
        return inferred or set(_TYPES)

    # -- enum / const --------------------------------------------------------------------------

    def _enum(self, f: Flat) -> rt.Regex:
        values = f.kw["enum"]
        kept = [v for v in values if self._valid_everywhere(v, f.sources)]
        return rt.alt(self._literal(v) for v in kept)

    def _literal(self, value: Any) -> rt.Regex:
        try:
            return rt.literal_json(value)
        except (ValueError, TypeError):
            return None

    def _valid_everywhere(self, value: Any, sources: list[Loc]) -> bool:
        if self._validator is None:
            self._validator = schema_validator(self.root)
        for loc in sources:
            try:
                if not self._validator.evolve(schema=loc.schema).is_valid(value):
                    return False
            except Exception:  # unresolvable refs and the like: not provably valid
                return False
        return True

    # -- anyOf / oneOf / not -------------------------------------------------------------------

    def _any_of(self, f: Flat) -> rt.Regex:
        kind, alts, path = f.anyof[0]
        rest = Flat(
            kw=f.kw, at=f.at, sources=f.sources, anyof=f.anyof[1:], nots=f.nots,
            unsupported=f.unsupported, false=f.false,
        )  # fmt: skip
        branches = [self._merge(rest, self.flat(a)) for a in alts]
        if kind == "oneOf" and len(branches) > 1:
            alt_flats = [self.flat(a) for a in alts]
            for i, bi in enumerate(branches):
                for j, aj in enumerate(alt_flats):
                    if i != j and not bi.false and not self._excludes(bi, aj):
                        self._refuse(
                            "oneOf",
                            path,
                            f"branches {i} and {j} may both match; cannot enforce exactly one",
                        )
                        break
                else:
                    continue
                break
        return rt.alt(self.emit(b) for b in branches)

    def _excludes(self, produced: Flat, other: Flat) -> bool:
        """True when no value generated from `produced` can satisfy `other`."""
        if other.false:
            return True
        if "enum" in produced.kw:
            vals = [v for v in produced.kw["enum"] if self._valid_everywhere(v, produced.sources)]
            return not any(self._valid_everywhere(v, other.sources) for v in vals)
        declared = other.kw.get("type")
        mine = self._types(produced)
        if declared is not None and not _intersect_types(mine, declared):
            return True
        if mine <= {"object"} and "properties" in produced.kw:
            required = set(produced.kw.get("required", []))
            mine_props = produced.kw.get("properties", {})
            for name, s in other.kw.get("properties", {}).items():
                if name in required and name in mine_props:
                    a, b = self.flat(mine_props[name]), self.flat(s)
                    if "enum" in a.kw and "enum" in b.kw and self._excludes(a, b):
                        return True
            extras = self._extras_allowed(produced) or "patternProperties" in produced.kw
            if not extras:
                for name in other.kw.get("required", []):
                    if name not in mine_props:
                        return True
            # a property we always write that the other schema does not allow
            if (
                other.kw.get("additionalProperties") is False
                and "patternProperties" not in other.kw
            ):
                allowed = other.kw.get("properties", {})
                if any(name not in allowed for name in required):
                    return True
        return False

    def _apply_nots(self, f: Flat, types: set[str]) -> set[str] | None:
        for sub, path in f.nots:
            n = self.flat(sub)
            if n.false:
                continue
            keys = set(n.kw)
            if not keys and not n.anyof and not n.nots and not n.unsupported:
                return None  # not {} : nothing is valid
            if keys == {"type"} and not n.anyof and not n.nots:
                banned = n.kw["type"]
                types = {t for t in types if not _intersect_types({t}, banned)}
                if "number" in banned:
                    types.discard("integer")
                continue
            if keys == {"required"} and not n.anyof and not n.nots and len(n.kw["required"]) == 1:
                types = types & {"object"}
                f.kw.setdefault("_forbidden", set()).add(n.kw["required"][0])
                continue
            self._refuse("not", path)
        return types

    # -- scalars -------------------------------------------------------------------------------

    def _null(self, f: Flat) -> rt.Regex:
        return "null"

    def _boolean(self, f: Flat) -> rt.Regex:
        return "(?:true|false)"

    def _string(self, f: Flat) -> rt.Regex:
        kw, at = f.kw, f.at
        lo, hi = kw.get("minLength", 0), kw.get("maxLength")
        formats = [x for x in kw.get("format", []) if x in FORMATS or x in UNSUPPORTED_FORMATS]
        patterns = kw.get("pattern", [])
        for fmt in formats:
            if fmt in UNSUPPORTED_FORMATS:
                self._refuse("format", at.get("format", "#"), f"format {fmt!r} is not enforced")
                formats = [x for x in formats if x != fmt]
        if len(set(formats)) > 1:
            self._refuse("format", at.get("format", "#"), "several formats at once")
            formats = formats[:1]
        if len(patterns) > 1:
            self._refuse("pattern", at.get("pattern", "#"), "several patterns at once")
            patterns = patterns[:1]
        if patterns and formats:
            self._refuse("pattern", at.get("pattern", "#"), "together with 'format'")
            formats = []
        if patterns:
            p = patterns[0]
            if not isinstance(p, str):
                raise GrammarError(f"'pattern' at {at.get('pattern')} must be a string")
            try:
                lang = pattern_language(p)
            except PatternError as e:
                self._refuse("pattern", at.get("pattern", "#"), str(e))
                return rt.json_string(
                    rt.ANY_JSON_UNIT, lo, self._counted(lo, hi, len(rt.ANY_JSON_UNIT))
                )

            if lo <= lang.min_len and (
                hi is None or (lang.max_len is not None and lang.max_len <= hi)
            ):
                return rt.seq(rt.QUOTE, lang.regex, rt.QUOTE)
            if lang.repeated_set is not None:
                new_hi = (
                    lang.max_len
                    if hi is None
                    else hi
                    if lang.max_len is None
                    else min(hi, lang.max_len)
                )
                units = rt.json_units(lang.repeated_set)
                new_lo = max(lo, lang.min_len)
                return rt.json_string(
                    units, new_lo, self._counted(new_lo, new_hi, len(units or ""))
                )
            try:
                limited = pattern_with_length(
                    p, lo, hi, lambda a, b: self._counted(a, b, len(rt.ANY_JSON_UNIT))
                )
            except PatternError as e:
                self._refuse(
                    "maxLength" if hi is not None else "minLength",
                    at.get("minLength" if "minLength" in kw else "maxLength", "#"),
                    f"together with 'pattern': {e}",
                )
                return rt.seq(rt.QUOTE, lang.regex, rt.QUOTE)
            return rt.seq(rt.QUOTE, limited, rt.QUOTE)
        if formats:
            regex, fmin, fmax = FORMATS[formats[0]]
            if lo <= fmin and (hi is None or (fmax is not None and fmax <= hi)):
                return rt.seq(rt.QUOTE, regex, rt.QUOTE)
            self._refuse(
                "maxLength" if hi is not None else "minLength",
                at.get("format", "#"),
                f"together with format {formats[0]!r}",
            )
            return rt.seq(rt.QUOTE, regex, rt.QUOTE)
        return rt.json_string(rt.ANY_JSON_UNIT, lo, self._counted(lo, hi, len(rt.ANY_JSON_UNIT)))

    def _counted(self, lo: int, hi: int | None, unit_chars: int) -> int | None:
        """The upper count actually generated for a bounded repetition.

        outlines-core builds every automaton state eagerly, and a bound of n copies the unit n
        times: a large bound is narrowed (soundly: fewer repetitions are still valid) to what
        fits a budget, never below `lo`.
        """
        if hi is None or hi <= lo:
            return hi
        room = max(self.options.max_counted, _COUNT_BUDGET // max(unit_chars, 1))
        return min(hi, lo + room) if hi - lo > room else hi

    def _bounds(self, f: Flat) -> tuple[Any, bool, Any, bool]:
        kw = f.kw
        lo, lo_strict, hi, hi_strict = None, False, None, False
        if "minimum" in kw:
            lo = kw["minimum"]
        if "exclusiveMinimum" in kw and (lo is None or kw["exclusiveMinimum"] >= lo):
            lo, lo_strict = kw["exclusiveMinimum"], True
        if "maximum" in kw:
            hi = kw["maximum"]
        if "exclusiveMaximum" in kw and (hi is None or kw["exclusiveMaximum"] <= hi):
            hi, hi_strict = kw["exclusiveMaximum"], True
        return lo, lo_strict, hi, hi_strict

    def _integer(self, f: Flat) -> rt.Regex:
        lo, lo_strict, hi, hi_strict = self._bounds(f)
        ilo = None if lo is None else (math.floor(lo) + 1 if lo_strict else math.ceil(lo))
        ihi = None if hi is None else (math.ceil(hi) - 1 if hi_strict else math.floor(hi))
        m = f.kw.get("multipleOf")
        if (
            m is None
            or (m.denominator == 1 and m == 1)
            or (m.numerator == 1 and _power_of_two(m.denominator))
        ):
            return int_range(ilo, ihi)
        if m.denominator != 1:
            self._refuse(
                "multipleOf", f.at.get("multipleOf", "#"), "a fractional multipleOf on integers"
            )
            return int_range(ilo, ihi)
        k = int(m)
        if ilo is not None and ihi is not None and (ihi // k - (ilo + k - 1) // k) < 2000:
            start = -((-ilo) // k) * k
            return rt.alt(str(n) for n in range(start, ihi + 1, k))
        self._refuse(
            "multipleOf",
            f.at.get("multipleOf", "#"),
            "only with bounds allowing fewer than 2000 values",
        )
        return int_range(ilo, ihi)

    def _number(self, f: Flat) -> rt.Regex:
        m = f.kw.get("multipleOf")
        if m is not None:
            if m.denominator == 1:
                return self._integer(f)  # multiples of an integer are integers: a narrowing
            self._refuse(
                "multipleOf", f.at.get("multipleOf", "#"), "fractional multipleOf on numbers"
            )
        lo, lo_strict, hi, hi_strict = self._bounds(f)
        if lo is None and hi is None:
            return JSON_NUMBER
        where = f.at.get("minimum", f.at.get("maximum", "#"))
        max_frac = None
        dlo, dhi = _decimal(lo), _decimal(hi)
        for d, strict, name in (
            (dlo, lo_strict, "exclusiveMinimum"),
            (dhi, hi_strict, "exclusiveMaximum"),
        ):
            if d is None:
                continue
            if abs(d) >= _EXACT_FLOAT_LIMIT:
                self._refuse("minimum", where, "bounds beyond 2**53 on numbers")
                return JSON_NUMBER
            if strict:
                # An exclusive bound holds after float rounding only if x stays a few ulps away
                # from it: generate at most 15 significant digits around the bound.
                int_digits = len(str(int(abs(d))))
                frac_digits = max(0, -d.normalize().as_tuple().exponent)  # type: ignore[operator]
                limit = _SIGNIFICANT_DIGITS - int_digits
                if frac_digits > limit:
                    self._refuse(name, where, "too many digits for an exact exclusive bound")
                    return JSON_NUMBER
                max_frac = limit if max_frac is None else min(max_frac, limit)
        return decimal_range(dlo, lo_strict, dhi, hi_strict, max_frac)

    # -- containers ----------------------------------------------------------------------------

    def _item_sep(self) -> str:
        return self.ws + L(",") + self.ws

    def _array(self, f: Flat) -> rt.Regex:
        kw, at = f.kw, f.at
        prefix: list[Any] = kw.get("prefixItems", [])
        rest: Any = kw.get("items", True)
        if "items" not in kw and "unevaluatedItems" in kw:
            rest = kw["unevaluatedItems"]
        lo, hi = kw.get("minItems", 0), kw.get("maxItems")
        if "contains" in kw:
            self._refuse("contains", at.get("contains", "#"))
        if kw.get("uniqueItems") and not (hi is not None and hi <= 1):
            unique = self._unique_items(prefix, rest, lo, hi)
            if unique is not None:
                return unique
            self._refuse("uniqueItems", at.get("uniqueItems", "#"))
        elems = [self.value(s) for s in prefix]
        rest_regex = None if rest is False else self.value(rest)
        if rest_regex is None:
            hi = len(prefix) if hi is None else min(hi, len(prefix))
        elif hi is not None and hi > max(lo, len(prefix)):
            start = max(lo, len(prefix))
            hi = start + (self._counted(start, hi, len(rest_regex)) or hi) - start
        if hi is not None and hi < lo:
            return None
        sep = self._item_sep()

        # positions 0..len(prefix)-1 come from prefix; then `rest` repeated
        def tail(i: int) -> rt.Regex:  # elements from position i on, element i-1 emitted
            if hi is not None and i >= hi:
                return ""
            if i < len(prefix):
                with_i = rt.seq(sep, elems[i], tail(i + 1))
                return with_i if i < lo else rt.alt([with_i, ""])
            need = max(0, lo - i)
            more = None if hi is None else hi - i
            return rt.repeat(rt.seq(sep, rest_regex), need, more)

        first = elems[0] if prefix else rest_regex
        body = rt.seq(first, tail(1))
        if lo == 0:
            body = rt.alt([body, ""])
        if hi == 0:
            body = ""
        return rt.seq(L("["), self.ws, body, self.ws, L("]"))

    def _unique_items(self, prefix: list, rest: Any, lo: int, hi: int | None) -> rt.Regex:
        """uniqueItems over a finite set of item values: generate them in enum order."""
        if prefix or rest is True or rest is False:
            return None
        item = self.flat(rest)
        if "enum" in item.kw:
            values = [v for v in item.kw["enum"] if self._valid_everywhere(v, item.sources)]
        elif self._types(item) == {"boolean"} and set(item.kw) <= {"type"}:
            values = [False, True]
        else:
            return None
        distinct: list[Any] = []
        for v in values:
            if not any(_json_equal(v, d) for d in distinct):
                distinct.append(v)
        if lo > 1 or (hi is not None and hi < len(distinct)):
            return None
        literals = [self._literal(v) for v in distinct]
        body = self._ordered_subset(literals, lo >= 1)
        return rt.seq(L("["), self.ws, body, self.ws, L("]"))

    def _ordered_subset(self, items: list[rt.Regex], nonempty: bool) -> rt.Regex:
        """Items in the given order, each optional, comma-separated."""
        return self._property_list([(item, False) for item in items], None, nonempty)

    def _object(self, f: Flat) -> rt.Regex:
        kw = f.kw
        dep_req: dict[str, list[str]] = kw.get("dependentRequired", {})
        dep_sch: dict[str, Any] = kw.get("dependentSchemas", {})
        if dep_req or dep_sch:
            return self._object_dependencies(f, dep_req, dep_sch)
        return self._object_plain(f)

    def _object_dependencies(self, f: Flat, dep_req: dict, dep_sch: dict) -> rt.Regex:
        """Split on each trigger property: absent, or present with what it requires."""
        props = f.kw.get("properties", {})
        triggers = [t for t in dict.fromkeys([*dep_req, *dep_sch])]
        variants = [f]
        for t in triggers:
            nxt = []
            for v in variants:
                base = Flat(
                    kw={k: x for k, x in v.kw.items()},
                    at=v.at,
                    sources=v.sources,
                    nots=v.nots,
                    unsupported=v.unsupported,
                    false=v.false,
                )
                base.kw.pop("dependentRequired", None)
                base.kw.pop("dependentSchemas", None)
                rest_req = {k: x for k, x in v.kw.get("dependentRequired", {}).items() if k != t}
                rest_sch = {k: x for k, x in v.kw.get("dependentSchemas", {}).items() if k != t}
                if rest_req:
                    base.kw["dependentRequired"] = rest_req
                if rest_sch:
                    base.kw["dependentSchemas"] = rest_sch
                required = base.kw.get("required", [])
                # variant: t absent
                if t not in required:
                    absent = Flat(
                        kw=dict(base.kw),
                        at=base.at,
                        sources=base.sources,
                        nots=base.nots,
                        unsupported=base.unsupported,
                    )
                    absent.kw["_forbidden"] = set(base.kw.get("_forbidden", set())) | {t}
                    nxt.append(absent)
                # variant: t present (only possible if it can be generated)
                if t in props or t in required or self._extras_allowed(base):
                    present = Flat(
                        kw=dict(base.kw),
                        at=base.at,
                        sources=base.sources,
                        nots=base.nots,
                        unsupported=base.unsupported,
                    )
                    present.kw["required"] = list(
                        dict.fromkeys(required + [t] + dep_req.get(t, []))
                    )
                    if t in dep_sch:
                        present = self._merge(present, self.flat(dep_sch[t]))
                    nxt.append(present)
            variants = nxt
            if len(variants) > 16:
                self._refuse(
                    "dependentRequired",
                    f.at.get("dependentRequired", f.at.get("dependentSchemas", "#")),
                    "too many dependencies",
                )
                break
        where = f.at.get("dependentSchemas", "#")
        for v in variants:  # what a dependent schema brought besides object keywords
            for k, path in v.unsupported[len(f.unsupported) :]:
                self._refuse(k, path)
            if v.anyof or len(v.nots) > len(f.nots):
                self._refuse("dependentSchemas", where, "anyOf, oneOf or not inside it")
        return rt.alt(
            self._object_plain(v)
            if not (v.kw.get("dependentRequired") or v.kw.get("dependentSchemas"))
            else self._object(v)
            for v in variants
            if not v.false
        )

    def _extras_allowed(self, f: Flat) -> bool:
        addl = f.kw.get("additionalProperties")
        if addl is False or f.kw.get("unevaluatedProperties") is False:
            return False
        if addl is not None:
            return True
        return "properties" not in f.kw or self.options.allow_unlisted_properties

    def _object_plain(self, f: Flat) -> rt.Regex:
        kw, at = f.kw, f.at
        props: dict[str, Any] = dict(kw.get("properties", {}))
        required: list[str] = list(kw.get("required", []))
        forbidden: set[str] = set(kw.get("_forbidden", set()))
        addl = kw.get("additionalProperties")
        uneval = kw.get("unevaluatedProperties")
        patterns: dict[str, Any] = kw.get("patternProperties", {})
        names_schema = kw.get("propertyNames")
        names_flat = None if names_schema is None else self.flat(names_schema)
        if names_flat is not None and not names_flat.false and self._all_strings(names_flat):
            names_schema = names_flat = None  # every key is a string: no constraint
        lo, hi = kw.get("minProperties", 0), kw.get("maxProperties")
        if any(r in forbidden for r in required):
            return None
        compiled_patterns = {}
        for p in patterns:
            try:
                compiled_patterns[p] = re.compile(p)
            except re.error as e:
                raise GrammarError(
                    f"invalid pattern {p!r} in patternProperties at {at.get('patternProperties')}: {e}"
                ) from None

        def matching(name: str) -> list[Any]:
            return [patterns[p] for p, c in compiled_patterns.items() if c.search(name)]

        listed_names = list(props)
        # properties that must appear but are not listed take the schema extras would get
        for name in required:
            if name not in props:
                m = matching(name)
                if m:
                    props[name] = Conj(tuple(m))
                elif addl is False or (addl is None and uneval is False):
                    return None
                else:
                    props[name] = _conj(
                        addl if addl is not None else True, uneval if uneval is not None else True
                    )
        entries: list[tuple[str, Any, bool]] = []
        for name, s in props.items():
            is_required = name in required
            if name in forbidden:
                continue
            m = matching(name) if name in listed_names else []
            schema = Conj((s, *m)) if m else s
            if names_schema is not None and not self._name_allowed(name, names_schema):
                if is_required:
                    return None
                continue
            entries.append((name, schema, is_required))
        # extra keys
        extra_key: rt.Regex = None
        extra_value: Any = None
        if patterns:
            distinct = {json.dumps(_raw(s), sort_keys=True) for s in patterns.values()}
            clash = any(
                c.search(n)
                for c in compiled_patterns.values()
                for n in list(props) + list(forbidden)
            )
            if len(distinct) == 1 and not clash and names_schema is None and hi is None:
                keys = []
                for p in patterns:
                    try:
                        keys.append(rt.seq(rt.QUOTE, pattern_language(p).regex, rt.QUOTE))
                    except PatternError:
                        keys = []
                        break
                if keys:
                    extra_key, extra_value = rt.alt(keys), next(iter(patterns.values()))
        elif (
            self._extras_allowed(f)
            and hi is None
            and (names_schema is None or not (props or forbidden))
        ):
            if names_flat is None:
                extra_key = rt.string_not_in(list(props) + sorted(forbidden))
            else:  # a pure map: keys are the strings propertyNames accepts
                extra_key = self.emit(self._merge(names_flat, Flat(kw={"type": {"string"}})))
            extra_value = _conj(
                addl if addl is not None else True, uneval if uneval is not None else True
            )
        n_required = sum(1 for e in entries if e[2])
        nonempty = False
        if lo > n_required:
            if lo == 1:
                nonempty = True
            else:
                self._refuse("minProperties", at.get("minProperties", "#"))
        if hi is not None and len(entries) > hi:
            if n_required > hi:
                return None
            self._refuse("maxProperties", at.get("maxProperties", "#"))
        kv_sep = self.ws + L(":") + self.ws
        kvs = []
        for name, schema, is_required in entries:
            v = self.value(schema)
            if v is None:
                if is_required:
                    return None
                continue
            kvs.append((rt.literal_json(name), v, is_required))
        extra: rt.Regex = None
        if extra_key is not None:
            ev = self.value(extra_value)
            extra = rt.seq(extra_key, kv_sep, ev) if ev is not None else None
        items = [(rt.seq(key_regex, kv_sep, v), req) for key_regex, v, req in kvs]
        body = self._property_list(items, extra, nonempty)
        return rt.seq(L("{"), self.ws, body, self.ws, L("}"))

    def _property_list(
        self, items: list[tuple[rt.Regex, bool]], extra: rt.Regex, nonempty: bool
    ) -> rt.Regex:
        """Comma-separated properties in order (required ones always, optional ones maybe),
        then any number of extra properties.

        With a required property: items before the last required one carry a trailing comma,
        items after it a leading one.
        """
        sep = self._item_sep()
        extra_tail = rt.star(rt.seq(sep, extra)) if extra is not None else ""
        last_required = max((i for i, (_, req) in enumerate(items) if req), default=-1)
        if last_required >= 0:
            parts: list[rt.Regex] = []
            for i, (kv, req) in enumerate(items):
                if i < last_required:
                    parts.append(rt.seq(kv, sep) if req else rt.opt(rt.seq(kv, sep)))
                elif i == last_required:
                    parts.append(kv)
                else:
                    parts.append(rt.opt(rt.seq(sep, kv)))
            return rt.seq(*parts, extra_tail)

        # No required property: choose the last item written; every earlier one is optional and
        # followed by a comma. Written right to left, Y_i = KV_i | (KV_i ",")? Y_{i+1}, the text
        # stays linear, and the automaton too (both readings of KV_i advance together).
        y: rt.Regex = rt.seq(extra, extra_tail) if extra is not None else None
        for kv, _ in reversed(items):
            y = rt.alt([rt.seq(kv, extra_tail), rt.seq(rt.opt(rt.seq(kv, sep)), y)])
        return y if nonempty else rt.alt([y, ""])

    def _all_strings(self, f: Flat) -> bool:
        """Whether a flattened schema accepts every string (it says nothing about strings)."""
        if f.anyof or f.nots or f.unsupported or "enum" in f.kw:
            return False
        string_keywords = set(f.kw) & (_STRING_KW | {"type"})
        return string_keywords <= {"type"} and ("type" not in f.kw or "string" in f.kw["type"])

    def _name_allowed(self, name: str, names_schema: Any) -> bool:
        if isinstance(names_schema, bool):
            return names_schema
        return self._valid_everywhere(name, [s for s in _locs(names_schema)])

    # -- canonical key order -------------------------------------------------------------------

    def ordered(self, value: Any, sub: Any, depth: int) -> Any:
        if depth > 64 or not isinstance(value, (dict, list)):
            return value
        try:
            f = self.flat(sub)
            for _, alts, _ in f.anyof:
                for a in alts:
                    fa = self.flat(a)
                    if self._valid_everywhere(value, fa.sources):
                        f = self._merge(f, fa)
                        break
        except (GrammarError, RecursionError):
            return value
        if isinstance(value, dict):
            props = f.kw.get("properties", {})
            keys = [k for k in props if k in value] + [k for k in value if k not in props]
            addl = f.kw.get("additionalProperties", True)
            return {k: self.ordered(value[k], props.get(k, addl), depth + 1) for k in keys}
        prefix, rest = f.kw.get("prefixItems", []), f.kw.get("items", True)
        return [
            self.ordered(v, prefix[i] if i < len(prefix) else rest, depth + 1)
            for i, v in enumerate(value)
        ]

    # -- unconstrained values ------------------------------------------------------------------

    def any_value(self, depth: int) -> str:
        scalar = "|".join(
            [rt.json_string(rt.ANY_JSON_UNIT), JSON_NUMBER, "true", "false", "null"]  # type: ignore[list-item]
        )
        if depth <= 0:
            return f"(?:{scalar})"
        inner = self.any_value(depth - 1)
        sep, kv_sep = self._item_sep(), self.ws + L(":") + self.ws
        kv = rt.json_string(rt.ANY_JSON_UNIT) + kv_sep + inner  # type: ignore[operator]
        array = f"{L('[')}{self.ws}(?:{inner}(?:{sep}{inner})*)?{self.ws}{L(']')}"
        obj = f"{L('{')}{self.ws}(?:{kv}(?:{sep}{kv})*)?{self.ws}{L('}')}"
        return f"(?:{scalar}|{array}|{obj})"


def _raw(s: Any) -> Any:
    if isinstance(s, Loc):
        return s.schema
    if isinstance(s, Conj):
        return [_raw(p) for p in s.parts]
    return s


def _locs(s: Any) -> list[Loc]:
    if isinstance(s, Loc):
        return [s]
    if isinstance(s, Conj):
        return [x for p in s.parts for x in _locs(p)]
    return []


_EVALUATING = frozenset(
    {"properties", "patternProperties", "additionalProperties", "dependentSchemas",
     "prefixItems", "items", "contains", "unevaluatedProperties", "unevaluatedItems"}
)  # fmt: skip


def _unevaluated(f: Flat) -> str | None:
    """The unevaluatedProperties / unevaluatedItems keyword `f` constrains, if any."""
    for k in ("unevaluatedProperties", "unevaluatedItems"):
        if f.kw.get(k, True) is not True:
            return k
    return None


def _evaluates(f: Flat) -> bool:
    return bool(_EVALUATING.intersection(f.kw)) or bool(f.anyof)


def _conj(a: Any, b: Any) -> Any:
    if a is True or a is None:
        return b
    if b is True or b is None:
        return a
    if a is False or b is False:
        return False
    return Conj((a, b))


def _schema_list(v: Any, at: str) -> list:
    if not isinstance(v, list) or not v:
        raise GrammarError(f"{at} must be a non-empty array of schemas")
    return v


def _number(v: Any, path: str, k: str) -> Fraction:
    if (
        isinstance(v, bool)
        or not isinstance(v, (int, float))
        or (isinstance(v, float) and not math.isfinite(v))
    ):
        raise GrammarError(f"'{k}' at {path} must be a number")
    return Fraction(v)


def _decimal(v: Fraction | None) -> Decimal | None:
    """The shortest decimal that reads back as the same double (what a validator compares with)."""
    if v is None:
        return None
    if v.denominator == 1:
        return Decimal(int(v))
    return Decimal(repr(float(v)))


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _intersect_types(a: set[str], b: set[str]) -> set[str]:
    out = a & b
    if "integer" in a and "number" in b or "number" in a and "integer" in b:
        out.add("integer")
    return out


def _json_equal(x: Any, y: Any) -> bool:
    """JSON equality as validators see it: 1 == 1.0, but true != 1."""
    if isinstance(x, bool) or isinstance(y, bool):
        return isinstance(x, bool) and isinstance(y, bool) and x == y
    if isinstance(x, (int, float)) and isinstance(y, (int, float)):
        return x == y
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(_json_equal(a, b) for a, b in zip(x, y, strict=True))
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_json_equal(x[k], y[k]) for k in x)
    return type(x) is type(y) and x == y
