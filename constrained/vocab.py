"""A tokenizer's vocabulary as the byte strings a grammar matches tokens against."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from radixlm.constrained.errors import GrammarError


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte <-> printable character table used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs], strict=True))


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}
SENTINEL_BYTES = "\U0010ffff".encode()


class TokenVocabulary:
    """Token id -> the bytes it decodes to (None for tokens a grammar never allows).

    `size` is the width of the logits (may exceed the tokenizer: the extra ids are never
    allowed); `eos_token_ids` end a grammar-constrained generation in an accepting state.
    """

    def __init__(
        self,
        token_bytes: Sequence[bytes | None],
        eos_token_ids: Iterable[int],
        size: int | None = None,
    ) -> None:
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        if not self.eos_token_ids:
            raise GrammarError("the vocabulary needs an end-of-sequence token id")
        self.size = (
            int(size) if size is not None else max(len(token_bytes), max(self.eos_token_ids) + 1)
        )
        self.token_bytes: list[bytes | None] = [
            (b if b else None) if i < self.size else None for i, b in enumerate(token_bytes)
        ]
        self.token_bytes += [None] * max(0, self.size - len(self.token_bytes))
        for e in self.eos_token_ids:
            if e >= self.size:
                raise GrammarError(f"EOS id {e} is outside the vocabulary of {self.size} tokens")
            self.token_bytes[e] = None

    @classmethod
    def from_tokenizer(
        cls,
        tokenizer: Any,
        vocab_size: int | None = None,
        eos_token_ids: Iterable[int] | None = None,
    ) -> TokenVocabulary:
        """Read a Hugging Face tokenizer (or any object with `get_vocab()` and `eos_token_id`).

        Byte-level BPE tokens (GPT-2 style, `Ġ` for space) are mapped back to their bytes,
        SentencePiece tokens (`▁` for space, `<0x0A>` byte fallback) likewise; added tokens are
        their literal text; special tokens are never allowed.
        """
        vocab: dict[str, int] = tokenizer.get_vocab()
        if eos_token_ids is None:
            eos = getattr(tokenizer, "eos_token_id", None)
            if eos is None:
                raise GrammarError("the tokenizer has no eos_token_id; pass eos_token_ids")
            eos_token_ids = [eos]
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        added: dict[int, Any] = dict(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        for i, tok in added.items():
            if getattr(tok, "special", False):
                special.add(int(i))
        n = max(vocab.values(), default=-1) + 1
        table: list[bytes | None] = [None] * n
        mode = _decoding_mode(tokenizer, vocab)
        for text, i in vocab.items():
            if i in special:
                continue
            table[i] = text.encode("utf-8") if i in added else _token_bytes(text, mode)
        return cls(table, eos_token_ids, vocab_size if vocab_size is not None else n)

    @cached_property
    def first_byte(self) -> np.ndarray:
        """(size,) int16: each token's first byte, -1 for tokens never allowed."""
        out = np.full(self.size, -1, dtype=np.int16)
        for i, b in enumerate(self.token_bytes):
            if b:
                out[i] = b[0]
        return out

    @cached_property
    def token_of_bytes(self) -> dict[bytes, int]:
        """Bytes -> the lowest token id spelling exactly them."""
        out: dict[bytes, int] = {}
        for i, b in enumerate(self.token_bytes):
            if b and b not in out:
                out[b] = i
        return out

    @cached_property
    def trie(self) -> TokenTrie:
        """The usable tokens as a level-by-level trie."""
        return TokenTrie(self)

    def outlines_vocabulary(self) -> Any:
        """The outlines-core Vocabulary of the allowed tokens, as outlines-core's own `Index`
        reads it (the benchmark's baseline and the tests' oracle)."""
        return self._outlines

    @property
    def sentinel_id(self) -> int:
        """The id of the fake token spelling the end-of-match sentinel (just past the logits)."""
        return self.size

    @cached_property
    def _outlines(self) -> Any:
        from outlines_core import Vocabulary

        grouped: dict[bytes, list[int]] = {}
        for i, b in enumerate(self.token_bytes):
            # Byte 0xF4 only starts plane-16 characters, which grammars never generate: leaving
            # those tokens out guarantees that only the fake sentinel token can end a match.
            if b and 0xF4 not in b:
                grouped.setdefault(b, []).append(i)
        if not grouped:
            raise GrammarError("the vocabulary has no usable tokens")
        grouped.setdefault(SENTINEL_BYTES, []).append(self.sentinel_id)
        return Vocabulary(self.eos_token_ids[0], grouped)

    @cached_property
    def outlines_words(self) -> int:
        """How many int32 words outlines-core writes a mask into (it sizes by the largest id)."""
        return (max(self.sentinel_id, self.eos_token_ids[0]) + 1 + 31) // 32


def _decoding_mode(tokenizer: Any, vocab: dict[str, int]) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        try:
            spec = json.loads(backend.to_str())
        except Exception:
            spec = {}
        text = json.dumps(spec.get("decoder") or {}) + json.dumps(spec.get("pre_tokenizer") or {})
        if '"ByteLevel"' in text:
            return "byte_level"
        if '"ByteFallback"' in text or "\u2581" in text or "Metaspace" in text:
            return "sentencepiece"
    if any("\u0120" in t or "\u010a" in t for t in vocab):  # Ġ (space), Ċ (newline)
        return "byte_level"
    if any(t.startswith("\u2581") for t in vocab):
        return "sentencepiece"
    return "plain"


def _token_bytes(text: str, mode: str) -> bytes | None:
    if mode == "byte_level":
        try:
            return bytes(_BYTE_DECODER[c] for c in text)
        except KeyError:
            return text.encode("utf-8")
    if mode == "sentencepiece":
        if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            try:
                return bytes([int(text[3:5], 16)])
            except ValueError:
                pass
        return text.replace("\u2581", " ").encode("utf-8")
    return text.encode("utf-8")


@dataclass
class _Level:
    """The trie nodes at depth j+1 (prefixes of j+1 bytes), in lexicographic order."""

    parent: np.ndarray  # (N,) int64: index of the node's prefix one byte shorter (level j-1)
    byte: np.ndarray  # (N,) int64: the node's last byte
    start: np.ndarray  # (257,) int64: nodes with first byte b are start[b]:start[b+1]
    end_node: np.ndarray  # (E,) int64: nodes that spell a whole token, ascending
    end_token: np.ndarray  # (E,) int64: that token's id
    end_start: (
        np.ndarray
    )  # (257,) int64: ends whose first byte is b are end_start[b]:end_start[b+1]


class TokenTrie:
    """The vocabulary's usable tokens as a trie, one array level per byte depth (a DFA walks it
    to find the tokens a state allows: automaton.ByteAutomaton.allowed_tokens).

    Tokens that contain byte 0xF4 are left out: it only starts plane-16 characters, which
    grammars never generate (the end-of-match sentinel lives there).
    """

    def __init__(self, vocab: TokenVocabulary) -> None:
        self.size = vocab.size
        tokens = sorted((b, i) for i, b in enumerate(vocab.token_bytes) if b and 0xF4 not in b)
        if not tokens:
            raise GrammarError("the vocabulary has no usable tokens")
        self.levels: list[_Level] = []
        previous: dict[bytes, int] = {}
        depth = 0
        alive = tokens
        while alive:
            index: dict[bytes, int] = {}
            parents: list[int] = []
            last: list[int] = []
            firsts: list[int] = []
            end_node: list[int] = []
            end_token: list[int] = []
            for data, tok in alive:
                prefix = data[: depth + 1]
                node = index.get(prefix)
                if node is None:
                    node = index[prefix] = len(parents)
                    parents.append(previous[prefix[:-1]] if depth else 0)
                    last.append(prefix[-1])
                    firsts.append(prefix[0])
                if len(data) == depth + 1:
                    end_node.append(node)
                    end_token.append(tok)
            first = np.asarray(firsts, dtype=np.int64)
            ends = np.asarray(end_node, dtype=np.int64)
            self.levels.append(
                _Level(
                    parent=np.asarray(parents, dtype=np.int64),
                    byte=np.asarray(last, dtype=np.int64),
                    start=np.searchsorted(first, np.arange(257)),
                    end_node=ends,
                    end_token=np.asarray(end_token, dtype=np.int64),
                    end_start=np.searchsorted(first[ends], np.arange(257)),
                )
            )
            previous = index
            depth += 1
            alive = [(d, t) for d, t in alive if len(d) > depth]
        per_first = sum(np.diff(level.start) for level in self.levels)  # (256,) subtrie sizes
        self.nodes_before = np.concatenate([[0], np.cumsum(per_first)]).tolist()
        self.depth = sum(
            (np.diff(level.start) > 0).astype(np.int64) for level in self.levels
        ).tolist()
        # the same nodes numbered globally, level after level
        sizes = [len(level.parent) for level in self.levels]
        self.offset = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        self.n_nodes = self.offset[-1]
        self.byte = np.concatenate([level.byte for level in self.levels])
        self.parent = np.concatenate(
            [np.zeros(sizes[0], dtype=np.int64)]
            + [level.parent + self.offset[j] for j, level in enumerate(self.levels[1:])]
        )
        self.starts = [level.start.tolist() for level in self.levels]
        self.end_token = np.concatenate([level.end_token for level in self.levels])
        self.end_node = np.concatenate(
            [level.end_node + self.offset[j] for j, level in enumerate(self.levels)]
        )
