"""Building regex text that both outlines-core (Rust `regex` syntax) and Python `re` read alike.

Every non-alphanumeric character is written as a hex escape (`\\xHH`, `\\uHHHH`, `\\UHHHHHHHH`),
the one spelling the two dialects share, so no character is ever read as syntax by accident and
Python's `re` can serve as the oracle for the regexes we build.

`None` stands for the empty language (no string matches): the combinators propagate it, so a
branch that cannot be satisfied disappears instead of turning into an invalid regex.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

Regex = str | None  # None: the empty language

# Generated text never uses plane 16 (U+100000..U+10FFFF, private use): its last code point is
# the end-of-match sentinel appended to every grammar (see compiler.py), and keeping the whole
# plane out means no real token can ever start the sentinel.
MAX_CODE_POINT = 0xFFFFF
SENTINEL = "\U0010ffff"
SURROGATES = (0xD800, 0xDFFF)

# A set of code points: sorted, disjoint, non-adjacent inclusive ranges.
CharSet = tuple[tuple[int, int], ...]


def escape_char(cp: int) -> str:
    ch = chr(cp)
    if ch.isascii() and ch.isalnum():
        return ch
    if cp < 0x100:
        return f"\\x{cp:02x}"
    if cp < 0x10000:
        return f"\\u{cp:04x}"
    return f"\\U{cp:08x}"


def generable(text: str) -> bool:
    """Whether every character of `text` may appear in generated text."""
    return all(
        ord(c) <= MAX_CODE_POINT and not SURROGATES[0] <= ord(c) <= SURROGATES[1] for c in text
    )


def lit(text: str) -> str:
    """The regex matching exactly `text`."""
    return "".join(escape_char(ord(c)) for c in text)


def seq(*parts: Regex) -> Regex:
    if any(p is None for p in parts):
        return None
    return "".join(p for p in parts if p)  # type: ignore[misc]


def group(r: str) -> str:
    return r if _is_atomic(r) else f"(?:{r})"


def alt(parts: Iterable[Regex]) -> Regex:
    """Union; drops empty languages and duplicates, keeps order."""
    seen: list[str] = []
    for p in parts:
        if p is not None and p not in seen:
            seen.append(p)
    if "" in seen:
        seen.remove("")
        return opt(alt(seen)) if seen else ""
    if not seen:
        return None
    if len(seen) == 1:
        return seen[0]
    return "(?:" + "|".join(seen) + ")"


def opt(r: Regex) -> str:
    if r is None or r == "":
        return ""
    return group(r) + "?"


def star(r: Regex) -> str:
    if r is None or r == "":
        return ""
    return group(r) + "*"


def repeat(r: Regex, lo: int, hi: int | None) -> Regex:
    """`r` repeated between lo and hi times (hi None: unbounded)."""
    if hi is not None and hi < lo:
        return None
    if r is None:
        return "" if lo == 0 else None
    if r == "" or hi == 0:
        return ""
    if (lo, hi) == (1, 1):
        return r
    g = group(r)
    if hi is None:
        return g + ("*" if lo == 0 else "+" if lo == 1 else f"{{{lo},}}")
    if lo == hi:
        return g + f"{{{lo}}}"
    if (lo, hi) == (0, 1):
        return g + "?"
    return g + f"{{{lo},{hi}}}"


def _is_atomic(r: str) -> bool:
    """True when `r` is one character, one escape, one class or one group."""
    if len(r) == 1:
        return True
    if r.startswith("\\"):
        n = {"x": 4, "u": 6, "U": 10}.get(r[1], 2)
        return len(r) == n
    if r.startswith("[") and r.endswith("]"):
        return _closing_bracket(r, 0) == len(r) - 1
    if r.startswith("(") and r.endswith(")"):
        return _closing_paren(r, 0) == len(r) - 1
    return False


def _closing_bracket(r: str, i: int) -> int:
    j = i + 1
    while j < len(r):
        if r[j] == "\\":
            j += 2
            continue
        if r[j] == "]":
            return j
        j += 1
    return -1


def _closing_paren(r: str, i: int) -> int:
    depth = 0
    j = i
    while j < len(r):
        c = r[j]
        if c == "\\":
            j += 2
            continue
        if c == "[":
            j = _closing_bracket(r, j) + 1
            continue
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return j
        j += 1
    return -1


# ---------------------------------------------------------------------------------------------
# Character sets


def charset(*ranges: tuple[int, int]) -> CharSet:
    return normalize(ranges)


def chars(text: str) -> CharSet:
    return normalize((ord(c), ord(c)) for c in text)


def normalize(ranges: Iterable[tuple[int, int]]) -> CharSet:
    out: list[list[int]] = []
    for lo, hi in sorted(r for r in ranges if r[0] <= r[1]):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((a, b) for a, b in out)


def union(*sets: CharSet) -> CharSet:
    return normalize(r for s in sets for r in s)


def complement(s: CharSet) -> CharSet:
    """All Unicode scalar values (surrogates excluded) not in `s`."""
    out = []
    prev = 0
    for lo, hi in s:
        if lo > prev:
            out.append((prev, lo - 1))
        prev = hi + 1
    if prev <= MAX_CODE_POINT:
        out.append((prev, MAX_CODE_POINT))
    return subtract(normalize(out), (SURROGATES,))


def intersect(a: CharSet, b: CharSet) -> CharSet:
    out = []
    for lo1, hi1 in a:
        for lo2, hi2 in b:
            lo, hi = max(lo1, lo2), min(hi1, hi2)
            if lo <= hi:
                out.append((lo, hi))
    return normalize(out)


def subtract(a: CharSet, b: CharSet) -> CharSet:
    out = list(a)
    for blo, bhi in b:
        nxt = []
        for lo, hi in out:
            if bhi < lo or blo > hi:
                nxt.append((lo, hi))
                continue
            if lo < blo:
                nxt.append((lo, blo - 1))
            if hi > bhi:
                nxt.append((bhi + 1, hi))
        out = nxt
    return normalize(out)


def contains(s: CharSet, cp: int) -> bool:
    return any(lo <= cp <= hi for lo, hi in s)


def size(s: CharSet) -> int:
    return sum(hi - lo + 1 for lo, hi in s)


def class_regex(s: CharSet) -> Regex:
    """A character class for the code points in `s` (surrogates and plane 16 dropped)."""
    s = subtract(s, (SURROGATES, (MAX_CODE_POINT + 1, 0x10FFFF)))
    if not s:
        return None
    if len(s) == 1 and s[0][0] == s[0][1]:
        return escape_char(s[0][0])
    body = []
    for lo, hi in s:
        if lo == hi:
            body.append(escape_char(lo))
        elif hi == lo + 1:
            body.append(escape_char(lo) + escape_char(hi))
        else:
            body.append(f"{escape_char(lo)}-{escape_char(hi)}")
    return "[" + "".join(body) + "]"


ANY_CHAR: CharSet = complement(())
DIGITS: CharSet = chars("0123456789")
HEX_DIGITS: CharSet = union(DIGITS, chars("abcdefABCDEF"))
ASCII: CharSet = ((0, 0x7F),)

# ---------------------------------------------------------------------------------------------
# JSON string content. A "unit" is one decoded character in its encoded form: a raw character or
# one escape. Units concatenate unambiguously (a backslash always opens an escape), so the
# decoding of a concatenation is the concatenation of the decodings, and counting units counts
# characters.

JSON_RAW: CharSet = complement(union(chars('"\\'), ((0, 0x1F),)))
_SHORT_ESCAPES = {
    0x22: '\\"',
    0x5C: "\\\\",
    0x08: "\\b",
    0x0C: "\\f",
    0x0A: "\\n",
    0x0D: "\\r",
    0x09: "\\t",
}


def canonical_escape(cp: int) -> str:
    """How `json.dumps(..., ensure_ascii=False)` writes a character that must be escaped."""
    return _SHORT_ESCAPES.get(cp) or f"\\u{cp:04x}"


def json_units(s: CharSet) -> Regex:
    """One JSON string unit decoding to a character of `s`, in canonical (json.dumps) form only.

    Canonical-only keeps encoded strings and decoded strings one-to-one, which is what makes
    "key not in this set" and pattern languages exact.
    """
    raw = class_regex(intersect(s, JSON_RAW))
    escaped = [
        lit(canonical_escape(cp)) for lo, hi in subtract(s, JSON_RAW) for cp in range(lo, hi + 1)
    ]
    return alt([raw, *escaped])


def _any_unit() -> str:
    # Raw characters and the two-character escapes. \uXXXX escapes are not generated: the raw
    # UTF-8 character is always available instead, and each hex digit would add automaton
    # states to every string (about a third more compile time for string-heavy schemas).
    escape = lit("\\") + class_regex(chars('"\\/bfnrt'))  # type: ignore[operator]
    return alt([class_regex(JSON_RAW), escape])  # type: ignore[list-item,return-value]


ANY_JSON_UNIT: str = _any_unit()  # any one character, raw or escaped
QUOTE = lit('"')


def json_string(units: Regex, lo: int = 0, hi: int | None = None) -> Regex:
    return seq(QUOTE, repeat(units, lo, hi), QUOTE)


def literal_json(value: object) -> Regex:
    """The regex of one JSON value's compact canonical serialization (None if unencodable)."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    if not generable(text):
        return None  # a lone surrogate cannot be written as UTF-8; plane 16 is reserved
    return lit(text)


def string_not_in(excluded: Sequence[str]) -> Regex:
    """Canonical JSON strings (quotes included) whose decoded value is not in `excluded`."""
    any_unit = json_units(ANY_CHAR)
    trie: dict = {}
    for word in set(excluded):
        node = trie
        for c in word:
            node = node.setdefault(c, {})
        node[""] = {}  # end marker

    def below(node: dict) -> Regex:
        children = [c for c in node if c]
        branches: list[Regex] = []
        if "" not in node:
            branches.append("")  # this prefix itself is not excluded
        for c in children:
            branches.append(seq(json_units(chars(c)), below(node[c])))
        others = subtract(ANY_CHAR, chars("".join(children)))
        branches.append(seq(json_units(others), star(any_unit)))
        return alt(branches)

    return seq(QUOTE, below(trie), QUOTE)


def ordered_items(
    items: list[tuple[Regex, bool]], sep: Regex, extra: Regex = None, nonempty: bool = False
) -> Regex:
    """Items in their order, `sep` between them, each (item, required) always or maybe there,
    then any number of `extra` items (None: none); with `nonempty`, at least one item.

    With a required item: items before the last required one carry a trailing separator, items
    after it a leading one. With none required: the last item written is chosen, every earlier
    one optional and followed by a separator; written right to left, Y_i = I_i | (I_i sep)? Y_i+1,
    the text stays linear, and the automaton too (both readings of I_i advance together).
    """
    extra_tail = star(seq(sep, extra)) if extra is not None else ""
    last_required = max((i for i, (_, req) in enumerate(items) if req), default=-1)
    if last_required >= 0:
        parts: list[Regex] = []
        for i, (item, req) in enumerate(items):
            if i < last_required:
                parts.append(seq(item, sep) if req else opt(seq(item, sep)))
            elif i == last_required:
                parts.append(item)
            else:
                parts.append(opt(seq(sep, item)))
        return seq(*parts, extra_tail)
    y: Regex = seq(extra, extra_tail) if extra is not None else None
    for item, _ in reversed(items):
        y = alt([seq(item, extra_tail), seq(opt(seq(item, sep)), y)])
    return y if nonempty else alt([y, ""])
