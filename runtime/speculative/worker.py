"""The speculative worker beside the plain decode path: it drafts for the scheduler and verifies
for the model runner; the output processor takes what it accepts (`OutputProcessor.apply_tokens`).

A request with a draft is scheduled as one multi-token item [newest token, d1 .. dk] over its
cached prefix: causally a prompt chunk, so the extend path of the model runner and the attention
backends computes it, with logits kept at all k + 1 positions. On a GPU the step replays graphs
that run every token as a decode row instead (runtime/cuda_graph.py RowGraphs), at about the cost
of a decode step of as many rows, and give each row's argmax with its logits. The positions of rejected draft
tokens lose their KV slots as soon as the step is applied (`CacheManager.truncate`), before the
accepted tokens are taken, so they never reach the prefix cache.

Drafters: NGRAM copies what followed the latest earlier occurrence of the context's ending
(ngram.py); STANDALONE runs a draft model (standalone.py) and EAGLE3 a one-layer draft over the
target's own features (eagle3.py: the model runner hands them over, `keep_features`), both over
the drafted-for requests at once in `prepare`; MEDUSA runs its heads (medusa.py) over the final
hidden state of the position that gave the request's newest token. The model runner hands that state over after each forward
(`wants_hidden`, `draft_from_hidden`, and `verify` for the accepted position of a draft); the
state waits in `req.draft_index` with the context length it follows, so a context that changed
since (jump-forward, a rewritten output) is not drafted for from a stale state. The heads run
over the waiting states of all requests at once when the scheduler first asks for a draft, so
steps the gate keeps plain run no heads.

With speculative_eagle_topk above 1 a request's draft (without a grammar) is a tree of that
many candidate paths (tree.py: NGRAM's matches of different lengths, MEDUSA's first-head top-k;
EAGLE3's chain with its rivals at each depth, the likeliest nodes, eagle3.py `draft_tree`),
laid out on lent request-table rows so that its step runs as decode rows and each node sees only
its ancestors; greedy acceptance follows the argmax down any branch (`accept_greedy`), sampled
acceptance tries a node's children in turn (verify.py `rejection_sample_tree`).

A request with a grammar is drafted for too: its draft is cut at the first token its grammar
does not allow from where it stands (`_grammar_prefix`: the matcher advanced over the draft and
rolled back), and each of its verify rows is masked by the grammar's state after the draft tokens
before it (`_masked_rows`), so greedy acceptance takes the masked argmax and rejection sampling
the masked distribution: exactly what plain constrained decoding would take at each position.
Requests with log-probabilities, penalties, a logit bias or min_new_tokens decode plainly for
now (their sampling needs the host's state at each position); a request whose draft finds no
earlier occurrence of its ending decodes plainly that step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from radixlm.protocol.histogram import Histogram
from radixlm.runtime.config import EAGLE_ALGORITHMS
from radixlm.runtime.request import Req
from radixlm.runtime.speculative.gate import SpeculationGate
from radixlm.runtime.speculative.ngram import NgramIndex
from radixlm.runtime.speculative.tree import Accepted, DraftTree, accept_greedy, merge_chains
from radixlm.runtime.speculative.verify import (
    greedy_accept,
    rejection_sample,
    rejection_sample_tree,
    target_probs,
)

logger = logging.getLogger(__name__)

# the steps before the gate's next try of drafting from which what a drafter reads is kept again
# (EAGLE3's features: the draft's entries for positions a plain stretch left out stay stale;
# MEDUSA's hidden state: its newest is all the heads need)
_RESUME_AHEAD = 16
# the algorithms that draft with a model of their own (`prepare`)
_OWN_MODEL = ("STANDALONE", *EAGLE_ALGORITHMS)


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
    grammar = req.grammar
    return (
        (grammar is None or not grammar.is_terminated())
        and not req.logprob.return_logprob
        and not p.has_penalties
        and not p.has_logit_bias
        and p.min_new_tokens == 0
    )


class SpeculativeWorker:
    def __init__(self, config, model=None, draft_model=None) -> None:
        """`model`: the target (MEDUSA's heads read its LM head and are checked against it);
        `draft_model`: STANDALONE's (standalone.py `DraftModel`) or EAGLE's and EAGLE3's
        (eagle3.py `Eagle3Drafter`)."""
        self.algorithm = config.speculative_algorithm  # NGRAM, MEDUSA, STANDALONE, EAGLE, EAGLE3
        # the drafter that runs a model of its own over the requests at once (`prepare`)
        self.draft_model = draft_model
        if self.algorithm in _OWN_MODEL and draft_model is None:
            raise ValueError(f"speculative_algorithm={self.algorithm} needs its draft model")
        # the drafter over the target's features (EAGLE, EAGLE3)
        self.eagle = draft_model if self.algorithm in EAGLE_ALGORITHMS else None
        self.num_draft_tokens = config.speculative_num_draft_tokens
        self.min_window = config.speculative_ngram_min_match_window_size
        self.max_window = config.speculative_ngram_max_match_window_size
        self.medusa = None
        # candidate paths a draft holds (a constrained request's: one) (speculative_eagle_topk: 1, a chain)
        self.width = config.speculative_eagle_topk
        if self.algorithm == "MEDUSA":
            from radixlm.runtime.speculative.medusa import MedusaDrafter

            self.medusa = MedusaDrafter.load(config.speculative_draft_model_path, model)
            most = self.medusa.num_heads * self.width + 1  # (a tree: each path all the heads)
            if self.num_draft_tokens is None:  # every head drafts
                self.num_draft_tokens = most
            elif self.num_draft_tokens > most:
                raise ValueError(
                    f"speculative_num_draft_tokens={self.num_draft_tokens}: the Medusa heads "
                    f"draft {most - 1} tokens (their count times speculative_eagle_topk), so a "
                    f"verify step computes at most {most} positions; use at most {most} (or "
                    "leave it unset)"
                )
        self.totals = SpecTotals()
        # tokens a verify step gave, per step: 1 (the bonus only) .. num_draft_tokens
        self.accept_lengths = Histogram(
            tuple(float(n) for n in range(1, self.num_draft_tokens + 1))
        )
        # where drafting pays, by measurement (None: draft at every step)
        self.gate = SpeculationGate() if config.speculative_adaptive else None
        # MEDUSA: the requests whose kept state the heads have not run over yet (by id: a
        # request kept again replaces itself; the heads' next run empties it)
        self._unheaded: dict[int, Req] = {}
        self._gate_batch = 0  # decoding requests of the step the gate last decided for

    def drafting(self, batch: int, measured: bool = True) -> bool:
        """Whether a step of `batch` decoding requests drafts (the scheduler asks first);
        `measured`: no prompt chunk joins the step (the gate measures only such steps)."""
        self._gate_batch = batch
        return self.gate is None or self.gate.drafting(batch, measured)

    def may_overlap(self, plan) -> bool:
        """Whether the step after `plan` may be launched before `plan`'s tokens are on the host
        (overlap scheduling): `plan` verified no drafts (a tree's rows are lent until the next
        schedule), and the gate keeps the next step plain, which needs no draft made from the
        newest tokens. Where a drafter keeps state from plain steps (EAGLE's features, MEDUSA's
        hidden states), only while the gate rests it: those steps then keep nothing."""
        if self.gate is None or any(it.draft for it in plan.items):
            return False
        if self.eagle is not None or self.medusa is not None:
            return self._resting()
        return self.gate.quiet(self._gate_batch, 1)

    def observe_step(self, plan, results, seconds: float, overlapped: float | None = None) -> None:
        """A finished step for the gate, which took `seconds` of the core thread (its scheduling
        and launch, then its wait and apply): measured when it held decodes only (no prompt
        chunk), verifying drafts or not. `overlapped`: what a step that ran in lockstep would
        have cost overlapped, which is how plain steps run once the gate keeps them plain (the
        plain way is measured at that, a verify step never overlaps)."""
        if self.gate is None or any(len(it.draft) + 1 != it.num_tokens for it in plan.items):
            return
        tokens = sum(t is not None for t in results.tokens)
        verified = bool(results.verified)
        if verified:
            tokens += sum(map(len, results.verified.values()))
        elif overlapped is not None:
            seconds = overlapped
        # (under the batch it was decided for: `_gate_batch` is the newest step's, which may
        # be the next one where the steps overlap)
        self.gate.observe(plan.batch or len(plan), verified, tokens, seconds)

    # ---- drafting (the scheduler asks) -------------------------------------------------------

    def prepare(self, decoding: list[Req]) -> None:
        """Before a drafting step's `propose` calls: STANDALONE's draft model (EAGLE3's draft)
        runs over the requests that may be drafted for, all at once (the others draft on their
        own)."""
        if self.draft_model is None:
            return
        reqs = [r for r in decoding if not r.num_pending and speculates(r) and self._room(r) > 0]
        if not reqs:
            return
        num = max(self._room(r) for r in reqs)
        try:
            chains = self.draft_model.draft(reqs, num)  # (EAGLE3's: trees where topk > 1)
        except Exception:  # (out of memory, say): the requests decode on, without drafts
            logger.exception(
                "the draft model failed; %s drafting is off from now on", self.algorithm
            )
            self.draft_model.release_all()
            self.draft_model = self.eagle = None  # (`propose` then drafts nothing)
            return
        for req, chain in zip(reqs, chains):
            req.draft_index = (len(req.input_ids) + len(req.output_ids), [chain])

    def _draft_model_lost(self) -> bool:
        return self.algorithm in _OWN_MODEL and self.draft_model is None

    def _room(self, req: Req) -> int:
        return min(self.num_draft_tokens - 1, req.max_output_len - len(req.output_ids) - 1)

    def propose(self, req: Req) -> list[int]:
        """A draft to verify after `req`'s newest token: at most num_draft_tokens - 1 tokens, and
        no more than its output may still take after the bonus token."""
        room = self._room(req)
        if room <= 0 or not speculates(req) or self._draft_model_lost():
            return []
        # a tree for a request without a grammar (a constrained one verifies a chain)
        width = self.width if req.grammar is None else 1
        if self.medusa is not None or self.draft_model is not None:
            # the chains the heads (the draft model) made for this context, if still its
            made = req.draft_index
            if made is None or made[0] != len(req.input_ids) + len(req.output_ids):
                return []
            if isinstance(made[1], torch.Tensor):  # its state, not run through the heads yet
                self._run_heads()
            chains = req.draft_index[1][:width]
        else:
            index = req.draft_index
            if index is None:
                index = req.draft_index = NgramIndex(self.min_window, self.max_window)
            index.update(req.input_ids, req.output_ids)
            chains = index.propose_many(room, width)
        if not chains:
            return []
        if len(chains) > 1:
            return tree_of(chains, room)
        made = chains[0]
        if isinstance(made, DraftTree):  # (EAGLE3's; a constrained request verifies a chain)
            if width > 1:
                return cut_tree(made, room)
            made = made.first_path()
        draft = list(made[:room])
        if req.grammar is not None and draft:
            draft = _grammar_prefix(req.grammar, draft)
        return draft

    # ---- the target's features (the model runner asks, for EAGLE3) -----------------------------

    def feature_layers(self, reqs) -> tuple[int, ...]:
        """The target layers whose input a step of these requests (Req or ScheduledReq) keeps
        at every token of the requests drafted for (`keep_features`); () for none."""
        if self.eagle is None or not any(speculates(getattr(r, "req", r)) for r in reqs):
            return ()
        if self._resting() or _in_flight(reqs):
            return ()
        return self.eagle.aux_layers

    def _resting(self) -> bool:
        """Whether the gate keeps drafting off for a while: steps then keep nothing for a
        drafter (EAGLE3's features, MEDUSA's hidden states) and run as plain decoding's."""
        return self.gate is not None and self.gate.quiet(self._gate_batch, _RESUME_AHEAD)

    def keep_features(self, spans, features: torch.Tensor) -> None:
        """The target's features at the given positions of each request (eagle3.py)."""
        if self.eagle is None:
            return
        try:
            self.eagle.keep_features(spans, features)
        except Exception:  # (as a failing draft in `prepare`: drafting stops, no request fails)
            logger.exception("the %s draft failed; drafting is off from now on", self.algorithm)
            self.eagle.release_all()
            self.draft_model = self.eagle = None

    # ---- hidden states (the model runner asks, for MEDUSA) ------------------------------------

    def wants_hidden(self, reqs) -> bool:
        """Whether a step of these requests (Req or ScheduledReq) must keep the final hidden
        states at its logits rows: a drafter reads them, and one of them is drafted for."""
        if self.medusa is None or self._resting() or _in_flight(reqs):
            return False
        return any(speculates(getattr(r, "req", r)) for r in reqs)

    def draft_from_hidden(self, hidden: torch.Tensor, reqs: list[Req]) -> None:
        """Draft for each request from its row of `hidden` (N, H): the state its step samples
        its next token from, so the chain follows that token."""
        self._draft(hidden, reqs, [1] * len(reqs))

    def _draft(self, hidden: torch.Tensor, reqs: list[Req], taken: list[int]) -> None:
        """Keep each drafted-for request's row of `hidden` (a tensor of this step's own, not a
        graph's buffer) with the context length it follows; the heads run over the rows when a
        draft is first asked for (`_run_heads`), so a step the gate keeps plain pays no heads."""
        if self.medusa is None:
            return
        for i, req in enumerate(reqs):
            if speculates(req):
                at = len(req.input_ids) + len(req.output_ids) + taken[i]
                req.draft_index = (at, hidden[i])
                self._unheaded[id(req)] = req

    def _run_heads(self) -> None:
        """The heads over every kept state not run through them yet, in one batch: each such
        request's chains (`draft_candidates`) replace its state."""
        reqs = [
            r
            for r in self._unheaded.values()
            if r.draft_index is not None and isinstance(r.draft_index[1], torch.Tensor)
        ]
        self._unheaded.clear()
        if not reqs:
            return
        hidden = torch.stack([r.draft_index[1] for r in reqs])
        num = min(self.num_draft_tokens - 1, self.medusa.num_heads)
        for req, chains in zip(reqs, self.medusa.draft_candidates(hidden, num, self.width)):
            req.draft_index = (req.draft_index[0], chains)

    # ---- verification (the model runner asks) --------------------------------------------------

    def verify(
        self,
        logits: torch.Tensor,
        reqs: list[Req],
        drafts: list[tuple[int, ...]],
        rows: list[int],
        hidden: torch.Tensor | None = None,
        argmax: torch.Tensor | None = None,
    ) -> list[list[int]]:
        """Each request's output tokens from its k + 1 logits rows starting at rows[i]: the
        accepted draft tokens, then the target's own next token. With `hidden` (the final
        hidden states at the logits rows), MEDUSA drafts the next chain from the row of the last
        accepted position, the one that gave the target's own token. `argmax`: each logits row's
        argmax, where the step computed it already."""
        out: list[list[int] | None] = [None] * len(reqs)
        masked = {
            i: _masked_rows(logits, rows[i], r.grammar, drafts[i])
            for i, r in enumerate(reqs)
            if r.grammar is not None
        }
        greedy = [i for i, r in enumerate(reqs) if r.params.is_greedy and i not in masked]
        for i, m in masked.items():
            if reqs[i].params.is_greedy:
                out[i] = greedy_accept(m.argmax(dim=-1).tolist(), drafts[i])
        trees = [i for i in greedy if isinstance(drafts[i], DraftTree)]
        if greedy:
            at = [rows[i] + j for i in greedy for j in range(len(drafts[i]) + 1)]
            if argmax is not None:  # (one copy of the step's few rows, then picked on the host)
                every = argmax.tolist()
                targets = [every[a] for a in at]
            else:
                targets = logits[torch.tensor(at, device=logits.device)].argmax(dim=-1).tolist()
            offset = 0
            for i in greedy:
                k = len(drafts[i])
                if i in trees:
                    out[i] = Accepted(*accept_greedy(targets[offset : offset + k + 1], drafts[i]))
                else:
                    out[i] = greedy_accept(targets[offset : offset + k + 1], drafts[i])
                offset += k + 1
        for i, req in enumerate(reqs):
            if out[i] is None:
                k = len(drafts[i])
                own = masked.get(i, logits[rows[i] : rows[i] + k + 1])
                probs = target_probs(own, req.params)
                if isinstance(drafts[i], DraftTree):
                    out[i] = Accepted(
                        *rejection_sample_tree(probs, drafts[i], req.seed, len(req.output_ids))
                    )
                else:
                    out[i] = rejection_sample(probs, drafts[i], req.seed, len(req.output_ids))
        if hidden is not None and self.medusa is not None:
            at = [  # the row of the last accepted position (a tree's: its node's)
                rows[i] + (t.nodes[-1] + 1 if t.nodes else 0)
                if isinstance(t, Accepted)
                else rows[i] + len(t) - 1  # type: ignore[arg-type]
                for i, t in enumerate(out)
            ]
            taken = [len(t) for t in out]  # type: ignore[arg-type]
            self._draft(hidden[torch.tensor(at, device=hidden.device)], reqs, taken)
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
        self.accept_lengths.observe(tokens_taken)
        t = self.totals
        t.verify_steps += 1
        t.draft_tokens += num_drafted
        t.accepted_tokens += num_accepted
        t.output_tokens += tokens_taken

    def stats(self) -> dict[str, object]:
        t = self.totals
        return {
            "spec_verify_ct": t.verify_steps,
            "spec_num_proposed_drafts": t.draft_tokens,
            "spec_num_correct_drafts": t.accepted_tokens,
            "spec_accept_length": t.output_tokens / t.verify_steps if t.verify_steps else 0.0,
            "spec_accept_rate": t.accepted_tokens / t.draft_tokens if t.draft_tokens else 0.0,
            "spec_accept_length_histogram": self.accept_lengths.snapshot(),
        }


def _in_flight(reqs) -> bool:
    """Whether a step of these requests (Req or ScheduledReq) is launched while an earlier step
    of one of them is in flight (overlap scheduling, where the gate keeps steps plain): such a
    step keeps nothing for a drafter, whose state pairs each position with the token after it
    (EAGLE's catch-up reads the step's input tokens on the host); the positions it leaves out
    are what a rested drafter leaves out."""
    return any(getattr(r, "req", r).num_pending for r in reqs)


def tree_of(chains: list[list[int]], room: int) -> tuple[int, ...]:
    """Several candidate chains as one draft of at most `room` tokens: the first (the drafter's
    best) keeps most of the room, each other chain gets room / (2 (paths - 1)) tokens; chains
    that begin alike share their nodes (merge_chains)."""
    share = max(1, room // (2 * (len(chains) - 1)))
    first = max(1, room - share * (len(chains) - 1))
    return merge_chains([chains[0][:first], *(c[:share] for c in chains[1:])], room)


def cut_tree(tree: DraftTree, room: int) -> tuple[int, ...]:
    """`tree`'s first `room` nodes (depth-first: every node's ancestors come before it), a
    chain where that leaves one path."""
    if len(tree) <= room:
        return tree
    parents = tree.parents[:room]
    if all(p == j - 1 for j, p in enumerate(parents)):
        return tuple(tree[:room])
    return DraftTree(tree[:room], parents)


def _grammar_prefix(grammar, draft: list[int]) -> list[int]:
    """The longest prefix of `draft` that `grammar` allows from where it stands, and that its
    matcher can undo at once (max_rollback); the matcher is left where it was."""
    n = 0
    for token in draft[: grammar.max_rollback]:
        if grammar.is_terminated() or not grammar.accept_token(token):
            break
        n += 1
    if n:
        grammar.rollback(n)
    return draft[:n]


def _masked_rows(logits: torch.Tensor, start: int, grammar, draft) -> torch.Tensor:
    """The k + 1 logits rows of a constrained request's verify, each masked by its grammar's
    state after the draft tokens before it (a copy; the matcher is left where it was). The draft
    is one the grammar allows (`_grammar_prefix` made it)."""
    from radixlm.constrained import allocate_token_bitmask, apply_token_bitmask_

    k = len(draft)
    bitmask = allocate_token_bitmask(k + 1, logits.shape[-1])
    taken = 0
    try:
        for j in range(k + 1):
            grammar.fill_next_token_bitmask(bitmask, j)
            if j < k:
                if not grammar.accept_token(draft[j]):
                    raise RuntimeError(f"the grammar refused draft token {draft[j]} it allowed")
                taken += 1
    finally:
        if taken:
            grammar.rollback(taken)
    rows = logits[start : start + k + 1].clone()
    apply_token_bitmask_(rows, bitmask.to(rows.device))
    return rows
