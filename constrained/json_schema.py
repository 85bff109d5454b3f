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
from radixlm.constrained.schema_rewrite import iter_subschemas, schema_nodes

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
    cls = _validator_class(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def _validator_class(schema: Any) -> Any:
    import jsonschema
    from jsonschema.validators import validator_for

    default = jsonschema.Draft202012Validator
    if isinstance(schema, dict) and "$schema" not in schema and _uses_item_arrays(schema):
        default = jsonschema.Draft201909Validator
    return validator_for(schema, default=default)


_OLD_DRAFT = re.compile(r"draft-0[3467]\b")
# keywords under which a wider subschema makes a narrower schema: where they are, a oneOf read
# as anyOf (or a format left unchecked) widens nothing for sure
_NARROWING = frozenset({"not", "if", "maxContains"})


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


def one_of_exclusivity(schema: Any, narrowed: Any = None) -> dict[str, str | None]:
    """Each `oneOf` of `schema` (by JSON pointer, in schema order) -> None where no value of one
    branch (with what surrounds the oneOf) satisfies another, so that "exactly one" is "at least
    one" and an `anyOf` of the same branches is the same schema; else why not (as a refusal says
    it). For a generator that is not ours: the proof reads every value a schema accepts, not
    only those our regex generates. narrowed: what is generated instead of `schema`, where a
    rewrite narrowed it (closed objects: the same pointers, with keywords added); its values
    must then each satisfy one branch of `schema`, as written: narrowing a oneOf's branches can
    make them exclusive without making its values valid."""
    out: dict[str, str | None] = {}
    if not isinstance(schema, dict):
        return out
    if not any("oneOf" in node for node in schema_nodes(schema)):  # (most: no pointers made)
        return out
    places = [where for where, node in iter_subschemas(schema) if "oneOf" in node]
    if any("oneOf" in ref for ref in _refs(schema)):  # renaming it would move what they name
        return {where: "a $ref points inside a oneOf" for where in places}
    options = JsonSchemaOptions(allow_unlisted_properties=True)
    written = _SchemaCompiler(schema, options, accepted=True)
    generated = written if narrowed is None else _SchemaCompiler(narrowed, options, accepted=True)
    generated.theirs = written
    for where in places:
        try:
            out[where] = generated.one_of_overlap(where)
        except (GrammarError, RecursionError, LookupError) as e:
            out[where] = f"cannot tell whether branches overlap ({e})"
    return out


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
    false: bool = False  # no value satisfies it (or `cut`: none within the unrolled depth)
    cut: bool = False  # a recursive $ref was cut off at max_ref_depth (as false) in it


def _pointer(path: str, *parts: Any) -> str:
    return path + "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


class _SchemaCompiler:
    """A schema's regex (`value`), and the reasoning it rests on. accepted: what `_excludes`
    reasons about is every value a schema accepts (for a generator other than ours, which may
    write any of them), not the narrower set this compiler generates."""

    def __init__(self, root: Any, options: JsonSchemaOptions, *, accepted: bool = False) -> None:
        self.root = root
        self.options = options
        self.accepted = accepted
        # who reads the schemas whose values `_excludes` rules out (`other`): another compiler
        # where the values come from a narrowed copy of the schema (one_of_exclusivity)
        self.theirs = self
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
        self._readings: dict[str, Any] = {}  # the validators of _check, by reading
        # drafts 3 to 7 ignore the keywords beside a $ref (the accepted view reads them so; a
        # `$schema` naming another draft, or none, reads them all: wider is what it may be)
        self._ref_alone = accepted and isinstance(draft, str) and bool(_OLD_DRAFT.search(draft))
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
        keywords = schema.items()
        if self._ref_alone and "$ref" in schema:
            keywords = [("$ref", schema["$ref"])]
        for k, v in keywords:
            if k in ANNOTATIONS or k not in KEYWORDS:
                continue
            at = _pointer(path, k)
            if k == "$ref":
                if not isinstance(v, str):
                    raise GrammarError(f"$ref at {path} must be a string")
                target = self._resolve(v, here)
                if target.refs.count(target.refs[-1]) > self.options.max_ref_depth:
                    # recursion unrolled as deep as allowed
                    parts.append(Flat(false=True, cut=True))
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
            cut=a.cut or b.cut,
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
        # (unresolvable refs and the like: not provably valid)
        return self._check("exact", value, sources) is True

    # -- anyOf / oneOf / not -------------------------------------------------------------------

    def _any_of(self, f: Flat) -> rt.Regex:
        kind, alts, path = f.anyof[0]
        rest = Flat(
            kw=f.kw, at=f.at, sources=f.sources, anyof=f.anyof[1:], nots=f.nots,
            unsupported=f.unsupported, false=f.false, cut=f.cut,
        )  # fmt: skip
        branches = [self._merge(rest, self.flat(a)) for a in alts]
        if kind == "oneOf":
            overlap = self._overlap(branches, alts)
            if overlap is not None:
                self._refuse("oneOf", path, _overlap_reason(overlap))
        return rt.alt(self.emit(b) for b in branches)

    def one_of_overlap(self, where: str) -> str | None:
        """Why the branches of the oneOf of the subschema at the JSON pointer `where` may
        overlap, or None: no value of one (as this compiler reads its root) satisfies another
        (as `theirs` reads its own)."""
        mine, f = self._one_of_at(where)
        theirs, _ = self.theirs._one_of_at(where)
        if mine is None or theirs is None:  # drafts 3 to 7 read a $ref alone, not beside it
            return "beside a $ref (the schema's draft reads the $ref alone)"
        rest = Flat(
            kw=f.kw, at=f.at, sources=f.sources, nots=f.nots, unsupported=f.unsupported,
            false=f.false, cut=f.cut,
        )  # fmt: skip
        overlap = self._overlap([self._merge(rest, self.flat(a)) for a in mine], theirs)
        return None if overlap is None else _overlap_reason(overlap)

    def _one_of_at(self, where: str) -> tuple[list[Sub] | None, Flat]:
        """The branches of the oneOf of the subschema at `where` (None if it is not read), and
        that subschema flattened."""
        node, base = self._node_at(where)
        f = self._flat_loc(Loc(node, where, base))
        at = _pointer(where, "oneOf")
        return next((alts for kind, alts, path in f.anyof if path == at), None), f

    def _node_at(self, where: str) -> tuple[Any, str]:
        """The subschema at the JSON pointer `where`, and its base URI (its enclosing $ids)."""
        node, base = self.root, self.root_base
        for part in where.split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            node = node[int(part)] if isinstance(node, list) else node[part]
            ident = node.get(self.id_keys[0]) if isinstance(node, dict) else None
            if not isinstance(ident, str) and isinstance(node, dict):
                ident = node.get(self.id_keys[-1])
            if isinstance(ident, str) and not ident.startswith("#"):
                base = urldefrag(urljoin(base, ident))[0]
        return node, base

    def _overlap(self, branches: list[Flat], alts: list[Sub]) -> tuple[int, int] | None:
        """Two oneOf branches (i, j) that may both match a value of branch i (`branches[i]`:
        the i-th of `alts` with what surrounds the oneOf), or None: exactly one matches."""
        if len(branches) < 2:
            return None
        alt_flats = [self.theirs.flat(a) for a in alts]
        for i, bi in enumerate(branches):
            if self._unsatisfiable(bi, produced=True):
                continue
            for j, aj in enumerate(alt_flats):
                if i != j and not self._excludes(bi, aj):
                    return i, j
        return None

    def _unsatisfiable(self, f: Flat, produced: bool = False) -> bool:
        """No value satisfies `f`; or (`produced`, not the accepted view) this compiler
        generates none: where recursion was cut off, only the generated values are none."""
        return f.false and not (f.cut and (self.accepted or not produced))

    def _excludes(self, produced: Flat, other: Flat, depth: int = 0) -> bool:
        """True when no value of `produced` can satisfy `other`: of the values this compiler
        generates from it, or (accepted view) of all the values it accepts."""
        if self._unsatisfiable(other):
            return True
        # the cheap proofs first: types, then values
        mine = self._produced_types(produced)
        if not _intersect_types(mine, _accepted_types(other)):
            return True
        if "enum" in produced.kw and "enum" in other.kw:
            values = other.kw["enum"]
            if not any(_json_equal(x, y) for x in produced.kw["enum"] for y in values):
                return True
        if "enum" in produced.kw:
            if self.accepted:
                vals = [
                    v
                    for v in produced.kw["enum"]
                    if self._check("wide", v, produced.sources) is not False
                ]
                theirs = self.theirs
                if all(theirs._check("plain", v, other.sources) is False for v in vals):
                    return True
            else:
                vals = [
                    v for v in produced.kw["enum"] if self._valid_everywhere(v, produced.sources)
                ]
                if all(self._check("exact", v, other.sources) is False for v in vals):
                    return True
        # `other` allows a few values, none of them one of `produced` (read widely: a value
        # generated from it satisfies it read so; not where lenient mode generates more)
        if (
            "enum" in other.kw
            and (self.accepted or not self.options.lenient)
            and all(self._check("wide", v, produced.sources) is False for v in other.kw["enum"])
        ):
            return True
        if mine <= {"object"} and "properties" in produced.kw:
            required = set(produced.kw.get("required", []))
            mine_props = produced.kw.get("properties", {})
            if depth < _EXCLUDES_DEPTH:
                # a property we always write whose values the other schema's refuse
                for name, s in other.kw.get("properties", {}).items():
                    if name in required and name in mine_props:
                        a, b = self.flat(mine_props[name]), self.theirs.flat(s)
                        if self._excludes(a, b, depth + 1):
                            return True
            if not self._produced_extras(produced):
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

    def _produced_types(self, f: Flat) -> set[str]:
        if self.accepted or "enum" in f.kw:
            return _accepted_types(f)
        return self._types(f)

    def _produced_extras(self, f: Flat) -> bool:
        """Whether a value of `f` may carry keys `f`'s properties do not list."""
        if "patternProperties" in f.kw:
            return True
        if self.accepted:
            return f.kw.get("additionalProperties") is not False
        return self._extras_allowed(f)

    def _check(self, reading: str, value: Any, sources: list[Loc]) -> bool | None:
        """Whether `value` satisfies each of `sources` as `reading` reads the schema: "exact" as
        the output check does; "plain" with formats as annotations; "wide" also with every
        oneOf read as anyOf (a superset of what any sound generator writes from them). None
        where it cannot be told (a reference that does not resolve; plain or wide readings
        where `not`, `if` or `maxContains` could turn a wider part into a narrower whole)."""
        validator = self._reading(reading)
        if validator is None:
            return None
        try:
            return all(validator.evolve(schema=loc.schema).is_valid(value) for loc in sources)
        except Exception:
            return None

    def _reading(self, reading: str) -> Any:
        if reading not in self._readings:
            if reading == "exact":
                self._readings[reading] = schema_validator(self.root)
            elif _has_key(self.root, _NARROWING):
                self._readings[reading] = None
            else:
                from jsonschema.validators import extend

                cls = _validator_class(self.root)
                if reading == "wide":
                    cls = extend(cls, {"oneOf": cls.VALIDATORS["anyOf"]})
                self._readings[reading] = cls(self.root)
        return self._readings[reading]

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
        return rt.ordered_items(items, self._item_sep(), extra, nonempty)

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


def _overlap_reason(overlap: tuple[int, int]) -> str:
    i, j = overlap
    return f"branches {i} and {j} may both match; cannot enforce exactly one"


_DATA = ("enum", "const", "default", "examples")
_EXCLUDES_DEPTH = 4  # how deep _excludes looks into the properties of properties


def _accepted_types(f: Flat) -> set[str]:
    """The JSON types of the values `f` accepts, as far as its `enum` and `type` tell (the
    keywords of other types say nothing of a value of this one)."""
    if "enum" in f.kw:
        return {_json_type(v) for v in f.kw["enum"]}
    return set(f.kw["type"]) if "type" in f.kw else set(_TYPES)


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or isinstance(value, float) and value.is_integer():
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object" if isinstance(value, dict) else "null"


def _has_key(node: Any, keys: frozenset[str]) -> bool:
    """Whether any object in `node` (data values aside) has one of `keys`."""
    if isinstance(node, dict):
        return any(k in keys for k in node) or any(
            _has_key(v, keys) for k, v in node.items() if k not in _DATA
        )
    if isinstance(node, list):
        return any(_has_key(v, keys) for v in node)
    return False


def _refs(node: Any) -> list[str]:
    """The $ref strings of `node`."""
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [r for k, v in node.items() if k not in _DATA for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


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
