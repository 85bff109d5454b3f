"""Agent frameworks against our server, as their users run them: the OpenAI Agents SDK (its models
over chat completions and over the Responses API, its default) and LangChain's OpenAI chat model,
each through its own OpenAI client pointed at the server. The real default model serves: a demanded
call (tool_choice "required" or a named tool) and a response_format are grammars, so what it writes
is well-formed whatever it knows, and what is checked is the protocol: calls the framework parses
and runs, their results going back into the next prompt, a final output the framework validates,
streamed and not. Each framework's tests skip where it is not installed (`pip install -e ".[dev]"`
installs both)."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from typing import Any, Literal

import jsonschema
import pytest
from pydantic import BaseModel

from radixlm.server.backend import LocalEngineBackend
from tests.live_server import serve_in_thread

# LangChain's structured output serializes its parsed object through a model that types it None
pytestmark = pytest.mark.filterwarnings("ignore:Pydantic serializer warnings:UserWarning")

MAX_TOKENS = 40  # room for a call or a Report, compact, with the default model's tokenizer


class Report(BaseModel):
    """The final answer the agents must give."""

    sunny: bool
    unit: Literal["celsius", "fahrenheit"]


def weather(unit: Literal["celsius", "fahrenheit"]) -> str:
    """The weather in Paris now."""
    return f"sunny, {21 if unit == 'celsius' else 70} degrees {unit}"


def clock(zone: Literal["UTC", "CET"]) -> str:
    """The time now in a time zone."""
    return f"12:00 {zone}"


class RecordingBackend(LocalEngineBackend):
    """The real engine, keeping each generation's prompt, sampling params and finished text."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.runs: list[tuple[str, dict[str, Any], str]] = []

    async def stream(self, input_ids, sampling_params, **options):
        snapshots = await super().stream(input_ids, sampling_params, **options)
        prompt = self.decode(list(input_ids))

        async def recorded():
            async for snapshot in snapshots:
                if snapshot["meta_info"].get("finish_reason") is not None:
                    self.runs.append((prompt, dict(sampling_params), snapshot["text"]))
                yield snapshot

        return recorded()


class Served:
    def __init__(self, url: str, backend: RecordingBackend) -> None:
        self.url = f"{url}/v1"
        self.backend = backend
        with urllib.request.urlopen(f"{self.url}/models") as r:
            self.model = json.load(r)["data"][0]["id"]  # the name the server answers to


# (module-scoped, and named before `served` by the tests: a missing framework skips before the
# engine starts)
@pytest.fixture(scope="module")
def agents_sdk() -> Any:
    return pytest.importorskip("agents")


@pytest.fixture(scope="module")
def langchain_openai() -> Any:
    return pytest.importorskip("langchain_openai")


@pytest.fixture(scope="module")
def served(engine) -> Iterator[Served]:
    backend = RecordingBackend(engine)
    with serve_in_thread(backend) as url:
        yield Served(url, backend)


def _recording_client(url: str, sent: list[dict[str, Any]]) -> Any:
    """An AsyncOpenAI client at `url` that keeps the body of each request it posts."""
    import httpx
    from openai import AsyncOpenAI

    async def keep(request: httpx.Request) -> None:
        if request.method == "POST":
            sent.append(json.loads(request.content))

    http = httpx.AsyncClient(event_hooks={"request": [keep]})
    return AsyncOpenAI(base_url=url, api_key="unused", http_client=http, max_retries=0)


# ---- the OpenAI Agents SDK -----------------------------------------------------------------


def _agent(
    served: Served, sent: list[dict[str, Any]], tool_choice: str, api: str
) -> tuple[Any, list]:
    """An agent with two function tools and Report as its output type, on our server through
    `api` (the SDK's model over /v1/chat/completions or /v1/responses, its default); the list the
    tools append (tool name, arguments, result) to when they run."""
    import agents

    agents.set_tracing_disabled(True)
    models = {
        "chat_completions": agents.OpenAIChatCompletionsModel,
        "responses": agents.OpenAIResponsesModel,
    }
    ran: list[tuple[str, dict[str, Any], str]] = []

    def get_weather(unit: Literal["celsius", "fahrenheit"]) -> str:
        """The weather in Paris now."""
        ran.append(("get_weather", {"unit": unit}, weather(unit)))
        return ran[-1][2]

    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """The time now in a time zone."""
        ran.append(("get_time", {"zone": zone}, clock(zone)))
        return ran[-1][2]

    agent = agents.Agent(
        name="forecaster",
        instructions="Look the weather up, then report it.",
        # offered until one has run (the SDK's is_enabled), so that the next turn answers: with
        # tools offered, a model may go on calling them (tool_choice "auto", as OpenAI's may),
        # and a small model does
        tools=[
            agents.function_tool(tool, is_enabled=lambda context, agent: not ran)
            for tool in (get_weather, get_time)
        ],
        output_type=Report,
        model=models[api](model=served.model, openai_client=_recording_client(served.url, sent)),
        model_settings=agents.ModelSettings(
            tool_choice=tool_choice, max_tokens=MAX_TOKENS, temperature=0
        ),
    )
    return agent, ran


def _check_agent_run(served: Served, agent: Any, sent, ran, items, final, tool_choice) -> None:
    from agents import ToolCallItem, ToolCallOutputItem

    schemas = {t.name: t.params_json_schema for t in agent.tools}
    calls = [i.raw_item for i in items if isinstance(i, ToolCallItem)]
    outputs = {i.raw_item["call_id"]: i.output for i in items if isinstance(i, ToolCallOutputItem)}
    # the model's calls, as the SDK parsed them from our tool_calls, valid for their schemas
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    if tool_choice != "required":
        assert {call.name for call in calls} == {tool_choice}
    # ... each run by the SDK, whose results went back as tool messages with the call's id
    assert [(name, args) for name, args, _ in ran] == [
        (call.name, json.loads(call.arguments)) for call in calls
    ]
    assert [outputs[call.call_id] for call in calls] == [result for *_, result in ran]
    assert len(sent) == 2, sent  # the turn that calls, then the one that answers
    if "messages" in sent[1]:  # chat completions
        tool_messages = [m for m in sent[1]["messages"] if m["role"] == "tool"]
        returned = [(m["tool_call_id"], m["content"]) for m in tool_messages]
        answer_format = sent[1]["response_format"]["json_schema"]["schema"]
    else:  # responses
        outputs_sent = [i for i in sent[1]["input"] if i.get("type") == "function_call_output"]
        returned = [(i["call_id"], i["output"]) for i in outputs_sent]
        answer_format = sent[1]["text"]["format"]["schema"]
    assert returned == [(call.call_id, outputs[call.call_id]) for call in calls]
    # ... and our server put them into the answering turn's prompt
    (call_prompt, _, _), (answer_prompt, params, answer) = served.backend.runs[-2:]
    for *_, result in ran:
        assert result not in call_prompt and result in answer_prompt
    # the answer is the output type's JSON (its response_format), which the SDK validated
    assert json.loads(params["json_schema"]) == answer_format
    assert isinstance(final, Report) and final == Report.model_validate_json(answer)


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
@pytest.mark.parametrize("tool_choice", ["required", "get_time"])
def test_openai_agents_sdk_runs_tools_and_gives_the_final_output(
    agents_sdk, served, tool_choice, api
):
    from agents import Runner

    sent: list[dict[str, Any]] = []
    agent, ran = _agent(served, sent, tool_choice, api)
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    assert not any(body.get("stream") for body in sent)
    _check_agent_run(served, agent, sent, ran, result.new_items, result.final_output, tool_choice)


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_openai_agents_sdk_streams_a_run(agents_sdk, served, api):
    from agents import Runner

    sent: list[dict[str, Any]] = []
    agent, ran = _agent(served, sent, "required", api)

    async def run() -> tuple[Any, list[str]]:
        streamed = Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=4)
        names = [
            event.name
            async for event in streamed.stream_events()
            if event.type == "run_item_stream_event"
        ]
        return streamed, names

    streamed, names = asyncio.run(run())
    assert all(body.get("stream") is True for body in sent)
    calls = names.count("tool_called")
    assert calls >= 1 and names == ["tool_called"] * calls + ["tool_output"] * calls + [
        "message_output_created"
    ]
    _check_agent_run(
        served, agent, sent, ran, streamed.new_items, streamed.final_output, "required"
    )


# ---- LangChain's OpenAI chat model ---------------------------------------------------------


def _chat_model(served: Served, sent: list[dict[str, Any]] | None = None) -> Any:
    """LangChain's ChatOpenAI on our server; `sent` keeps the body of each request it posts."""
    import httpx
    import langchain_openai

    def keep(request: httpx.Request) -> None:
        if sent is not None and request.method == "POST":
            sent.append(json.loads(request.content))

    return langchain_openai.ChatOpenAI(
        model=served.model,
        base_url=served.url,
        api_key="unused",
        max_tokens=MAX_TOKENS,
        temperature=0,
        max_retries=0,
        http_client=httpx.Client(event_hooks={"request": [keep]}),
    )


def _langchain_tools() -> list[Any]:
    from langchain_core.tools import tool

    return [tool(weather), tool(clock)]


def test_langchain_bind_tools_parses_calls_and_takes_their_results(langchain_openai, served):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.utils.function_calling import convert_to_openai_tool

    llm = _chat_model(served)
    tools = {t.name: t for t in _langchain_tools()}
    schemas = {n: convert_to_openai_tool(t)["function"]["parameters"] for n, t in tools.items()}
    question = HumanMessage("What is the weather in Paris?")
    with_tools = llm.bind_tools(list(tools.values()), tool_choice="required")
    reply = with_tools.invoke([question])
    _, params, raw = served.backend.runs[-1]
    assert "json_schema" in params  # the demanded call's grammar
    assert reply.tool_calls and not reply.invalid_tool_calls, raw
    for call in reply.tool_calls:
        jsonschema.validate(call["args"], schemas[call["name"]])
    assert reply.response_metadata["finish_reason"] == "tool_calls"
    # streamed: the same calls (greedy, the same prompt), rebuilt by LangChain from the deltas
    chunks = list(with_tools.stream([question]))
    assert len(chunks) > 1
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [
        (c["name"], c["args"]) for c in reply.tool_calls
    ]
    # the loop: each call run, its result back as a ToolMessage, and the model answers (without
    # tools: offered them, a model may go on calling, as a small one may)
    results = [
        ToolMessage(tools[call["name"]].invoke(call["args"]), tool_call_id=call["id"])
        for call in reply.tool_calls
    ]
    answer = llm.invoke([question, reply, *results])
    prompt, _, text = served.backend.runs[-1]
    for result in results:
        assert result.content in prompt
    assert answer.content == text and not answer.tool_calls


@pytest.mark.parametrize("method", [None, "function_calling"])
def test_langchain_structured_output_is_a_validated_object(langchain_openai, served, method):
    sent: list[dict[str, Any]] = []
    llm = _chat_model(served, sent)
    options = {} if method is None else {"method": method}
    structured = llm.with_structured_output(Report, include_raw=True, **options)
    out = structured.invoke("Report the weather in Paris.")
    assert out["parsing_error"] is None
    report = out["parsed"]
    assert isinstance(report, Report)
    _, params, text = served.backend.runs[-1]
    if method is None:  # its default for our server: response_format json_schema
        (body,) = sent
        assert json.loads(params["json_schema"]) == body["response_format"]["json_schema"]["schema"]
        assert report == Report.model_validate_json(text)
    else:  # a forced call of a tool named after the model
        (call,) = out["raw"].tool_calls
        assert call["name"] == "Report" and Report(**call["args"]) == report
    # streamed, the same object
    streamed = llm.with_structured_output(Report, **options).stream("Report the weather in Paris.")
    assert list(streamed)[-1] == report


def test_langchain_streams_text(langchain_openai, served):
    llm = _chat_model(served)
    chunks = list(llm.stream("Say hello."))
    _, _, text = served.backend.runs[-1]
    assert len(chunks) > 2
    assert "".join(c.content for c in chunks) == text
    reasons = [
        c.response_metadata["finish_reason"]
        for c in chunks
        if "finish_reason" in c.response_metadata
    ]
    assert len(reasons) == 1 and reasons[0] in ("stop", "length"), reasons
