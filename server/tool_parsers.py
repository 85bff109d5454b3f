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
| `pythonic` | `[f(a=1, b="x"), g()]` (Llama 3.2/4; read with `ast`, never evaluated) |
| `mistral` | `[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]` |
| `deepseekv3` | `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\\n```json\\n{...}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>` |

One rule for all: a call counts once it is complete and well-formed and names an offered tool,
with arguments that are a JSON object. Anything else (a call cut off by max_tokens, broken JSON
or Python, an unknown name) stays in the text, as content. A streamed output therefore sends a
call whole (a first delta with its id and name, then one with its arguments) once it is complete,
and never sends a call the finished output does not have: streamed in any pieces, an output gives
the content and calls that parsing it whole gives. Whitespace between content and a call belongs
to the call.
"""

from __future__ import annotations

import ast
import functools
import json
import keyword
import logging
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

logger = logging.getLogger("radixlm.server")


@dataclass(frozen=True)
class ToolCallItem:
    name: str
    arguments: str  # the JSON text of an object


@dataclass(frozen=True)
class ParseResult:
    normal_text: str
    calls: list[ToolCallItem]


class _Incomplete:
    """A call region whose end has not arrived yet."""


INCOMPLETE = _Incomplete()


@dataclass(frozen=True)
class _Region:
    end: int  # where the call region ends in the text
    calls: list[ToolCallItem]


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
        normal, calls = scan.step(text, final=True)
        return ParseResult(normal, calls)

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
        self, text: str, start: int, tools: set[str], final: bool
    ) -> _Region | _Incomplete | None:
        """The calls of the region at `start`: INCOMPLETE while its end has not arrived (never
        when `final`), None if it is no call region after all (its text is content)."""

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
    """The content and tool-call deltas of an output as it arrives (OpenAI's `tool_calls` delta
    shape, with each call's `index`)."""

    def __init__(self, scan: _Scan) -> None:
        self._scan = scan
        self.count = 0  # calls sent

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """(the new content, the new tool-call deltas) for the output so far (`final`: all of
        it)."""
        normal, calls = self._scan.step(text, final)
        deltas: list[dict[str, Any]] = []
        for call in calls:
            deltas.append(
                {
                    "index": self.count,
                    "id": new_call_id(),
                    "type": "function",
                    "function": {"name": call.name, "arguments": ""},
                }
            )
            deltas.append({"index": self.count, "function": {"arguments": call.arguments}})
            self.count += 1
        return normal, deltas


class _Scan:
    """Walks an output from its start, deciding what is content and what is a call only where
    the text seen so far settles it (the part undecided is looked at again with more text).

    Whitespace is held back until what follows it is known: whitespace before the first call
    with no content before it, and after the last call with no content after it, is the calls';
    whitespace between content and a call in the middle stays content."""

    def __init__(self, parser: ToolCallParser, tools: set[str]) -> None:
        self.parser = parser
        self.tools = tools
        self.pos = 0  # the text before this is decided
        self.held = ""  # decided whitespace not handed out yet
        self.content_started = False
        self.call_since_content = False

    def step(self, text: str, final: bool) -> tuple[str, list[ToolCallItem]]:
        normal: list[str] = []
        calls: list[ToolCallItem] = []
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
                return "".join(normal), calls
            region = self.parser._region(text, start, self.tools, final)
            if region is INCOMPLETE:
                normal.append(self._content(text[self.pos : start]))
                self.pos = start
                return "".join(normal), calls
            if region is None:  # no call: its first character is content; search on after it
                search = start + 1
                continue
            assert isinstance(region, _Region)
            normal.append(self._content(text[self.pos : start]))
            if not self.content_started:
                self.held = ""  # whitespace the output opens with, before a call
            calls.extend(region.calls)
            self.pos = search = region.end
            self.call_since_content = True

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


# ---- reading JSON and Python ---------------------------------------------------------------


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _json_end(text: str, start: int) -> int | None:
    """Where the JSON object or array that opens at `start` ends (None: not yet arrived).
    Strings are skipped as JSON writes them; the text between is not checked here."""
    depth, i, in_string = 0, start, False
    while i < len(text):
        c = text[i]
        if in_string:
            if c == "\\":
                i += 1
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _call_from_json(item: Any, tools: set[str], keys: tuple[str, ...]) -> ToolCallItem | None:
    """A call from a JSON object `{"name": ..., <key>: {...}}`; None unless it is one of the
    tools with an object of arguments (an object written as a JSON string of it counts)."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    if item["name"] not in tools:
        return None
    arguments = next((item[k] for k in keys if k in item), {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCallItem(item["name"], json.dumps(arguments, ensure_ascii=False))


def _json_calls(text: str, tools: set[str], keys: tuple[str, ...]) -> list[ToolCallItem] | None:
    """The calls of a JSON object or array of objects; None unless every one is a call."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [_call_from_json(item, tools, keys) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


def _expect(text: str, i: int, literal: str, final: bool) -> int | _Incomplete | None:
    """After `literal` at `i`; INCOMPLETE if the text ends inside it, None if something else."""
    rest = text[i : i + len(literal)]
    if rest == literal:
        return i + len(literal)
    if literal.startswith(rest) and i + len(rest) == len(text):
        return None if final else INCOMPLETE
    return None


# ---- the families --------------------------------------------------------------------------


class HermesParser(ToolCallParser):
    """Hermes 2/3 and Qwen2.5/Qwen3: one `<tool_call>` block per call."""

    names = ("hermes", "qwen25", "qwen")
    markers = ("<tool_call>",)
    starts = ("<tool_call>",)
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def _region(self, text, start, tools, final):
        i = _skip_space(text, start + len(self.OPEN))
        if i == len(text):
            return None if final else INCOMPLETE
        if text[i] != "{":
            return None
        end = _json_end(text, i)
        if end is None:
            return None if final else INCOMPLETE
        after = _expect(text, _skip_space(text, end), self.CLOSE, final)
        if not isinstance(after, int):
            return after
        calls = _json_calls(text[i:end], tools, ("arguments", "parameters"))
        return _Region(after, calls) if calls and len(calls) == 1 else None

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

    def _region(self, text, start, tools, final):
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
        end = _json_end(text, i)
        if end is None:
            return None if final else INCOMPLETE
        calls = _json_calls(text[i:end], tools, ("parameters", "arguments"))
        return _Region(end, calls) if calls and len(calls) == 1 else None

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

    def _region(self, text, start, tools, final):
        i = _skip_space(text, start + len(self.TAG))
        if i == len(text):
            return None if final else INCOMPLETE
        if text[i] not in "[{":
            return None
        end = _json_end(text, i)
        if end is None:
            return None if final else INCOMPLETE
        calls = _json_calls(text[i:end], tools, ("arguments", "parameters"))
        return _Region(end, calls) if calls else None

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
    starts = (BEGIN,)

    def _region(self, text, start, tools, final):
        i = start + len(self.BEGIN)
        calls: list[ToolCallItem] = []
        while True:
            i = _skip_space(text, i)
            if text.startswith(self.END, i) and calls:
                return _Region(i + len(self.END), calls)
            opened = _expect(text, i, self.CALL_BEGIN, final)
            if not isinstance(opened, int):
                if opened is INCOMPLETE or not calls:
                    return opened
                after = _expect(text, i, self.END, final)  # (not a call: must be the end)
                return after if not isinstance(after, int) else None
            i = opened
            sep = text.find(self.SEP, i)
            fence = text.find("\n```json\n", sep + 1) if sep != -1 else -1
            if fence == -1:
                return None if final else INCOMPLETE
            name = text[sep + len(self.SEP) : fence]
            if text[i:sep] != "function" or "\n" in name or name not in tools:
                return None
            j = _skip_space(text, fence + len("\n```json\n"))
            if j == len(text):
                return None if final else INCOMPLETE
            if text[j] != "{":
                return None
            end = _json_end(text, j)
            if end is None:
                return None if final else INCOMPLETE
            after = _expect(text, _skip_space(text, end), "```" + self.CALL_END, final)
            if not isinstance(after, int):
                return after
            call = _call_from_json(
                {"name": name, "arguments": _loads(text[j:end])}, tools, ("arguments",)
            )
            if call is None:
                return None
            calls.append(call)
            i = after

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


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


class PythonicParser(ToolCallParser):
    """Llama 3.2 / Llama 4 pythonic calls: a Python list of calls with keyword arguments,
    `[get_weather(city="Paris"), f(x=1)]` (Llama 4 may wrap it in `<|python_start|>` ...
    `<|python_end|>`). Read with `ast`, never evaluated; argument values are literals (JSON's
    `true`, `false` and `null` are read as Python's)."""

    names = ("pythonic",)
    markers = ("<|python_start|>",)
    OPEN, CLOSE = "<|python_start|>", "<|python_end|>"
    starts = (OPEN, "[")

    def _region(self, text, start, tools, final):
        i = start
        wrapped = text.startswith(self.OPEN, i)
        if wrapped:
            i = _skip_space(text, i + len(self.OPEN))
            if i == len(text):
                return None if final else INCOMPLETE
        if text[i] != "[":
            return None
        # "[" then a name and "(": anything else is no list of calls (decided early, so that a
        # bracket in plain text is not held back)
        j = _skip_space(text, i + 1)
        k = j
        while k < len(text) and (text[k].isalnum() or text[k] in "_."):
            k += 1
        if k == len(text):
            return None if final else INCOMPLETE
        if k == j or text[k] != "(" or not (text[j].isalpha() or text[j] == "_"):
            return None
        end = _python_list_end(text, i)
        if end is None:
            return None if final else INCOMPLETE
        calls = _python_calls(text[i:end], tools)
        if calls is None:
            return None
        if wrapped:
            after = _expect(text, _skip_space(text, end), self.CLOSE, final)
            if not isinstance(after, int):
                return after
            end = after
        return _Region(end, calls)

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


def _python_list_end(text: str, start: int) -> int | None:
    """Where the Python list that opens at `start` ends (None: not arrived yet); strings in
    single or double quotes are skipped."""
    depth, i, quote = 0, start, ""
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = ""
        elif c in "\"'":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


_JSON_NAMES = {"true": True, "false": False, "null": None}


def _python_calls(source: str, tools: set[str]) -> list[ToolCallItem] | None:
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, ast.Name):
            return None
        if node.func.id not in tools:
            return None
        arguments = {}
        for kw in node.keywords:
            if kw.arg is None:  # **kwargs
                return None
            try:
                arguments[kw.arg] = _literal(kw.value)
            except ValueError:
                return None
        calls.append(ToolCallItem(node.func.id, json.dumps(arguments, ensure_ascii=False)))
    return calls


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
    """The parser a chat template's own text points to (None: no tool-call markers in it)."""
    template = chat_template or ""
    for cls in _DETECTION_ORDER:
        if any(marker in template for marker in cls.markers):
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
