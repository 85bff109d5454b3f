"""The server's stream plumbing without a model: merging several streams, and opening them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from radixlm.errors import EngineShutDown
from radixlm.server.app import create_app
from radixlm.server.errors import APIError, internal_error, unavailable
from radixlm.server.generation import merge, open_streams
from tests.live_server import sse_payloads
from tests.test_server import parse_prometheus
from tests.test_server_tools import ScriptedBackend


class Counted:
    """A stream of `steps` cumulative snapshots, made only as they are read; `made` counts them."""

    def __init__(self, steps: int) -> None:
        self.steps, self.made, self.closed = steps, 0, False

    def __aiter__(self) -> Counted:
        return self

    async def __anext__(self) -> dict[str, Any]:
        await asyncio.sleep(0)
        if self.made == self.steps:
            raise StopAsyncIteration
        self.made += 1
        done = self.made == self.steps
        return {"text": "x" * self.made, "meta_info": {"finish_reason": "end" if done else None}}

    async def aclose(self) -> None:
        self.closed = True


def test_merge_reads_a_stream_only_as_its_snapshots_are_taken():
    """Snapshots are cumulative: a reader that stalls must not have every step of every stream
    queued for it (that held O(steps^2) of text), only the newest."""

    async def run() -> None:
        streams = [Counted(500), Counted(500)]
        merged = merge(streams)
        await merged.__anext__()
        for _ in range(2000):  # the reader stalls while the streams could go on
            await asyncio.sleep(0)
        assert max(s.made for s in streams) <= 2
        seen = {0: 0, 1: 0}
        async for index, snapshot in merged:
            seen[index] = len(snapshot["text"])
        assert seen == {0: 500, 1: 500}  # every stream to its end

    asyncio.run(run())


def test_open_streams_closes_what_it_opened_whatever_refuses_a_later_one():
    async def run(error: Exception) -> list[Counted]:
        opened: list[Counted] = []

        async def stream(*args: Any, **kwargs: Any) -> Counted:
            if opened:
                raise error
            opened.append(Counted(3))
            return opened[-1]

        state = SimpleNamespace(backend=SimpleNamespace(stream=stream))
        items = [SimpleNamespace(input_ids=[1], params={}, return_logprob=False,
                                 logprob_start_len=None, top_logprobs_num=0, priority=None)] * 2  # fmt: skip
        with pytest.raises(APIError):
            await open_streams(state, items)
        return opened

    for error in (ValueError("bad second item"), internal_error("the engine failed")):
        (first,) = asyncio.run(run(error))
        assert first.closed, error


# ---- through the app, over a scripted backend ------------------------------------------------


class _Profiled(ScriptedBackend):
    def __init__(self, script: str, fail_after: int | None = None, error=None) -> None:
        super().__init__(script)
        self.fail_after = fail_after  # snapshots before the stream fails as a lost engine's does
        self.error = error or unavailable("the engine process exited")
        self.profiling: list[str] = []

    async def start_profile(self, output_dir: str) -> None:
        self.profiling.append(output_dir)

    async def stop_profile(self) -> str:
        return "trace.json"

    async def _run(self, prompt_tokens: int) -> AsyncIterator[dict[str, Any]]:
        k = 0
        async for snapshot in super()._run(prompt_tokens):
            if k == self.fail_after:
                raise self.error
            k += 1
            yield snapshot


def test_profile_routes_take_the_get_sglangs_client_sends():
    backend = _Profiled("hi")
    with TestClient(create_app(backend)) as c:
        assert c.get("/start_profile").status_code == 200
        assert c.get("/stop_profile").json()["trace_file"] == "trace.json"
        assert c.post("/start_profile", json={"output_dir": "/tmp/x"}).status_code == 200
    assert backend.profiling[-1] == "/tmp/x"


_LABELS = {"errors_total": "kind", "requests_total": "finish_reason"}


def metric(c: TestClient, name: str, label: str) -> float:
    samples = parse_prometheus(c.get("/metrics").text)
    return samples.get(f'radixlm_{name}{{{_LABELS[name]}="{label}"}}', 0.0)


@pytest.mark.parametrize("stream", [True, False])
def test_a_generation_the_engine_fails_is_counted_as_an_error_not_a_disconnect(stream):
    with TestClient(create_app(_Profiled("some longer text", fail_after=1))) as c:
        r = c.post("/generate", json={"text": "hi", "stream": stream})
        assert r.status_code == (200 if stream else 503)
        if stream:
            assert "the engine process exited" in r.text
        assert metric(c, "errors_total", "service_unavailable") == 1
        assert metric(c, "errors_total", "client_disconnected") == 0
        assert metric(c, "requests_total", "error") == 1


def test_a_client_gone_while_sending_its_body_is_a_499_not_an_internal_error():
    app = create_app(_Profiled("hi"))
    messages = [
        {"type": "http.request", "body": b'{"text": "h', "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else await asyncio.sleep(3600)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "path": "/generate", "raw_path": b"/generate", "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 5),
        "server": ("test", 80), "scheme": "http", "state": {},
    }  # fmt: skip
    asyncio.run(app(scope, receive, send))
    assert [m.get("status") for m in sent if m["type"] == "http.response.start"] == [499]
    assert app.state.server.metrics.error_count("internal_error") == 0


@pytest.mark.parametrize("route", ["/generate", "/v1/chat/completions"])
def test_an_engine_shut_down_before_the_first_snapshot_is_a_503_in_band(route):
    body = {"text": "hi", "stream": True}
    if route != "/generate":
        body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    backend = _Profiled("hi", fail_after=0, error=EngineShutDown("the engine is shut down"))
    with TestClient(create_app(backend)) as c:
        with c.stream("POST", route, json=body) as r:
            events = [x for x in sse_payloads(r.iter_lines()) if x != "[DONE]"]
        assert events[-1]["error"]["code"] == 503, events
        assert metric(c, "errors_total", "service_unavailable") == 1
        assert metric(c, "errors_total", "internal_error") == 0


@pytest.mark.parametrize("how", ["raised", "failed by the engine, streamed"])
def test_a_batch_item_dropped_because_another_failed_is_no_client_disconnect(how):
    class FirstFails(_Profiled):
        def __init__(self) -> None:
            super().__init__("a long enough script for several snapshots")
            self.opened = 0

        async def stream(self, input_ids, sampling_params, **options):
            self.opened += 1
            fails, inner = self.opened == 1, ScriptedBackend._run(self, len(input_ids))

            async def run():
                async for k, snapshot in _enumerate(inner):
                    if fails and k == 1 and how == "raised":
                        raise unavailable("the engine process exited")
                    if fails and k == 1:  # the engine's own failure: a final snapshot
                        meta = snapshot["meta_info"]
                        meta["finish_reason"] = {"type": "abort", "message": "boom"}
                        meta["error"] = "boom"
                        yield snapshot
                        return
                    if not fails:
                        await asyncio.sleep(0.05)  # still going when the first fails
                    yield snapshot

            return run()

    with TestClient(create_app(FirstFails())) as c:
        if how == "raised":
            assert c.post("/generate", json={"text": ["a", "b"]}).status_code == 503
            assert metric(c, "errors_total", "service_unavailable") == 1
            assert metric(c, "requests_total", "error") == 1
            assert metric(c, "requests_total", "abort") == 1
        else:
            r = c.post("/generate", json={"text": ["a", "b"], "stream": True})
            assert "generation failed: boom" in r.text
            assert metric(c, "errors_total", "internal_error") == 1
            assert metric(c, "requests_total", "abort") == 2  # the failed one, and its sibling
        assert metric(c, "errors_total", "client_disconnected") == 0


async def _enumerate(stream):
    k = 0
    async for item in stream:
        yield k, item
        k += 1
