"""EBNF grammars (GBNF syntax) whose rules do not recurse, inlined into one regex.

    root   ::= "The answer is " answer "."
    answer ::= "yes" | "no" | [0-9]+    # comments run to the end of the line

Supported: `name ::= ...` rules (the start rule is `root`, else the first one), string literals
with escapes, character classes (`[a-z]`, `[^"\\\\]`), `.`, grouping, `|`, and the quantifiers
`* + ? {m} {m,} {m,n}`. A rule that refers back to itself (directly or not) makes the language
context-free, which a regex cannot express: such grammars are refused, unless `max_depth` allows
unrolling the recursion that many levels (a rule may be open inside itself at most `max_depth`
times). The unrolled language is a subset of the grammar's, so every output still belongs to the
grammar; deeper nesting is never generated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from radixlm.constrained import regex_text as rt
from radixlm.constrained.errors import GrammarError

# larger unrolled grammars are refused (the automaton builder would choke on them anyway)
MAX_UNROLLED_CHARS = 1_000_000

_RULE_START = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_-]*)\s*::=", re.MULTILINE)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
_ESCAPES = {
    "n": "\n",
    "t": "\t",
    "r": "\r",
    "\\": "\\",
    '"': '"',
    "'": "'",
    "[": "[",
    "]": "]",
    "-": "-",
    "^": "^",
    "/": "/",
}


@dataclass
class _Parser:
    text: str
    pos: int = 0

    def error(self, what: str) -> GrammarError:
        line = self.text.count("\n", 0, self.pos) + 1
        return GrammarError(f"EBNF syntax error at line {line}: {what}")

    def skip(self) -> None:
        while self.pos < len(self.text):
            c = self.text[self.pos]
            if c == "#":
                end = self.text.find("\n", self.pos)
                self.pos = len(self.text) if end < 0 else end
            elif c.isspace():
                self.pos += 1
            else:
                break

    def peek(self) -> str:
        self.skip()
        return self.text[self.pos] if self.pos < len(self.text) else ""


def _parse_rules(text: str) -> tuple[dict[str, str], str]:
    starts = list(_RULE_START.finditer(text))
    if not starts:
        raise GrammarError("EBNF grammar has no rules (expected `name ::= ...`)")
    bodies: dict[str, str] = {}
    for i, m in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(text)
        name = m.group(1)
        if name in bodies:
            raise GrammarError(f"EBNF rule {name!r} is defined twice")
        bodies[name] = text[m.end() : end]
    start = "root" if "root" in bodies else starts[0].group(1)
    return bodies, start


def ebnf_to_regex(text: str, max_depth: int = 0) -> str:
    """The regex of an EBNF grammar; GrammarError for anything it cannot express.

    max_depth: how many times a rule may be open inside itself (0: recursive grammars are
    refused). References nested deeper are the empty language, so their alternatives drop out.
    """
    bodies, start = _parse_rules(text)
    done: dict[tuple[str, tuple[tuple[str, int], ...]], rt.Regex] = {}

    def rule(name: str, stack: tuple[str, ...]) -> rt.Regex:
        open_ = stack.count(name)
        if open_ and max_depth <= 0:
            cycle = " -> ".join((*stack[stack.index(name) :], name))
            raise GrammarError(
                f"EBNF rule {name!r} is recursive ({cycle}): context-free grammars are not "
                "supported; use a regex or a json_schema, unroll the recursion yourself, or let "
                "the engine unroll it (ebnf_recursion_depth)"
            )
        if open_ > max_depth:
            return None  # nested too deep: this branch is not generated
        # what a rule expands to depends only on how often each rule is open around it
        key = (name, tuple(sorted((n, stack.count(n)) for n in set(stack))))
        if key not in done:
            if name not in bodies:
                raise GrammarError(f"EBNF rule {name!r} is used but never defined")
            p = _Parser(bodies[name])
            r = _alternatives(p, lambda n: rule(n, (*stack, name)))
            if p.peek():
                raise p.error(f"unexpected {p.peek()!r} in rule {name!r}")
            if r is not None and len(r) > MAX_UNROLLED_CHARS:
                raise GrammarError(
                    f"the EBNF grammar unrolled {max_depth} levels deep is a regex of more than "
                    f"{MAX_UNROLLED_CHARS} characters; unroll fewer levels"
                )
            done[key] = r
        return done[key]

    regex = rule(start, ())
    if regex is None:
        if max_depth > 0:
            raise GrammarError(
                f"no string of the EBNF grammar nests its recursion at most {max_depth} levels "
                "deep (or it matches nothing)"
            )
        raise GrammarError("the EBNF grammar matches nothing")
    return regex


def _alternatives(p: _Parser, ref) -> rt.Regex:
    branches = [_sequence(p, ref)]
    while p.peek() == "|":
        p.pos += 1
        branches.append(_sequence(p, ref))
    return rt.alt(branches)


def _sequence(p: _Parser, ref) -> rt.Regex:
    parts: list[rt.Regex] = []
    while p.peek() not in ("", "|", ")"):
        parts.append(_quantified(p, ref))
    return rt.seq(*parts) if parts else ""


def _quantified(p: _Parser, ref) -> rt.Regex:
    atom = _atom(p, ref)
    while True:
        c = p.text[p.pos] if p.pos < len(p.text) else ""
        if c == "*":
            p.pos += 1
            atom = rt.repeat(atom, 0, None)
        elif c == "+":
            p.pos += 1
            atom = rt.repeat(atom, 1, None)
        elif c == "?":
            p.pos += 1
            atom = rt.repeat(atom, 0, 1)
        elif c == "{":
            m = re.compile(r"\{\s*(\d+)\s*(,\s*(\d*)\s*)?\}").match(p.text, p.pos)
            if not m:
                raise p.error("bad repetition {m,n}")
            p.pos = m.end()
            lo = int(m.group(1))
            hi = lo if m.group(2) is None else (int(m.group(3)) if m.group(3) else None)
            atom = rt.repeat(atom, lo, hi)
        else:
            return atom


def _atom(p: _Parser, ref) -> rt.Regex:
    c = p.peek()
    if c in ('"', "'"):
        text = _string(p, c)
        if not rt.generable(text):
            raise p.error("string literals may not contain surrogates or plane-16 characters")
        return rt.lit(text)
    if c == "[":
        return rt.class_regex(_char_class(p))
    if c == "(":
        p.pos += 1
        inner = _alternatives(p, ref)
        if p.peek() != ")":
            raise p.error("missing ')'")
        p.pos += 1
        return rt.group(inner) if inner else inner  # None (no string) stays None, "" stays ""
    if c == ".":
        p.pos += 1
        return rt.class_regex(rt.ANY_CHAR)
    m = _NAME.match(p.text, p.pos)
    if m:
        p.pos = m.end()
        r = ref(m.group(0))
        return rt.group(r) if r else r
    raise p.error(f"unexpected {c!r}" if c else "unexpected end of rule")


def _escape(p: _Parser) -> str:
    c = p.text[p.pos]
    p.pos += 1
    if c in "xuU":
        n = {"x": 2, "u": 4, "U": 8}[c]
        digits = p.text[p.pos : p.pos + n]
        if len(digits) != n or not all(ch in "0123456789abcdefABCDEF" for ch in digits):
            raise p.error(f"bad \\{c} escape")
        p.pos += n
        return chr(int(digits, 16))
    if c in _ESCAPES:
        return _ESCAPES[c]
    raise p.error(f"unknown escape \\{c}")


def _string(p: _Parser, quote: str) -> str:
    p.pos += 1
    out = []
    while True:
        if p.pos >= len(p.text):
            raise p.error("unterminated string")
        c = p.text[p.pos]
        p.pos += 1
        if c == quote:
            return "".join(out)
        out.append(_escape(p) if c == "\\" else c)


def _char_class(p: _Parser) -> rt.CharSet:
    p.pos += 1
    negate = p.pos < len(p.text) and p.text[p.pos] == "^"
    if negate:
        p.pos += 1
    ranges: list[tuple[int, int]] = []
    first = True
    while True:
        if p.pos >= len(p.text):
            raise p.error("unterminated character class")
        c = p.text[p.pos]
        if c == "]" and not first:
            p.pos += 1
            break
        p.pos += 1
        lo = _escape(p) if c == "\\" else c
        hi = lo
        if p.pos + 1 < len(p.text) and p.text[p.pos] == "-" and p.text[p.pos + 1] != "]":
            p.pos += 1
            c2 = p.text[p.pos]
            p.pos += 1
            hi = _escape(p) if c2 == "\\" else c2
            if ord(hi) < ord(lo):
                raise p.error(f"bad range {lo!r}-{hi!r}")
        ranges.append((ord(lo), ord(hi)))
        first = False
    s = rt.normalize(ranges)
    return rt.complement(s) if negate else s
