"""SGLang's routes and stream shapes beyond /generate itself, over the real default model through
FastAPI's TestClient: streamed log-probabilities (the new entries of each chunk, with the count
so far), /concate_and_append_request, /tokenize and /detokenize, and the model card of
/v1/models."""

from __future__ import annotations

import math

import pytest
from fastapi.testclient import TestClient

from radixlm.server.app import create_app
from tests.live_server import serve_in_thread, sse_payloads

PROMPT = "The capital of France is"
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine, owns_engine=False)) as c:
        yield c


# ---- streamed log-probabilities --------------------------------------------------------------


def stream_chunks(client, body: dict) -> list[dict]:
    with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = sse_payloads(r.iter_lines())
    assert events[-1] == "[DONE]"
    return events[:-1]


def test_a_streamed_chunk_carries_the_logprobs_of_its_new_tokens_only(client):
    body = {
        "text": PROMPT,
        "sampling_params": {"max_new_tokens": 6, **GREEDY},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
    }
    whole = client.post("/generate", json=body).json()["meta_info"]
    assert whole["output_token_logprobs_length"] == len(whole["output_token_logprobs"]) == 6
    chunks = stream_chunks(client, body)
    assert len(chunks) > 1
    metas = [c["meta_info"] for c in chunks]
    # the text and output ids stay cumulative (SGLang's client slices the text itself)
    assert [len(c["output_ids"]) for c in chunks] == [m["completion_tokens"] for m in metas]
    assert chunks[-1]["text"] == client.post("/generate", json=body).json()["text"]
    # each chunk: the entries since the last one, and the count so far
    before = 0
    for meta in metas:
        assert meta["output_token_logprobs_length"] == meta["completion_tokens"]
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] - before
        assert len(meta["output_top_logprobs"]) == len(meta["output_token_logprobs"])
        before = meta["completion_tokens"]
    # the prompt's in the first chunk only
    assert len(metas[0]["input_token_logprobs"]) == whole["prompt_tokens"]
    assert all(m["input_token_logprobs"] == [] for m in metas[1:])
    # together, the lists of the whole output
    for key in ("input_token_logprobs", "output_token_logprobs", "output_top_logprobs"):
        joined = [e for m in metas for e in m[key]]
        assert [e[1:] for e in _flat(joined)] == [e[1:] for e in _flat(whole[key])], key
        for a, b in zip(_flat(joined), _flat(whole[key])):
            assert a[0] is b[0] is None or math.isclose(a[0], b[0], abs_tol=1e-4)


def _flat(entries: list) -> list:
    """Top-logprob lists flattened into their entries; plain entries as they are."""
    out = []
    for e in entries:
        if e is None:
            continue
        out.extend(e if e and isinstance(e[0], list) else [e])
    return out


def test_a_streamed_batch_counts_each_generations_logprobs_apart(client):
    body = {
        "text": ["One, two,", "A, B,"],
        "sampling_params": {"max_new_tokens": 4, **GREEDY},
        "return_logprob": True,
    }
    whole = client.post("/generate", json=body).json()
    got: dict[int, list] = {0: [], 1: []}
    for chunk in stream_chunks(client, body):
        meta = chunk["meta_info"]
        got[chunk["index"]].extend(meta["output_token_logprobs"])
        assert meta["output_token_logprobs_length"] == len(got[chunk["index"]])
    for i in (0, 1):
        assert [e[1] for e in got[i]] == whole[i]["output_ids"]


def test_our_program_client_sees_the_whole_logprob_lists_of_a_streamed_gen(engine):
    """radixlm's own RuntimeEndpoint puts the streamed pieces together again."""
    import radixlm as sgl

    @sgl.function
    def answer(s):
        s += PROMPT
        s += sgl.gen("city", max_tokens=5, temperature=0, return_logprob=True, top_logprobs_num=2)

    local = answer.run(backend=engine)
    with serve_in_thread(engine) as url:
        state = answer.run(backend=sgl.RuntimeEndpoint(url), stream=True)
        pieces = list(state.text_iter("city"))
        remote = state.get_meta_info("city")
    assert "".join(pieces) == state["city"] == local["city"]
    ours = local.get_meta_info("city")
    assert [e[1] for e in remote["output_token_logprobs"]] == [
        e[1] for e in ours["output_token_logprobs"]
    ]
    assert len(remote["output_top_logprobs"]) == len(ours["output_top_logprobs"]) == 5


# ---- /concate_and_append_request -------------------------------------------------------------


def test_concatenate_and_append_acknowledges_the_join(client):
    body = {"src_rids": ["a1", "b2"], "dst_rid": "c3"}
    r = client.post("/concate_and_append_request", json=body)
    assert r.status_code == 200
    assert r.json()["success"] is True


@pytest.mark.parametrize(
    "body, message",
    [
        ({"src_rids": [], "dst_rid": "c"}, "src_rids"),
        ({"src_rids": ["a", 1], "dst_rid": "c"}, "src_rids"),
        ({"src_rids": ["a"]}, "dst_rid"),
        ({"src_rids": ["a"], "dst_rid": "c", "extra": 1}, "unknown field"),
        (["a"], "JSON object"),
    ],
)
def test_concatenate_and_append_refuses_a_malformed_body(client, body, message):
    r = client.post("/concate_and_append_request", json=body)
    assert r.status_code == 400
    assert message in r.json()["error"]["message"]


# ---- /tokenize and /detokenize ---------------------------------------------------------------


def test_tokenize_gives_the_ids_generate_runs_a_prompt_as(client, engine):
    r = client.post("/tokenize", json={"prompt": PROMPT})
    assert r.status_code == 200
    out = r.json()
    assert out["tokens"] == engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    assert out["count"] == len(out["tokens"])
    assert out["max_model_len"] == engine.context_len
    generated = client.post(
        "/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 1}}
    ).json()
    assert generated["meta_info"]["prompt_tokens"] == out["count"]
    # a list of prompts, on the /v1 path too
    many = client.post("/v1/tokenize", json={"prompt": [PROMPT, "Hi"]}).json()
    assert many["tokens"][0] == out["tokens"]
    assert many["count"] == [len(t) for t in many["tokens"]]


def test_tokenize_messages_as_a_chat_completion_renders_them(client, engine):
    messages = [{"role": "user", "content": "Name a color."}]
    out = client.post("/tokenize", json={"messages": messages}).json()
    assert out["tokens"] == engine.tokenizer.encode(
        engine.apply_chat_template(messages), add_special_tokens=False
    )
    chat = client.post(
        "/v1/chat/completions", json={"messages": messages, "max_tokens": 1, **GREEDY}
    ).json()
    assert chat["usage"]["prompt_tokens"] == out["count"]


def test_detokenize_round_trips_and_skips_special_tokens(client, engine):
    ids = client.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"text": PROMPT}
    end = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert client.post("/detokenize", json={"tokens": [*ids, end]}).json()["text"] == PROMPT
    kept = client.post(
        "/v1/detokenize", json={"tokens": [ids, [end]], "skip_special_tokens": False}
    )
    assert kept.json() == {"text": [PROMPT, "<|im_end|>"]}
    assert client.post("/detokenize", json={"tokens": []}).json() == {"text": ""}


@pytest.mark.parametrize(
    "path, body, message",
    [
        ("/tokenize", {}, "exactly one of prompt and messages"),
        ("/tokenize", {"prompt": "a", "messages": []}, "exactly one of prompt and messages"),
        ("/tokenize", {"prompt": []}, "empty list"),
        ("/tokenize", {"prompt": 3}, "invalid request"),
        ("/tokenize", {"prompt": "a", "tools": []}, "applies to messages"),
        ("/tokenize", {"prompt": "a", "nonsense": 1}, "unknown field"),
        ("/tokenize", {"messages": [{"role": "user", "content": "a"}],
                       "add_generation_prompt": False}, "add_generation_prompt"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "a"}]}, "role"),
        ("/detokenize", {"tokens": ["a"]}, "list of token ids"),
        ("/detokenize", {"tokens": [[1], 2]}, "list of token ids"),
        ("/detokenize", {}, "list of token ids"),
        ("/detokenize", {"tokens": [10**9]}, "outside the vocabulary"),
        ("/detokenize", {"tokens": [-1]}, "outside the vocabulary"),
    ],
)  # fmt: skip
def test_tokenizer_routes_refuse_bad_input_with_a_400(client, path, body, message):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


def test_tokenizer_routes_know_only_the_served_model(client):
    r = client.post("/tokenize", json={"model": "gpt-4", "prompt": "a"})
    assert r.status_code == 404
    ok = client.post("/tokenize", json={"model": "SmolLM2-135M-Instruct", "prompt": "a"})
    assert ok.status_code == 200


# ---- /v1/models ------------------------------------------------------------------------------


def test_model_card_has_openai_and_sglang_fields(client, engine):
    (card,) = client.get("/v1/models").json()["data"]
    assert card == {
        "id": "SmolLM2-135M-Instruct",
        "object": "model",
        "created": card["created"],
        "owned_by": "radixlm",
        "root": "SmolLM2-135M-Instruct",
        "parent": None,
        "max_model_len": engine.context_len,
    }
    assert isinstance(card["created"], int) and card["created"] > 1_600_000_000
    assert client.get("/v1/models/SmolLM2-135M-Instruct").json() == card
