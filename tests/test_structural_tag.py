"""structural_tag: free text in which each trigger opens a section held to its JSON schema until
its end tag (SGLang's and xgrammar's structural tag), on the llguidance backend."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from radixlm.constrained import GrammarCompiler, GrammarError
from radixlm.protocol.sampling_params import SamplingParams

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TAG = {
    "structures": [
        {"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"},
        {"begin": "<function=get_time>", "schema": TIME, "end": "</function>"},
    ],
    "triggers": ["<function="],
}
SECTION = re.compile(r"<function=(\w+)>(.*?)</function>", re.S)


@pytest.fixture(scope="module")
def hf_tokenizer(default_model_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_folder)


def accepts(grammar, tokenizer, text: str) -> bool:
    """Whether the matcher takes `text` (as the tokenizer spells it) and then EOS."""
    matcher = grammar.matcher()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept_token(t) for t in ids) and matcher.accept_token(
        tokenizer.eos_token_id
    )


def valid_sections(text: str) -> bool:
    """The plain reading: every tagged section names a structure and its JSON validates."""
    schemas = {"get_weather": WEATHER, "get_time": TIME}
    for name, body in SECTION.findall(text):
        if name not in schemas:
            return False
        try:
            jsonschema.validate(json.loads(body), schemas[name])
        except (ValueError, jsonschema.ValidationError):
            return False
    return text.count("<function=") == len(SECTION.findall(text))


@pytest.mark.parametrize(
    "text",
    [
        "No tool needed here.",
        'Checking. <function=get_weather>{"city":"Paris"}</function> Done.',
        '<function=get_time>{"zone":"UTC"}</function><function=get_weather>{"city":"Oslo"}</function>',
        'x <function=get_weather>{"town":"Paris"}</function>',  # a key the schema has not
        'x <function=get_time>{"zone":"PST"}</function>',  # not in the enum
        "x <function=get_news>{}</function>",  # no such structure
        '<function=get_weather>{"city":"Paris"}',  # the section never ends
        'x <function=get_weather>{"city": "Paris"}</function>',  # compact JSON, as json_schema
    ],
)
def test_the_grammar_accepts_exactly_text_whose_sections_validate(hf_tokenizer, text):
    grammar = GrammarCompiler(hf_tokenizer).compile("structural_tag", json.dumps(TAG))
    compact = ": " not in text
    assert accepts(grammar, hf_tokenizer, text) == (valid_sections(text) and compact)


@pytest.mark.parametrize(
    "tag, message",
    [
        ("{", "not valid JSON"),
        ({"structures": [], "triggers": ["<f"]}, "structures must be a non-empty list"),
        ({"structures": TAG["structures"], "triggers": []}, "triggers must be a non-empty"),
        (
            {"structures": [{"begin": "<tool>", "schema": WEATHER, "end": "</tool>"}],
             "triggers": ["<function="]},
            "starts with none of the triggers",
        ),
        (
            {"structures": [{"begin": "<f>", "schema": "object", "end": "</f>"}],
             "triggers": ["<f"]},
            "schema must be a JSON schema",
        ),
    ],
)  # fmt: skip
def test_a_malformed_structural_tag_is_a_clear_error(tag, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams.from_dict({"structural_tag": tag if isinstance(tag, str) else tag})


def test_it_is_one_constraint_among_the_others():
    with pytest.raises(ValueError, match="at most one of"):
        SamplingParams.from_dict({"structural_tag": TAG, "regex": "a+"})
    assert SamplingParams.from_dict({"structural_tag": TAG}).constraint[0] == "structural_tag"


def test_a_schema_inside_is_refused_as_a_json_schema_request_would_be(hf_tokenizer):
    bad = {
        "structures": [
            {
                "begin": "<f>",
                "schema": {"type": "object", "not": {"required": ["a"]}},
                "end": "</f>",
            }
        ],
        "triggers": ["<f"],
    }
    with pytest.raises(GrammarError, match=r"structures\[0\]\.schema"):
        GrammarCompiler(hf_tokenizer).compile("structural_tag", json.dumps(bad))


def test_the_outlines_backend_refuses_it_saying_which_backend_has_it(hf_tokenizer):
    compiler = GrammarCompiler(hf_tokenizer, backend="outlines")
    with pytest.raises(GrammarError, match="needs the llguidance grammar backend"):
        compiler.compile("structural_tag", json.dumps(TAG))


def test_the_real_model_writes_sections_that_validate(engine):
    # a few-shot continuation gets the small model to open a section itself
    prompt = (
        'Weather in Paris: <function=get_weather>{"city":"Paris"}</function>\n'
        'Time in UTC: <function=get_time>{"zone":"UTC"}</function>\n'
        'Weather in Rome: <function=get_weather>{"city":"Rome"}</function>\n'
        "Weather in Oslo:"
    )
    out = engine.generate(
        prompt, {"max_new_tokens": 40, "temperature": 0, "structural_tag": json.dumps(TAG)}
    )
    assert "<function=" in out["text"], out["text"]  # (what the few shots are for)
    assert valid_sections(out["text"]), out["text"]


@pytest.fixture(scope="module")
def client(engine):
    from fastapi.testclient import TestClient

    from radixlm.server.app import create_app

    with TestClient(create_app(engine, owns_engine=False)) as c:
        yield c


def test_response_format_structural_tag_over_the_openai_api(client):
    prompt = 'Weather in Paris: <function=get_weather>{"city":"Paris"}</function>\nWeather in Oslo:'
    body = {
        "prompt": prompt,
        "max_tokens": 30,
        "temperature": 0,
        "response_format": {"type": "structural_tag", **TAG},
    }
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert "<function=" in text and valid_sections(text), text


@pytest.mark.parametrize(
    "fmt, needle",
    [
        ({"type": "structural_tag", "structures": TAG["structures"]}, "triggers"),
        ({"type": "structural_tag", "triggers": ["<f"]}, "structures"),
        ({"type": "json_object", "triggers": ["<f"]}, "come with type 'structural_tag'"),
        ({"type": "text", "structures": TAG["structures"]}, "come with type 'structural_tag'"),
    ],
)
def test_a_bad_structural_tag_response_format_is_a_400(client, fmt, needle):
    body = {"messages": [{"role": "user", "content": "x"}], "response_format": fmt}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_structural_tag_in_native_sampling_params(client):
    """SGLang's /generate form: the tag as JSON text in sampling_params."""
    body = {
        "text": 'Weather in Paris: <function=get_weather>{"city":"Paris"}</function>\nWeather in Oslo:',
        "sampling_params": {
            "max_new_tokens": 30,
            "temperature": 0,
            "structural_tag": json.dumps(TAG),
        },
    }
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    text = r.json()["text"]
    assert "<function=" in text and valid_sections(text), text
    bad = {"text": "x", "sampling_params": {"structural_tag": "{}"}}
    r = client.post("/generate", json=bad)
    assert r.status_code == 400 and "structural_tag" in r.json()["error"]["message"], r.text
