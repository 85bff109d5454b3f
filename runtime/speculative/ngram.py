"""N-gram drafting: propose the tokens that followed the latest earlier occurrence of the context's
own ending (prompt lookup decoding, SGLang's `NGRAM` algorithm without a shared trie).

Each request keeps an `NgramIndex` of its own context (prompt + output): for every window size n
in [min_window, max_window] a dict from each n-gram to the position of the token that followed its
latest occurrence. It grows with the context (a few dict writes per new token), so a draft costs
max_window - min_window + 1 lookups, not a scan of the context.

Where the copy reaches the context's end it continues over itself (a repeating text keeps
repeating). `propose_many` also gives what followed the latest occurrences of shorter windows,
where those are other occurrences: the candidates of a draft tree (tree.py,
speculative_eagle_topk).
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """The n-grams of one token sequence that grows at its end."""

    __slots__ = ("min_window", "max_window", "tokens", "_follows")

    def __init__(self, min_window: int, max_window: int) -> None:
        if not 1 <= min_window <= max_window:
            raise ValueError(f"need 1 <= min_window <= max_window, got {min_window}, {max_window}")
        self.min_window = min_window
        self.max_window = max_window
        self.tokens: list[int] = []  # the sequence as indexed so far
        # n - min_window -> {n-gram: position of the token after its latest occurrence}
        self._follows: list[dict[tuple[int, ...], int]] = [
            {} for _ in range(max_window - min_window + 1)
        ]

    def update(self, prompt: Sequence[int], output: Sequence[int] = ()) -> None:
        """Index the context `prompt + output`, which extends what was indexed before; one that
        is shorter, or whose token at the last indexed position differs (output rewritten), is
        indexed afresh. Only the new tokens are read."""
        seen, total = len(self.tokens), len(prompt) + len(output)
        if total < seen or (seen and _at(prompt, output, seen - 1) != self.tokens[-1]):
            self.__init__(self.min_window, self.max_window)  # type: ignore[misc]
            seen = 0
        tokens = self.tokens
        if seen < len(prompt):
            tokens.extend(prompt[seen:])
            tokens.extend(output)
        else:
            tokens.extend(output[seen - len(prompt) :])
        lo, hi = self.min_window, self.max_window
        # the n-grams ending just before each newly known token: that token follows them
        for pos in range(max(seen, lo), len(tokens)):
            for n in range(lo, min(hi, pos) + 1):
                self._follows[n - lo][tuple(tokens[pos - n : pos])] = pos

    def propose(self, max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens that followed the latest earlier occurrence of the longest
        window (max_window down to min_window) the sequence ends with; [] when none recurs."""
        tokens = self.tokens
        if max_tokens <= 0:
            return []
        lo = self.min_window
        for n in range(min(self.max_window, len(tokens) - 1), lo - 1, -1):
            pos = self._follows[n - lo].get(tuple(tokens[len(tokens) - n :]))
            if pos is not None:
                return _continue_from(tokens, pos, max_tokens)
        return []

    def propose_many(self, max_tokens: int, count: int) -> list[list[int]]:
        """Up to `count` drafts of up to `max_tokens` tokens: what `propose` gives first, then
        what followed the latest occurrences of shorter windows the sequence ends with, where
        those are other occurrences."""
        tokens = self.tokens
        if max_tokens <= 0:
            return []
        out, seen, lo = [], set(), self.min_window
        for n in range(min(self.max_window, len(tokens) - 1), lo - 1, -1):
            pos = self._follows[n - lo].get(tuple(tokens[len(tokens) - n :]))
            if pos is not None and pos not in seen:
                seen.add(pos)
                out.append(_continue_from(tokens, pos, max_tokens))
                if len(out) == count:
                    break
        return out


def _at(prompt: Sequence[int], output: Sequence[int], i: int) -> int:
    return prompt[i] if i < len(prompt) else output[i - len(prompt)]


def propose_by_scan(
    tokens: Sequence[int], min_window: int, max_window: int, max_tokens: int
) -> list[int]:
    """The plain twin of `NgramIndex.propose` (a scan of the whole context): the test oracle."""
    if max_tokens <= 0:
        return []
    for n in range(min(max_window, len(tokens) - 1), min_window - 1, -1):
        suffix = list(tokens[len(tokens) - n :])
        for start in range(len(tokens) - n - 1, -1, -1):  # latest earlier occurrence first
            if list(tokens[start : start + n]) == suffix:
                return _continue_from(tokens, start + n, max_tokens)
    return []


def _continue_from(tokens: Sequence[int], pos: int, max_tokens: int) -> list[int]:
    """`max_tokens` tokens copied from `pos` on; where the copy reaches the end of `tokens` it
    goes on over what it copied (the text repeats with the period len(tokens) - pos, as it has
    since the matched occurrence)."""
    out = list(tokens[pos : pos + max_tokens])
    period = len(tokens) - pos
    while len(out) < max_tokens:
        out.append(out[len(out) - period])
    return out
