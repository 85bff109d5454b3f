"""The server on a real socket (uvicorn on 127.0.0.1, a free port): the official `openai` client,
client disconnects aborting their generations, and `radixlm serve` stopping cleanly on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.live_server import free_port, serve_in_thread, wait_idle

API_KEY = "test-key"


@pytest.fixture(scope="module")
def base_url(engine):
    with serve_in_thread(engine, API_KEY) as url:
        yield url


# ---- the official openai client ------------------------------------------------------------


@pytest.fixture(scope="module")
def openai_client(base_url):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=base_url + "/v1", api_key=API_KEY, max_retries=0)


def test_openai_client_chat_stream_and_completions(openai_client):
    (model,) = [m.id for m in openai_client.models.list()]
    messages = [{"role": "user", "content": "Name a color."}]
    chat = openai_client.chat.completions.create(
        model=model, messages=messages, max_tokens=5, temperature=0, seed=1
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content
    assert chat.usage.completion_tokens <= 5
    assert chat.usage.prompt_tokens_details.cached_tokens >= 0

    stream = openai_client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens

    completion = openai_client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=3, temperature=0
    )
    assert completion.choices[0].text == " Paris.\n"
    assert completion.usage.completion_tokens == 3


def test_openai_client_structured_output_and_tools_are_accepted(openai_client):
    schema = {
        "type": "object",
        "properties": {"color": {"type": "string"}},
        "required": ["color"],
    }
    out = openai_client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Give a color as JSON."}],
        max_tokens=8,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "color", "schema": schema, "strict": True},
        },
    )
    assert out.choices[0].finish_reason in ("stop", "length")
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    out = openai_client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Weather in Rome?"}],
        tools=[tool],
        tool_choice="required",
        max_tokens=8,
        temperature=0,
    )
    assert out.choices[0].finish_reason in ("tool_calls", "length", "stop")


def test_openai_client_errors(openai_client):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=-1,
        )
    assert "max_tokens" in str(info.value)
    with pytest.raises(openai.NotFoundError):
        openai_client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "x"}]
        )
    bad_key = openai.OpenAI(base_url=openai_client.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()


# ---- disconnects ---------------------------------------------------------------------------

LONG = {"max_new_tokens": 2000, "ignore_eos": True, "temperature": 0}
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_a_closed_stream_aborts_its_generation(base_url, engine):
    wait_idle(engine.get_stats, 10.0)
    body = {"text": "Count to a million:", "sampling_params": LONG, "stream": True}
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", base_url + "/generate", json=body, headers=AUTH) as r,
    ):
        assert r.status_code == 200
        # keep the line iterator referenced: a dropped one is closed at once, and httpx then
        # closes the connection, which would abort the request before the check below
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                assert json.loads(line[6:])["meta_info"]["completion_tokens"] >= 1
                break
        assert engine.get_stats()["num_running_reqs"] == 1
        lines.close()
    stats = wait_idle(engine.get_stats, 10.0)  # aborted long before its 2000 tokens
    assert stats["generated_tokens"] > 0
    metrics = httpx.get(base_url + "/metrics", headers=AUTH).text
    assert 'radixlm_errors_total{kind="client_disconnected"}' in metrics


def test_a_client_that_gives_up_waiting_aborts_its_generation(base_url, engine):
    wait_idle(engine.get_stats, 10.0)
    before = engine.get_stats()["generated_tokens"]
    body = {"text": "Count to a million:", "sampling_params": LONG}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base_url + "/generate", json=body, headers=AUTH, timeout=1.0)
    stats = wait_idle(engine.get_stats, 10.0)
    assert 0 < stats["generated_tokens"] - before < 2000


# ---- radixlm serve -------------------------------------------------------------------------


def test_serve_finishes_in_flight_requests_on_sigterm(default_model_folder):
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "radixlm.cli",
            "serve",
            "--model-path",
            default_model_folder,
            "--port",
            str(port),
            "--max-total-tokens",
            "4096",
            "--graceful-timeout",
            "20",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "RADIXLM_API_KEY": ""},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        with httpx.Client(timeout=1) as poller:  # (one SSL context for all the polls)
            while True:
                try:
                    if poller.get(url + "/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError("the server did not start:\n" + (proc.stdout.read() or ""))
                time.sleep(0.2)
        body = {"text": "Hello", "sampling_params": {"max_new_tokens": 12, "ignore_eos": True}}
        events = []
        with (
            httpx.Client(timeout=60) as client,
            client.stream("POST", url + "/generate", json={**body, "stream": True}) as r,
        ):
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 1:
                    proc.send_signal(signal.SIGTERM)  # mid-request
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["meta_info"]["completion_tokens"] == 12
        # uvicorn re-raises the signal it handled once it has shut down, so the exit status is
        # "terminated by SIGTERM", after a clean shutdown (which the log shows)
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
        log = proc.stdout.read()
        print(log)
        assert "shutting down the engine" in log
        assert " POST /generate 200 in=" in log and "out=12" in log  # the request log line
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
