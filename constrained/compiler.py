"""GrammarCompiler: specs (regex, JSON schema, choices, EBNF) -> cached CompiledGrammars."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import heapq
import itertools
import json
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from radixlm.constrained import regex_text as rt
from radixlm.constrained.automaton import ByteAutomaton
from radixlm.constrained.dfa_process import (
    BuildStopped,
    Deadline,
    DfaBuilders,
    DfaRefused,
    TooManyStates,
)
from radixlm.constrained.ebnf import ebnf_to_regex
from radixlm.constrained.errors import GrammarError
from radixlm.constrained.grammar import CompiledGrammar, MaskCache
from radixlm.constrained.json_schema import JsonSchemaOptions, json_schema_regex
from radixlm.constrained.pattern import PatternError, translate_regex
from radixlm.constrained.schema_rewrite import NumberLimits, bound_numbers
from radixlm.constrained.vocab import TokenVocabulary

KINDS = ("regex", "json_schema", "choice", "ebnf", "structural_tag")
# "llguidance": llguidance's Earley parser (llguidance_backend.py), the default. "outlines": our
# own compiler of every grammar into one regex and a byte DFA (built by outlines-core), with
# token masks walked per state; recursion is unrolled to a fixed depth.
GRAMMAR_BACKENDS = ("llguidance", "outlines")
_Key = tuple[str, str, bool]
# The largest byte DFA a grammar may have. Of the MaskBench schemas the grammar benchmark compiles
# (measured on half of them), half have under 400 states and 99% under 50k; the largest has 300k
# (7 s to build). The cap leaves room above that and keeps the (256, states) int32 table that
# renumbering a DFA holds for a moment under 1 GB. A counted repetition after an open-ended one,
# `[ab]*a[ab]{n}`, needs 2**(n+1) states: n = 19 is refused once built (about 5 s), and n = 30,
# which would build for hours, is stopped at the deadline instead.
DEFAULT_MAX_STATES = 1_000_000


class _CompileStopped(GrammarError):
    """A build stopped before it finished (its deadline passed, the compiler closed): the request
    fails, but nothing is cached, since under less load the same grammar may compile."""


class GrammarCompiler:
    """Compiles grammars for one tokenizer; one per engine.

    tokenizer: a Hugging Face tokenizer (or a TokenVocabulary). vocab_size: the logits width,
    which may exceed the tokenizer (extra ids are never allowed). whitespace: "compact" or
    "flexible" JSON (or a regex for the whitespace between JSON tokens). compile_timeout: seconds
    from asking for a grammar to its compile failing with GrammarError; the "outlines" build stops
    then too (in its queue or its helper process, see dfa_process.py), so its worker is free for
    the next one; an llguidance build cannot be stopped once it runs (it finishes in its worker,
    and is cached). max_states ("outlines"): the most states a grammar's byte DFA may have; a
    larger one is refused with GrammarError (and cached as refused). lenient: the default of
    `compile`'s own `lenient` (JSON schemas skip the keywords we cannot enforce instead of being
    refused; outputs must then be checked, see `CompiledGrammar.validate_output`).
    ebnf_recursion_depth ("outlines"; llguidance parses recursion as written): recursive EBNF
    rules are unrolled this many levels (0: such grammars are refused).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int | None = None,
        *,
        whitespace: str = "compact",
        compile_timeout: float = 30.0,
        lenient: bool = False,
        max_ref_depth: int = 3,
        any_depth: int = 2,
        ebnf_recursion_depth: int = 0,
        allow_unlisted_properties: bool = False,
        eos_token_ids: Iterable[int] | None = None,
        cache_size: int = 128,
        mask_cache_bytes: int = 256 << 20,
        max_workers: int | None = None,
        max_states: int = DEFAULT_MAX_STATES,
        backend: str = "llguidance",
        numbers: NumberLimits | None = None,
    ) -> None:
        if backend not in GRAMMAR_BACKENDS:
            raise ValueError(
                f"grammar_backend={backend!r} is not known; use one of {', '.join(GRAMMAR_BACKENDS)}"
            )
        self.backend = backend
        self.numbers = numbers if numbers is not None else NumberLimits()
        self._tokenizer, self._vocab_size, self._eos_token_ids = (
            tokenizer,
            vocab_size,
            eos_token_ids,
        )
        self._vocab: TokenVocabulary | None = None
        self._ll: Any = None
        self.json_options = JsonSchemaOptions(
            whitespace=whitespace,
            lenient=lenient,
            max_ref_depth=max_ref_depth,
            any_depth=any_depth,
            allow_unlisted_properties=allow_unlisted_properties,
        )
        self.compile_timeout = compile_timeout
        if max_states < 1:
            raise ValueError("max_states must be >= 1")
        self.max_states = max_states
        if ebnf_recursion_depth < 0:
            raise ValueError("ebnf_recursion_depth must be >= 0")
        self.ebnf_recursion_depth = ebnf_recursion_depth
        self.masks = MaskCache(mask_cache_bytes)
        # keyed by (kind, spec text, lenient)
        self._cache: OrderedDict[_Key, Any] = OrderedDict()
        # the compiles running now, and when each stops waiting for its helper
        self._inflight: dict[_Key, tuple[Future, Deadline]] = {}
        self._cache_size = cache_size
        self._lock = threading.Lock()
        # compiles hold no GIL in llguidance: a thread for every other core (2 at the least)
        self._max_workers = max_workers or max(2, min(8, (os.cpu_count() or 2) // 2))
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = 0
        self._builders = DfaBuilders()
        # read the tokenizer now: a bad one fails here, not at a compile
        if backend == "outlines":
            _ = self.vocab
        else:
            self._llguidance()

    @property
    def vocab(self) -> TokenVocabulary:
        """The vocabulary as byte strings (built on first use: the "outlines" backend's, and
        the llguidance backend's for a tokenizer that is not a Hugging Face fast one)."""
        if self._vocab is None:
            tokenizer, vocab_size = self._tokenizer, self._vocab_size
            if isinstance(tokenizer, TokenVocabulary):
                self._vocab = tokenizer
                if vocab_size is not None and vocab_size != tokenizer.size:
                    self._vocab = TokenVocabulary(
                        tokenizer.token_bytes, tokenizer.eos_token_ids, vocab_size
                    )
            else:
                self._vocab = TokenVocabulary.from_tokenizer(
                    tokenizer, vocab_size, self._eos_token_ids
                )
        return self._vocab

    def _llguidance(self):
        if self._ll is None:
            from radixlm.constrained.llguidance_backend import LLGuidanceBackend

            self._ll = LLGuidanceBackend.for_tokenizer(
                self._tokenizer,
                self._vocab_size,
                self._eos_token_ids,
                whitespace=self.json_options.whitespace,
                allow_unlisted_properties=self.json_options.allow_unlisted_properties,
                numbers=self.numbers,
                vocab=lambda: self.vocab,
            )
        return self._ll

    @property
    def vocab_size(self) -> int:
        return self._ll.vocab_size if self._ll is not None else self.vocab.size

    # -- public API ----------------------------------------------------------------------------

    def compile(self, kind: str, spec: Any, *, lenient: bool | None = None) -> CompiledGrammar:
        """Compile (or fetch from the cache) a grammar; GrammarError with the reason otherwise.

        lenient (JSON schemas only; None: the compiler's default): keywords that cannot be
        enforced are left out of the automaton instead of refusing the schema; the grammar's
        `notes` name them and `validate_output` checks a finished output against the full schema.
        """
        future = self._future(kind, spec, lenient)
        try:
            return future.result(timeout=self.compile_timeout)
        except FutureTimeout:
            raise self._too_slow(kind) from None

    def compile_async(self, kind: str, spec: Any, *, lenient: bool | None = None) -> Future:
        """Like compile, in a worker thread: a Future of the CompiledGrammar (or GrammarError)."""
        try:
            inner = self._future(kind, spec, lenient)
        except GrammarError as e:
            failed: Future = Future()
            _fail(failed, e)
            return failed
        if inner.done():
            return inner
        outer: Future = Future()
        _TIMEOUTS.add(time.monotonic() + self.compile_timeout, outer, self._too_slow(kind))

        def relay(f: Future) -> None:
            exc = f.exception()
            if exc is not None:
                _fail(outer, exc)
            else:
                _succeed(outer, f.result())

        inner.add_done_callback(relay)
        return outer

    def compile_regex(self, regex: str) -> CompiledGrammar:
        return self.compile("regex", regex)

    def compile_json_schema(self, schema: Any) -> CompiledGrammar:
        return self.compile("json_schema", schema)

    def compile_choices(self, choices: Sequence[str]) -> CompiledGrammar:
        return self.compile("choice", list(choices))

    def clear_cache(self) -> None:
        """Forget every compiled grammar (the next request for each compiles it again); those in
        use keep working."""
        with self._lock:
            self._cache.clear()

    def close(self) -> None:
        """Stop compiling: queued compiles are dropped and those waiting on a helper process fail
        with GrammarError. A later compile starts over."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        builders, self._builders = self._builders, DfaBuilders()
        builders.close()

    def _executor(self) -> ThreadPoolExecutor:
        # A forked child inherits the pool object but not its threads, and the helper processes
        # belong to the parent: it starts its own of both.
        if self._pool is None or self._pool_pid != os.getpid():
            if self._pool_pid not in (0, os.getpid()):
                self._builders = DfaBuilders()
            self._pool = ThreadPoolExecutor(self._max_workers, thread_name_prefix="grammar-compile")
            self._pool_pid = os.getpid()
            self._inflight.clear()
        return self._pool

    def _too_slow(self, kind: str) -> GrammarError:
        return _CompileStopped(
            f"compiling the {kind} took longer than {self.compile_timeout:g} s; "
            + _what_to_simplify(kind, self.backend)
        )

    # -- internals -----------------------------------------------------------------------------

    def _future(self, kind: str, spec: Any, lenient: bool | None = None) -> Future:
        lenient = self.json_options.lenient if lenient is None else bool(lenient)
        key = (kind, _spec_key(kind, spec), lenient and kind == "json_schema")
        with self._lock:
            done = self._cache.get(key)
            if done is not None:
                self._cache.move_to_end(key)
                f: Future = Future()
                if isinstance(done, GrammarError):
                    # a fresh copy for each caller: raising the cached one again would add the
                    # caller's frames (and its request) to that one exception's traceback
                    _fail(f, copy.copy(done))
                else:
                    _succeed(f, done)
                return f
            patience = time.monotonic() + self.compile_timeout
            running = self._inflight.get(key)
            if running is not None and running[1].extend(patience):
                return running[0]  # the build now runs as long as its last caller waits
            deadline = Deadline(patience)
            f = self._executor().submit(self._build, kind, key[1], key[2], deadline)
            self._inflight[key] = (f, deadline)
        f.add_done_callback(lambda fut, key=key: self._store(key, fut))
        return f

    def _store(self, key: _Key, fut: Future) -> None:
        exc = fut.exception()
        value = fut.result() if exc is None else exc
        with self._lock:
            if self._inflight.get(key, (None,))[0] is fut:
                del self._inflight[key]
            if isinstance(exc, _CompileStopped) or (
                exc is not None and not isinstance(exc, GrammarError)
            ):
                return  # stopped builds and unexpected failures are not cached
            if isinstance(value, GrammarError):
                value = copy.copy(value)  # without the first caller's traceback
            self._cache[key] = value
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)

    def _build(self, kind: str, spec: str, lenient: bool, deadline: Deadline) -> Any:
        try:
            if deadline.remaining() <= 0:  # it waited in the queue past its callers' patience
                raise self._too_slow(kind)
            if self.backend == "llguidance":
                return self._llguidance().build(kind, spec, lenient)
            if kind == "structural_tag":  # free text with tagged sections: no single regex
                raise GrammarError(
                    "structural_tag needs the llguidance grammar backend "
                    "(grammar_backend='llguidance', the default)"
                )
            regex, notes = self.to_regex(kind, spec, lenient)
            sentinel, parse_error = True, ""
            if kind == "regex":
                try:
                    regex = translate_regex(regex)
                except PatternError as e:
                    sentinel, parse_error = False, str(e)  # outlines-core reads it as written
            return self._index(kind, spec, regex, notes, sentinel, deadline, parse_error, lenient)
        except GrammarError:
            raise
        except Exception as e:  # anything else is still this request's problem, never the engine's
            raise GrammarError(f"cannot compile the {kind}: {type(e).__name__}: {e}") from e

    def to_regex(
        self, kind: str, spec: str, lenient: bool | None = None
    ) -> tuple[str, tuple[str, ...]]:
        """The regex a spec compiles to, and notes on keywords skipped (lenient mode)."""
        if kind == "regex":
            return spec, ()
        if kind == "json_schema":
            options = self.json_options
            if lenient is not None and lenient != options.lenient:
                options = dataclasses.replace(options, lenient=lenient)
            try:
                schema = json.loads(spec)
            except ValueError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
            if isinstance(schema, dict):
                # (this backend refuses a fractional multipleOf: fraction digits stay free here)
                numbers = dataclasses.replace(self.numbers, fraction_digits=-1)
                schema = bound_numbers(schema, numbers)
            regex, notes = json_schema_regex(schema, options)
            return regex, tuple(notes)
        if kind == "choice":
            choices = json.loads(spec)
            if not all(rt.generable(c) for c in choices):
                raise GrammarError("choices may not contain lone surrogates or plane-16 characters")
            regex = rt.alt(rt.lit(c) for c in choices)
            if regex is None:
                raise GrammarError("choice needs at least one option")
            return regex, ()
        if kind == "ebnf":
            return ebnf_to_regex(spec, self.ebnf_recursion_depth), ()
        raise GrammarError(f"unknown grammar kind {kind!r}; expected one of {', '.join(KINDS)}")

    def _index(
        self,
        kind: str,
        spec: str,
        regex: str,
        notes: tuple[str, ...],
        sentinel: bool,
        deadline: Deadline,
        parse_error: str = "",
        lenient: bool = False,
    ) -> CompiledGrammar:
        """Build the byte automaton; token masks are built per state on first use.

        outlines-core 0.2.14 drops, from an accepting state, every transition that leads to a
        non-accepting one (`a(bc)?` never allows "b" after "a"). So the regex gets a sentinel
        character appended: no state of the user's language is accepting any more, and "EOS
        allowed" reads "the sentinel may follow". Regexes we cannot re-read in our dialect go in
        unchanged (a narrower language, still sound).

        The DFA is built in a helper process, which is killed if the deadline passes first, and
        refused past `max_states` states.
        """
        if sentinel:
            regex = f"(?:{regex}){rt.escape_char(ord(rt.SENTINEL))}"
        try:
            dfa = self._builders.build(regex, self.max_states, deadline)
        except BuildStopped as e:
            if deadline.remaining() <= 0:
                raise self._too_slow(kind) from None
            raise _CompileStopped(f"compiling the {kind} stopped: {e}") from None
        except TooManyStates:
            raise GrammarError(self._too_many_states(kind)) from None
        except DfaRefused as e:
            if kind == "regex":  # a user's regex: most likely its syntax
                raise GrammarError(f"invalid regex: {parse_error or e}") from None
            raise GrammarError(
                f"the regex built from the {kind} is too large for the automaton builder "
                f"({e}); simplify it"
            ) from None
        automaton = ByteAutomaton(dfa, sentinel)
        automaton.node_classes(self.vocab.trie)  # ready before the first mask
        return CompiledGrammar(
            kind, spec, regex, automaton, self.vocab, self.masks, notes, lenient=lenient
        )

    def _too_many_states(self, kind: str) -> str:
        what = "the regex" if kind == "regex" else f"the regex built from the {kind}"
        limit = f"more than {self.max_states:,} automaton states"
        return f"{what} needs {limit}; {_what_to_simplify(kind)}"


def _what_to_simplify(kind: str, backend: str = "outlines") -> str:
    if kind == "regex" and backend == "llguidance":
        return "bound its repetitions by smaller counts (a{100000} is slow to compile)"
    if kind == "regex":
        return (
            "bound its repetitions (each count of a repetition after an open-ended one, "
            "like [ab]*a[ab]{30}, doubles the automaton)"
        )
    return "simplify it (fewer alternatives, smaller length and item bounds, simpler patterns)"


def _spec_key(kind: str, spec: Any) -> str:
    if kind not in KINDS:
        raise GrammarError(f"unknown grammar kind {kind!r}; expected one of {', '.join(KINDS)}")
    if kind in ("json_schema", "structural_tag") and not isinstance(spec, str):
        return json.dumps(spec, ensure_ascii=False)
    if kind == "choice":
        items = json.loads(spec) if isinstance(spec, str) else list(spec)
        if not items or not all(isinstance(c, str) for c in items):
            raise GrammarError("choice needs a non-empty list of strings")
        return json.dumps(items, ensure_ascii=False)
    if not isinstance(spec, str):
        raise GrammarError(f"a {kind} grammar must be given as a string")
    return spec


class _Timeouts:
    """Futures failed with their error once their time passes (unless done before): one thread
    for all of them, started on first use. (A timer thread per compile cost its caller a wait
    for the GIL at each start: with the compile threads holding it, 96 compiles took 0.2 s only
    to submit.)"""

    def __init__(self) -> None:
        self._due: list[tuple[float, int, Future, BaseException]] = []  # a heap
        self._purge_at = 256  # its size when the done futures are next dropped
        self._count = itertools.count()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    def add(self, at: float, f: Future, error: BaseException) -> None:
        """Fail `f` with `error` at time.monotonic() `at`, if it is not done by then."""
        with self._wake:
            if len(self._due) >= self._purge_at:  # (the done would hold results until due)
                self._due = [entry for entry in self._due if not entry[2].done()]
                heapq.heapify(self._due)
                self._purge_at = max(256, 2 * len(self._due))  # (a scan per doubling)
            heapq.heappush(self._due, (at, next(self._count), f, error))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="grammar-timeouts", daemon=True
                )
                self._thread.start()
            elif self._due[0][2] is f:  # (the earliest now: the thread sleeps too long)
                self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while self._due and self._due[0][2].done():  # (done in time: forgotten)
                    heapq.heappop(self._due)
                if not self._due:
                    self._wake.wait(timeout=5.0)  # (and looks again: futures end meanwhile)
                    continue
                at, _, f, error = self._due[0]
                left = at - time.monotonic()
                if left > 0:
                    self._wake.wait(timeout=min(left, 5.0))
                    continue
                heapq.heappop(self._due)
            _fail(f, error)


_TIMEOUTS = _Timeouts()


def _fail(f: Future, exc: BaseException) -> None:
    if not f.done():
        with contextlib.suppress(Exception):
            f.set_exception(exc)


def _succeed(f: Future, value: Any) -> None:
    if not f.done():
        with contextlib.suppress(Exception):
            f.set_result(value)


__all__ = ["DEFAULT_MAX_STATES", "KINDS", "GrammarCompiler"]
