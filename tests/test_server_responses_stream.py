"""A streamed /v1/responses with thinking and tool calls, over a scripted output that arrives a
few characters a step: each item's events as it is generated (the reasoning text, the message's
text, a call's arguments piece by piece), the items and their order those of the same request
not streamed, and the openai client's own accumulation of the events agreeing."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from radixlm.server.app import create_app
from radixlm.server.tool_parsers import tool_call_parser
from tests.test_server_tools import TIME, WEATHER, ScriptedBackend

PARIS = ("get_weather", {"city": "Paris", "unit": "celsius"})
UTC = ("get_time", {"timezone": "UTC"})
TOOLS = [{"type": "function", **t["function"]} for t in (WEATHER, TIME)]


def _openai(client: TestClient):
    from openai import OpenAI

    return OpenAI(base_url="http://testserver/v1", api_key="-", http_client=client, max_retries=0)


def _summary(output: list[Any]) -> list[tuple[str, str]]:
    """(type, its text or arguments) of each output item."""
    out = []
    for item in output:
        if item.type == "function_call":
            out.append((f"function_call {item.name}", item.arguments))
        else:
            out.append((item.type, "".join(part.text for part in item.content or [])))
    return out


@pytest.mark.parametrize("family", ["hermes", "pythonic", None])
def test_thinking_text_and_calls_stream_as_they_are_generated(family):
    if family is None:  # the server's default format, a call demanded: an array of calls
        calls = json.dumps([{"name": n, "arguments": a} for n, a in (PARIS, UTC)])
        script, choice, answer = (
            f"<think>\nThe user wants both.\n</think>\n\n{calls}",
            "required",
            "",
        )
    else:
        calls = tool_call_parser(family).format_calls([PARIS, UTC])
        script = f"<think>\nThe user wants both.\n</think>\n\nChecking. {calls}"
        choice, answer = "auto", "Checking."
    options: dict[str, Any] = {"reasoning_parser": "qwen3"}
    if family is not None:
        options["tool_call_parser"] = family
    request = {"model": "scripted", "input": "Weather and time in Paris?", "tools": TOOLS}
    request["tool_choice"] = choice
    with TestClient(create_app(ScriptedBackend(script), **options)) as client:
        openai = _openai(client)
        events = list(openai.responses.create(**request, stream=True))
        whole = openai.responses.create(**request)
        with openai.responses.stream(**request) as stream:  # (the client's own accumulation)
            accumulated = stream.get_final_response()
    expected = [
        ("reasoning", "The user wants both."),
        *([("message", answer)] if answer else []),
        ("function_call get_weather", json.dumps(PARIS[1])),
        ("function_call get_time", json.dumps(UTC[1])),
    ]
    final = events[-1].response
    assert events[-1].type == "response.completed"
    assert _summary(final.output) == _summary(whole.output) == _summary(accumulated.output)
    assert [(kind, _value(text)) for kind, text in _summary(final.output)] == [
        (kind, _value(text)) for kind, text in expected
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # each item's text went out in pieces, as generated, and adds up to the item
    by_item: dict[str, list[str]] = {}
    for e in events:
        if e.type.endswith(".delta"):
            by_item.setdefault(e.item_id, []).append(e.delta)
    for item in final.output:
        pieces = by_item[item.id]
        assert len(pieces) > 1, (item.type, pieces)
        text = item.arguments if item.type == "function_call" else item.content[0].text
        assert "".join(pieces) == text
    # the thinking is done before the answer begins
    kinds = [(e.type, getattr(e, "output_index", None)) for e in events]
    reasoning_done = kinds.index(("response.output_item.done", 0))
    first_answer = next(i for i, (_, index) in enumerate(kinds) if index == 1)
    assert reasoning_done < first_answer


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def test_an_output_with_only_thinking_still_has_its_message():
    script = "<think>\nNothing to say.\n</think>\n\n"
    with TestClient(create_app(ScriptedBackend(script), reasoning_parser="qwen3")) as client:
        events = list(_openai(client).responses.create(model="scripted", input="Hm?", stream=True))
    assert _summary(events[-1].response.output) == [
        ("reasoning", "Nothing to say."),
        ("message", ""),
    ]
