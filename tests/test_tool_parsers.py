"""The tool-call formats of model families (`--tool-call-parser`) and the reasoning split
(`--reasoning-parser`): outputs written in each family's documented format, whole and streamed
in random pieces (which must agree), arguments streamed as they are generated, malformed and
cut-off calls, the forced-call grammars, and choosing the format from a chat template."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest

from radixlm.protocol.reasoning import REASONING_PARSERS, reasoning_parser
from radixlm.server.tool_parsers import (
    TOOL_CALL_PARSERS,
    detect_tool_call_parser,
    resolve_tool_call_parser,
    tool_call_parser,
)
from radixlm.server.tools import thinking_prefix

TOOLS = {"get_weather", "get_time"}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string"}},
            "required": ["timezone"],
        },
    },
}

PARIS = ("get_weather", {"city": "Paris", "unit": "celsius"})
UTC = ("get_time", {"timezone": "UTC"})

DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

# (parser, output as the family writes it, expected content, expected calls: the arguments as a
# value, or as their text where a call was cut off)
CASES: list[tuple[str, str, str, list[tuple[str, Any]]]] = [
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
        '{"timezone": "UTC"}}\n</tool_call>',
        "Let me check.",
        [PARIS, UTC],
    ),
    (  # an unknown tool and a block of no JSON stay text; a call cut off keeps what it got
        "qwen25",
        '<tool_call>{"name": "launch", "arguments": {}}</tool_call> <tool_call>oops</tool_call>'
        ' <tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>'
        '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
        '<tool_call>{"name": "launch", "arguments": {}}</tool_call> <tool_call>oops</tool_call>',
        [UTC, ("get_weather", '{"city": "Pa')],
    ),
    (  # broken JSON inside a closed block: the call as far as it was valid; text after it stays
        "hermes",
        'x <tool_call>{"name": "get_time", "arguments": {"timezone": }}</tool_call>. Done',
        "x . Done",
        [("get_time", '{"timezone": ')],
    ),
    (  # the arguments written first, or as a JSON string of them; other members skipped
        "hermes",
        '<tool_call>{"arguments": {"timezone": "UTC"}, "name": "get_time"}</tool_call>'
        '<tool_call>{"type": "function", "name": "get_time", "arguments": "{\\"timezone\\": '
        '\\"UTC\\"}", "id": 7}</tool_call>',
        "",
        [UTC, UTC],
    ),
    (
        "llama3",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
        '"celsius"}}; {"name": "get_time", "parameters": {"timezone": "UTC"}}',
        "",
        [PARIS, UTC],
    ),
    (  # without the tag, as the whole answer; "arguments" is read too
        "llama3",
        '  {"name": "get_time", "arguments": {"timezone": "UTC"}}',
        "",
        [UTC],
    ),
    (  # JSON that is no call is the answer; a call after text needs the tag
        "llama3",
        '{"answer": 42} and {"name": "get_time", "parameters": {"timezone": "UTC"}}',
        '{"answer": 42} and {"name": "get_time", "parameters": {"timezone": "UTC"}}',
        [],
    ),
    (
        "llama3",
        'Sure. <|python_tag|>{"name": "get_weather", "parameters": {"city": "Par',
        "Sure.",
        [("get_weather", '{"city": "Par')],
    ),
    (
        "pythonic",
        '[get_weather(city="Paris", unit="celsius"), get_time(timezone=\'UTC\')]',
        "",
        [PARIS, UTC],
    ),
    (  # Llama 4's wrapping; JSON's literals; a bracket of plain text
        "pythonic",
        'See [1]. <|python_start|>[get_weather(city="Paris", unit="celsius", extra=[1, true, '
        "null], more={'a': -1.5})]<|python_end|>",
        "See [1].",
        [
            (
                "get_weather",
                {"city": "Paris", "unit": "celsius", "extra": [1, True, None], "more": {"a": -1.5}},
            )
        ],
    ),  # fmt: skip
    (  # positional arguments, a call that is code, an unknown tool: text; a call cut off
        "pythonic",
        '[get_time("UTC")] [get_time(timezone=__import__("os").getcwd())] [launch(x=1)] '
        '[get_time(timezone="U',
        '[get_time("UTC")] [get_time(timezone=__import__("os").getcwd())] [launch(x=1)]',
        [("get_time", '{"timezone": "U')],
    ),
    (  # Python's strings (escapes, triple quotes), numbers, no arguments, a trailing comma
        "pythonic",
        '[get_time(timezone=\'Europe/\\u00c5land\\n\\x41\\101\', tz="""it\'s ""x"" y""", '
        "n=-3, big=1e3,), get_weather()]",
        "",
        [
            (
                "get_time",
                {
                    "timezone": "Europe/\u00c5land\nAA",
                    "tz": 'it\'s ""x"" y',
                    "n": -3,
                    "big": 1000.0,
                },
            ),
            ("get_weather", {}),
        ],
    ),  # fmt: skip
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
        '"celsius"}}, {"name": "get_time", "arguments": {"timezone": "UTC"}}]',
        "",
        [PARIS, UTC],
    ),
    (  # an unknown tool in the list after a call: no call, and no content either
        "mistral",
        'Hm. [TOOL_CALLS] [{"name": "get_time", "arguments": {"timezone": "UTC"}}, '
        '{"name": "launch", "arguments": {"a": "]"}}] Done.',
        "Hm.  Done.",
        [UTC],
    ),
    (  # ... and first: the list is no list of calls
        "mistral",
        '[TOOL_CALLS] [{"name": "launch", "arguments": {}}, {"name": "get_time", "arguments": {}}]',
        '[TOOL_CALLS] [{"name": "launch", "arguments": {}}, {"name": "get_time", "arguments": {}}]',
        [],
    ),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_time", "arguments": {"timezone": "U',
        "",
        [("get_time", '{"timezone": "U')],
    ),
    (
        "deepseekv3",
        f"Checking.{DS_BEGIN}{DS_CALL}function{DS_SEP}get_weather\n```json\n"
        f'{{"city": "Paris", "unit": "celsius"}}\n```{DS_CALL_END}\n{DS_CALL}function{DS_SEP}'
        f'get_time\n```json\n{{"timezone": "UTC"}}\n```{DS_CALL_END}{DS_END}',
        "Checking.",
        [PARIS, UTC],
    ),
    (
        "deepseekv3",
        f'{DS_BEGIN}{DS_CALL}function{DS_SEP}get_time\n```json\n{{"timezone": "UTC"',
        "",
        [("get_time", '{"timezone": "UTC"')],
    ),
    (  # an unknown tool, and a name no tool's begins with: text
        "deepseekv3",
        f"{DS_BEGIN}{DS_CALL}function{DS_SEP}launch\n```json\n{{}}\n```{DS_CALL_END}{DS_END} ok",
        f"{DS_BEGIN}{DS_CALL}function{DS_SEP}launch\n```json\n{{}}\n```{DS_CALL_END}{DS_END} ok",
        [],
    ),
    (  # no calls at all: every character is content, whitespace included
        "hermes",
        "  Paris is sunny today.\n\n",
        "  Paris is sunny today.\n\n",
        [],
    ),
]


def _value(arguments: str) -> Any:
    """Arguments as a value; their text where they are no JSON (a call cut off)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _whole(parser: str, text: str) -> tuple[str, list[tuple[str, Any]]]:
    result = tool_call_parser(parser).parse(text, TOOLS)
    return result.normal_text, [(c.name, _value(c.arguments)) for c in result.calls]


def _streamed(parser: str, text: str, cuts: list[int]) -> tuple[str, list[list[str]]]:
    stream = tool_call_parser(parser).stream(TOOLS)
    content, calls = "", []
    for cut in [*cuts, len(text)]:
        piece, deltas = stream.feed(text[:cut], final=cut == len(text))
        content += piece
        for delta in deltas:
            if "id" in delta:  # a call's first delta: its id, type and name
                assert delta["index"] == len(calls) and delta["type"] == "function"
                assert delta["id"].startswith("call_")
                calls.append([delta["function"]["name"], delta["function"]["arguments"]])
            else:
                calls[delta["index"]][1] += delta["function"]["arguments"]
    return content, calls


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_whole_outputs_in_each_family_format(parser, text, content, calls):
    assert _whole(parser, text) == (content, calls)


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_streamed_in_random_pieces_agrees_with_the_whole_output(parser, text, content, calls):
    whole = tool_call_parser(parser).parse(text, TOOLS)
    rng = random.Random(hash((parser, text)) & 0xFFFF)
    for _ in range(60):
        n = rng.choice([1, 3, 10, len(text) // 2])
        cuts = sorted(rng.sample(range(1, len(text)), min(n, len(text) - 1)))
        got = _streamed(parser, text, cuts)
        assert got == (whole.normal_text, [[c.name, c.arguments] for c in whole.calls]), cuts
    # character by character too
    assert _streamed(parser, text, list(range(1, len(text))))[0] == whole.normal_text


# ---- arguments streamed as they are generated ----------------------------------------------

STREAM_FAMILIES = ["hermes", "llama3", "pythonic", "mistral", "deepseekv3"]
RICH = (
    "get_weather",
    {"city": 'Saint-Étienne "centre"\n', "unit": "celsius", "days": [1, 2.5, -300.0],
     "extra": {"deep": [True, None, {}]}},
)  # fmt: skip


def _family_output(parser: str) -> str:
    calls = tool_call_parser(parser).format_calls([RICH, UTC])
    return calls if parser == "llama3" else f"Let me look. {calls}"  # (llama3: calls alone)


def _stream_deltas(parser: str, text: str, cuts: list[int]) -> tuple[str, list[list[str]], int]:
    """Feeds `text` cut at `cuts`, checking each delta's shape and that a call's arguments so
    far only ever grow; (content, [name, arguments] of each call, argument pieces sent)."""
    stream = tool_call_parser(parser).stream(TOOLS)
    content, calls, pieces = "", [], 0
    for cut in [*cuts, len(text)]:
        piece, deltas = stream.feed(text[:cut], final=cut == len(text))
        content += piece
        for delta in deltas:
            if "id" in delta:  # a call's first: its index, id, type and name, no arguments yet
                assert set(delta) == {"index", "id", "type", "function"}
                assert delta["index"] == len(calls) and delta["type"] == "function"
                assert delta["function"]["arguments"] == ""
                calls.append([delta["function"]["name"], ""])
            else:  # then pieces of its arguments, and nothing else
                assert set(delta) == {"index", "function"} and set(delta["function"]) == {
                    "arguments"
                }
                assert delta["function"]["arguments"]
                calls[delta["index"]][1] += delta["function"]["arguments"]
                pieces += 1
    return content, calls, pieces


@pytest.mark.parametrize("parser", STREAM_FAMILIES)
def test_streamed_argument_pieces_add_up_to_the_parsed_arguments(parser):
    text = _family_output(parser)
    whole = tool_call_parser(parser).parse(text, TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [RICH, UTC]
    expected = (whole.normal_text, [[c.name, c.arguments] for c in whole.calls])
    # character by character, and in pieces of a few characters as tokens come
    content, calls, pieces = _stream_deltas(parser, text, list(range(1, len(text))))
    assert (content, calls) == expected and pieces > 20
    rng = random.Random(parser)
    for _ in range(20):
        cuts = sorted({rng.randint(1, len(text) - 1) for _ in range(len(text) // 3)})
        assert _stream_deltas(parser, text, cuts)[:2] == expected, cuts


@pytest.mark.parametrize("parser", STREAM_FAMILIES)
def test_arguments_go_out_before_the_call_is_complete(parser):
    text = _family_output(parser)
    final = tool_call_parser(parser).parse(text, TOOLS).calls[0].arguments
    cut = text.index("Saint-") + len("Saint-")  # in the middle of the first call's arguments
    _, calls, _ = _stream_deltas(parser, text[:cut], list(range(1, cut)))
    assert calls[0][0] == "get_weather"
    assert final.startswith(calls[0][1]) and calls[0][1].endswith("Saint-")


def test_text_that_turns_out_no_call_is_let_go_as_soon_as_known():
    hermes = tool_call_parser("hermes").stream(TOOLS)
    assert hermes.feed('Hi <tool_call>{"name": "get_') == ("Hi", [])
    # a name no tool's begins with: content at once, before the name or the block ends
    assert hermes.feed('Hi <tool_call>{"name": "get_x') == (' <tool_call>{"name": "get_x', [])
    llama3 = tool_call_parser("llama3").stream(TOOLS)  # (a JSON answer, not a call)
    assert llama3.feed('{"a') == ("", [])
    assert llama3.feed('{"answer": 4') == ('{"answer": 4', [])
    deepseek = tool_call_parser("deepseekv3").stream(TOOLS)
    head = f"{DS_BEGIN}{DS_CALL}function{DS_SEP}"
    assert deepseek.feed(f"{head}get_") == ("", [])
    assert deepseek.feed(f"{head}get_x") == (f"{head}get_x", [])  # (no tool's name begins so)
    pythonic = tool_call_parser("pythonic").stream(TOOLS)
    assert pythonic.feed("[get_time(") == ("", [])
    assert pythonic.feed('[get_time("') == ('[get_time("', [])  # (positional: no call)


@pytest.mark.parametrize("parser", STREAM_FAMILIES)
def test_any_output_streamed_in_any_pieces_agrees_with_itself_whole(parser):
    # outputs pieced together from calls, an unknown tool's call, markers of every family and
    # stray characters, then cut off or with a character changed: however the text arrives, the
    # stream never takes back what it sent and ends where parsing it whole ends
    p = tool_call_parser(parser)
    pieces = [
        p.format_calls([RICH, UTC]),
        p.format_call(*UTC),
        p.format_call("launch", {"x": 1}),
        "Hi ",
        " ",
        "\n",
        "[1]",
        *"{}[]\"',;:()=<\\",
        "<tool_call>",
        "</tool_call>",
        "[TOOL_CALLS]",
        "<|python_tag|>",
        "<|python_start|>",
        "<|python_end|>",
        DS_BEGIN,
        DS_END,
        DS_CALL,
        "```",
    ]
    rng = random.Random(f"fuzz {parser}")
    for _ in range(600):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 6)))
        if rng.random() < 0.5:
            text = text[: rng.randint(1, len(text))]
        if rng.random() < 0.3:
            k = rng.randrange(len(text))
            text = text[:k] + rng.choice('x"{}[],:; \n)') + text[k + 1 :]
        whole = p.parse(text, TOOLS)
        expected = (whole.normal_text, [[c.name, c.arguments] for c in whole.calls])
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))))
        assert _stream_deltas(parser, text, cuts)[:2] == expected, (text, cuts)


@pytest.mark.parametrize("parser", STREAM_FAMILIES)
def test_a_long_call_streams_in_time_linear_in_its_length(parser):
    # a call is read again from its start as each token comes: what is settled (a string's
    # characters, the calls before) is not read twice, so 5,000 steps over 30,000 characters
    # take about 0.1 s (reading it all each step took a minute)
    import time

    code = 'print("x")\n' * 2000
    calls = [("get_weather", {"city": code, "days": list(range(500))}), *[UTC] * 100]
    text = tool_call_parser(parser).format_calls(calls)
    stream = tool_call_parser(parser).stream(TOOLS)
    started, pieces = time.perf_counter(), {}
    for cut in range(6, len(text) + 6, 6):
        for delta in stream.feed(text[:cut], final=cut >= len(text))[1]:
            pieces[delta["index"]] = pieces.get(delta["index"], "") + delta["function"]["arguments"]
    assert time.perf_counter() - started < 10
    assert [json.loads(pieces[i]) for i in sorted(pieces)] == [a for _, a in calls]


def test_text_that_cannot_open_a_call_is_not_held_back():
    stream = tool_call_parser("hermes").stream(TOOLS)
    assert stream.feed("Hello <tool") == ("Hello", [])  # "<tool" may open a call; " " may be its
    assert stream.feed("Hello <tools are") == (" <tools are", [])
    pythonic = tool_call_parser("pythonic").stream(TOOLS)
    assert pythonic.feed("See [1] and") == ("See [1] and", [])


# ---- the readers of JSON and Python literals, against json.loads and ast ------------------

VALID_JSON = [
    '{"a": [1, -2.5e+3, 0, 0.25E-2, true, false, null, {"b": "x\\"\\\\\\/\\u00e9\\n"}]}',
    "[]",
    "{}",
    ' [ 1 ,2 , "3" ] ',
    '"é"',
    "true",
    '{"": {"": []}}',
]
# (the text, where the reader must stop: the first character no valid JSON has there)
INVALID_JSON = [
    ('{"a" 1}', 5),
    ('{"a": 01}', 7),
    ('{"a": 1.}', 8),
    ('{"a": -}', 7),
    ('{"a": tru}', 9),
    ('{"a": "\\x"}', 8),
    ('{"a": "\\u12g4"}', 11),
    ('{"a": "line\nbreak"}', 11),
    ("[1,]", 3),
    ("{,}", 1),
    ('{"a": 1,}', 8),
    ("{'a': 1}", 1),
]


def _scan_json(text: str, by_char: bool):
    from radixlm.server.tool_parsers import _JsonScanner

    scanner = _JsonScanner(0)
    for cut in range(1, len(text) + 1) if by_char else [len(text)]:
        scanner.advance(text[:cut])
        if scanner.state != "open":
            break
    return scanner


@pytest.mark.parametrize("text", VALID_JSON)
@pytest.mark.parametrize("by_char", [False, True])
def test_the_json_reader_reads_what_json_reads(text, by_char):
    json.loads(text)  # (the oracle agrees it is JSON)
    start = len(text) - len(text.lstrip())
    scanner = _scan_json(text[start:], by_char)
    assert scanner.state == "done" and scanner.pos == len(text.strip())
    for cut in range(1, len(text.strip())):  # every beginning of it may still become JSON
        assert _scan_json(text.strip()[:cut], False).state == "open"


@pytest.mark.parametrize("text,at", INVALID_JSON)
@pytest.mark.parametrize("by_char", [False, True])
def test_the_json_reader_stops_where_json_is_broken(text, at, by_char):
    with pytest.raises(ValueError):
        json.loads(text)
    scanner = _scan_json(text, by_char)
    assert (scanner.state, scanner.pos) == ("broken", at)


@pytest.mark.parametrize(
    "literal",
    [
        "'plain'",
        '"it\'s"',
        "'\\n\\t\\\\\\'\\x41\\101\\0\\u00e9\\U0001F600\\N{EM DASH}\\q'",
        "'''a\nb'' ''c'''",
        '""',
        "''",
        "'a\\\nb'",
    ],
)
def test_the_python_string_reader_reads_what_python_reads(literal):
    import ast

    from radixlm.server.tool_parsers import _python_value

    memo: dict[int, Any] = {}
    sent, text = "", literal + ", b=1)"  # ("" ends only where no third quote follows)
    for cut in range(1, len(text) + 1):  # character by character, as it arrives
        got, end, state = _python_value(text[:cut], 0, memo)
        assert got.startswith(sent)
        sent = got
    assert (state, end) == ("done", len(literal))
    assert json.loads(got) == ast.literal_eval(literal)


# ---- forced calls --------------------------------------------------------------------------

FORCED_FAMILIES = ["hermes", "llama3", "pythonic", "mistral", "deepseekv3"]


@pytest.mark.parametrize("parser", FORCED_FAMILIES)
def test_the_forced_grammar_is_the_family_format_with_valid_arguments(parser):
    p = tool_call_parser(parser)
    many = re.compile(p.forced_regex([WEATHER, TIME], one=False, whitespace="flexible"))
    one = re.compile(p.forced_regex([WEATHER, TIME], one=True, whitespace="flexible"))
    both = p.format_calls([PARIS, UTC])
    single = p.format_calls([PARIS])
    assert many.fullmatch(both) and many.fullmatch(single)
    assert one.fullmatch(single) and not one.fullmatch(both)
    # what it admits, the same parser reads back
    assert _whole(parser, both) == ("", [PARIS, UTC])
    # arguments the schema refuses, an unknown tool, another family's format: refused
    assert not many.fullmatch(p.format_calls([("get_weather", {"city": "Paris", "unit": "K"})]))
    assert not many.fullmatch(p.format_calls([("get_weather", {"town": "Paris"})]))
    assert not many.fullmatch(p.format_calls([("launch", {})]))
    assert not many.fullmatch(p.format_calls([("get_time", {})]))  # (timezone is required)
    other = "mistral" if parser != "mistral" else "hermes"
    assert not many.fullmatch(tool_call_parser(other).format_calls([PARIS]))


def test_pythonic_grammar_keeps_optional_arguments_optional_and_in_order():
    regex = re.compile(tool_call_parser("pythonic").forced_regex([WEATHER], one=True))
    assert regex.fullmatch('[get_weather(city="Paris")]')
    assert regex.fullmatch('[get_weather(city="Paris", unit="fahrenheit")]')
    assert not regex.fullmatch('[get_weather(unit="celsius")]')
    assert not regex.fullmatch('[get_weather(unit="celsius", city="Paris")]')


@pytest.mark.parametrize(
    "parameters,needle",
    [
        ({"type": "object", "properties": {"for": {"type": "string"}}}, "'for' is no Python"),
        ({"type": "object", "properties": {"a-b": {"type": "string"}}}, "'a-b' is no Python"),
        ({"type": "object", "minProperties": 1}, "cannot enforce 'minProperties'"),
    ],
)
def test_pythonic_grammar_refuses_what_keyword_arguments_cannot_say(parameters, needle):
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    with pytest.raises(ValueError, match=needle):
        tool_call_parser("pythonic").forced_regex([tool], one=True)


def test_a_forced_grammar_refuses_keywords_it_cannot_enforce():
    tool = {
        "type": "function",
        "function": {
            "name": "tag",
            "parameters": {
                "type": "object",
                "properties": {"tags": {"type": "array", "uniqueItems": True}},
            },
        },
    }
    with pytest.raises(ValueError, match="uniqueItems"):
        tool_call_parser("mistral").forced_regex([tool], one=True)


def test_a_tool_set_builds_its_forced_grammar_once(monkeypatch):
    import radixlm.server.tool_parsers as tp

    tool = {"type": "function", "function": {"name": "cached_once", "parameters": {}}}
    tool["function"]["parameters"] = {"type": "object", "properties": {"q": {"type": "string"}}}
    built: list[str] = []
    real = tp.MistralParser._forced
    monkeypatch.setattr(
        tp.MistralParser, "_forced", lambda self, *a: built.append("x") or real(self, *a)
    )
    parser = tool_call_parser("mistral")
    first = parser.forced_regex([tool], one=False)
    assert parser.forced_regex([json.loads(json.dumps(tool))], one=False) == first
    assert built == ["x"]


# ---- the registry and "auto" ---------------------------------------------------------------


def test_sglang_names_are_all_there():
    assert set(TOOL_CALL_PARSERS) == {
        "hermes", "qwen25", "qwen", "llama3", "pythonic", "mistral", "deepseekv3", "auto",
    }  # fmt: skip
    assert {"deepseek-r1", "qwen3"} <= set(REASONING_PARSERS)
    with pytest.raises(ValueError, match="use one of"):
        tool_call_parser("gpt4")
    with pytest.raises(ValueError, match="use one of"):
        reasoning_parser("o1")


@pytest.mark.parametrize(
    "template,expected",
    [
        ("{% for tool_call in message.tool_calls %}<tool_call>\n{{ tool_call }}", "hermes"),
        ("{{- '<|python_tag|>' + tool_call.name }}", "llama3"),
        ("{{- '<|python_start|>' }}[{{ call }}]", "pythonic"),
        ("{{ '[TOOL_CALLS] ' + message.tool_calls|tojson }}", "mistral"),
        ("{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'}}", "deepseekv3"),
        ("{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}", None),
        (None, None),
    ],
)
def test_auto_reads_the_format_from_the_chat_template(template, expected):
    assert detect_tool_call_parser(template) == expected


# templates with no marker of their format in their text: Llama 3.2's JSON calls (no
# <|python_tag|>) and its pythonic ones; "auto" reads the format from the call they write
_LLAMA_HEADER = "'<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n'"
_JSON_CALLS = (
    "{% for m in messages %}{{ " + _LLAMA_HEADER + " }}{% if m.tool_calls %}"
    '{% for c in m.tool_calls %}{{ \'{"name": "\' + c.function.name + \'", "parameters": \' '
    "+ c.function.arguments | tojson + '}' }}{% endfor %}"
    "{% else %}{{ m.content }}{% endif %}{{ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
_PYTHONIC_CALLS = (
    "{% for m in messages %}{{ m.role + ': ' }}{% if m.tool_calls %}{{ '[' }}"
    "{% for c in m.tool_calls %}{{ c.function.name + '(' }}"
    "{% for k, v in c.function.arguments.items() %}{{ k + '=' + v | tojson }}{% endfor %}"
    "{{ ')' }}{% endfor %}{{ ']' }}{% else %}{{ m.content }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


@pytest.mark.parametrize(
    "template,expected",
    [
        (_JSON_CALLS, "llama3"),
        (_PYTHONIC_CALLS, "pythonic"),
        # a call written in no family's format, and a template that cannot render a call
        (_PYTHONIC_CALLS.replace("'('", "' with '"), None),
        ("{{ raise_exception('no tools here') }}", None),
    ],
)
def test_auto_reads_the_format_from_the_call_a_template_writes(template, expected):
    assert detect_tool_call_parser(template) == expected


def test_auto_says_which_format_it_chose(caplog):
    with caplog.at_level("INFO", logger="radixlm.server"):
        parser = resolve_tool_call_parser("auto", "x [TOOL_CALLS] y")
    assert parser is not None and parser.name == "mistral"
    assert "tool_call_parser=auto" in caplog.text and "mistral" in caplog.text
    assert resolve_tool_call_parser(None, "x [TOOL_CALLS] y") is None


# ---- reasoning -----------------------------------------------------------------------------

REASONING_CASES = [
    # deepseek-r1: the template opens <think>, so the output may start inside it
    ("deepseek-r1", "The user wants Paris.\n</think>\n\nIt is sunny.", "The user wants Paris.",
     "It is sunny."),
    ("deepseek-r1", "<think>\nHmm.\n</think>Answer", "Hmm.", "Answer"),
    ("deepseek-r1", "Still thinking when cut", "Still thinking when cut", ""),
    ("qwen3", "<think>\nLet me see.\n</think>\n\nParis.", "Let me see.", "Paris."),
    ("qwen3", "Paris, no thinking.", None, "Paris, no thinking."),
    ("qwen3", "<think>\n\n</think>\n\nParis.", "", "Paris."),
    ("qwen3", "<think>cut off", "cut off", ""),
]  # fmt: skip


@pytest.mark.parametrize("name,text,thinking,answer", REASONING_CASES)
def test_reasoning_split_whole_and_streamed(name, text, thinking, answer):
    parser = reasoning_parser(name)
    assert parser.split(text) == (thinking, answer)
    rng = random.Random(len(text))
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(8, len(text) - 1))))
        stream, streamed, answers = parser.stream(), "", []
        for cut in [*cuts, len(text)]:
            streamed += stream.feed(text[:cut], final=cut == len(text))
            answers.append(stream.answer)
        assert streamed == (thinking or "")
        assert stream.answer == answer
        # the answer so far only ever grows (the tool-call parsing reads it as it arrives)
        assert all(b.startswith(a) for a, b in zip(answers, answers[1:]))


@pytest.mark.parametrize("name", ["deepseek-r1", "qwen3"])
def test_the_reasoning_grammar_prefix_lets_thinking_come_before_a_forced_call(name):
    parser = reasoning_parser(name)
    call = tool_call_parser("hermes").forced_regex([TIME], one=True)
    regex = re.compile(f"{thinking_prefix(parser)}(?:{call})", re.DOTALL)
    forced = '<tool_call>\n{"name": "get_time", "arguments": {"timezone":"UTC"}}\n</tool_call>'
    assert regex.fullmatch(f"<think>\nWhich zone? UTC.\n</think>\n\n{forced}")
    assert not regex.fullmatch(f"<think>\nno end {forced}")
    assert bool(regex.fullmatch(forced)) == (name == "qwen3")  # (r1 always thinks first)
    assert bool(regex.fullmatch(f"Thinking.</think>{forced}")) == (name == "deepseek-r1")
