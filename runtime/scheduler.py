"""Continuous batching: which requests run in the next step, and how many tokens each computes.

The scheduler decides; it never touches tensors. Each step holds every running request that is
decoding (one token each) plus prompt chunks under a token budget (chunked prefill), so prefills and
decodes share a step. Under heavy load, waiting prompts are admitted in groups: a step that computes
a prompt chunk cannot replay a captured decode graph, so admitting one prompt each time a request
finishes would make nearly every step an eager one. When KV memory runs short, cached prefixes are
evicted first, then the newest running requests are preempted: their computed tokens go to the prefix cache and they wait
to resume (recomputing what was evicted meanwhile). A request is never failed for lack of memory
once admitted: one that could never fit alone is refused when it is submitted.

With priority scheduling (SGLang's `enable_priority_scheduling`), each request's `priority` ranks
it: a larger value is more urgent (a smaller one with `schedule_low_priority_values_first`), and a
request without one is the least urgent of all. Waiting requests are admitted most urgent first
(the schedule policy orders those of equal priority); one that finds no seat or no memory
preempts running requests less urgent than itself by more than
`priority_scheduling_preemption_threshold`, the least urgent (newest among equals) first, and only
when that makes room for it. Memory-short preemption takes the least urgent too. A preempted
request resumes as any preempted request does; it is never failed.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from radixlm.radix_cache.ordering import order_waiting
from radixlm.runtime.cache_manager import CacheManager
from radixlm.runtime.request import Req, ReqStatus
from radixlm.runtime.speculative.tree import DraftTree, lay_out

if TYPE_CHECKING:
    import torch


class ScheduledReq:
    """One request's part of a step: positions `start .. start + num_tokens` are computed. With a
    `draft` (speculative decoding), the last len(draft) of them are its tokens, not yet the
    request's: the step verifies them. A draft tree (runtime/speculative/tree.py) also has each
    node's request-table row (`node_rows`: the request's own for its first path, a lent row for
    the others)."""

    __slots__ = ("req", "start", "num_tokens", "samples", "draft", "node_rows")

    def __init__(
        self,
        req: Req,
        start: int,
        num_tokens: int,
        samples: bool | None = None,
        draft: tuple[int, ...] = (),
    ) -> None:
        self.req = req
        self.draft = draft
        self.node_rows: list[int] | None = None
        self.start = start  # first position computed in this step
        self.num_tokens = num_tokens  # positions computed in this step
        # whether this step ends at the request's newest token, so its logits give the next one
        # (fixed when planned: a token pending later changes the request, not the plan)
        self.samples = start + num_tokens == req.sched_len if samples is None else samples

    def __repr__(self) -> str:
        return f"ScheduledReq({self.req.rid!r}, start={self.start}, num_tokens={self.num_tokens})"


class StepPlan:
    """One step's work. The requests that decode one token, nearly all of a busy step, are kept
    as parallel lists (no object per request per step); anything else (prompt chunks, a decode
    of several tokens after jump-forward) is a ScheduledReq in `items`. Results come in the order
    decodes, then items, which is also the order iterating a plan gives (as ScheduledReq)."""

    __slots__ = ("decodes", "rows", "seq_lens", "slots", "items", "batch")

    def __init__(self) -> None:
        self.decodes: list[Req] = []  # each computes its newest token and samples the next
        self.rows: list[int] = []  # request-table row of each decode
        self.seq_lens: list[int] = []  # its length including the token computed
        # the KV slot of each decode's token (CPU int64): in the request table's host copy, and
        # written into the device copy by the step (ModelRunner)
        self.slots: torch.Tensor | None = None
        self.items: list[ScheduledReq] = []
        # decoding requests when planned (before any preemption): the speculation gate measures
        # the step under this batch's bucket
        self.batch = 0

    def __len__(self) -> int:
        return len(self.decodes) + len(self.items)

    def __iter__(self):
        for req, seq_len in zip(self.decodes, self.seq_lens):
            yield ScheduledReq(req, seq_len - 1, 1, True)
        yield from self.items

    def __repr__(self) -> str:
        return f"StepPlan({len(self.decodes)} decodes, items={self.items!r})"


class Scheduler:
    def __init__(
        self,
        cache: CacheManager,
        *,
        max_running_requests: int,
        chunked_prefill_size: int,
        schedule_policy: str,
        max_admission_delay: int = 0,
        drafter: Callable[[Req], list[int]] | None = None,
        drafting: Callable[[int, bool], bool] | None = None,
        prepare_drafts: Callable[[list[Req]], None] | None = None,
        enable_priority_scheduling: bool = False,
        schedule_low_priority_values_first: bool = False,
        priority_scheduling_preemption_threshold: int = 10,
    ) -> None:
        self.cache = cache
        self.priority_scheduling = enable_priority_scheduling
        # +1: a larger priority value is more urgent (SGLang's default); -1: a smaller one
        self.priority_sign = -1 if schedule_low_priority_values_first else 1
        self.preemption_threshold = priority_scheduling_preemption_threshold
        # speculative decoding: a draft for a request about to decode its newest token ([] for
        # none); such a request then computes [newest, *draft] as one item
        self.drafter = drafter
        # whether a step of so many decoding requests drafts at all, told whether the step is
        # decodes alone (no prompt chunk may join it) (None: always)
        self.drafting = drafting
        # called with the decoding requests before a drafting step's `drafter` calls: a drafter
        # that drafts for them all at once (a draft model) does it there
        self.prepare_drafts = prepare_drafts
        # the most token rows a verify step's graphs hold (None: no bound, no graphs): drafts
        # are cut so that a step's requests and draft tokens fit, since a larger step runs
        # eagerly (at batch 128, eager verify steps made NGRAM 0.34x of plain on an H100)
        self.max_verify_rows: int | None = None
        self.max_running = max_running_requests
        self.chunk_budget = chunked_prefill_size
        self.policy = schedule_policy
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.num_preemptions = 0
        self.num_priority_preemptions = 0  # of those, preempted for a more urgent request
        self.max_admission_delay = max_admission_delay
        self._deferred = 0  # steps admission has been put off
        self._lent: list[int] = []  # request-table rows lent to the last step's draft trees

    # ---- queue ----------------------------------------------------------------------------

    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, req: Req) -> None:
        """Take a request out (finished or aborted) and release its memory."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.cache.release(req)

    # ---- planning -------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Plan the next step; reserves the KV slots it needs. Empty when there is nothing to run."""
        for row in self._lent:  # (rows lent to draft trees; speculation runs in lockstep: the
            self.cache.rows.give_back(row)  # step that used them is done)
        self._lent = []
        plan = StepPlan()
        made_room = self.priority_scheduling and bool(self.waiting) and self._make_room()
        prefilling = self._schedule_decodes(plan)
        budget = self.chunk_budget
        # prompts already partly computed continue first
        for req in prefilling:
            if budget <= 0:
                break
            item = self._extend(req, min(budget, req.num_tokens - req.kv_len))
            if item is None:
                break
            plan.items.append(item)
            budget -= item.num_tokens
        if budget > 0 and self.waiting and (made_room or self._admission_due()):
            plan.items.extend(self._admit_waiting(budget))
        if not plan and self.running and not any(r.num_pending for r in self.running):
            # nothing fits: free memory by preempting, then plan again (progress is guaranteed
            # because a lone request always fits; with tokens pending, applying them comes first)
            self._preempt(self.running[self._victim(self.running)])
            return self.schedule()
        return plan

    def _admission_due(self) -> bool:
        """Admit waiting prompts now? At once under light load (fewer running requests than a
        quarter of `max_running`), else once there are seats for every waiting request or for an
        eighth of `max_running`, or after `max_admission_delay` steps of waiting."""
        seats = self.max_running - len(self.running)
        if (
            len(self.running) < self.max_running // 4
            or seats >= max(1, min(len(self.waiting), self.max_running // 8))
            or self._deferred >= self.max_admission_delay
        ):
            self._deferred = 0
            return True
        self._deferred += 1
        return False

    def _schedule_decodes(self, plan: StepPlan) -> list[Req]:
        """Put the decoding requests into `plan`; return those still in prefill (in order).

        A decoding request computes its newest token, or several when jump-forward appended text;
        not one whose pending token already ends it (it finishes when that token is applied)."""
        decoding: list[Req] = []
        counts: list[int] = []
        prefilling: list[Req] = []
        plain = True  # every one computes one token, read from token_buf
        for r in self.running:
            if not r.prefill_done:
                # its prompt, or output it lost to preemption, is computed in budgeted chunks (as
                # one decode the lost output went past the chunk budget, and preempted itself
                # over again); the tokens jump-forward appends go as one decode item
                prefilling.append(r)
                continue
            prompt_len, kv_len, pending = len(r.input_ids), r.kv_len, r.num_pending
            num_out = len(r.output_ids)
            n = prompt_len + num_out + pending - kv_len  # r.sched_len - r.kv_len
            if n <= 0 or (pending and num_out + pending >= r.params.max_new_tokens):
                continue  # nothing new, or finishing
            decoding.append(r)
            counts.append(n)
            if n != 1 or not r.token_in_buf:
                plain = False
        if not decoding:
            return prefilling
        total = sum(counts)
        plan.batch = len(decoding)
        drafts: list[tuple[int, ...]] = []
        rows = self.cache.rows
        alone = self._decodes_alone(prefilling)
        if self.drafter is not None and (
            self.drafting is None or self.drafting(len(decoding), alone)
        ):
            if self.prepare_drafts is not None:
                self.prepare_drafts(decoding)
            drafts = _drafts(self.drafter, decoding, counts)
            if self.max_verify_rows is not None:
                drafts = _fit_rows(drafts, self.max_verify_rows)
            # a tree's further paths borrow rows of the table; a step that may take a prompt
            # chunk verifies chains (a tree's step runs as decode rows, a chunk among them too)
            spare = rows.num_spare if alone else 0
            for i, d in enumerate(drafts):
                if isinstance(d, DraftTree):
                    need = len(d.paths()) - 1
                    if need > spare:
                        drafts[i] = d.first_path()
                    else:
                        spare -= need
            extra = sum(map(len, drafts))
            if extra and self.cache.can_extend(total + extra):
                total += extra
                counts = [n + len(d) for n, d in zip(counts, drafts)]
                plain = False
            else:  # (memory is short: no drafts this step, rather than preempting for them)
                drafts = []
        while decoding and not self.cache.can_extend(total):
            i = self._victim(decoding)  # the least urgent, the newest among equals
            self._preempt(decoding.pop(i))
            total -= counts.pop(i)
            if drafts:
                drafts.pop(i)
        if not plain:
            # those that compute several tokens (after jump-forward), or one whose input is on the
            # host only (a resumed request's last chunk left one token), go as items
            several = [
                i for i, (r, n) in enumerate(zip(decoding, counts)) if n > 1 or not r.token_in_buf
            ]
            reqs = [decoding[i] for i in several]
            starts = [r.kv_len for r in reqs]
            self.cache.extend_many(reqs, [counts[i] for i in several])
            for i, r, start in zip(several, reqs, starts):
                n, draft = counts[i], drafts[i] if drafts else ()
                item = ScheduledReq(r, start, n, True, draft)
                if isinstance(draft, DraftTree):
                    root = start + n - len(draft) - 1  # (the newest token's position)
                    item.node_rows, lent = lay_out(draft, rows, r.pool_row, root)
                    self._lent += lent
                plan.items.append(item)
            decoding = [r for r, n in zip(decoding, counts) if n == 1 and r.token_in_buf]
        if decoding:
            plan.decodes = decoding
            plan.rows, plan.seq_lens, plan.slots = self.cache.extend_decodes(decoding)
        return prefilling

    def _decodes_alone(self, prefilling: list[Req]) -> bool:
        """Whether no prompt chunk can join the step being planned: none is under way, and no
        waiting request has a seat and a row to be admitted into."""
        seats = len(self.running) < self.max_running and self.cache.rows.num_free > 0
        return not prefilling and not (self.waiting and seats)

    def _extend(self, req: Req, n: int) -> ScheduledReq | None:
        if n <= 0 or not self.cache.can_extend(n):
            return None
        start = req.kv_len
        self.cache.extend(req, n)
        return ScheduledReq(req, start, n)

    def _admit_waiting(self, budget: int) -> list[ScheduledReq]:
        admitted: list[ScheduledReq] = []
        ordered = order_waiting(
            list(self.waiting), lambda r: len(self.cache.match(r).slots), self.policy
        )
        if self.priority_scheduling:  # most urgent first; the policy's order among equals
            ordered.sort(key=lambda r: -self.urgency(r))
        fresh: list[list[int]] = []  # prompts admitted this step
        # keep one slot per running decode in reserve so admission does not force preemption
        # (requests admitted here are not decoding yet)
        reserve = sum(1 for r in self.running if r.prefill_done)
        for req in ordered:
            if budget <= 0 or len(self.running) >= self.max_running or not self.cache.rows.num_free:
                break
            if req.num_pending:
                continue  # preempted with a token still being sampled: resumes once it is known
            match = self.cache.match(req)
            if self.policy == "lpm" and _shares_uncached_prefix(
                req.all_ids, len(match.slots), fresh
            ):
                continue  # computed by a request admitted this step; it hits the cache next step
            n = min(budget, req.num_tokens - len(match.slots))
            self.cache.admit(req, match)
            if not self.cache.can_extend(n + reserve):
                self.cache.release(req)
                break
            start = req.kv_len
            self.cache.extend(req, n)
            if req.num_preemptions == 0:
                self.cache.record_first_admission(req)
            else:
                req.recompute_len = req.num_tokens
            fresh.append(req.all_ids)
            self.waiting.remove(req)
            req.status = ReqStatus.RUNNING
            self.running.append(req)
            admitted.append(ScheduledReq(req, start, n))
            budget -= n
        return admitted

    # ---- priorities -----------------------------------------------------------------------

    def urgency(self, req: Req) -> float:
        """How urgent a request is, larger first: its priority (negated when low values go
        first); without one, or without priority scheduling, the least urgent (-inf)."""
        if not self.priority_scheduling or req.priority is None:
            return -math.inf
        return self.priority_sign * req.priority

    def _outranks(self, req: Req, running: Req) -> bool:
        """May `req` preempt `running`? Only when more urgent by more than the threshold."""
        mine, theirs = self.urgency(req), self.urgency(running)
        if mine == -math.inf:
            return False
        return theirs == -math.inf or mine - theirs > self.preemption_threshold

    def _victim(self, reqs: list[Req]) -> int:
        """The index of the request to preempt first: the least urgent, the newest (last) among
        equals (without priority scheduling, simply the newest)."""
        return min(range(len(reqs)), key=lambda i: (self.urgency(reqs[i]), -i))

    def _make_room(self) -> bool:
        """Preempt running requests for more urgent waiting ones that find no seat or no memory,
        as admission will take them this step (most urgent first, within the step's prompt
        budget). A request preempts only requests it outranks, and only when that makes room
        for it; the first that cannot get room ends the pass (those after it outrank no more).
        Whether anything was preempted."""
        running = self.running
        budget = self.chunk_budget - sum(
            r.num_tokens - r.kv_len for r in running if not r.prefill_done
        )
        decoding = sum(1 for r in running if r.prefill_done)
        seats = min(self.max_running - len(running), self.cache.rows.num_free)
        # slots left once this step's decodes have theirs and one each is kept in reserve
        free = self.cache.available_slots - 2 * decoding
        # least urgent first, the newest among equals
        candidates = sorted(
            range(len(running)), key=lambda i: (self.urgency(running[i]), -i)
        )  # fmt: skip
        victims = [running[i] for i in candidates]
        chosen: list[Req] = []
        for req in sorted(self.waiting, key=lambda r: -self.urgency(r)):
            if budget <= 0 or self.urgency(req) == -math.inf:
                break
            if req.num_pending:
                continue  # (resumes once its pending token is known)
            need = min(budget, req.num_tokens - len(self.cache.match(req).slots))
            taken: list[Req] = []
            while (seats < 1 or free < need) and victims and self._outranks(req, victims[0]):
                victim = victims.pop(0)
                taken.append(victim)
                seats += 1
                free += victim.kv_len - victim.locked_len + (2 if victim.prefill_done else 0)
            if seats < 1 or free < need:
                break
            chosen.extend(taken)
            seats -= 1
            free -= need
            budget -= need
        for victim in chosen:
            self._preempt(victim)
            self.num_priority_preemptions += 1
        return bool(chosen)

    def _preempt(self, req: Req) -> None:
        self.running.remove(req)
        self.cache.release(req)
        req.status = ReqStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)


def _drafts(
    drafter: Callable[[Req], list[int]], decoding: list[Req], counts: list[int]
) -> list[tuple[int, ...]]:
    """The drafter's proposal for each request whose newest tokens are known on the host (no
    step in flight for it): one that computes its newest token, or the tokens jump-forward
    appended; () for the others."""
    return [_as_tuple(drafter(r)) if not r.num_pending else () for r in decoding]


def _fit_rows(drafts: list, max_rows: int) -> list:
    """`drafts` cut so that the step's rows (each request's newest token and its draft) number
    at most `max_rows`: every draft to the same length, a tree to its first path; none at all
    where a request cannot have one token of draft."""
    if len(drafts) + sum(map(len, drafts)) <= max_rows:
        return drafts
    room = max_rows // len(drafts) - 1
    if room < 1:
        return [() for _ in drafts]
    return [
        tuple((d.first_path() if isinstance(d, DraftTree) else d)[:room]) if len(d) > room else d
        for d in drafts
    ]


def _as_tuple(draft) -> tuple[int, ...]:
    return draft if isinstance(draft, tuple) else tuple(draft)  # (a DraftTree is one)


# Waiting for another request to compute a shared prefix pays only when the prefix is long.
_MIN_SHARED_PREFIX = 32


def _shares_uncached_prefix(tokens: list[int], cached: int, fresh: list[list[int]]) -> bool:
    """True when a request admitted this step computes at least _MIN_SHARED_PREFIX tokens that
    `tokens` also starts with, beyond its cached part."""
    end = cached + _MIN_SHARED_PREFIX
    return len(tokens) > end and any(len(o) >= end and o[:end] == tokens[:end] for o in fresh)
