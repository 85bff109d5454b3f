"""A compiled grammar (a token-level automaton) and the per-request matcher that walks it."""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from radixlm.constrained.bitmask import bitmask_words, ids_from_bitmask
from radixlm.constrained.errors import GrammarError
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
    """A regex compiled against a vocabulary into an outlines-core Index. Immutable, shareable
    between requests and threads; `matcher()` makes the per-request state."""

    def __init__(
        self,
        kind: str,
        spec: str,
        regex: str,
        index: Any,
        vocab: TokenVocabulary,
        masks: MaskCache,
        notes: tuple[str, ...] = (),
        sentinel: bool = True,
    ) -> None:
        self.kind = kind
        self.spec = spec
        self.regex = regex
        self.index = index
        self.vocab = vocab
        self.notes = notes  # keywords skipped in lenient mode: the output must be validated
        self._masks = masks
        self._owner = masks.new_owner()
        self._words = bitmask_words(vocab.size)
        # With the sentinel (see compiler.py) a state accepts iff the sentinel token may follow;
        # without it, outlines-core's own final states.
        self._sentinel = vocab.sentinel_id if sentinel else None
        self._final_states = frozenset(index.get_final_states())
        self._accepting: dict[int, bool] = {}
        self._forced: dict[int, tuple[int, int] | None] = {}
        self._dead_end: dict[int, bool] = {}
        eos_only = np.zeros(self._words, dtype=np.int32)
        _set_bits(eos_only, vocab.eos_token_ids, True)
        self.eos_only_mask = eos_only

    @property
    def initial_state(self) -> int:
        return self.index.get_initial_state()

    def matcher(self, max_rollback: int = 64) -> GrammarMatcher:
        """A fresh per-request matcher at the start of the grammar."""
        return GrammarMatcher(self, max_rollback=max_rollback)

    def is_final(self, state: int) -> bool:
        """Whether the text so far is a complete match (EOS allowed)."""
        if self._sentinel is None:
            return state in self._final_states
        out = self._accepting.get(state)
        if out is None:
            out = self._accepting[state] = (
                self.index.get_next_state(state, self._sentinel) is not None
            )
        return out

    def state_mask(self, state: int, guide: Any) -> np.ndarray:
        """The (W,) int32 mask of `state`; `guide` must stand at `state` (used on a cache miss)."""
        key = (self._owner, state)
        mask = self._masks.get(key)
        if mask is None:
            scratch = np.zeros(self.vocab.outlines_words, dtype=np.int32)
            guide.write_mask_into(scratch.__array_interface__["data"][0], scratch.shape[0], 4)
            mask = scratch[: self._words].copy()
            tail = self.vocab.size % 32
            if tail:  # ids past the logits (the sentinel among them) are never sampled
                mask.view(np.uint32)[-1] &= np.uint32((1 << tail) - 1)
            _set_bits(mask, self.vocab.eos_token_ids, False)  # EOS is ours to decide
            if self.is_final(state):
                _set_bits(mask, self.vocab.eos_token_ids, True)
            self._masks.put(key, mask)
        return mask

    def allowed_tokens(self, state: int) -> list[int]:
        """Allowed non-EOS token ids at `state` (the plain path: outlines' own list)."""
        skip = {*self.vocab.eos_token_ids, self.vocab.sentinel_id}
        return [t for t in self.index.get_allowed_tokens(state) if t not in skip]

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
            allowed = self.allowed_tokens(state)
            if allowed:
                firsts = np.unique(self.vocab.first_byte[np.asarray(allowed)])
                if firsts.size == 1 and firsts[0] >= 0:
                    b = int(firsts[0])
                    tok = self.vocab.token_of_bytes.get(bytes([b]))
                    nxt = None if tok is None else self.index.get_next_state(state, tok)
                    if nxt is not None:
                        out = (b, nxt)
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
        from outlines_core import Guide

        self.grammar = grammar
        self._guide = Guide(grammar.index, max_rollback=max(max_rollback, _MAX_JUMP_BYTES))
        self._eos = frozenset(grammar.vocab.eos_token_ids)
        self._terminated = False
        self._history: list[int] = []  # guide steps per accepted item (0: EOS)
        self._max_history = max_rollback

    @property
    def state(self) -> int:
        return self._guide.get_state()

    def is_terminated(self) -> bool:
        """EOS was accepted, or the grammar is complete and nothing but EOS may follow."""
        return self._terminated or self.grammar.is_dead_end(self.state)

    def is_accepting(self) -> bool:
        """The text so far is a complete match: EOS is allowed now."""
        return self._terminated or self.grammar.is_final(self.state)

    def next_token_mask(self) -> np.ndarray:
        """The (W,) int32 mask of the next token (shared: do not modify)."""
        if self._terminated:
            return self.grammar.eos_only_mask
        return self.grammar.state_mask(self.state, self._guide)

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
            if not self.grammar.is_final(self.state):
                return False
            self._terminated = True
            self._push(0)
            return True
        try:
            self._guide.advance(token_id, return_tokens=False)
        except (ValueError, OverflowError, TypeError):
            return False
        self._push(1)
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
        steps = self._walk_bytes(data)
        if steps is None:
            return False
        if steps:
            self._push(steps)
        return True

    def _walk_bytes(self, data: bytes) -> int | None:
        table = self.grammar.vocab.token_of_bytes
        longest = self.grammar.vocab.max_token_len
        steps = 0
        i = 0
        while i < len(data):
            advanced = False
            # single bytes first (always a valid path when the vocabulary has them), then longer
            for n in [1, *range(min(longest, len(data) - i), 1, -1)]:
                tok = table.get(data[i : i + n])
                if tok is None:
                    continue
                try:
                    self._guide.advance(tok, return_tokens=False)
                except ValueError:
                    continue
                steps += 1
                i += n
                advanced = True
                break
            if not advanced:
                if steps:
                    self._guide.rollback_state(steps)
                return None
        return steps

    def jump_forward_string(self) -> str | None:
        """The text the grammar forces from here (only what every continuation starts with),
        or None. Stops before a state where EOS is allowed, and at whole characters."""
        if self._terminated:
            return None
        out = bytearray()
        state = self.state
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
        steps = 0
        for _ in range(n):
            s = self._history.pop()
            if s == 0:
                self._terminated = False
            steps += s
        if steps:
            self._guide.rollback_state(steps)

    def reset(self) -> None:
        self._guide.reset()
        self._terminated = False
        self._history.clear()

    def _push(self, steps: int) -> None:
        self._history.append(steps)
        if len(self._history) > self._max_history:
            del self._history[0]
