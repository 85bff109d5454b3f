"""An output constraint held to the answer of a reasoning model, after its thinking.

With `--reasoning-parser`, a model thinks (`<think>...</think>`) before it answers; a grammar
that held the output from its first token would leave it no room to. `hold_after_thinking`
rewrites a request's one constraint into the thinking, free, then the constraint:

| constraint | held after the thinking as |
|---|---|
| `json_schema` (a response_format, a demanded call in the default format) | a regex: the thinking's, then the schema's, where a regex holds the schema whole |
| `regex` | the thinking's regex, then the user's regex (read as the engine reads it) |
| `ebnf` | the grammar with a new `root`: the thinking, then the grammar's own start rule |
| `structural_tag` | itself with a `thinking` (its markers): the thinking, in which no trigger opens a section, then the tag's free text and sections (the llguidance backend) |

Where it cannot (a schema no regex holds whole, a regex the engine would refuse), the constraint
holds from the first token and the output is all answer, as before.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
from typing import Any

from radixlm.protocol.reasoning import ReasoningParser
from radixlm.server.tools import answer_after_thinking_regex, thinking_prefix


def hold_after_thinking(
    params: dict[str, Any], parser: ReasoningParser, whitespace: str, user_regex: bool = True
) -> bool:
    """Let the thinking come before the constraint `params` carry (rewritten in place); False
    where the constraint cannot be written so (it then holds from the first token). A `regex`
    the server built itself (`user_regex` false: a forced call's, the tools') is in the
    engine's dialect already."""
    if "structural_tag" in params:
        return _structural_tag_after_thinking(params, parser)
    if "json_schema" in params:
        with contextlib.suppress(ValueError):
            params["regex"] = answer_after_thinking_regex(parser, params["json_schema"], whitespace)
            del params["json_schema"]
            return True
        return False
    if "regex" in params:
        try:
            answer = _translated(params["regex"]) if user_regex else params["regex"]
        except ValueError:  # (the engine refuses it, saying why, as without thinking)
            return False
        params["regex"] = f"{thinking_prefix(parser)}(?:{answer})"
        return True
    if "ebnf" in params:
        params["ebnf"] = ebnf_after_thinking(params["ebnf"], parser)
        return True
    return False


def _structural_tag_after_thinking(params: dict[str, Any], parser: ReasoningParser) -> bool:
    """The structural tag with the thinking before it, as the llguidance backend reads it
    (`structural_tag_thinking`); False for one that is not a JSON object (the engine refuses
    it, saying why)."""
    try:
        tag = json.loads(params["structural_tag"])
    except (TypeError, ValueError):
        return False
    if not isinstance(tag, dict):
        return False
    tag["thinking"] = {"begin": parser.start, "end": parser.end, "forced": parser.forced}
    params["structural_tag"] = json.dumps(tag)
    return True


@functools.lru_cache(maxsize=64)
def _translated(regex: str) -> str:
    """A regex as the engine reads it (full match, its classes spelled out), to be put after the
    thinking's: its anchors and inline flags would mean something else there."""
    # (the grammar package loads torch: imported here, so the HTTP process starts without it)
    from radixlm.constrained.pattern import translate_regex

    return translate_regex(regex)


# ---- EBNF (GBNF syntax, as `constrained/ebnf.py` and llguidance read it) -------------------

_RULE_START = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_-]*)\s*::=", re.MULTILINE)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")


def ebnf_after_thinking(grammar: str, parser: ReasoningParser) -> str:
    """`grammar` with a new start rule: the thinking, then the grammar's own start (`root`,
    renamed, else its first rule). The grammar's lines stay where they were (the new rules come
    last), so an error in it is reported at its own line."""
    names = [m.group(1) for m in _RULE_START.finditer(grammar)]
    if not names:
        return grammar  # (no rules: the engine says so)

    def fresh(base: str) -> str:
        name, k = base, 1
        while name in names:
            name, k = f"{base}-{k}", k + 1
        names.append(name)
        return name

    start = "root" if "root" in names else names[0]
    if start == "root":
        start = fresh("answer")
        grammar = _renamed(grammar, "root", start)
    thinking = fresh("thinking")
    return f"{grammar.rstrip()}\n{thinking} ::= {_thinking_ebnf(parser)}\nroot ::= {thinking} {start}\n"


def _renamed(grammar: str, old: str, new: str) -> str:
    """`grammar` with the rule name `old` written `new` (in its definition and every reference;
    not in strings, character classes or comments)."""
    out, i, n = [], 0, len(grammar)
    while i < n:
        c = grammar[i]
        if c == "#":
            end = grammar.find("\n", i)
            end = n if end == -1 else end
        elif c in "\"'[":
            close = "]" if c == "[" else c
            end = i + 1
            while end < n and grammar[end] != close:
                end += 2 if grammar[end] == "\\" else 1
            end = min(end + 1, n)
        elif (m := _NAME.match(grammar, i)) is not None:
            end = m.end()
            if m.group() == old:
                out.append(new)
                i = end
                continue
        else:
            end = i + 1
        out.append(grammar[i:end])
        i = end
    return "".join(out)


def _thinking_ebnf(parser: ReasoningParser) -> str:
    """The thinking an output may open with, in GBNF: `thinking_prefix`'s language."""
    body = f"{_ebnf_text_without(parser.end)} {_literal(parser.end)} [ \\n]*"
    if parser.forced:
        return f"{_literal(parser.start)}? {body}"
    return f"({_literal(parser.start)} {body})?"


def _ebnf_text_without(marker: str) -> str:
    """Every text without `marker` in it (whose first character occurs only there), in GBNF:
    the automaton of `tools._text_without`, written out."""
    if marker[0] in marker[1:]:
        raise ValueError("the marker's first character must not recur in it")
    first = _literal(marker[0])

    def then(j: int, last: str) -> str:  # marker[1:j], then `last`
        return f"{_literal(marker[1:j])} {last}" if j > 1 else last

    again = " | ".join(then(j, first) for j in range(1, len(marker)))
    out = " | ".join(then(j, _other_than(marker[0] + marker[j])) for j in range(1, len(marker)))
    partial = " | ".join(_literal(marker[1:j]) for j in range(2, len(marker)))
    tail = f"{first} ({again})* ({partial})?" if partial else f"{first} ({again})*"
    return f"({_other_than(marker[0])} | {first} ({again})* ({out}))* ({tail})?"


def _literal(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def _other_than(chars: str) -> str:
    escaped = "".join("\\" + c if c in "\\]^-[" else c for c in dict.fromkeys(chars))
    return f"[^{escaped}]"
