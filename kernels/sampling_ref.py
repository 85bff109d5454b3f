"""Plain-torch twins of the sampling kernels (kernels/sampling.py): the CPU path of the sampler
(runtime/sampler.py and constrained/bitmask.py call these) and the kernels' oracle.

A sampled row picks argmax(p / q) over its vocabulary, with p the row's softmax at its temperature
after min-p, top-k and top-p (`filtered_probs`) and q ~ Exp(1) (the exponential race, equivalent
to sampling from p). The noise is a pure function of (row seed, token id), a counter-based
splitmix64 hash (`exponential_noise`), and the row seed a pure function of (request seed, output
position) (`row_seed`), so no row's choice depends on another row and a seeded run repeats.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from radixlm.protocol.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def row_seed(seed: int, step: int) -> int:
    """Mix a request seed and a position into a 63-bit seed (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _MIX1, _MIX2 = (
    _signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
)


def _shr(z: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> n) & ((1 << (64 - n)) - 1)


def exponential_noise(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """(B, vocab) float32 Exp(1) noise; row b is splitmix64 of (seeds[b], token id). int64
    arithmetic wraps modulo 2**64 on every torch device, so the CPU and the GPU draw the same
    uniforms (their float32 logarithms may differ in the last bit)."""
    ids = torch.arange(1, vocab + 1, dtype=torch.int64, device=seeds.device)
    z = seeds.unsqueeze(1) + ids * _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    u = (_shr(z, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    # (2**24 - 1 + 0.5) rounds to 2**24 in float32: keep u below 1 so that q > 0 (q = -0.0 made a
    # filtered or masked token's 0 / q a NaN, which argmax picks)
    u = u.clamp_(max=1.0 - 2.0**-24)  # uniform in (0, 1)
    return -torch.log(u)


def _column(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(R, 1) on `device` from a host list, copied without waiting for the device's queued work
    (from pinned memory, as runtime/tensors.to_device does)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device).unsqueeze(1)
    return host.pin_memory().to(device, non_blocking=True).unsqueeze(1)


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Softmax at each row's temperature, then min-p, top-k and top-p, for all rows at once
    (renormalization is not needed: the exponential race samples in proportion to what is left);
    tokens tied at the top-k / top-p boundary are all kept."""
    dev, dtype = logits.device, logits.dtype
    # a NaN logit is never sampled (as in the fused kernel); it would make the whole row NaN
    inf = float("inf")
    logits = logits.nan_to_num(nan=-inf, posinf=inf, neginf=-inf)
    temps = _column([p.temperature for p in params], dtype, dev)
    probs = torch.softmax(logits / temps, dim=-1)
    if any(p.min_p > 0 for p in params):
        min_p = _column([p.min_p for p in params], dtype, dev)
        probs = torch.where(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0, probs)
    use_top_p = any(p.top_p < 1.0 for p in params)
    if not use_top_p and not any(p.top_k > 0 for p in params):
        return probs
    vocab = probs.shape[-1]
    ks = [p.top_k if p.top_k > 0 else vocab for p in params]
    # the top-p set is cut from the sorted row; top-k alone needs only the k largest
    width = vocab if use_top_p else min(max(ks), vocab)
    vals, order = probs.topk(width, dim=-1)  # sorted, largest first
    rank = torch.arange(width, device=dev)
    keep = rank < _column(ks, torch.int64, dev)
    if use_top_p:
        # the smallest set of top tokens whose mass reaches top_p (of the row's mass after min-p)
        top_p = _column([p.top_p for p in params], dtype, dev)
        before = vals.cumsum(dim=-1) - vals
        # (rows without top-p keep everything: rounding in the cumulative sum must not cut them)
        keep &= (before < top_p * probs.sum(dim=-1, keepdim=True)) | (top_p >= 1.0)
    # every token tied with the last one kept is kept too, as the fused kernel keeps them (the
    # kept set is a prefix of the sorted row: its last value is the row's threshold)
    last = vals.gather(-1, keep.sum(dim=-1, keepdim=True).clamp(min=1) - 1)
    return torch.where(probs >= last, probs, 0.0)


def sample_ref(
    logits: torch.Tensor, params: Sequence[SamplingParams], seeds: torch.Tensor
) -> torch.Tensor:
    """The twin of kernels/sampling.sample: (R,) int64, row r's token argmax(p / q) for p the
    `filtered_probs` of logits[r] and q its `exponential_noise(seeds[r])` (seeds: (R,) int64 on
    the logits' device, each a `row_seed`)."""
    probs = filtered_probs(logits, params)
    return (probs / exponential_noise(seeds, probs.shape[-1])).argmax(dim=-1)


def argmax_rows_ref(
    logits: torch.Tensor,
    into: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    bitmask: torch.Tensor | None = None,
    mask_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The twin of kernels/sampling.argmax_rows: `logits.argmax(dim=-1)` (the first index of each
    row's max; a NaN is the max); with a packed (M, W) `bitmask`, over each row's allowed tokens
    (row i reads bitmask row `mask_rows[i]`, -1: none; row i without `mask_rows`), the logits
    left as they are; with `into` and `rows`, also `into[rows] =` it."""
    if bitmask is not None:
        logits = logits.clone()
        if mask_rows is None:
            apply_token_bitmask_ref(logits, bitmask)
        else:
            which = (mask_rows >= 0).nonzero().flatten()
            masked = logits[which]
            apply_token_bitmask_ref(masked, bitmask[mask_rows[which]])
            logits[which] = masked
    ids = logits.argmax(dim=-1)
    if into is not None and rows is not None:
        into[rows] = ids
    return ids


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, W) int32 -> (B, vocab_size) bool, True where allowed (bit i % 32 of word i // 32)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # (B, W, 32)
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """The twin of kernels/sampling.apply_token_bitmask: in place, the logits (B, V) of tokens
    whose bit is clear in the packed (B, W) int32 `bitmask`, and of columns past 32 * W, become
    -inf. Both on the logits' device."""
    vocab = logits.shape[1]
    covered = min(vocab, 32 * bitmask.shape[1])
    allowed = unpack_bitmask(bitmask, covered)  # (B, covered)
    logits[:, :covered].masked_fill_(~allowed, float("-inf"))
    if covered < vocab:
        logits[:, covered:] = float("-inf")
