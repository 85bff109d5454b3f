"""Incremental detokenization with stop strings.

Text is decoded a few tokens at a time, never splitting a UTF-8 character: while the newest tokens
decode to a replacement character (an incomplete byte sequence) their text is held back. Stop
strings are searched across chunk boundaries; the text that could still become the start of a stop
string is held back from streaming until it is decided.

Without stop strings nothing needs the text between steps unless someone reads it, so new tokens
are only queued and decoded when `text` is read (a streaming client each step; a plain request
once at the end). Decoding goes straight to the fast tokenizer's decoder where transformers' wrapper
would add nothing but per-call overhead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# how many tokens before the newest one are re-decoded, so that a tokenizer that merges spaces
# or bytes across tokens gives the same text incrementally as in one go
_PREFIX_WINDOW = 6


@dataclass
class IncrementalDetokenizer:
    tokenizer: Any
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop: list[str] = field(default_factory=list)
    # stop strings are looked for from this many tokens on (min_new_tokens): before, the text
    # grows but nothing ends it
    min_tokens: int = 0

    matched_stop: str | None = None
    _text: str = ""  # the decoded output so far, stop string trimmed once matched
    _ids: list[int] = field(default_factory=list)
    _pending: list[int] = field(default_factory=list)  # queued, not decoded yet
    _prefix_offset: int = 0
    _read_offset: int = 0

    def __post_init__(self) -> None:
        self._decode_fn = fast_decoder(
            self.tokenizer, self.skip_special_tokens, self.spaces_between_special_tokens
        )

    @property
    def text(self) -> str:
        """The decoded output so far (stop string trimmed once matched)."""
        self._decode_pending()
        return self._text

    @property
    def _stops_armed(self) -> bool:
        """Whether a stop string may end the output now: there are some, and min_tokens are out."""
        return bool(self.stop) and len(self._ids) >= self.min_tokens

    def _decode_pending(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, []
            self._add(pending)

    def add(self, token_ids: list[int]) -> None:
        """Take newly generated tokens. With stop strings they are decoded now, so that
        `matched_stop` is current; without, when `text` is next read."""
        if self.stop:
            self._add(token_ids)
        else:
            self._pending.extend(token_ids)

    def add_one(self, token_id: int) -> None:
        """`add([token_id])`, without the list (called for every token of every request)."""
        if self.stop:
            self._add([token_id])
        else:
            self._pending.append(token_id)

    def _add(self, token_ids: list[int]) -> None:
        if self.matched_stop is not None:
            return
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if new_text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token,
            # but the whole characters before it may already complete a stop string
            settled = new_text.rstrip("\ufffd")[len(prefix_text) :]
            if settled and self._stops_armed:
                search_from = max(0, len(self._text) - self._longest_stop + 1)
                candidate = self._text + settled
                if any(candidate.find(s, search_from) != -1 for s in self.stop):
                    self._text = candidate
                    self._find_stop(search_from)
            return
        delta = new_text[len(prefix_text) :]
        self._read_offset = len(self._ids)
        self._prefix_offset = max(0, self._read_offset - _PREFIX_WINDOW)
        if not delta:
            return
        search_from = max(0, len(self._text) - self._longest_stop + 1)
        self._text += delta
        if self._stops_armed:
            self._find_stop(search_from)

    def reset(self, token_ids: list[int]) -> None:
        """Start over from these tokens (after earlier tokens were replaced)."""
        self._text, self.matched_stop = "", None
        self._ids, self._pending, self._prefix_offset, self._read_offset = [], [], 0, 0
        self.add(list(token_ids))

    def flush(self) -> None:
        """At the end of generation: release any bytes still held (as replacement characters)."""
        self._decode_pending()
        if self.matched_stop is None and self._read_offset < len(self._ids):
            prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
            search_from = max(0, len(self._text) - self._longest_stop + 1)
            self._text += self._decode(self._ids[self._prefix_offset :])[len(prefix_text) :]
            self._read_offset = len(self._ids)
            if self._stops_armed:  # the released text may hold
                self._find_stop(search_from)  # a stop string: trimmed like any other

    @property
    def stream_text(self) -> str:
        """The part of `text` that is safe to show now: not a possible start of a stop string."""
        if self.matched_stop is not None or not self.stop:
            return self.text
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self._text)), hold, -1):
                if self._text.endswith(s[:k]):
                    hold = k
                    break
        return self._text[: len(self._text) - hold]

    @property
    def _longest_stop(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    def _find_stop(self, search_from: int) -> None:
        best = None
        for s in self.stop:
            pos = self._text.find(s, search_from)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is not None:
            self._text = self._text[: best[0]]
            self.matched_stop = best[1]

    def _decode(self, ids: list[int]) -> str:
        return self._decode_fn(ids) if ids else ""


def fast_decoder(tokenizer, skip_special_tokens: bool, spaces_between_special_tokens: bool = True):
    """ids -> text. The fast tokenizer's own decoder where transformers' `decode` would return the
    same text (it only adds clean-up of tokenization spaces, skipped for BPE), else `decode`."""
    backend = getattr(tokenizer, "_tokenizer", None)
    cleanup = getattr(tokenizer, "clean_up_tokenization_spaces", False)
    if cleanup and backend is not None:
        forced = getattr(
            tokenizer,
            "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
            False,
        )
        cleanup = type(backend.model).__name__ != "BPE" or forced
    if backend is not None and hasattr(backend, "decode") and not cleanup:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids,
        skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=spaces_between_special_tokens,
    )
