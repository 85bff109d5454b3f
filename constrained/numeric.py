"""Regexes for numbers inside exact bounds.

Integers are written canonically (no leading zeros, no "-0"); bounded decimals as
`-?INT(.FRACTION)?` without exponent. Bounds are exact decimals; the caller picks them so that
the float rounding a validator applies cannot move a generated number across a bound.
"""

from __future__ import annotations

from decimal import Decimal

from radixlm.constrained import regex_text as rt

DIGIT = "[0-9]"
JSON_INTEGER = "(?:" + rt.lit("-") + ")?(?:0|[1-9][0-9]*)"
JSON_NUMBER = (
    JSON_INTEGER
    + "(?:"
    + rt.lit(".")
    + "[0-9]+)?(?:[eE](?:"
    + rt.lit("+")
    + "|"
    + rt.lit("-")
    + ")?[0-9]+)?"
)
_MINUS = rt.lit("-")
_DOT = rt.lit(".")


def _digit_class(lo: int, hi: int) -> rt.Regex:
    if lo > hi:
        return None
    if lo == hi:
        return str(lo)
    if (lo, hi) == (0, 9):
        return DIGIT
    return f"[{lo}-{hi}]"


def _digits(n: int) -> str:
    return rt.repeat(DIGIT, n, n) or ""  # type: ignore[return-value]


def _at_least(s: str) -> rt.Regex:
    """Digit strings of len(s) that are >= s (leading zeros allowed)."""
    if not s:
        return ""
    if s.strip("0") == "":
        return _digits(len(s))
    d = int(s[0])
    return rt.alt(
        [rt.seq(s[0], _at_least(s[1:])), rt.seq(_digit_class(d + 1, 9), _digits(len(s) - 1))]
    )


def _at_most(s: str) -> rt.Regex:
    """Digit strings of len(s) that are <= s (leading zeros allowed)."""
    if not s:
        return ""
    if s.strip("9") == "":
        return _digits(len(s))
    d = int(s[0])
    return rt.alt(
        [rt.seq(s[0], _at_most(s[1:])), rt.seq(_digit_class(0, d - 1), _digits(len(s) - 1))]
    )


def _same_length(a: str, b: str) -> rt.Regex:
    """Digit strings s with len(s) == len(a) == len(b) and a <= s <= b."""
    if a > b:
        return None
    i = 0
    while i < len(a) and a[i] == b[i]:
        i += 1
    if i == len(a):
        return a
    prefix, da, db, rest = a[:i], int(a[i]), int(b[i]), len(a) - i - 1
    if rest == 0:
        return prefix + _digit_class(da, db)  # type: ignore[operator]
    return rt.seq(
        prefix,
        rt.alt(
            [
                rt.seq(str(da), _at_least(a[i + 1 :])),
                rt.seq(_digit_class(da + 1, db - 1), _digits(rest)),
                rt.seq(str(db), _at_most(b[i + 1 :])),
            ]
        ),
    )


def uint_range(lo: int, hi: int | None) -> rt.Regex:
    """Canonical non-negative integers n with lo <= n <= hi (hi None: unbounded)."""
    lo = max(lo, 0)
    if hi is not None and hi < lo:
        return None
    parts: list[rt.Regex] = []
    n_lo = len(str(lo))
    last = len(str(hi)) if hi is not None else n_lo
    for n in range(n_lo, last + 1):
        a = max(lo, 10 ** (n - 1) if n > 1 else 0)
        b = 10**n - 1 if hi is None else min(hi, 10**n - 1)
        parts.append(_same_length(str(a), str(b)))
    if hi is None:
        parts.append(f"[1-9][0-9]{{{n_lo},}}")
    return rt.alt(parts)


def int_range(lo: int | None, hi: int | None) -> rt.Regex:
    """Canonical integers in [lo, hi] (None: unbounded on that side)."""
    parts: list[rt.Regex] = []
    if hi is None or hi >= 0:
        parts.append(uint_range(max(lo, 0) if lo is not None else 0, hi))
    if lo is None or lo < 0:
        # negative n: magnitude in [max(1, -hi), -lo]
        m_lo = 1 if hi is None or hi >= 0 else -hi
        parts.append(rt.seq(_MINUS, uint_range(m_lo, None if lo is None else -lo)))
    return rt.alt(parts)


def _split(d: Decimal) -> tuple[int, str]:
    """Integer part and fraction digits (no trailing zeros) of a non-negative decimal."""
    text = format(d, "f")
    whole, _, frac = text.partition(".")
    return int(whole), frac.rstrip("0")


def _fraction(
    lo: str | None, lo_strict: bool, hi: str | None, hi_strict: bool, max_digits: int | None
) -> rt.Regex:
    """The optional fraction `(.DIGITS)?` whose value 0.DIGITS lies within the bounds.

    lo/hi are fraction digit strings without trailing zeros ("" is zero); None: no bound.
    """
    memo: dict[tuple, rt.Regex] = {}

    def end_ok(i: int, tlo: bool, thi: bool) -> bool:
        # The digits so far equal lo[:i] (when tlo) / hi[:i] (when thi); stopping here means the
        # rest is zeros.
        if tlo and (i < len(lo) or lo_strict):  # type: ignore[arg-type]
            return False
        return not (thi and hi_strict and i >= len(hi))  # type: ignore[arg-type]

    def rest(i: int, tlo: bool, thi: bool, remaining: int | None, must: bool) -> rt.Regex:
        key = (i, tlo, thi, remaining, must)
        if key not in memo:
            memo[key] = _rest(i, tlo, thi, remaining, must)
        return memo[key]

    def _rest(i: int, tlo: bool, thi: bool, remaining: int | None, must: bool) -> rt.Regex:
        stop = "" if (not must and end_ok(i, tlo, thi)) else None
        if remaining == 0:
            return stop
        nxt = None if remaining is None else remaining - 1
        past_lo = tlo and i >= len(lo)  # type: ignore[arg-type]
        past_hi = thi and i >= len(hi)  # type: ignore[arg-type]
        if not tlo and not thi:
            return rt.alt([stop, rt.repeat(DIGIT, 1, remaining)])
        if past_hi:  # equal to hi so far: only zeros may follow, and equality must be allowed
            if (tlo and not past_lo) or hi_strict or (tlo and lo_strict):
                return None
            return rt.alt([stop, rt.repeat("0", 1, remaining)])
        if past_lo and not thi:
            if not lo_strict:
                return rt.alt([stop, rt.repeat(DIGIT, 1, remaining)])
            # a nonzero digit must still come
            if remaining is None:
                return "0*[1-9][0-9]*"
            return rt.alt(
                rt.seq(rt.repeat("0", k, k), "[1-9]", rt.repeat(DIGIT, 0, remaining - k - 1))
                for k in range(remaining)
            )
        d_lo = int(lo[i]) if tlo and not past_lo else 0  # type: ignore[index]
        d_hi = int(hi[i]) if thi else 9  # type: ignore[index]
        branches: list[rt.Regex] = [stop]
        loose_lo, loose_hi = d_lo, d_hi
        if tlo:
            branches.append(rt.seq(str(d_lo), rest(i + 1, True, thi and d_lo == d_hi, nxt, False)))
            loose_lo = d_lo + 1
        if thi and d_hi >= loose_lo:
            branches.append(rt.seq(str(d_hi), rest(i + 1, False, True, nxt, False)))
            loose_hi = d_hi - 1
        if loose_lo <= loose_hi:
            branches.append(rt.seq(_digit_class(loose_lo, loose_hi), rt.repeat(DIGIT, 0, nxt)))
        return rt.alt(branches)

    tlo, thi = lo is not None, hi is not None
    absent = "" if end_ok(0, tlo, thi) else None
    present = rest(0, tlo, thi, max_digits, True) if max_digits != 0 else None
    return rt.alt([absent, rt.seq(_DOT, present)])


def _nonnegative(
    lo: Decimal, lo_strict: bool, hi: Decimal | None, hi_strict: bool, max_frac: int | None
) -> rt.Regex:
    li, lf = _split(lo)
    if hi is None:
        return rt.alt(
            [
                rt.seq(str(li), _fraction(lf, lo_strict, None, False, max_frac)),
                rt.seq(uint_range(li + 1, None), _fraction(None, False, None, False, max_frac)),
            ]
        )
    if hi < lo or (hi == lo and (lo_strict or hi_strict)):
        return None
    hi_i, hf = _split(hi)
    if li == hi_i:
        return rt.seq(str(li), _fraction(lf, lo_strict, hf, hi_strict, max_frac))
    return rt.alt(
        [
            rt.seq(str(li), _fraction(lf, lo_strict, None, False, max_frac)),
            rt.seq(uint_range(li + 1, hi_i - 1), _fraction(None, False, None, False, max_frac)),
            rt.seq(str(hi_i), _fraction(None, False, hf, hi_strict, max_frac)),
        ]
    )


def decimal_range(
    lo: Decimal | None,
    lo_strict: bool,
    hi: Decimal | None,
    hi_strict: bool,
    max_frac: int | None = None,
) -> rt.Regex:
    """Decimals `-?INT(.FRAC)?` (no exponent) with lo <(=) x <(=) hi, exactly.

    max_frac: the most fraction digits generated (None: unbounded).
    """
    parts: list[rt.Regex] = []
    if hi is None or hi > 0 or (hi == 0 and not hi_strict):
        if lo is None or lo < 0:
            parts.append(_nonnegative(Decimal(0), False, hi, hi_strict, max_frac))
        else:
            parts.append(_nonnegative(lo, lo_strict, hi, hi_strict, max_frac))
    if lo is None or lo < 0:
        # x = -m with m > 0 and -hi <(=) m <(=) -lo
        if hi is None or hi >= 0:
            m_lo, m_lo_strict = Decimal(0), True
        else:
            m_lo, m_lo_strict = -hi, hi_strict
        m_hi = None if lo is None else -lo
        parts.append(rt.seq(_MINUS, _nonnegative(m_lo, m_lo_strict, m_hi, lo_strict, max_frac)))
    return rt.alt(parts)
