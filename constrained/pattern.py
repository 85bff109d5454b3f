"""JSON Schema `pattern` (an ECMA-262 regex, applied with search semantics) as a regex over JSON
string content.

The pattern is parsed with Python's own regex parser (the dialect `jsonschema` checks with), and
every construct is given a meaning that holds under both the ECMA and the Python reading: `\\d`,
`\\w` and `\\s` generate their ASCII members only, negated classes that contain them generate ASCII
only, `.` never generates a line terminator. Anything whose language we cannot write exactly
(lookarounds, backreferences, word boundaries, flags, anchors in the middle) is refused.

The result matches the *encoded* string content: each decoded character becomes its canonical
JSON unit (`"` becomes `\\"`, control characters their escapes), so a string we generate decodes
to exactly the text the pattern was checked on.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from radixlm.constrained import regex_text as rt
from radixlm.constrained.errors import GrammarError

try:  # Python 3.11+
    import re._constants as _sre_c  # type: ignore[import-not-found]
    import re._parser as _sre_parse  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as _sre_c  # type: ignore[no-redef]
    import sre_parse as _sre_parse  # type: ignore[no-redef]

_MAXREPEAT = _sre_c.MAXREPEAT
_ANY_LINE = rt.complement(rt.chars("\n\r\u2028\u2029"))
_WORD = rt.union(rt.charset((ord("a"), ord("z")), (ord("A"), ord("Z"))), rt.DIGITS, rt.chars("_"))
_SPACE = rt.chars(" \t\n\r\f\v")
# U+001C..U+001F are whitespace to Python's re (the jsonschema checker's) but not to ECMA-262's:
# never generated for \s, never for anything that must not be \s either
_ANY_SPACE = rt.union(_SPACE, rt.charset((0x1C, 0x1F)))
_NOT_SPACE = rt.subtract(rt.ASCII, _ANY_SPACE)
_CATEGORIES = {
    _sre_c.CATEGORY_DIGIT: rt.DIGITS,
    _sre_c.CATEGORY_NOT_DIGIT: rt.subtract(rt.ASCII, rt.DIGITS),
    _sre_c.CATEGORY_WORD: _WORD,
    _sre_c.CATEGORY_NOT_WORD: rt.subtract(rt.ASCII, _WORD),
    _sre_c.CATEGORY_SPACE: _SPACE,
    _sre_c.CATEGORY_NOT_SPACE: _NOT_SPACE,
}
_STARTS = (_sre_c.AT_BEGINNING, _sre_c.AT_BEGINNING_STRING)
_ENDS = (_sre_c.AT_END, _sre_c.AT_END_STRING)
_NAMED_GROUP = re.compile(r"\(\?<(?![=!])")


Units = Callable[[rt.CharSet], rt.Regex]  # a decoded character set -> its regex


class PatternError(GrammarError):
    pass


@dataclass(frozen=True)
class PatternLanguage:
    """The strings a pattern accepts, as a regex over JSON string units (no quotes)."""

    regex: rt.Regex
    min_len: int  # in decoded characters
    max_len: int | None
    # When the whole pattern is one character set repeated (`^[a-z]{2,8}$`), that set, so that
    # minLength/maxLength can be folded into the repetition.
    repeated_set: rt.CharSet | None = None


@dataclass(frozen=True)
class _Part:
    regex: rt.Regex
    lo: int
    hi: int | None


def _parse(pattern: str):
    source = _NAMED_GROUP.sub("(?P<", pattern)
    try:
        with warnings.catch_warnings():
            # Python warns where other dialects read a class differently ([[:alpha:]], &&, --)
            warnings.simplefilter("error")
            parsed = _sre_parse.parse(source)
    except (re.error, RecursionError, OverflowError, FutureWarning, DeprecationWarning) as e:
        raise PatternError(f"invalid pattern {pattern!r}: {e}") from None
    flags = parsed.state.flags & ~(re.UNICODE | re.ASCII)
    if flags:
        raise PatternError(f"pattern {pattern!r}: inline flags are not supported")
    return parsed


def translate_regex(regex: str) -> str:
    """A user regex (full-match semantics, raw text) in our dialect, with every character class
    read as in `pattern_language`; PatternError for what cannot be read the same way."""
    parsed = _parse(regex)
    variants = _sequence(list(parsed), True, True, regex, rt.class_regex)
    out = rt.alt(part.regex for _, part, _ in variants)
    if out is None:
        raise PatternError(f"regex {regex!r} matches nothing")
    return out


def pattern_language(pattern: str) -> PatternLanguage:
    """Translate a schema `pattern`; raise PatternError naming the construct we cannot enforce."""
    parsed = _parse(pattern)
    variants = _sequence(list(parsed), True, True, pattern, rt.json_units)
    any_string = rt.star(rt.ANY_JSON_UNIT)
    branches, lo, hi = [], None, 0
    for anchored_start, part, anchored_end in variants:
        branches.append(
            rt.seq(
                "" if anchored_start else any_string, part.regex, "" if anchored_end else any_string
            )
        )
        lo = part.lo if lo is None else min(lo, part.lo)
        if hi is not None:
            hi = (
                None
                if (part.hi is None or not anchored_start or not anchored_end)
                else max(hi, part.hi)
            )
    repeated = _repeated_set(list(parsed)) if len(variants) == 1 else None
    return PatternLanguage(rt.alt(branches), lo or 0, hi, repeated)


def _repeated_set(items: list) -> rt.CharSet | None:
    """The set S when the pattern is exactly ^S{m,n}$ (or ^S*$, ^S+$)."""
    if len(items) != 3 or items[0][0] != _sre_c.AT or items[0][1] not in _STARTS:
        return None
    if items[2][0] != _sre_c.AT or items[2][1] not in _ENDS:
        return None
    op, av = items[1]
    if op not in (_sre_c.MAX_REPEAT, _sre_c.MIN_REPEAT) or len(av[2]) != 1:
        return None
    return _charset_of(av[2][0])


def _charset_of(item) -> rt.CharSet | None:
    op, av = item
    if op == _sre_c.LITERAL:
        return rt.chars(chr(av))
    if op == _sre_c.NOT_LITERAL:
        return rt.subtract(rt.ANY_CHAR, rt.chars(chr(av)))
    if op == _sre_c.ANY:
        return _ANY_LINE
    if op == _sre_c.IN:
        return _class(av)
    return None


def _class(items) -> rt.CharSet:
    negate = bool(items) and items[0][0] == _sre_c.NEGATE
    members: list[rt.CharSet] = []
    has_category = False
    for op, av in items[1:] if negate else items:
        if op == _sre_c.LITERAL:
            members.append(rt.chars(chr(av)))
        elif op == _sre_c.RANGE:
            members.append(rt.charset(av))
        elif op == _sre_c.CATEGORY:
            has_category = True
            if av not in _CATEGORIES:
                raise PatternError(f"unsupported character category {av}")
            # (in a negated class, \s excludes every character either dialect counts as space)
            members.append(
                _ANY_SPACE if negate and av == _sre_c.CATEGORY_SPACE else _CATEGORIES[av]
            )
        else:
            raise PatternError(f"unsupported class member {op}")
    s = rt.union(*members)
    if not negate:
        return s
    out = rt.complement(s)
    # \d, \w, \s stand for their ASCII members only; the complement of that subset would
    # include Unicode digits/letters/spaces, which the real class excludes: stay in ASCII.
    return rt.intersect(out, rt.ASCII) if has_category else out


def _sequence(
    items: list, at_start: bool, at_end: bool, pattern: str, units: Units
) -> list[tuple[bool, _Part, bool]]:
    """Variants (anchored at start, language, anchored at end) of a sequence of parsed items.

    `at_start`/`at_end`: whether this sequence sits at the start/end of the whole pattern, the
    only places where an anchor may appear.
    """
    anchored_start = anchored_end = False
    if items and items[0][0] == _sre_c.AT and items[0][1] in _STARTS:
        if not at_start:
            raise PatternError(f"pattern {pattern!r}: '^' is only supported at the start")
        anchored_start, items = True, items[1:]
    if items and items[-1][0] == _sre_c.AT and items[-1][1] in _ENDS:
        if not at_end:
            raise PatternError(f"pattern {pattern!r}: '$' is only supported at the end")
        anchored_end, items = True, items[:-1]
    n = len(items)
    variants: list[tuple[bool, _Part, bool]] = [(False, _Part("", 0, 0), False)]
    for i, item in enumerate(items):
        # Only the first item may hold a '^' of its own, only the last one a '$'.
        first = i == 0 and at_start and not anchored_start
        last = i == n - 1 and at_end and not anchored_end
        item_variants = _item(item, first, last, pattern, units)
        variants = [
            (
                vs or is_,
                _Part(
                    rt.seq(vpart.regex, ipart.regex), vpart.lo + ipart.lo, _add(vpart.hi, ipart.hi)
                ),
                ie,
            )
            for vs, vpart, _ in variants
            for is_, ipart, ie in item_variants
        ]
        if len(variants) > 64:
            raise PatternError(f"pattern {pattern!r} has too many anchored alternatives")
    return [(vs or anchored_start, part, ve or anchored_end) for vs, part, ve in variants]


def _add(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a + b


def _item(
    item, at_start: bool, at_end: bool, pattern: str, units: Units
) -> list[tuple[bool, _Part, bool]]:
    op, av = item
    cs = _charset_of(item)
    if cs is not None:
        return [(False, _Part(units(cs), 1, 1), False)]
    if op == _sre_c.SUBPATTERN:
        _group, add_flags, del_flags, sub = av
        if add_flags or del_flags:
            raise PatternError(f"pattern {pattern!r}: inline flags are not supported")
        return _sequence(list(sub), at_start, at_end, pattern, units)
    if op == _sre_c.BRANCH:
        out = []
        for sub in av[1]:
            out.extend(_sequence(list(sub), at_start, at_end, pattern, units))
        return out
    if op in (_sre_c.MAX_REPEAT, _sre_c.MIN_REPEAT):
        lo, hi, sub = av
        hi = None if hi == _MAXREPEAT else hi
        inner = [v[1] for v in _sequence(list(sub), False, False, pattern, units)]
        his = [p.hi for p in inner]
        part = _Part(
            rt.alt(p.regex for p in inner),
            min(p.lo for p in inner),
            None if None in his else max(h for h in his if h is not None),
        )
        return [
            (
                False,
                _Part(
                    rt.repeat(part.regex, lo, hi),
                    part.lo * lo,
                    None if hi is None or part.hi is None else part.hi * hi,
                ),
                False,
            )
        ]
    if op == _sre_c.AT:
        where = (
            "'^'"
            if av in _STARTS
            else "'$'"
            if av in _ENDS
            else "word boundaries / \\A \\Z assertions"
        )
        raise PatternError(
            f"pattern {pattern!r}: {where} only supported at the start/end of the pattern"
        )
    names = {
        _sre_c.ASSERT: "lookaround assertions",
        _sre_c.ASSERT_NOT: "lookaround assertions",
        _sre_c.GROUPREF: "backreferences",
        _sre_c.GROUPREF_EXISTS: "conditional groups",
    }
    what = names.get(op, f"the construct {op}")
    raise PatternError(f"pattern {pattern!r}: {what} are not supported")


_LENGTH_SPLIT_CAP = 32  # patterns of variable length are split by length up to this maxLength


def pattern_with_length(
    pattern: str, lo: int, hi: int | None, counted: Callable[[int, int | None], int | None]
) -> rt.Regex:
    """A pattern together with minLength/maxLength, as JSON string content.

    Each anchored/unanchored variant is split by the length of its core (exactly when the core
    has one length, or by enumerating lengths up to a small maxLength); the free text before
    or after the core then gets the remaining length. An unanchored core with much room around
    it is placed at the start or the end only (a sound narrowing). `counted` narrows large
    repetition bounds like everywhere else.
    """
    parsed = _parse(pattern)
    items = list(parsed)
    variants = _sequence(items, True, True, pattern, rt.json_units)
    any_unit = rt.ANY_JSON_UNIT

    def free(n_lo: int, n_hi: int | None) -> rt.Regex:
        return rt.repeat(any_unit, n_lo, counted(n_lo, n_hi))

    pieces: list[rt.Regex] = []
    for anchored_start, part, anchored_end in variants:
        if part.hi is not None and part.lo == part.hi:
            by_length = {part.lo: part.regex}
        elif hi is not None and hi <= _LENGTH_SPLIT_CAP and len(variants) == 1:
            core = [
                it
                for i, it in enumerate(items)
                if not (
                    it[0] == _sre_c.AT
                    and ((i == 0 and it[1] in _STARTS) or (i == len(items) - 1 and it[1] in _ENDS))
                )
            ]
            by_length = _by_length(core, hi, pattern)
        else:
            raise PatternError(
                f"pattern {pattern!r} together with minLength/maxLength: lengths too varied to split"
            )
        for n, core_regex in sorted(by_length.items()):
            room = None if hi is None else hi - n
            need = max(0, lo - n)
            if room is not None and room < need:
                continue
            if anchored_start and anchored_end:
                if need == 0:
                    pieces.append(core_regex)
            elif anchored_start:
                pieces.append(rt.seq(core_regex, free(need, room)))
            elif anchored_end:
                pieces.append(rt.seq(free(need, room), core_regex))
            elif room is not None and room <= 8:
                for before in range(room + 1):
                    after_lo = max(0, need - before)
                    pieces.append(
                        rt.seq(free(before, before), core_regex, free(after_lo, room - before))
                    )
            else:
                pieces.append(rt.seq(core_regex, free(need, room)))
                pieces.append(rt.seq(free(need, room), core_regex))
    return rt.alt(pieces)


def _by_length(items: list, cap: int, pattern: str) -> dict[int, rt.Regex]:
    """The language of a parsed sequence, split by decoded length (lengths up to cap)."""
    out: dict[int, rt.Regex] = {0: ""}
    for item in items:
        out = _concat(out, _item_by_length(item, cap, pattern), cap)
        if not out:
            break
    return out


def _concat(a: dict[int, rt.Regex], b: dict[int, rt.Regex], cap: int) -> dict[int, rt.Regex]:
    out: dict[int, list[rt.Regex]] = {}
    for la, ra in a.items():
        for lb, rb in b.items():
            if la + lb <= cap:
                out.setdefault(la + lb, []).append(rt.seq(ra, rb))
    merged = {n: rt.alt(rs) for n, rs in out.items()}
    if sum(len(r or "") for r in merged.values()) > 200_000:
        raise PatternError("pattern too large to split by length")
    return {n: r for n, r in merged.items() if r is not None}


def _item_by_length(item, cap: int, pattern: str) -> dict[int, rt.Regex]:
    op, av = item
    cs = _charset_of(item)
    if cs is not None:
        r = rt.json_units(cs)
        return {1: r} if r is not None else {}
    if op == _sre_c.SUBPATTERN:
        if av[1] or av[2]:
            raise PatternError(f"pattern {pattern!r}: inline flags are not supported")
        return _by_length(list(av[3]), cap, pattern)
    if op == _sre_c.BRANCH:
        out: dict[int, list[rt.Regex]] = {}
        for sub in av[1]:
            for n, r in _by_length(list(sub), cap, pattern).items():
                out.setdefault(n, []).append(r)
        return {n: r for n, rs in out.items() if (r := rt.alt(rs)) is not None}
    if op in (_sre_c.MAX_REPEAT, _sre_c.MIN_REPEAT):
        lo, hi, sub = av
        hi = cap if hi == _MAXREPEAT else min(hi, cap)
        once = _by_length(list(sub), cap, pattern)
        acc: dict[int, rt.Regex] = {0: ""}
        result: dict[int, list[rt.Regex]] = {}
        for k in range(hi + 1):
            if k >= lo:
                for n, r in acc.items():
                    result.setdefault(n, []).append(r)
            if k == hi:
                break
            acc = _concat(acc, once, cap)
            if not acc:
                break
        return {n: r for n, rs in result.items() if (r := rt.alt(rs)) is not None}
    raise PatternError(
        f"pattern {pattern!r}: cannot combine this construct with minLength/maxLength"
    )
