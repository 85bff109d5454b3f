"""A reasoning model's thinking before a constraint (`server/thinking.py`): each kind of
constraint rewritten to hold the answer after the thinking, checked by what each grammar backend
admits over a vocabulary of single characters, and through the server over a scripted output:
`reasoning_content` split off and the answer held, streamed and whole."""

from __future__ import annotations

import json
import re
import string
from typing import Any

import pytest
from fastapi.testclient import TestClient

from radixlm.constrained import GrammarCompiler, GrammarError
from radixlm.constrained.compiler import GRAMMAR_BACKENDS
from radixlm.constrained.ebnf import ebnf_to_regex
from radixlm.errors import GrammarRefused
from radixlm.protocol.reasoning import reasoning_parser
from radixlm.server.app import create_app
from radixlm.server.thinking import ebnf_after_thinking, hold_after_thinking
from tests.live_server import sse_payloads
from tests.test_server_tools import TIME, WEATHER, ScriptedBackend

TOKENS = ["<eos>", *string.printable]


class CharTokenizer:
    """A vocabulary of single characters: a grammar admits a text exactly when it admits it
    character by character."""

    eos_token_id = 0
    all_special_ids = [0]

    def get_vocab(self) -> dict[str, int]:
        return {t: i for i, t in enumerate(TOKENS)}


@pytest.fixture(scope="module", params=GRAMMAR_BACKENDS)
def compiler(request) -> GrammarCompiler:
    return GrammarCompiler(
        CharTokenizer(), vocab_size=len(TOKENS), compile_timeout=30, backend=request.param
    )


def admits(compiler: GrammarCompiler, params: dict[str, Any], text: str) -> bool:
    (kind,) = [k for k in ("regex", "json_schema", "ebnf", "structural_tag") if k in params]
    matcher = compiler.compile(kind, params[kind]).matcher()
    return matcher.accept_string(text) and matcher.is_accepting()


THOUGHT = "The user asks <yes or no>; </thin is not the end. So: yes."
EBNF = '# root answers\nroot ::= "The answer is " answer "."\nanswer ::= "yes" | "no" | "[root]"'
CONSTRAINTS: list[tuple[dict[str, Any], str, str]] = [
    # (the constraint, an answer it admits, one it refuses)
    ({"regex": "^(yes|no)$"}, "yes", "maybe"),
    ({"regex": r"\d{2}-\d{2}"}, "12-31", "12/31"),
    ({"ebnf": EBNF}, "The answer is [root].", "The answer is maybe."),
    ({"ebnf": 'greeting ::= "hi" | "hello"'}, "hello", "hey"),
    (
        {"json_schema": json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}})},
        '{"n":1}',
        '{"n":"1"}',
    ),
]


@pytest.mark.parametrize("constraint,answer,wrong", CONSTRAINTS)
@pytest.mark.parametrize("name", ["qwen3", "deepseek-r1"])
def test_a_constraint_holds_the_answer_after_the_thinking(
    compiler, constraint, answer, wrong, name
):
    parser = reasoning_parser(name)
    params = dict(constraint)
    assert hold_after_thinking(params, parser, "compact")
    assert admits(compiler, params, f"<think>\n{THOUGHT}\n</think>\n\n{answer}")
    assert not admits(compiler, params, f"<think>\n{THOUGHT}\n</think>\n\n{wrong}")
    assert not admits(compiler, params, f"<think>{THOUGHT}{answer}")  # (thinking never ended)
    # qwen3 may answer without thinking; deepseek-r1's template opened <think>: it always thinks
    assert admits(compiler, params, answer) == (name == "qwen3")
    assert admits(compiler, params, f"{THOUGHT}</think>{answer}") == (name == "deepseek-r1")


def test_ebnf_after_thinking_keeps_the_grammar_s_own_lines_and_names():
    grammar = ebnf_after_thinking(EBNF, reasoning_parser("qwen3"))
    # the grammar's lines first, as written but for its start rule's new name
    assert grammar.splitlines()[:3] == [
        "# root answers",
        'answer-1 ::= "The answer is " answer "."',  # ("answer" was taken)
        'answer ::= "yes" | "no" | "[root]"',
    ]
    assert grammar.splitlines()[-1] == "root ::= thinking answer-1"
    regex = re.compile(ebnf_to_regex(grammar), re.DOTALL)
    assert regex.fullmatch(f"<think>{THOUGHT}</think>The answer is no.")
    # a grammar without `root` starts at its first rule
    first = ebnf_after_thinking('a ::= "x" b\nb ::= "y"', reasoning_parser("deepseek-r1"))
    assert re.fullmatch(ebnf_to_regex(first), f"{THOUGHT}</think>\nxy")


def test_what_cannot_come_after_the_thinking_says_so():
    parser = reasoning_parser("qwen3")
    for params in ({"regex": "(?i)yes"}, {"json_schema": json.dumps({"uniqueItems": True})}):
        before = dict(params)
        assert not hold_after_thinking(params, parser, "compact") and params == before
    tag = {"structural_tag": "[1, 2]"}  # (not a structural tag: the engine says why)
    assert not hold_after_thinking(tag, parser, "compact") and tag == {"structural_tag": "[1, 2]"}


N = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
TAG = {
    "structures": [
        {"begin": "<f=a>", "schema": N, "end": "</f>"},
        {"begin": "<f=b>", "schema": N, "end": "</f>"},
    ],
    "triggers": ["<f="],
}
# a trigger written inside the thinking, followed by what no section admits
TAG_THOUGHT = "Call <f=a> or <f=b>? Say <f=c (no such one)."
TAG_ANSWERS = [
    # (the tagged text after the thinking, whether the tag admits it)
    ("No call needed.", True),
    ('Calling <f=a>{"n":1}</f> then <f=b>{"n":2}</f>.', True),
    ('<f=a>{"n":"1"}</f>', False),  # (the section holds its schema)
    ("Calling <f=a> now.", False),  # (a trigger after the thinking opens its section)
]


@pytest.mark.parametrize("answer,held", TAG_ANSWERS)
@pytest.mark.parametrize("name", ["qwen3", "deepseek-r1"])
def test_a_structural_tag_opens_sections_only_after_the_thinking(compiler, answer, held, name):
    parser = reasoning_parser(name)
    params = {"structural_tag": json.dumps(TAG)}
    assert hold_after_thinking(params, parser, "compact")
    if compiler.backend != "llguidance":  # (structural tags are llguidance's only: refused)
        with pytest.raises(GrammarError, match="grammar_backend='llguidance'"):
            admits(compiler, params, answer)
        return
    assert admits(compiler, params, f"<think>\n{TAG_THOUGHT}\n</think>\n\n{answer}") == held
    assert not admits(compiler, params, f"<think>{TAG_THOUGHT}")  # (thinking never ended)
    # qwen3 may answer without thinking; deepseek-r1's template opened <think>: it always thinks
    assert admits(compiler, params, answer) == (held and name == "qwen3")
    assert admits(compiler, params, f"{TAG_THOUGHT}</think>{answer}") == (
        held and name == "deepseek-r1"
    )
    # without the thinking's markers, its triggers open sections (the text it holds then fails)
    assert not admits(compiler, params, f"{TAG_THOUGHT} {answer}")


def test_a_malformed_thinking_in_a_structural_tag_says_what_to_fix(compiler):
    tag = json.dumps({**TAG, "thinking": {"begin": "<think>", "end": ""}})
    message = "grammar_backend" if compiler.backend != "llguidance" else "thinking must be"
    with pytest.raises(GrammarError, match=message):
        compiler.compile("structural_tag", tag)


# ---- through the server --------------------------------------------------------------------


def _chat(client: TestClient, body: dict[str, Any]) -> tuple[str | None, str, list, str]:
    """(reasoning_content, content, [name, arguments] of each call, finish_reason)."""
    if not body.get("stream"):
        out = client.post("/v1/chat/completions", json=body)
        assert out.status_code == 200, out.text
        choice = out.json()["choices"][0]
        message = choice["message"]
        calls = [
            [c["function"]["name"], c["function"]["arguments"]]
            for c in message.get("tool_calls") or []
        ]
        content = message["content"] or ""
        return message.get("reasoning_content"), content, calls, choice["finish_reason"]
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        chunks = [x for x in sse_payloads(r.iter_lines()) if x != "[DONE]"]
    thinking, content, calls, reason = "", "", [], None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            thinking += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            for d in delta.get("tool_calls") or []:
                if "id" in d:
                    calls.append([d["function"]["name"], d["function"]["arguments"]])
                else:
                    calls[d["index"]][1] += d["function"]["arguments"]
            reason = choice["finish_reason"] or reason
    return thinking or None, content, calls, reason


CALL = '[{"name":"get_time","arguments":{"timezone":"UTC"}}]'  # (compact, as the grammar writes)
SERVER_CASES = [
    # (what the request asks, what the model writes after its thinking, the reply it gets)
    (
        {"tools": [WEATHER, TIME], "tool_choice": "required"},
        CALL,
        ("", [["get_time", '{"timezone":"UTC"}']], "tool_calls"),
    ),
    ({"regex": "(yes|no)"}, "yes", ("yes", [], "stop")),
    ({"ebnf": 'root ::= "yes" | "no"'}, "no", ("no", [], "stop")),
]


@pytest.mark.parametrize("asks,answer,reply", SERVER_CASES)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_server_splits_the_thinking_and_holds_the_answer(asks, answer, reply, stream):
    script = f"<think>\nThe user wants a short answer.\n</think>\n\n{answer}"
    backend = ScriptedBackend(script)
    body = {"messages": [{"role": "user", "content": "Well?"}], **asks, "stream": stream}
    with TestClient(create_app(backend, reasoning_parser="qwen3")) as client:
        thinking, *rest = _chat(client, body)
    assert thinking == "The user wants a short answer." and tuple(rest) == reply
    # the grammar sent lets the thinking come first, then holds the answer
    (sent,) = [v for k, v in backend.calls[0].items() if k in ("regex", "ebnf")]
    kind = "regex" if "regex" in backend.calls[0] else "ebnf"
    held = re.compile(sent if kind == "regex" else ebnf_to_regex(sent), re.DOTALL)
    assert held.fullmatch(script) and not held.fullmatch(f"{script} and more")


class CompilingBackend(ScriptedBackend):
    """A ScriptedBackend whose engine compiles the constraint it is sent over a vocabulary of
    single characters (its own tokens, as `ScriptedBackend.tokenize` spells them), refusing one
    its grammar backend refuses as the engine does, and keeps the grammar."""

    def __init__(self, script: str, backend: str) -> None:
        super().__init__(script)
        self.compiler = GrammarCompiler(
            CharTokenizer(), vocab_size=len(TOKENS), compile_timeout=30, backend=backend
        )
        self.grammars: list[Any] = []

    async def stream(self, input_ids, sampling_params, **logprob_options):
        try:
            grammar = self.compiler.compile("structural_tag", sampling_params["structural_tag"])
        except GrammarError as e:
            raise GrammarRefused(str(e)) from e
        self.grammars.append(grammar)
        return await super().stream(input_ids, sampling_params, **logprob_options)


RESPONSE_TAG = {"type": "structural_tag", **TAG}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_structural_tag_holds_the_answer_after_the_thinking(stream):
    answer = 'See <f=a>{"n":1}</f>'
    script = f"<think>\n{TAG_THOUGHT}\n</think>\n\n{answer}"
    backend = CompilingBackend(script, "llguidance")
    body = {
        "messages": [{"role": "user", "content": "Go"}],
        "response_format": RESPONSE_TAG,
        "stream": stream,
    }
    with TestClient(create_app(backend, reasoning_parser="qwen3")) as client:
        thinking, content, calls, reason = _chat(client, body)
    assert (thinking, content, calls, reason) == (TAG_THOUGHT, answer, [], "stop")
    sent = json.loads(backend.calls[0]["structural_tag"])
    assert sent["thinking"] == {"begin": "<think>", "end": "</think>", "forced": False}
    # the grammar the engine compiled: the thinking's triggers open nothing, the answer's do
    (grammar,) = backend.grammars
    for text, held in [
        (script, True),
        (f"<think>\n{TAG_THOUGHT}\n</think>\n\nSee <f=a> and more", False),
        (f"{TAG_THOUGHT} {answer}", False),
    ]:
        matcher = grammar.matcher()
        assert (matcher.accept_string(text) and matcher.is_accepting()) == held, text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_structural_tag_after_the_thinking_on_a_backend_without_it_is_a_400(stream):
    backend = CompilingBackend("<think>\nPlan.\n</think>\n\nDone.", "outlines")
    body = {
        "messages": [{"role": "user", "content": "Go"}],
        "response_format": RESPONSE_TAG,
        "stream": stream,
    }
    with TestClient(create_app(backend, reasoning_parser="qwen3")) as client:
        out = client.post("/v1/chat/completions", json=body)
    assert out.status_code == 400, out.text
    assert "grammar_backend='llguidance'" in out.json()["error"]["message"]


PING = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("family", ["hermes", "llama3", "pythonic", "mistral", "deepseekv3"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_demanded_call_in_each_family_comes_after_the_thinking(family, stream):
    from radixlm.server.tool_parsers import tool_call_parser

    call = tool_call_parser(family).format_calls([("ping", {})])
    script = f"<think>\nI should ping.\n</think>\n\n{call}"
    backend = ScriptedBackend(script)
    body = {
        "messages": [{"role": "user", "content": "Ping?"}],
        "tools": [PING],
        "tool_choice": "required",
        "stream": stream,
    }
    app = create_app(backend, reasoning_parser="qwen3", tool_call_parser=family)
    with TestClient(app) as client:
        reply = _chat(client, body)
    assert reply == ("I should ping.", "", [["ping", "{}"]], "tool_calls")
    held = re.compile(backend.calls[0]["regex"], re.DOTALL)
    assert held.fullmatch(script) and held.fullmatch(call)  # (qwen3 may also not think)
    assert not held.fullmatch("<think>\nNo.\n</think>\n\nNo call.")
