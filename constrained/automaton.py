"""The byte-level automaton of a regex, and the token masks it induces, built lazily.

Compiling a grammar builds only the byte-level DFA of its regex: outlines-core's `Index` over a
vocabulary of the 256 single bytes (built in a helper process, see dfa_process.py), which costs
about what building the DFA costs; `ByteAutomaton` renumbers it into a dense table. The token-level
view (which tokens may follow in a state) is computed the first time a state is visited, by walking
the whole vocabulary through the DFA at once: the vocabulary is a trie laid out level by level
(`vocab.TokenTrie`), so a prefix shared by many tokens is walked once, and each level is one vectorized
gather in the DFA's transition table. A token is allowed iff its walk ends in a live state, which
is exactly what outlines-core's token `Index` precomputes for every state up front (its `Index`
over the real vocabulary is the oracle the tests compare against).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable

import numpy as np

from radixlm.constrained.dfa_process import RawDfa
from radixlm.constrained.vocab import SENTINEL_BYTES, TokenTrie

# Cost model of one walk over the trie (measured on a 2-core x86 CPU, SmolLM2's 49k tokens):
# about this many nodes cost what one more level of numpy calls costs. Live first bytes are
# walked in runs; two runs merge when the dead subtries between them are cheaper to walk than a
# second walk's per-level overhead.
_NODES_PER_LEVEL_OVERHEAD = 700
# Walks over more nodes than this write every level into one buffer over the whole trie and read
# all token ends in one gather at the end (a fixed cost that pays off on large walks).
_BUFFERED_WALK_NODES = 8000


def _int64(values: array) -> np.ndarray:
    return np.frombuffer(values, dtype=np.uintc).astype(np.int64)


def _renumbering(original: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """outlines-core's state ids (sparse) -> 0..n-1 in the order given."""
    n = len(original)
    if n and int(original.min()) >= 0 and int(original.max()) < 64 * n + 1024:
        lookup = np.full(int(original.max()) + 1, -1, dtype=np.int64)
        lookup[original] = np.arange(n)
        return lambda ids: lookup[ids]
    order = np.argsort(original)
    ranks = order.astype(np.int64)
    ordered = original[order]
    return lambda ids: ranks[np.searchsorted(ordered, ids)]


class ByteAutomaton:
    """A DFA over bytes: states 0..n-1, `dead` (= n) the sink every forbidden byte leads to.

    `offsets` is the flat (n + 1) x C transition table over byte classes (bytes that no
    transition tells apart share a class), holding `next state * C` so that a walk needs no
    multiply; `accepting[s]`: the text so far is a complete match.
    """

    def __init__(self, dfa: RawDfa, sentinel: bool) -> None:
        original = _int64(dfa.states)
        n = len(original)
        self.n_states = n
        self.dead = n
        renumber = _renumbering(original)
        counts = _int64(dfa.counts)
        src = np.repeat(np.arange(n, dtype=np.int64), counts)
        keys, dsts = _int64(dfa.keys), _int64(dfa.targets)
        is_byte = keys < 256  # the EOS pseudo-token of final states is not a byte
        dense = np.full((256, n + 1), n, dtype=np.int32)  # (byte, state)
        dense[keys[is_byte], src[is_byte]] = renumber(dsts[is_byte])
        # byte classes: bytes whose columns are identical behave alike in every state
        class_of: dict[bytes, int] = {}
        byte_class = np.empty(256, dtype=np.int64)
        for b in range(256):
            byte_class[b] = class_of.setdefault(dense[b].tobytes(), len(class_of))
        firsts = np.unique(byte_class, return_index=True)[1]
        self.byte_class = byte_class
        self.n_classes = len(class_of)
        table = np.ascontiguousarray(dense[firsts].T).reshape(-1)  # (state, class) flat
        self.initial = int(renumber(np.asarray([dfa.initial]))[0])
        if sentinel:
            # the end-of-match sentinel may follow exactly where the user's text is complete
            state = np.arange(n + 1, dtype=np.int64)
            for b in SENTINEL_BYTES:
                state = table[state * self.n_classes + self.byte_class[b]].astype(np.int64)
            accepting = np.isin(state, renumber(_int64(dfa.finals)))
        else:
            accepting = np.zeros(n + 1, dtype=bool)
            accepting[renumber(_int64(dfa.finals))] = True
        accepting[n] = False
        self.accepting = accepting
        wide = (n + 1) * self.n_classes >= 2**31
        self.offsets = table.astype(np.int64 if wide else np.int32) * self.n_classes
        self.dead_offset = n * self.n_classes
        self._first_bytes: dict[int, np.ndarray] = {}
        self._node_classes: tuple[TokenTrie, np.ndarray] | None = None

    @property
    def nbytes(self) -> int:
        return int(self.offsets.nbytes + self.accepting.nbytes)

    def node_classes(self, trie: TokenTrie) -> np.ndarray:
        """(nodes,) the byte class of every trie node, levels one after another (made once)."""
        cached = self._node_classes
        if cached is None or cached[0] is not trie:
            cached = self._node_classes = (
                trie,
                self.byte_class[trie.byte].astype(self.offsets.dtype),
            )
        return cached[1]

    def step(self, state: int, byte: int) -> int:
        c = self.n_classes
        return int(self.offsets[state * c + self.byte_class[byte]]) // c

    def walk(self, state: int, data: bytes) -> int:
        """The state after `data` (`dead` if any byte is forbidden)."""
        offsets, classes, c = self.offsets, self.byte_class, self.n_classes
        offset, dead = state * c, self.dead_offset
        for b in data:
            offset = int(offsets[offset + classes[b]])
            if offset == dead:
                break
        return offset // c

    def live_bytes(self, state: int) -> np.ndarray:
        """The bytes that may follow in `state`, ascending."""
        out = self._first_bytes.get(state)
        if out is None:
            row = self.offsets[state * self.n_classes : (state + 1) * self.n_classes]
            out = np.flatnonzero(row[self.byte_class] != self.dead_offset)
            self._first_bytes[state] = out
        return out

    def allowed_tokens(self, trie: TokenTrie, state: int) -> np.ndarray:
        """(size,) bool: the tokens whose bytes this DFA accepts from `state` without dying."""
        out = np.zeros(trie.size, dtype=bool)
        runs = _runs(trie, self.live_bytes(state).tolist())
        nodes = sum(trie.nodes_before[hi] - trie.nodes_before[lo] for lo, hi in runs)
        if nodes < _BUFFERED_WALK_NODES:
            for lo, hi in runs:
                self._walk(trie, state, out, lo, hi)
            return out
        buffer = np.full(trie.n_nodes, self.dead_offset, dtype=self.offsets.dtype)
        for lo, hi in runs:
            self._walk_buffered(trie, state, buffer, lo, hi)
        out[trie.end_token] = buffer[trie.end_node] != self.dead_offset
        return out

    def _walk(self, trie: TokenTrie, state: int, out: np.ndarray, lo: int, hi: int) -> None:
        """Walk the subtries of first bytes lo..hi-1 from `state`, marking live token ends."""
        offsets, dead = self.offsets, self.dead_offset
        classes = self.node_classes(trie)
        root = state * self.n_classes
        states = offsets[:0]
        base = 0  # index of the first node of the previous level's slice
        for j, level in enumerate(trie.levels):
            a, b = trie.starts[j][lo], trie.starts[j][hi]
            if a == b:
                return
            g = trie.offset[j]
            if j == 0:
                cur = offsets[root + classes[a:b]]
            else:
                parent = level.parent[a:b]
                cur = offsets[states[parent - base if base else parent] + classes[g + a : g + b]]
            ea, eb = int(level.end_start[lo]), int(level.end_start[hi])
            if ea < eb:
                ends = level.end_node[ea:eb]
                live = cur[ends - a if a else ends] != dead
                out[level.end_token[ea:eb][live]] = True
            if cur.min() == dead:  # the dead state has the largest offset
                return
            states, base = cur, a

    def _walk_buffered(
        self, trie: TokenTrie, state: int, buffer: np.ndarray, lo: int, hi: int
    ) -> None:
        """Like _walk, writing each node's state offset into `buffer` (global node numbers);
        nodes left unwritten keep the dead offset they were filled with."""
        offsets, dead = self.offsets, self.dead_offset
        classes, parent = self.node_classes(trie), trie.parent
        for j in range(len(trie.levels)):
            g = trie.offset[j]
            a, b = g + trie.starts[j][lo], g + trie.starts[j][hi]
            if a == b:
                return
            cur = buffer[a:b]
            if j == 0:
                np.take(offsets, state * self.n_classes + classes[a:b], out=cur)
            else:
                np.take(offsets, buffer[parent[a:b]] + classes[a:b], out=cur)
            if cur.min() == dead:  # the dead state has the largest offset
                return


def _runs(trie: TokenTrie, firsts: list[int]) -> list[tuple[int, int]]:
    """Ranges of first bytes to walk: every live byte in one, merged where that is cheaper."""
    runs: list[list[int]] = []
    nodes, depth = trie.nodes_before, trie.depth
    for b in firsts:
        if runs and nodes[b] - nodes[runs[-1][1]] <= depth[b] * _NODES_PER_LEVEL_OVERHEAD:
            runs[-1][1] = b + 1
        else:
            runs.append([b, b + 1])
    return [(lo, hi) for lo, hi in runs]


__all__ = ["ByteAutomaton"]
