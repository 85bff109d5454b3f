"""How many digits a JSON number may have, held by the token mask instead of by the grammar.

A schema that bounds none of its numbers lets a model write digits until `max_new_tokens` runs
out (`"population": 1000000000...`). Bounds written into the schema stop that, but llguidance
builds a bounded number as a regex of O(digits^2) alternatives: about 0.5 ms of a compile for
each bounded place, a third of a typical schema's compile. So the llguidance backend compiles a
JSON schema without them, and each matcher follows the JSON its output writes, byte by byte (in
a string or not; in a number's integer, fraction or exponent digits, and how many): where a
token would take a number past its digits, the mask leaves it out and `accept_token` refuses it.

The limits never narrow a schema's own numbers: a grammar's limits are raised to the digits of
every number its schema writes (bounds, `multipleOf`, `const` and `enum` values), and where the
grammar allows nothing but more digits (a long constant), the mask keeps them.

    digits = NumberDigits(TokenTable(token_bytes), DigitLimits(18, 10, 2))
    state, refused = digits.after(START, token)    # the state after `token`, and whether the
                                                    # token wrote too many digits
    keep = digits.keep(state)                       # None, or the (W,) int32 mask of the tokens
                                                    # allowed from `state` (AND it in)
"""

from __future__ import annotations

import decimal
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from radixlm.constrained.bitmask import bitmask_words
from radixlm.constrained.schema_rewrite import NAMED_SUBSCHEMAS

# a state is phase + 8 * digits (the digits of the number's current part, for the number phases)
OUT, STR, ESC, INT, FRAC, EXP = range(6)
START = OUT
_QUOTE, _BACKSLASH, _DOT, _PLUS, _MINUS = 0x22, 0x5C, 0x2E, 0x2B, 0x2D
_SPECIAL = frozenset(b'"\\0123456789.eE+-')
_NUMERIC_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


@dataclass(frozen=True)
class DigitLimits:
    """integer: digits before the point (0: any); fraction: after it (-1: any); exponent: of
    the exponent (0: no exponent, -1: any)."""

    integer: int = 18
    fraction: int = 10
    exponent: int = 2

    @property
    def any(self) -> bool:
        """Whether any number is limited at all."""
        return self.integer > 0 or self.fraction >= 0 or self.exponent >= 0

    def covering(self, schema: Any) -> DigitLimits:
        """These limits, raised where `schema` writes a number with more digits."""
        integer, fraction = schema_digits(schema)
        return DigitLimits(
            self.integer if self.integer <= 0 else max(self.integer, integer),
            self.fraction if self.fraction < 0 else max(self.fraction, fraction),
            self.exponent,
        )


def schema_digits(schema: Any) -> tuple[int, int]:
    """The most digits before and after the point among the numbers `schema` writes: its
    numeric keywords' values and the numbers inside `const` and `enum` values."""
    most = [0, 0]

    def number(v: Any) -> None:
        if isinstance(v, bool):
            return
        if isinstance(v, int):  # (before isfinite: an int past a double's range overflows it)
            most[0] = max(most[0], len(str(abs(v))))
            return
        if not isinstance(v, float) or not math.isfinite(v):
            return
        d = decimal.Decimal(repr(v)).normalize()
        sign, digits, exp = d.as_tuple()
        assert isinstance(exp, int)
        most[0] = max(most[0], len(digits) + exp)
        most[1] = max(most[1], -exp)

    def value(v: Any) -> None:  # (a const or enum value: any JSON)
        if isinstance(v, dict):
            for x in v.values():
                value(x)
        elif isinstance(v, list):
            for x in v:
                value(x)
        else:
            number(v)

    def walk(node: Any, names: bool = False) -> None:
        if isinstance(node, dict):
            for key, v in node.items():
                if names:  # (a property's or a definition's name: its value is a subschema)
                    walk(v)
                elif key in _NUMERIC_KEYWORDS:
                    number(v)
                elif key == "const" or (key == "enum" and isinstance(v, list)):
                    value(v)
                else:
                    walk(v, key in NAMED_SUBSCHEMAS)
        elif isinstance(node, list):
            for x in node:
                walk(x)

    walk(schema)
    return most[0], most[1]


class TokenTable:
    """What the readers need of a vocabulary's tokens, made once (vectorized: ~20 ms for 49k
    tokens) and shared by every set of limits: each token's bytes (None or b"" for a token that
    never appears in JSON text), whether it has bytes but none that ends a string or is read in
    a number (most tokens), whether it has bytes but no quote or backslash (a string's text goes
    on), a digit, and whether it begins with an exponent's letter."""

    def __init__(self, token_bytes: Sequence[bytes | None]) -> None:
        self.bytes = [b or b"" for b in token_bytes]
        self.size = len(self.bytes)
        lengths = np.fromiter((len(b) for b in self.bytes), dtype=np.int64, count=self.size)
        ends = np.cumsum(lengths)
        starts = ends - lengths
        data = np.frombuffer(b"".join(self.bytes), dtype=np.uint8)

        def count(table: np.ndarray) -> np.ndarray:  # per token: its bytes in `table`
            running = np.concatenate(([0], np.cumsum(table[data], dtype=np.int64)))
            return running[ends] - running[starts]

        special = np.zeros(256, dtype=np.int64)
        special[list(_SPECIAL)] = 1
        digit = np.zeros(256, dtype=np.int64)
        digit[0x30:0x3A] = 1
        self.plain: list[bool] = ((count(special) == 0) & (lengths > 0)).tolist()
        quote = np.zeros(256, dtype=np.int64)
        quote[[_QUOTE, _BACKSLASH]] = 1
        self.in_string: list[bool] = ((count(quote) == 0) & (lengths > 0)).tolist()
        self.has_digit = count(digit) > 0
        first = np.where(lengths > 0, data[np.minimum(starts, max(len(data) - 1, 0))], 0)
        self.exponent_first = (first == 0x65) | (first == 0x45)


class NumberDigits:
    """The JSON reader and the masks for one vocabulary (a TokenTable) and one set of limits.
    Shared by every matcher of the grammars with those limits; its tables fill as states and
    tokens are met."""

    def __init__(self, table: TokenTable, limits: DigitLimits) -> None:
        self.limits = limits
        inf = 1 << 30
        self._most = {
            INT: limits.integer if limits.integer > 0 else inf,
            FRAC: limits.fraction if limits.fraction >= 0 else inf,
            EXP: limits.exponent if limits.exponent > 0 else inf,
        }
        self._no_exponent = limits.exponent == 0
        # digits past every limit read alike (a long constant the grammar forces)
        self._cap = 1 + max((v for v in self._most.values() if v < inf), default=0)
        self._bytes = table.bytes
        self._plain = table.plain
        self._in_string = table.in_string
        self._words = bitmask_words(table.size)
        # the tokens that can take a number past a limit: those with a digit (and, where
        # exponents are refused, those that begin one)
        risky = table.has_digit | (table.exponent_first if self._no_exponent else False)
        self._risky = np.flatnonzero(risky).tolist()
        self._after: dict[tuple[int, int], tuple[int, bool]] = {}
        self._keep: dict[int, np.ndarray | None] = {}
        self._lock = threading.Lock()

    def after(self, state: int, token: int) -> tuple[int, bool]:
        """The state after `token` from `state`, and whether it wrote more digits than allowed."""
        phase = state & 7
        if phase in (STR, ESC):  # (an escape takes the token's first byte; the rest is text)
            if self._in_string[token]:
                return STR, False
        elif self._plain[token]:
            return OUT, False
        key = (state, token)
        got = self._after.get(key)
        if got is None:
            got = self._after[key] = self.after_bytes(state, self._bytes[token])
        return got

    def after_bytes(self, state: int, data: bytes) -> tuple[int, bool]:
        """`after` for any bytes."""
        phase, digits, refused = state & 7, state >> 3, False
        most, cap = self._most, self._cap
        for c in data:
            if phase == STR:
                if c == _BACKSLASH:
                    phase = ESC
                elif c == _QUOTE:
                    phase = OUT
                continue
            if phase == ESC:
                phase = STR
                continue
            if phase != OUT:  # in a number
                if 0x30 <= c <= 0x39:
                    digits += 1
                    if digits > most[phase]:
                        refused = True
                    digits = min(digits, cap)
                    continue
                if c == _DOT and phase == INT:
                    phase, digits = FRAC, 0
                    continue
                if (c == 0x65 or c == 0x45) and phase != EXP:
                    phase, digits = EXP, 0
                    refused = refused or self._no_exponent
                    continue
                if c in (_PLUS, _MINUS) and phase == EXP and digits == 0:
                    continue
                phase, digits = OUT, 0  # the number ended: this byte is read outside it
            if c == _QUOTE:
                phase = STR
            elif c == _MINUS:
                phase, digits = INT, 0
            elif 0x30 <= c <= 0x39:
                phase, digits = INT, 1
                refused = refused or digits > most[INT]
        return phase | (digits << 3), refused

    def keep(self, state: int) -> np.ndarray | None:
        """The (W,) int32 mask of the tokens allowed from `state` by the limits (None: all)."""
        try:
            return self._keep[state]
        except KeyError:
            pass
        with self._lock:
            if state not in self._keep:
                self._keep[state] = self._make_keep(state)
            return self._keep[state]

    def _make_keep(self, state: int) -> np.ndarray | None:
        # (in a string too: a token may end it and begin a number, `":123` in some vocabularies)
        refused = [t for t in self._risky if self.after_bytes(state, self._bytes[t])[1]]
        if not refused:
            return None
        bits = np.ones(self._words * 32, dtype=bool)
        bits[refused] = False
        return np.packbits(bits, bitorder="little").view(np.int32).copy()


def hold(row: np.ndarray, keep: np.ndarray) -> None:
    """`row &= keep` in place (a (W,) int32 mask row), unless that leaves no token: where the
    grammar allows nothing but more digits, it keeps them."""
    held = row & keep
    if held.any():
        np.copyto(row, held)
