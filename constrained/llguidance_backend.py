"""The llguidance grammar backend: JSON schemas, regexes, choices and EBNF compiled by llguidance
(an Earley parser over a lazily built lexer, in Rust), so recursive schemas and grammars are
enforced as written, compiles take about a millisecond, and token masks are computed per step.

Chosen as the default because, measured over MaskBench (benchmarks/grammar.py), it is the one
engine of the field with no false accepts, compiles under 10 ms at p99 and refuses, with a
message, what it cannot enforce. The engine sees only the CompiledGrammar / GrammarMatcher
nouns that the DFA backend has too:

    backend = LLGuidanceBackend(tokenizer, vocab_size, eos_token_ids)
    grammar = backend.build("json_schema", schema_text, lenient=False)
    matcher = grammar.matcher()
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from radixlm.constrained.bitmask import bitmask_words, ids_from_bitmask
from radixlm.constrained.errors import GrammarError
from radixlm.constrained.json_schema import FLEXIBLE_WHITESPACE, OutputCheck, one_of_exclusivity
from radixlm.constrained.number_digits import DigitLimits, NumberDigits, TokenTable, hold
from radixlm.constrained.schema_rewrite import (
    NAMED_SUBSCHEMAS,
    NumberLimits,
    bound_numbers,
    close_objects,
    iter_subschemas,
    map_subschemas,
    one_of_as_any_of,
    prepare_schema,
    reachable_subschemas,
    share_leaves,
)
from radixlm.constrained.vocab import TokenVocabulary

_MAX_JUMP_BYTES = 4096
# The widest bounds llguidance reads (as doubles): an integer bound at 2**63 or past it, or a
# number bound past 10**18, is refused or narrowed by llguidance itself
_INTEGER_LIMIT = 9 * 10**18
_NUMBER_LIMIT = 10**18
_UNLIMITED = NumberLimits(0, -1, -1)
# a run of digits as long as an integer past 2**53 (llguidance reads such a constant as a double)
_LONG_DIGITS = re.compile(r"\d{16}")
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S+)")
# what llguidance says of a oneOf whose branches it cannot tell apart (refused; lenient: anyOf)
_ONE_OF = re.compile(r"oneOf constraints are not supported|oneOf not fully supported")


class LLGuidanceBackend:
    """Builds llguidance grammars for one tokenizer (the tokenizer's conversion, ~0.1-1 s, is done
    once here). whitespace: "compact", "flexible", or a regex for the whitespace between JSON
    tokens. allow_unlisted_properties: objects that list `properties` and say nothing of
    `additionalProperties` may carry other keys (off: only the listed ones are generated, as the
    DFA backend does). numbers: bounds for numbers whose schema sets none (schema_rewrite.py)."""

    name = "llguidance"
    # llguidance's threads for a step's batch of tokens and masks (LLExecutor); None: its own
    # choice, 80% of the cores up to 32 (one on a 2-core machine). Read when the executor is made.
    executor_threads: int | None = None

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        *,
        whitespace: str = "compact",
        allow_unlisted_properties: bool = False,
        numbers: NumberLimits | None = None,
    ) -> None:
        import llguidance

        self._ll = llguidance
        self.tokenizer = tokenizer  # an llguidance.LLTokenizer
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = eos_token_ids
        self.whitespace = whitespace
        self.allow_unlisted_properties = allow_unlisted_properties
        self.numbers = numbers if numbers is not None else NumberLimits()
        n = self.numbers
        self._digit_limits = DigitLimits(n.integer_digits, n.fraction_digits, n.exponent_digits)
        # the JSON readers of each set of digit limits met (number_digits.py), over one table of
        # the tokens' bytes: the default limits' made here (~40 ms), not in a first compile
        self._digits: dict[DigitLimits, NumberDigits] = {}
        self._token_table: TokenTable | None = None
        self._digits_lock = threading.Lock()
        if self._digit_limits.any:
            self._number_digits(self._digit_limits)
        self._executor: Any = None
        self._fill_thread: Any = None
        # errors without the parser's state dump: they reach the user
        self._limits = llguidance.LLParserLimits(verbose_errors=False)

    @property
    def fill_thread(self) -> Any:
        """The thread a batch of masks fills in while the engine core goes on (begin_fill)."""
        if self._fill_thread is None:
            from concurrent.futures import ThreadPoolExecutor

            self._fill_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._fill_thread

    @property
    def executor(self) -> Any:
        """llguidance's thread pool that fills many masks at once (made on first use)."""
        if self._executor is None:
            self._executor = self._ll.LLExecutor(self.executor_threads)
        return self._executor

    @classmethod
    def for_tokenizer(
        cls,
        tokenizer: Any,
        vocab_size: int | None,
        eos_token_ids: Iterable[int] | None,
        *,
        vocab: Callable[[], TokenVocabulary],
        **options: Any,
    ) -> LLGuidanceBackend:
        """The backend for a Hugging Face fast tokenizer (read by llguidance itself, so its own
        tokenization is the model's) or anything else `vocab()` can read into byte strings."""
        import llguidance

        fast = not isinstance(tokenizer, TokenVocabulary) and hasattr(
            tokenizer, "backend_tokenizer"
        )
        if fast:
            if eos_token_ids is None:
                eos_token_ids = (
                    [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
                )
            eos = tuple(dict.fromkeys(int(e) for e in eos_token_ids))
            if not eos:
                raise GrammarError("the tokenizer has no eos_token_id; pass eos_token_ids")
            size = int(vocab_size) if vocab_size is not None else len(tokenizer)
            try:
                lltok = _unpanicked(lambda: _read_tokenizer(_tokenizer_json(tokenizer), size, eos))
            except ValueError:  # not one llguidance reads: by its bytes
                pass
            else:
                return cls(lltok, size, eos, **options)
        words = vocab()
        if not any(words.token_bytes):
            raise GrammarError("the vocabulary has no usable tokens")
        wrapper = llguidance.TokenizerWrapper(_ByteTokenizer(words))
        lltok = _unpanicked(
            lambda: llguidance.LLTokenizer(
                wrapper, n_vocab=words.size, eos_token=list(words.eos_token_ids)
            )
        )
        return cls(lltok, words.size, words.eos_token_ids, **options)

    def build(self, kind: str, spec: str, lenient: bool) -> LLGuidanceGrammar:
        """Compile `spec`; GrammarError saying what to change if llguidance refuses it."""
        overlapping: dict[str, str] = {}  # the oneOfs whose branches may overlap, and why
        digits = None
        if kind == "json_schema":
            # the numbers' digits held by the mask, not by bounds in the grammar (~0.5 ms each)
            held = self._digit_limits.any
            schema, overlapping = self._prepared_schema(spec, lenient, bound=not held)
            if held:
                digits = self._number_digits(self._digit_limits.covering(schema))
            text = self._schema_grammar(schema, lenient)
        elif kind == "structural_tag":
            text = self._structural_tag_grammar(spec, lenient)
        else:
            text = self._grammar_text(kind, spec)
        matcher = self._matcher(text)
        unknown: set[str] = set()
        while kind == "json_schema" and matcher.is_error():
            # a format llguidance does not know asserts nothing (JSON Schema: formats are
            # annotations, and validators ignore unknown ones): compiled without it
            found = _UNKNOWN_FORMAT.search(matcher.get_error())
            if found is None or found.group(1) in unknown:
                break
            unknown.add(found.group(1))
            text = self._schema_grammar(schema, lenient, drop_formats=unknown)
            matcher = self._matcher(text)
        if not matcher.is_error():
            # The first mask builds the lexer states every request starts from (shared with the
            # copies each request gets): here, in the compile worker and within its timeout,
            # never in the engine's step (a long counted repetition takes seconds). A grammar
            # no token can start fails here too.
            matcher.compute_bitmask()
        if matcher.is_error() and kind == "structural_tag":
            self._refuse_structure(spec, lenient)  # (names the structure whose schema fails)
        if matcher.is_error():
            raise GrammarError(_refusal(kind, matcher.get_error(), spec, overlapping))
        notes = ()
        if lenient:
            notes = _located_notes(matcher.get_grammar_warnings(), spec, overlapping)
        return LLGuidanceGrammar(kind, spec, matcher, self, notes, lenient, digits)

    def _number_digits(self, limits: DigitLimits) -> NumberDigits:
        with self._digits_lock:
            digits = self._digits.get(limits)
            if digits is None:
                if self._token_table is None:
                    tok, size = self.tokenizer, self.vocab_size
                    own = min(tok.vocab_size, size)
                    self._token_table = TokenTable(
                        [
                            None if tok.is_special_token(i) else tok.decode_bytes([i])
                            for i in range(own)
                        ]
                        + [None] * (size - own)
                    )
                digits = self._digits[limits] = NumberDigits(self._token_table, limits)
            return digits

    def _matcher(self, text: str) -> Any:
        return self._ll.LLMatcher(self.tokenizer, text, log_level=0, limits=self._limits)

    def _schema_grammar(
        self, schema: Any, lenient: bool, drop_formats: set[str] | None = None
    ) -> str:
        if drop_formats:
            schema = map_subschemas(
                schema,
                lambda node, _: {
                    k: v for k, v in node.items() if k != "format" or v not in drop_formats
                },
            )
        options = self._json_options(lenient)
        if not isinstance(schema, dict):  # (llguidance says what is wrong with it)
            return self._ll.LLMatcher.grammar_from_json_schema(
                json.dumps(schema, ensure_ascii=False), defaults=options
            )
        # What grammar_from_json_schema(text, defaults=options) makes, written here: it reads
        # the text and writes the grammar out again, in Rust but holding the GIL, which the
        # matcher then reads once more. The schema's own x-guidance overrides the defaults, as
        # there; as text: a dict with an integer past 64 bits (a bound of 10**20) is refused.
        own = schema.get("x-guidance")
        schema = {**schema, "x-guidance": {**options, **own} if isinstance(own, dict) else options}
        return '{"grammars": [{"json_schema": ' + json.dumps(schema, ensure_ascii=False) + "}]}"

    def _structural_tag_grammar(self, spec: str, lenient: bool) -> str:
        """Free text in which each trigger opens a section: the rest of its `begin`, JSON held to
        its schema (prepared as a json_schema request's is), then its `end` (llguidance's
        StructTag: a trigger is a lazy lexeme, so the text runs until the trigger appears; one
        that is a special token of the tokenizer, that token). With `thinking` (see
        `structural_tag_thinking`), the thinking comes first, free, and the triggers open
        sections only after it."""
        from radixlm.protocol.sampling_params import structural_tag_parts

        try:
            structures, triggers = structural_tag_parts(spec)
        except ValueError as e:
            raise GrammarError(str(e)) from None
        thinking = structural_tag_thinking(spec)
        tags = []
        for i, item in enumerate(structures):
            try:
                schema, _ = self._prepared_schema(json.dumps(item["schema"]), lenient)
            except GrammarError as e:
                raise GrammarError(f"structural_tag.structures[{i}].schema: {e}") from None
            if isinstance(schema, bool):
                schema = {} if schema else {"not": {}}
            schema = {**schema, "x-guidance": self._json_options(lenient)}
            trigger = next(t for t in triggers if item["begin"].startswith(t))
            tags.append(
                self._ll.StructTag(
                    trigger=trigger, begin=item["begin"], grammar=schema, end=item["end"]
                )
            )
        special = {t: i for t in triggers if (i := self._special_token(t)) is not None}
        if thinking is None:
            return self._ll.LLMatcher.grammar_from_lark(_struct_tags(tags, special))
        return self._ll.LLMatcher.grammar_from_lark(
            _struct_tags_after_thinking(tags, thinking, special)
        )

    def _special_token(self, text: str) -> int | None:
        """The id of the special token `text` is, if it is one. (llguidance's StructTag takes a
        trigger written `<...>` for one; `<tool_call>` is one in Qwen's vocabulary, but text the
        model writes in several tokens in most others.)"""
        try:
            ids = self.tokenizer.tokenize_str(text, parse_special=True)
        except Exception:  # (a tokenizer that cannot parse special tokens out of text has none)
            return None
        return ids[0] if len(ids) == 1 and self.tokenizer.is_special_token(ids[0]) else None

    def _refuse_structure(self, spec: str, lenient: bool) -> None:
        """A structural tag llguidance refused: the first structure whose schema it refuses as a
        json_schema request, as that request's refusal, with where the structure sits."""
        from radixlm.protocol.sampling_params import structural_tag_parts

        for i, item in enumerate(structural_tag_parts(spec)[0]):
            try:
                self.build("json_schema", json.dumps(item["schema"]), lenient)
            except GrammarError as e:
                raise GrammarError(f"structural_tag.structures[{i}].schema: {e}") from None

    def _grammar_text(self, kind: str, spec: str) -> str:
        ll = self._ll.LLMatcher
        if kind == "regex":
            # \d, \w and \s mean their ASCII members, as in the DFA backend (llguidance's own
            # reading is Unicode's: a date regex wrote "🯸202-11-24"); `/` escaped for Lark
            return ll.grammar_from_lark(f"start: /{self._ll.regex_to_lark(spec, 'dws')}/\n")
        if kind == "choice":
            choices = json.loads(spec)
            alternatives = " | ".join(_lark_string(c) for c in choices)
            return ll.grammar_from_lark(f"start: {alternatives}\n")
        if kind == "ebnf":
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                lark = gbnf_to_lark(_plain_escapes(spec))
            except Exception as e:
                raise GrammarError(f"EBNF syntax error: {e}") from None
            return ll.grammar_from_lark(lark)
        raise GrammarError(f"unknown grammar kind {kind!r}")

    def _prepared_schema(
        self, spec: str, lenient: bool, bound: bool = True
    ) -> tuple[Any, dict[str, str]]:
        """The schema llguidance compiles, and the oneOfs left as they are (pointer -> why their
        branches may overlap). Unless `bound`, numbers get no bounds of the number limits (the
        mask holds their digits). Those a value is checked against are refused here, unless
        `lenient` (llguidance then generates them as anyOf, and says so): llguidance would
        otherwise judge them itself, on the objects this closed, which can make branches
        exclusive whose values still match two of the branches as written."""
        try:
            schema = json.loads(spec)
        except ValueError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("a JSON schema must be an object or a boolean")
        if _LONG_DIGITS.search(spec):
            _refuse_inexact_constants(schema)
        overlapping: dict[str, str] = {}
        fit = (_INTEGER_LIMIT, _NUMBER_LIMIT)
        numbers = self.numbers if bound else _UNLIMITED
        if isinstance(schema, dict):
            # (bounded numbers and strings with formats make costly lexemes: built once each)
            prepared = prepare_schema(schema, not self.allow_unlisted_properties, numbers, fit)
            if prepared is not None:  # (no oneOf, no dependencies: all in one or two passes)
                return prepared, overlapping
            narrowed = schema if self.allow_unlisted_properties else close_objects(schema)
            exclusivity = one_of_exclusivity(schema, None if narrowed is schema else narrowed)
            overlapping = {where: why for where, why in exclusivity.items() if why is not None}
            if overlapping and not lenient:
                reachable = reachable_subschemas(schema)
                refused = [
                    f"unsupported keyword 'oneOf' at {where}: {why}"
                    for where, why in overlapping.items()
                    if reachable is None or where in reachable
                ]
                if refused:
                    raise GrammarError(_cannot_enforce(refused[:1]))
            exclusive = [where for where, why in exclusivity.items() if why is None]
            schema = one_of_as_any_of(narrowed, exclusive)
            schema = share_leaves(bound_numbers(schema, numbers, fit=fit))
        return schema, overlapping

    def _json_options(self, lenient: bool) -> dict[str, Any]:
        options: dict[str, Any] = {"lenient": bool(lenient)}
        if self.whitespace == "compact":
            options.update(whitespace_flexible=False, item_separator=",", key_separator=":")
        elif self.whitespace == "flexible":
            # bounded, as in the DFA backend: llguidance's own is unbounded, and a small model
            # can then write newlines until max_new_tokens
            options.update(whitespace_flexible=True, whitespace_pattern=FLEXIBLE_WHITESPACE)
        else:
            options.update(whitespace_pattern=self.whitespace)
        return options


class LLGuidanceGrammar:
    """A compiled llguidance grammar: immutable, shared by its requests; `matcher()` makes each
    one's state (a copy of the compiled matcher, which costs microseconds)."""

    def __init__(
        self,
        kind: str,
        spec: str,
        matcher: Any,
        backend: LLGuidanceBackend,
        notes: tuple[str, ...] = (),
        lenient: bool = False,
        digits: NumberDigits | None = None,
    ) -> None:
        self.kind = kind
        self.digits = digits  # the numbers' digits, held by the mask (number_digits.py)
        self.spec = spec
        self.notes = notes
        self.lenient = lenient
        self.backend = backend
        self.vocab_size = backend.vocab_size
        self.eos_token_ids = backend.eos_token_ids
        self._template = matcher
        self._words = bitmask_words(self.vocab_size)
        eos_only = np.zeros(self._words, dtype=np.int32)
        for e in self.eos_token_ids:
            eos_only.view(np.uint32)[e >> 5] |= np.uint32(1 << (e & 31))
        self.eos_only_mask = eos_only
        self._check: OutputCheck | None = None  # built on the first check

    def matcher(self, max_rollback: int = 64) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self, self._template.deep_copy(), max_rollback)

    def validate_output(self, text: str) -> dict[str, Any]:
        """Check a finished output against the full JSON schema: {"valid", "error",
        "ignored_keywords"} (what lenient mode owes the caller)."""
        if self.kind != "json_schema":
            raise GrammarError(f"validate_output checks JSON-schema outputs, not {self.kind}")
        if self._check is None:
            self._check = OutputCheck(self.spec, self.notes)
        return self._check(text)


class LLGuidanceMatcher:
    """Where one request stands in its llguidance grammar, with the engine's matcher contract:
    a refused token returns False and changes nothing; EOS is accepted only where the grammar is
    complete, and ends it; `rollback` undoes accepted tokens (EOS included). Where the grammar's
    numbers have digit limits (`grammar.digits`), a token that writes too many is refused too
    and left out of the mask, unless the grammar allows nothing else."""

    def __init__(self, grammar: LLGuidanceGrammar, matcher: Any, max_rollback: int) -> None:
        self.grammar = grammar
        self._m = matcher
        self._eos = frozenset(grammar.eos_token_ids)
        self._terminated = False
        self._depth = 0  # tokens accepted that rollback can undo (EOS included)
        # a token accept_batch took for the next accept_token: in llguidance's state, not yet in
        # ours (any other use of the matcher first gives it back: _settle)
        self._ahead: int | None = None
        self._max_rollback = max_rollback
        # a batch mask fill running in another thread holds llguidance's matcher (begin_fill):
        # every call into it waits for that first (_idle), but for what `_snap` answers: (stopped,
        # accepting, failed, forced bytes) of llguidance's state as the fill began
        self._busy: Any = None
        self._snap: tuple[bool, bool, bool, bytes] | None = None
        self.version = 0  # bumped by every change of what the next mask is
        # where the output stands in its JSON (number_digits.py), and where it stood before each
        # token llguidance took (for rollback: all of them, an int a token, as the output's ids;
        # rollbacks one after another may reach further back than max_rollback from the end)
        self._digits = grammar.digits
        self._num = 0
        self._nums: list[int] = []
        # the digits' mask of `_num`, if it holds any
        self._keep: np.ndarray | None = None if self._digits is None else self._digits.keep(0)

    @property
    def max_rollback(self) -> int:
        return self._max_rollback

    @property
    def rollback_depth(self) -> int:
        return min(self._depth, self._max_rollback)

    def _idle(self) -> None:
        busy, self._busy = self._busy, None
        if busy is not None:
            busy.exception()  # (waits; a fill that failed is PendingFill.result's to redo)

    def _changed(self) -> None:
        self._snap = None
        self.version += 1

    def _settle(self) -> None:
        if self._ahead is not None:
            self._idle()
            self._ahead = None
            self._m.rollback(1)
            self._changed()

    def _state(self) -> tuple[bool, bool, bool, bytes] | None:
        """What `_snap` knows of llguidance's state, if it is still that state."""
        self._settle()
        return self._snap

    def is_terminated(self) -> bool:
        """EOS was accepted, or the grammar is complete and nothing but EOS may follow."""
        if self._terminated:
            return True
        snap = self._state()
        if snap is not None:
            return snap[0] and not snap[2]
        self._idle()
        # (llguidance's matcher also reads "stopped" once it has failed: that is no success)
        return self._m.is_stopped() and not self._m.is_error()

    def is_accepting(self) -> bool:
        if self._terminated:
            return True
        snap = self._state()
        if snap is not None:
            return snap[1] and not snap[2]
        self._idle()
        return self._m.is_accepting() and not self._m.is_error()

    def next_token_mask(self) -> np.ndarray:
        """The (W,) int32 mask of the next token."""
        self._settle()
        self._idle()
        if self._terminated:
            return self.grammar.eos_only_mask
        mask = np.zeros(self.grammar._words, dtype=np.int32)
        self._m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        if self._m.is_error():
            mask[:] = 0  # llguidance allows EOS once it fails: the output would look complete
        elif self._digits is not None:
            self.hold_digits(mask)
        return mask

    def hold_digits(self, row: np.ndarray) -> None:
        """Leave out of a filled mask row the tokens that write too many digits (no-op without
        digit limits)."""
        digits = self._digits
        if digits is not None:
            keep = self._keep
            if self._ahead is not None:
                keep = digits.keep(digits.after(self._num, self._ahead)[0])
            if keep is not None:
                hold(row, keep)

    def fill_next_token_bitmask(self, bitmask: torch.Tensor | np.ndarray, index: int = 0) -> None:
        """Write the allowed next tokens into `bitmask`: a (W,) row or row `index` of (B, W)."""
        self._settle()
        self._idle()
        row = bitmask[index] if bitmask.ndim == 2 else bitmask
        if row.shape[-1] != self.grammar._words:
            raise GrammarError(
                f"bitmask row has {row.shape[-1]} words, the grammar's vocabulary needs "
                f"{self.grammar._words}"
            )
        if isinstance(row, torch.Tensor) and (row.device.type != "cpu" or not row.is_contiguous()):
            row.copy_(torch.from_numpy(self.next_token_mask()))
            return
        if isinstance(row, np.ndarray) and not row.flags.c_contiguous:
            np.copyto(row, self.next_token_mask())
            return
        if self._terminated:
            np.copyto(
                row.numpy() if isinstance(row, torch.Tensor) else row, self.grammar.eos_only_mask
            )
            return
        ptr = row.data_ptr() if isinstance(row, torch.Tensor) else row.ctypes.data
        self._m.unsafe_compute_mask_ptr(ptr, self.grammar._words * 4)
        if self._m.is_error():  # as in next_token_mask
            (row.numpy() if isinstance(row, torch.Tensor) else row).fill(0)
        elif self._digits is not None:
            self.hold_digits(row.numpy() if isinstance(row, torch.Tensor) else row)

    def allowed_token_ids(self) -> list[int]:
        """The allowed next token ids (EOS included when accepting): for tests and debugging."""
        return ids_from_bitmask(self.next_token_mask(), self.grammar.vocab_size)

    def accept_token(self, token_id: int) -> bool:
        if self._terminated:
            return False
        token_id = int(token_id)
        if self._ahead is not None:  # taken already, with its step's others (accept_batch)
            if self._ahead == token_id:
                digits = self._digits
                if digits is None:
                    self._ahead = None
                    self._depth += 1
                    return True
                state, refused = digits.after(self._num, token_id)
                if not refused:
                    self._ahead = None
                    self._depth += 1
                    self._went(state)
                    return True
            self._settle()
        if token_id in self._eos:
            if not self.is_accepting():
                return False
            self._terminated = True
            self._depth += 1
            self._changed()
            return True
        if not 0 <= token_id < self.grammar.vocab_size:
            return False
        self._idle()
        digits = self._digits
        if digits is not None:
            state, refused = digits.after(self._num, token_id)
            if refused and not self._only_digits(token_id):
                return False
        if self._m.try_consume_tokens([token_id]) != 1:
            return False
        self._depth += 1
        if digits is not None:
            self._went(state)
        self._changed()
        return True

    def _went(self, state: int) -> None:
        """The digits' reader is at `state` after one more token llguidance took."""
        self._nums.append(self._num)
        self._num = state
        self._keep = self._digits.keep(state)

    def _only_digits(self, token_id: int) -> bool:
        """Whether `token_id`, which writes too many digits, is allowed all the same: the
        grammar allows it, and nothing the limits allow (a long constant)."""
        mask = np.zeros(self.grammar._words, dtype=np.int32)
        self._m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        keep = self._keep  # (the limits' mask where it stands)
        allowed = (int(mask[token_id >> 5]) >> (token_id & 31)) & 1
        return bool(allowed) and (keep is None or not (mask & keep).any())

    def accept_tokens(self, token_ids: list[int]) -> int:
        """Accept tokens in order until one is refused; returns how many were accepted."""
        for n, t in enumerate(token_ids):
            if not self.accept_token(t):
                return n
        return len(token_ids)

    def accept_string(self, text: str) -> bool:
        """Advance over `text` (tokenized by the grammar's tokenizer), all or nothing; False
        also where the vocabulary cannot spell `text`."""
        self._settle()
        self._idle()
        if self._terminated:
            return False
        tokenizer = self.grammar.backend.tokenizer
        data = text.encode("utf-8", "surrogatepass")
        ids = tokenizer.tokenize_str(text)
        if tokenizer.decode_bytes(ids) != data:
            return False
        if self._digits is not None and self._digits.after_bytes(self._num, data)[1]:
            return False  # (too many digits: a forced long constant is sampled instead)
        # checked first, then taken: undoing a partial advance could need more than max_rollback
        if self._m.validate_tokens(ids) != len(ids) or self._m.try_consume_tokens(ids) != len(ids):
            return False
        self._depth += len(ids)
        if self._digits is not None:
            for t in ids:
                self._went(self._digits.after(self._num, t)[0])
        self._changed()
        return True

    def jump_forward_string(self) -> str | None:
        """The text the grammar forces from here, cut at whole characters, or None."""
        if self._terminated:
            return None
        snap = self._state()
        if snap is not None:
            forced = snap[3]
        else:
            self._idle()
            forced = bytes(self._m.compute_ff_bytes()[:_MAX_JUMP_BYTES])
        if not forced:  # (most steps: nothing forced)
            return None
        for cut in range(len(forced), max(len(forced) - 4, -1), -1):
            try:
                text = forced[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
            return text or None
        return None

    def rollback(self, n: int) -> None:
        if n < 0 or n > self.rollback_depth:
            raise GrammarError(f"cannot roll back {n} tokens; {self.rollback_depth} can be undone")
        if n == 0:
            return
        self._settle()
        self._idle()
        self._changed()
        self._depth -= n
        if self._terminated:  # EOS is always the last token accepted, and never reached llguidance
            self._terminated = False
            n -= 1
        if n and not self._m.rollback(n):
            raise GrammarError(f"llguidance could not roll back {n} tokens: {self._m.get_error()}")
        if n and self._digits is not None:
            self._num = self._nums[-n]
            del self._nums[-n:]
            self._keep = self._digits.keep(self._num)

    def reset(self) -> None:
        self._idle()
        self._changed()
        self._ahead = None  # (undone with the rest)
        self._m.reset()
        self._terminated = False
        self._depth = 0
        self._num = 0
        self._nums.clear()
        self._keep = None if self._digits is None else self._digits.keep(0)


def accept_batch(pairs: list[tuple[LLGuidanceMatcher, int]], executor: Any) -> None:
    """Take each (matcher, token) in llguidance's threads at once, for the matcher's next
    `accept_token(token)` to return at once. EOS and matchers already done are left to it.
    (benchmarks/grammar_step.py, 77 requests: on an H200's 16-core host 0.30 ms a step, against
    0.47 for each `accept_token` taking its own; on the 2-core machine 0.29 against 0.21.)"""
    todo, calls = [], []
    for m, t in pairs:
        t = int(t)
        if m._terminated or m._ahead is not None or t in m._eos:
            continue
        if 0 <= t < m.grammar.vocab_size:
            m._idle()
            m._changed()
            todo.append((m, t))
            calls.append((m._m, t))
    if not todo:
        return
    taken = executor.consume_token_par(calls)
    for (m, t), ok in zip(todo, taken):
        if ok:  # (a refused token leaves the matcher failed: accept_token then refuses it too)
            m._ahead = t


def fill_bitmasks(matchers: list[tuple[Any, int]], bitmask: torch.Tensor, executor: Any) -> None:
    """Fill rows of a contiguous CPU (B, W) int32 bitmask for many llguidance matchers at once,
    in llguidance's own threads (without the GIL): [(LLGuidanceMatcher, row)]."""
    for m, _ in matchers:
        m._settle()
        m._idle()
    live = [(m._m, row) for m, row in matchers if not m._terminated]
    for m, row in matchers:
        if m._terminated:
            np.copyto(bitmask[row].numpy(), m.grammar.eos_only_mask)
    if live:
        batch, words = bitmask.shape
        executor.unsafe_compute_mask_ptr(live, bitmask.data_ptr(), words * 4, batch)
        rows = bitmask.numpy()
        for m, row in matchers:
            if m._terminated:
                continue
            if m._m.is_error():  # as in LLGuidanceMatcher.next_token_mask: nothing, not EOS
                rows[row] = 0
            elif m._digits is not None:
                m.hold_digits(rows[row])


class _ByteTokenizer:
    """A TokenVocabulary as llguidance's TokenizerWrapper reads a tokenizer: each token's bytes
    (b"" for one never allowed, which llguidance treats as special) and an encoder into the
    fewest tokens (greedy longest-first can miss a spelling: "abc" over {"ab", "a", "bc"})."""

    bos_token_id = None

    def __init__(self, vocab: TokenVocabulary) -> None:
        self.eos_token_id = vocab.eos_token_ids[0]
        self.tokens = [b or b"" for b in vocab.token_bytes]
        self.special_token_ids = [i for i, b in enumerate(self.tokens) if not b]
        self._ids: dict[bytes, int] = {}
        for i, b in enumerate(self.tokens):
            if b:
                self._ids.setdefault(b, i)
        self._longest = max((len(b) for b in self._ids), default=1)

    def __call__(self, data: bytes) -> list[int]:
        out: list[int] = []
        at = 0
        while at < len(data):
            end, tokens = self._spell(data, at)
            out += tokens
            at = end + 1  # data[end] is a byte no token spells (there): skipped
        return out

    def _spell(self, data: bytes, start: int) -> tuple[int, list[int]]:
        """The fewest tokens spelling the longest spellable stretch from `start`: (its end,
        tokens)."""
        # best[i]: (tokens, token id, where it starts) of the best spelling of data[start:i]
        best: dict[int, tuple[int, int, int]] = {start: (0, -1, -1)}
        for i in range(start, len(data)):
            if i not in best:
                continue
            for n in range(1, min(self._longest, len(data) - i) + 1):
                token = self._ids.get(data[i : i + n])
                if token is not None and best.get(i + n, (1 << 62,))[0] > best[i][0] + 1:
                    best[i + n] = (best[i][0] + 1, token, i)
        end = max(best)
        tokens, at = [], end
        while at != start:
            _, token, at = best[at]
            tokens.append(token)
        return end, tokens[::-1]


_WIDE_ESCAPE = re.compile(r"\\\\|\\u([0-9a-fA-F]{4})|\\U([0-9a-fA-F]{8})")


def _plain_escapes(ebnf: str) -> str:
    """`\\uXXXX` and `\\UXXXXXXXX` escapes in EBNF text as llguidance's converter reads them:
    it drops their leading zeros (`\\u00e9` became `\\ue9`, which its regexes refuse), so they
    are written as the character itself, or as `\\xHH` below 0x80 (where it may be special)."""

    def plain(m: re.Match[str]) -> str:
        digits = m.group(1) or m.group(2)
        if digits is None:  # an escaped backslash: kept, with what follows it
            return m.group(0)
        code = int(digits, 16)
        if code < 0x80:
            return f"\\x{code:02x}"
        if 0xD800 <= code < 0xE000 or code > 0x10FFFF:
            return m.group(0)  # not a character: left for the converter to refuse
        return chr(code)

    return _WIDE_ESCAPE.sub(plain, ebnf)


class PendingFill:
    """A batch of masks filling in another thread (begin_fill); `result()` waits for it, then
    fills again the rows of the matchers that changed meanwhile."""

    def __init__(self, future: Any, pairs: list, versions: list[int], bitmask: torch.Tensor):
        self._future, self._pairs, self._versions, self._bitmask = future, pairs, versions, bitmask

    def result(self) -> torch.Tensor:
        future = self._future
        failed = future.exception() is not None
        rows = self._bitmask.numpy()
        for (m, row), version in zip(self._pairs, self._versions):
            if m._busy is future:
                m._busy = None
            if failed or m.version != version or m._terminated:
                m.fill_next_token_bitmask(self._bitmask, row)
            elif m._m.is_error():  # as in LLGuidanceMatcher.next_token_mask: nothing, not EOS
                rows[row] = 0
            elif m._keep is not None or (m._ahead is not None and m._digits is not None):
                m.hold_digits(rows[row])
        return self._bitmask


def begin_fill(pairs: list[tuple[LLGuidanceMatcher, int]], bitmask: torch.Tensor) -> PendingFill:
    """Start filling rows of the contiguous CPU (B, W) int32 `bitmask` for [(matcher, row)] in a
    thread of the matchers' backend (llguidance's threads, without the GIL), from llguidance's
    state now (tokens taken ahead included). Until `result()`, the matchers answer what the
    engine asks of each token (accept it, complete?, forced text) from a snapshot taken here; a
    matcher changed meanwhile has its row filled again by `result()`."""
    backend = pairs[0][0].grammar.backend
    live, versions = [], []
    for m, row in pairs:
        m._idle()
        if not m._terminated:
            ll = m._m
            ff = bytes(ll.compute_ff_bytes()[:_MAX_JUMP_BYTES])
            m._snap = (ll.is_stopped(), ll.is_accepting(), ll.is_error(), ff)
            live.append((ll, row))
        versions.append(m.version)
    batch, words = bitmask.shape
    fill, started = backend.executor.unsafe_compute_mask_ptr, threading.Event()

    def fill_masks() -> None:
        started.set()
        fill(live, bitmask.data_ptr(), words * 4, batch)

    future = backend.fill_thread.submit(fill_masks)
    for m, _ in pairs:
        if not m._terminated:
            m._busy = future
    # The fill thread needs the GIL to enter llguidance (which then lets it go for the fill):
    # while this thread runs Python it would get it only when this thread blocks or after the
    # interpreter's switch interval (5 ms), so the "background" fill began when the step waited
    # for it (measured: 3.1 ms late behind 3 ms of Python). Waiting here until it has begun hands
    # the GIL over (back once llguidance lets go of it): 50-75 us on the 2-core machine, against
    # 100-160 us for time.sleep(0), which sleeps the kernel's timer slack (50 us) at least. Not
    # beyond the switch interval: a fill thread busy with an earlier fill, or gone (a forked
    # child), would otherwise hold this thread, and with it the engine, up.
    started.wait(sys.getswitchinterval())
    return PendingFill(future, pairs, versions, bitmask)


# llguidance's reading of a tokenizer, by (its JSON's digest, vocabulary size, EOS ids): immutable,
# so engines of one process with the same tokenizer share it (each reading costs ~0.6 s of CPU)
_READ_TOKENIZERS: OrderedDict[tuple[bytes, int, tuple[int, ...]], Any] = OrderedDict()
_READ_TOKENIZERS_LOCK = threading.Lock()
_READ_TOKENIZERS_KEPT = 4


def _read_tokenizer(text: str, size: int, eos: tuple[int, ...]) -> Any:
    import llguidance

    key = (hashlib.sha256(text.encode()).digest(), size, eos)
    with _READ_TOKENIZERS_LOCK:
        found = _READ_TOKENIZERS.get(key)
        if found is not None:
            _READ_TOKENIZERS.move_to_end(key)
            return found
    lltok = llguidance.LLTokenizer(text, n_vocab=size, eos_token=list(eos))
    with _READ_TOKENIZERS_LOCK:
        _READ_TOKENIZERS[key] = lltok
        while len(_READ_TOKENIZERS) > _READ_TOKENIZERS_KEPT:
            _READ_TOKENIZERS.popitem(last=False)
    return lltok


def _tokenizer_json(tokenizer: Any) -> str:
    """A fast tokenizer's Rust tokenizer as JSON (its added tokens included), as llguidance reads
    it: without padding or truncation. (llguidance.hf copies the tokenizer every time to switch
    those off, which costs more than the rest of its reading and holds the GIL; a copy is made
    here only where one is set.)"""
    backend = tokenizer.backend_tokenizer
    if backend.padding is not None or backend.truncation is not None:
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
    return backend.to_str()


def _unpanicked(read: Callable[[], Any]) -> Any:
    """`read()` (llguidance reading a tokenizer), with a panic of its Rust code (a BaseException,
    past `except Exception`: a token over 1024 bytes, say) as a GrammarError that says what to do."""
    try:
        return read()
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception:
        raise
    except BaseException as e:
        raise GrammarError(
            f"llguidance cannot read this tokenizer ({type(e).__name__}: {e}); "
            "use grammar_backend='outlines'"
        ) from None


def _refuse_inexact_constants(schema: Any) -> None:
    """GrammarError where a `const` or `enum` holds an integer past 2**53: llguidance reads it as
    a double and would force a different number (9007199254740993 written as ...992)."""

    def wide(value: Any) -> bool:
        if isinstance(value, dict):
            return any(wide(v) for v in value.values())
        if isinstance(value, list):
            return any(wide(v) for v in value)
        return isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**53

    def walk(node: Any, where: str, names: bool) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                here = f"{where}/{str(key).replace('~', '~0').replace('/', '~1')}"
                if not names and key in ("const", "enum"):
                    if wide(value):
                        raise GrammarError(
                            f"the JSON schema cannot be enforced exactly: keyword {key!r} at "
                            f"{here} holds an integer beyond 2**53, which llguidance reads as a "
                            "double (it would write another number); write it as a string"
                        )
                    continue
                walk(value, here, not names and key in NAMED_SUBSCHEMAS)
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{where}/{i}", False)

    walk(schema, "#", False)


def _lark_string(text: str) -> str:
    """`text` as a Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def structural_tag_thinking(spec: str) -> Thinking | None:
    """The thinking a structural tag lets come first (its `thinking`: `begin` and `end`, the
    markers around it, and `forced`, whether the output starts inside it without `begin`), or
    None. The server sets it for a reasoning model (`--reasoning-parser`); GrammarError saying
    what to fix where it is malformed."""
    try:
        tag = json.loads(spec)
    except ValueError:
        return None  # (not a structural tag: `structural_tag_parts` says why)
    thinking = tag.get("thinking") if isinstance(tag, dict) else None
    if thinking is None:
        return None
    if (
        not isinstance(thinking, dict)
        or not all(isinstance(thinking.get(k), str) and thinking[k] for k in ("begin", "end"))
        or not isinstance(thinking.get("forced", False), bool)
    ):
        raise GrammarError(
            "structural_tag.thinking must be an object with non-empty strings 'begin' and 'end' "
            "and a boolean 'forced'"
        )
    return Thinking(thinking["begin"], thinking["end"], thinking.get("forced", False))


@dataclasses.dataclass(frozen=True)
class Thinking:
    """A reasoning model's thinking, between `begin` and `end`; `forced`: the output starts
    inside it, `begin` written or not (else there is thinking only where the output opens with
    `begin`, after whitespace, as `ReasoningStream` reads it)."""

    begin: str
    end: str
    forced: bool


def _struct_tags(tags: list[Any], special: dict[str, int]) -> str:
    """The Lark grammar `StructTag.to_grammar(tags)` writes (sections opened by triggers in free
    text), a trigger a special token only where `special` has its id."""
    lark = ["%llguidance {}", f"start: ({_alternatives('tag', tags)})* tag_end"]
    lark += ["tag_end: TAG_TEXT", r"TAG_TEXT: /(.|\n)*/"]
    for i, tag in enumerate(tags):
        lark += _struct_tag_rules(f"tag_{i}", "TAG_TEXT", tag, special)
    return "\n".join(lark) + "\n"


def _struct_tags_after_thinking(
    tags: list[Any], thinking: Thinking, special: dict[str, int]
) -> str:
    """The Lark grammar of `StructTag.to_grammar(tags)` (sections opened by triggers in free
    text) after the thinking: up to its first `end`, a lazy lexeme, in which no trigger opens a
    section. Where the thinking is optional, an output that does not open with its `begin` is
    the tagged text at once: its first stretch of text may not start with `begin` (else a
    trigger inside the thinking would open a section of that reading)."""
    begin, end = _lark_string(thinking.begin), _lark_string(thinking.end)
    any_text = r"/(.|\n)*/"
    lark = ["%llguidance {}"]
    if thinking.forced:
        lark += ["start: thinking tags", f"thinking[lazy]: {any_text} {end}"]
    else:
        lark += [
            "start: thinking tags | bare",
            rf"thinking[lazy]: /\s*/ {begin} {any_text} {end}",
            f"bare: ({_alternatives('first', tags)}) tags | BARE_TEXT",
            rf"BARE_TEXT: {any_text} & ~(/\s*/ {begin} {any_text})",
        ]
    lark += [f"tags: ({_alternatives('tag', tags)})* tag_end", "tag_end: TAG_TEXT"]
    lark += [f"TAG_TEXT: {any_text}"]
    for i, tag in enumerate(tags):
        lark += _struct_tag_rules(f"tag_{i}", "TAG_TEXT", tag, special)
        if not thinking.forced:
            lark += _struct_tag_rules(f"first_{i}", "BARE_TEXT", tag, special)
    return "\n".join(lark) + "\n"


def _alternatives(prefix: str, tags: list[Any]) -> str:
    return " | ".join(f"{prefix}_{i}" for i in range(len(tags)))


def _struct_tag_rules(rule: str, text: str, tag: Any, special: dict[str, int]) -> list[str]:
    """The rules of one section, `text` before its trigger, as `StructTag.to_grammar` writes
    them: a trigger `special` has the id of is that special token, any other a lazy lexeme of
    its text."""
    rest = tag.begin[len(tag.trigger) :]
    body = " ".join(
        part
        for part in (
            _lark_string(rest) if rest else "",
            "%json " + json.dumps(tag.grammar),
            _lark_string(tag.end) if tag.end else "",
        )
        if part
    )
    if tag.trigger in special:
        return [f"{rule}: {text} <[{special[tag.trigger]}]> {body}"]
    return [f"{rule}_trig[lazy]: {text} {_lark_string(tag.trigger)}", f"{rule}: {rule}_trig {body}"]


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: (\[.*?\])")
_LARK_CONTEXT = re.compile(r"\n\s*\d+ \|.*", re.DOTALL)  # the Lark text we made: not the user's


def _refusal(kind: str, error: str, spec: str, overlapping: dict[str, str] | None = None) -> str:
    """llguidance's error as a message saying what to change in what the user wrote
    (`overlapping`: the oneOfs left as written, by pointer, and why)."""
    error = _LARK_CONTEXT.sub("", re.sub(r"^at \d+\(\d+\): ", "", error.strip()))
    error = error.replace("<non-verbose/>", "").strip()
    if kind == "regex" and "regex parse error:" in error:
        return "invalid regex: " + error.split("regex parse error:", 1)[1].strip()
    what = {"json_schema": "JSON schema", "ebnf": "EBNF grammar"}.get(kind, kind)
    if error.startswith("NoExtensionBias"):
        return f"the {what} allows no text this model's vocabulary can write"
    if kind == "json_schema":
        unsupported = _located(error, spec, overlapping=overlapping)
        if unsupported:
            return _cannot_enforce(unsupported)
    if "too many" in error or "limit" in error:
        error += "; simplify it (smaller repetition counts, fewer alternatives)"
    return f"the {what} cannot be enforced exactly: {error}"


def _cannot_enforce(unsupported: list[str]) -> str:
    return (
        f"the JSON schema cannot be enforced exactly: {'; '.join(unsupported)}; remove or "
        "rewrite it, or set json_schema_lenient to generate without it and have the output "
        "validated"
    )


def _located_notes(
    warnings: list[str], spec: str, overlapping: dict[str, str] | None = None
) -> tuple[str, ...]:
    """Lenient mode's warnings (what was not enforced) as the DFA backend's notes: one per
    keyword and place (llguidance counts repeats: `Unimplemented keys: ["not"] (2 times)`)."""
    notes: list[str] = []
    for warning in warnings:
        for note in _located(warning, spec, every=True, overlapping=overlapping) or [warning]:
            if note not in notes:
                notes.append(note)
    return tuple(notes)


def _located(
    error: str, spec: str, every: bool = False, overlapping: dict[str, str] | None = None
) -> list[str]:
    """`unsupported keyword 'K' at PATH` for each keyword llguidance names in `error` (its
    "Unimplemented keys: [...]", "Unknown format: F", or a oneOf it cannot enforce, the place
    one of `overlapping` with why): at the first place in the schema that has it, or (`every`)
    at each; [] if it names none."""
    if _ONE_OF.search(error) and overlapping:
        places = [
            f"unsupported keyword 'oneOf' at {where}: {why}" for where, why in overlapping.items()
        ]
        return places[: None if every else 1]
    found = _UNIMPLEMENTED.search(error)
    fmt = _UNKNOWN_FORMAT.search(error)
    if found is None and fmt is None:
        return []
    try:
        schema = json.loads(spec)
    except ValueError:
        schema = None
    named: list[tuple[str, Any, str]] = []  # (keyword, its value or None, what to add)
    if found is not None:
        try:
            keys = [str(k) for k in json.loads(found.group(1))]
        except ValueError:
            keys = re.findall(r'"([^"]*)"', found.group(1))
        named += [(key, None, "") for key in keys]
    if fmt is not None:
        name = fmt.group(1).strip("\"'")
        named.append(("format", name, f": unknown format '{name}'"))
    out = []
    for key, value, why in named:
        places = keyword_locations(schema, key, value) or ["#"]
        out += [
            f"unsupported keyword '{key}' at {where}{why}"
            for where in places[: None if every else 1]
        ]
    return out


def keyword_locations(schema: Any, keyword: str, value: Any = None) -> list[str]:
    """The JSON pointers of the (sub)schemas of `schema` that have `keyword` (with `value`, if
    given), in the order they are written: where to point a user at a keyword llguidance
    names without a place."""
    return [
        where
        for where, node in iter_subschemas(schema)
        if keyword in node and (value is None or node[keyword] == value)
    ]


__all__ = [
    "LLGuidanceBackend",
    "LLGuidanceGrammar",
    "LLGuidanceMatcher",
    "fill_bitmasks",
    "keyword_locations",
    "structural_tag_thinking",
]
