"""From logits to tokens: penalties, masks, temperature, top-k / top-p / min-p, seeded sampling.

Sampling is reproducible per request whatever else is in the batch: each row picks argmax(p / q)
with q ~ Exp(1) (the exponential race, equivalent to sampling from p), and its noise is a pure
function of (request seed, output position, token id), a counter-based hash computed for the whole
batch at once, so no row's choice depends on another row and no per-row generator or host sync is
needed. Every step is a batched tensor operation; only penalties loop over the rows that use them.
Greedy rows are an argmax, and a batch of plain greedy rows is nothing else.

On CUDA the sampled rows go through one fused Triton kernel (kernels/sampling.py: temperature,
softmax statistics, min-p, top-k and top-p by bisection on a threshold instead of a sort, and the
race with the same noise), unless RADIXLM_DISABLE_FUSED=1; the torch code here is the CPU path and
the oracle its tests compare against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from radixlm.protocol.sampling_params import SamplingParams
from radixlm.runtime.tensors import int64_tensor, packed_to_device, to_device

_MASK64 = (1 << 64) - 1


@dataclass
class SamplingRow:
    params: SamplingParams
    seed: int
    step: int  # index of the output token being sampled
    input_ids: list[int]
    output_ids: list[int]
    banned_ids: tuple[int, ...] = ()  # e.g. EOS while min_new_tokens is not reached
    want_logprob: bool = False
    top_logprobs_num: int = 0
    grammar: Any = None  # a constrained.GrammarMatcher: its allowed tokens mask the logits

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy with nothing to mask or penalize: the argmax of the logits."""
        p = self.params
        return p.is_plain_argmax and not self.banned_ids and self.grammar is None


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float | None]  # the chosen token's log-probability, where asked
    top_logprobs: list[list[tuple[float, int]] | None]


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


def logprobs_at(
    logits: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, k: int
) -> tuple[list[float], list[list[tuple[float, int]]]]:
    """The log-probability of token ids[j] in logits row rows[j], and that row's top k
    (log-probability, id) pairs (empty lists for k = 0), each kind copied back once for all rows."""
    lp = torch.log_softmax(logits[rows], dim=-1)
    chosen = lp.gather(1, ids[:, None]).squeeze(1).tolist()
    if not k:
        return chosen, [[] for _ in chosen]
    values, top_ids = lp.topk(k, dim=-1)
    return chosen, [list(zip(v, t)) for v, t in zip(values.tolist(), top_ids.tolist())]


class Sampler:
    def __init__(self) -> None:
        # the host bitmask buffers grammar masks are filled into (pinned where a GPU reads them),
        # used alternately: a step's buffer is written again two steps later, when its copy to
        # the device is long done (the step between waited for the tokens sampled after it)
        self._mask_buffers: list[torch.Tensor | None] = [None, None]
        self._mask_copied: list[torch.cuda.Event | None] = [None, None]  # its copy is done then
        self._mask_flip = 0

    def mask_buffer(self, rows: int, vocab: int, pinned: bool) -> torch.Tensor:
        """A (rows, ceil(vocab / 32)) int32 host tensor to fill masks into (contents stale)."""
        from radixlm.constrained.bitmask import bitmask_words

        words = bitmask_words(vocab)
        self._mask_flip ^= 1
        copied = self._mask_copied[self._mask_flip]
        if copied is not None:  # (done long ago, but for a step whose rows are sampled apart)
            copied.synchronize()
        buf = self._mask_buffers[self._mask_flip]
        if buf is None or buf.shape[0] < rows or buf.shape[1] != words or buf.is_pinned() != pinned:
            buf = torch.empty((max(rows, 64), words), dtype=torch.int32, pin_memory=pinned)
            self._mask_buffers[self._mask_flip] = buf
        return buf[:rows]

    def __call__(
        self,
        logits: torch.Tensor,  # (B, V) float32; not modified
        rows: list[SamplingRow],
    ) -> SampleOutput:
        ids = self.sample_ids(logits, rows).tolist()
        lps = self.logprobs(logits, rows, ids)
        return SampleOutput(ids, [lp for lp, _ in lps], [top for _, top in lps])

    @staticmethod
    def logprobs(
        logits: torch.Tensor, rows: list[SamplingRow], ids: list[int]
    ) -> list[tuple[float | None, list[tuple[float, int]] | None]]:
        """(the chosen token's log-probability, the top list) per row where asked, of the model's
        own distribution (before penalties, masks and filters); (None, None) elsewhere."""
        out: list[tuple[float | None, list[tuple[float, int]] | None]] = [(None, None)] * len(ids)
        want = [i for i, r in enumerate(rows) if r.want_logprob]
        if not want:
            return out
        at, chosen_ids = packed_to_device([want, [ids[i] for i in want]], logits.device)
        most = max(rows[i].top_logprobs_num for i in want)
        chosen, tops = logprobs_at(logits, at, chosen_ids, most)
        for j, i in enumerate(want):
            k = rows[i].top_logprobs_num
            out[i] = (chosen[j], tops[j][:k] if k else None)
        return out

    def begin_masks(self, rows: list[SamplingRow], vocab: int, on_gpu: bool) -> Any:
        """Start filling the grammar masks of `rows` (for `sample_ids(..., masks=)`), in the
        grammar backend's threads while the caller goes on; None if no row has a grammar."""
        from radixlm.constrained import begin_next_token_bitmasks

        constrained = [r.grammar for r in rows if r.grammar is not None]
        if not constrained:
            return None
        bitmask = self.mask_buffer(len(constrained), vocab, on_gpu)
        return begin_next_token_bitmasks(constrained, bitmask)

    def sample_ids(
        self, logits: torch.Tensor, rows: list[SamplingRow], masks: Any = None
    ) -> torch.Tensor:
        """The chosen tokens (B,) int64 on the logits' device, without waiting for the device.
        masks: what `begin_masks(rows, ...)` began, if it was."""
        if all(r.is_plain_greedy for r in rows):
            return greedy_ids(logits)
        banned = [(i, t) for i, r in enumerate(rows) for t in r.banned_ids]
        constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
        biased = [i for i, r in enumerate(rows) if r.params.has_logit_bias]
        if banned or constrained or biased or any(r.params.has_penalties for r in rows):
            logits = logits.clone()
        if biased:
            _apply_logit_bias(logits, rows, biased)
        for i, r in enumerate(rows):
            if r.params.has_penalties:
                _apply_penalties(logits[i], r)
        if banned:  # (indices from host lists would be a blocking copy: a sync a step)
            rows_idx, tokens = zip(*banned)
            at = packed_to_device([list(rows_idx), list(tokens)], logits.device)
            logits[at[0], at[1]] = float("-inf")
        if constrained:
            if masks is not None:
                bitmask = masks.result()
            else:
                bitmask = self.mask_buffer(len(constrained), logits.shape[-1], logits.is_cuda)
            _apply_grammar_masks(logits, rows, constrained, bitmask, filled=masks is not None)
            if logits.is_cuda:
                self._mask_copied[self._mask_flip] = torch.cuda.Event()
                self._mask_copied[self._mask_flip].record()

        sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        seeds = [row_seed(rows[i].seed, rows[i].step) for i in sampled]
        if sampled and _use_fused(logits):
            return _sample_fused(logits, rows, sampled, seeds)
        token_ids = greedy_ids(logits)
        if sampled:
            dev = logits.device
            idx = _to_device(sampled, torch.int64, dev)
            probs = _filtered_probs(logits[idx], [rows[i].params for i in sampled])
            noise = exponential_noise(_to_device(seeds, torch.int64, dev), probs.shape[-1])
            token_ids[idx] = (probs / noise).argmax(dim=-1)
        return token_ids


def greedy_ids(
    logits: torch.Tensor, into: torch.Tensor | None = None, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """`logits.argmax(dim=-1)`; with `into` and `rows`, also `into[rows] =` it. Where the fused
    kernels run, kernels/sampling.py's `argmax_rows`: torch reduces one long row in one block of
    threads (13 us for SmolLM2's 49k-token vocabulary on an H200, at batch 1 the costliest kernel
    of a step after the LM head), and the scatter is a kernel of its own."""
    if _use_fused(logits) and logits.dim() == 2 and logits.stride(-1) == 1:
        return _sampling_kernels().argmax_rows(logits, into, rows)
    ids = logits.argmax(dim=-1)
    if into is not None and rows is not None:
        into[rows] = ids
    return ids


def _use_fused(logits: torch.Tensor) -> bool:
    """Sample with kernels/sampling.py where the fused kernels run (kernels/fused.enabled: on
    CUDA, unless RADIXLM_DISABLE_FUSED=1)."""
    if not logits.is_cuda:
        return False
    from radixlm.kernels import fused  # imports triton: only where CUDA is used

    return fused.enabled(logits)


def _sampling_kernels():
    from radixlm.kernels import sampling  # imports triton: only where CUDA is used

    return sampling


def _sample_fused(
    logits: torch.Tensor, rows: list[SamplingRow], sampled: list[int], seeds: list[int]
) -> torch.Tensor:
    """The fused kernel for the sampled rows (the greedy ones are an argmax), its per-row
    parameters sent in two non-blocking copies (aligned views: the kernel compiles once)."""
    dev = logits.device
    params = [rows[i].params for i in sampled]
    logit_rows, row_seeds, top_k = packed_to_device(
        [sampled, seeds, [p.top_k for p in params]], dev
    )
    temperature, top_p, min_p = packed_to_device(
        [[getattr(p, f) for p in params] for f in ("temperature", "top_p", "min_p")],
        dev,
        torch.float32,
    )
    ids = _sampling_kernels().sample(
        logits, logit_rows, row_seeds, top_k, temperature, top_p, min_p,
        bisects=any(p.top_k > 0 or p.top_p < 1.0 for p in params),
    )  # fmt: skip
    if len(sampled) == len(rows):
        return ids
    token_ids = greedy_ids(logits)
    token_ids[logit_rows] = ids
    return token_ids


def _to_device(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device`, without waiting for the device's queued work."""
    host = int64_tensor(data) if dtype == torch.int64 else torch.tensor(data, dtype=dtype)
    return to_device(host, device)


def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow], which: list[int]) -> None:
    """Add each row's logit_bias to its logits, for all those rows in one indexed add."""
    tokens, biases = zip(*(rows[i].params.logit_bias_columns for i in which))
    row_idx = torch.repeat_interleave(int64_tensor(which), int64_tensor([len(t) for t in tokens]))
    at = to_device(torch.stack([row_idx, torch.cat(tokens)]), logits.device)
    bias = to_device(torch.cat(biases).to(logits.dtype), logits.device)
    logits.index_put_((at[0], at[1]), bias, accumulate=True)


def _apply_penalties(logits: torch.Tensor, r: SamplingRow) -> None:
    p = r.params
    if p.repetition_penalty != 1.0:
        seen = _to_device(sorted(set(r.input_ids) | set(r.output_ids)), torch.long, logits.device)
        if len(seen):
            vals = logits[seen]
            logits[seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
    if (p.frequency_penalty or p.presence_penalty) and r.output_ids:
        out = _to_device(r.output_ids, torch.long, logits.device)
        # (not bincount: on CUDA it reads the largest id back to size its output, a sync)
        counts = torch.zeros_like(logits).index_add_(
            0, out, torch.ones_like(out, dtype=logits.dtype)
        )
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Softmax at each row's temperature, then min-p, top-k and top-p, for all rows at once
    (renormalization is not needed: the exponential race samples in proportion to what is left);
    tokens tied at the top-k / top-p boundary are all kept."""
    dev, dtype = logits.device, logits.dtype
    # a NaN logit is never sampled (as in the fused kernel); it would make the whole row NaN
    inf = float("inf")
    logits = logits.nan_to_num(nan=-inf, posinf=inf, neginf=-inf)
    temps = _to_device([p.temperature for p in params], dtype, dev).unsqueeze(1)
    probs = torch.softmax(logits / temps, dim=-1)
    if any(p.min_p > 0 for p in params):
        min_p = _to_device([p.min_p for p in params], dtype, dev).unsqueeze(1)
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
    keep = rank < _to_device(ks, torch.int64, dev).unsqueeze(1)
    if use_top_p:
        # the smallest set of top tokens whose mass reaches top_p (of the row's mass after min-p)
        top_p = _to_device([p.top_p for p in params], dtype, dev).unsqueeze(1)
        before = vals.cumsum(dim=-1) - vals
        # (rows without top-p keep everything: rounding in the cumulative sum must not cut them)
        keep &= (before < top_p * probs.sum(dim=-1, keepdim=True)) | (top_p >= 1.0)
    # every token tied with the last one kept is kept too, as the fused kernel keeps them (the
    # kept set is a prefix of the sorted row: its last value is the row's threshold)
    last = vals.gather(-1, keep.sum(dim=-1, keepdim=True).clamp(min=1) - 1)
    return torch.where(probs >= last, probs, 0.0)


def _apply_grammar_masks(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    which: list[int],
    bitmask: torch.Tensor | None = None,
    filled: bool = False,
) -> None:
    """The grammar rows' masks, filled on the host (together, where the backend can) into
    `bitmask` (len(which), W) (pinned memory on a GPU), copied without a wait and applied on the
    logits' device."""
    from radixlm.constrained import (
        allocate_token_bitmask,
        apply_token_bitmask_,
        fill_next_token_bitmasks,
    )

    if bitmask is None:
        bitmask = allocate_token_bitmask(len(which), logits.shape[-1])
    if not filled:
        fill_next_token_bitmasks([rows[i].grammar for i in which], bitmask)
    device_mask = bitmask.to(logits.device, non_blocking=True)
    if len(which) == logits.shape[0]:  # every row (the common case): no gather and scatter
        apply_token_bitmask_(logits, device_mask)
        return
    idx = _to_device(which, torch.int64, logits.device)
    masked = logits[idx]
    apply_token_bitmask_(masked, device_mask)
    logits[idx] = masked
