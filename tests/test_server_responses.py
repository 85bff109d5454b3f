"""OpenAI's Responses API (/v1/responses, stateless) through the `openai` client, over the real
default model on a live server."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.live_server import serve_in_thread

openai = pytest.importorskip("openai")

GREEDY = {"temperature": 0.0}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def url(engine):
    with serve_in_thread(engine) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused")


def chat_text(client, messages, max_tokens):
    done = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_tokens=max_tokens, **GREEDY
    )
    return done.choices[0].message.content, done.usage, done.choices[0].finish_reason


def test_a_response_answers_as_the_chat_with_its_instructions_first(client):
    r = client.responses.create(
        model="SmolLM2-135M-Instruct",
        instructions="Answer in one word.",
        input="What is the capital of France?",
        max_output_tokens=8,
        **GREEDY,
    )
    text, usage, reason = chat_text(
        client,
        [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        8,
    )
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == text
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant"
    assert r.usage.input_tokens == usage.prompt_tokens
    assert r.usage.output_tokens == usage.completion_tokens
    assert r.status == ("incomplete" if reason == "length" else "completed")


def test_message_items_and_a_cut_off_answer(client):
    r = client.responses.create(
        model="SmolLM2-135M-Instruct",
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Count to ten."}]},
        ],
        max_output_tokens=3,
        **GREEDY,
    )
    text, _, reason = chat_text(client, [{"role": "user", "content": "Count to ten."}], 3)
    assert reason == "length"
    assert r.output_text == text
    assert r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"


def test_a_streamed_response_sends_the_responses_events(client):
    events = list(
        client.responses.create(
            model="SmolLM2-135M-Instruct", input="Name a fruit.", max_output_tokens=6,
            stream=True, **GREEDY,
        )
    )  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1
    final = events[-1].response
    text, _, _ = chat_text(client, [{"role": "user", "content": "Name a fruit."}], 6)
    assert "".join(deltas) == final.output_text == text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_demanded_function_call_and_its_output_in_the_next_turn(client):
    r = client.responses.create(
        model="SmolLM2-135M-Instruct",
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=40,
        **GREEDY,
    )
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    follow = client.responses.create(
        model="SmolLM2-135M-Instruct",
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
             "arguments": calls[0].arguments},
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny."},
        ],
        tools=[WEATHER],
        max_output_tokens=8,
        **GREEDY,
    )  # fmt: skip
    assert follow.usage.input_tokens > r.usage.input_tokens
    streamed = list(
        client.responses.create(
            model="SmolLM2-135M-Instruct", input="What is the weather in Paris?",
            tools=[WEATHER], tool_choice="required", max_output_tokens=40, stream=True, **GREEDY,
        )
    )  # fmt: skip
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [c.arguments for c in calls]
    assert streamed[-1].type == "response.completed"


@pytest.mark.parametrize(
    "body, message",
    [
        ({"input": ""}, "input is empty"),
        ({"input": 3}, "input must be"),
        ({"input": [{"role": "wizard", "content": "a"}]}, "role"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "text only"),
        ({"input": [{"type": "web_search_call"}]}, "function_call_output"),
        ({"input": "a", "previous_response_id": "resp_1"}, "stores no responses"),
        ({"input": "a", "tools": [{"type": "web_search"}]}, "function tools only"),
        ({"input": "a", "tool_choice": {"type": "mcp"}}, "tool_choice"),
        ({"input": "a", "max_output_tokens": -1}, "max_tokens"),
        ({"input": "a", "unknown": 1}, "unknown field"),
    ],
)
def test_bad_requests_are_400s_that_say_what_to_change(url, body, message):
    r = httpx.post(url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
