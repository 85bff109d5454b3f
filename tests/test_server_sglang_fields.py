"""Every field of SGLang's own requests is known here (server/sglang_fields.py): honoured, ignored,
or refused with a reason unless at SGLang's default. The field lists come from SGLang's source
(`GenerateReqInput`, `CompletionRequest`, `ChatCompletionRequest`), read with `ast` from the
`sglang` package of `.venv-sglang`, so a field SGLang adds fails here until it is placed."""

from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from radixlm.server import native, sglang_fields
from radixlm.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from radixlm.server.sglang_fields import CHAT, COMPLETIONS, GENERATE

ROOT = Path(__file__).resolve().parent.parent
NO_DEFAULT = object()  # a required field, or a default that is not a literal

# What SGLang's router (sglang-router 0.3) forwards for a plain request to each route: its request
# objects serialized with every field at its default (read off a stub worker's log)
ROUTER_BODIES = {
    "/generate": {
        "text": "Hello",
        "model": None,
        "sampling_params": {"max_new_tokens": 2},
        "return_text_in_logprobs": False,
        "stream": False,
        "log_metrics": True,
        "return_hidden_states": False,
        "background": False,
        "no_logs": False,
        "return_bytes": False,
        "return_entropy": False,
    },
    "/v1/completions": {
        "model": None,
        "prompt": "Hello",
        "max_tokens": 2,
        "stream": False,
        "echo": False,
        "no_stop_trim": False,
        "ignore_eos": False,
        "skip_special_tokens": True,
        "return_hidden_states": False,
    },
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": "Hello"}],
        "model": None,
        "logprobs": False,
        "max_completion_tokens": 2,
        "stream": False,
        "no_stop_trim": False,
        "ignore_eos": False,
        "continue_final_message": False,
        "skip_special_tokens": True,
        "separate_reasoning": True,
        "stream_reasoning": True,
        "return_hidden_states": False,
    },
}
BASE = {  # the least each route needs
    "/generate": {"text": "Hello", "sampling_params": {"max_new_tokens": 1}},
    "/v1/completions": {"prompt": "Hello", "max_tokens": 1},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
}
TABLES = {"/generate": GENERATE, "/v1/completions": COMPLETIONS, "/v1/chat/completions": CHAT}


def sglang_source() -> Path:
    where = os.environ.get("RADIXLM_SGLANG_SOURCE")
    candidates = (
        [Path(where)]
        if where
        else sorted(ROOT.glob(".venv-sglang/lib/python*/site-packages/sglang"))
    )
    for path in candidates:
        if (path / "srt" / "managers" / "io_struct.py").is_file():
            return path
    pytest.skip("SGLang's source is not installed (make test creates .venv-sglang)")


def sglang_fields_of(path: Path, name: str) -> dict[str, Any]:
    """The public fields of class `name` (and its bases in the same file) with their defaults."""
    tree = ast.parse(path.read_text())
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    fields: dict[str, Any] = {}

    def walk(cls: ast.ClassDef) -> None:
        for base in cls.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                walk(classes[base.id])
        for node in cls.body:
            target = node.target if isinstance(node, ast.AnnAssign) else None
            if isinstance(target, ast.Name) and not target.id.startswith("_"):
                fields[target.id] = default_of(node.value)

    walk(classes[name])
    return fields


def default_of(value: ast.expr | None) -> Any:
    if isinstance(value, ast.Call):  # field(default=...) or Field(default=...)
        value = next((k.value for k in value.keywords if k.arg == "default"), None)
        if value is None:
            return NO_DEFAULT
    if value is None:
        return NO_DEFAULT
    try:
        return ast.literal_eval(value)
    except ValueError:
        return NO_DEFAULT


def sglang_requests() -> dict[str, dict[str, Any]]:
    src = sglang_source()
    protocol = src / "srt" / "entrypoints" / "openai" / "protocol.py"
    return {
        "/generate": sglang_fields_of(
            src / "srt" / "managers" / "io_struct.py", "GenerateReqInput"
        ),
        "/v1/completions": sglang_fields_of(protocol, "CompletionRequest"),
        "/v1/chat/completions": sglang_fields_of(protocol, "ChatCompletionRequest"),
    }


# ---- the table against SGLang's source and our parsers --------------------------------------


def test_every_field_of_sglangs_requests_is_placed():
    for route, fields in sglang_requests().items():
        assert len(fields) > 40, (route, fields)  # the walk read the class
        missing = sorted(set(fields) - set(TABLES[route]))
        assert not missing, f"SGLang's {route} fields with no treatment in sglang_fields: {missing}"


def test_the_table_states_sglangs_own_defaults():
    """A `default only` field accepts SGLang's default: the value its clients and router send."""
    for route, fields in sglang_requests().items():
        for key, rule in TABLES[route].items():
            default = fields.get(key, NO_DEFAULT)
            if rule.treatment == "default only" and default is not NO_DEFAULT:
                assert sglang_fields.is_unset(default, rule), (route, key, default, rule)


def test_the_openai_structs_declare_every_field_of_the_table():
    for struct, table in ((CompletionRequest, COMPLETIONS), (ChatCompletionRequest, CHAT)):
        assert set(table) <= set(struct.__struct_fields__), set(table) - set(
            struct.__struct_fields__
        )


def test_generate_reads_each_field_the_table_says_it_honours():
    honoured = {k for k, rule in GENERATE.items() if rule.treatment == "honoured"}
    assert honoured <= native._GENERATE_KEYS, honoured - native._GENERATE_KEYS


def test_the_docs_table_is_current():
    doc = (ROOT / "docs" / "sglang_fields.md").read_text()
    assert doc == sglang_fields.markdown_table(), (
        "docs/sglang_fields.md is stale: write sglang_fields.markdown_table() to it"
    )


def test_a_set_default_only_value_is_refused_naming_the_field_and_why():
    rule = GENERATE["return_hidden_states"]
    assert sglang_fields.is_unset(False, rule) and sglang_fields.is_unset(None, rule)
    assert not sglang_fields.is_unset(True, rule) and not sglang_fields.is_unset(1, rule)
    assert sglang_fields.is_unset([None, None], GENERATE["lora_path"])  # one per prompt
    assert not sglang_fields.is_unset([None, "adapter"], GENERATE["lora_path"])
    assert sglang_fields.is_unset(0, GENERATE["data_parallel_rank"])
    assert not sglang_fields.is_unset(1, GENERATE["data_parallel_rank"])


# ---- over HTTP ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(tiny_model_folder):
    import radixlm
    from radixlm.server.app import create_app

    with (
        radixlm.Engine(tiny_model_folder, dtype="float32", max_total_tokens=2048) as engine,
        TestClient(create_app(engine, owns_engine=False)) as c,
    ):
        yield c


@pytest.mark.parametrize("route", list(ROUTER_BODIES))
def test_the_bodies_sglangs_router_forwards_are_served(client, route):
    r = client.post(route, json=ROUTER_BODIES[route])
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("route", list(TABLES))
def test_every_unacted_sglang_field_at_its_default_is_accepted(client, route):
    """All of SGLang's fields this server does not act on, at once, at SGLang's defaults."""
    fields = sglang_requests()[route]
    body = dict(BASE[route])
    for key, rule in TABLES[route].items():
        if rule.treatment != "honoured" and key in fields:
            default = fields[key]
            body[key] = None if default is NO_DEFAULT else default
    r = client.post(route, json=body)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("route", list(TABLES))
def test_each_default_only_field_set_is_a_400_that_names_it(client, route):
    for key, rule in TABLES[route].items():
        if rule.treatment != "default only" or key in BASE[route]:
            continue
        value = not rule.default if isinstance(rule.default, bool) else "x"
        r = client.post(route, json={**BASE[route], key: value})
        assert r.status_code == 400, (key, r.text)
        error = r.json()["error"]
        assert error["param"] == key, (key, error)
        assert "not supported" in error["message"] and rule.why in error["message"], error


@pytest.mark.parametrize("route", list(TABLES))
def test_a_field_neither_sglang_nor_openai_defines_is_still_refused(client, route):
    r = client.post(route, json={**BASE[route], "max_new_tokenz": 3})
    assert r.status_code == 400 and "unknown field" in r.json()["error"]["message"], r.text


def test_ignored_fields_take_any_value(client):
    body = {**BASE["/generate"], "model": "whatever", "routing_key": "k", "priority": 7}
    assert client.post("/generate", json=body).status_code == 200, body
    body = {
        **BASE["/v1/completions"],
        "rid": "mine",
        "session_id": "s",
        "custom_labels": {"a": "b"},
    }
    assert client.post("/v1/completions", json=body).status_code == 200, body
    body = {**BASE["/v1/chat/completions"], "task": "query", "return_flat_raw_top_logprobs_b64": 0}
    assert client.post("/v1/chat/completions", json=body).status_code == 200, body
