"""OpenAI tool calling over a chat model: prompts, output grammars, and parsing of the calls.

Calls are JSON objects `{"name": ..., "arguments": {...}}`. With `tool_choice` "required" or a
named tool, the whole output is constrained by a JSON schema built from the tools' parameter
schemas (an array of calls when parallel calls are allowed). With "auto", the model writes calls in
`<tool_call>...</tool_call>` blocks (the Hermes/Qwen convention), or as its whole answer; a regex
(`auto_output_regex`) leaves the text free and constrains each call once the model opens a block;
there, keywords the grammar cannot enforce (`uniqueItems`, `multipleOf`) are skipped, since the
model need not call at all, while the constrained modes refuse a schema with them. With a
response_format too, the "auto" regex is the answer in the format or calls alone.
Streamed, a call goes out as OpenAI's deltas while it is generated (`ToolCallStreamer`): a first one
with its id and name, then pieces of its arguments.

Tools reach the model through the chat template when the template knows about tools; otherwise
they are described in the system prompt, and earlier calls and their results are written into
the conversation as the same tagged blocks.

This is the server's default format; `--tool-call-parser` replaces it with a model family's own
(tool_parsers.py), which then writes, forces and reads the calls.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from radixlm.protocol.reasoning import ReasoningParser
from radixlm.server.errors import bad_request

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
# a call's object as the grammars write it: its name, then its arguments' JSON value
_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_SPACE = re.compile(r"\s*")
# a block of any text, for outputs no grammar wrote (the lenient fallback of parse_output)
_LOOSE_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolPlan:
    """What the request asks of tools: mode none | auto | required | named."""

    mode: str = "none"
    tools: list[dict[str, Any]] = field(default_factory=list)  # {"type": "function", "function"}
    name: str | None = None  # the named tool
    parallel: bool = True

    @property
    def active(self) -> bool:
        return self.mode != "none"

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "named")

    @property
    def offered(self) -> list[dict[str, Any]]:
        """The tools shown to the model."""
        if self.mode == "named":
            return [t for t in self.tools if t["function"]["name"] == self.name]
        return self.tools if self.active else []

    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.offered}

    def output_schema(self) -> dict[str, Any] | None:
        """The JSON schema the whole output must follow, for the constrained modes."""
        if not self.constrained:
            return None
        calls, defs = _call_schemas([t["function"] for t in self.offered])
        if self.mode == "named":
            return _with_defs(calls[0], defs)
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        if self.parallel:
            return _with_defs({"type": "array", "items": one, "minItems": 1}, defs)
        return _with_defs(one, defs)

    def instructions(self) -> str:
        """How to call, for the system prompt."""
        if self.mode == "named":
            return (
                f'Call the function "{self.name}" now. Reply with only a JSON object of the form '
                f'{{"name": "{self.name}", "arguments": {{...}}}}, the arguments following the '
                "function's parameter schema."
            )
        if self.mode == "required":
            if self.parallel:
                return (
                    "Call one or more of these functions now. Reply with only a JSON array of "
                    'calls, each of the form {"name": "<function name>", "arguments": {...}}, '
                    "the arguments following the function's parameter schema."
                )
            return (
                "Call one of these functions now. Reply with only a JSON object of the form "
                '{"name": "<function name>", "arguments": {...}}, the arguments following the '
                "function's parameter schema."
            )
        return (
            "To call a function, reply with one block per call:\n"
            f'{CALL_OPEN}\n{{"name": "<function name>", "arguments": {{...}}}}\n{CALL_CLOSE}\n'
            "the arguments following the function's parameter schema. If no function helps, "
            "answer directly."
        )


def plan_tools(tools: list[Any] | None, tool_choice: Any, parallel: bool) -> ToolPlan:
    """Validate `tools` / `tool_choice` (msgspec structs) into a plan; 400 for contradictions."""
    specs: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools or []):
        if tool.type != "function":
            raise bad_request(
                f"tools[{i}].type={tool.type!r}; only 'function' is supported", "tools"
            )
        fn = tool.function
        if not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", fn.name):
            raise bad_request(
                f"tools[{i}].function.name={fn.name!r}: use 1 to 64 letters, digits, _ . -",
                "tools",
            )
        if fn.name in seen:
            raise bad_request(f"two tools are named {fn.name!r}", "tools")
        seen.add(fn.name)
        parameters = fn.parameters if fn.parameters is not None else {"type": "object"}
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            # a call's arguments are a JSON object: a schema of anything else has no call
            raise bad_request(
                f"tools[{i}].function.parameters must be a JSON schema of an object "
                f'(type "object"), got {parameters!r:.200}',
                "tools",
            )
        if "type" not in parameters:  # (`{}` would let the grammar write any JSON value)
            parameters = {"type": "object", **parameters}
        function: dict[str, Any] = {"name": fn.name, "parameters": parameters}
        if fn.description:
            function["description"] = fn.description
        specs.append({"type": "function", "function": function})

    if tool_choice is None:
        mode, name = ("auto" if specs else "none"), None
    elif isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise bad_request(
                f"tool_choice={tool_choice!r}; use 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        mode, name = tool_choice, None
    else:
        if tool_choice.type != "function":
            raise bad_request("tool_choice.type must be 'function'", "tool_choice")
        mode, name = "named", tool_choice.function.name
        if name not in seen:
            raise bad_request(
                f"tool_choice names {name!r}, which is not among the tools {sorted(seen)}",
                "tool_choice",
            )
    if mode in ("auto", "required") and not specs:
        if mode == "required":
            raise bad_request("tool_choice='required' needs at least one tool", "tool_choice")
        mode = "none"
    return ToolPlan(mode=mode, tools=specs, name=name, parallel=parallel)


def _call_schemas(
    functions: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The schema of a call of each function, and the `$defs` their document needs at its root.

    A parameter schema is nested in a larger document, so its local refs (`#/$defs/A`, `#`)
    would resolve from that document's root: one with such refs moves to the root's
    `$defs/<function name>` (a prefix of its own, so two tools' defs of one name never meet),
    its refs rewritten to point there, and its call's arguments refer to it."""
    calls, defs = [], {}
    for function in functions:
        name, arguments = function["name"], function["parameters"]
        rebased = _rebase_refs(arguments, f"#/$defs/{name}")
        if rebased != arguments:
            defs[name] = rebased
            arguments = {"$ref": f"#/$defs/{name}"}
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": arguments},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    return calls, defs


def _with_defs(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "$defs": defs} if defs else schema


# keywords whose values are JSON data, not schemas (a `$ref` in them is no reference)
_DATA_KEYWORDS = frozenset({"enum", "const", "examples", "default"})
# keywords whose values map names to schemas (a name is not a keyword there)
_SCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies"}
)


def _rebase_refs(schema: Any, root: str) -> Any:
    """`schema` with each ref into itself (`#`, `#/...`) made to point under `root`, where the
    schema will sit in a larger document. A subschema with its own `$id` is a resource its refs
    resolve in, and stays as it is."""
    if isinstance(schema, list):
        return [_rebase_refs(s, root) for s in schema]
    if not isinstance(schema, dict):
        return schema
    ident = schema.get("$id")
    if isinstance(ident, str) and not ident.startswith("#"):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value[:2] == "#/"):
            out[key] = root + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _rebase_refs(s, root) for name, s in value.items()}
        else:
            out[key] = _rebase_refs(value, root)
    return out


def auto_output_regex(
    plan: ToolPlan, whitespace: str = "compact", answer_schema: str | None = None
) -> str:
    """For tool_choice "auto": any text, in which every `<tool_call>` block holds one call that
    follows its tool's schema (at most one block without parallel calls), less the keywords the
    grammar cannot enforce. With `answer_schema` (a response_format's JSON schema, as text): the
    answer in that schema, or calls alone, as OpenAI lets a model either call or answer in the
    format. GrammarError (a ValueError) for a parameter schema that cannot be compiled even so (a
    ref that does not resolve, say), or an answer schema the regex cannot enforce whole."""
    # not sort_keys: the grammar writes an object's properties in its schema's order
    tools = json.dumps(plan.offered, ensure_ascii=False)
    return _auto_output_regex(tools, plan.parallel, whitespace, answer_schema)


@functools.lru_cache(maxsize=64)
def _auto_output_regex(
    tools: str, parallel: bool, whitespace: str, answer_schema: str | None = None
) -> str:
    # keyed on the offered tools' JSON: clients send the same tools with every turn
    # (the grammar package loads torch: imported here, so the HTTP process starts without it)
    from radixlm.constrained import regex_text as rt
    from radixlm.constrained.json_schema import JsonSchemaOptions, json_schema_to_regex

    calls, defs = _call_schemas([t["function"] for t in json.loads(tools)])
    schema = _with_defs(calls[0] if len(calls) == 1 else {"anyOf": calls}, defs)
    # lenient: a keyword the grammar cannot enforce must not refuse a request that may call
    # no tool at all; the constrained modes, which demand a call, refuse it instead
    options = JsonSchemaOptions(whitespace=whitespace, lenient=True)
    call = json_schema_to_regex(schema, options)
    pad = r"[ \n]{0,2}"
    block = f"{rt.lit(CALL_OPEN)}{pad}(?:{call}){pad}{rt.lit(CALL_CLOSE)}"
    if answer_schema is not None:
        # not lenient: the answer is held to the whole of its format, as without tools
        answer = json_schema_to_regex(answer_schema, JsonSchemaOptions(whitespace=whitespace))
        blocks = f"{block}(?:{pad}{block})*" if parallel else block
        return f"(?:{answer})|(?:{pad}{blocks}{pad})"
    free_text = _free_text()
    block += free_text
    return f"{free_text}(?:{block}){'*' if parallel else '?'}"


@functools.cache
def _free_text() -> str:
    """Any text without a `<tool_call>` in it."""
    return _text_without(CALL_OPEN)


def thinking_prefix(parser: ReasoningParser) -> str:
    """The regex of the thinking an output may open with, for a grammar that constrains the
    answer after it (a forced tool call): the model still thinks first."""
    from radixlm.constrained import regex_text as rt

    thinking = rt.seq(_text_without(parser.end), rt.lit(parser.end), "[ \\n]*")
    if parser.forced:
        return rt.seq(rt.opt(rt.lit(parser.start)), thinking)  # type: ignore[return-value]
    return rt.opt(rt.seq(rt.lit(parser.start), thinking))


def answer_after_thinking_regex(parser: ReasoningParser, schema: str, whitespace: str) -> str:
    """A response_format's JSON schema (as text) held to the answer alone: the thinking first,
    free, then the answer in the schema. GrammarError (a ValueError) where the regex cannot
    enforce the schema whole."""
    from radixlm.constrained.json_schema import JsonSchemaOptions, json_schema_to_regex

    answer = json_schema_to_regex(schema, JsonSchemaOptions(whitespace=whitespace))
    return f"{thinking_prefix(parser)}(?:{answer})"


def _text_without(marker: str) -> str:
    """A regex of every text that does not contain `marker` (whose first character occurs only
    there): the automaton that counts how much of the marker was just seen, written out."""
    from radixlm.constrained import regex_text as rt

    if marker[0] in marker[1:]:
        raise ValueError("the marker's first character must not recur in it")
    first = rt.lit(marker[0])

    def other_than(text: str) -> str:
        return rt.class_regex(rt.complement(rt.chars(text)))  # type: ignore[return-value]

    # from "marker[0] seen", back to it (another marker[0] after a partial match) or out of it
    again = "|".join(rt.lit(marker[1:j]) + first for j in range(1, len(marker)))
    out = "|".join(
        rt.lit(marker[1:j]) + other_than(marker[0] + marker[j]) for j in range(1, len(marker))
    )
    partial = "|".join(rt.lit(marker[1:j]) for j in range(2, len(marker)))
    return (
        f"(?:{other_than(marker[0])}|{first}(?:{again})*(?:{out}))*"
        f"(?:{first}(?:{again})*(?:{partial})?)?"
    )


class ToolCallStreamer:
    """While streaming an output whose calls follow a grammar: the tool-call deltas, as OpenAI
    streams them, for the text generated so far.

    A call's first delta carries its index, id, type and name (sent once `"arguments":` follows
    the name); the next ones carry the pieces of its arguments' JSON text as they are generated.
    Calls are found in `<tool_call>` blocks (tool_choice "auto") or as the objects of the whole
    output (a call, or an array of calls)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.in_blocks = not plan.constrained
        self._names = plan.names()
        self._stopped = False  # an object that is no call of these tools came: nothing more
        self.count = 0  # calls started
        self._pos = 0  # where the search for the next call resumes
        self._start: int | None = None  # where the current call's object begins
        self._args: _JsonValueScanner | None = None  # the current call's arguments

    def feed(self, text: str) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        while not self._stopped:
            if self._args is not None:
                piece, done = self._args.advance(text)
                if piece:
                    deltas.append({"index": self.count - 1, "function": {"arguments": piece}})
                if not done:
                    return deltas
                self._pos, self._args = self._args.end, None
            if self._start is None:
                self._start = self._next_object(text)
                if self._start is None:
                    return deltas
            head = _CALL_HEAD.match(text, self._start)
            if head is None or head.end() == len(text):
                return deltas  # the name (or what follows it) is not complete yet
            name = json.loads(f'"{head.group(1)}"')
            if name not in self._names:  # (no grammar here writes one)
                if not self.in_blocks:  # the output is no list of calls: left to parse_output
                    self._stopped = True
                    break
                self._pos, self._start = head.end(), None  # not a call: on to the next block
                continue
            deltas.append(
                {
                    "index": self.count,
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {"name": name, "arguments": ""},
                }
            )
            self.count += 1
            self._args = _JsonValueScanner(head.end())
            self._start = None
        return deltas

    def _next_object(self, text: str) -> int | None:
        pos = self._pos
        if self.in_blocks:
            opened = text.find(CALL_OPEN, pos)
            if opened == -1:
                return None
            pos = opened + len(CALL_OPEN)
        start = text.find("{", pos)
        if start == -1:
            return None
        self._pos = start
        return start


class _JsonValueScanner:
    """Finds where one JSON value, starting at `start`, ends, as its text arrives."""

    def __init__(self, start: int) -> None:
        self.sent = self.scanned = start
        self.end = -1
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._began = False

    def advance(self, text: str) -> tuple[str, bool]:
        """(the value's text not handed out yet, whether the value is complete)."""
        i = self.scanned
        while i < len(text) and self.end < 0:
            c = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
                    if self._depth == 0:
                        self.end = i + 1
            elif c in " \n\r\t" and not self._began:
                self.sent = i + 1  # whitespace before the value is not part of it
            elif c in "{[":
                self._began = True
                self._depth += 1
            elif c in "}]" or (c == "," and self._depth == 0):
                if self._depth == 0:  # the end of a bare scalar, before its container closes
                    self.end = i
                    break
                self._depth -= 1
                if self._depth == 0:
                    self.end = i + 1
            elif c == '"':
                self._began = True
                self._in_string = True
            else:
                self._began = True
            i += 1
        self.scanned = i
        upto = self.end if self.end >= 0 else i
        piece = text[self.sent : upto]
        self.sent = max(self.sent, upto)
        return piece, self.end >= 0


def tools_system_prompt(plan: ToolPlan, instructions: str | None = None) -> str:
    """The tools and how to call them (default: `plan.instructions()`), for a model whose chat
    template has no tool support."""
    lines = ["# Tools", "", "You can call these functions (JSON schemas of their signatures):"]
    lines.append("<tools>")
    lines.extend(json.dumps(t, ensure_ascii=False) for t in plan.offered)
    lines.append("</tools>")
    lines.append("")
    lines.append(instructions or plan.instructions())
    return "\n".join(lines)


def call_as_text(name: str, arguments: Any) -> str:
    """An earlier call, written back into the conversation as the model writes calls."""
    body = json.dumps({"name": name, "arguments": _arguments_value(arguments)}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


def result_as_text(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"


def _arguments_value(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def arguments_dict(arguments: Any) -> Any:
    """Arguments as a value (what chat templates expect), from the JSON text OpenAI sends."""
    return _arguments_value(arguments)


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    tool_calls: list[dict[str, Any]]  # OpenAI's message.tool_calls entries


def parse_output(text: str, plan: ToolPlan, scan: bool = True) -> ParsedOutput:
    """Split a finished output into content and tool calls (none found: all of it is content).

    Calls as the grammars write them are found as `ToolCallStreamer` finds them while
    streaming, so the two agree: the arguments are their JSON text as generated, and a call that
    max_tokens cut off is there with the arguments it got (its finish reason says "length").
    Other outputs (no grammar: a bare JSON answer under "auto") are read leniently, and a call
    there counts only if its arguments follow its tool's parameter schema. `scan=False`: the
    streamer has been over this output already and found no call."""
    if not plan.active:
        return ParsedOutput(text, [])
    streamed = _streamed_calls(text, plan) if scan else []
    if streamed:
        content = None if plan.constrained else _without_blocks(text).strip() or None
        calls = [openai_call(name, _arguments_text(arguments)) for name, arguments in streamed]
        return ParsedOutput(content, calls)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in plan.offered}
    calls: list[tuple[str, str]] = []
    content = text
    if CALL_OPEN in text:
        for block in _LOOSE_BLOCK.findall(text):
            calls.extend(_calls_from_json(block, schemas) or [])
        content = _LOOSE_BLOCK.sub("", text).strip()
    else:
        whole = _calls_from_json(text.strip(), schemas)
        if whole:
            calls, content = whole, ""
    if not calls:
        return ParsedOutput(text, [])
    return ParsedOutput(content or None, [openai_call(name, args) for name, args in calls])


def _streamed_calls(text: str, plan: ToolPlan) -> list[tuple[str, str]]:
    """(name, arguments' JSON text) of each call the streamer finds in the whole output."""
    calls: list[tuple[str, str]] = []
    for delta in ToolCallStreamer(plan).feed(text):
        name, arguments = delta["function"].get("name"), delta["function"]["arguments"]
        if "id" in delta:
            calls.append((name, arguments))
        else:
            calls[-1] = (calls[-1][0], calls[-1][1] + arguments)
    return calls


def _without_blocks(text: str) -> str:
    """The text outside the call blocks (a block cut off runs to the end)."""
    pieces, pos = [], 0
    while (opened := text.find(CALL_OPEN, pos)) != -1:
        pieces.append(text[pos:opened])
        end = _CallBlockEnd(opened).find(text)
        pos = len(text) if end is None else end
    pieces.append(text[pos:])
    return "".join(pieces)


def _arguments_text(arguments: str) -> str:
    """A call's arguments as OpenAI gives them: the JSON text of an object. (A model that wrote
    the object as a JSON string of it, which no grammar here lets through, gets the string's
    text.)"""
    try:
        value = json.loads(arguments)
    except ValueError:  # cut off by max_tokens: as far as it got
        return arguments
    if isinstance(value, str) and isinstance(_arguments_value(value), dict):
        return value
    return arguments


def _calls_from_json(text: str, schemas: dict[str, Any]) -> list[tuple[str, str]] | None:
    """The calls in a JSON object or array of objects, as (name, arguments' JSON text); None
    unless every one names a tool and its arguments follow that tool's parameter schema."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, ValueError):
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in schemas:
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        arguments = _arguments_value(arguments)
        if not isinstance(arguments, dict) or not _follows(arguments, schemas[item["name"]]):
            return None
        calls.append((item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls or None


def _follows(value: Any, schema: dict[str, Any]) -> bool:
    import jsonschema  # (on the finished output of a request with tools only)

    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        return cls(schema).is_valid(value)
    except Exception:  # a schema that cannot be checked (a ref that does not resolve): no call
        return False


def openai_call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


class _CallBlockEnd:
    """Where a `<tool_call>` block that opened at `opened` ends (after its `</tool_call>`),
    found as its text arrives: past its call's arguments, so that a `</tool_call>` inside one of
    their strings does not end it."""

    def __init__(self, opened: int) -> None:
        self._from = opened + len(CALL_OPEN)
        self._args: _JsonValueScanner | None = None
        self._close_from = self._from  # where the search for the close tag resumes

    def find(self, text: str) -> int | None:
        """The block's end, or None while it has not ended."""
        if self._args is None:
            head = _CALL_HEAD.match(text, _SPACE.match(text, self._from).end())
            if head is not None and head.end() < len(text):
                self._args = _JsonValueScanner(head.end())
            # else no call's head (yet): its close tag, if any, is the end
        if self._args is not None and self._args.end < 0:
            self._args.advance(text)
            if self._args.end < 0:
                return None
            self._close_from = max(self._close_from, self._args.end)
        close = text.find(CALL_CLOSE, self._close_from)
        if close == -1:  # resume where a close tag could still begin
            self._close_from = max(self._close_from, len(text) - len(CALL_CLOSE) + 1)
            return None
        return close + len(CALL_CLOSE)


class ContentFilter:
    """While streaming with tool_choice=auto: which text is content to show now, so that the
    content streamed is the content `parse_output` finds in the finished output.

    `<tool_call>` blocks are left out and the text between and after them is shown. Held back
    until decided: a suffix that may be the start of `<tool_call>`, whitespace until text follows
    it (whitespace before a call or at the end of an output with calls is not content), and an
    output that starts like a bare JSON call. One difference remains: whitespace the output opens
    with, before text that a call follows later, is shown, as it must be if no call follows."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.shown = 0  # the text before this is shown, held back, or inside a call
        self.in_call = False
        self.calls = 0  # call blocks opened
        self._call_start = 0  # where the last call block opened
        self._block: _CallBlockEnd | None = None  # the open block's end, found as it arrives
        self._open_from = 0  # where the search for a first call block in held text resumes
        self._held = ""  # whitespace not shown yet
        self._started = False  # whether any content was shown

    def visible(self, text: str) -> str:
        """The new content to show, given the output so far."""
        if self.plan.constrained:
            return ""
        if self.shown == 0:
            head = text.lstrip()
            if not head or (head[0] in "{[" and not self._has_block(text)):
                return ""  # maybe a bare JSON call: decided when the output is finished
        pieces = []
        while True:
            if self.in_call:
                assert self._block is not None
                end = self._block.find(text)
                if end is None:
                    break
                self.shown, self.in_call = end, False
            opened = text.find(CALL_OPEN, self.shown)
            end = opened if opened != -1 else len(text) - _partial_suffix(text, CALL_OPEN)
            if end > self.shown:
                pieces.append(self._content(text[self.shown : end]))
                self.shown = end
            if opened == -1:
                break
            self.in_call, self._call_start = True, opened
            self._block = _CallBlockEnd(opened)
            self.calls += 1
            self.shown = opened + len(CALL_OPEN)
        return "".join(pieces)

    def _has_block(self, text: str) -> bool:
        found = text.find(CALL_OPEN, self._open_from) != -1
        self._open_from = max(self._open_from, len(text) - len(CALL_OPEN) + 1)
        return found

    def rest(self, text: str, calls_found: bool) -> str:
        """At the end: the content not shown yet. Without calls the whole output is content, so
        all of it that was not shown; with calls, the text after the last one less its trailing
        whitespace (nothing of a call cut off, nor of an output that is a bare JSON call)."""
        if not calls_found:
            delta = self._held + text[self._call_start if self.in_call else self.shown :]
        elif self.in_call or not self.calls:
            delta = ""
        else:
            delta = self._content(text[self.shown :])
        self.shown, self._held = len(text), ""
        return delta

    def _content(self, piece: str) -> str:
        """`piece` of content less the whitespace it ends with, which waits for more text."""
        piece = self._held + piece
        shown = piece.rstrip()
        self._held = piece[len(shown) :]
        if not self._started and self.calls:
            shown = shown.lstrip()  # parse_output strips the content of an output with calls
        self._started = self._started or bool(shown)
        return shown


def _partial_suffix(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
