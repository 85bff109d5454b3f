"""Constrained decoding: grammars (regex, JSON schema, choices, EBNF) compiled into token-level
matchers over a tokenizer's vocabulary, packed token bitmasks, jump-forward.

Two backends compile them (GrammarCompiler's `backend`): "llguidance", the default
(llguidance_backend.py: an Earley parser, so recursion is enforced as written), and "outlines",
described below.

    compiler = GrammarCompiler(tokenizer, vocab_size=logits_width)
    grammar = compiler.compile("json_schema", schema_text)   # cached; GrammarError if refused
    matcher = grammar.matcher()                             # one per request
    matcher.fill_next_token_bitmask(bitmask[i])             # then apply_token_bitmask_(logits, bitmask)
    matcher.accept_token(token)                             # False if the grammar forbids it

The "outlines" backend: every grammar becomes a regex (recursion unrolled to a configured depth);
compiling builds only its byte-level DFA (outlines-core's Index over
the 256 single bytes, in a helper process that is killed when the compile's deadline passes;
dfa_process.py), and each state's token mask is built on the state's first visit by walking
the vocabulary trie through the DFA (automaton.py), then cached. The JSON schema converter is our
own and refuses, naming keyword and location, whatever it cannot enforce exactly.
"""

from __future__ import annotations

from radixlm.constrained.batch import (
    accept_next_tokens,
    begin_next_token_bitmasks,
    fill_next_token_bitmasks,
)
from radixlm.constrained.bitmask import (
    allocate_token_bitmask,
    apply_token_bitmask_,
    bitmask_from_ids,
    ids_from_bitmask,
)
from radixlm.constrained.compiler import GRAMMAR_BACKENDS, KINDS, GrammarCompiler
from radixlm.constrained.errors import GrammarError
from radixlm.constrained.grammar import CompiledGrammar, GrammarMatcher
from radixlm.constrained.json_schema import (
    JsonSchemaOptions,
    dump_json_for_schema,
    json_schema_to_regex,
    schema_validator,
    validate_json_output,
)
from radixlm.constrained.schema_rewrite import NumberLimits
from radixlm.constrained.vocab import TokenVocabulary

__all__ = [
    "GRAMMAR_BACKENDS",
    "accept_next_tokens",
    "KINDS",
    "NumberLimits",
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarError",
    "GrammarMatcher",
    "JsonSchemaOptions",
    "TokenVocabulary",
    "allocate_token_bitmask",
    "apply_token_bitmask_",
    "begin_next_token_bitmasks",
    "bitmask_from_ids",
    "dump_json_for_schema",
    "fill_next_token_bitmasks",
    "ids_from_bitmask",
    "json_schema_to_regex",
    "schema_validator",
    "validate_json_output",
]
