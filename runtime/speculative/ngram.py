"""N-gram drafting: propose the tokens that followed the latest earlier occurrence of the context's
own ending (prompt lookup decoding, SGLang's `NGRAM` algorithm without a shared trie).

Each request keeps an `NgramIndex` of its own context (prompt + output): the tokens in a numpy
array that grows at its end, copied in only as they become known (no per-token Python work, so a
request that went many steps without a draft, the speculation gate keeping its steps plain,
catches up in one copy; a dict of every n-gram cost ~0.4 ms a request to catch up, ~50 ms for a
step of 128 requests on an H100's host). A draft is what followed the latest earlier occurrence
of the longest window (max_window tokens down to min_window) the context ends with. Up to a
thousand tokens of context, a byte search of the tokens for a few windows finds it
(`_latest_longest`); in longer contexts, and for several candidates (`propose_many`), one
vectorized comparison finds the earlier positions of the context's last token, then how far
back each of them matches the context's ending: the longest match first, the latest among
equals.

Where the copy reaches the context's end it continues over itself (a repeating text keeps
repeating). `propose_many` also gives what followed the latest occurrences of shorter windows,
where those are other occurrences: the candidates of a draft tree (tree.py,
speculative_eagle_topk).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_STEPS = np.arange(64)  # k = 0, 1, ...: tokens back from a match's end (made once)


class NgramIndex:
    """The tokens of one sequence that grows at its end, and the n-gram matches of its ending."""

    __slots__ = ("min_window", "max_window", "_buf", "_len")

    def __init__(self, min_window: int, max_window: int) -> None:
        if not 1 <= min_window <= max_window:
            raise ValueError(f"need 1 <= min_window <= max_window, got {min_window}, {max_window}")
        self.min_window = min_window
        self.max_window = max_window
        self._buf = np.empty(256, dtype=np.int64)  # the sequence as known so far: _buf[:_len]
        self._len = 0

    @property
    def tokens(self) -> np.ndarray:
        return self._buf[: self._len]

    def update(self, prompt: Sequence[int], output: Sequence[int] = ()) -> None:
        """Take the context `prompt + output`, which extends what was taken before; one that is
        shorter, or whose token at the last known position differs (output rewritten), is taken
        afresh. Only the new tokens are read."""
        seen, total = self._len, len(prompt) + len(output)
        if total < seen or (seen and _at(prompt, output, seen - 1) != self._buf[seen - 1]):
            seen = 0
        if total > len(self._buf):
            grown = np.empty(max(total, 2 * len(self._buf)), dtype=np.int64)
            grown[:seen] = self._buf[:seen]
            self._buf = grown
        if seen < len(prompt):
            self._buf[seen : len(prompt)] = prompt[seen:]
            self._buf[len(prompt) : total] = output
        elif total > seen:
            self._buf[seen:total] = output[seen - len(prompt) :]
        self._len = total

    def propose(self, max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens that followed the latest earlier occurrence of the longest
        window (max_window down to min_window) the sequence ends with; [] when none recurs."""
        drafts = self.propose_many(max_tokens, 1)
        return drafts[0] if drafts else []

    def propose_many(self, max_tokens: int, count: int) -> list[list[int]]:
        """Up to `count` drafts of up to `max_tokens` tokens: what `propose` gives first, then
        what followed the latest occurrences of shorter windows the sequence ends with, where
        those are other occurrences."""
        n = self._len
        hi = min(self.max_window, n - 1)
        if max_tokens <= 0 or count <= 0 or hi < self.min_window:
            return []
        t = self._buf[:n]
        if count == 1 and n <= _BYTE_SEARCH_MAX:
            pos = self._latest_longest(t, hi)
            if pos is None:
                return []
            return [_repeated(t[pos : pos + max_tokens].tolist(), n - pos, max_tokens)]
        ends = np.flatnonzero(t[: n - 1] == t[n - 1])  # earlier occurrences of the last token
        if not ends.size:
            return []
        # how far back each matches the ending: k tokens back from each, while equal
        steps = _STEPS[:hi] if hi <= len(_STEPS) else np.arange(hi)
        back = ends[:, None] - steps
        same = t[back] == t[n - 1 - steps]  # (a negative index wraps: cut by the mask below)
        same &= back >= 0
        length = same.cumprod(axis=1).sum(axis=1)
        if count == 1:  # the latest of the longest: the last index of the maximum
            last = len(length) - 1 - int(length[::-1].argmax())
            if length[last] < self.min_window:
                return []
            pos = int(ends[last]) + 1
            return [_repeated(t[pos : pos + max_tokens].tolist(), n - pos, max_tokens)]
        out, seen = [], set()
        for window in range(int(length.max()), self.min_window - 1, -1):
            at = np.flatnonzero(length >= window)  # (ascending: the last is the latest)
            if not at.size:
                continue
            pos = int(ends[at[-1]]) + 1
            if pos in seen:
                continue
            seen.add(pos)
            draft = t[pos : pos + max_tokens].tolist()
            out.append(_repeated(draft, n - pos, max_tokens))
            if len(out) == count:
                break
        return out

    def _latest_longest(self, t: np.ndarray, hi: int) -> int | None:
        """Where the copy starts for `propose`: the position after the latest earlier
        occurrence of the longest window (hi down to min_window) that the sequence `t` ends
        with, or None. A byte search over the tokens (8 bytes each) for each window tried: the
        shortest first, which alone settles most texts that do not repeat, then the longest
        that occurs, by halving."""
        data = t.tobytes()
        limit = (len(t) - 1) * _WIDTH  # (an occurrence ends before the last token)

        def latest(window: int) -> int | None:
            ending = data[(len(t) - window) * _WIDTH :]
            end = limit
            while (at := data.rfind(ending, 0, end)) >= 0:
                if at % _WIDTH == 0:
                    return at // _WIDTH + window
                end = at + len(ending) - 1  # (across token boundaries: look before it)
            return None

        # a window that occurs earlier has every shorter one occur too: the longest by halving
        lo, found = self.min_window, latest(self.min_window)
        if found is None:
            return None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            pos = latest(mid)
            if pos is None:
                hi = mid - 1
            else:
                lo, found = mid, pos
        return found


_WIDTH = np.dtype(np.int64).itemsize
# contexts up to this many tokens draft by byte search (`_latest_longest`), longer ones by the
# vectorized match: 300-1,000 tokens that repeat 3.6-4.4 us against 9.8-10.1 a draft, 4,000
# that do not 11-20 us against 3-12 (the 2-core machine)
_BYTE_SEARCH_MAX = 1024


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


def propose_many_by_scan(
    tokens: Sequence[int], min_window: int, max_window: int, max_tokens: int, count: int
) -> list[list[int]]:
    """The plain twin of `NgramIndex.propose_many`: for each window from the longest down, the
    latest earlier occurrence of the ending, by a scan; each other occurrence a draft."""
    out, seen = [], set()
    if max_tokens <= 0:
        return out
    for n in range(min(max_window, len(tokens) - 1), min_window - 1, -1):
        suffix = list(tokens[len(tokens) - n :])
        for start in range(len(tokens) - n - 1, -1, -1):
            if list(tokens[start : start + n]) == suffix:
                if start + n not in seen:
                    seen.add(start + n)
                    out.append(_continue_from(tokens, start + n, max_tokens))
                break
        if len(out) == count:
            break
    return out


def _continue_from(tokens: Sequence[int], pos: int, max_tokens: int) -> list[int]:
    """`max_tokens` tokens copied from `pos` on; where the copy reaches the end of `tokens` it
    goes on over what it copied (the text repeats with the period len(tokens) - pos, as it has
    since the matched occurrence)."""
    return _repeated(list(tokens[pos : pos + max_tokens]), len(tokens) - pos, max_tokens)


def _repeated(out: list[int], period: int, max_tokens: int) -> list[int]:
    """`out` (a copy from the context's position len(context) - period on) continued to
    `max_tokens` tokens over itself."""
    while len(out) < max_tokens:
        out.append(out[len(out) - period])
    return out
