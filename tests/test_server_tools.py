"""OpenAI tool calling: plans and output schemas, parsing calls out of text, streaming tool-call
deltas, and prompts with tools and tool results (real chat template), end to end where the model
allows it."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import jsonschema
import msgspec
import pytest
from fastapi.testclient import TestClient

from radixlm.server.app import create_app
from radixlm.server.backend import ModelInfo
from radixlm.server.chat import render_chat_prompt
from radixlm.server.errors import APIError
from radixlm.server.openai_protocol import ChatCompletionRequest
from radixlm.server.tools import (
    ContentFilter,
    ToolCallStreamer,
    auto_output_regex,
    parse_output,
    plan_tools,
)
from tests.live_server import sse_payloads

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
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

# as pydantic writes models: in $defs, referred to by $ref, one def referring to another
ORDER = {
    "type": "function",
    "function": {
        "name": "place_order",
        "parameters": {
            "type": "object",
            "$defs": {
                "Item": {
                    "type": "object",
                    "properties": {"sku": {"type": "string"}, "size": {"$ref": "#/$defs/Size"}},
                    "required": ["sku", "size"],
                    "additionalProperties": False,
                },
                "Size": {"enum": ["S", "M", "L"]},
            },
            "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}}},
            "required": ["items"],
            "additionalProperties": False,
        },
    },
}
# a def of the same name as ORDER's, meaning something else, under draft 7's "definitions"
REFUND = {
    "type": "function",
    "function": {
        "name": "refund",
        "parameters": {
            "type": "object",
            "definitions": {"Size": {"type": "integer", "minimum": 1, "maximum": 9}},
            "properties": {"size": {"$ref": "#/definitions/Size"}},
            "required": ["size"],
            "additionalProperties": False,
        },
    },
}
# a ref to the parameter schema's own root
OUTLINE = {
    "type": "function",
    "function": {
        "name": "outline",
        "parameters": {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "sections": {"type": "array", "items": {"$ref": "#"}},
            },
            "required": ["title"],
            "additionalProperties": False,
        },
    },
}
TAG = {
    "type": "function",
    "function": {
        "name": "tag",
        "parameters": {
            "type": "object",
            "properties": {
                "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
                "weight": {"type": "number", "multipleOf": 0.5},
            },
            "required": ["tags"],
            "additionalProperties": False,
        },
    },
}


def chat_request(**fields: Any) -> ChatCompletionRequest:
    fields.setdefault("messages", [{"role": "user", "content": "Weather in Paris?"}])
    return msgspec.convert(fields, ChatCompletionRequest)


def plan_of(**fields: Any):
    req = chat_request(**fields)
    return plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls)


# ---- plans and schemas ---------------------------------------------------------------------


def test_tool_choice_modes():
    assert plan_of().mode == "none"
    assert plan_of(tools=[WEATHER]).mode == "auto"
    assert plan_of(tools=[WEATHER], tool_choice="none").mode == "none"
    assert plan_of(tools=[WEATHER], tool_choice="required").mode == "required"
    named = plan_of(
        tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}
    )
    assert named.mode == "named" and named.names() == {"get_time"}


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"tool_choice": "required"}, "at least one tool"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "sometimes"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "nope",
        ),
        ({"tools": [WEATHER, WEATHER]}, "two tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "bad name!"),
    ],
)
def test_contradictory_tools_are_refused(fields, needle):
    with pytest.raises(APIError) as info:
        plan_of(**fields)
    assert info.value.status == 400 and needle in info.value.message


def test_named_schema_admits_exactly_calls_of_that_tool():
    plan = plan_of(
        tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    schema = plan.output_schema()
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid({"name": "get_weather", "arguments": {"city": "Paris"}})
    assert not validator.is_valid({"name": "get_time", "arguments": {"timezone": "UTC"}})
    assert not validator.is_valid({"name": "get_weather", "arguments": {}})  # city required
    assert not validator.is_valid({"name": "get_weather", "arguments": {"city": "P", "x": 1}})


def test_required_schema_is_an_array_of_calls_when_parallel():
    parallel = jsonschema.Draft202012Validator(
        plan_of(tools=[WEATHER, TIME], tool_choice="required").output_schema()
    )
    calls = [
        {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
        {"name": "get_time", "arguments": {"timezone": "Europe/Paris"}},
    ]
    assert parallel.is_valid(calls)
    assert not parallel.is_valid([])
    assert not parallel.is_valid([{"name": "get_weather", "arguments": {"city": 3}}])
    single = jsonschema.Draft202012Validator(
        plan_of(
            tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False
        ).output_schema()
    )
    assert single.is_valid(calls[1]) and not single.is_valid(calls)
    assert plan_of(tools=[WEATHER]).output_schema() is None  # auto: unconstrained


def _output(plan, calls: list[dict[str, Any]]) -> str:
    """The output that makes `calls`, as the plan's grammar spells it (compact JSON)."""
    dump = functools.partial(json.dumps, separators=(",", ":"))
    if plan.mode == "auto":
        return "".join(f"<tool_call>{dump(call)}</tool_call>" for call in calls)
    return dump(calls[0]) if plan.mode == "named" else dump(calls)


@pytest.mark.parametrize(
    "tool_choice", ["auto", "required", {"type": "function", "function": {"name": "refund"}}]
)
def test_parameter_schemas_with_local_refs_are_enforced_in_every_mode(tool_choice):
    from radixlm.constrained.json_schema import json_schema_to_regex

    plan = plan_of(tools=[ORDER, REFUND, OUTLINE], tool_choice=tool_choice)
    if plan.mode == "auto":
        grammar = re.compile(auto_output_regex(plan), re.DOTALL)
        validator = None
    else:
        schema = plan.output_schema()
        grammar = re.compile(json_schema_to_regex(schema), re.DOTALL)
        validator = jsonschema.Draft202012Validator(schema)
    order = {"name": "place_order", "arguments": {"items": [{"sku": "a1", "size": "M"}]}}
    refund = {"name": "refund", "arguments": {"size": 2}}
    outline = {
        "name": "outline",
        "arguments": {"title": "a", "sections": [{"title": "b", "sections": [{"title": "c"}]}]},
    }
    good = [refund] if plan.mode == "named" else [order, refund, outline]
    bad = [
        {"name": "refund", "arguments": {"size": "M"}},  # ORDER's Size, not its own
        {"name": "refund", "arguments": {"size": 10}},
    ]
    if plan.mode != "named":
        bad += [
            {"name": "place_order", "arguments": {"items": [{"sku": "a1", "size": 2}]}},
            {"name": "outline", "arguments": {"title": "a", "sections": [{"name": "b"}]}},
        ]
    for call in good:
        assert grammar.fullmatch(_output(plan, [call])), call
        assert validator is None or validator.is_valid(json.loads(_output(plan, [call])))
    for call in bad:
        assert not grammar.fullmatch(_output(plan, [call])), call
        assert validator is None or not validator.is_valid(json.loads(_output(plan, [call])))


# ---- parsing -------------------------------------------------------------------------------


def test_parse_tagged_calls_with_content():
    plan = plan_of(tools=[WEATHER, TIME])
    text = (
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": "{\\"timezone\\": \\"UTC\\"}"}</tool_call>'
    )
    parsed = parse_output(text, plan)
    assert parsed.content == "Let me check."
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert json.loads(parsed.tool_calls[1]["function"]["arguments"]) == {"timezone": "UTC"}
    ids = [c["id"] for c in parsed.tool_calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2


def test_parse_bare_json_calls_and_refuse_the_rest():
    plan = plan_of(tools=[WEATHER], tool_choice="required")
    parsed = parse_output('[{"name": "get_weather", "arguments": {"city": "Oslo"}}]', plan)
    assert parsed.content is None and len(parsed.tool_calls) == 1
    parsed = parse_output('{"name": "get_weather", "arguments": {"city": "Oslo"}}', plan)
    assert len(parsed.tool_calls) == 1
    for text in (
        '{"name": "launch_rockets", "arguments": {}}',  # not a tool
        '{"name": "get_weather", "arguments"',  # cut off before its arguments
        "It is sunny in Oslo.",
    ):
        parsed = parse_output(text, plan)
        assert parsed.tool_calls == [] and parsed.content == text
    assert parse_output('{"name": "get_weather"}', plan_of()).tool_calls == []  # no tools
    # cut off by max_tokens in its arguments: there, as far as it got (as it was streamed)
    parsed = parse_output('{"name": "get_weather", "arguments": {"city": "Os', plan)
    assert [c["function"] for c in parsed.tool_calls] == [
        {"name": "get_weather", "arguments": '{"city": "Os'}
    ]
    # under "auto" a bare JSON answer (no grammar wrote it) is a call only if it follows the schema
    auto = plan_of(tools=[WEATHER])
    for text in ('{"name": "get_weather", "arguments": {"city": 5}}',
                 '{"name": "get_weather", "arguments": {"city": "Oslo", "zzz": 1}}'):  # fmt: skip
        assert parse_output(text, auto).tool_calls == [], text
    assert (
        len(parse_output('{"name": "get_weather", "arguments": {"city": "Oslo"}}', auto).tool_calls)
        == 1
    )


def test_streamed_and_whole_calls_agree_where_a_grammar_lets_text_through():
    """The non-streamed reply takes its calls from the same scan as the stream: the arguments'
    text as generated, a `</tool_call>` inside an argument's string, content opening with `{`."""
    plan = plan_of(tools=[WEATHER, TIME])
    cases = {
        '<tool_call>{"name":"get_weather","arguments":{"city":"a</tool_call>b"}}</tool_call> ok': (
            "ok", [("get_weather", '{"city":"a</tool_call>b"}')]
        ),
        '{Paris} is nice. <tool_call>{"name":"get_time","arguments":{"timezone":"UTC"}}</tool_call>': (
            "{Paris} is nice.", [("get_time", '{"timezone":"UTC"}')]
        ),
        '<tool_call>{"name":"get_time","arguments":{"timezone":"UTC"}}</tool_call><tool_call>{"name":"get_weather","arguments":{"ci': (
            None, [("get_time", '{"timezone":"UTC"}'), ("get_weather", '{"ci')]
        ),
        'a <tool_call>{"name":"nope","arguments":{}}</tool_call> b <tool_call>{"name":"get_time","arguments":{}}</tool_call>': (
            "a  b", [("get_time", "{}")]
        ),  # a block no grammar wrote, naming no tool: not a call, and no end to the scan
    }  # fmt: skip
    for text, (content, calls) in cases.items():
        parsed = parse_output(text, plan)
        assert parsed.content == content, text
        assert [
            (c["function"]["name"], c["function"]["arguments"]) for c in parsed.tool_calls
        ] == calls
        for step in (1, 3, 8):  # the stream: content and call deltas
            f, streamer, shown, args = ContentFilter(plan), ToolCallStreamer(plan), "", {}
            for end in range(step, len(text) + step, step):
                shown += f.visible(text[:end])
                for d in streamer.feed(text[:end]):
                    args[d["index"]] = args.get(d["index"], "") + d["function"]["arguments"]
            shown += f.rest(text, calls_found=streamer.count > 0)
            assert shown == (content or ""), (text, step)
            assert list(args.values()) == [a for _, a in calls], (text, step)


def test_a_tool_without_a_parameter_type_still_takes_an_object():
    from radixlm.constrained.json_schema import json_schema_to_regex

    noop = {"type": "function", "function": {"name": "noop", "parameters": {}}}
    schema = plan_of(tools=[noop], tool_choice="required").output_schema()
    rx = re.compile(json_schema_to_regex(schema))
    assert rx.fullmatch('[{"name":"noop","arguments":{}}]')
    assert not rx.fullmatch('[{"name":"noop","arguments":1}]')


def test_content_filter_holds_back_what_may_open_a_call():
    f = ContentFilter(plan_of(tools=[WEATHER]))
    assert f.visible("Sure") == "Sure"
    assert f.visible("Sure. <tool") == "."  # "<tool" may begin a call; " " waits for text
    assert f.visible("Sure. <tool_call>{") == ""
    assert f.visible('Sure. <tool_call>{"name"') == ""
    bare = ContentFilter(plan_of(tools=[WEATHER]))
    assert bare.visible('  {"na') == ""  # maybe a bare JSON call: held to the end
    assert bare.rest('  {"nah": 1}', calls_found=False) == '  {"nah": 1}'
    forced = ContentFilter(plan_of(tools=[WEATHER], tool_choice="required"))
    assert forced.visible("anything") == ""


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize(
    "text",
    [
        'Sure. <tool_call>{"name": "get_time", "arguments": {}}</tool_call> Done.',
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n\nIt is noon.\n',
        'A<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>B <tool',
        'A <tool_call>{"name": "get_time", "arguments": {}}</tool_call> B <tool_call>{"na',
        "No call here, just <tags> and < tool_call> \n",
        '  {"nah": 1}',
        '{"name": "get_time", "arguments": {}}',
    ],
)
def test_content_filter_streams_the_content_parse_output_keeps(text, step):
    plan = plan_of(tools=[WEATHER, TIME])
    parsed = parse_output(text, plan)
    f = ContentFilter(plan)
    streamed = "".join(f.visible(text[:end]) for end in range(step, len(text) + step, step))
    streamed += f.rest(text, calls_found=bool(parsed.tool_calls))
    assert streamed == (parsed.content or "")


# ---- prompts (the real chat template, which has no tool support) ---------------------------


def test_tools_and_results_are_rendered_into_the_prompt(engine):
    from radixlm.server.backend import LocalEngineBackend

    backend = LocalEngineBackend(engine)
    assert backend.model_info().chat_template_has_tools is False
    req = chat_request(
        tools=[WEATHER],
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
        ],
    )
    plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    prompt = render_chat_prompt(backend, req.messages, plan)
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(WEATHER["function"]["parameters"]) in prompt
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        in prompt
    )
    assert '<|im_start|>user\n<tool_response>\n{"temperature": 21}\n</tool_response>' in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


# ---- through the app, with a scripted backend ----------------------------------------------


class ScriptedBackend:
    """A GenerationBackend whose every generation writes `script`, a few characters a step."""

    def __init__(self, script: str, kv_capacity: int | None = None, finish: str = "stop") -> None:
        self.script = script
        self.kv_capacity = kv_capacity
        self.finish = finish  # how the generation ends: "stop" or "length"
        self.calls: list[dict[str, Any]] = []

    def model_info(self) -> ModelInfo:
        return ModelInfo("scripted", "scripted", "scripted", 4096, 256, False, self.kv_capacity)

    def tokenize(self, text: str) -> list[int]:
        return [min(ord(c), 255) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))

    def token_texts(self, ids: list[int]) -> list[str]:
        return [chr(i) for i in ids]

    def render_chat(self, messages, tools=None) -> str:
        return json.dumps(messages)

    async def stream(self, input_ids, sampling_params, **logprob_options):
        self.calls.append(dict(sampling_params))
        return self._run(len(input_ids))

    async def _run(self, prompt_tokens: int) -> AsyncIterator[dict[str, Any]]:
        pieces = [self.script[i : i + 4] for i in range(0, len(self.script), 4)]
        ids: list[int] = []
        for k, piece in enumerate(pieces):
            ids.extend(self.tokenize(piece))
            last = k == len(pieces) - 1
            yield {
                "text": "".join(pieces[: k + 1]),
                "output_ids": list(ids),
                "meta_info": {
                    "id": "scripted",
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": len(ids),
                    "cached_tokens": 0,
                    "finish_reason": (
                        None
                        if not last
                        else {"type": "length", "length": len(ids)}
                        if self.finish == "length"
                        else {"type": "stop", "matched": 0}
                    ),
                    "e2e_latency": 0.0,
                },
            }

    async def flush_cache(self) -> bool:
        return True

    async def freeze_gc(self) -> None:
        self.gc_frozen = getattr(self, "gc_frozen", 0) + 1

    async def stats(self) -> dict[str, Any]:
        return {}

    def engine_config(self) -> dict[str, Any]:
        return {}

    def shutdown(self) -> None:
        pass


def test_named_tool_choice_constrains_and_returns_tool_calls():
    backend = ScriptedBackend('{"name": "get_weather", "arguments": {"city": "Paris"}}')
    with TestClient(create_app(backend)) as c:
        body = {
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [WEATHER, TIME],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        }
        out = c.post("/v1/chat/completions", json=body).json()
    schema = json.loads(backend.calls[0]["json_schema"])
    assert schema["properties"]["name"] == {"const": "get_weather"}
    assert schema["properties"]["arguments"] == WEATHER["function"]["parameters"]
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    jsonschema.validate(
        json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"]
    )


REPORT_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "report",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"sunny": {"type": "boolean"}},
            "required": ["sunny"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize("parser", [None, "hermes"])
@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_a_demanded_call_with_a_response_format_is_held_to_the_tools_grammar(parser, tool_choice):
    # as the OpenAI Agents SDK sends an agent's first turn when it has an output type and must
    # call a tool: OpenAI takes both, the call is the output, the format shapes a later answer
    script = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    if parser == "hermes":
        # (as the grammar writes it: the arguments' JSON compact)
        script = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>'
    choice: Any = tool_choice
    if tool_choice == "named":
        choice = {"type": "function", "function": {"name": "get_weather"}}
        script = script if parser else script[1:-1]  # one call: an object, not a list
    backend = ScriptedBackend(script)
    body = {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER, TIME],
        "tool_choice": choice,
        "response_format": REPORT_FORMAT,
    }
    with TestClient(create_app(backend, tool_call_parser=parser)) as c:
        out = c.post("/v1/chat/completions", json=body)
        assert out.status_code == 200, out.text
        without = c.post("/v1/chat/completions", json={**body, "response_format": None})
        assert without.status_code == 200, without.text
        # a response_format that is wrong in itself is still refused
        bad = c.post(
            "/v1/chat/completions",
            json={**body, "response_format": {"type": "json_schema", "json_schema": {}}},
        )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"
    # the grammar is the tools' alone, as without the format: the output is the call
    with_format, without_format = backend.calls
    assert with_format == without_format
    grammar = with_format.get("regex") or with_format["json_schema"]
    assert "sunny" not in grammar
    if parser == "hermes":
        assert re.fullmatch(with_format["regex"], script)
    choice_out = out.json()["choices"][0]
    assert choice_out["finish_reason"] == "tool_calls"
    (call,) = choice_out["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert call["function"]["arguments"] in script  # (as generated, in either format)
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


ANSWER = '{"sunny":true}'  # (as the grammar writes it: compact)
CALL_BLOCK = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'


@pytest.mark.parametrize("parser", [None, "hermes"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("script", [ANSWER, CALL_BLOCK], ids=["answer", "call"])
def test_auto_with_a_response_format_answers_in_it_or_calls(parser, stream, script):
    # an agent with tools and an output type: OpenAI's model either calls a tool or answers in
    # the format; the grammar admits exactly those two
    backend = ScriptedBackend(script)
    body = {
        "messages": [{"role": "user", "content": "Is it sunny in Paris?"}],
        "tools": [WEATHER, TIME],
        "response_format": REPORT_FORMAT,
        "stream": stream,
    }
    with TestClient(create_app(backend, tool_call_parser=parser)) as c:
        if stream:
            with c.stream("POST", "/v1/chat/completions", json=body) as r:
                chunks = [x for x in sse_payloads(r.iter_lines()) if x != "[DONE]"]
            deltas = [ch["delta"] for x in chunks for ch in x["choices"]]
            content = "".join(d.get("content") or "" for d in deltas)
            pieces = [t for d in deltas for t in d.get("tool_calls") or []]
            calls = [
                (p["function"]["name"], "".join(q["function"]["arguments"] for q in pieces))
                for p in pieces
                if "id" in p
            ]
            reason = [ch["finish_reason"] for x in chunks for ch in x["choices"]][-1]
        else:
            out = c.post("/v1/chat/completions", json=body).json()["choices"][0]
            content, reason = out["message"]["content"] or "", out["finish_reason"]
            calls = [
                (t["function"]["name"], t["function"]["arguments"])
                for t in out["message"].get("tool_calls") or []
            ]
    (params,) = backend.calls
    assert "json_schema" not in params
    grammar = re.compile(params["regex"], re.DOTALL)
    assert grammar.fullmatch(ANSWER) and grammar.fullmatch(CALL_BLOCK)
    assert grammar.fullmatch(f"{CALL_BLOCK}\n{CALL_BLOCK}")  # parallel calls
    refused = ["It is sunny.", '{"sunny":"yes"}', f"{CALL_BLOCK} It is sunny.", ANSWER + CALL_BLOCK]
    for text in refused:
        assert not grammar.fullmatch(text), text
    if script == ANSWER:
        assert (content, calls, reason) == (ANSWER, [], "stop")
    else:
        assert (content, reason) == ("", "tool_calls")
        # (both formats keep the arguments as generated)
        assert [(name, json.loads(arguments)) for name, arguments in calls] == [
            ("get_weather", {"city": "Paris"})
        ]


def test_auto_with_a_format_the_regex_cannot_write_holds_the_answer_to_it():
    # uniqueItems, which no regex enforces: the answer alone is held to the format (by the
    # engine's JSON schema grammar), as without tools
    schema = {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
        "required": ["tags"],
    }
    backend = ScriptedBackend('{"tags": ["a"]}')
    body = {
        "messages": [{"role": "user", "content": "Tags?"}],
        "tools": [WEATHER],
        "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}},
    }
    with TestClient(create_app(backend)) as c:
        out = c.post("/v1/chat/completions", json=body).json()["choices"][0]
    (params,) = backend.calls
    assert "regex" not in params and json.loads(params["json_schema"]) == schema
    assert out["message"]["content"] == '{"tags": ["a"]}' and out["finish_reason"] == "stop"


@pytest.mark.parametrize("tool_choice", ["required", "auto", "auto, a bare JSON call"])
def test_a_call_cut_off_by_max_tokens_is_length_streamed_or_not(tool_choice):
    script = '[{"name": "get_weather", "arguments": {"city": "Par'
    if tool_choice == "auto":
        script = '<tool_call>{"name": "get_weather", "arguments": {"city": "Par'
    elif tool_choice != "required":  # complete as max_tokens ran out (free text: never done)
        tool_choice, script = "auto", '{"name": "get_weather", "arguments": {"city": "Par"}}'
    body = {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER, TIME],
        "tool_choice": tool_choice,
    }
    with TestClient(create_app(ScriptedBackend(script, finish="length"))) as c:
        whole = c.post("/v1/chat/completions", json=body).json()["choices"][0]
        with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            chunks = [x for x in sse_payloads(r.iter_lines()) if x != "[DONE]"]
    assert whole["finish_reason"] == "length"
    (call,) = whole["message"]["tool_calls"]
    arguments = call["function"]["arguments"]
    assert call["function"]["name"] == "get_weather" and arguments.startswith('{"city": "Par')
    deltas = [d for x in chunks for ch in x["choices"] for d in ch["delta"].get("tool_calls", [])]
    assert "".join(d["function"].get("arguments", "") for d in deltas) == arguments
    assert [ch["finish_reason"] for x in chunks for ch in x["choices"]][-1] == "length"


def test_auto_tool_calls_stream_as_deltas_after_content():
    script = (
        'Checking.<tool_call>{"name": "get_time", "arguments": {"timezone": "UTC"}}</tool_call>'
    )
    backend = ScriptedBackend(script)
    with TestClient(create_app(backend)) as c:
        body = {
            "messages": [{"role": "user", "content": "Time?"}],
            "tools": [WEATHER, TIME],
            "stream": True,
        }
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            *chunks, done = sse_payloads(r.iter_lines())
        assert done == "[DONE]"
    # auto: the text is free, a call follows its schema once opened
    assert "json_schema" not in backend.calls[0]
    auto = re.compile(backend.calls[0]["regex"], re.DOTALL)
    assert auto.fullmatch("Checking.") and not auto.fullmatch("Checking.<tool_call>{}")
    deltas = [c["choices"][0]["delta"] for c in chunks]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == "Checking."
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    first, *pieces = calls
    # OpenAI's shape: the id and name first, then the arguments in pieces as they are generated
    assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"] == {"name": "get_time", "arguments": ""}
    assert len(pieces) > 1
    assert all(set(p) == {"index", "function"} and p["index"] == 0 for p in pieces)
    arguments = "".join(p["function"]["arguments"] for p in pieces)
    assert json.loads(arguments) == {"timezone": "UTC"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_required_parallel_calls_stream_each_call_as_it_is_generated():
    script = (
        '[{"name":"get_weather","arguments":{"city":"Paris"}},'
        '{"name":"get_time","arguments":{"timezone":"CET"}}]'
    )
    backend = ScriptedBackend(script)
    with TestClient(create_app(backend)) as c:
        body = {
            "messages": [{"role": "user", "content": "Weather and time in Paris?"}],
            "tools": [WEATHER, TIME],
            "tool_choice": "required",
            "stream": True,
        }
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            *chunks, done = sse_payloads(r.iter_lines())
        assert done == "[DONE]"
    assert "json_schema" in backend.calls[0]
    calls: dict[int, dict[str, Any]] = {}
    order = []
    for chunk in chunks:
        for tc in chunk["choices"][0]["delta"].get("tool_calls") or []:
            order.append(tc["index"])
            call = calls.setdefault(tc["index"], {"name": None, "arguments": ""})
            if "id" in tc:
                assert call["name"] is None  # the header comes once, first
                call["name"] = tc["function"]["name"]
            call["arguments"] += tc["function"]["arguments"]
    assert order == sorted(order) and order.count(0) > 2  # call 0 in pieces, then call 1
    assert [c["name"] for c in calls.values()] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert json.loads(calls[1]["arguments"]) == {"timezone": "CET"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_auto_streams_the_text_between_and_after_calls_as_it_returns_it():
    script = (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\nAnd the time:\n<tool_call>{"name": "get_time", "arguments": '
        '{"timezone": "CET"}}</tool_call>\nBoth asked for.\n'
    )
    backend = ScriptedBackend(script)
    body = {
        "messages": [{"role": "user", "content": "Weather and time in Paris?"}],
        "tools": [WEATHER, TIME],
    }
    with TestClient(create_app(backend)) as c:
        whole = c.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            *chunks, done = sse_payloads(r.iter_lines())
        assert done == "[DONE]"
    assert whole["content"] == "Let me look.\n\nAnd the time:\n\nBoth asked for."
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == whole["content"]
    heads = [tc for d in deltas for tc in d.get("tool_calls") or [] if "id" in tc]
    names = [tc["function"]["name"] for tc in heads]
    assert names == [tc["function"]["name"] for tc in whole["tool_calls"]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_auto_tool_choice_skips_keywords_the_grammar_cannot_enforce():
    backend = ScriptedBackend(
        '<tool_call>{"name": "tag", "arguments": {"tags": ["a"]}}</tool_call>'
    )
    with TestClient(create_app(backend)) as c:
        body = {"messages": [{"role": "user", "content": "Tag it."}], "tools": [TAG, TIME]}
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "tag"
    auto = re.compile(backend.calls[0]["regex"], re.DOTALL)

    def call(arguments: str) -> str:
        return f'<tool_call>{{"name":"tag","arguments":{arguments}}}</tool_call>'

    assert auto.fullmatch(call('{"tags":["a","a"],"weight":0.3}'))  # the two keywords skipped
    assert not auto.fullmatch(call('{"tags":[1]}'))  # the rest of the schema still holds
    assert not auto.fullmatch(call('{"weight":1}'))


@pytest.mark.parametrize("step", [1, 2, 5, 100])
def test_tool_call_streamer_rebuilds_the_arguments_whatever_the_steps(step):
    plan = plan_tools(_tools(WEATHER, TIME), "auto", True)
    text = (
        'Let me see. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Sa\\"o}{ [P]", '
        '"unit": "celsius"}}\n</tool_call>\n<tool_call>{"name":"get_time","arguments":{}}'
        "</tool_call>"
    )
    streamer = ToolCallStreamer(plan)
    calls: dict[int, dict[str, str]] = {}
    for end in range(0, len(text) + step, step):
        for delta in streamer.feed(text[:end]):
            call = calls.setdefault(delta["index"], {"name": "", "arguments": ""})
            call["name"] += delta["function"].get("name", "")
            call["arguments"] += delta["function"]["arguments"]
    assert streamer.count == 2
    assert calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": 'Sa"o}{ [P]', "unit": "celsius"}
    assert calls[1] == {"name": "get_time", "arguments": "{}"}


def _tools(*tools: dict[str, Any]) -> list[Any]:
    req = msgspec.convert({"messages": [], "tools": list(tools)}, ChatCompletionRequest)
    return req.tools


def test_auto_regex_frees_the_text_and_constrains_opened_calls():
    parallel = re.compile(auto_output_regex(plan_tools(_tools(WEATHER, TIME), "auto", True)), re.S)
    single = re.compile(auto_output_regex(plan_tools(_tools(WEATHER, TIME), "auto", False)), re.S)
    call = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Rome"}}\n</tool_call>'
    for text in ("", "Hello <b>, < tool_call>, <tool_cal", "It is sunny.\n", "<<tool", "x" + call):
        assert parallel.fullmatch(text), text
    assert parallel.fullmatch(call + " and " + call) and not single.fullmatch(call + call)
    assert single.fullmatch("Sure. " + call + " Done.")
    for text in (
        "<tool_call>",  # opened, never closed
        "<<tool_call>x",
        '<tool_call>{"name":"get_weather","arguments":{}}</tool_call>',  # city is required
        '<tool_call>{"name":"get_weather","arguments":{"city":"Rome","unit":"kelvin"}}</tool_call>',
        '<tool_call>{"name":"nope","arguments":{}}</tool_call>',
        "a\U0010ffff",  # plane 16 (the grammar's end sentinel) is never generated text
        "<\U0010ffff",
        "<t\U0010ffff",
    ):
        assert not parallel.fullmatch(text), text


def test_auto_regex_is_built_once_per_set_of_tools():
    plan = plan_tools(_tools(WEATHER, TIME), "auto", True)
    assert auto_output_regex(plan) is auto_output_regex(
        plan_tools(_tools(WEATHER, TIME), "auto", True)
    )
    assert auto_output_regex(plan) != auto_output_regex(plan_tools(_tools(WEATHER), "auto", True))
    assert auto_output_regex(plan) != auto_output_regex(
        plan_tools(_tools(WEATHER, TIME), "auto", False)
    )
    assert auto_output_regex(plan) != auto_output_regex(plan, "flexible")


def test_tool_choice_none_leaves_text_alone():
    backend = ScriptedBackend('{"name": "get_time", "arguments": {"timezone": "UTC"}}')
    with TestClient(create_app(backend)) as c:
        body = {
            "messages": [{"role": "user", "content": "Time?"}],
            "tools": [TIME],
            "tool_choice": "none",
        }
        out = c.post("/v1/chat/completions", json=body).json()
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["choices"][0]["message"]["content"] == backend.script
    assert "tool_calls" not in out["choices"][0]["message"]


def test_chat_without_max_tokens_gets_the_room_the_kv_pool_leaves():
    backend = ScriptedBackend("ok", kv_capacity=1000)
    with TestClient(create_app(backend)) as c:
        out = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert out.status_code == 200
    prompt_tokens = out.json()["usage"]["prompt_tokens"]
    assert backend.calls[0]["max_new_tokens"] == 1000 - prompt_tokens


# ---- with the real model -------------------------------------------------------------------


def test_two_turn_tool_loop_with_the_real_model(engine):
    """A named call, its result sent back, and the model's answer. The call's arguments are
    checked against the schema only where the engine enforces JSON schemas."""
    with TestClient(create_app(engine, owns_engine=False)) as c:
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        first = c.post(
            "/v1/chat/completions",
            json={
                "messages": messages,
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                "max_tokens": 24,
                "temperature": 0,
            },
        )
        assert first.status_code == 200, first.text
        message = first.json()["choices"][0]["message"]
        enforced = engine_enforces_constraints(engine)
        if enforced:
            (call,) = message["tool_calls"]
            jsonschema.validate(
                json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"]
            )
        call = {
            "id": "call_0",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": '{"temperature_c": 21}'},
        ]
        second = c.post(
            "/v1/chat/completions",
            json={"messages": messages, "tools": [WEATHER], "max_tokens": 8, "temperature": 0},
        )
        assert second.status_code == 200, second.text
        assert second.json()["usage"]["prompt_tokens"] > first.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    "tool_choice", ["auto", "required", {"type": "function", "function": {"name": "f"}}]
)
def test_tools_with_local_refs_are_served_in_every_mode(engine, tool_choice):
    parameters = {
        "type": "object",
        "$defs": {"A": {"type": "string"}},
        "properties": {"a": {"$ref": "#/$defs/A"}},
    }
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    with TestClient(create_app(engine, owns_engine=False)) as c:
        body = {
            "messages": [{"role": "user", "content": "Call f."}],
            "tools": [tool],
            "tool_choice": tool_choice,
            "max_tokens": 64,  # (room for the two calls the model makes under "required")
            "temperature": 0,
        }
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    calls = choice["message"].get("tool_calls") or []
    if tool_choice != "auto":
        assert calls  # (the grammar demands one)
    if choice["finish_reason"] == "length":  # the last call may be cut short, as designed
        calls = calls[:-1]
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), parameters)


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "tag"}}]
)
def test_a_demanded_call_refuses_keywords_the_grammar_cannot_enforce(engine, tool_choice):
    """A call the client demands must follow the schema: a keyword the grammar cannot enforce
    is a 400 naming it, not a call that may break it."""
    with TestClient(create_app(engine, owns_engine=False)) as c:
        body = {
            "messages": [{"role": "user", "content": "Tag it."}],
            "tools": [TAG],
            "tool_choice": tool_choice,
            "max_tokens": 8,
        }
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert "unsupported keyword 'uniqueItems'" in r.json()["error"]["message"]


def engine_enforces_constraints(engine) -> bool:
    out = engine.generate("Say something:", {"max_new_tokens": 4, "temperature": 0, "regex": "zzz"})
    return out["text"] == "zzz"


def test_auto_regex_constrains_a_call_the_real_model_opens(engine):
    """Few-shot examples lead the model into calls with a wrong argument name; free, it writes
    arguments the schema refuses; under the auto regex the call it opens must follow the schema (and the text stays free)."""
    forecast = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    }
    plan = plan_tools(_tools(forecast), "auto", True)
    prompt = (
        'Q: weather in Rome\nA: <tool_call>\n{"name":"get_weather","arguments":{"town":"Rome"}}\n'
        '</tool_call>\nQ: weather in Oslo\nA: <tool_call>\n{"name":"get_weather","arguments":'
        '{"town":"Oslo"}}\n</tool_call>\nQ: weather in Paris for a week\nA:'
    )
    params = {"max_new_tokens": 40, "temperature": 0, "stop": ["\nQ:"]}
    free = parse_output(engine.generate(prompt, params)["text"], plan)
    (call,) = free.tool_calls
    with pytest.raises(jsonschema.ValidationError):  # the premise: free, it gets them wrong
        jsonschema.validate(
            json.loads(call["function"]["arguments"]), forecast["function"]["parameters"]
        )

    out = engine.generate(prompt, {**params, "regex": auto_output_regex(plan)})
    parsed = parse_output(out["text"], plan)
    (call,) = parsed.tool_calls
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, forecast["function"]["parameters"])
    assert arguments["city"] == "Paris"


def test_the_http_routes_import_without_torch():
    """The HTTP process only parses, renders and forwards; tool grammars load the grammar package
    (and torch) only when a request needs one."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import radixlm.server.native, radixlm.server.openai_api, radixlm.server.metrics\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
