"""`radixlm serve` with the engine in a process of its own (the default): the real server on a free
port, driven over HTTP, checked against the in-process engine; disconnects abort and free KV; a
killed engine process gives 503s and an unhealthy /health, never a hang; SIGTERM stops both."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from radixlm.errors import EngineShutDown
from radixlm.server.backend import ENGINE_STATS_TIMEOUT_S
from radixlm.server.engine_process import _EngineServer
from radixlm.server.errors import APIError, internal_error
from radixlm.server.ipc import (
    REQUEST_INVALID,
    Codec,
    DeltaEncoder,
    SnapshotBuilder,
    ToEngine,
    ToServer,
    error_kind,
    exception_for,
)
from tests.live_server import free_port, sse_payloads, wait_idle
from tests.test_server import parse_prometheus

GREEDY = {"temperature": 0.0}
LONG = {"max_new_tokens": 2000, "ignore_eos": True, "temperature": 0}


class Server:
    def __init__(self, model_folder: str, log: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        command = [
            sys.executable, "-m", "radixlm.cli", "serve", "--model-path", model_folder,
            "--port", str(self.port), "--max-total-tokens", "4096", "--graceful-timeout", "10",
            *extra,
        ]  # fmt: skip
        self._log_file = open(log, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            command,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "RADIXLM_API_KEY": ""},
        )
        deadline = time.monotonic() + 180
        # one client for the polls: each httpx.get builds an SSL context (tens of milliseconds of
        # CPU taken from the starting server, five times a second)
        with httpx.Client(timeout=1) as client:
            while True:
                try:
                    if client.get(self.url + "/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise AssertionError("the server did not start:\n" + log.read_text())
                time.sleep(0.2)
            self.engine_pid = client.get(self.url + "/server_info", timeout=5).json()["engine_pid"]

    def stats(self) -> dict:
        return httpx.get(self.url + "/server_info", timeout=10).json()["internal_states"][0]

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._log_file.close()


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) counts as gone
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "\nState:\tZ" in status.read_text())


@pytest.fixture(scope="module")
def server(default_model_folder, tmp_path_factory):
    srv = Server(default_model_folder, tmp_path_factory.mktemp("serve") / "server.log")
    yield srv
    code = srv.stop()
    log = srv.log.read_text()
    assert code in (0, -signal.SIGTERM), log
    assert "shutting down the engine" in log
    deadline = time.monotonic() + 10
    while pid_exists(srv.engine_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_exists(srv.engine_pid), "the engine process outlived the server"


# ---- the wire format, without a model ------------------------------------------------------


def test_deltas_rebuild_every_snapshot():
    snapshots = [
        {"text": "", "output_ids": [], "meta_info": {"finish_reason": None}},
        {"text": "Hel", "output_ids": [1], "meta_info": {"output_token_logprobs": [(-0.1, 1)]}},
        {"text": "Hello", "output_ids": [1, 2], "meta_info": {"output_token_logprobs": [(-0.1, 1), (-0.2, 2)]}},
        # text that is not an extension of the last (a held-back stop string trimmed at the end)
        {"text": "Help", "output_ids": [1, 2, 3], "meta_info": {"output_token_logprobs": [(-0.1, 1), (-0.2, 2), (-0.3, 3)]}},
    ]  # fmt: skip
    encoder, builder, codec = DeltaEncoder(7), SnapshotBuilder(), Codec(ToServer)
    kept = []
    for i, snap in enumerate(snapshots):
        update = encoder.update(snap, finished=i == len(snapshots) - 1)
        assert len(update.new_ids) <= 1  # only what is new crosses
        (update,) = codec.decode(codec.frame([codec.encode(update)])[4:])  # through msgpack
        assert update.rid == 7
        rebuilt = builder.apply(update)
        kept.append(rebuilt)
        assert rebuilt["text"] == snap["text"]
        assert rebuilt["output_ids"] == snap["output_ids"]
        lps = snap["meta_info"].get("output_token_logprobs")
        if lps is not None:
            assert rebuilt["meta_info"]["output_token_logprobs"] == [list(x) for x in lps]
    assert kept[1]["output_ids"] == [1]  # an earlier snapshot is not changed by later ones
    assert len(kept[2]["meta_info"]["output_token_logprobs"]) == 2


def test_engine_failures_cross_as_the_exceptions_the_in_process_engine_raises():
    def failed(message: str) -> Exception:
        return internal_error(f"the engine failed: {message}")

    for exc, invalid, raised in (
        (ValueError("bad"), (ValueError,), ValueError),
        (TypeError("sampling params must be a dict"), REQUEST_INVALID, ValueError),  # bad input
        (TypeError("a bug at start-up"), (ValueError,), APIError),  # elsewhere a TypeError is not
        (KeyError("x"), REQUEST_INVALID, APIError),
        (RuntimeError("boom"), REQUEST_INVALID, APIError),  # a crash, not a shut-down engine
    ):
        error = exception_for(error_kind(exc, invalid), str(exc), failed)
        assert type(error) is raised, exc
        assert str(exc) in str(error)
    assert type(exception_for("unavailable", "shut down", failed)) is EngineShutDown
    error = exception_for("error", "KeyError: 'x'", failed)
    assert isinstance(error, APIError) and error.status == 500


# ---- requests ------------------------------------------------------------------------------


def test_generate_and_its_stream_match_the_in_process_engine(server, engine):
    prompt = "The capital of France is"
    params = {"max_new_tokens": 8, **GREEDY}
    expected = engine.generate(prompt, params)
    out = httpx.post(
        server.url + "/generate", json={"text": prompt, "sampling_params": params}, timeout=60
    ).json()
    assert out["text"] == expected["text"]
    assert out["output_ids"] == expected["output_ids"]
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 8}

    with httpx.stream(
        "POST",
        server.url + "/generate",
        json={"text": prompt, "sampling_params": params, "stream": True},
        timeout=60,
    ) as r:
        assert r.status_code == 200
        events = sse_payloads(r.iter_lines())
    assert events[-1] == "[DONE]"
    snapshots = events[:-1]
    assert len(snapshots) > 1
    texts = [s["text"] for s in snapshots]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative
    assert snapshots[-1]["text"] == expected["text"]
    assert snapshots[-1]["output_ids"] == expected["output_ids"]


def test_logprobs_batches_and_n_cross_the_process_boundary(server, engine):
    prompt = "Paris is the capital of"
    body = {
        "text": prompt,
        "sampling_params": {"max_new_tokens": 4, **GREEDY},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 2,
    }
    expected = engine.generate(
        prompt, body["sampling_params"], return_logprob=True, logprob_start_len=0,
        top_logprobs_num=2,
    )  # fmt: skip
    with httpx.stream("POST", server.url + "/generate", json={**body, "stream": True}) as r:
        chunks = sse_payloads(r.iter_lines())[:-1]
    # each chunk carries the entries new since the one before: together, the whole lists
    joined = {
        key: [e for c in chunks for e in c["meta_info"][key]]
        for key in ("input_token_logprobs", "output_token_logprobs", "output_top_logprobs")
    }
    for key, got in joined.items():
        want = expected["meta_info"][key]
        assert len(got) == len(want), key
        flat = [e for e in got if e is not None]
        assert all(isinstance(e, list) for e in flat)
    assert chunks[-1]["meta_info"]["output_token_logprobs_length"] == 4
    got_lp = [e[0] for e in joined["output_token_logprobs"]]
    want_lp = [e[0] for e in expected["meta_info"]["output_token_logprobs"]]
    assert got_lp == pytest.approx(want_lp, abs=1e-4)

    batch = httpx.post(
        server.url + "/generate",
        json={
            "text": ["One, two,", "A, B,"],
            "sampling_params": {"max_new_tokens": 3, "n": 2, "temperature": 0.8, "seed": 5},
        },
        timeout=60,
    ).json()
    assert len(batch) == 4
    assert all(item["meta_info"]["completion_tokens"] == 3 for item in batch)


@pytest.mark.parametrize(
    "sampling_params, needle",
    [
        ({"temperature": -1}, "temperature"),
        ({"regex": "(("}, "regex"),
        ({"json_schema": "{not json"}, "json"),
        ({"no_such_key": 1}, "no_such_key"),
        ({"max_new_tokens": 100_000}, "max_new_tokens"),
    ],
)
def test_bad_input_is_a_400_from_the_engine_process(server, sampling_params, needle):
    r = httpx.post(
        server.url + "/generate",
        json={"text": "Hi", "sampling_params": sampling_params},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"].lower()
    assert httpx.get(server.url + "/health_generate", timeout=30).status_code == 200


def test_a_refused_grammar_in_a_batch_aborts_only_its_item_across_the_process(server):
    refused = json.dumps({"type": "object", "properties": {"a": {"not": {"type": "string"}}}})
    body = {
        "text": ["Hi", "Hi"],
        "sampling_params": [
            {"max_new_tokens": 4, **GREEDY},
            {"max_new_tokens": 4, "json_schema": refused},
        ],
    }
    r = httpx.post(server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    ran, aborted = r.json()
    assert ran["meta_info"]["completion_tokens"] == 4
    reason = aborted["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "not" in reason["message"], reason
    single = {"text": "Hi", "sampling_params": body["sampling_params"][1]}
    r = httpx.post(server.url + "/generate", json=single, timeout=60)
    assert r.status_code == 400 and "not" in r.json()["error"]["message"], r.text


def test_a_closed_stream_aborts_and_frees_its_kv(server):
    wait_idle(server.stats, 15.0)
    body = {"text": "Count to a million:", "sampling_params": LONG, "stream": True}
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", server.url + "/generate", json=body) as r,
    ):
        lines = r.iter_lines()  # kept referenced: a dropped iterator closes the connection
        for line in lines:
            if line.startswith("data: "):
                break
        running = server.stats()
        assert running["num_running_reqs"] == 1
        assert (
            running["kv_pool_free_tokens"] + running["radix_cache_tokens"]
            < (running["kv_pool_capacity_tokens"])
        )  # the request holds slots of its own
        lines.close()
    stats = wait_idle(server.stats, 15.0)
    # every slot is free or held by the prefix cache: nothing is left to the aborted request
    assert (
        stats["kv_pool_free_tokens"] + stats["radix_cache_tokens"]
        == (stats["kv_pool_capacity_tokens"])
    )
    assert stats["generated_tokens"] < 2000 + running["generated_tokens"]


def test_a_client_that_gives_up_waiting_aborts_its_generation(server):
    before = wait_idle(server.stats, 15.0)["generated_tokens"]
    body = {"text": "Count to a million:", "sampling_params": LONG}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/generate", json=body, timeout=1.0)
    stats = wait_idle(server.stats, 15.0)
    assert 0 < stats["generated_tokens"] - before < 2000


def test_a_deadline_and_abort_request_reach_the_engine_process(server):
    """Through the channel too: a generation past its deadline, or aborted by its id, ends with
    finish_reason abort and leaves no KV slot locked in the engine process."""
    body = {"text": "Count:", "sampling_params": LONG, "request_timeout": 0.5}
    r = httpx.post(server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200
    meta = r.json()["meta_info"]
    assert meta["finish_reason"] == {
        "type": "abort",
        "message": "the request timed out after 0.5 s",
    }
    assert meta["completion_tokens"] < LONG["max_new_tokens"]
    assert wait_idle(server.stats, 5.0)["radix_cache_protected_tokens"] == 0

    async def abort_by_id() -> dict:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            body = {"text": "Count:", "sampling_params": LONG, "rid": "process-abort"}
            pending = asyncio.ensure_future(c.post("/generate", json=body))
            while True:  # until the request runs
                r = await c.post("/abort_request", json={"rid": "process-abort"})
                if r.status_code == 200:
                    break
                assert r.status_code == 404
                await asyncio.sleep(0.05)
            return (await pending).json()

    out = asyncio.run(abort_by_id())
    assert out["meta_info"]["id"] == "process-abort"
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert wait_idle(server.stats, 5.0)["radix_cache_protected_tokens"] == 0


def test_metrics_cache_flush_and_grammar_compile_time(server):
    r = httpx.post(
        server.url + "/generate",
        json={"text": "Digits:", "sampling_params": {"max_new_tokens": 3, "regex": "[0-9]+"}},
        timeout=60,
    )
    assert r.status_code == 200
    assert r.json()["text"].isdigit()
    metrics = parse_prometheus(httpx.get(server.url + "/metrics").text)
    for name in (
        "sglang:num_running_reqs",
        "radixlm_kv_cache_usage_ratio",
        "sglang:cache_hit_rate",
        'sglang:time_to_first_token_seconds_count{is_streaming="false"}',
    ):
        assert name in metrics
    assert metrics["radixlm_grammar_compile_seconds_count"] >= 1
    wait_idle(server.stats, 15.0)
    assert httpx.post(server.url + "/flush_cache").status_code == 200
    assert httpx.post(server.url + "/freeze_gc").status_code == 200  # (in the engine's process)
    assert server.stats()["radix_cache_tokens"] == 0


def test_a_stopped_engine_process_leaves_metrics_answering(server):
    """An engine process that does not answer (stopped; /health still 200) costs /metrics and
    /server_info no more than the bound: the server's own metrics with engine_responsive 0, and
    a 503. Once it runs again, so do its stats."""
    os.kill(server.engine_pid, signal.SIGSTOP)
    try:
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        started = time.monotonic()
        r = httpx.get(server.url + "/metrics", timeout=30)
        assert time.monotonic() - started < ENGINE_STATS_TIMEOUT_S + 5
        assert r.status_code == 200
        metrics = parse_prometheus(r.text)
        assert metrics["radixlm_engine_responsive"] == 0
        assert metrics['sglang:time_to_first_token_seconds_count{is_streaming="false"}'] >= 1
        assert "sglang:num_running_reqs" not in metrics
        started = time.monotonic()
        r = httpx.get(server.url + "/get_server_info", timeout=30)
        assert time.monotonic() - started < ENGINE_STATS_TIMEOUT_S + 5
        assert r.status_code == 503 and "did not answer" in r.json()["error"]["message"]
    finally:
        os.kill(server.engine_pid, signal.SIGCONT)
    r = httpx.get(server.url + "/metrics", timeout=30)
    assert parse_prometheus(r.text)["radixlm_engine_responsive"] == 1
    assert "num_running_reqs" in server.stats()


def test_profiler_writes_a_trace(server, tmp_path):
    (tmp_path / "a_file").write_text("")
    r = httpx.post(server.url + "/start_profile", json={"output_dir": str(tmp_path / "a_file/x")})
    assert r.status_code == 400 and "cannot be used" in r.text, r.text  # the caller's folder
    r = httpx.post(server.url + "/start_profile", json={"output_dir": str(tmp_path)})
    assert r.status_code == 200, r.text
    assert httpx.post(server.url + "/start_profile").status_code == 400  # already running
    httpx.post(
        server.url + "/generate",
        json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}},
        timeout=60,
    )
    r = httpx.post(server.url + "/stop_profile", timeout=120)
    assert r.status_code == 200, r.text
    trace = Path(r.json()["trace_file"])
    assert trace.parent == tmp_path and trace.stat().st_size > 0
    assert httpx.post(server.url + "/stop_profile").status_code == 400  # not running


def test_openai_chat_with_a_named_tool_streams_its_call(server):
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [weather],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 40,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        chunks = [c for c in sse_payloads(r.iter_lines()) if c != "[DONE]"]
    deltas = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    arguments = json.loads("".join(d["function"]["arguments"] for d in deltas))
    assert set(arguments) == {"city"} and len(arguments["city"]) <= 12
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


# ---- the engine process dies ---------------------------------------------------------------


def test_a_killed_engine_process_fails_requests_cleanly(default_model_folder, tmp_path):
    server = Server(default_model_folder, tmp_path / "server.log")
    try:
        body = {"text": "Count to a million:", "sampling_params": LONG, "stream": True}
        with (
            httpx.Client(timeout=30) as client,
            client.stream("POST", server.url + "/generate", json=body) as r,
        ):
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    break
            os.kill(server.engine_pid, signal.SIGKILL)
            started = time.monotonic()
            rest = sse_payloads(lines)  # the stream ends promptly, the failure in-band
        assert time.monotonic() - started < 10
        assert rest[-1] == "[DONE]"
        error = rest[-2]["error"]
        assert error["code"] == 503 and "engine process exited" in error["message"]

        r = httpx.post(server.url + "/generate", json={"text": "Hi"}, timeout=10)
        assert r.status_code == 503
        assert "engine" in r.json()["error"]["message"]
        r = httpx.post(
            server.url + "/v1/completions",
            json={"model": "SmolLM2-135M-Instruct", "prompt": "Hi", "max_tokens": 2},
            timeout=10,
        )
        assert r.status_code == 503
        assert httpx.get(server.url + "/health", timeout=10).status_code == 503
        assert httpx.get(server.url + "/health_generate", timeout=10).status_code == 503
        assert httpx.get(server.url + "/metrics", timeout=10).status_code == 200
    finally:
        code = server.stop(timeout=30)
    assert code in (0, -signal.SIGTERM), server.log.read_text()


def test_bad_engine_options_fail_before_serving(default_model_folder, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "radixlm.cli", "serve", "--model-path", str(tmp_path / "nothing")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "radixlm serve: error:" in proc.stderr


def test_the_engine_process_closes_its_channel_once_its_engine_stopped():
    """An engine stopped by an internal error refuses every request: its process then closes the
    channel, so the server answers 503 and /health turns unhealthy (as for a dead process)."""

    class Backend:
        checks = 0

        def is_alive(self) -> bool:
            self.checks += 1
            return self.checks < 3

    ours, theirs = socket.socketpair()
    backend = Backend()
    asyncio.run(asyncio.wait_for(_EngineServer(backend, Codec(ToEngine)).serve(ours, 0.01), 10))
    assert backend.checks == 3
    theirs.settimeout(5)
    assert theirs.recv(16) == b""  # closed, not merely quiet
    theirs.close()
