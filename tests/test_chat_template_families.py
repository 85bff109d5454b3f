"""Chat templates of each tool-call family and of reasoning models, written for the tests
(tests/chat_templates/, each from its family's documented format), served by the real default
model through `chat_template`.

Tools: `tool_call_parser="auto"` reads each family from its template; a demanded call
(tool_choice "required", then a named tool) comes out in that family's format and the same server
reads it back into `tool_calls`, through the openai client, streamed and not; the second turn
feeds the call and its result back, and the template writes them in the family's format.

Reasoning: with `reasoning_parser` (`qwen3`: the model opens `<think>`; `deepseek-r1`: the
template's generation prompt does), `reasoning_content` and `content` are the output's thinking
and answer, streamed and not, with and without a JSON schema on the answer. The real model thinks
because the request shows it how: earlier turns with their `reasoning_content`, which the
template writes back inside `<think>`.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from fastapi.testclient import TestClient

from radixlm.runtime.chat_templates import load_chat_template
from radixlm.server.app import create_app
from radixlm.server.tool_parsers import detect_tool_call_parser, tool_call_parser
from tests.test_agent_frameworks import RecordingBackend
from tests.test_server_tool_parsers import FAMILY_OPENING

TEMPLATES = Path(__file__).parent / "chat_templates"
FAMILIES = list(FAMILY_OPENING)

# enums: what the model chooses is a token or two, the rest of a call the grammar writes (and
# the engine appends without decoding it), which keeps each generation short on a CPU
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Tokyo"]},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time now in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}
TOOLS = {t["function"]["name"]: t for t in (WEATHER, TIME)}
RESULTS = {"get_weather": "sunny, 21 degrees", "get_time": "12:00"}
QUESTION = "What is the weather in Paris, and the time?"
# where each template puts a tool's result (the family's documented wrapping)
RESULT_OPENING = {
    "hermes": "<tool_response>\n",
    "llama3": "<|start_header_id|>ipython<|end_header_id|>\n\n",
    "pythonic": "<|start_header_id|>ipython<|end_header_id|>\n\n",
    "mistral": '[TOOL_RESULTS] {"content": "',
    "deepseekv3": "<｜tool▁output▁begin｜>",
}
MAX_TOKENS = 120  # (a call is far shorter but for DeepSeek's markers, many tokens each)


@contextlib.contextmanager
def _serve(default_model_folder: str, template: str, **options: Any) -> Iterator[Any]:
    """The real default model with the chat template `template` (tests/chat_templates/), and a
    client of a server over it that records each generation."""
    import radixlm

    path = str(TEMPLATES / f"{template}.jinja")
    # a small KV pool (these prompts are short) and no overlap schedule, with which these short
    # generations took half as long again on a CPU of two cores
    with radixlm.Engine(
        default_model_folder,
        chat_template=path,
        max_total_tokens=4096,
        disable_overlap_schedule=True,
    ) as engine:
        backend = RecordingBackend(engine)
        with TestClient(create_app(backend, owns_engine=False, **options)) as client:
            yield client, backend


def _completions(client: TestClient) -> Callable[..., Any]:
    """The openai client's `chat.completions.create` on the served model."""
    from openai import OpenAI

    # (a TestClient is an httpx.Client, which the openai client takes)
    openai = OpenAI(base_url="http://testserver/v1", api_key="-", http_client=client, max_retries=0)
    model = client.get("/v1/models").json()["data"][0]["id"]
    return functools.partial(openai.chat.completions.create, model=model)


# ---- tool calls ----------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_reads_each_family_from_its_template(family):
    assert detect_tool_call_parser(load_chat_template(str(TEMPLATES / f"{family}.jinja"))) == family


@pytest.fixture(scope="module", params=FAMILIES)
def family_served(request, default_model_folder) -> Iterator[tuple[str, TestClient, Any]]:
    """(family, client, backend): the family's template served with tool_call_parser "auto"."""
    with _serve(default_model_folder, request.param, tool_call_parser="auto") as (client, backend):
        yield request.param, client, backend


def _call(
    create: Callable[..., Any], messages: list[dict[str, Any]], tool_choice: Any, stream: bool
) -> Any:
    """(content, [[id, name, arguments]] of the calls, finish_reason) of one chat completion."""
    request = {
        "messages": messages,
        "tools": list(TOOLS.values()),
        "tool_choice": tool_choice,
        "parallel_tool_calls": False,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    if not stream:
        choice = create(**request).choices[0]
        calls = [[c.id, c.function.name, c.function.arguments] for c in choice.message.tool_calls]
        return choice.message.content, calls, choice.finish_reason
    content, calls, reason = "", [], None
    for chunk in create(**request, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reason = choice.finish_reason or reason
            for delta in choice.delta.tool_calls or []:
                if delta.id is not None:
                    assert delta.index == len(calls)
                    calls.append([delta.id, delta.function.name, ""])
                calls[delta.index][2] += delta.function.arguments or ""
    return content, calls, reason


def _check_read_back(family: str, backend: Any, calls: list[list[str]]) -> None:
    """The output was a call in the family's format, and the calls are what the family's parser
    reads from it, their arguments following the tool's schema."""
    raw = backend.runs[-1][2]
    assert raw.startswith(FAMILY_OPENING[family]), raw
    parsed = tool_call_parser(family).parse(raw, set(TOOLS))
    assert [[name, arguments] for _, name, arguments in calls] == [
        [c.name, c.arguments] for c in parsed.calls
    ]
    for _, name, arguments in calls:
        jsonschema.validate(json.loads(arguments), TOOLS[name]["function"]["parameters"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_call_in_the_family_format_is_read_back_and_fed_back_through_the_template(
    family_served, stream
):
    family, client, backend = family_served
    create = _completions(client)
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]

    # the first turn: some call, demanded
    content, calls, reason = _call(create, messages, "required", stream)
    assert len(calls) == 1 and reason == "tool_calls" and not content, (calls, content)
    _check_read_back(family, backend, calls)
    [[call_id, name, arguments]] = calls

    # the second turn: that call and its result, and a named call of the other tool
    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": RESULTS[name]},
    ]
    other = next(n for n in TOOLS if n != name)
    named = {"type": "function", "function": {"name": other}}
    content, calls, reason = _call(create, messages, named, stream)
    assert [n for _, n, _ in calls] == [other] and reason == "tool_calls" and not content
    _check_read_back(family, backend, calls)

    # ... whose prompt has the earlier call as the family writes one, then its result
    prompt = backend.runs[-1][0]
    earlier = prompt[prompt.index(QUESTION) + len(QUESTION) :]
    [written] = tool_call_parser(family).parse(earlier, set(TOOLS)).calls
    assert (written.name, json.loads(written.arguments)) == (name, json.loads(arguments))
    assert RESULT_OPENING[family] + RESULTS[name] in earlier


# ---- reasoning -----------------------------------------------------------------------------

# earlier turns with their thinking: the model learns from them to think briefly, then answer
SHOTS = [
    ("Is ice cold?", "Ice is frozen water, so it is cold.", "Yes, ice is cold."),
    ("Is 7 more than 3?", "Seven comes after three.", "Yes, 7 is more than 3."),
]
YES = {"type": "object", "properties": {"yes": {"type": "boolean"}}, "required": ["yes"]}
REASONING = {"qwen3": "qwen3", "deepseek_r1": "deepseek-r1"}  # template -> reasoning_parser


@pytest.fixture(scope="module", params=list(REASONING))
def reasoning_served(request, default_model_folder) -> Iterator[tuple[str, Callable, Any]]:
    """(reasoning parser, a chat completion's `create`, backend): a reasoning model's template
    served with its parser."""
    parser = REASONING[request.param]
    with _serve(default_model_folder, request.param, reasoning_parser=parser) as (client, backend):
        yield parser, _completions(client), backend


def _answer(create: Callable[..., Any], schema: dict[str, Any] | None, stream: bool) -> Any:
    """(reasoning_content, content, finish_reason) of a question after the SHOTS."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Think briefly, then answer in one short sentence."}
    ]
    for question, thinking, answer in SHOTS:
        messages.append({"role": "user", "content": question})
        messages.append({"role": "assistant", "content": answer, "reasoning_content": thinking})
    messages.append({"role": "user", "content": "Is fire hot?"})
    request: dict[str, Any] = {
        "messages": messages,
        "max_tokens": 48,
        "temperature": 0,
    }
    if schema is not None:
        request["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "yes", "schema": schema},
        }
    if not stream:
        choice = create(**request).choices[0]
        thinking = getattr(choice.message, "reasoning_content", None)
        return thinking, choice.message.content, choice.finish_reason
    thinking, content, reason = "", "", None
    for chunk in create(**request, stream=True):
        for choice in chunk.choices:
            thinking += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
            reason = choice.finish_reason or reason
    return thinking, content, reason


# each parser answers once whole and once streamed, and each kind of answer comes both ways
# (four generations in all)
STREAMED = {("qwen3", "text"), ("deepseek-r1", "json_schema")}


@pytest.mark.parametrize("schema", [None, YES], ids=["text", "json_schema"])
def test_the_thinking_and_the_answer_split(reasoning_served, schema):
    parser, create, backend = reasoning_served
    stream = (parser, "text" if schema is None else "json_schema") in STREAMED
    reasoning_content, content, reason = _answer(create, schema, stream)
    prompt, params, raw = backend.runs[-1]

    # the template wrote the earlier thinking back, and opened <think> (deepseek-r1) or left it
    # to the model (qwen3), which opened it
    for _, thinking, answer in SHOTS:
        assert f"<think>\n{thinking}\n</think>\n\n{answer}" in prompt
    opened_by_template = prompt.endswith("<think>\n")
    assert opened_by_template == (parser == "deepseek-r1")
    assert opened_by_template or raw.startswith("<think>"), raw
    # the model thought and then answered (what the shots make it do, and the premise here)
    assert "</think>" in raw and raw.count("<think>") <= 1, raw
    thinking, answer = raw.split("</think>", 1)
    thinking = thinking.removeprefix("<think>").strip()

    assert reasoning_content == thinking and thinking
    assert content == answer.strip()  # (may be empty: the model may end as it stops thinking)
    assert reason == "stop"
    if schema is not None:
        # the schema held the answer after the thinking: one regex of both, and an answer in it
        assert "regex" in params and "json_schema" not in params
        jsonschema.validate(json.loads(content), schema)
