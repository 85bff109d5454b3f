"""The grammar compiler reads the tokenizer (about a second of work) in a thread of its own as the
engine starts: no caller's thread builds it, a constrained request that arrives before it is ready
waits for it alone, and a tokenizer the backend cannot read fails the constrained requests alone."""

from __future__ import annotations

import json
import threading

import pytest

import radixlm
from radixlm.constrained import GrammarError
from radixlm.runtime.engine import Engine

DIGIT = {"type": "object", "properties": {"d": {"enum": [1, 2, 3]}}, "required": ["d"]}


def test_the_compiler_is_built_in_its_own_thread_as_the_engine_starts(
    tiny_model_folder, monkeypatch
):
    built_in = []
    real = Engine._new_grammar_compiler

    def record(self):
        built_in.append(threading.current_thread().name)
        return real(self)

    monkeypatch.setattr(Engine, "_new_grammar_compiler", record)
    with radixlm.Engine(tiny_model_folder, max_total_tokens=2048) as eng:
        compiler = eng.grammar_compiler()  # (waits for it)
        out = eng.generate("Hi", {"max_new_tokens": 12, "temperature": 0, "json_schema": DIGIT})
        assert eng.grammar_compiler() is compiler
    assert built_in == ["radixlm-grammar-setup"]
    assert json.loads(out["text"])["d"] in (1, 2, 3), out


def test_a_constrained_request_waits_for_the_compiler_alone(tiny_model_folder, monkeypatch):
    gate = threading.Event()
    real = Engine._new_grammar_compiler

    def slow(self):
        gate.wait(60)
        return real(self)

    monkeypatch.setattr(Engine, "_new_grammar_compiler", slow)
    with radixlm.Engine(tiny_model_folder, max_total_tokens=2048) as eng:
        constrained = {}

        def ask() -> None:
            params = {"max_new_tokens": 12, "temperature": 0, "json_schema": DIGIT}
            constrained["out"] = eng.generate(["Hi"], params)[0]

        caller = threading.Thread(target=ask)
        caller.start()
        plain = eng.generate("Hello", {"max_new_tokens": 6, "ignore_eos": True})
        assert plain["meta_info"]["completion_tokens"] == 6
        assert caller.is_alive() and not eng._grammar_setup.done()  # still waiting, alone
        gate.set()
        caller.join(60)
    assert json.loads(constrained["out"]["text"])["d"] in (1, 2, 3), constrained


def test_a_tokenizer_the_backend_cannot_read_fails_only_the_constrained_requests(
    tiny_model_folder, monkeypatch
):
    def unreadable(self):
        raise GrammarError("llguidance cannot read this tokenizer; use grammar_backend='outlines'")

    monkeypatch.setattr(Engine, "_new_grammar_compiler", unreadable)
    with radixlm.Engine(tiny_model_folder, max_total_tokens=2048) as eng:
        outs = eng.generate(
            ["Hi", "Hello"],
            [
                {"max_new_tokens": 4, "json_schema": DIGIT},
                {"max_new_tokens": 4, "ignore_eos": True},
            ],
        )
        with pytest.raises(ValueError, match="grammar_backend='outlines'"):
            eng.generate("Hi", {"max_new_tokens": 4, "regex": "(yes|no)"})
    reason = outs[0]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "cannot read this tokenizer" in reason["message"]
    assert outs[1]["meta_info"]["completion_tokens"] == 4


def test_engines_of_one_process_share_llguidances_reading_of_one_tokenizer(tiny_model_folder):
    """Reading a tokenizer costs llguidance ~0.6 s of CPU; the result is immutable, so compilers
    of the same tokenizer, vocabulary size and EOS ids share it, and any of these differing
    reads it anew."""
    from transformers import AutoTokenizer

    from radixlm.constrained import GrammarCompiler

    def reading(vocab_size: int, eos: list[int]):
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_folder)  # (a fresh object each time)
        return GrammarCompiler(tokenizer, vocab_size, eos_token_ids=eos)._llguidance().tokenizer

    first = reading(49152, [2])
    assert reading(49152, [2]) is first
    assert reading(49216, [2]) is not first
    assert reading(49152, [0, 2]) is not first
    compiled = GrammarCompiler(
        AutoTokenizer.from_pretrained(tiny_model_folder), 49152, eos_token_ids=[2]
    ).compile("regex", "(yes|no)")
    assert compiled.matcher().accept_string("yes")
