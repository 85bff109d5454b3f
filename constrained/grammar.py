"""A compiled grammar (a byte automaton with token masks built per state on first use) and the
per-request matcher that walks it."""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from radixlm.constrained.automaton import ByteAutomaton
from radixlm.constrained.bitmask import bitmask_words, ids_from_bitmask
from radixlm.constrained.errors import GrammarError
from radixlm.constrained.json_schema import OutputCheck
from radixlm.constrained.vocab import TokenVocabulary

_MAX_JUMP_BYTES = 4096


class MaskCache:
    """Allowed-token bitmasks per (grammar, automaton state), least recently used out first.

    Bounded by bytes and shared by the grammars of one compiler, so a long-lived engine holds a
    fixed amount of mask memory however many schemas it has seen.
    """

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.hits = 0
        self.misses = 0

    def new_owner(self) -> int:
        return next(self._ids)

    def get(self, key: tuple[int, int]) -> np.ndarray | None:
        with self._lock:
            mask = self._entries.get(key)
            if mask is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return mask

    def put(self, key: tuple[int, int], mask: np.ndarray) -> None:
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = mask
            self._bytes += mask.nbytes
            while self._bytes > self.max_bytes and len(self._entries) > 1:
                _, old = self._entries.popitem(last=False)
                self._bytes -= old.nbytes


class CompiledGrammar:
    """A regex compiled into a byte-level automaton whose token masks are built on first use.
    Immutable as far as callers can tell, shareable between requests and threads; `matcher()`
    makes the per-request state."""

    def __init__(
        self,
        kind: str,
        spec: str,
        regex: str,
        automaton: ByteAutomaton,
        vocab: TokenVocabulary,
        masks: MaskCache,
        notes: tuple[str, ...] = (),
        lenient: bool = False,
    ) -> None:
        self.kind = kind
        self.spec = spec
        self.regex = regex
        self.automaton = automaton
        self.vocab = vocab
        self.notes = notes  # keywords skipped in lenient mode: the output must be validated
        self.lenient = lenient  # a JSON schema compiled leniently: see validate_output
        self._check: OutputCheck | None = None  # built on the first check
        self._masks = masks
        self._owner = masks.new_owner()
        self._words = bitmask_words(vocab.size)
        self._forced: dict[int, tuple[int, int] | None] = {}
        self._dead_end: dict[int, bool] = {}
        eos_only = np.zeros(self._words, dtype=np.int32)
        _set_bits(eos_only, vocab.eos_token_ids, True)
        self.eos_only_mask = eos_only

    @property
    def initial_state(self) -> int:
        return self.automaton.initial

    def validate_output(self, text: str) -> dict[str, Any]:
        """Check a finished output against the full JSON schema (what lenient mode owes the
        caller): {"valid", "error" (None or what is wrong), "ignored_keywords" (not enforced)}."""
        if self.kind != "json_schema":
            raise GrammarError(f"validate_output checks JSON-schema outputs, not {self.kind}")
        if not self.notes and self._matches(text):  # the automaton enforced the whole schema
            return {"valid": True, "error": None, "ignored_keywords": []}
        if self._check is None:
            self._check = OutputCheck(self.spec, self.notes)
        return self._check(text)

    def _matches(self, text: str) -> bool:
        """Whether `text` is a whole match of the grammar (an output cut short is not)."""
        state = self.automaton.walk(self.initial_state, text.encode("utf-8", "surrogatepass"))
        return state != self.automaton.dead and self.is_final(state)

    def matcher(self, max_rollback: int = 64) -> GrammarMatcher:
        """A fresh per-request matcher at the start of the grammar."""
        return GrammarMatcher(self, max_rollback=max_rollback)

    def is_final(self, state: int) -> bool:
        """Whether the text so far is a complete match (EOS allowed)."""
        return bool(self.automaton.accepting[state])

    def next_state(self, state: int, token_id: int) -> int | None:
        """The state after `token_id`, or None if the grammar forbids it here."""
        data = self.vocab.token_bytes[token_id] if 0 <= token_id < self.vocab.size else None
        if data is None or 0xF4 in data:  # never allowed: see TokenTrie
            return None
        nxt = self.automaton.walk(state, data)
        return None if nxt == self.automaton.dead else nxt

    def state_mask(self, state: int) -> np.ndarray:
        """The (W,) int32 mask of `state`, built on the state's first visit."""
        key = (self._owner, state)
        mask = self._masks.get(key)
        if mask is None:
            allowed = self.automaton.allowed_tokens(self.vocab.trie, state)  # (size,) bool
            allowed[list(self.vocab.eos_token_ids)] = self.is_final(state)  # EOS is ours
            flags = np.zeros(self._words * 32, dtype=bool)
            flags[: allowed.shape[0]] = allowed
            mask = np.packbits(flags, bitorder="little").view(np.int32)
            self._masks.put(key, mask)
        return mask

    def allowed_tokens(self, state: int) -> list[int]:
        """Allowed non-EOS token ids at `state`."""
        eos = set(self.vocab.eos_token_ids)
        return [
            t for t in ids_from_bitmask(self.state_mask(state), self.vocab.size) if t not in eos
        ]

    def is_dead_end(self, state: int) -> bool:
        """A final state from which no token but EOS can follow."""
        out = self._dead_end.get(state)
        if out is None:
            out = self._dead_end[state] = self.is_final(state) and not self.allowed_tokens(state)
        return out

    def forced_byte(self, state: int) -> tuple[int, int] | None:
        """(byte, next state) when every continuation from `state` starts with that byte."""
        if state in self._forced:
            return self._forced[state]
        out = None
        if not self.is_final(state):
            live = self.automaton.live_bytes(state)
            if live.size == 1:
                b = int(live[0])
                out = (b, self.automaton.step(state, b))
        self._forced[state] = out
        return out


def _set_bits(mask: np.ndarray, ids: tuple[int, ...], value: bool) -> None:
    words = mask.view(np.uint32)
    for i in ids:
        bit = np.uint32(1 << (i & 31))
        if value:
            words[i >> 5] |= bit
        else:
            words[i >> 5] &= ~bit


class GrammarMatcher:
    """Where one request stands in its grammar.

    fill_next_token_bitmask -> sample -> accept_token, repeated; jump_forward_string gives the
    text the grammar forces next, accept_string advances over it; rollback undoes accepted
    tokens (speculative decoding). Nothing here raises on a bad token: it is refused with False.
    """

    def __init__(self, grammar: CompiledGrammar, max_rollback: int = 64) -> None:
        self.grammar = grammar
        self._state = grammar.initial_state
        self._eos = frozenset(grammar.vocab.eos_token_ids)
        self._terminated = False
        self._history: list[int] = []  # the state before each accepted item (EOS included)
        self._max_history = max_rollback

    @property
    def state(self) -> int:
        return self._state

    @property
    def max_rollback(self) -> int:
        """The most accepted tokens `rollback` can ever undo at once."""
        return self._max_history

    @property
    def rollback_depth(self) -> int:
        """How many of the tokens accepted so far `rollback` can undo now."""
        return len(self._history)

    def is_terminated(self) -> bool:
        """EOS was accepted, or the grammar is complete and nothing but EOS may follow."""
        return self._terminated or self.grammar.is_dead_end(self._state)

    def is_accepting(self) -> bool:
        """The text so far is a complete match: EOS is allowed now."""
        return self._terminated or self.grammar.is_final(self._state)

    def next_token_mask(self) -> np.ndarray:
        """The (W,) int32 mask of the next token (shared: do not modify)."""
        if self._terminated:
            return self.grammar.eos_only_mask
        return self.grammar.state_mask(self._state)

    def fill_next_token_bitmask(self, bitmask: torch.Tensor | np.ndarray, index: int = 0) -> None:
        """Write the allowed next tokens into `bitmask`: a (W,) row or row `index` of (B, W)."""
        row = bitmask[index] if bitmask.ndim == 2 else bitmask
        mask = self.next_token_mask()
        if row.shape[-1] != mask.shape[0]:
            raise GrammarError(
                f"bitmask row has {row.shape[-1]} words, the grammar's vocabulary needs {mask.shape[0]}"
            )
        if isinstance(row, np.ndarray):
            np.copyto(row, mask)
        elif row.device.type == "cpu":
            np.copyto(row.numpy(), mask)
        else:
            row.copy_(torch.from_numpy(mask), non_blocking=False)

    def allowed_token_ids(self) -> list[int]:
        """The allowed next token ids (EOS included when accepting): for tests and debugging."""
        return ids_from_bitmask(self.next_token_mask(), self.grammar.vocab.size)

    def accept_token(self, token_id: int) -> bool:
        """Advance over one sampled token; False (state unchanged) if the grammar forbids it."""
        if self._terminated:
            return False
        token_id = int(token_id)
        if token_id in self._eos:
            if not self.grammar.is_final(self._state):
                return False
            self._push()
            self._terminated = True
            return True
        nxt = self.grammar.next_state(self._state, token_id)
        if nxt is None:
            return False
        self._push()
        self._state = nxt
        return True

    def accept_tokens(self, token_ids: list[int]) -> int:
        """Accept tokens in order until one is refused; returns how many were accepted."""
        for n, t in enumerate(token_ids):
            if not self.accept_token(t):
                return n
        return len(token_ids)

    def accept_string(self, text: str) -> bool:
        """Advance over `text` (e.g. a jump-forward string), all or nothing."""
        if self._terminated:
            return False
        data = text.encode("utf-8")
        if not data:
            return True
        automaton = self.grammar.automaton
        nxt = automaton.walk(self._state, data)
        if nxt == automaton.dead:
            return False
        self._push()
        self._state = nxt
        return True

    def jump_forward_string(self) -> str | None:
        """The text the grammar forces from here (only what every continuation starts with),
        or None. Stops before a state where EOS is allowed, and at whole characters."""
        if self._terminated:
            return None
        out = bytearray()
        state = self._state
        while len(out) < _MAX_JUMP_BYTES:
            step = self.grammar.forced_byte(state)
            if step is None:
                break
            out.append(step[0])
            state = step[1]
        for cut in range(len(out), max(len(out) - 4, -1), -1):
            try:
                text = bytes(out[:cut]).decode("utf-8")
            except UnicodeDecodeError:
                continue
            return text or None
        return None

    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens (or accepted strings)."""
        if n < 0 or n > len(self._history):
            raise GrammarError(f"cannot roll back {n} tokens; {len(self._history)} can be undone")
        if n == 0:
            return
        self._state = self._history[-n]
        del self._history[-n:]
        self._terminated = False  # EOS is always the last item accepted

    def reset(self) -> None:
        self._state = self.grammar.initial_state
        self._terminated = False
        self._history.clear()

    def _push(self) -> None:
        self._history.append(self._state)
        if len(self._history) > self._max_history:
            del self._history[0]
