"""The server under load, faults and hostile input: a bounded queue answered honestly (503 with
Retry-After), deadlines and /abort_request that free the KV at once, admin routes apart from the
user's key, an audit log that keeps no text unless asked, and /metrics under SGLang's names."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from radixlm.server.app import create_app
from radixlm.server.audit import AuditLog
from radixlm.server.state import ServerLimits
from tests.test_server_tools import ScriptedBackend

# as long as the tiny model's context (512) leaves: a generation of seconds on a CPU
LONG = {"max_new_tokens": 480, "ignore_eos": True, "temperature": 0.0}
USER, ADMIN = "user-key-1234", "admin-key-5678"


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_folder):
    """The tiny random model with no prefix cache: a finished or aborted request leaves every KV
    slot free, so the stats show at once whether one was kept."""
    import radixlm

    with radixlm.Engine(tiny_model_folder, disable_radix_cache=True, max_total_tokens=2048) as e:
        yield e


def run(coroutine):
    return asyncio.run(coroutine)


def client_of(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        await asyncio.sleep(0.01)


def engine_stats(app) -> dict:
    return app.state.server.backend._engine.get_stats()


async def wait_kv_free(app, timeout: float = 2.0) -> dict:
    """The engine's stats once every KV slot is free again (within `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine_stats(app)
        if stats["kv_pool_free_tokens"] == stats["kv_pool_capacity_tokens"]:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"KV slots still held: {stats}")
        await asyncio.sleep(0.01)


# ---- overload: a bounded queue ---------------------------------------------------------------


def test_past_max_queued_requests_a_503_with_retry_after_while_the_accepted_finish(tiny_engine):
    app = create_app(tiny_engine, owns_engine=False, limits=ServerLimits(max_queued_requests=2))
    inflight = app.state.server.inflight

    async def scenario() -> None:
        async with client_of(app) as c:
            body = {"text": "Once upon a time", "sampling_params": LONG}
            accepted = [asyncio.ensure_future(c.post("/generate", json=body)) for _ in range(2)]
            await wait_for(lambda: inflight.count == 2)
            for path, refused in (
                ("/generate", body),
                ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
            ):
                r = await c.post(path, json=refused)
                assert r.status_code == 503, (path, r.text)
                assert r.headers["retry-after"] == "1"
                error = r.json()["error"]
                assert error["type"] == "service_unavailable"
                assert "max-queued-requests" in error["message"]
            assert inflight.count == 2  # the refusals took no seat
            for response in await asyncio.gather(*accepted):
                assert response.status_code == 200
                meta = response.json()["meta_info"]
                assert meta["finish_reason"]["type"] == "length"
                assert meta["completion_tokens"] == LONG["max_new_tokens"]
            assert inflight.count == 0
            r = await c.post(
                "/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}}
            )
            assert r.status_code == 200
            # a request that could never fit is the client's to split, not a retry
            r = await c.post(
                "/generate",
                json={"text": ["a", "b", "c"], "sampling_params": {"max_new_tokens": 1}},
            )
            assert r.status_code == 400 and "split it" in r.json()["error"]["message"]
            metrics = parse(await c.get("/metrics"))
            assert sample(metrics, "radixlm_errors_total", kind="service_unavailable") == 3

    run(scenario())


def test_without_a_bound_requests_are_accepted_as_before():
    with TestClient(create_app(ScriptedBackend("hello world"))) as c:
        for _ in range(3):
            assert c.post("/generate", json={"text": "Hi"}).status_code == 200
        assert c.app.state.server.inflight.count == 0


# ---- deadlines and /abort_request ------------------------------------------------------------


@pytest.mark.parametrize("where", ["request", "server"])
def test_a_deadline_aborts_the_generation_and_frees_its_kv_at_once(tiny_engine, where):
    limits = ServerLimits(request_timeout=0.3 if where == "server" else None)
    app = create_app(tiny_engine, owns_engine=False, limits=limits)
    # a request may ask for less time than the server's bound, never more
    body = {"text": "Once upon a time", "sampling_params": LONG}
    body["request_timeout"] = 0.3 if where == "request" else 100

    async def scenario() -> None:
        async with client_of(app) as c:
            started = time.monotonic()
            r = await c.post("/generate", json=body)
            took = time.monotonic() - started
            assert r.status_code == 200, r.text
            meta = r.json()["meta_info"]
            assert meta["finish_reason"] == {
                "type": "abort",
                "message": "the request timed out after 0.3 s",
            }
            assert meta["completion_tokens"] < LONG["max_new_tokens"]
            assert took < 0.3 + 1.5
            stats = await wait_kv_free(app)
            assert stats["num_running_reqs"] == stats["num_waiting_reqs"] == 0
            assert app.state.server.inflight.count == 0
            metrics = parse(await c.get("/metrics"))
            assert sample(metrics, "sglang:num_aborted_requests_total") == 1

    run(scenario())


def test_the_openai_routes_take_a_deadline_too(tiny_engine):
    app = create_app(tiny_engine, owns_engine=False)
    with TestClient(app) as c:
        r = c.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Tell a story"}],
                "max_tokens": 400,
                "ignore_eos": True,
                "request_timeout": 0.2,
            },
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "abort"
        for bad in (-1, 0, "soon", True):
            r = c.post("/v1/completions", json={"prompt": "Hi", "request_timeout": bad})
            assert r.status_code == 400, bad
            r = c.post("/generate", json={"text": "Hi", "request_timeout": bad})
            assert r.status_code == 400, bad
            assert "request_timeout" in r.json()["error"]["message"]


def test_abort_request_ends_a_request_by_the_id_its_client_sees(tiny_engine):
    app = create_app(tiny_engine, owns_engine=False)
    inflight = app.state.server.inflight

    async def scenario() -> None:
        async with client_of(app) as c:
            # a client's own rid, as SGLang's take it
            body = {"text": "Once upon a time", "sampling_params": LONG, "rid": "my-request"}
            pending = asyncio.ensure_future(c.post("/generate", json=body))
            await wait_for(lambda: inflight.count == 1)
            r = await c.post("/generate", json=body)  # the same id twice at once
            assert r.status_code == 400 and "already in use" in r.json()["error"]["message"]
            r = await c.post("/abort_request", json={"rid": "my-request"})
            assert r.status_code == 200 and r.json() == {"success": True, "aborted": 1}
            out = (await pending).json()
            assert out["meta_info"]["id"] == "my-request"
            assert out["meta_info"]["finish_reason"] == {
                "type": "abort",
                "message": "aborted by /abort_request",
            }
            await wait_kv_free(app)

            # the id the server made is the meta_info id the client reads
            body.pop("rid")
            pending = asyncio.ensure_future(c.post("/generate", json=body))
            await wait_for(lambda: inflight.count == 1)
            (rid,) = list(inflight._by_id)
            assert (await c.post("/abort_request", json={"rid": rid})).status_code == 200
            out = (await pending).json()
            assert out["meta_info"]["id"] == rid
            assert out["meta_info"]["finish_reason"]["type"] == "abort"

            # an OpenAI response by its id
            chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 400}
            pending = asyncio.ensure_future(
                c.post("/v1/chat/completions", json={**chat, "ignore_eos": True})
            )
            await wait_for(lambda: inflight.count == 1)
            (rid,) = list(inflight._by_id)
            assert (await c.post("/abort_request", json={"rid": rid})).status_code == 200
            out = (await pending).json()
            assert out["id"] == rid and out["choices"][0]["finish_reason"] == "abort"
            await wait_kv_free(app)

            # an OpenAI request with SGLang's rid: its n choices as rid_0, rid_1
            body = {**chat, "ignore_eos": True, "rid": "turn-1", "n": 2}
            pending = asyncio.ensure_future(c.post("/v1/chat/completions", json=body))
            await wait_for(lambda: inflight.count == 2)
            assert sorted(inflight._by_id) == ["turn-1_0", "turn-1_1"]
            for rid in ("turn-1_0", "turn-1_1"):
                assert (await c.post("/abort_request", json={"rid": rid})).status_code == 200
            out = (await pending).json()
            assert [c["finish_reason"] for c in out["choices"]] == ["abort", "abort"]
            await wait_kv_free(app)
            r = await c.post("/v1/completions", json={"prompt": "Hi", "rid": ["a", "a"]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "rid"

            r = await c.post("/abort_request", json={"rid": "no-such-request"})
            assert r.status_code == 404 and "no-such-request" in r.json()["error"]["message"]
            for bad in ({}, {"rid": 7}, {"rid": "x", "extra": 1}, {"abort_all": "yes"}):
                assert (await c.post("/abort_request", json=bad)).status_code == 400, bad
            r = await c.post("/abort_request", json={"abort_all": True})
            assert r.json() == {"success": True, "aborted": 0}

    run(scenario())


# ---- admin routes apart ----------------------------------------------------------------------


def _admin_calls(c: TestClient, headers: dict) -> dict[str, int]:
    return {
        "/flush_cache": c.post("/flush_cache", headers=headers).status_code,
        "/freeze_gc": c.post("/freeze_gc", headers=headers).status_code,
        "/abort_request": c.post(
            "/abort_request", json={"abort_all": True}, headers=headers
        ).status_code,
        "/start_profile": c.post("/start_profile", headers=headers).status_code,
        "/stop_profile": c.post("/stop_profile", headers=headers).status_code,
    }


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_admin_routes_take_the_admin_key_only():
    from tests.test_server_generation import _Profiled

    app = create_app(_Profiled("hi"), api_key=USER, admin_api_key=ADMIN)
    with TestClient(app) as c:
        for status in _admin_calls(c, {}).values():
            assert status == 401
        statuses = _admin_calls(c, bearer(USER))
        assert set(statuses.values()) == {403}, statuses
        r = c.post("/flush_cache", headers=bearer(USER))
        assert "admin" in r.json()["error"]["message"]
        assert set(_admin_calls(c, bearer("wrong")).values()) == {401}
        assert set(_admin_calls(c, bearer(ADMIN)).values()) == {200}
        # the user's routes take the user's key, and the admin key does not open them
        body = {"text": "Hi"}
        assert c.post("/generate", json=body, headers=bearer(USER)).status_code == 200
        assert c.post("/generate", json=body, headers=bearer(ADMIN)).status_code == 401
        assert c.post("/generate", json=body).status_code == 401
        assert c.get("/metrics").status_code == 200  # public, as before


def test_without_an_admin_key_the_admin_routes_keep_the_user_keys_guard():
    from tests.test_server_generation import _Profiled

    with TestClient(create_app(_Profiled("hi"), api_key=USER)) as c:
        assert set(_admin_calls(c, {}).values()) == {401}
        assert set(_admin_calls(c, bearer(USER)).values()) == {200}
    with TestClient(create_app(_Profiled("hi"))) as c:  # no key at all: open, as before
        assert set(_admin_calls(c, {}).values()) == {200}
    # only an admin key: the user's routes stay open, the admin routes take it
    with TestClient(create_app(_Profiled("hi"), admin_api_key=ADMIN)) as c:
        assert c.post("/generate", json={"text": "Hi"}).status_code == 200
        assert set(_admin_calls(c, {}).values()) == {401}
        assert set(_admin_calls(c, bearer(ADMIN)).values()) == {200}


def test_rate_limits_stay_per_key_with_an_admin_key():
    limits = ServerLimits(rate_limit_per_minute=60, rate_limit_burst=1)
    app = create_app(ScriptedBackend("hi"), api_key=USER, admin_api_key=ADMIN, limits=limits)
    with TestClient(app) as c:
        assert c.post("/generate", json={"text": "Hi"}, headers=bearer(USER)).status_code == 200
        r = c.post("/generate", json={"text": "Hi"}, headers=bearer(USER))
        assert r.status_code == 429 and "retry-after" in r.headers
        # the admin's bucket is its own
        assert c.post("/flush_cache", headers=bearer(ADMIN)).status_code == 200


# ---- the audit log ---------------------------------------------------------------------------


def _audit_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_audit_log_has_a_line_per_request_and_no_text(tmp_path):
    path = tmp_path / "audit.log"
    app = create_app(ScriptedBackend("SECRET OUTPUT"), api_key=USER, audit_log=str(path))
    with TestClient(app) as c:
        r = c.post(
            "/generate",
            json={"text": "SECRET PROMPT", "rid": "audited-1"},
            headers=bearer(USER),
        )
        assert r.status_code == 200
        assert c.post("/generate", json={"text": "Hi"}).status_code == 401
        c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=bearer(USER))
    text = path.read_text()
    assert "SECRET" not in text and USER not in text
    first, refused, completion = _audit_lines(path)
    assert first["endpoint"] == "/generate" and first["method"] == "POST"
    assert first["status"] == 200
    assert first["rids"] == ["audited-1"]
    want = hashlib.pbkdf2_hmac("sha256", USER.encode(), b"radixlm audit key id", 20_000)
    assert first["key_id"] == want.hex()[:12] and USER not in json.dumps(first)
    assert first["role"] == "user"
    assert first["prompt_tokens"] == len("SECRET PROMPT")
    assert first["completion_tokens"] == len("SECRET OUTPUT")
    assert first["cached_tokens"] == 0
    assert first["finish_reasons"] == ["stop"]
    assert first["latency_s"] > 0 and first["time"].endswith("Z")
    assert len(first["request_id"]) == 12 and "request" not in first and "outputs" not in first
    assert refused["status"] == 401 and refused["key_id"] is None and refused["rids"] == []
    assert completion["endpoint"] == "/v1/completions"
    assert completion["rids"][0].startswith("cmpl-")


def test_the_audit_log_keeps_texts_with_log_requests(tmp_path):
    path = tmp_path / "audit.log"
    app = create_app(ScriptedBackend("the output"), audit_log=str(path), log_requests=True)
    with TestClient(app) as c:
        assert c.post("/generate", json={"text": "the prompt"}).status_code == 200
    (line,) = _audit_lines(path)
    assert json.loads(line["request"]) == {"text": "the prompt"}
    assert line["outputs"] == ["the output"]
    assert line["key_id"] is None and line["role"] is None


def test_the_audit_log_rotates_by_size_and_writes_to_stdout(tmp_path, capsys):
    path = tmp_path / "audit.log"
    log = AuditLog(str(path), max_bytes=300, backups=2)
    for i in range(10):
        log.write({"request_id": f"r{i}", "status": 200})
    log.close()
    assert (tmp_path / "audit.log.1").exists() and (tmp_path / "audit.log.2").exists()
    assert not (tmp_path / "audit.log.3").exists()
    assert _audit_lines(path)[-1]["request_id"] == "r9"
    log = AuditLog("-")
    log.write({"request_id": "to-stdout"})
    log.close()
    assert json.loads(capsys.readouterr().out)["request_id"] == "to-stdout"
    with pytest.raises(ValueError, match="cannot open the audit log"):
        AuditLog(str(tmp_path / "no-such-folder" / "audit.log"))


# ---- metrics by the book ---------------------------------------------------------------------


def parse(response) -> dict:
    """The families of a /metrics answer, by name, read with prometheus_client's own parser."""
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {f.name: f for f in text_string_to_metric_families(response.text)}


def sample(families: dict, name: str, **labels: str) -> float:
    """The sum of the samples called `name` whose labels include `labels`."""
    found = [s for f in families.values() for s in f.samples if s.name == name]
    assert found, f"no sample {name}"
    return sum(s.value for s in found if all(s.labels.get(k) == v for k, v in labels.items()))


SGLANG_METRICS = {
    "sglang:num_running_reqs": "gauge",
    "sglang:num_queue_reqs": "gauge",
    "sglang:num_grammar_queue_reqs": "gauge",
    "sglang:token_usage": "gauge",
    "sglang:num_used_tokens": "gauge",
    "sglang:cache_hit_rate": "gauge",
    "sglang:kv_available_tokens": "gauge",
    "sglang:kv_evictable_tokens": "gauge",
    "sglang:kv_used_tokens": "gauge",
    "sglang:num_retracted_requests": "counter",
    "sglang:prompt_tokens": "counter",
    "sglang:generation_tokens": "counter",
    "sglang:cached_tokens": "counter",
    "sglang:num_requests": "counter",
    "sglang:num_aborted_requests": "counter",
    "sglang:time_to_first_token_seconds": "histogram",
    "sglang:inter_token_latency_seconds": "histogram",
    "sglang:request_time_per_output_token_seconds": "histogram",
    "sglang:e2e_request_latency_seconds": "histogram",
    "sglang:http_requests": "counter",
    "sglang:http_responses": "counter",
    "sglang:http_requests_active": "gauge",
}


def test_metrics_carry_sglangs_names_types_and_labels(tiny_engine):
    app = create_app(tiny_engine, owns_engine=False, served_model_name="tiny")
    with TestClient(app) as c:
        r = c.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 3}})
        assert r.status_code == 200
        prompt_tokens = r.json()["meta_info"]["prompt_tokens"]
        families = parse(c.get("/metrics"))
    for name, kind in SGLANG_METRICS.items():
        assert families[name].type == kind, name
    tokenizer = {"model_name": "tiny", "engine_type": "unified"}
    scheduler = {**tokenizer, "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
    assert families["sglang:num_running_reqs"].samples[0].labels == scheduler
    assert sample(families, "sglang:num_running_reqs") == 0
    assert 0 <= sample(families, "sglang:token_usage") <= 1
    assert sample(families, "sglang:prompt_tokens_total", **tokenizer) == prompt_tokens
    assert sample(families, "sglang:generation_tokens_total", is_streaming="false") == 3
    assert sample(families, "sglang:num_requests_total", is_streaming="false") == 1
    ttft = families["sglang:time_to_first_token_seconds"]
    bounds = [s.labels["le"] for s in ttft.samples if s.name.endswith("_bucket")]
    assert bounds[:3] == ["0.1", "0.2", "0.4"] and "+Inf" in bounds  # SGLang's buckets
    assert sample(families, "sglang:time_to_first_token_seconds_count", is_streaming="false") == 1
    assert sample(families, "sglang:inter_token_latency_seconds_count") == 2
    assert sample(families, "sglang:http_requests_total", endpoint="/generate") == 1
    responses = "sglang:http_responses_total"
    assert sample(families, responses, endpoint="/generate", status_code="200") == 1
    # ours, under radixlm_
    assert sample(families, "radixlm_requests_total", finish_reason="length") == 1
    assert sample(families, "radixlm_engine_responsive") == 1
    assert families["radixlm_engine_steps"].type == "counter"
    assert not any(name.endswith("_created") for name in families)


def test_two_apps_in_one_process_keep_their_own_counts():
    a, b = create_app(ScriptedBackend("aaaa")), create_app(ScriptedBackend("bbbb"))
    with TestClient(a) as ca, TestClient(b) as cb:
        for _ in range(3):
            assert ca.post("/generate", json={"text": "Hi"}).status_code == 200
        assert cb.get("/nowhere").status_code == 404  # an unknown path: no label of its own
        fa, fb = parse(ca.get("/metrics")), parse(cb.get("/metrics"))
    assert sample(fa, "sglang:num_requests_total") == 3
    assert sample(fb, "sglang:num_requests_total") == 0
    assert sample(fb, "sglang:http_responses_total", endpoint="other", status_code="404") == 1
    assert sample(fa, "sglang:http_responses_total", endpoint="other") == 0


# ---- priorities ------------------------------------------------------------------------------


class PriorityRecorder(ScriptedBackend):
    """Records the priority each generation reaches the engine with."""

    def __init__(self) -> None:
        super().__init__("hi")
        self.priorities: list = []

    async def stream(self, input_ids, sampling_params, **options):
        self.priorities.append(options.get("priority"))
        return await super().stream(input_ids, sampling_params)


@pytest.mark.parametrize(
    "path, body",
    [
        ("/generate", {"text": "Hello", "sampling_params": {"n": 2}}),
        ("/v1/completions", {"prompt": ["a", "b"]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]}),
    ],
)
def test_a_request_priority_reaches_the_engine_and_a_bad_one_is_a_400(path, body):
    backend = PriorityRecorder()
    with TestClient(create_app(backend)) as c:
        assert c.post(path, json={**body, "priority": 7}).status_code == 200
        assert backend.priorities and set(backend.priorities) == {7}
        assert c.post(path, json={**body, "priority": None}).status_code == 200
        assert backend.priorities[-1] is None
        for bad in ("high", 1.5, True):
            r = c.post(path, json={**body, "priority": bad})
            assert r.status_code == 400, (bad, r.text)
            assert "priority" in r.json()["error"]["message"]


# ---- a disconnect storm ----------------------------------------------------------------------


def test_a_disconnect_storm_frees_every_kv_slot_and_leaves_the_others_outputs_alone(tiny_engine):
    """40 streaming clients vanish at random points (some before their first event) while two
    greedy requests run: their generations are aborted (not run to their length), the two give
    what they give in a quiet run, and once the storm has passed every KV slot is free
    (benchmarks/overload.py runs the full-size storm)."""
    import random

    from tests.live_server import serve_in_thread, wait_idle

    greedy = {"max_new_tokens": 24, "ignore_eos": True, "temperature": 0.0}
    vanishing = {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0.0}
    controls = [{"text": "Once upon a time", "sampling_params": greedy},
                {"text": "The capital of France is", "sampling_params": greedy}]  # fmt: skip
    rng = random.Random(5)
    cuts = [rng.randint(0, 8) for _ in range(40)]

    async def control_outputs(url: str) -> list[list[int]]:
        async with httpx.AsyncClient(timeout=120) as c:
            replies = await asyncio.gather(*(c.post(url + "/generate", json=b) for b in controls))
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
        return [r.json()["output_ids"] for r in replies]

    async def vanish(url: str, k: int, events: int) -> None:
        body = {"text": f"Story number {k}:", "sampling_params": vanishing, "stream": True}
        async with (
            httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_keepalive_connections=0)) as c,
            c.stream("POST", url + "/generate", json=body) as r,
        ):
            assert r.status_code == 200
            read = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    read += 1
                    if read >= events:
                        break  # leaving the block drops the connection mid-stream

    async def storm(url: str) -> list[list[int]]:
        storm = [asyncio.ensure_future(vanish(url, k, n)) for k, n in enumerate(cuts)]
        outputs = await control_outputs(url)
        await asyncio.gather(*storm)
        return outputs

    with serve_in_thread(tiny_engine) as url:
        quiet = run(control_outputs(url))
        before = tiny_engine.get_stats()["generated_tokens"]
        loud = run(storm(url))
        stats = wait_idle(tiny_engine.get_stats, timeout=30)
    assert loud == quiet
    # run to their length, the vanished generations alone would have made 16,000 tokens
    assert stats["generated_tokens"] - before < 40 * 30
    assert stats["kv_pool_free_tokens"] == stats["kv_pool_capacity_tokens"], stats
