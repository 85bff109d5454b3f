"""Packed token bitmasks: bit i % 32 of int32 word i // 32 set means token i is allowed."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from radixlm.constrained.errors import GrammarError


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_token_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """(batch, ceil(vocab_size / 32)) int32, every token allowed."""
    return torch.full((batch, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, W) int32 -> (B, vocab_size) bool, True where allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # (B, W, 32)
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits of disallowed tokens become -inf. logits (B, V) float, bitmask (B, W).

    Columns beyond 32 * W are disallowed too. Runs on the logits' device.
    """
    if logits.dim() != 2 or bitmask.dim() != 2 or logits.shape[0] != bitmask.shape[0]:
        raise ValueError(
            f"expected logits (B, V) and bitmask (B, W); got {tuple(logits.shape)} and {tuple(bitmask.shape)}"
        )
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32, got {bitmask.dtype}")
    mask = bitmask.to(logits.device, non_blocking=True)
    if logits.is_cuda and logits.stride(1) == 1 and mask.stride(1) == 1:
        from radixlm.kernels.sampling import apply_token_bitmask  # (triton: only on a GPU)

        apply_token_bitmask(logits, mask)  # one kernel for what follows
        return
    vocab = logits.shape[1]
    covered = min(vocab, 32 * bitmask.shape[1])
    allowed = unpack_bitmask(mask, covered)  # (B, covered)
    logits[:, :covered].masked_fill_(~allowed, float("-inf"))
    if covered < vocab:
        logits[:, covered:] = float("-inf")


def fill_next_token_bitmasks(matchers: list, bitmask: torch.Tensor) -> None:
    """Row i of the contiguous CPU (B, W) int32 `bitmask` := the next-token mask of matchers[i].
    llguidance's matchers are filled together in its own threads, without the GIL (one call for
    the batch); others one by one."""
    groups = _by_parallel_backend(list(enumerate(matchers)))
    for backend, pairs in groups.items():
        if backend is None or not bitmask.is_contiguous():
            for row, matcher in pairs:
                matcher.fill_next_token_bitmask(bitmask, row)
        else:
            from radixlm.constrained.llguidance_backend import fill_bitmasks

            fill_bitmasks([(m, row) for row, m in pairs], bitmask, backend.executor)


class PendingMasks:
    """Masks filling (begin_next_token_bitmasks); `result()` gives the bitmask once filled."""

    def __init__(self, bitmask: torch.Tensor, pending: list, others: list) -> None:
        self._bitmask, self._pending, self._others = bitmask, pending, others

    def result(self) -> torch.Tensor:
        for fill in self._pending:
            fill.result()
        for row, matcher in self._others:
            matcher.fill_next_token_bitmask(self._bitmask, row)
        return self._bitmask


def begin_next_token_bitmasks(matchers: list, bitmask: torch.Tensor) -> PendingMasks:
    """fill_next_token_bitmasks, begun: llguidance's matchers fill in another thread while the
    caller goes on (the engine core applies the previous step's tokens meanwhile; a matcher that
    changes before `result()` is filled again then); others fill at `result()`."""
    from radixlm.constrained.llguidance_backend import begin_fill

    pending, others = [], []
    for backend, pairs in _by_parallel_backend(list(enumerate(matchers))).items():
        if backend is None or not bitmask.is_contiguous():
            others.extend(pairs)
        else:
            pending.append(begin_fill([(m, row) for row, m in pairs], bitmask))
    return PendingMasks(bitmask, pending, others)


def accept_next_tokens(matchers: list, tokens: list[int]) -> None:
    """Let matchers[i] take tokens[i] ahead of its `accept_token(tokens[i])`, all together where
    the backend can (llguidance's threads); `accept_token` then answers at once. Others wait for
    their `accept_token`."""
    from radixlm.constrained.llguidance_backend import accept_batch

    groups = _by_parallel_backend(list(zip(tokens, matchers)))
    for backend, pairs in groups.items():
        if backend is not None:
            accept_batch([(m, t) for t, m in pairs], backend.executor)


def _by_parallel_backend(items: list) -> dict:
    """(x, matcher) items grouped by the llguidance backend of their matcher (None: others)."""
    from radixlm.constrained.llguidance_backend import LLGuidanceMatcher

    groups: dict = {}
    for x, matcher in items:
        backend = matcher.grammar.backend if type(matcher) is LLGuidanceMatcher else None
        groups.setdefault(backend, []).append((x, matcher))
    return groups


def bitmask_from_ids(ids: Iterable[int], vocab_size: int) -> np.ndarray:
    """(W,) int32 numpy row with exactly `ids` allowed (the plain oracle of the fast paths)."""
    arr = np.fromiter(ids, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        raise GrammarError("token id outside the vocabulary")
    flags = np.zeros(bitmask_words(vocab_size) * 32, dtype=bool)
    flags[arr] = True
    return np.packbits(flags, bitorder="little").view(np.int32)


def ids_from_bitmask(row: np.ndarray | torch.Tensor, vocab_size: int | None = None) -> list[int]:
    """Allowed token ids of one packed row."""
    if isinstance(row, torch.Tensor):
        row = row.detach().cpu().numpy()
    flags = np.unpackbits(
        np.ascontiguousarray(row, dtype=np.int32).view(np.uint8), bitorder="little"
    )
    ids = np.flatnonzero(flags)
    if vocab_size is not None:
        ids = ids[ids < vocab_size]
    return ids.tolist()
