"""The HTTP server over the real default model, through FastAPI's TestClient (no network)."""

from __future__ import annotations

import asyncio
import copy
import math
import time

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from radixlm.protocol.histogram import Histogram
from radixlm.protocol.stats import EngineStats
from radixlm.server import backend as backend_module
from radixlm.server import native
from radixlm.server.app import create_app
from radixlm.server.backend import LocalEngineBackend
from radixlm.server.metrics import Metrics
from radixlm.server.state import ServerLimits
from tests.live_server import sse_payloads

PROMPT = "The capital of France is"
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine, owns_engine=False)) as c:
        yield c


# ---- native API ----------------------------------------------------------------------------


def test_generate_greedy_matches_the_engine(client, engine):
    expected = engine.generate(PROMPT, {"max_new_tokens": 6, **GREEDY})
    r = client.post(
        "/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 6, **GREEDY}}
    )
    assert r.status_code == 200
    out = r.json()
    assert out["text"] == expected["text"]
    assert out["output_ids"] == expected["output_ids"]
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == expected["meta_info"]["prompt_tokens"]
    assert meta["completion_tokens"] == 6
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["e2e_latency"] > 0
    assert meta["cached_tokens"] >= 0


def test_generate_input_ids_and_batch_with_n(client, engine):
    ids = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    single = client.post(
        "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 3, **GREEDY}}
    ).json()
    batch = client.post(
        "/generate",
        json={
            "text": [PROMPT, "One, two,"],
            "sampling_params": {"max_new_tokens": 3, "n": 2, **GREEDY},
        },
    )
    assert batch.status_code == 200
    outs = batch.json()
    assert isinstance(outs, list) and len(outs) == 4  # prompt-major, n per prompt
    assert outs[0]["output_ids"] == outs[1]["output_ids"] == single["output_ids"]
    assert outs[2]["output_ids"] == outs[3]["output_ids"]
    assert outs[2]["meta_info"]["prompt_tokens"] != outs[0]["meta_info"]["prompt_tokens"]


def test_generate_logprobs_with_token_texts(client, engine):
    r = client.post(
        "/generate",
        json={
            "text": PROMPT,
            "sampling_params": {"max_new_tokens": 2, **GREEDY},
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 2,
            "return_text_in_logprobs": True,
        },
    )
    assert r.status_code == 200
    meta = r.json()["meta_info"]
    prompt_ids = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    inputs = meta["input_token_logprobs"]
    assert [e[1] for e in inputs] == prompt_ids
    assert inputs[0][0] is None  # the first token has no context to be scored from
    assert all(e[0] < 0 for e in inputs[1:])
    assert [e[2] for e in inputs] == [engine.tokenizer.decode([t]) for t in prompt_ids]
    outputs = meta["output_token_logprobs"]
    assert [e[1] for e in outputs] == r.json()["output_ids"]
    for entry, top in zip(outputs, meta["output_top_logprobs"]):
        assert len(top) == 2
        assert top[0][1] == entry[1]  # greedy: the chosen token is the most likely
        assert math.isclose(top[0][0], entry[0], rel_tol=1e-5)
        assert isinstance(top[1][2], str)


def test_generate_stream_is_cumulative_and_ends_with_done(client):
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 5, **GREEDY}}
    whole = client.post("/generate", json=body).json()
    with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_payloads(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    # a chunk a step, but steps a slow reader missed come as one (the snapshots are cumulative)
    assert 1 <= len(chunks) <= 5
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    ids = [len(c["output_ids"]) for c in chunks]
    assert ids == sorted(set(ids))
    assert chunks[-1]["text"] == whole["text"]
    assert chunks[-1]["output_ids"] == whole["output_ids"]
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_generate_stream_of_a_batch_is_indexed(client):
    body = {"text": ["Hi", "Yes"], "sampling_params": {"max_new_tokens": 2}, "stream": True}
    with client.stream("POST", "/generate", json=body) as r:
        events = sse_payloads(r.iter_lines())
    assert events[-1] == "[DONE]"
    finals = [e for e in events[:-1] if e["meta_info"]["finish_reason"] is not None]
    assert sorted(e["index"] for e in finals) == [0, 1]


def test_generate_accepts_what_sglangs_client_sends(client):
    """RuntimeEndpoint.generate: every SglSamplingParams key, unset ones as null, plus the
    special-token flags; select() scores choices with max_new_tokens=0 and text in logprobs."""
    params = {
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
        "max_new_tokens": 3,
        "min_new_tokens": 0,
        "n": 1,
        "stop": [],
        "stop_token_ids": [],
        "stop_regex": None,
        "temperature": 0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "ignore_eos": False,
        "regex": None,
        "json_schema": None,
    }
    r = client.post("/generate", json={"text": PROMPT, "sampling_params": params})
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 3

    r = client.post(
        "/generate",
        json={
            "text": [PROMPT + " Paris", PROMPT + " London"],
            "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True,
            "return_text_in_logprobs": True,
            "logprob_start_len": 3,
        },
    )
    assert r.status_code == 200, r.text
    paris, london = r.json()
    for out in (paris, london):
        assert out["output_ids"] == []
        assert out["meta_info"]["output_token_logprobs"] == []
    score = {
        name: sum(e[0] for e in out["meta_info"]["input_token_logprobs"])
        for name, out in (("paris", paris), ("london", london))
    }
    assert score["paris"] > score["london"]
    assert paris["meta_info"]["input_token_logprobs"][-1][2] == " Paris"


def test_no_stop_trim_keeps_the_stop_string(client):
    base = {"text": PROMPT, "sampling_params": {"max_new_tokens": 8, "stop": ".", **GREEDY}}
    trimmed = client.post("/generate", json=base).json()
    base["sampling_params"]["no_stop_trim"] = True
    kept = client.post("/generate", json=base).json()
    assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": "."}
    assert not trimmed["text"].endswith(".")
    assert kept["text"] == trimmed["text"] + "."


def test_model_and_server_info(client, engine):
    for path in ("/model_info", "/get_model_info"):
        info = client.get(path).json()
        assert info["is_generation"] is True
        assert info["model_path"] and info["tokenizer_path"]
        assert info["context_length"] == engine.context_len
    for path in ("/server_info", "/get_server_info"):
        info = client.get(path).json()
        assert info["context_length"] == engine.context_len
        # the prompt chunk size in use, not the option's unset default
        assert info["chunked_prefill_size"] == engine._core.scheduler.chunk_budget > 0
        assert "num_running_reqs" in info["internal_states"][0]
        assert info["limits"]["max_n"] >= 1


def test_health_health_generate_and_flush_cache(client):
    assert client.get("/health").status_code == 200
    assert client.head("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    r = client.post("/flush_cache", json={"empty_cache": True})
    assert r.status_code == 200
    assert client.get("/server_info").json()["internal_states"][0]["radix_cache_tokens"] == 0


def test_freeze_gc_freezes_what_is_alive(client):
    """SGLang's /freeze_gc: the engine collects, then freezes the objects alive (gc.freeze)."""
    import gc

    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    assert client.post("/freeze_gc").status_code == 200
    assert gc.get_freeze_count() > 0


# ---- OpenAI API ----------------------------------------------------------------------------


def test_models_list(client):
    data = client.get("/v1/models").json()
    assert data["object"] == "list"
    (card,) = data["data"]
    assert card["id"] == "SmolLM2-135M-Instruct"
    assert client.get(f"/v1/models/{card['id']}").status_code == 200
    assert client.get("/v1/models/gpt-4").status_code == 404


def test_completion_usage_and_cached_tokens(client):
    body = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": 3, **GREEDY}
    first = client.post("/v1/completions", json=body).json()
    second = client.post("/v1/completions", json=body).json()
    assert first["object"] == "text_completion"
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    assert first["choices"][0]["finish_reason"] == "length"
    usage = second["usage"]
    assert usage["completion_tokens"] == 3
    assert usage["total_tokens"] == usage["prompt_tokens"] + 3
    # the second request finds the prompt in the radix cache (all but the last token)
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1


def test_logit_bias_reaches_the_sampler_on_both_apis(client, engine):
    """OpenAI's logit_bias (string keys, as JSON has them) and SGLang's sampling_params one."""
    tokens = engine.generate(PROMPT, {"max_new_tokens": 1, "temperature": 0})["output_ids"]
    forced = engine.tokenizer.encode(" banana", add_special_tokens=False)[0]
    assert tokens[0] != forced
    body = {"prompt": PROMPT, "max_tokens": 2, **GREEDY, "logit_bias": {str(forced): 100}}
    out = client.post("/v1/completions", json=body).json()
    assert out["choices"][0]["text"] == engine.tokenizer.decode([forced] * 2)
    native = {"max_new_tokens": 2, "temperature": 0, "logit_bias": {str(forced): 100}}
    out = client.post("/generate", json={"text": PROMPT, "sampling_params": native}).json()
    assert out["output_ids"] == [forced] * 2


def test_completion_echo_logprobs_and_stream(client):
    body = {"prompt": "1, 2, 3,", "max_tokens": 3, "logprobs": 1, "echo": True, **GREEDY}
    out = client.post("/v1/completions", json=body).json()
    choice = out["choices"][0]
    assert choice["text"].startswith("1, 2, 3,")
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["token_logprobs"][0] is None
    assert len(lp["tokens"]) == out["usage"]["prompt_tokens"] + 3
    assert lp["text_offset"][1] == len(lp["tokens"][0])

    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        events = sse_payloads(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == choice["text"]
    streamed_tokens = [
        t for c in chunks if c["choices"] for t in c["choices"][0]["logprobs"]["tokens"]
    ]
    assert streamed_tokens == lp["tokens"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert all(c["usage"] is None for c in chunks[:-1])


def test_chat_completion_and_its_stream_agree(client):
    body = {
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_completion_tokens": 6,
        **GREEDY,
    }
    out = client.post("/v1/chat/completions", json=body).json()
    assert out["object"] == "chat.completion"
    message = out["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"]
    assert out["choices"][0]["finish_reason"] in ("stop", "length")
    assert out["usage"]["completion_tokens"] <= 6
    assert out["usage"]["prompt_tokens"] > 10  # the chat template's markers are counted

    with client.stream(
        "POST",
        "/v1/chat/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
    ) as r:
        events = sse_payloads(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert content == message["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == out["choices"][0]["finish_reason"]
    assert events[-2]["usage"]["completion_tokens"] == out["usage"]["completion_tokens"]


def test_chat_logprobs_and_n(client):
    body = {
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 3,
        "n": 2,
        "seed": 7,
        "logprobs": True,
        "top_logprobs": 2,
    }
    out = client.post("/v1/chat/completions", json=body).json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for choice in out["choices"]:
        content = choice["logprobs"]["content"]
        assert len(content) == 3
        for entry in content:
            assert entry["logprob"] <= 0
            assert len(entry["top_logprobs"]) == 2
            assert entry["bytes"] == list(entry["token"].encode())
    assert out["usage"]["completion_tokens"] == 6
    again = client.post("/v1/chat/completions", json=body).json()
    assert [c["message"] for c in again["choices"]] == [c["message"] for c in out["choices"]]


def test_nullable_fields_take_their_defaults(client):
    """Clients that send every unset field as null (the OpenAI spec marks these nullable)."""
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 3,
        "stream": None,
        "n": None,
        "logprobs": None,
        "parallel_tool_calls": None,
        "stream_options": {"include_usage": None, "continuous_usage_stats": None},
        **GREEDY,
    }
    out = client.post("/v1/chat/completions", json=body)
    assert out.status_code == 200, out.text
    assert len(out.json()["choices"]) == 1 and out.json()["choices"][0]["logprobs"] is None
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "echo": None})
    assert r.status_code == 200 and not r.json()["choices"][0]["text"].startswith(PROMPT)


def test_chat_template_kwargs_become_template_variables(client, engine):
    from radixlm.server.backend import TokenizerSide

    tokenizer = copy.deepcopy(engine.tokenizer)
    tokenizer.chat_template = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    side = TokenizerSide(tokenizer)
    assert side.render_chat([{"role": "user", "content": "x"}], None, {"greeting": "Hi "}) == "Hi x"
    messages = [{"role": "user", "content": "Hi"}]
    body = {
        "messages": messages,
        "max_tokens": 2,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    body["chat_template_kwargs"] = {"tokenize": True}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and "tokenize" in r.json()["error"]["message"]


def test_no_stop_trim_keeps_the_stop_string_streamed_or_not(client):
    free = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, **GREEDY})
    text = free.json()["choices"][0]["text"]
    stop = text.strip().split()[1]  # the second word, which the greedy output reaches
    body = {"prompt": PROMPT, "max_tokens": 8, "stop": [stop], **GREEDY}
    trimmed = client.post("/v1/completions", json=body).json()["choices"][0]
    kept = client.post("/v1/completions", json={**body, "no_stop_trim": True}).json()
    assert trimmed["finish_reason"] == "stop" and not trimmed["text"].endswith(stop)
    assert kept["choices"][0]["text"] == trimmed["text"] + stop
    with client.stream(
        "POST", "/v1/completions", json={**body, "no_stop_trim": True, "stream": True}
    ) as r:
        chunks = [c for c in sse_payloads(r.iter_lines()) if c != "[DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == kept["choices"][0]["text"]
    chat = {"messages": [{"role": "user", "content": "Count: one, two,"}], "max_tokens": 8}
    free = client.post("/v1/chat/completions", json={**chat, **GREEDY}).json()
    word = free["choices"][0]["message"]["content"].split()[0]
    out = client.post(
        "/v1/chat/completions", json={**chat, **GREEDY, "stop": [word], "no_stop_trim": True}
    ).json()
    assert out["choices"][0]["message"]["content"].endswith(word)


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client):
    for path, body in (
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ):
        body = {
            **body,
            "max_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "ignore_eos": True,
            **GREEDY,
        }
        with client.stream("POST", path, json=body) as r:
            chunks = [c for c in sse_payloads(r.iter_lines()) if c != "[DONE]"]
        usages = [c["usage"] for c in chunks]
        assert all(u is not None for u in usages), path
        done = [u["completion_tokens"] for u in usages[:-1]]
        assert done == sorted(done) and done[-1] == 5, path
        assert usages[-1]["completion_tokens"] == 5
        assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)


def test_max_tokens_beyond_the_context_and_min_tokens_beyond_max_are_400s(client, engine):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": engine.context_len})
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "context_length_exceeded"
    assert error["param"] == "max_tokens" and "at most" in error["message"]
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 4}
    r = client.post("/v1/chat/completions", json={**body, "min_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
    assert "min_tokens=5" in r.json()["error"]["message"]


def test_a_text_too_long_for_the_context_is_refused_before_tokenizing(client, engine):
    longest = max(map(len, engine.tokenizer.get_vocab()))
    text = "a" * (2 * engine.context_len * longest + 1)
    for path, body in (
        ("/v1/completions", {"prompt": text}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
        ("/generate", {"text": text}),
    ):
        r = client.post(path, json=body)
        assert r.status_code == 400, path
        assert r.json()["error"]["code"] == "context_length_exceeded", path
        assert "characters" in r.json()["error"]["message"], path


# ---- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/generate", {"text": PROMPT, "sampling_params": {"tempreature": 0}}, "tempreature"),
        ("/generate", {"text": ""}, "empty"),
        (
            "/generate",
            {"text": PROMPT, "sampling_params": {"max_new_tokens": -1}},
            "max_new_tokens",
        ),
        ("/generate", {"text": PROMPT, "sampling_params": {"n": 10_000}}, "n=10000"),
        ("/generate", {"text": PROMPT, "input_ids": [1]}, "exactly one"),
        ("/generate", {"input_ids": [10**9]}, "vocabulary"),
        ("/generate", {"text": PROMPT, "image_data": "x.png"}, "image_data"),
        ("/generate", {"text": PROMPT, "sampling_params": {"stop_regex": "a+"}}, "stop_regex"),
        ("/generate", {"text": PROMPT, "sampling_params": {"logit_bias": {"5": 500}}}, "100"),
        ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"x": 1}}, "token id"),
        (
            "/v1/completions",
            {"prompt": PROMPT, "stream_options": {"include_usage": True}},
            "stream_options",
        ),
        # (these were 500s, and the first stopped the engine for everyone)
        (
            "/generate",
            {"text": PROMPT, "sampling_params": {"max_new_tokens": 2, "skip_special_tokens": 1}},
            "skip_special_tokens",
        ),
        ("/generate", {"text": PROMPT, "sampling_params": {"ignore_eos": "no"}}, "ignore_eos"),
        ("/generate", {"text": PROMPT, "sampling_params": {"n": 2, "seed": "abc"}}, "seed"),
        ("/generate", {"text": PROMPT, "sampling_params": {"dtype": []}}, "dtype"),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ],
            },
            "object",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_object", "json_schema": {"schema": {}}},
            },
            "json_schema",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "without its 'text'",
        ),
        ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"99999999": 1}}, "vocabulary"),
        ("/v1/completions", {"prompt": "", "max_tokens": 2}, "empty"),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": -5}, "max_tokens"),
        ("/v1/completions", {"prompt": PROMPT, "n": 100_000}, "n=100000"),
        ("/v1/completions", {"prompt": PROMPT, "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": PROMPT, "top_p": 0}, "top_p"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "wizard"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "frobnicate": 1},
            "frobnicate",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
            "logprobs",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
            "tool",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
            "response_format",
        ),
    ],
)
def test_bad_input_is_a_400_with_a_message(client, path, body, needle):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert needle in error["message"] + str(error["param"])
    assert error["type"] == "invalid_request_error"


def test_an_unknown_nested_field_is_named_with_its_path(client):
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "text", "a": 1},
    }
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.a", r.text


def test_a_body_nested_too_deeply_is_a_400(client):
    deep = "[" * 5000 + "]" * 5000
    for path, body in [
        ("/generate", '{"text": "Hi", "rid": ' + deep + "}"),
        ("/v1/completions", '{"prompt": ' + deep + "}"),
    ]:
        r = client.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "nested" in r.json()["error"]["message"], r.text


def test_a_top_k_past_int64_samples_as_the_whole_vocabulary(client, engine):
    """(top_k = 2**63 overflowed the sampler's int64 tensor and failed its whole step)"""
    body = {"prompt": PROMPT, "max_tokens": 2, "top_k": 2**63, "temperature": 0.7, "seed": 1}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def test_completion_max_tokens_null_is_the_default_16(client):
    body = {"prompt": PROMPT, "max_tokens": None, "ignore_eos": True, **GREEDY}
    assert client.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 16


def test_malformed_json_unknown_model_and_too_long_prompt(client, engine):
    r = client.post(
        "/v1/chat/completions",
        content=b'{"messages": [',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = client.post(
        "/v1/chat/completions",
        json={"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]},
    )
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = client.post("/generate", json={"input_ids": [42] * (engine.context_len + 1)})
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
    r = client.get("/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = client.get("/generate")
    assert r.status_code == 405 and "error" in r.json()
    # and the server still generates for everyone else
    assert client.get("/health_generate").status_code == 200


# ---- protection ----------------------------------------------------------------------------


def test_api_key_guards_every_route_but_the_probes_and_metrics(engine):
    """As SGLang: /health* and /metrics answer without the key (readiness probes, scrapes)."""
    app = create_app(engine, api_key="sesame", owns_engine=False)
    with TestClient(app) as c:
        for path in ("/health", "/health_generate", "/metrics"):
            assert c.get(path).status_code == 200, path
        for method, path in (("GET", "/v1/models"), ("GET", "/server_info"), ("POST", "/generate")):
            r = c.request(method, path, json={"text": "x"})
            assert r.status_code == 401, path
            assert r.json()["error"]["type"] == "authentication_error"
        r = c.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        r = c.get("/v1/models", headers={"Authorization": "Bearer sesame"})
        assert r.status_code == 200
        body = {"text": "x", "sampling_params": {"max_new_tokens": 1}}
        r = c.post("/generate", json=body, headers={"Authorization": "Bearer sesame"})
        assert r.status_code == 200


def test_rate_limit_answers_429_with_retry_after(engine):
    limits = ServerLimits(rate_limit_per_minute=6, rate_limit_burst=2)
    app = create_app(engine, api_key="k", limits=limits, owns_engine=False)
    with TestClient(app) as c:
        auth = {"Authorization": "Bearer k"}
        assert c.get("/v1/models", headers=auth).status_code == 200
        assert c.get("/v1/models", headers=auth).status_code == 200
        r = c.get("/v1/models", headers=auth)
        assert r.status_code == 429
        assert 1 <= int(r.headers["Retry-After"]) <= 10
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert c.get("/health").status_code == 200  # probes are not limited


def test_limits_on_body_size_prompt_length_n_and_max_tokens(engine):
    limits = ServerLimits(max_body_bytes=2000, max_prompt_tokens=8, max_n=2, max_new_tokens=4)
    with TestClient(create_app(engine, limits=limits, owns_engine=False)) as c:
        r = c.post("/v1/completions", json={"prompt": "x" * 5000})
        assert r.status_code == 413 and "2000 bytes" in r.json()["error"]["message"]
        r = c.post(
            "/v1/completions", json={"prompt": "one two three four five six seven eight nine"}
        )
        assert r.status_code == 400 and "at most 8" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"prompt": "Hi", "n": 3})
        assert r.status_code == 400 and "n=3" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 5})
        assert r.status_code == 400 and "limit of 4" in r.json()["error"]["message"]
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 400  # the chat template alone is longer than 8 tokens
        r = c.post("/generate", json={"text": "Hi"})  # no max_new_tokens: the limit applies
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] <= 4


# ---- metrics -------------------------------------------------------------------------------

# the labels every SGLang metric of one server carries alike: left out of the sample keys below
_SERVER_LABELS = {"model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"}


def parse_prometheus(text: str) -> dict[str, float]:
    """The samples of a Prometheus text, read by prometheus_client's own parser, by
    `name{label="value",...}` (labels sorted, the server-wide ones left out)."""
    samples = {}
    families = list(text_string_to_metric_families(text))
    assert families, "no metric declared"
    for family in families:
        for sample in family.samples:
            labels = ",".join(
                f'{k}="{v}"' for k, v in sorted(sample.labels.items()) if k not in _SERVER_LABELS
            )
            key = f"{sample.name}{{{labels}}}" if labels else sample.name
            assert key not in samples, f"the sample {key} twice"
            samples[key] = sample.value
    return samples


def test_the_engines_histograms_render_from_their_snapshots():
    hist = Histogram((0.1, 1.0))
    for seconds in (0.1, 0.5, 3.0):  # a value on a bound falls in that bound's bucket
        hist.observe(seconds)
    snapshot = hist.snapshot()
    assert snapshot == {
        "buckets": [0.1, 1.0],
        "counts": [1, 1, 1],
        "sum": snapshot["sum"],
        "count": 3,
    }
    s = parse_prometheus(
        Metrics("m").render(EngineStats(grammar_compile_seconds=snapshot)).decode()
    )
    name = "radixlm_grammar_compile_seconds"
    assert [s[f'{name}_bucket{{le="{le}"}}'] for le in ("0.1", "1.0", "+Inf")] == [1, 2, 3]
    assert s[name + "_count"] == 3 and s[name + "_sum"] == pytest.approx(3.6)
    for malformed in ({"buckets": [1.0], "counts": [1]}, {"buckets": [1.0]}, {"counts": "x"}):
        text = Metrics("m").render(EngineStats(grammar_compile_seconds=malformed)).decode()
        assert name not in text  # left out; the rest of the scrape still answers
        ttft = 'sglang:time_to_first_token_seconds_count{is_streaming="false"}'
        assert parse_prometheus(text)[ttft] == 0


def test_speculative_acceptance_lengths_are_a_prometheus_histogram():
    from radixlm.protocol.histogram import Histogram

    hist = Histogram((1.0, 2.0, 3.0, 4.0))
    for tokens in (1, 3, 3, 4, 2):
        hist.observe(tokens)
    stats = EngineStats(spec_verify_ct=5, spec_accept_length_histogram=hist.snapshot())
    s = parse_prometheus(Metrics("m").render(stats).decode())
    name = "radixlm_spec_accept_length"
    cumulative = [s[f'{name}_bucket{{le="{le}"}}'] for le in ("1.0", "2.0", "3.0", "4.0", "+Inf")]
    assert cumulative == [1, 2, 4, 5, 5]
    assert s[name + "_count"] == 5 and s[name + "_sum"] == 13
    assert "spec_accept_length_histogram" not in Metrics("m").render(stats).decode()


def test_metrics_are_prometheus_text(client):
    client.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 3}})
    client.post("/generate", json={"text": ""})  # an error, counted by kind
    r = client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    s = parse_prometheus(r.text)
    for hist, labels in (
        ("time_to_first_token", 'is_streaming="false",'),
        ("inter_token_latency", ""),
        ("e2e_request_latency", 'is_streaming="false",'),
    ):
        name = f"sglang:{hist}_seconds"
        buckets = [v for k, v in s.items() if k.startswith(f"{name}_bucket{{{labels}")]
        assert buckets == sorted(buckets), "buckets are cumulative"
        count = f"{name}_count{{{labels[:-1]}}}" if labels else f"{name}_count"
        assert s[f'{name}_bucket{{{labels}le="+Inf"}}'] == s[count] > 0
        assert s[count.replace("_count", "_sum")] > 0
    assert s['sglang:generation_tokens_total{is_streaming="false"}'] >= 3
    assert s['sglang:prompt_tokens_total{is_streaming="false"}'] >= 5
    assert 'sglang:cached_tokens_total{cache_source="device"}' in s
    assert s['radixlm_errors_total{kind="invalid_request_error"}'] >= 1
    assert s["sglang:num_running_reqs"] == 0
    assert 0 <= s["radixlm_kv_cache_usage_ratio"] <= 1
    assert 0 <= s["sglang:cache_hit_rate"] <= 1


def prometheus_types(text: str) -> dict[str, str]:
    return {
        line.split(" ")[2]: line.split(" ")[3]
        for line in text.splitlines()
        if line.startswith("# TYPE ")
    }


def test_engine_totals_are_counters_and_its_levels_gauges(client):
    client.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    types = prometheus_types(client.get("/metrics").text)
    for name in (
        "radixlm_engine_steps_total",
        "sglang:num_retracted_requests_total",
        "radixlm_engine_graph_steps_total",
        "radixlm_engine_prefill_graph_steps_total",
        "radixlm_engine_overlapped_steps_total",
        "radixlm_engine_jump_forward_tokens_total",
    ):
        assert types.get(name) == "counter", name
    for name in (
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "radixlm_kv_cache_usage_ratio",
        "sglang:cache_hit_rate",
        "radixlm_radix_cache_tokens",
        "sglang:kv_evictable_tokens",
        "radixlm_engine_radix_cache_protected_tokens",
        "radixlm_engine_responsive",
    ):
        assert types.get(name) == "gauge", name
    for name, kind in types.items():
        assert (kind == "counter") == name.endswith("_total"), (name, kind)


class SlowBackend(LocalEngineBackend):
    """The real engine behind a backend that waits `stats_delay` seconds before each stats call
    and `stream_delay` before each stream is handed back (as validation or a grammar's compile
    can); with `silent_streams`, no stream ever yields a token."""

    def __init__(
        self,
        engine,
        *,
        stats_delay: float = 0.0,
        stream_delay: float = 0.0,
        silent_streams: bool = False,
    ) -> None:
        super().__init__(engine)
        self.stats_delay = stats_delay
        self.stream_delay = stream_delay
        self.silent_streams = silent_streams

    async def stats(self):
        await asyncio.sleep(self.stats_delay)
        return await super().stats()

    async def stream(self, *args, **kwargs):
        await asyncio.sleep(self.stream_delay)
        if self.silent_streams:
            return _silent()
        return await super().stream(*args, **kwargs)


async def _silent():
    await asyncio.sleep(3600)
    yield {}


def test_metrics_answer_without_the_engine_and_server_info_is_a_503(engine, monkeypatch):
    """An engine that does not answer (stuck, or busy far beyond the bound) must not hold up
    /metrics: the server's own metrics come back in time, with engine_responsive 0."""
    monkeypatch.setattr(backend_module, "ENGINE_STATS_TIMEOUT_S", 0.2)
    stuck = SlowBackend(engine, stats_delay=30.0)
    with TestClient(create_app(stuck, owns_engine=False)) as c:
        body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 2}}
        assert c.post("/generate", json=body).status_code == 200
        assert c.get("/health").status_code == 200  # the engine's process or thread still runs
        started = time.monotonic()
        r = c.get("/metrics")
        assert time.monotonic() - started < 3
        assert r.status_code == 200
        s = parse_prometheus(r.text)
        assert s["radixlm_engine_responsive"] == 0
        assert s['sglang:time_to_first_token_seconds_count{is_streaming="false"}'] == 1
        assert s['sglang:generation_tokens_total{is_streaming="false"}'] == 2
        assert "sglang:num_running_reqs" not in s
        started = time.monotonic()
        r = c.get("/get_server_info")
        assert time.monotonic() - started < 3
        assert r.status_code == 503
        assert "did not answer" in r.json()["error"]["message"]
    monkeypatch.undo()  # (the real engine on a loaded machine may take over 0.2 s to answer)
    with TestClient(create_app(engine, owns_engine=False)) as c:
        assert parse_prometheus(c.get("/metrics").text)["radixlm_engine_responsive"] == 1


_REQUEST_METRICS = (
    "sglang:time_to_first_token_seconds",
    "sglang:inter_token_latency_seconds",
    "sglang:request_time_per_output_token_seconds",
    "sglang:e2e_request_latency_seconds",
    "sglang:prompt_tokens_total",
    "sglang:generation_tokens_total",
    "sglang:cached_tokens_total",
    "sglang:num_requests_total",
    "sglang:num_aborted_requests_total",
    "radixlm_requests_total",
    "radixlm_errors_total",
)


def _request_metrics(text: str) -> dict[str, float]:
    return {k: v for k, v in parse_prometheus(text).items() if k.startswith(_REQUEST_METRICS)}


def test_the_health_probe_is_not_counted_as_a_request(engine):
    with TestClient(create_app(engine, owns_engine=False)) as c:
        before = _request_metrics(c.get("/metrics").text)
        assert c.get("/health_generate").status_code == 200
        assert _request_metrics(c.get("/metrics").text) == before


def test_a_health_probe_that_times_out_is_no_disconnected_client(engine, monkeypatch):
    monkeypatch.setattr(native, "HEALTH_GENERATE_TIMEOUT_S", 0.2)
    silent = SlowBackend(engine, silent_streams=True)
    with TestClient(create_app(silent, owns_engine=False)) as c:
        r = c.get("/health_generate")
        assert r.status_code == 503 and "in time" in r.json()["error"]["message"]
        s = _request_metrics(c.get("/metrics").text)
        assert 'radixlm_errors_total{kind="client_disconnected"}' not in s
        assert 'radixlm_requests_total{finish_reason="abort"}' not in s


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 1}}),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 1}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
        ),
    ],
)
def test_time_to_first_token_counts_from_the_requests_arrival(engine, path, body):
    """What the server spends before the generation starts (tokenizing, validating, compiling a
    grammar: here a delay before the stream is handed back) is part of the time to first token."""
    delay = 1.0
    with TestClient(create_app(SlowBackend(engine, stream_delay=delay), owns_engine=False)) as c:
        assert c.post(path, json=body).status_code == 200
        s = parse_prometheus(c.get("/metrics").text)
    assert s['sglang:time_to_first_token_seconds_count{is_streaming="false"}'] == 1
    assert s['sglang:time_to_first_token_seconds_sum{is_streaming="false"}'] >= delay
    assert s['sglang:e2e_request_latency_seconds_sum{is_streaming="false"}'] >= delay


def test_a_shut_down_engine_is_a_503_and_other_engine_failures_a_500(engine, monkeypatch):
    """EngineShutDown (nothing more can run) answers 503; any other RuntimeError from the engine
    is a failure of ours, 500, and not mistaken for a shut-down engine."""
    from radixlm.errors import EngineShutDown

    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 2, **GREEDY}}
    with TestClient(create_app(engine, owns_engine=False), raise_server_exceptions=False) as c:
        for error, status in ((EngineShutDown("the engine is shut down"), 503),
                              (RuntimeError("CUDA error: an illegal memory access"), 500)):  # fmt: skip

            async def failing(*args, error=error, **kwargs):
                raise error

            monkeypatch.setattr(engine, "async_generate", failing)
            r = c.post("/generate", json=body)
            assert r.status_code == status, (r.status_code, r.text)
            r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            assert r.status_code == status, (r.status_code, r.text)

            def failing_call(*args, error=error, **kwargs):
                raise error

            monkeypatch.setattr(engine, "flush_cache", failing_call)
            assert c.post("/flush_cache").status_code == status
        monkeypatch.undo()
        assert c.post("/generate", json=body).status_code == 200
