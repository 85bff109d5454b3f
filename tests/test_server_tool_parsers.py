"""`tool_call_parser` and `reasoning_parser` through the server: with the real default model, a
demanded call (tool_choice "required" or a named tool) comes out in the family's own format and
the same server reads it back into `tool_calls` whose arguments follow the schema, streamed and
not, as the openai client reads them too; the reasoning split over a scripted output."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
from fastapi.testclient import TestClient

from radixlm.server.app import create_app
from radixlm.server.backend import LocalEngineBackend
from radixlm.server.chat import render_chat_prompt
from radixlm.server.tool_parsers import tool_call_parser
from radixlm.server.tools import plan_tools
from tests.live_server import sse_payloads
from tests.test_server_tools import TIME, WEATHER, ScriptedBackend, chat_request

# what each family's output opens with (as its documentation writes it), whatever the grammar
FAMILY_OPENING = {
    "hermes": '<tool_call>\n{"name": "',
    "llama3": '{"name": "',
    "pythonic": "[get_",
    "mistral": '[TOOL_CALLS] [{"name": "',
    "deepseekv3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_",
}
# DeepSeek's markers are many tokens each in the default model's vocabulary (a call is about 90):
# room for one call, and one call only (parallel calls would run past it, and a section cut off
# before its end marker is content)
MAX_TOKENS = {"deepseekv3": 130}
ONE_CALL = {"deepseekv3"}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


class RecordingBackend(LocalEngineBackend):
    """The real engine, keeping each generation's sampling params and finished text."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.runs: list[tuple[dict[str, Any], str]] = []

    async def stream(self, input_ids, sampling_params, **options):
        snapshots = await super().stream(input_ids, sampling_params, **options)

        async def recorded():
            # recorded at the finished snapshot: a consumer may stop reading there, never
            # reaching the end of the iteration
            async for snapshot in snapshots:
                if snapshot["meta_info"].get("finish_reason") is not None:
                    self.runs.append((dict(sampling_params), snapshot["text"]))
                yield snapshot

        return recorded()


@pytest.fixture(scope="module")
def served(engine):
    """family -> (client, backend), one app per family over the one engine."""
    apps: dict[str, tuple[TestClient, RecordingBackend]] = {}
    try:
        for family in FAMILY_OPENING:
            backend = RecordingBackend(engine)
            client = TestClient(create_app(backend, owns_engine=False, tool_call_parser=family))
            apps[family] = (client.__enter__(), backend)
        yield apps
    finally:
        for client, _ in apps.values():
            client.__exit__(None, None, None)


def _streamed_calls(chunks: list[dict[str, Any]]) -> tuple[str, list[list[str]], str]:
    content, calls, reason = "", [], None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for d in delta.get("tool_calls") or []:
                if "id" in d:
                    assert d["index"] == len(calls)
                    calls.append([d["function"]["name"], d["function"].get("arguments", "")])
                else:
                    calls[d["index"]][1] += d["function"]["arguments"]
            reason = choice["finish_reason"] or reason
    return content, calls, reason


@pytest.mark.parametrize("family", list(FAMILY_OPENING))
@pytest.mark.parametrize("tool_choice", ["required", "named"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_demanded_call_is_written_in_the_family_format_and_read_back(
    served, family, tool_choice, stream
):
    client, backend = served[family]
    choice: Any = tool_choice
    if tool_choice == "named":
        choice = {"type": "function", "function": {"name": "get_weather"}}
    body = {
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER, TIME],
        "tool_choice": choice,
        "max_tokens": MAX_TOKENS.get(family, 60),
        "temperature": 0,
        "stream": stream,
    }
    if family in ONE_CALL:
        body["parallel_tool_calls"] = False
    if stream:
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            chunks = [x for x in sse_payloads(r.iter_lines()) if x != "[DONE]"]
        content, calls, reason = _streamed_calls(chunks)
    else:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        out = r.json()["choices"][0]
        message, reason = out["message"], out["finish_reason"]
        content = message["content"]
        calls = [[c["function"]["name"], c["function"]["arguments"]] for c in message["tool_calls"]]
    params, raw = backend.runs[-1]
    # the output is the family's format, as the grammar the server sent demands
    assert "json_schema" not in params
    assert raw.startswith(FAMILY_OPENING[family]), raw
    assert re.fullmatch(params["regex"], raw, re.DOTALL) or reason == "length", raw
    # ... and the server read it back: every call the output holds, nothing left as content
    parsed = tool_call_parser(family).parse(raw, {"get_weather", "get_time"})
    assert calls == [[c.name, c.arguments] for c in parsed.calls]
    assert calls, raw
    if tool_choice == "named":
        assert [name for name, _ in calls] == ["get_weather"] and reason == "tool_calls"
    if reason == "tool_calls":
        assert not content
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("family", list(FAMILY_OPENING))
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_openai_client_gets_the_calls_of_each_family(served, family, stream):
    from openai import OpenAI

    client, backend = served[family]  # (a TestClient is an httpx.Client the openai client takes)
    openai = OpenAI(base_url="http://testserver/v1", api_key="-", http_client=client, max_retries=0)
    request = {
        "model": client.get("/v1/models").json()["data"][0]["id"],
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER, TIME],
        "tool_choice": "required",
        "max_tokens": MAX_TOKENS.get(family, 60),
        "temperature": 0,
        "parallel_tool_calls": family not in ONE_CALL,
    }
    if stream:
        calls: dict[int, list[str]] = {}
        pieces: dict[int, int] = {}
        for chunk in openai.chat.completions.create(**request, stream=True):
            for delta in (chunk.choices[0].delta.tool_calls if chunk.choices else None) or []:
                call = calls.setdefault(delta.index, ["", ""])
                call[0] += delta.function.name or ""
                call[1] += delta.function.arguments or ""
                pieces[delta.index] = pieces.get(delta.index, 0) + bool(delta.function.arguments)
        got = list(calls.values())
        # the arguments went out as they were generated, not in one piece at the end
        assert pieces and all(n > 1 for n in pieces.values()), pieces
    else:
        message = openai.chat.completions.create(**request).choices[0].message
        got = [[c.function.name, c.function.arguments] for c in message.tool_calls or []]
    raw = backend.runs[-1][1]
    assert raw.startswith(FAMILY_OPENING[family]), raw
    parsed = tool_call_parser(family).parse(raw, {"get_weather", "get_time"})
    assert got and got == [[c.name, c.arguments] for c in parsed.calls]
    for name, arguments in got:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_earlier_calls_are_written_in_the_parser_format_where_the_template_has_no_tools(engine):
    backend = LocalEngineBackend(engine)
    req = chat_request(
        tools=[WEATHER],
        messages=[
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
    prompt = render_chat_prompt(backend, req.messages, plan, None, tool_call_parser("pythonic"))
    assert '[get_weather(city="Paris")]' in prompt
    assert "<tool_call>" not in prompt  # (the default format's blocks)
    system = prompt.split("<|im_start|>user")[0]  # how to call, in the parser's format
    assert '[<function name>(<argument>="<value>")]' in system


# ---- reasoning, over a scripted output -----------------------------------------------------

THINKING = "The user wants the time in UTC, so get_time."
# (as the grammar writes it: the arguments' JSON compact)
CALL = '<tool_call>\n{"name": "get_time", "arguments": {"timezone":"UTC"}}\n</tool_call>'


def _app(script: str, finish: str = "stop", **options: Any) -> tuple[TestClient, ScriptedBackend]:
    backend = ScriptedBackend(script, finish=finish)
    return TestClient(create_app(backend, **options)), backend


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_thinking_is_reasoning_content_and_calls_are_read_from_the_answer(stream):
    # deepseek-r1: the template opened <think>, so the output starts inside the thinking; a
    # call written while thinking is no call
    script = f"{THINKING} Maybe <tool_call>\n</think>\n\n{CALL}"
    client, backend = _app(script, tool_call_parser="hermes", reasoning_parser="deepseek-r1")
    body = {
        "messages": [{"role": "user", "content": "Time?"}],
        "tools": [WEATHER, TIME],
        "tool_choice": "required",
        "stream": stream,
    }
    with client:
        if stream:
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                chunks = [x for x in sse_payloads(r.iter_lines()) if x != "[DONE]"]
            content, calls, reason = _streamed_calls(chunks)
            thinking = "".join(
                c["choices"][0]["delta"].get("reasoning_content") or "" for c in chunks
            )
        else:
            out = client.post("/v1/chat/completions", json=body).json()["choices"][0]
            message, reason = out["message"], out["finish_reason"]
            content, thinking = message["content"], message.get("reasoning_content")
            calls = [
                [c["function"]["name"], c["function"]["arguments"]] for c in message["tool_calls"]
            ]
    assert thinking == f"{THINKING} Maybe <tool_call>"
    assert calls == [["get_time", '{"timezone":"UTC"}']]  # (as generated)
    assert not content and reason == "tool_calls"
    # the forced grammar lets the model think first, then demands the call in its format
    forced = re.compile(backend.calls[0]["regex"], re.DOTALL)
    assert forced.fullmatch(script) and not forced.fullmatch(f"{THINKING}\n</think>\nNo call.")


@pytest.mark.parametrize("family", list(FAMILY_OPENING))
def test_the_openai_client_gets_arguments_in_pieces_as_they_come(family):
    # the scripted output arrives a few characters a step: each call goes out as OpenAI streams
    # one (its index, id, type and name first, then its arguments piece by piece), and the
    # pieces add up to the arguments of the same output read whole
    calls = tool_call_parser(family).format_calls(
        [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "UTC"})]
    )
    script = calls if family == "llama3" else f"Checking. {calls}"  # (llama3: calls alone)
    from openai import OpenAI

    client, _ = _app(script, tool_call_parser=family)
    with client:
        openai = OpenAI(
            base_url="http://testserver/v1", api_key="-", http_client=client, max_retries=0
        )
        request = {
            "model": client.get("/v1/models").json()["data"][0]["id"],
            "messages": [{"role": "user", "content": "Weather and time in Paris?"}],
            "tools": [WEATHER, TIME],
        }
        content, firsts, pieces, reasons = "", {}, {}, []
        for chunk in openai.chat.completions.create(**request, stream=True):
            for choice in chunk.choices:
                content += choice.delta.content or ""
                reasons.append(choice.finish_reason)
                for delta in choice.delta.tool_calls or []:
                    if delta.id is not None:
                        assert delta.index == len(firsts) and delta.type == "function"
                        firsts[delta.index] = delta.function.name
                        assert delta.function.arguments == ""
                    else:  # later deltas: the call's index and a piece of its arguments only
                        assert delta.function.name is None and delta.type is None
                        pieces.setdefault(delta.index, []).append(delta.function.arguments)
        whole = openai.chat.completions.create(**request).choices[0]
    assert firsts == {0: "get_weather", 1: "get_time"}
    assert len(pieces[0]) > 2 and len(pieces[1]) > 1, pieces
    assert ["".join(pieces[i]) for i in sorted(pieces)] == [
        c.function.arguments for c in whole.message.tool_calls or []
    ]
    assert [json.loads("".join(pieces[i])) for i in sorted(pieces)] == [
        {"city": "Paris", "unit": "celsius"},
        {"timezone": "UTC"},
    ]
    assert content == (whole.message.content or "") == ("" if family == "llama3" else "Checking.")
    assert [r for r in reasons if r] == ["tool_calls"] and whole.finish_reason == "tool_calls"


def test_separate_reasoning_false_keeps_the_thinking_in_the_content():
    script = f"<think>{THINKING}</think>\n\nIt is noon."
    client, _ = _app(script, reasoning_parser="qwen3")
    body = {"messages": [{"role": "user", "content": "Time?"}]}
    with client:
        apart = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        together = client.post(
            "/v1/chat/completions", json={**body, "separate_reasoning": False}
        ).json()["choices"][0]["message"]
    assert apart["reasoning_content"] == THINKING and apart["content"] == "It is noon."
    assert together["content"] == script and "reasoning_content" not in together


def test_an_unknown_parser_name_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="pythonic"):
        create_app(ScriptedBackend("x"), tool_call_parser="llama9")
    with pytest.raises(ValueError, match="deepseek-r1"):
        create_app(ScriptedBackend("x"), reasoning_parser="r2")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_max_tokens_reached_while_thinking_is_all_thinking_and_length(stream):
    client, _ = _app(f"<think>{THINKING} Then", finish="length", reasoning_parser="qwen3")
    body = {"messages": [{"role": "user", "content": "Time?"}], "max_tokens": 16, "stream": stream}
    with client:
        if stream:
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                chunks = [x for x in sse_payloads(r.iter_lines()) if x != "[DONE]"]
            deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
            thinking = "".join(d.get("reasoning_content") or "" for d in deltas)
            content = "".join(d.get("content") or "" for d in deltas)
            reason = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
        else:
            out = client.post("/v1/chat/completions", json=body).json()["choices"][0]
            message, reason = out["message"], out["finish_reason"]
            thinking, content = message.get("reasoning_content"), message["content"]
    # the output was cut off inside the thinking: no answer, and the finish reason says so
    assert thinking == f"{THINKING} Then" and not content and reason == "length"


def _chat(client: TestClient, body: dict[str, Any]) -> tuple[str | None, str | None, str]:
    """(reasoning_content, content, finish_reason) of a chat completion, streamed or not."""
    if not body.get("stream"):
        out = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        message = out["message"]
        return message.get("reasoning_content"), message["content"], out["finish_reason"]
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        chunks = [x for x in sse_payloads(r.iter_lines()) if x != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    reason = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
    thinking = "".join(d.get("reasoning_content") or "" for d in deltas) or None
    return thinking, "".join(d.get("content") or "" for d in deltas), reason


HOUR = {"type": "object", "properties": {"hour": {"type": "integer"}}, "required": ["hour"]}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_json_schema_holds_the_answer_after_the_thinking(stream):
    answer = '{"hour":12}'
    script = f"<think>{THINKING}</think>\n\n{answer}"
    client, backend = _app(script, reasoning_parser="qwen3")
    fmt = {"type": "json_schema", "json_schema": {"name": "hour", "schema": HOUR}}
    body = {"messages": [{"role": "user", "content": "Hour?"}], "response_format": fmt}
    with client:
        thinking, content, reason = _chat(client, {**body, "stream": stream})
    assert thinking == THINKING and content == answer and reason == "stop"
    # the grammar: the thinking free (qwen3: none at all, too), then the answer in the schema
    sent = backend.calls[0]
    assert "json_schema" not in sent
    held = re.compile(sent["regex"], re.DOTALL)
    assert held.fullmatch(script) and held.fullmatch(answer)
    assert not held.fullmatch(f"<think>{THINKING}</think>\n\nNoon.")
    assert not held.fullmatch(f'<think>{THINKING}</think>\n\n{{"hour":"12"}}')


def test_a_schema_no_regex_holds_whole_holds_the_whole_output_as_before():
    client, backend = _app('["a"]', reasoning_parser="qwen3")
    schema = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
    fmt = {"type": "json_schema", "json_schema": {"name": "tags", "schema": schema}}
    body = {"messages": [{"role": "user", "content": "Tags?"}], "response_format": fmt}
    with client:
        thinking, content, _ = _chat(client, body)
    assert json.loads(backend.calls[0]["json_schema"]) == schema and "regex" not in backend.calls[0]
    assert thinking is None and content == '["a"]'


def test_the_real_model_answers_in_the_schema_with_a_reasoning_parser(engine):
    app = create_app(LocalEngineBackend(engine), owns_engine=False, reasoning_parser="qwen3")
    sunny = {"type": "object", "properties": {"sunny": {"type": "boolean"}}, "required": ["sunny"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "sunny", "schema": sunny}}
    body = {
        "messages": [{"role": "user", "content": "Is the sun up at noon? Answer in JSON."}],
        "response_format": fmt,
        "max_tokens": 40,
        "temperature": 0,
    }
    with TestClient(app) as client:
        for stream in (False, True):
            thinking, content, reason = _chat(client, {**body, "stream": stream})
            assert reason == "stop", (thinking, content)
            jsonschema.validate(json.loads(content), sunny)
