"""The speculative worker beside the plain decode path: it drafts for the scheduler and verifies
for the model runner; the output processor takes what it accepts (`OutputProcessor.apply_tokens`).

A request with a draft is scheduled as one multi-token item [newest token, d1 .. dk] over its
cached prefix: causally a prompt chunk, so the extend path of the model runner and the attention
backends computes it, with logits kept at all k + 1 positions. The positions of rejected draft
tokens lose their KV slots as soon as the step is applied (`CacheManager.truncate`), before the
accepted tokens are taken, so they never reach the prefix cache.

Requests with a grammar, log-probabilities, penalties, a logit bias or min_new_tokens decode
plainly for now (their sampling needs the host's state at each position); a request whose draft
finds no earlier occurrence of its ending decodes plainly that step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlm.runtime.request import Req
from radixlm.runtime.speculative.ngram import NgramIndex
from radixlm.runtime.speculative.verify import greedy_accept, rejection_sample, target_probs


@dataclass(slots=True)
class SpecTotals:
    """The engine's speculative counters (engine stats)."""

    verify_steps: int = 0  # request-steps that verified a draft
    draft_tokens: int = 0  # draft tokens proposed in them
    accepted_tokens: int = 0  # of which accepted
    output_tokens: int = 0  # tokens those steps gave (accepted drafts + bonus tokens)


def speculates(req: Req) -> bool:
    """Whether `req` may be drafted for (else it decodes plainly)."""
    p = req.params
    return (
        req.grammar is None
        and not req.logprob.return_logprob
        and not p.has_penalties
        and not p.has_logit_bias
        and p.min_new_tokens == 0
    )


class SpeculativeWorker:
    def __init__(self, config) -> None:
        self.algorithm = config.speculative_algorithm  # "NGRAM" (the only one so far)
        self.num_draft_tokens = config.speculative_num_draft_tokens
        self.min_window = config.speculative_ngram_min_match_window_size
        self.max_window = config.speculative_ngram_max_match_window_size
        self.totals = SpecTotals()

    # ---- drafting (the scheduler asks) -------------------------------------------------------

    def propose(self, req: Req) -> list[int]:
        """A draft to verify after `req`'s newest token: at most num_draft_tokens - 1 tokens, and
        no more than its output may still take after the bonus token."""
        room = min(self.num_draft_tokens - 1, req.max_output_len - len(req.output_ids) - 1)
        if room <= 0 or not speculates(req):
            return []
        index = req.draft_index
        if index is None:
            index = req.draft_index = NgramIndex(self.min_window, self.max_window)
        index.update(req.input_ids, req.output_ids)
        return index.propose(room)

    # ---- verification (the model runner asks) --------------------------------------------------

    def verify(
        self, logits: torch.Tensor, reqs: list[Req], drafts: list[tuple[int, ...]], rows: list[int]
    ) -> list[list[int]]:
        """Each request's output tokens from its k + 1 logits rows starting at rows[i]: the
        accepted draft tokens, then the target's own next token."""
        out: list[list[int] | None] = [None] * len(reqs)
        greedy = [i for i, r in enumerate(reqs) if r.params.is_greedy]
        if greedy:
            at = [rows[i] + j for i in greedy for j in range(len(drafts[i]) + 1)]
            targets = logits[torch.tensor(at, device=logits.device)].argmax(dim=-1).tolist()
            offset = 0
            for i in greedy:
                k = len(drafts[i])
                out[i] = greedy_accept(targets[offset : offset + k + 1], drafts[i])
                offset += k + 1
        for i, req in enumerate(reqs):
            if out[i] is None:
                k = len(drafts[i])
                probs = target_probs(logits[rows[i] : rows[i] + k + 1], req.params)
                out[i] = rejection_sample(probs, drafts[i], req.seed, len(req.output_ids))
        return out  # type: ignore[return-value]

    def record(self, req: Req, num_drafted: int, tokens_taken: int, num_accepted: int) -> None:
        """Count one verify step of `req` (SGLang's per-request spec_* fields, and the totals)."""
        req.spec_verify_ct += 1
        req.spec_num_proposed_drafts += num_drafted
        req.spec_num_correct_drafts += num_accepted
        req.spec_verify_tokens += tokens_taken
        hist = req.spec_correct_drafts_histogram
        while len(hist) <= num_accepted:
            hist.append(0)
        hist[num_accepted] += 1
        t = self.totals
        t.verify_steps += 1
        t.draft_tokens += num_drafted
        t.accepted_tokens += num_accepted
        t.output_tokens += tokens_taken

    def stats(self) -> dict[str, float]:
        t = self.totals
        return {
            "spec_verify_ct": t.verify_steps,
            "spec_num_proposed_drafts": t.draft_tokens,
            "spec_num_correct_drafts": t.accepted_tokens,
            "spec_accept_length": t.output_tokens / t.verify_steps if t.verify_steps else 0.0,
            "spec_accept_rate": t.accepted_tokens / t.draft_tokens if t.draft_tokens else 0.0,
        }
