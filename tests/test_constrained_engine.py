"""Constrained decoding through the engine with the real default model: every output matches its
regex or validates against its schema; bad grammars fail their own request with a clear error."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

import radixlm

REGEXES = {
    "date": r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    "email": r"[a-z]{2,10}@[a-z]{2,10}\.(com|org|net)",
    "ipv4": r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)",
    "phone": r"\(\d{3}\) \d{3}-\d{4}",
    "enum": r"(red|green|blue)",
}

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": ["string", "null"]},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 12},
            "minItems": 1,
            "maxItems": 3,
        },
        "role": {"enum": ["admin", "user", "guest"]},
        "kind": {"const": "person"},
        "address": {"$ref": "#/$defs/address"},
        "id": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 8}]},
    },
    "required": ["name", "age", "email", "tags", "role", "kind", "address", "id"],
    "additionalProperties": False,
    "$defs": {
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        }
    },
}


def chat(engine, text: str) -> str:
    return engine.apply_chat_template([{"role": "user", "content": text}])


@pytest.mark.parametrize("name", sorted(REGEXES))
def test_regex_outputs_full_match(engine, name):
    pattern = REGEXES[name]
    prompt = chat(engine, f"Give an example {name}.")
    outs = engine.generate(
        [prompt] * 4, {"max_new_tokens": 40, "temperature": 0.8, "seed": 11, "regex": pattern}
    )
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        assert re.fullmatch(pattern, out["text"]), out["text"]


def test_json_schema_outputs_validate_in_a_mixed_batch(engine):
    prompt = chat(engine, "Describe a made-up user as JSON.")
    constrained = {"max_new_tokens": 160, "temperature": 0.7, "seed": 1, "json_schema": PERSON}
    free = {"max_new_tokens": 24, "temperature": 0}
    outs = engine.generate([prompt] * 6, [constrained, free] * 3)
    for out in outs[::2]:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), PERSON)
    plain = engine.generate(prompt, free)
    assert all(o["output_ids"] == plain["output_ids"] for o in outs[1::2])


def test_pydantic_model_as_schema(engine):
    pydantic = pytest.importorskip("pydantic")

    class City(pydantic.BaseModel):
        name: str
        population: int
        capital: bool

    out = engine.generate(
        chat(engine, "Paris as JSON."),
        {"max_new_tokens": 60, "temperature": 0, "json_schema": City},
    )
    City.model_validate_json(out["text"])


@pytest.mark.parametrize("jump_forward", [True, False])
def test_a_complete_output_finishes_without_an_eos_step_even_at_the_length_limit(
    default_model_folder, jump_forward
):
    """Once the grammar is complete and only EOS may follow, the request is done: no step is
    spent sampling EOS, and an output that is complete at exactly max_new_tokens is a "stop"."""
    prompt = [{"role": "user", "content": "Pick a colour."}]
    params = {"temperature": 0, "regex": r"(red|green|blue) and (red|green|blue)"}
    with radixlm.Engine(default_model_folder, enable_jump_forward=jump_forward) as eng:
        text = eng.apply_chat_template(prompt)
        free = eng.generate(text, {**params, "max_new_tokens": 40})
        n = len(free["output_ids"])
        assert free["meta_info"]["finish_reason"] == {
            "type": "stop", "matched": free["output_ids"][-1],
        }  # fmt: skip
        assert not set(free["output_ids"]) & eng.eos_token_ids
        assert re.fullmatch(params["regex"], free["text"])
        exact = eng.generate(text, {**params, "max_new_tokens": n})
        assert exact["output_ids"] == free["output_ids"]
        assert exact["meta_info"]["finish_reason"]["type"] == "stop"


def test_running_out_of_tokens_mid_object_is_length_not_a_result(engine):
    out = engine.generate(
        chat(engine, "A user as JSON."), {"max_new_tokens": 5, "json_schema": PERSON}
    )
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


@pytest.mark.parametrize(
    "params, message",
    [
        ({"regex": "(unclosed"}, "regex"),
        ({"json_schema": "{not json"}, "JSON"),
        (
            {"json_schema": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
            "uniqueItems",
        ),
    ],
)
def test_bad_grammars_raise_before_reaching_the_engine(engine, params, message):
    with pytest.raises(ValueError, match=message):
        engine.generate("Hi", {"max_new_tokens": 4, **params})
    assert engine.generate("Hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


def test_jump_forward_saves_steps_and_keeps_outputs_valid(default_model_folder):
    schema = {
        "type": "object",
        "properties": {
            "customer_full_name": {"type": "string", "maxLength": 20},
            "customer_account_status": {"enum": ["active", "closed"]},
            "customer_loyalty_points": {"type": "integer", "maximum": 100000},
        },
        "required": ["customer_full_name", "customer_account_status", "customer_loyalty_points"],
        "additionalProperties": False,
    }
    params = {"max_new_tokens": 80, "temperature": 0, "json_schema": schema}
    results = {}
    for jump in (False, True):
        with radixlm.Engine(default_model_folder, enable_jump_forward=jump) as eng:
            prompts = [
                chat(eng, f"Customer {n} as JSON.") for n in ("Ann Lee", "Bo Chan", "Cy Diaz")
            ]
            outs = [eng.generate(p, params) for p in prompts]
            stats = eng.get_stats()
            canonical = [
                eng.tokenizer.encode(o["text"], add_special_tokens=False) == o["output_ids"][:-1]
                for o in outs
            ]
        for o in outs:
            jsonschema.validate(json.loads(o["text"]), schema)
        results[jump] = (outs, stats, canonical)
    (off, stats_off, canonical_off), (on, stats_on, _) = results[False], results[True]
    assert stats_on["jump_forward_tokens"] > 0
    assert stats_on["num_steps"] < stats_off["num_steps"]
    # where the model's own tokens were the canonical ones, jumping changes nothing
    for was_canonical, a, b in zip(canonical_off, off, on):
        if was_canonical:
            assert a["text"] == b["text"]


def test_constrained_tokens_applied_inline_are_those_of_the_general_path(
    default_model_folder, monkeypatch
):
    """A step's constrained tokens are applied inline (`_apply_decodes`: the grammar takes the
    token, then jump-forward) unless something else is due; the general path (`_apply`) is the
    reference: the same tokens, texts, finish reasons and jump-forward counts, over grammars
    that complete (finishing without an EOS step), run out of tokens, and jump forward, in one
    batch beside a plain request."""
    from radixlm.runtime.request import Req

    prompts = ["A person as JSON:", "Pick a colour:", "A date:", "Say hi."]
    params = [
        {"max_new_tokens": 200, "temperature": 0, "json_schema": json.dumps(PERSON)},
        {"max_new_tokens": 16, "temperature": 0, "regex": REGEXES["enum"]},
        {"max_new_tokens": 6, "temperature": 0, "regex": REGEXES["date"]},
        {"max_new_tokens": 12, "temperature": 0},
    ]

    def run():
        with radixlm.Engine(default_model_folder) as eng:
            outs = eng.generate(prompts, params)
            return [(o["output_ids"], o["text"], o["meta_info"]["finish_reason"]) for o in outs], (
                eng.get_stats()["jump_forward_tokens"]
            )

    inline = run()
    # (plain requests inline still, constrained ones by the general path)
    monkeypatch.setattr(Req, "applied_inline", property(lambda self: self.grammar is None))
    general = run()
    assert inline == general
    assert inline[1] > 0  # (jump-forward did run)
    reasons = [r["type"] for _, _, r in inline[0]]
    assert reasons[:3] == ["stop", "stop", "length"], reasons
    jsonschema.validate(json.loads(inline[0][0][1]), PERSON)


# -- lenient JSON schemas: unenforceable keywords skipped, the output checked and reported ------

# every value the mask allows is a list of three items from {1, 2}: never unique
NEVER_UNIQUE = {
    "type": "array",
    "items": {"enum": [1, 2]},
    "minItems": 3,
    "maxItems": 3,
    "uniqueItems": True,
}
MAYBE_UNIQUE = {
    "type": "array",
    "items": {"enum": ["red", "green", "blue"]},
    "minItems": 2,
    "maxItems": 2,
    "uniqueItems": True,
}


def test_lenient_schema_reports_an_invalid_output_never_a_silent_pass(engine):
    with pytest.raises(ValueError, match="uniqueItems"):
        engine.generate("Hi", {"max_new_tokens": 8, "json_schema": NEVER_UNIQUE})
    params = {"max_new_tokens": 16, "json_schema": NEVER_UNIQUE, "json_schema_lenient": True}
    out = engine.generate(chat(engine, "Three numbers as a JSON list."), params)
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    assert len(json.loads(out["text"])) == 3  # the enforceable part holds
    report = out["meta_info"]["grammar_validation"]
    assert report["valid"] is False
    assert "non-unique" in report["error"]
    assert report["ignored_keywords"] == ["unsupported keyword 'uniqueItems' at #"]


def test_lenient_validation_agrees_with_jsonschema(engine):
    params = {
        "max_new_tokens": 20,
        "temperature": 1.0,
        "seed": 5,
        "json_schema": MAYBE_UNIQUE,
        "json_schema_lenient": True,
    }
    outs = engine.generate([chat(engine, "Two colours as a JSON list.")] * 8, params)
    verdicts = set()
    for out in outs:
        report = out["meta_info"]["grammar_validation"]
        errors = list(
            jsonschema.Draft202012Validator(MAYBE_UNIQUE).iter_errors(json.loads(out["text"]))
        )
        assert report["valid"] == (not errors), (out["text"], report)
        assert (report["error"] is None) == report["valid"]
        verdicts.add(report["valid"])
    assert True in verdicts  # the model can satisfy the skipped keyword, and it is reported


def test_lenient_output_cut_by_max_new_tokens_is_reported_invalid(engine):
    params = {"max_new_tokens": 3, "json_schema": MAYBE_UNIQUE, "json_schema_lenient": True}
    out = engine.generate(chat(engine, "Two colours as a JSON list."), params)
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    report = out["meta_info"]["grammar_validation"]
    assert report["valid"] is False and "not valid JSON" in report["error"]


def test_strict_schemas_carry_no_validation_report(engine):
    schema = {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 2}
    out = engine.generate("Hi", {"max_new_tokens": 8, "json_schema": schema})
    assert "grammar_validation" not in out["meta_info"]


@pytest.mark.parametrize(
    "params, message",
    [
        ({"json_schema_lenient": True}, "give a json_schema"),
        ({"regex": "a+", "json_schema_lenient": True}, "give a json_schema"),
        ({"json_schema": {"type": "integer"}, "json_schema_lenient": "yes"}, "true or false"),
    ],
)
def test_lenient_needs_a_json_schema(engine, params, message):
    with pytest.raises(ValueError, match=message):
        engine.generate("Hi", {"max_new_tokens": 4, **params})


def test_ebnf_recursion_depth_is_checked():
    from radixlm.runtime.config import EngineConfig

    with pytest.raises(ValueError, match="ebnf_recursion_depth"):
        EngineConfig(ebnf_recursion_depth=-1)


def test_jump_forward_after_a_long_free_run_never_rolls_back_past_the_grammars_memory(
    tiny_model_folder,
):
    """Free text longer than the grammar can roll back (64 tokens), then a forced literal whose
    canonical tokens would replace more of the model's own: jump-forward is skipped there (it
    used to stop the engine with a GrammarError), and the output still matches."""
    params = {
        "max_new_tokens": 460,
        "temperature": 1.0,
        "seed": 3,
        "regex": "[a-z]{400}-done-and-finished",
    }
    with radixlm.Engine(tiny_model_folder, enable_jump_forward=True) as eng:
        outs = eng.generate(["Write:"] * 4, [{**params, "seed": s} for s in range(4)])
        assert eng.is_alive()
        assert eng.generate("Hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] != "abort", out["meta_info"]
        assert re.fullmatch("[a-z]{400}-done-and-finished", out["text"]), out["text"][-40:]


def test_a_grammar_no_token_can_continue_fails_with_that_reason(engine):
    """After "Hi" the grammar wants a character of an empty class: every token is masked, and
    the request says so (it said "internal error: the grammar refused the sampled token 0"; with
    llguidance, which then allows only EOS, it would have ended as if "Hi" were complete)."""
    params = {"max_new_tokens": 4, "ebnf": 'root ::= "Hi" [^\\x00-\\U0010FFFF]'}
    out = engine.generate("Hi", params)
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "cannot go on" in reason["message"], reason
    assert engine.generate("Hi", {"max_new_tokens": 1})["meta_info"]["completion_tokens"] == 1


def test_a_character_the_dfa_backend_never_generates_fails_with_that_reason(tiny_model_folder):
    """U+10FFFF ends every match in the DFA backend's automaton, so it is never generated:
    every token is masked at once. (llguidance writes it like any other character.)"""
    with radixlm.Engine(tiny_model_folder, grammar_backend="outlines") as eng:
        out = eng.generate("Hi", {"max_new_tokens": 3, "regex": "\U0010ffff+"})
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "cannot go on" in reason["message"], reason
        assert eng.generate("Hi", {"max_new_tokens": 1})["meta_info"]["completion_tokens"] == 1
