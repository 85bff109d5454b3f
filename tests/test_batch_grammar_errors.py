"""One refused grammar in a batch fails only its own item, at every entry point a user batches
through: the native `/generate` with a list of prompts (whole and streamed), the DSL's `run_batch`
(in-process and over `RuntimeEndpoint`). A single request with a refused grammar is still a 400
(a ValueError in process), and so is an OpenAI completions batch, whose grammar every prompt
shares. On the real default model, greedy, with short outputs."""

from __future__ import annotations

import json

import jsonschema
import pytest
from fastapi.testclient import TestClient

import radixlm as sgl
from radixlm.errors import GrammarRefused
from radixlm.lang.backend import BackendError
from radixlm.lang.engine_backend import EngineBackend
from radixlm.lang.interpreter import ProgramError
from radixlm.server.app import create_app
from radixlm.server.backend import LocalEngineBackend
from radixlm.server.ipc import GRAMMAR, error_kind, exception_for, is_callers_fault
from tests.live_server import serve_in_thread, sse_payloads
from tests.test_server import parse_prometheus

# llguidance cannot enforce `not`: refused, naming the keyword
REFUSED = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
NUMBER = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["n"],
    "additionalProperties": False,
}
PROMPT = "Answer in JSON. What is the capital of France?"
GREEDY = {"temperature": 0, "max_new_tokens": 48}


def constrained(schema: dict) -> dict:
    return {**GREEDY, "json_schema": json.dumps(schema)}


def assert_refused(item: dict) -> None:
    """A refused item: no output, aborted with the reason naming the keyword, as SGLang shapes
    an abort (no `error`, which would mark a failure of the engine's own)."""
    reason = item["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "not" in reason["message"], reason
    assert item["text"] == "" and item["output_ids"] == []
    assert item["meta_info"]["completion_tokens"] == 0
    assert "error" not in item["meta_info"]


def assert_follows(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine, owns_engine=False)) as c:
        yield c


def metrics(c: TestClient) -> dict[str, float]:
    samples = parse_prometheus(c.get("/metrics").text)
    return {
        key: samples.get(f"radixlm_{name}", 0.0)
        for key, name in (
            ("refused", 'errors_total{kind="invalid_request_error"}'),
            ("disconnected", 'errors_total{kind="client_disconnected"}'),
            ("engine_error", 'errors_total{kind="engine_error"}'),
            ("aborted", 'requests_total{finish_reason="abort"}'),
            ("stopped", 'requests_total{finish_reason="stop"}'),
        )
    }


# ---- native /generate ----------------------------------------------------------------------


def test_a_refused_grammar_in_a_batch_aborts_only_its_item(client, engine):
    before = metrics(client)
    r = client.post(
        "/generate",
        json={
            "text": [PROMPT, PROMPT, "Answer in JSON. Pick a number."],
            "sampling_params": [constrained(CITY), constrained(REFUSED), constrained(NUMBER)],
        },
    )
    assert r.status_code == 200, r.text
    first, refused, third = r.json()
    assert_refused(refused)
    assert_follows(first["text"], CITY)
    assert_follows(third["text"], NUMBER)
    # the valid items are what they would be alone
    assert first["text"] == engine.generate(PROMPT, constrained(CITY))["text"]

    after = metrics(client)
    assert after["refused"] - before["refused"] == 1  # as a refused single request counts
    assert after["aborted"] - before["aborted"] == 1
    assert after["stopped"] - before["stopped"] == 2
    assert after["disconnected"] == before["disconnected"]
    assert after["engine_error"] == before["engine_error"]


def test_a_streamed_batch_with_a_refused_grammar_streams_the_others(client):
    body = {
        "text": [PROMPT, PROMPT],
        "sampling_params": [constrained(REFUSED), constrained(CITY)],
        "stream": True,
    }
    with client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        events = sse_payloads(r.iter_lines())
    assert events[-1] == "[DONE]"
    assert not any("error" in e for e in events[:-1]), events
    by_index: dict[int, list[dict]] = {0: [], 1: []}
    for event in events[:-1]:
        by_index[event["index"]].append(event)
    (refused,) = by_index[0]  # one event: the abort
    assert_refused(refused)
    assert len(by_index[1]) > 1
    assert_follows(by_index[1][-1]["text"], CITY)


def test_a_batch_whose_every_grammar_is_refused_is_still_answered_item_by_item(client):
    # a list of one prompt (n = 2) is a batch too, as in the engine's list API
    r = client.post(
        "/generate",
        json={"text": [PROMPT], "sampling_params": {**constrained(REFUSED), "n": 2}},
    )
    assert r.status_code == 200, r.text
    assert len(r.json()) == 2
    for item in r.json():
        assert_refused(item)


@pytest.mark.parametrize("n", [1, 2])
def test_a_single_request_with_a_refused_grammar_is_a_400(client, n):
    r = client.post(
        "/generate", json={"text": PROMPT, "sampling_params": {**constrained(REFUSED), "n": n}}
    )
    assert r.status_code == 400, r.text
    assert "not" in r.json()["error"]["message"]


def test_other_bad_input_in_a_batch_still_fails_the_batch(client):
    r = client.post(
        "/generate",
        json={
            "text": [PROMPT, PROMPT],
            "sampling_params": [constrained(CITY), {**GREEDY, "temperature": -1}],
        },
    )
    assert r.status_code == 400
    assert "temperature" in r.json()["error"]["message"]


# ---- OpenAI completions --------------------------------------------------------------------


def test_openai_completions_batch_shares_one_grammar_so_a_refusal_is_a_400(client):
    body = {"prompt": [PROMPT, PROMPT], "json_schema": REFUSED, "max_tokens": 8, "temperature": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert "not" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={**body, "json_schema": CITY, "max_tokens": 48})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert_follows(choice["text"], CITY)


# ---- the engine process's channel ----------------------------------------------------------


def test_a_refused_grammar_crosses_the_process_boundary_as_its_own_kind():
    crossed = exception_for(error_kind(GrammarRefused("cannot enforce `not`")), "why", Exception)
    assert type(crossed) is GrammarRefused and str(crossed) == "why"
    assert isinstance(crossed, ValueError)  # elsewhere still the bad input it is
    assert error_kind(GrammarRefused("x")) == GRAMMAR and is_callers_fault(GRAMMAR)
    assert error_kind(ValueError("x")) != GRAMMAR


def test_the_in_process_backend_reports_the_engines_grammar_error_as_a_refusal(engine):
    import asyncio

    backend = LocalEngineBackend(engine)
    ids = backend.tokenize(PROMPT)

    async def open_refused() -> None:
        await backend.stream(ids, constrained(REFUSED))

    with pytest.raises(GrammarRefused, match="not"):
        asyncio.run(open_refused())


# ---- the DSL's run_batch -------------------------------------------------------------------


@sgl.function
def answer_as_json(s, question, schema):
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=48, json_schema=schema))


BATCH = [
    {"question": "What is the capital of France?", "schema": CITY},
    {"question": "What is the capital of France?", "schema": REFUSED},
    {"question": "Pick a number.", "schema": NUMBER},
]


def check_batch(states, error_type: type[BaseException]) -> None:
    ok, refused, number = states
    assert isinstance(refused.error(), error_type) and "not" in str(refused.error())
    with pytest.raises(ProgramError, match="not"):
        refused["answer"]
    assert ok.error() is None and number.error() is None
    assert_follows(ok["answer"], CITY)
    assert_follows(number["answer"], NUMBER)


def test_run_batch_keeps_a_refused_schema_on_its_own_program(engine):
    states = answer_as_json.run_batch(BATCH, backend=EngineBackend(engine), temperature=0)
    check_batch(states, ValueError)


def test_run_batch_over_the_runtime_endpoint_keeps_a_refused_schema_on_its_own_program(engine):
    with serve_in_thread(engine) as url:
        endpoint = sgl.RuntimeEndpoint(url)
        states = answer_as_json.run_batch(BATCH, backend=endpoint, temperature=0)
    check_batch(states, BackendError)
