"""Rewrites of a JSON schema before it is compiled: what the engine adds to a user's schema so
that the output is usable, never narrower than the schema's own bounds.

- Numbers the schema leaves unbounded are held to what JSON consumers read: integers within
  +-10**18 (inside 64 bits), other numbers within +-10**15 (inside a double's exact integers),
  written without exponent and with at most `fraction_digits` digits after the point. A greedy
  small model otherwise writes `"population":1000000000...` until max_new_tokens runs out.
- Objects that list `properties` and say nothing of other keys get `additionalProperties: false`
  unless unlisted properties are allowed (a model fills an open object with made-up keys).
- For llguidance, which reads bounds as doubles, a bound past 64 bits is brought to the widest
  it reads, and an integer bound past 2**53 to the nearest double inside it, inclusive
  (`fit_bounds`): the one rewrite narrower than the schema, and only there.
- For llguidance, which refuses a `oneOf` whose branches it cannot itself tell apart, a `oneOf`
  whose branches are proven to exclude each other (json_schema.one_of_exclusivity) is written as
  the `anyOf` it then equals (`one_of_as_any_of`): the same schema, never a looser one. Closing
  objects narrows a oneOf's branches, which can make them exclusive without making the values
  valid (a value of one closed branch may still match another branch as written): the proof
  reads the values of the closed branches against the branches as written.
- For llguidance, alike bounded numbers, alike strings with string keywords and alike enums
  point to one copy (`share_leaves`), built once.

The finished output is still validated against the schema as the user wrote it.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

# keywords whose value is one schema, a list of schemas, or a name -> schema map
_ONE = frozenset(
    {"additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames",
     "unevaluatedItems", "unevaluatedProperties", "additionalItems"}
)  # fmt: skip
_LIST = frozenset({"anyOf", "allOf", "oneOf", "prefixItems", "items"})
_OPEN_KEYS = (
    "additionalProperties", "unevaluatedProperties", "patternProperties", "allOf", "anyOf",
    "oneOf", "$ref", "if", "dependentSchemas", "dependencies",
)  # fmt: skip
# keywords whose value maps names to subschemas (a name there is not a keyword)
NAMED_SUBSCHEMAS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)


@dataclass(frozen=True)
class NumberLimits:
    """How many digits a number whose schema sets no bounds may have: integer_digits before the
    point (integers and other numbers alike; 0: any), fraction_digits after it (-1: any),
    exponent_digits (0: no exponent, -1: any). 18 keep integers within 64 bits. Written into a
    schema (`bound_numbers`) they are bounds of +-(10**integer_digits - 1) (+-10**15 at most on
    other numbers: what a double holds exactly, all the outlines backend reads), a `multipleOf`
    of 10**-fraction_digits, and no exponent; the llguidance backend holds them in the mask
    instead (number_digits.py)."""

    integer_digits: int = 18
    fraction_digits: int = 10
    exponent_digits: int = 2

    def __post_init__(self) -> None:
        if self.integer_digits < 0 or self.fraction_digits < -1 or self.exponent_digits < -1:
            raise ValueError(
                "number limits: integer_digits must be >= 0 (0: any), fraction_digits and "
                "exponent_digits >= -1 (-1: any)"
            )

    @property
    def bound(self) -> int:
        """The bound an integer's schema gets: |integer| <= this (0: none)."""
        return 10**self.integer_digits - 1 if self.integer_digits else 0

    @property
    def number_bound(self) -> int:
        """The bound another number's schema gets (0: none)."""
        return min(self.bound, 10**15) if self.integer_digits else 0


def map_subschemas(
    schema: Any,
    fn: Callable[[dict[str, Any], str], dict[str, Any]],
    where: str = "",
    note: Callable[[Any, Any, str], None] | None = None,
) -> Any:
    """A copy of `schema` with `fn(node, where)` applied to every (sub)schema object, innermost
    first; `where` is the keyword the node hangs under ("" at the root). With `note`,
    `note(container, key, where)` is told of each subschema's slot in the copy once its subtree
    is done (the container is a node, or the map or list under one of its keywords)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key, value in schema.items():  # (a node's own keys: fewer than the keywords)
        if isinstance(value, dict):
            if key in _ONE:
                out[key] = map_subschemas(value, fn, key, note)
                if note is not None:
                    note(out, key, key)
            elif key in NAMED_SUBSCHEMAS:
                out[key] = named = {}
                for name, sub in value.items():
                    named[name] = map_subschemas(sub, fn, key, note)
                    if note is not None:
                        note(named, name, key)
        elif isinstance(value, list) and key in _LIST:
            out[key] = listed = []
            for sub in value:
                listed.append(map_subschemas(sub, fn, key, note))
                if note is not None:
                    note(listed, len(listed) - 1, key)
    return fn(out, where)


def _child_schemas(node: dict[str, Any]) -> Iterator[tuple[str, Any, Any]]:
    """(keyword, index or name or None, subschema) of each subschema directly in `node`, in the
    order written: what iter_subschemas and schema_nodes enter."""
    for key, value in node.items():
        if isinstance(value, dict):
            if key in _ONE:
                yield key, None, value
            elif key in NAMED_SUBSCHEMAS or key == "dependencies":
                for name, sub in value.items():
                    yield key, name, sub
        elif isinstance(value, list) and key in _LIST:
            for i, sub in enumerate(value):
                yield key, i, sub


def schema_nodes(schema: Any) -> list[dict[str, Any]]:
    """Every (sub)schema object of `schema` that iter_subschemas yields, the root first, without
    making their pointers."""
    out, todo = [], [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            out.append(node)
            todo.extend(sub for _, _, sub in _child_schemas(node))
    return out


def iter_subschemas(schema: Any, pointer: str = "#") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every (sub)schema object of `schema` with its JSON pointer ("#", "#/properties/a", ...),
    parents first and in the order the schema is written; values of `enum`, `const`,
    `default` and the like are data, not schemas, and are not entered."""
    if not isinstance(schema, dict):
        return
    yield pointer, schema
    for key, at, sub in _child_schemas(schema):
        where = f"{pointer}/{_pointer_token(key)}"
        if at is not None:
            where += f"/{at}" if isinstance(at, int) else f"/{_pointer_token(at)}"
        yield from iter_subschemas(sub, where)


def reachable_subschemas(schema: Any) -> set[str] | None:
    """The JSON pointers of the subschemas of `schema` that a value is checked against: from
    the root through the keywords that hold subschemas and local `$ref`s ("#/..."), and into
    `$defs`/`definitions` only so. None where that cannot be told (a `$ref` of another form, an
    `$id` below the root): any may be."""
    seen: set[str] = set()
    todo: list[tuple[str, Any]] = [("#", schema)]
    while todo:
        where, node = todo.pop()
        if where in seen or not isinstance(node, dict):
            continue
        seen.add(where)
        if where != "#" and ("$id" in node or "$dynamicRef" in node or "$recursiveRef" in node):
            return None
        for key, value in node.items():
            at = f"{where}/{_pointer_token(key)}"
            if key == "$ref":
                target = _local_target(schema, value)
                if target is None:
                    return None
                todo.append(target)
            elif key in _ONE and isinstance(value, dict):
                todo.append((at, value))
            elif key in _LIST and isinstance(value, list):
                todo += [(f"{at}/{i}", sub) for i, sub in enumerate(value)]
            elif key in _APPLIED_MAP and isinstance(value, dict):
                todo += [(f"{at}/{_pointer_token(name)}", sub) for name, sub in value.items()]
    return seen


_APPLIED_MAP = ("properties", "patternProperties", "dependentSchemas", "dependencies")


def _local_target(schema: Any, ref: Any) -> tuple[str, Any] | None:
    """(pointer, subschema) that a local `$ref` ("#", "#/$defs/a") names; None if another."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    node, where = schema, "#"
    for token in unquote(ref[2:]).split("/") if ref != "#" else []:
        key = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
        where = f"{where}/{_pointer_token(key)}"
    return where, node


def _pointer_token(key: str) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


def bound_numbers(schema: Any, limits: NumberLimits, fit: tuple[int, int] | None = None) -> Any:
    """`schema` with the limits put on each integer or number schema that lacks its own; with
    `fit` (integer_limit, number_limit), what `fit_bounds` does too, in the same pass."""
    return map_subschemas(schema, lambda node, _: _bound_node(node, limits, fit))


def _bound_node(
    node: dict[str, Any], limits: NumberLimits, fit: tuple[int, int] | None
) -> dict[str, Any]:
    types = node.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    if "number" in types:
        _add_bounds(node, limits.number_bound)
        if limits.fraction_digits >= 0 and "multipleOf" not in node and "integer" not in types:
            node["multipleOf"] = float(f"1e-{limits.fraction_digits}")
        if fit is not None:
            _fit(node, fit[1])
    elif "integer" in types:
        _add_bounds(node, limits.bound)
        if fit is not None:
            _fit(node, fit[0])
    return node


def prepare_schema(
    schema: Any, close: bool, limits: NumberLimits, fit: tuple[int, int] | None = None
) -> Any | None:
    """`share_leaves(bound_numbers(close_objects(schema)))` (without `close_objects` where not
    `close`) in one copying pass and, where leaves are shared, one more in place: a schema is
    prepared in a compile thread, holding the GIL, while the engine and the other compiles wait
    for it. None where the schema has a `oneOf` (one_of_as_any_of rewrites those between the
    closing and the bounds) or `dependencies` (whose subschemas this walk does not enter, and
    one_of_exclusivity does)."""
    if not isinstance(schema, dict):
        return schema
    parts: dict[int, tuple[str | None, dict[str, Any], dict[str, Any] | None]] = {}
    counts: Counter = Counter()
    seen = {"oneOf": False, "ids": False}
    # (container, key or index, keyword, node) of each leaf that may be shared, innermost first:
    # the sharing then visits these slots alone instead of walking the schema again
    slots: list[tuple[Any, Any, str, dict[str, Any]]] = []

    def prepare(node: dict[str, Any], where: str) -> dict[str, Any]:
        if "oneOf" in node or "dependencies" in node:
            seen["oneOf"] = True
        if close:
            _close_node(node, where)
        _bound_node(node, limits, fit)
        if where:  # (the root is never shared)
            if "$id" in node or "id" in node:
                seen["ids"] = True
            part = parts[id(node)] = _leaf_part(node)
            counts[part[0]] += 1
        return node

    def slot(container: Any, key: Any, where: str) -> None:
        sub = container[key]
        if isinstance(sub, dict) and parts[id(sub)][0] is not None:
            slots.append((container, key, where, sub))

    prepared = map_subschemas(schema, prepare, note=slot)
    if seen["oneOf"]:
        return None
    if seen["ids"] or not isinstance(prepared.get("$defs", {}), dict):
        return share_leaves(prepared, counts)  # (identifiers first: the general way)
    return _share_slots(prepared, slots, parts, counts)


def _share_slots(
    schema: dict[str, Any],
    slots: list[tuple[Any, Any, str, dict[str, Any]]],
    parts: dict[int, tuple[str | None, dict[str, Any], dict[str, Any] | None]],
    counts: Counter,
) -> dict[str, Any]:
    """_share_in_place's sharing, where `slots` (container, key, keyword, node) are already
    known: every leaf that may be shared, innermost first, as the walk meets them."""
    shared = {text for text, n in counts.items() if text is not None and n >= 2}
    if not shared:
        return schema
    share = _Sharer(schema.get("$defs", {}), parts, shared)
    for container, key, where, node in slots:
        container[key] = share.replace(node, where)
    schema["$defs"] = {**share.defs, **share.made}
    return schema


def _share_in_place(
    schema: dict[str, Any],
    parts: dict[int, tuple[str | None, dict[str, Any], dict[str, Any] | None]],
    counts: Counter,
) -> dict[str, Any]:
    """share_leaves' sharing, done in `schema` itself (a copy of the caller's, map_subschemas'
    nodes): `parts` holds each node's _leaf_part by id, `counts` how often each leaf occurs."""
    shared = {text for text, n in counts.items() if text is not None and n >= 2}
    if not shared:
        return schema
    share = _Sharer(schema.get("$defs", {}), parts, shared)
    _replace_subschemas(schema, share.replace)
    schema["$defs"] = {**share.defs, **share.made}
    return schema


class _Sharer:
    """What a shared leaf becomes: a `$ref` to its one copy, made in `made` (the `$defs` to
    add once the walk is done, which walks `defs` too) under a name not among `defs`."""

    def __init__(
        self,
        defs: dict[str, Any],
        parts: dict[int, tuple[str | None, dict[str, Any], dict[str, Any] | None]],
        shared: set[str],
    ) -> None:
        self.defs, self.parts, self.shared = defs, parts, shared
        self.names = (f"radixlm-shared-{i}" for i in itertools.count())
        self.refs: dict[str, dict[str, Any]] = {}
        self.made: dict[str, dict[str, Any]] = {}

    def replace(self, node: Any, where: str) -> Any:
        part = self.parts.get(id(node)) if isinstance(node, dict) else None
        # (a oneOf's branch keeps its own keywords: llguidance tells the branches apart by them)
        if part is None or part[0] not in self.shared or where == "oneOf":
            return node
        text, body, rest = part
        if text not in self.refs:
            name = next(n for n in self.names if n not in self.defs)
            self.refs[text] = {"$ref": f"#/$defs/{name}"}
            self.made[name] = body
        if rest is None:
            return dict(self.refs[text])
        notes = {k: v for k, v in node.items() if _is_annotation(k, v)}
        return {"anyOf": [dict(self.refs[text]), rest], **notes}


def _replace_subschemas(node: Any, fn: Callable[[Any, str], Any]) -> None:
    """In place, each subschema slot below `node` := fn(subschema, keyword it hangs under),
    innermost first (the nodes map_subschemas enters; `node` itself is not replaced)."""
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if isinstance(value, dict):
            if key in _ONE:
                _replace_subschemas(value, fn)
                node[key] = fn(value, key)
            elif key in NAMED_SUBSCHEMAS:
                for name, sub in value.items():
                    _replace_subschemas(sub, fn)
                    value[name] = fn(sub, key)
        elif isinstance(value, list) and key in _LIST:
            for i, sub in enumerate(value):
                _replace_subschemas(sub, fn)
                value[i] = fn(sub, key)


def _add_bounds(node: dict[str, Any], bound: int) -> None:
    if not bound or "enum" in node or "const" in node:
        return
    if "minimum" not in node and "exclusiveMinimum" not in node:
        node["minimum"] = -bound
    if "maximum" not in node and "exclusiveMaximum" not in node:
        node["maximum"] = bound


def fit_bounds(schema: Any, integer_limit: int, number_limit: int) -> Any:
    """`schema` with each bound past +-`integer_limit` (integers) or +-`number_limit` (other
    numbers) brought to that limit: for a compiler that reads bounds as 64-bit numbers
    (llguidance refuses a minimum of -10**19 and narrows a maximum of 10**20 to 2**63-1 itself).
    The one place a rewrite may be narrower than the schema, and only past 64 bits."""

    def fit(node: dict[str, Any], _where: str) -> dict[str, Any]:
        types = node.get("type")
        types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
        if "number" in types:
            _fit(node, number_limit)
        elif "integer" in types:
            _fit(node, integer_limit)
        return node

    return map_subschemas(schema, fit)


def _fit(node: dict[str, Any], limit: int) -> None:
    for inclusive, exclusive, sign in (
        ("minimum", "exclusiveMinimum", -1),
        ("maximum", "exclusiveMaximum", 1),
    ):
        past = [
            k for k in (inclusive, exclusive) if _is_number(node.get(k)) and node[k] * sign > limit
        ]
        for key in past:
            del node[key]
        if past and inclusive not in node and exclusive not in node:
            node[inclusive] = sign * limit
        _inexact_bound_inward(node, inclusive, exclusive, sign)


def _inexact_bound_inward(node: dict[str, Any], inclusive: str, exclusive: str, sign: int) -> None:
    """An integer bound past 2**53, which a reader of doubles rounds to a neighbour (llguidance
    then allowed 2**53 under `minimum: 2**53 + 1`, and an exclusive bound's own value), made an
    inclusive bound on a double inside it: the nearest double at or above a lower bound (sign
    -1; plus one if exclusive), at or below an upper one (sign 1; less one). Narrower than the
    schema by the integers between, never wider."""
    for key in (inclusive, exclusive):
        value = node.get(key)
        if not (isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**53):
            continue
        if key == exclusive:
            value -= sign  # (x > m is x >= m + 1 for integers; x < m is x <= m - 1)
        near = int(float(value))
        if near * sign > value * sign:  # rounded outside the range: the next double inward
            near = int(math.nextafter(float(near), -sign * math.inf))
        del node[key]
        other = node.get(inclusive)
        # (both bounds given: the tighter)
        node[inclusive] = near if not _is_number(other) else min(near * sign, other * sign) * sign


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def one_of_as_any_of(schema: Any, exclusive: Iterable[str]) -> Any:
    """A copy of `schema` with the `oneOf` of the subschema at each JSON pointer of `exclusive`
    ("#/properties/a") written as `anyOf`: the same schema where those branches exclude each
    other. A subschema with an `anyOf` of its own gets the branches as one more `allOf` part."""

    def rename(node: dict[str, Any]) -> dict[str, Any]:
        node = dict(node)
        branches = node.pop("oneOf")
        if "anyOf" in node:
            node["allOf"] = [*node.get("allOf", []), {"anyOf": branches}]
        else:
            node["anyOf"] = branches
        return node

    # the deepest first: renaming a oneOf moves the pointers of what is inside it
    for where in sorted(exclusive, key=lambda w: -w.count("/")):
        schema = _replaced(schema, where.split("/")[1:], rename)
    return schema


def _replaced(node: Any, path: list[str], fn: Callable[[Any], Any]) -> Any:
    """A copy of `node` with `fn` applied to what the JSON pointer tokens `path` name in it."""
    if not path:
        return fn(node)
    key: Any = path[0].replace("~1", "/").replace("~0", "~")
    copy: Any = list(node) if isinstance(node, list) else dict(node)
    if isinstance(copy, list):
        key = int(key)
    copy[key] = _replaced(copy[key], path[1:], fn)
    return copy


_NUMBER_KEYS = frozenset(
    {"type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
)
_BOUND_KEYS = _NUMBER_KEYS - {"type"}
# the keywords that assert or that change how others read; any other key of a schema is an
# annotation (JSON Schema ignores unknown keywords), but for llguidance's own `x-` extensions
_KEYWORDS = frozenset(
    {"type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum",
     "exclusiveMinimum", "maxLength", "minLength", "pattern", "format", "contentEncoding",
     "contentMediaType", "contentSchema", "items", "prefixItems", "additionalItems", "contains",
     "maxItems", "minItems", "uniqueItems", "maxContains", "minContains", "maxProperties",
     "minProperties", "required", "properties", "patternProperties", "additionalProperties",
     "dependentRequired", "dependentSchemas", "dependencies", "propertyNames", "allOf", "anyOf",
     "oneOf", "not", "if", "then", "else", "$ref", "$dynamicRef", "$recursiveRef",
     "unevaluatedItems", "unevaluatedProperties", "$id", "id", "$schema", "$anchor",
     "$dynamicAnchor", "$recursiveAnchor", "$defs", "definitions", "$vocabulary"}
)  # fmt: skip


def _is_annotation(key: str, value: Any = None) -> bool:
    """An annotation: a key no keyword reads. An unknown key holding an object or a list is not
    counted one (a `$ref` may point into it, to a schema kept there)."""
    if key in _ANNOTATIONS:
        return True
    return key not in _KEYWORDS and not key.startswith("x-") and not isinstance(value, (dict, list))


_ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
     "writeOnly"}
)  # fmt: skip


# what the other types of a type list may carry beside a number's keywords: string keywords
# (`format` asserts on strings only: on a number it is an annotation)
_STRING_KEYS = frozenset({"format", "minLength", "maxLength", "pattern"})
_NUMERIC_TYPES = ("integer", "number")
_LEAF_KEYS = _BOUND_KEYS | _STRING_KEYS | {"enum"}
# enums of this many values and more are shared where alike (llguidance builds each place's
# alternatives anew: a schema with the 251 country codes three times spent ~1 ms on the copies)
_SHARED_ENUM = 4
# a leaf's keywords as text, the key alike leaves share (one encoder: json.dumps with options
# makes one per call)
_KEY = json.JSONEncoder(sort_keys=True)


def share_leaves(schema: Any, counts: Counter | None = None) -> Any:
    """`schema` with the leaf subschemas llguidance builds a costly lexeme for, where two or more
    are alike, replaced by a `$ref` to one copy in the root's `$defs`: the same schema
    (annotations aside), which llguidance compiles faster, building each distinct leaf once
    instead of once per place. The leaves: integers and numbers that are a type and bounds only
    (what `bound_numbers` makes of most of them; ~0.5 ms each), strings that are a type and
    string keywords only (`format`, `pattern`, `minLength`, `maxLength`), and enums of a few
    values or more (with their type, if any).

    A type list with one such type (`["integer", "null"]`, `["string", "null"]`) shares it as
    one branch of an `anyOf`, the other types the other branch. Identifiers below the root
    (`$id`, draft 4's `id`) change how a `$ref` inside them reads: where no `$ref` sits under
    one and every `$ref` is a local pointer, they name nothing and are left out; otherwise the
    schema is left as it is. counts: how often each leaf's text occurs below the root, where
    the caller counted already."""
    if not isinstance(schema, dict) or not isinstance(schema.get("$defs", {}), dict):
        return schema
    if counts is None:
        counts = Counter(_leaf_part(node)[0] for node in schema_nodes(schema)[1:])
    if not any(text is not None and n >= 2 for text, n in counts.items()):
        return schema  # (nothing to share: the schema as it came, identifiers and all)
    nodes = schema_nodes(schema)[1:]  # (the root first)
    strip = any("$id" in node or "id" in node for node in nodes)
    if strip and not _identifiers_name_nothing(list(iter_subschemas(schema))):
        return schema
    parts: dict[int, tuple[str | None, dict[str, Any], dict[str, Any] | None]] = {}

    def read(node: dict[str, Any], where: str) -> dict[str, Any]:
        if where:  # (the root is never shared; the identifiers below it go, naming nothing)
            if strip:
                node = {k: v for k, v in node.items() if k not in ("$id", "id")}
            parts[id(node)] = _leaf_part(node)
        return node

    copy = map_subschemas(schema, read)  # (the nodes the sharing walks, read once)
    return _share_in_place(copy, parts, Counter(part[0] for part in parts.values()))


def _leaf_part(
    node: dict[str, Any],
) -> tuple[str | None, dict[str, Any], dict[str, Any] | None]:
    """(the keywords of the bounded number, the string with string keywords or the enum that
    `node` is or holds, as text; those keywords; the schema of its other types, None where it
    has none),
    or (None, {}, None) where `node` is more than such a leaf (a type list with a bounded
    number may carry string keywords: they go with the other types)."""
    if node.keys().isdisjoint(_LEAF_KEYS):  # (most nodes: at once)
        return None, {}, None
    types, keys = node.get("type"), {k for k, v in node.items() if not _is_annotation(k, v)}
    if "enum" in keys:  # (an enum is the leaf whole, its type with it: a filter of its values)
        values = node["enum"]
        if keys <= {"enum", "type"} and isinstance(values, list) and len(values) >= _SHARED_ENUM:
            body = {k: node[k] for k in keys}
            return _KEY.encode(body), body, None
        return None, {}, None
    if keys & _BOUND_KEYS:
        if not keys <= _NUMBER_KEYS | _STRING_KEYS:
            return None, {}, None
        leaf_types, own = _NUMERIC_TYPES, _BOUND_KEYS
    elif keys & _STRING_KEYS and keys <= _STRING_KEYS | {"type"}:
        leaf_types, own = ("string",), _STRING_KEYS
    else:
        return None, {}, None
    if isinstance(types, str) and types in leaf_types:
        others: list[str] = []
    elif isinstance(types, list) and all(isinstance(t, str) for t in types):
        leaf = [t for t in types if t in leaf_types]
        others = [t for t in types if t not in leaf_types]
        if len(leaf) != 1 or not others or len(set(types)) != len(types):
            return None, {}, None
        types = leaf[0]
    else:
        return None, {}, None
    body = {k: v for k, v in node.items() if k in own}
    body["type"] = types
    text = _KEY.encode(body)
    if not others:
        return text, body, None
    rest: dict[str, Any] = {"type": others[0] if len(others) == 1 else others}
    if "string" in others:
        rest.update({k: v for k, v in node.items() if k in _STRING_KEYS})
    return text, body, rest


def _identifiers_name_nothing(nodes: list[tuple[str, dict[str, Any]]]) -> bool:
    """Whether the `$id`s and `id`s below the root of `nodes` (a schema's subschemas with their
    pointers, the root's "#" among them) change nothing: every `$ref` a local pointer ("#",
    "#/..."; the root's too: `"$ref": "#item"` may name an `$id` below), none under a node with
    an identifier, and no anchors or dynamic references."""
    scoped = [where for where, node in nodes if where != "#" and ("$id" in node or "id" in node)]
    for where, node in nodes:
        if node.keys() & {"$anchor", "$dynamicAnchor", "$dynamicRef", "$recursiveRef"}:
            return False
        if "$ref" not in node:
            continue
        ref = node["$ref"]
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            return False
        if any(where == s or where.startswith(s + "/") for s in scoped):
            return False
    return True


def close_objects(schema: Any) -> Any:
    """`additionalProperties: false` on every object schema that lists `properties` and says
    nothing of other keys. Not where other schemas combine with it (a branch of `allOf`, a node
    with `allOf`, `anyOf`, `oneOf`, `$ref` or conditionals): closing one part there could forbid
    what another part allows; nor where it requires a key it does not list."""
    return map_subschemas(schema, _close_node)


def _close_node(node: dict[str, Any], where: str) -> dict[str, Any]:
    properties = node.get("properties")
    required = node.get("required")
    if (
        where != "allOf"
        and isinstance(properties, dict)
        and not any(k in node for k in _OPEN_KEYS)
        # (a required key it does not list: closed, no value could have it)
        and not (isinstance(required, list) and any(k not in properties for k in required))
    ):
        node["additionalProperties"] = False
    return node


__all__ = [
    "NumberLimits",
    "bound_numbers",
    "close_objects",
    "fit_bounds",
    "iter_subschemas",
    "map_subschemas",
    "one_of_as_any_of",
    "prepare_schema",
    "reachable_subschemas",
    "schema_nodes",
    "share_leaves",
]
