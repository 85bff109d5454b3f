"""Packed token bitmasks: bit i % 32 of int32 word i // 32 set means token i is allowed."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from radixlm.constrained.errors import GrammarError
from radixlm.kernels.sampling_ref import apply_token_bitmask_ref


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_token_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """(batch, ceil(vocab_size / 32)) int32, every token allowed."""
    return torch.full((batch, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits of disallowed tokens become -inf. logits (B, V) float, bitmask (B, W).

    Columns beyond 32 * W are disallowed too. Runs on the logits' device: kernels/sampling.py's
    `apply_token_bitmask` on a GPU, else its plain-torch twin in kernels/sampling_ref.py.
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

        apply_token_bitmask(logits, mask)
        return
    apply_token_bitmask_ref(logits, mask)


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
