"""From logits to tokens: penalties, masks, temperature, top-k / top-p / min-p, seeded sampling.

Sampling is reproducible per request whatever else is in the batch: each row picks argmax(p / q)
with q ~ Exp(1) (the exponential race, equivalent to sampling from p), and its noise is a pure
function of (request seed, output position, token id), a counter-based hash computed for the whole
batch at once, so no row's choice depends on another row and no per-row generator or host sync is
needed. Every step is a batched tensor operation; only penalties loop over the rows that use them.
Greedy rows are an argmax, and a batch of plain greedy rows is nothing else.

On CUDA the sampled rows go through one fused Triton kernel (kernels/sampling.py: temperature,
softmax statistics, min-p, top-k and top-p by bisection on a threshold instead of a sort, and the
race with the same noise), unless RADIXLM_DISABLE_FUSED=1; elsewhere through that kernel's
plain-torch twin, kernels/sampling_ref.py (`row_seed`, `exponential_noise`, `filtered_probs`: the
CPU path and the oracle the kernel's tests compare against).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from radixlm.kernels.sampling_ref import argmax_rows_ref, row_seed, sample_ref
from radixlm.protocol.sampling_params import SamplingParams
from radixlm.runtime.tensors import int64_tensor, packed_to_device, to_device


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
        # waiting for the masks begun in the background (begin_masks), and filling the rest
        self.mask_seconds = 0.0

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
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        masks: Any = None,
        into: torch.Tensor | None = None,
        into_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The chosen tokens (B,) int64 on the logits' device, without waiting for the device.
        masks: what `begin_masks(rows, ...)` began, if it was. With `into` and `into_rows` (B,)
        on the device, also `into[into_rows] =` the tokens (a step's newest tokens into
        token_buf: where the tokens come from one kernel, it writes them there too)."""
        if all(r.is_plain_greedy for r in rows):
            return greedy_ids(logits, into, into_rows)
        constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
        if constrained and all(r.params.is_plain_argmax and not r.banned_ids for r in rows):
            # greedy under grammars (JSON extraction's usual case): the argmax over each row's
            # allowed tokens in one pass, the logits neither copied nor written
            bitmask = self._grammar_bitmask(logits, rows, constrained, masks)
            mask_rows = None
            if len(constrained) < len(rows):
                at = [-1] * len(rows)
                for j, i in enumerate(constrained):
                    at[i] = j
                mask_rows = _to_device(at, torch.int64, logits.device)
            return greedy_ids(logits, into, into_rows, bitmask, mask_rows)
        token_ids = self._sample_any(logits, rows, constrained, masks)
        if into is not None and into_rows is not None:
            into[into_rows] = token_ids
        return token_ids

    def _sample_any(
        self, logits: torch.Tensor, rows: list[SamplingRow], constrained: list[int], masks: Any
    ) -> torch.Tensor:
        """sample_ids with anything to apply to the logits first: bias, penalties, banned
        tokens, grammar masks; then the greedy rows' argmax and the sampled rows' race."""
        from radixlm.constrained import apply_token_bitmask_

        # the masks first: begun in the background, they are waited for before anything here can
        # fail (a failure falls back to sampling row by row, which fills masks again)
        bitmask = self._grammar_bitmask(logits, rows, constrained, masks) if constrained else None
        banned = [(i, t) for i, r in enumerate(rows) for t in r.banned_ids]
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
        if bitmask is not None:
            if len(constrained) == logits.shape[0]:  # every row: no gather and scatter
                apply_token_bitmask_(logits, bitmask)
            else:
                idx = _to_device(constrained, torch.int64, logits.device)
                masked = logits[idx]
                apply_token_bitmask_(masked, bitmask)
                logits[idx] = masked

        sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        seeds = [row_seed(rows[i].seed, rows[i].step) for i in sampled]
        if sampled and _use_fused(logits):
            return _sample_fused(logits, rows, sampled, seeds)
        token_ids = greedy_ids(logits)
        if sampled:
            dev = logits.device
            idx = _to_device(sampled, torch.int64, dev)
            params = [rows[i].params for i in sampled]
            token_ids[idx] = sample_ref(logits[idx], params, _to_device(seeds, torch.int64, dev))
        return token_ids

    def _grammar_bitmask(
        self, logits: torch.Tensor, rows: list[SamplingRow], constrained: list[int], masks: Any
    ) -> torch.Tensor:
        """The packed masks (len(constrained), W) of the grammar rows, on the logits' device:
        those `masks` began filling (waited for), else filled now (together, where the backend
        can), on the host (in pinned memory on a GPU, copied without a wait)."""
        from radixlm.constrained import fill_next_token_bitmasks

        if masks is not None:
            t0 = time.perf_counter()
            bitmask = masks.result()
            self.mask_seconds += time.perf_counter() - t0
        else:
            bitmask = self.mask_buffer(len(constrained), logits.shape[-1], logits.is_cuda)
            fill_next_token_bitmasks([rows[i].grammar for i in constrained], bitmask)
        if not logits.is_cuda:
            return bitmask
        device_mask = bitmask.to(logits.device, non_blocking=True)
        # (the host buffer is filled again two steps on: not before this copy is done)
        self._mask_copied[self._mask_flip] = torch.cuda.Event()
        self._mask_copied[self._mask_flip].record()
        return device_mask


def greedy_ids(
    logits: torch.Tensor,
    into: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    bitmask: torch.Tensor | None = None,
    mask_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """`logits.argmax(dim=-1)`; with `into` and `rows`, also `into[rows] =` it; with a packed
    grammar `bitmask` (and `mask_rows`, see kernels/sampling.argmax_rows), over each row's
    allowed tokens. Where the fused kernels run, kernels/sampling.py's `argmax_rows`: torch
    reduces one long row in one block of threads (13 us for SmolLM2's 49k-token vocabulary on an
    H200, at batch 1 the costliest kernel of a step after the LM head), and neither the scatter
    nor the mask is a kernel of its own."""
    if _use_fused(logits) and logits.dim() == 2 and logits.stride(-1) == 1:
        return _sampling_kernels().argmax_rows(
            logits, into, rows, bitmask=bitmask, mask_rows=mask_rows
        )
    return argmax_rows_ref(logits, into, rows, bitmask, mask_rows)


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
