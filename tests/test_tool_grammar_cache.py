"""A tool set compiles its grammar once: the second request with the same 20 tools, under
tool_choice "required" and under "auto", is a cache hit (counted at the compiler's build)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from radixlm.server.app import create_app


def tools(n: int = 20) -> list[dict]:
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": f"Tool number {i}.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "query": {"type": "string", "maxLength": 20},
                        "limit": {"type": "integer", "minimum": 1, "maximum": 10},
                    },
                    "required": ["query"],
                },
            },
        }
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine, owns_engine=False)) as c:
        yield c


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_a_tool_set_compiles_once(client, engine, monkeypatch, choice):
    compiler = engine.grammar_compiler()
    builds = []
    real = compiler._build

    def counted(*args, **kwargs):
        builds.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(compiler, "_build", counted)
    body = {
        "messages": [{"role": "user", "content": f"Search for cats ({choice})."}],
        "tools": tools(),
        "tool_choice": choice,
        "max_tokens": 12,
        "temperature": 0,
    }
    for _ in range(2):
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
    assert len(builds) == 1, builds
