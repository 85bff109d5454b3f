"""From logits to tokens: penalties, masks, temperature, top-k / top-p / min-p, seeded sampling.

Sampling is reproducible per request whatever else is in the batch: each row draws its noise from
its own generator seeded by (request seed, output position), and picks argmax(p / q) with q ~ Exp(1)
(the exponential race, equivalent to sampling from p), so no row's choice depends on another row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from radixlm.runtime.sampling_params import SamplingParams

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


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float | None]  # the chosen token's log-probability, where asked
    top_logprobs: list[list[tuple[float, int]] | None]


def row_seed(seed: int, step: int) -> int:
    """Mix a request seed and a position into a 63-bit generator seed (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[tuple[float, int]]:
    values, ids = logprobs.topk(k)
    return list(zip(values.tolist(), ids.tolist()))


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,  # (B, V) float32
        rows: list[SamplingRow],
    ) -> SampleOutput:
        raw_logprobs = None
        if any(r.want_logprob for r in rows):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = logits.clone()
        for i, r in enumerate(rows):
            _apply_penalties(logits[i], r)
            if r.banned_ids:
                logits[i, list(r.banned_ids)] = float("-inf")
        constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
        if constrained:
            _apply_grammar_masks(logits, rows, constrained)

        token_ids = logits.argmax(dim=-1)
        sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if sampled:
            idx = torch.tensor(sampled)
            probs = _filtered_probs(logits[idx], [rows[i].params for i in sampled])
            for j, i in enumerate(sampled):
                gen = torch.Generator(device=logits.device)
                gen.manual_seed(row_seed(rows[i].seed, rows[i].step))
                noise = torch.empty_like(probs[j]).exponential_(generator=gen)
                token_ids[i] = (probs[j] / noise).argmax()

        ids = token_ids.tolist()
        chosen: list[float | None] = [None] * len(rows)
        tops: list[list[tuple[float, int]] | None] = [None] * len(rows)
        if raw_logprobs is not None:
            for i, r in enumerate(rows):
                if r.want_logprob:
                    chosen[i] = float(raw_logprobs[i, ids[i]])
                    if r.top_logprobs_num:
                        tops[i] = top_logprobs(raw_logprobs[i], r.top_logprobs_num)
        return SampleOutput(ids, chosen, tops)


def _apply_penalties(logits: torch.Tensor, r: SamplingRow) -> None:
    p = r.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(r.input_ids) | set(r.output_ids)), dtype=torch.long)
        if len(seen):
            vals = logits[seen]
            logits[seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
    if (p.frequency_penalty or p.presence_penalty) and r.output_ids:
        out = torch.tensor(r.output_ids, dtype=torch.long)
        counts = torch.bincount(out, minlength=logits.shape[-1])[: logits.shape[-1]].to(
            logits.dtype
        )
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Softmax at each row's temperature, with top-k, top-p and min-p applied (renormalization is
    not needed: the exponential race samples proportionally to whatever mass is left)."""
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype).unsqueeze(1)
    probs = torch.softmax(logits / temps, dim=-1)
    for j, p in enumerate(params):
        if p.min_p > 0:
            row = probs[j]
            row[row < p.min_p * row.max()] = 0.0
        if p.top_k > 0 or p.top_p < 1.0:
            row = probs[j]
            k = p.top_k if p.top_k > 0 else row.numel()
            vals, order = row.topk(min(k, row.numel()))
            if p.top_p < 1.0:
                # keep the smallest set of top tokens whose mass reaches top_p
                before = vals.cumsum(0) - vals
                vals = torch.where(before < p.top_p * row.sum(), vals, torch.zeros_like(vals))
            filtered = torch.zeros_like(row)
            filtered[order] = vals
            probs[j] = filtered
    return probs


def _apply_grammar_masks(logits: torch.Tensor, rows: list[SamplingRow], which: list[int]) -> None:
    from radixlm.constrained import allocate_token_bitmask, apply_token_bitmask_

    bitmask = allocate_token_bitmask(len(which), logits.shape[-1])
    for j, i in enumerate(which):
        rows[i].grammar.fill_next_token_bitmask(bitmask, j)
    idx = torch.tensor(which, device=logits.device)
    masked = logits[idx]
    apply_token_bitmask_(masked, bitmask.to(logits.device, non_blocking=True))
    logits[idx] = masked
