"""Tool-call formats of model families, under SGLang's `--tool-call-parser` names.

A parser knows one family's way of writing calls: it finds them in an output (the whole text at
once, or as the text arrives while streaming), writes a call in that format (earlier turns, for a
template without tool support), and supplies the regex that forces a call in that format when a
request demands one (`tool_choice` "required" or a named tool), its arguments held to the tool's
parameter schema.

| name | a call |
|---|---|
| `hermes`, `qwen25` | `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, one block per call |
| `llama3` | `{"name": "f", "parameters": {...}}` (after `<|python_tag|>` or as the answer), `;` between |
| `pythonic` | `[f(a=1, b="x"), g()]` (Llama 3.2/4; read as Python literals, never evaluated) |
| `mistral` | `[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]` |
| `deepseekv3` | `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\\n```json\\n{...}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>` |

One rule for all, streamed or whole. A call counts from the moment its name (an offered tool) and
the beginning of its arguments are in: its arguments are then streamed as they are generated, as
OpenAI streams them (a first delta with the call's index, id and name, then pieces of the
arguments' text), and only what can no longer change is sent: a JSON family's arguments are their
JSON text as generated, sent as far as it is a valid beginning of a JSON object; a pythonic call's
are the JSON of its keyword arguments, each sent once its value (a string: each character) is
read. A call cut off there (max_tokens) or broken off by text no call can hold keeps the arguments
it got, so the finished output has every call the stream sent, with the same arguments, and
parsing it whole gives what streaming it in any pieces gives. Text that is not yet known to be a
call or not (the start of a call marker, a name not complete yet) is held back until it is known;
anything that is no call (a name no tool has, a block of other text) stays content. Whitespace
between content and a call belongs to the call.
"""

from __future__ import annotations

import ast
import functools
import json
import keyword
import logging
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

logger = logging.getLogger("radixlm.server")


@dataclass(frozen=True)
class ToolCallItem:
    name: str
    arguments: str  # the JSON text of an object (so far, in a call cut off)


@dataclass(frozen=True)
class ParseResult:
    normal_text: str
    calls: list[ToolCallItem]


class _Incomplete:
    """A call region not known yet to be one or not."""


INCOMPLETE = _Incomplete()


@dataclass(frozen=True)
class _Region:
    end: int  # where the call region ends in the text (while open: the end of the text)
    calls: list[ToolCallItem]  # at least one; while open, the last may still grow
    open: bool = False  # more of the region may arrive (never when the output is finished)


@dataclass(frozen=True)
class _Read:
    """Calls read from some place: how far they go and how they stopped there ("done": at their
    end; "open": the text ends inside them; "broken": `end` is where text they cannot hold
    begins)."""

    calls: list[ToolCallItem]
    end: int
    state: str


# scanners of JSON values by where they start, kept across the steps of one stream
# (and of Python strings, for the pythonic format)
_Memo = dict[int, Any]


class ToolCallParser(ABC):
    """One family's tool-call format. Subclasses set `names`, `markers` and `starts`, and write
    `_region` (read the calls of a region that starts at a given place), `format_call` and
    `_forced` (the regex of a forced output)."""

    names: ClassVar[tuple[str, ...]]  # SGLang's names for it
    # texts that, in a chat template, show that the model writes calls this way (for "auto")
    markers: ClassVar[tuple[str, ...]] = ()
    # texts that open a call region (a suffix of the output that begins one is held back)
    starts: ClassVar[tuple[str, ...]] = ()

    @property
    def name(self) -> str:
        return self.names[0]

    def parse(self, text: str, tools: set[str]) -> ParseResult:
        """The content and the calls of a finished output."""
        scan = _Scan(self, tools)
        normal = scan.step(text, final=True)
        return ParseResult(normal, list(scan.calls))

    def stream(self, tools: set[str]) -> ToolCallStream:
        """An incremental parse of an output that arrives in pieces."""
        return ToolCallStream(_Scan(self, tools))

    def _next_start(self, text: str, pos: int, at_start: bool, after_call: bool) -> int:
        """Where the next call region may begin at or after `pos` (-1: nowhere yet)."""
        found = [i for i in (text.find(s, pos) for s in self.starts) if i != -1]
        return min(found, default=-1)

    def _partial_start(self, text: str, pos: int) -> int:
        """The length of the longest suffix of `text[pos:]` that may begin a call region."""
        best = 0
        for marker in self.starts:
            for k in range(min(len(marker) - 1, len(text) - pos), best, -1):
                if text.endswith(marker[:k]):
                    best = k
                    break
        return best

    @abstractmethod
    def _region(
        self, text: str, start: int, tools: set[str], final: bool, memo: _Memo
    ) -> _Region | _Incomplete | None:
        """The calls of the region at `start`: INCOMPLETE while it is not known to hold a call
        (never when `final`), None if it holds none (its text is content). Read again from
        `start` as more text arrives, it gives the same calls, their arguments only extended."""

    @abstractmethod
    def format_call(self, name: str, arguments: dict[str, Any]) -> str:
        """A call as the model writes it (earlier turns, for a template without tools)."""

    def format_calls(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        return "\n".join(self.format_call(n, a) for n, a in calls)

    def instructions(self, mode: str, name: str | None, parallel: bool) -> str:
        """How to call, for the system prompt."""
        example = self.format_call(name or "<function name>", {"<argument>": "<value>"})
        if mode == "named":
            return (
                f'Call the function "{name}" now. Reply with only the call, written as\n{example}'
            )
        if mode == "required":
            many = " one or more of" if parallel else " one of"
            return f"Call{many} these functions now. Reply with only the calls, each written as\n{example}"
        return (
            f"To call a function, write the call as\n{example}\n"
            "the arguments following the function's parameter schema. If no function helps, "
            "answer directly."
        )

    def forced_regex(
        self, offered: list[dict[str, Any]], one: bool, whitespace: str = "compact"
    ) -> str:
        """The regex of an output of calls of the `offered` tools ({"type": "function",
        "function": ...}) in this format, each call's arguments following its tool's parameter
        schema: exactly one call if `one`, else one or more. GrammarError (a ValueError) for a
        schema it cannot enforce exactly. Built once per tool set."""
        tools = json.dumps([t["function"] for t in offered], ensure_ascii=False)
        return _forced_regex(self.name, tools, one, whitespace)

    @abstractmethod
    def _forced(self, calls: list[tuple[str, str]], one: bool, whitespace: str) -> str:
        """The forced output's regex, from (name, arguments' regex) of each offered tool."""

    def _arguments_regex(self, function: dict[str, Any], whitespace: str) -> str:
        return _json_arguments_regex(json.dumps(function["parameters"]), whitespace)


class ToolCallStream:
    """The content and tool-call deltas of an output as it arrives, in OpenAI's `tool_calls`
    delta shape: a call's first delta has its `index`, `id`, `type` and `function.name` (with
    empty arguments), the next ones its `index` and a piece of `function.arguments`; the pieces
    of a call add up to the arguments parsing the finished output gives."""

    def __init__(self, scan: _Scan) -> None:
        self._scan = scan
        self._sent: list[str] = []  # each call's arguments sent so far

    @property
    def count(self) -> int:
        """Calls sent."""
        return len(self._sent)

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """(the new content, the new tool-call deltas) for the output so far (`final`: all of
        it)."""
        normal = self._scan.step(text, final)
        deltas: list[dict[str, Any]] = []
        # (a call's arguments are whole once the next call has begun)
        for index in range(max(len(self._sent) - 1, 0), len(self._scan.calls)):
            call = self._scan.calls[index]
            if index == len(self._sent):
                self._sent.append("")
                deltas.append(
                    {
                        "index": index,
                        "id": new_call_id(),
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                )
            sent = self._sent[index]
            if len(call.arguments) > len(sent):
                if not call.arguments.startswith(sent):  # (the parsers never take text back)
                    raise RuntimeError(f"tool call {index}'s arguments changed once sent")
                deltas.append(
                    {"index": index, "function": {"arguments": call.arguments[len(sent) :]}}
                )
                self._sent[index] = call.arguments
        return normal, deltas


class _Scan:
    """Walks an output from its start, deciding what is content and what is a call only where
    the text seen so far settles it (the part undecided, and a call region still arriving, is
    read again with more text).

    Whitespace is held back until what follows it is known: whitespace before the first call
    with no content before it, and after the last call with no content after it, is the calls';
    whitespace between content and a call in the middle stays content."""

    def __init__(self, parser: ToolCallParser, tools: set[str]) -> None:
        self.parser = parser
        self.tools = tools
        self.pos = 0  # the text before this is decided (an open region starts here)
        self.held = ""  # decided whitespace not handed out yet
        self.content_started = False
        self.call_since_content = False
        self.calls: list[ToolCallItem] = []  # found so far; the open region's last may grow
        self._settled = 0  # calls of regions that have ended
        self._memo: _Memo = {}

    def step(self, text: str, final: bool) -> str:
        """The new content; `calls` is brought up to date."""
        normal: list[str] = []
        search = self.pos  # where the next region may start (past regions that were not)
        while True:
            fresh = search == self.pos  # (no region was turned down since the decided text)
            at_start = fresh and not self.content_started and not self.call_since_content
            after_call = fresh and self.call_since_content
            start = self.parser._next_start(text, search, at_start, after_call)
            if start == -1:
                end = len(text) if final else len(text) - self.parser._partial_start(text, search)
                normal.append(self._content(text[self.pos : max(end, self.pos)]))
                self.pos = max(end, self.pos)
                if final:
                    normal.append("" if self.call_since_content else self.held)
                    self.held = ""
                return "".join(normal)
            region = self.parser._region(text, start, self.tools, final, self._memo)
            if region is INCOMPLETE:
                normal.append(self._content(text[self.pos : start]))
                self.pos = start
                return "".join(normal)
            if region is None:  # no call: its first character is content; search on after it
                search = start + 1
                continue
            assert isinstance(region, _Region)
            normal.append(self._content(text[self.pos : start]))
            self.pos = start
            self.calls[self._settled :] = region.calls
            if region.open:  # (read again from its start with more text)
                return "".join(normal)
            if not self.content_started:
                self.held = ""  # whitespace the output opens with, before a call
            self._settled = len(self.calls)
            self.pos = search = region.end
            self.call_since_content = True
            self._memo.clear()

    def _content(self, piece: str) -> str:
        """`piece` decided as content, less the whitespace it ends with (held back)."""
        piece = self.held + piece
        shown = piece.rstrip()
        self.held = piece[len(shown) :]
        if shown:
            self.content_started = True
            self.call_since_content = False
        return shown


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ---- reading JSON as it arrives ------------------------------------------------------------


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]*')
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
# a JSON number, character by character: state -> (class of character -> next state)
_NUMBER = {
    "sign": {"0": "zero", "1": "int"},
    "zero": {".": "dot", "e": "e"},
    "int": {"0": "int", "1": "int", ".": "dot", "e": "e"},
    "dot": {"0": "frac", "1": "frac"},
    "frac": {"0": "frac", "1": "frac", "e": "e"},
    "e": {"+": "esign", "0": "exp", "1": "exp"},
    "esign": {"0": "exp", "1": "exp"},
    "exp": {"0": "exp", "1": "exp"},
}
_NUMBER_ENDS = {"zero", "int", "frac", "exp"}


def _number_class(c: str) -> str:
    if c == "0":
        return "0"
    if "1" <= c <= "9":
        return "1"
    if c in "eE":
        return "e"
    if c in "+-":
        return "+"
    return c


class _JsonScanner:
    """One JSON value read from `start` as its text arrives (the text only ever grows), checked
    as strictly as `json.loads` reads it: `state` "done" (it ends at `pos`), "open" (all of the
    text so far, up to `pos`, begins a valid value) or "broken" (`pos` is the first character
    no valid value can have there)."""

    def __init__(self, start: int) -> None:
        self.start = self.pos = start
        self.state = "open"
        self._stack: list[str] = []  # the open containers, "{" or "["
        self._mode = "value"
        self._key = False  # the string being read is an object's key
        self._escape = 0  # in a string: -1 after a backslash, k > 0: hex digits of \\u to come
        self._number = ""
        self._literal = ""  # the rest of true, false or null

    def advance(self, text: str) -> _JsonScanner:
        i, n = self.pos, len(text)
        while i < n and self.state == "open":
            c, mode = text[i], self._mode
            if mode == "string":
                if self._escape == 0:
                    i = _STRING_RUN.match(text, i).end()  # type: ignore[union-attr]
                    if i == n:
                        break
                    c = text[i]
                    if c == '"':
                        i += 1
                        if self._key:
                            self._mode = "colon"
                        else:
                            self._value_done(i)
                        continue
                    if c != "\\":
                        self._break(i)  # a control character
                        break
                    self._escape = -1
                elif self._escape == -1:
                    if c == "u":
                        self._escape = 4
                    elif c in '"\\/bfnrt':
                        self._escape = 0
                    else:
                        self._break(i)
                        break
                elif c in "0123456789abcdefABCDEF":
                    self._escape -= 1
                else:
                    self._break(i)
                    break
                i += 1
            elif mode == "number":
                step = _NUMBER[self._number].get(_number_class(c))
                if step is not None:
                    self._number = step
                    i += 1
                elif self._number in _NUMBER_ENDS:
                    self._value_done(i)  # (the character after a number is read anew)
                else:
                    self._break(i)
            elif mode == "literal":
                if c != self._literal[0]:
                    self._break(i)
                    break
                self._literal = self._literal[1:]
                i += 1
                if not self._literal:
                    self._value_done(i)
            elif c in " \t\r\n":
                i += 1
            elif mode in ("value", "first_value"):
                i += 1
                if c == "]" and mode == "first_value":
                    self._stack.pop()
                    self._value_done(i)
                elif c == "{":
                    self._stack.append("{")
                    self._mode = "first_key"
                elif c == "[":
                    self._stack.append("[")
                    self._mode = "first_value"
                elif c == '"':
                    self._mode, self._key = "string", False
                elif c == "-" or "0" <= c <= "9":
                    self._mode = "number"
                    self._number = "sign" if c == "-" else "zero" if c == "0" else "int"
                elif c in _LITERALS:
                    self._mode, self._literal = "literal", _LITERALS[c]
                else:
                    self._break(i - 1)
            elif mode in ("key", "first_key"):
                i += 1
                if c == '"':
                    self._mode, self._key = "string", True
                elif c == "}" and mode == "first_key":
                    self._stack.pop()
                    self._value_done(i)
                else:
                    self._break(i - 1)
            elif mode == "colon":
                if c != ":":
                    self._break(i)
                    break
                self._mode = "value"
                i += 1
            else:  # "after": a value inside a container has ended
                closer = "}" if self._stack[-1] == "{" else "]"
                i += 1
                if c == ",":
                    self._mode = "key" if closer == "}" else "value"
                elif c == closer:
                    self._stack.pop()
                    self._value_done(i)
                else:
                    self._break(i - 1)
        if self.state == "open":
            self.pos = max(i, self.pos)
        return self

    def _value_done(self, i: int) -> None:
        if self._stack:
            self._mode = "after"
        else:
            self.state, self.pos = "done", i

    def _break(self, i: int) -> None:
        self.state, self.pos = "broken", i


def _json_at(text: str, i: int, memo: _Memo) -> _JsonScanner:
    """The JSON value at `i`, read as far as the text goes (its scanner kept in `memo`)."""
    scanner = memo.get(i)
    if scanner is None:
        scanner = memo[i] = _JsonScanner(i)
    return scanner.advance(text)


def _expect(text: str, i: int, literal: str, final: bool) -> int | _Incomplete | None:
    """After `literal` at `i`; INCOMPLETE if the text ends inside it, None if something else."""
    rest = text[i : i + len(literal)]
    if rest == literal:
        return i + len(literal)
    if literal.startswith(rest) and i + len(rest) == len(text):
        return None if final else INCOMPLETE
    return None


def _arriving(text: str, i: int, literal: str) -> bool:
    """Whether the text from `i` is all of it a beginning of `literal`."""
    return literal.startswith(text[i : i + len(literal)]) and i + len(literal) > len(text)


def _call_object(
    text: str, i: int, tools: set[str], keys: tuple[str, ...], final: bool, memo: _Memo
) -> _Read | _Incomplete | None:
    """A call written as the JSON object at `i`: `{"name": ..., <key>: {...}}` with one of
    `keys` for the arguments (an object, or a JSON string of one), in either order. It is a call
    once its name (an offered tool) is in and its arguments have begun; before that, INCOMPLETE
    while it may still become one, and None as soon as it cannot (a name no tool's begins with,
    a member other than those, `type` and `id`: a JSON answer is let go early). Other members
    after that are skipped."""
    n = len(text)
    name: str | None = None
    arguments: str | None = None  # their text so far
    members = ("name", *keys, "type", "id")

    def stop(state: str, at: int) -> _Read | _Incomplete | None:
        if name is not None and arguments is not None:
            return _Read([ToolCallItem(name, arguments)], at, state)
        return None if final or state == "broken" else INCOMPLETE

    def may_become(string: _JsonScanner, start: int, candidates: Iterable[str]) -> bool:
        """Whether the string arriving at `start` may still be one of `candidates`."""
        so_far = text[start + 1 : string.pos]
        return "\\" in so_far or any(c.startswith(so_far) for c in candidates)

    j = _skip_space(text, i + 1)
    while True:
        if j == n:
            return stop("open", n)
        if text[j] != '"':
            return stop("broken", j)
        key = _json_at(text, j, memo)
        committed = name is not None and arguments is not None
        if key.state == "open" and not committed and not may_become(key, j, members):
            return None
        if key.state != "done":
            return stop(key.state, key.pos)
        k = _skip_space(text, key.pos)
        if k == n:
            return stop("open", n)
        if text[k] != ":":
            return stop("broken", k)
        v = _skip_space(text, k + 1)
        if v == n:
            return stop("open", n)
        value = _json_at(text, v, memo)
        member = json.loads(text[j : key.pos])
        if member not in members and not committed:
            return None
        if member == "name" and name is None:
            if text[v] != '"' or value.state == "broken":
                return None
            if value.state == "open":
                return stop("open", n) if may_become(value, v, tools) else None
            name = json.loads(text[v : value.pos])
            if name not in tools:
                return None
        elif member in keys and arguments is None:
            if text[v] == "{":
                arguments = text[v : value.pos]
                if value.state != "done":
                    return stop(value.state, value.pos)
            elif text[v] == '"' and value.state == "done":
                decoded = json.loads(text[v : value.pos])
                if not isinstance(_loads(decoded), dict):
                    return None
                arguments = decoded.strip()
            elif text[v] == '"' and value.state == "open":
                return stop("open", n)
            else:
                return None
        elif value.state != "done":
            return stop(value.state, value.pos)
        j = _skip_space(text, value.pos)
        if j == n:
            return stop("open", n)
        if text[j] == "}":
            if name is None:
                return None
            return _Read([ToolCallItem(name, arguments or "{}")], j + 1, "done")
        if text[j] != ",":
            return stop("broken", j)
        j = _skip_space(text, j + 1)


def _call_list(
    text: str,
    i: int,
    read_call: Callable[[int], _Read | _Incomplete | None],
    sep: str,
    close: str,
    final: bool,
    memo: _Memo,
) -> _Read | _Incomplete | None:
    """Calls one after another from `i`, `sep` between them (may be ""), `close` after them: None
    unless the first is a call; after one, what is no call ends them ("broken" there). Read
    again with more text, it resumes after the calls a separator has settled (kept in `memo`)."""
    settled = memo.get(("calls", i))
    calls, last, j = (list(settled[0]), settled[1], settled[2]) if settled else ([], i, i)
    j = _skip_space(text, j)  # (last: where the calls read so far end)
    while True:
        if j == len(text):
            if not calls:
                return None if final else INCOMPLETE
            return _Read(calls, len(text), "open")
        read = read_call(j)
        if not isinstance(read, _Read):
            if not calls:
                return read
            if read is INCOMPLETE:
                return _Read(calls, len(text), "open")
            return _Read(calls, last, "broken")
        calls.extend(read.calls)
        if read.state != "done":
            return _Read(calls, read.end, read.state)
        last = read.end
        k = _skip_space(text, last)
        if text.startswith(close, k):
            return _Read(calls, k + len(close), "done")
        if k == len(text) or _arriving(text, k, close) or _arriving(text, k, sep):
            return _Read(calls, len(text), "open")
        if sep and not text.startswith(sep, k):
            return _Read(calls, last, "broken")
        memo["calls", i] = (list(calls), last, k + len(sep))  # (no more text changes these)
        j = _skip_space(text, k + len(sep))


def _region_of(read: _Read, text: str, close: str, final: bool) -> _Region:
    """The region of calls `read`, which `close` ends if given: after calls that are done, what
    is not `close` is no part of it; after a call broken off, the text up to `close` is."""
    n = len(text)
    if read.state == "open":
        return _Region(n, read.calls, open=not final)
    if not close:
        return _Region(read.end, read.calls)
    if read.state == "broken":
        found = text.find(close, read.end)
        if found == -1:
            return _Region(n, read.calls, open=not final)
        return _Region(found + len(close), read.calls)
    k = _skip_space(text, read.end)
    if text.startswith(close, k):
        return _Region(k + len(close), read.calls)
    if k == n or _arriving(text, k, close):
        return _Region(n, read.calls, open=not final)
    return _Region(read.end, read.calls)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


# ---- the families --------------------------------------------------------------------------


class HermesParser(ToolCallParser):
    """Hermes 2/3 and Qwen2.5/Qwen3: one `<tool_call>` block per call."""

    names = ("hermes", "qwen25", "qwen")
    markers = ("<tool_call>",)
    starts = ("<tool_call>",)
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def _region(self, text, start, tools, final, memo):
        i = _skip_space(text, start + len(self.OPEN))
        if i == len(text):
            return None if final else INCOMPLETE
        if text[i] != "{":
            return None
        read = _call_object(text, i, tools, ("arguments", "parameters"), final, memo)
        return _region_of(read, text, self.CLOSE, final) if isinstance(read, _Read) else read

    def format_call(self, name, arguments):
        body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"{self.OPEN}\n{body}\n{self.CLOSE}"

    def _forced(self, calls, one, whitespace):
        from radixlm.constrained import regex_text as rt

        call = rt.alt(
            rt.seq(rt.lit('{"name": ' + json.dumps(n) + ', "arguments": '), a, rt.lit("}"))
            for n, a in calls
        )
        block = rt.seq(rt.lit(self.OPEN + "\n"), call, rt.lit("\n" + self.CLOSE))
        return block if one else rt.seq(block, rt.star(rt.seq(rt.lit("\n"), block)))


class Llama3Parser(ToolCallParser):
    """Llama 3.1/3.2 JSON calls: `{"name": ..., "parameters": {...}}`, after `<|python_tag|>`
    or as the answer itself, several separated by `;`."""

    names = ("llama3",)
    markers = ("<|python_tag|>",)
    TAG = "<|python_tag|>"
    starts = (TAG,)

    def _next_start(self, text, pos, at_start, after_call):
        tagged = text.find(self.TAG, pos)
        i = _skip_space(text, pos)
        if i < len(text) and ((at_start and text[i] == "{") or (after_call and text[i] == ";")):
            return i if tagged == -1 else min(i, tagged)
        return tagged

    def _region(self, text, start, tools, final, memo):
        i = start
        if text.startswith(self.TAG, i):
            i += len(self.TAG)
        elif text[i] == ";":
            i += 1
        i = _skip_space(text, i)
        if i == len(text):
            return None if final else INCOMPLETE
        if text[i] != "{":
            return None
        read = _call_object(text, i, tools, ("parameters", "arguments"), final, memo)
        return _region_of(read, text, "", final) if isinstance(read, _Read) else read

    def format_call(self, name, arguments):
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)

    def format_calls(self, calls):
        return "; ".join(self.format_call(n, a) for n, a in calls)

    def _forced(self, calls, one, whitespace):
        from radixlm.constrained import regex_text as rt

        call = rt.alt(
            rt.seq(rt.lit('{"name": ' + json.dumps(n) + ', "parameters": '), a, rt.lit("}"))
            for n, a in calls
        )
        return call if one else rt.seq(call, rt.star(rt.seq(rt.lit("; "), call)))


class MistralParser(ToolCallParser):
    """Mistral (v0.3 tokenizers): `[TOOL_CALLS]` and a JSON array of calls."""

    names = ("mistral",)
    markers = ("[TOOL_CALLS]",)
    TAG = "[TOOL_CALLS]"
    starts = (TAG,)

    def _region(self, text, start, tools, final, memo):
        i = _skip_space(text, start + len(self.TAG))
        if i == len(text):
            return None if final else INCOMPLETE
        keys = ("arguments", "parameters")
        if text[i] == "{":
            read = _call_object(text, i, tools, keys, final, memo)
        elif text[i] == "[":

            def call(j: int) -> _Read | _Incomplete | None:
                return _call_object(text, j, tools, keys, final, memo) if text[j] == "{" else None

            read = _call_list(text, i + 1, call, ",", "]", final, memo)
            if isinstance(read, _Read) and read.state == "broken":
                # an item of the list that is no call: the list is still the calls' (to its end)
                items = _json_at(text, i, memo)
                if items.state == "done":
                    return _Region(items.pos, read.calls)
                if items.state == "open":
                    return _Region(len(text), read.calls, open=not final)
        else:
            return None
        return _region_of(read, text, "", final) if isinstance(read, _Read) else read

    def format_call(self, name, arguments):
        return self.format_calls([(name, arguments)])

    def format_calls(self, calls):
        items = [{"name": n, "arguments": a} for n, a in calls]
        return f"{self.TAG} {json.dumps(items, ensure_ascii=False)}"

    def _forced(self, calls, one, whitespace):
        from radixlm.constrained import regex_text as rt

        call = rt.alt(
            rt.seq(rt.lit('{"name": ' + json.dumps(n) + ', "arguments": '), a, rt.lit("}"))
            for n, a in calls
        )
        items = call if one else rt.seq(call, rt.star(rt.seq(rt.lit(", "), call)))
        return rt.seq(rt.lit(self.TAG + " ["), items, rt.lit("]"))


class DeepSeekV3Parser(ToolCallParser):
    """DeepSeek V3 (and R1-0528): calls between `<｜tool▁calls▁begin｜>` and
    `<｜tool▁calls▁end｜>`, each a type, the name and its arguments in a fenced JSON block."""

    names = ("deepseekv3",)
    markers = ("tool▁calls▁begin",)
    BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    FENCE = "\n```json\n"
    starts = (BEGIN,)

    def _region(self, text, start, tools, final, memo):
        read = _call_list(
            text,
            start + len(self.BEGIN),
            lambda j: self._call(text, j, tools, final, memo),
            "",
            self.END,
            final,
            memo,
        )
        return _region_of(read, text, self.END, final) if isinstance(read, _Read) else read

    def _call(self, text, i, tools, final, memo) -> _Read | _Incomplete | None:
        pending = None if final else INCOMPLETE
        head = _expect(text, i, f"{self.CALL_BEGIN}function{self.SEP}", final)
        if not isinstance(head, int):
            return head
        line_end = text.find("\n", head)
        if line_end == -1:  # the name is arriving: no tool's name begins so, no call
            return pending if any(t.startswith(text[head:]) for t in tools) else None
        name = text[head:line_end]
        if name not in tools:
            return None
        fenced = _expect(text, line_end, self.FENCE, final)
        if not isinstance(fenced, int):
            return fenced
        j = _skip_space(text, fenced)
        if j == len(text):
            return pending
        if text[j] != "{":
            return None
        arguments = _json_at(text, j, memo)
        call = [ToolCallItem(name, text[j : arguments.pos])]
        if arguments.state != "done":
            return _Read(call, arguments.pos, arguments.state)
        after = _expect(text, _skip_space(text, arguments.pos), "```" + self.CALL_END, final)
        if isinstance(after, int):
            return _Read(call, after, "done")
        if after is INCOMPLETE:
            return _Read(call, len(text), "open")
        return _Read(call, arguments.pos, "broken")

    def format_call(self, name, arguments):
        return self.format_calls([(name, arguments)])

    def format_calls(self, calls):
        body = "\n".join(
            f"{self.CALL_BEGIN}function{self.SEP}{n}\n```json\n"
            f"{json.dumps(a, ensure_ascii=False)}\n```{self.CALL_END}"
            for n, a in calls
        )
        return f"{self.BEGIN}{body}{self.END}"

    def _forced(self, calls, one, whitespace):
        from radixlm.constrained import regex_text as rt

        call = rt.alt(
            rt.seq(
                rt.lit(f"{self.CALL_BEGIN}function{self.SEP}{n}\n```json\n"),
                a,
                rt.lit(f"\n```{self.CALL_END}"),
            )
            for n, a in calls
        )
        items = call if one else rt.seq(call, rt.star(rt.seq(rt.lit("\n"), call)))
        return rt.seq(rt.lit(self.BEGIN), items, rt.lit(self.END))


class PythonicParser(ToolCallParser):
    """Llama 3.2 / Llama 4 pythonic calls: a Python list of calls with keyword arguments,
    `[get_weather(city="Paris"), f(x=1)]` (Llama 4 may wrap it in `<|python_start|>` ...
    `<|python_end|>`). Read as Python literals, never evaluated (JSON's `true`, `false` and
    `null` are read as Python's), and given as the JSON object of the keyword arguments."""

    names = ("pythonic",)
    markers = ("<|python_start|>",)
    OPEN, CLOSE = "<|python_start|>", "<|python_end|>"
    starts = (OPEN, "[")

    def _region(self, text, start, tools, final, memo):
        i = start
        wrapped = text.startswith(self.OPEN, i)
        if wrapped:
            i = _skip_space(text, i + len(self.OPEN))
            if i == len(text):
                return None if final else INCOMPLETE
        if text[i] != "[":
            return None
        read = _call_list(
            text, i + 1, lambda j: _python_call(text, j, tools, final, memo), ",", "]", final, memo
        )
        if not isinstance(read, _Read):
            return read
        return _region_of(read, text, self.CLOSE if wrapped else "", final)

    def format_call(self, name, arguments):
        return self.format_calls([(name, arguments)])

    def format_calls(self, calls):
        def call(name: str, arguments: dict[str, Any]) -> str:
            kwargs = ", ".join(
                f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in arguments.items()
            )
            return f"{name}({kwargs})"

        return "[" + ", ".join(call(n, a) for n, a in calls) + "]"

    def _arguments_regex(self, function, whitespace):
        return _kwargs_regex(json.dumps(function["parameters"]), whitespace)

    def _forced(self, calls, one, whitespace):
        from radixlm.constrained import regex_text as rt

        call = rt.alt(rt.seq(rt.lit(n + "("), a, rt.lit(")")) for n, a in calls)
        items = call if one else rt.seq(call, rt.star(rt.seq(rt.lit(", "), call)))
        return rt.seq(rt.lit("["), items, rt.lit("]"))


# ---- reading Python calls as they arrive ---------------------------------------------------

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _python_call(
    text: str, i: int, tools: set[str], final: bool, memo: _Memo
) -> _Read | _Incomplete | None:
    """The call `name(a=..., b=...)` at `i`, its keyword arguments as a JSON object. It is a call
    once its name (an offered tool) and `(` are in and its first argument's value has begun (or
    it has none): positional arguments, code, an unknown name are none."""
    n = len(text)
    pending = None if final else INCOMPLETE
    head = _IDENTIFIER.match(text, i)
    if head is None:
        return None
    if head.end() == n:
        return pending if any(t.startswith(head.group()) for t in tools) else None
    name = head.group()
    if text[head.end()] != "(" or name not in tools:
        return None
    parts = ["{"]  # the arguments' JSON, piece by piece

    def stop(state: str, at: int) -> _Read | _Incomplete | None:
        if len(parts) == 1:  # (no argument's value has begun: not known to be a call)
            return None if state == "broken" else pending
        return _Read([ToolCallItem(name, "".join(parts))], at, state)

    j = _skip_space(text, head.end() + 1)
    while True:
        if j == n:
            return stop("open", n)
        if text[j] == ")":
            parts.append("}")
            return _Read([ToolCallItem(name, "".join(parts))], j + 1, "done")
        if len(parts) > 1:
            if text[j] != ",":
                return stop("broken", j)
            j = _skip_space(text, j + 1)
            if j == n:
                return stop("open", n)
            if text[j] == ")":
                continue
        key = _IDENTIFIER.match(text, j)
        if key is None or keyword.iskeyword(key.group()):
            return stop("broken", j)
        eq = _skip_space(text, key.end())
        if eq == n:
            return stop("open", n)
        if text[eq] != "=":
            return stop("broken", j)
        v = _skip_space(text, eq + 1)
        if v == n:
            return stop("open", n)
        value, end, state = _python_value(text, v, memo)
        if state == "broken" and not value:
            return stop("broken", j)
        if value:
            comma = ", " if len(parts) > 1 else ""
            parts.append(f"{comma}{json.dumps(key.group())}: {value}")
        if state != "done":
            return stop(state, end)
        j = _skip_space(text, end)


def _python_value(text: str, i: int, memo: _Memo) -> tuple[str, int, str]:
    """(the JSON text of the literal at `i` so far, where it ends or stops, its state): a
    string streams as its characters arrive; other literals come whole, once they end."""
    q = text[i]
    if q in "'\"":
        if text[i:] in (q, q * 2):  # ("" may be all of it, or the start of """)
            return '"', len(text), "open"
        string = memo.get(i)
        if string is None:
            string = memo[i] = _PythonString(text, i)
        string.advance(text)
        return string.json, string.pos, string.state
    expression = memo.get(i)
    if expression is None:
        expression = memo[i] = _PythonExpression(i)
    return expression.advance(text)


class _PythonExpression:
    """The Python literal at `start` (not a string) as JSON text, once it has ended: at a `,` or
    an unmatched closing bracket outside strings, found as its text arrives."""

    def __init__(self, start: int) -> None:
        self.start = self.pos = start
        self._depth, self._quote, self._escape = 0, "", False
        self._read: tuple[str, int, str] | None = None  # (JSON text, end, state) once ended

    def advance(self, text: str) -> tuple[str, int, str]:
        i, n = self.pos, len(text)
        while i < n and self._read is None:
            c = text[i]
            if self._quote:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == self._quote:
                    self._quote = ""
            elif c in "\"'":
                self._quote = c
            elif c in "([{":
                self._depth += 1
            elif c in ")]}" and self._depth:
                self._depth -= 1
            elif c in ",)]}" and not self._depth:
                self._read = self._literal(text[self.start : i].rstrip())
            i += 1
        self.pos = i
        return self._read or ("", n, "open")

    def _literal(self, source: str) -> tuple[str, int, str]:
        try:
            value = _literal(ast.parse(source, mode="eval").body)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return "", self.start, "broken"
        return json.dumps(value, ensure_ascii=False), self.start + len(source), "done"


_PLAIN = {q: re.compile(rf"[^{q}\\\n]*") for q in "'\""}


class _PythonString:
    """The Python string literal at `start` as JSON text, read as its characters arrive (the
    text only ever grows): `json` so far, `state` and `pos` as `_JsonScanner` has them."""

    def __init__(self, text: str, start: int) -> None:
        self.quote = text[start]
        triple = text.startswith(self.quote * 3, start)
        self.close = self.quote * (3 if triple else 1)
        self.pos = start + len(self.close)
        self.state = "open"
        self.json = '"'

    def advance(self, text: str) -> _PythonString:
        n, q, close = len(text), self.quote, self.close
        j, out = self.pos, []
        while j < n and self.state == "open":
            c = text[j]
            if text.startswith(close, j):
                out.append('"')
                self.state, j = "done", j + len(close)
            elif c == q:  # (in a triple-quoted string)
                if _arriving(text, j, close):
                    break
                out.append(_json_chars(c))
                j += 1
            elif c == "\\":
                end = _escape_end(text, j)
                if end is None:
                    break
                try:
                    char = _ESCAPES.get(text[j + 1 : end]) or ast.literal_eval(q + text[j:end] + q)
                except (ValueError, SyntaxError):
                    self.state = "broken"
                    break
                out.append(_json_chars(char))
                j = end
            elif c == "\n" and len(close) == 1:
                self.state = "broken"
            else:
                run = max(_PLAIN[q].match(text, j).end(), j + 1)  # type: ignore[union-attr]
                out.append(_json_chars(text[j:run]))  # (a newline, in a triple-quoted string)
                j = run
        self.pos = j
        self.json += "".join(out)
        return self


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"'}


def _json_chars(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _escape_end(text: str, i: int) -> int | None:
    """Where the escape sequence at `i` (a backslash) ends (None: not arrived yet)."""
    n = len(text)
    if i + 1 == n:
        return None
    c = text[i + 1]
    if c in "xuU":
        end = i + 2 + {"x": 2, "u": 4, "U": 8}[c]
        return end if end <= n else None
    if c == "N":
        close = text.find("}", i + 2)
        return None if close == -1 else close + 1
    if c in "01234567":
        j = i + 2
        while j < min(n, i + 4) and text[j] in "01234567":
            j += 1
        return None if j == n and j < i + 4 else j
    return i + 2


_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.AST) -> Any:
    """The value of a literal (constants, lists, dicts, tuples as lists, JSON's names)."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict")
        keys = [_literal(k) for k in node.keys]  # type: ignore[arg-type]
        if not all(isinstance(k, str) for k in keys):
            raise ValueError("a JSON object's keys are strings")
        return dict(zip(keys, (_literal(v) for v in node.values)))
    value = ast.literal_eval(node)  # constants, signed numbers
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    raise ValueError(f"{type(value).__name__} is no JSON value")


# ---- forced-call grammars ------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _forced_regex(parser: str, tools: str, one: bool, whitespace: str) -> str:
    # keyed on the offered tools' JSON: clients send the same tools with every turn
    p = tool_call_parser(parser)
    calls = [(f["name"], p._arguments_regex(f, whitespace)) for f in json.loads(tools)]
    return p._forced(calls, one, whitespace)


@functools.lru_cache(maxsize=256)
def _json_arguments_regex(parameters: str, whitespace: str) -> str:
    # (the grammar package loads torch: imported here, so the HTTP process starts without it)
    from radixlm.constrained.json_schema import JsonSchemaOptions, json_schema_to_regex

    return json_schema_to_regex(json.loads(parameters), JsonSchemaOptions(whitespace=whitespace))


# what a parameter schema may say at its top level for keyword arguments to enforce it exactly
_KWARGS_KEYWORDS = frozenset(
    {
        "type",
        "properties",
        "required",
        "additionalProperties",
        "description",
        "title",
        "$defs",
        "definitions",
        "$schema",
        "$id",
        "$comment",
    }
)


@functools.lru_cache(maxsize=256)
def _kwargs_regex(parameters: str, whitespace: str) -> str:
    """Keyword arguments `a=1, b="x"` (values as JSON writes them, which Python reads alike),
    the listed properties in their order, required ones always: what a parameter schema of
    listed properties allows."""
    from radixlm.constrained import regex_text as rt
    from radixlm.constrained.errors import GrammarError
    from radixlm.constrained.json_schema import JsonSchemaOptions, json_schema_to_regex
    from radixlm.server.tools import _rebase_refs

    schema = json.loads(parameters)
    for key in schema:
        if key not in _KWARGS_KEYWORDS:
            raise GrammarError(
                f"pythonic calls cannot enforce {key!r} in a tool's parameters; list the "
                "arguments in 'properties'"
            )
    props: dict[str, Any] = schema.get("properties", {})
    required: list[str] = schema.get("required", [])
    for name in required:
        if name not in props:
            raise GrammarError(f"the required argument {name!r} is not in 'properties'")
    for name in props:
        if not name.isidentifier() or keyword.iskeyword(name):
            raise GrammarError(
                f"pythonic calls pass arguments by keyword: {name!r} is no Python identifier"
            )
    root = "#/$defs/__parameters"
    defs = {"__parameters": _rebase_refs(schema, root)}
    options = JsonSchemaOptions(whitespace=whitespace)
    items = []
    for name, sub in props.items():
        value = json_schema_to_regex({"allOf": [_rebase_refs(sub, root)], "$defs": defs}, options)
        items.append((rt.seq(rt.lit(name + "="), value), name in required))
    return rt.ordered_items(items, rt.lit(", "))


# ---- the registry --------------------------------------------------------------------------

_PARSERS: tuple[type[ToolCallParser], ...] = (
    HermesParser,
    Llama3Parser,
    PythonicParser,
    MistralParser,
    DeepSeekV3Parser,
)
# detection order for "auto": the most specific markers first
_DETECTION_ORDER: tuple[type[ToolCallParser], ...] = (
    DeepSeekV3Parser,
    MistralParser,
    PythonicParser,
    Llama3Parser,
    HermesParser,
)
TOOL_CALL_PARSERS: tuple[str, ...] = (*(n for p in _PARSERS for n in p.names), "auto")


@functools.cache
def tool_call_parser(name: str) -> ToolCallParser:
    """The parser of an SGLang name (not "auto": see `resolve_tool_call_parser`)."""
    for cls in _PARSERS:
        if name in cls.names:
            return cls()
    raise ValueError(f"tool_call_parser={name!r}; use one of {', '.join(TOOL_CALL_PARSERS)}")


def detect_tool_call_parser(chat_template: str | None) -> str | None:
    """The parser a chat template points to: by the markers in its text, else by the format it
    writes an earlier call in (None: neither shows one)."""
    template = chat_template or ""
    for cls in _DETECTION_ORDER:
        if any(marker in template for marker in cls.markers):
            return cls.names[0]
    return _format_of_written_call(template) if template else None


# the conversation "auto" renders to see how a template writes a call (a format without marker
# tokens, such as Llama 3.2's JSON or pythonic calls, shows only in the calls themselves)
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
_PROBE_ARGUMENTS = {"city": "Paris"}
_PROBE_QUESTION = {"role": "user", "content": "What is the weather in Paris?"}
_PROBE_CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": _PROBE_ARGUMENTS},
        }
    ],
}


def _format_of_written_call(template: str) -> str | None:
    """The parser that reads back the call the template writes for an assistant's turn that
    made one (None: none does, or the template cannot render such a turn)."""
    from radixlm.lang.chat_template import jinja_renderer

    try:
        # (the special tokens are the tokenizer's, not known here: empty)
        render = jinja_renderer(
            template, {"bos_token": "", "eos_token": "", "tools": [_PROBE_TOOL]}
        )
        asked = render([_PROBE_QUESTION], True)
        answered = render([_PROBE_QUESTION, _PROBE_CALL], False)
    except Exception:  # (a template's own errors, whatever they are: no format shown)
        return None
    # the assistant's turn as the model would have generated it, where the template renders the
    # earlier turn as it prompts for a new one; else everything after the question
    if answered.startswith(asked):
        written = answered[len(asked) :]
    else:
        written = answered[max(answered.find(_PROBE_QUESTION["content"]), 0) :]
    name = _PROBE_TOOL["function"]["name"]
    for cls in _DETECTION_ORDER:
        calls = tool_call_parser(cls.names[0]).parse(written, {name}).calls
        if [(c.name, _loads(c.arguments)) for c in calls] == [(name, _PROBE_ARGUMENTS)]:
            return cls.names[0]
    return None


def resolve_tool_call_parser(name: str | None, chat_template: str | None) -> ToolCallParser | None:
    """The parser a server runs with: None (the default format), a name, or "auto" (from the
    chat template, logged)."""
    if name is None:
        return None
    if name != "auto":
        return tool_call_parser(name)
    found = detect_tool_call_parser(chat_template)
    if found is None:
        logger.info(
            "tool_call_parser=auto: the chat template shows no tool-call format; "
            "tool calls use the default format"
        )
        return None
    logger.info("tool_call_parser=auto: the chat template writes calls as %s", found)
    return tool_call_parser(found)
