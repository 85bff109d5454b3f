"""One forward step: build the batch tensors once, run the model, sample.

`ModelRunner.launch` queues a step on the device (plan -> ForwardBatch or a CUDA graph -> logits ->
tokens) and returns a `StepHandle` whose `results()` waits for it. Each sampled
token is also left on the device in `token_buf[request row]`, so the next step can be launched
before this one's tokens reach the host: a request whose newest token is still pending
(`req.num_pending`) reads it from there.

Under tensor parallelism rank 0's runner has a `mirror` (runtime/tp_worker.py StepMirror): it
sends each step's device work, as the host lists this runner builds it from, to the other ranks'
runners before running it (`graph_step`, `eager_step`), and each token written into `token_buf`
outside a graph after it (`tokens`); they run the same methods of their own runner on them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from radixlm.runtime.forward_batch import ForwardBatch
from radixlm.runtime.sampler import Sampler, SamplingRow, logprobs_at
from radixlm.runtime.scheduler import ScheduledReq, StepPlan
from radixlm.runtime.speculative.tree import Accepted
from radixlm.runtime.speculative.worker import speculates
from radixlm.runtime.tensors import int64_tensor, packed_to_device, to_device

logger = logging.getLogger(__name__)

_LOGPROB_ROWS = 512  # prompt positions scored at once (each a vocabulary-wide float32 row)


@dataclass(slots=True)
class ReqStepResult:
    """What a step gives one request beyond its token: log-probabilities, where asked."""

    logprob: float | None = None
    top_logprobs: list[tuple[float, int]] | None = None
    # input log-probabilities for prompt positions computed in this step: (logprob, token_id);
    # None when there are none (most steps: made on demand)
    input_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    # why this request's token could not be sampled (the others of its step were): it fails
    error: str | None = None


@dataclass(slots=True)
class StepResults:
    # per plan item, its new token; None where the step did not end at the request's newest token
    tokens: list[int | None]
    extras: dict[int, ReqStepResult]  # plan index -> log-probabilities, only where asked
    # plan index -> the output tokens a verified draft gave (accepted draft tokens, then the
    # target's own next token); its entry in `tokens` is None
    verified: dict[int, list[int]] | None = None


@dataclass(slots=True)
class StepLists:
    """The index lists of an eager step, host side: one entry per token, per request (item), per
    logits row."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    token_rows: list[int] = field(default_factory=list)  # the request row of each token
    pending: list[tuple[int, int]] = field(default_factory=list)  # (token, row): in token_buf
    rows: list[int] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    prefix_lens: list[int] = field(default_factory=list)
    num_multi: int = 0  # items of more than one token
    logits_rows: list[int] = field(default_factory=list)  # token rows that need logits
    which: list[int] = field(default_factory=list)  # items that sample
    sample_rows: list[int] = field(default_factory=list)  # their rows of the logits
    input_lp_rows: dict[int, list[tuple[int, int]]] = field(
        default_factory=dict
    )  # item -> [(logits row, token index)]
    # items verifying a draft: (item, its first logits row), each with a row per position
    drafts: list[tuple[int, int]] = field(default_factory=list)
    # a speculative drafter reads the final hidden states at the logits rows (MEDUSA): kept
    # here by the forward, (L, H)
    keep_hidden: bool = False
    hidden: torch.Tensor | None = None
    # the argmax of each logits row, where the forward computed it (a step run as decode rows)
    argmax: torch.Tensor | None = None
    # a draft tree is among the items: the step must run as decode rows (its nodes' positions
    # are their depths, each on its path's request-table row)
    tree: bool = False
    # an EAGLE-3 draft reads the input of these target layers at every token of the requests
    # drafted for: their token rows, (item, first token row) of each such item, and the features
    # the forward kept there, (len(feature_rows), 3 x H)
    feature_layers: tuple[int, ...] = ()
    feature_rows: list[int] = field(default_factory=list)
    feature_items: list[tuple[int, int]] = field(default_factory=list)
    features: torch.Tensor | None = None


class StepHandle:
    """A launched step. `results()` waits for the device and returns the results in plan order."""

    def __init__(self, finish) -> None:
        self._finish = finish
        self._results: StepResults | None = None

    @classmethod
    def done(cls, results: StepResults) -> StepHandle:
        handle = cls(None)
        handle._results = results
        return handle

    @property
    def ready(self) -> bool:
        return self._results is not None

    def results(self) -> StepResults:
        if self._results is None:
            self._results = self._finish()
        return self._results


class DeferredStep:
    """A step whose forward is queued and whose sampling waits for `sample()`. `begin_masks()`,
    once the grammars have taken the previous step's tokens, starts filling this step's grammar
    masks in the background, while the caller applies the rest of that step."""

    def __init__(self, sample: Callable[[Any], StepHandle], begin: Callable[[], Any]) -> None:
        self._sample, self._begin = sample, begin
        self._masks: Any = None

    def begin_masks(self) -> None:
        if self._masks is None:
            try:
                self._masks = self._begin()
            except Exception:  # (then `sample()` fills them itself)
                logger.exception("beginning a step's grammar masks failed")

    def sample(self) -> StepHandle:
        return self._sample(self._masks)


class ModelRunner:
    def __init__(
        self,
        model,
        backend,
        req_to_token: torch.Tensor,
        device: torch.device,
        graphs=None,
        token_buf: torch.Tensor | None = None,
        prefill_graphs=None,
        verifier=None,
        mirror=None,
        row_graphs=None,
    ) -> None:
        self.model = model
        self.backend = backend
        self.req_to_token = req_to_token
        self.device = device
        self.graphs = graphs  # a cuda_graph.DecodeGraphs, or None
        self.prefill_graphs = prefill_graphs  # a cuda_graph.PrefillGraphs, or None
        self.row_graphs = row_graphs  # a cuda_graph.RowGraphs (verify steps as rows), or None
        self.sampler = Sampler()
        # speculative decoding (runtime/speculative/worker.py): verifies the steps' drafts
        self.verifier = verifier
        # tensor parallelism: the other ranks' runners, sent each step's work (or None)
        self.mirror = mirror
        # the newest sampled token of each request row, on the device
        self.token_buf = (
            token_buf
            if token_buf is not None
            else torch.zeros(req_to_token.shape[0], dtype=torch.int64, device=device)
        )
        # pinned host buffers the sampled tokens are copied into, used alternately so that a
        # step's copy never overwrites the previous step's before it is read
        self._host_tokens = [self._host_buffer(), self._host_buffer()]
        self._flip = 0
        self.num_graph_steps = 0  # decode steps replayed from a CUDA graph
        self.num_prefill_graph_steps = 0  # other steps replayed from a CUDA graph
        self.num_row_graph_steps = 0  # of which run as decode rows (RowGraphs)

    def _host_buffer(self) -> torch.Tensor:
        buf = torch.zeros(self.token_buf.shape[0], dtype=torch.int64)
        return buf.pin_memory() if self.device.type == "cuda" else buf

    def launch(
        self, plan: StepPlan, greedy_only: bool = False, defer_sampling: bool = False
    ) -> StepHandle | DeferredStep:
        """Queue one step on the device. Sampling without log-probabilities does not wait for
        the device; anything else is finished here (the handle is then `ready`). `greedy_only`
        says every request is plain greedy, so none need be checked.

        With `defer_sampling`, a step with requests to sample on the host's say (grammar masks,
        penalties) returns a DeferredStep once its forward is queued: the caller applies the
        previous step's tokens (advancing grammars) while the device computes, then calls
        `sample()` for the handle. The masks are filled then, as late as they can be."""
        input_lp_rows: dict[int, list[tuple[int, int]]] = {}
        order: list[int] | None = None
        items: list[ScheduledReq] = []
        greedy = None  # the graph's argmax, already in token_buf
        logits = None  # every logits row of an eager step
        verified = None  # plan index -> the output tokens of a verified draft
        if self._graphable(plan):  # decodes only: one logits row each, in plan order
            reqs = plan.decodes
            if self.mirror is not None:
                self.mirror.graph_step(plan.rows, plan.seq_lens, plan.slots)
            with self._lockstep():
                row_logits, greedy = self.graphs.run(plan.rows, plan.seq_lens, plan.slots)
            self.num_graph_steps += 1
            pool_rows = self.graphs.rows_on_device(len(reqs))
            at = None  # the sampled rows are the plan's, in order
        else:  # multi-token items first
            if plan.decodes and self.req_to_token.device.type != "cpu":
                self._write_decode_slots(plan)
            plan_items = list(plan)
            order = sorted(range(len(plan_items)), key=lambda i: plan_items[i].num_tokens == 1)
            items = [plan_items[i] for i in order]
            lists = self._step_lists(items)
            lists.keep_hidden = self._keeps_hidden(items)
            self._feature_rows(items, lists)
            which, logit_rows, input_lp_rows = lists.which, lists.sample_rows, lists.input_lp_rows
            use_graph = self._graph_for(lists)
            if self.mirror is not None:
                self.mirror.eager_step(plan if plan.decodes else None, lists, use_graph)
            with self._lockstep():
                logits = self.forward_lists(lists, use_graph)  # (L, V)
            self.num_prefill_graph_steps += use_graph in ("rows", "prefill")
            self.num_row_graph_steps += use_graph == "rows"
            if lists.hidden is not None and which:  # the drafter follows the sampled tokens
                hidden = lists.hidden[to_device(int64_tensor(logit_rows), logits.device)]
                self.verifier.draft_from_hidden(hidden, [items[i].req for i in which])
            if lists.drafts:
                verified = self._verify(
                    logits, items, order, lists.drafts, lists.hidden, lists.argmax
                )
            if lists.features is not None:
                self._keep_features(items, order, lists, verified)
            if logit_rows == list(range(len(logit_rows))):
                row_logits = logits[: len(logit_rows)]  # (logits may have padding rows after)
            else:
                row_logits = logits[to_device(int64_tensor(logit_rows), logits.device)]
            reqs = [items[i].req for i in which]
            pool_rows = None
            at = [order[i] for i in which]  # plan index of each sampled row
        rows: list[SamplingRow] = []
        if reqs and not (greedy_only or all(r.plain_greedy for r in reqs)):
            rows = [_sampling_row(r) for r in reqs]  # (as of now: their step numbers)
        if defer_sampling and rows:
            if pool_rows is None:  # (now: a request the previous step finishes loses its row)
                pool_rows = to_device(int64_tensor([r.pool_row for r in reqs]), self.device)
            return DeferredStep(
                lambda masks: self._sample(
                    plan, reqs, rows, row_logits, greedy, pool_rows, at, order, items,
                    logits, input_lp_rows, masks, verified,
                ),
                lambda: self.sampler.begin_masks(
                    rows, row_logits.shape[-1], row_logits.device.type == "cuda"
                ),
            )  # fmt: skip
        return self._sample(
            plan, reqs, rows, row_logits, greedy, pool_rows, at, order, items, logits,
            input_lp_rows, verified=verified,
        )  # fmt: skip

    def _verify(
        self,
        logits: torch.Tensor,
        items: list[ScheduledReq],
        order: list[int],
        drafts,
        hidden,
        argmax: torch.Tensor | None = None,
    ) -> dict[int, list[int]]:
        """The output tokens of the step's drafts (plan index -> tokens); each request's newest
        one goes into token_buf, as a sampled token does."""
        which = [items[i] for i, _ in drafts]
        tokens = self.verifier.verify(
            logits, [it.req for it in which], [it.draft for it in which], [r for _, r in drafts],
            hidden, argmax,
        )  # fmt: skip
        pool_rows, last = packed_to_device(
            [[it.req.pool_row for it in which], [t[-1] for t in tokens]], self.device
        )
        self.set_tokens(pool_rows, last)
        return {order[i]: t for (i, _), t in zip(drafts, tokens)}

    def _sample(
        self, plan, reqs, rows, row_logits, greedy, pool_rows, at, order, items, logits,
        input_lp_rows, masks=None, verified=None,
    ) -> StepHandle:  # fmt: skip
        """Sample the step's tokens (queued on the device) and return its handle."""
        tokens = None
        failed: dict[int, str] = {}  # sampled row -> why it could not be sampled
        if reqs:
            if greedy is not None and not rows:  # every request plain greedy, in the graph
                tokens = greedy
            else:
                if pool_rows is None:
                    pool_rows = to_device(int64_tensor([r.pool_row for r in reqs]), self.device)
                try:  # (the tokens go into token_buf with them)
                    tokens = self.sampler.sample_ids(
                        row_logits, rows, masks, self.token_buf, pool_rows
                    )
                    written = True
                except Exception:
                    if len(rows) <= 1:
                        raise
                    tokens = self._sample_apart(row_logits, rows, reqs, failed)
                    written = False
                self.set_tokens(pool_rows, tokens, written)

        def finish(host: torch.Tensor | None = None) -> StepResults:
            out: list[int | None]
            extras: dict[int, ReqStepResult] = {}
            if tokens is None:
                out = [None] * len(plan)
            else:
                ids = host[: len(reqs)].tolist() if host is not None else tokens.tolist()
                if at is None:
                    out = ids
                else:
                    out = [None] * len(plan)
                    for j, i in enumerate(at):
                        out[i] = ids[j]
                if any(r.want_logprob for r in rows):
                    for j, (lp, top) in enumerate(self.sampler.logprobs(row_logits, rows, ids)):
                        if rows[j].want_logprob:
                            extras[j if at is None else at[j]] = ReqStepResult(lp, top)
            for i, entries in input_lp_rows.items():
                result = extras.setdefault(order[i], ReqStepResult())
                self._input_logprobs(logits, items[i], entries, result)
            for j, why in failed.items():
                extras.setdefault(j if at is None else at[j], ReqStepResult()).error = why
            return StepResults(out, extras, verified)

        if tokens is None or input_lp_rows or failed or any(r.want_logprob for r in rows):
            return StepHandle.done(finish())
        host = self._host_tokens[self._flip][: len(reqs)]
        self._flip ^= 1
        host.copy_(tokens, non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()

        def wait() -> StepResults:
            if event is not None:
                event.synchronize()
            return finish(host)

        return StepHandle(wait)  # (on the CPU the tokens are there already; applied just as late)

    def _sample_apart(
        self, logits: torch.Tensor, rows: list[SamplingRow], reqs: list, failed: dict[int, str]
    ) -> torch.Tensor:
        """After sampling a batch raised: each row alone, so that the request whose sampling
        fails (a grammar's mask, say) fails by itself, not everyone in its step. Its entry in
        `failed` says why; its token is a placeholder that is never applied."""
        tokens = []
        for j, row in enumerate(rows):
            try:
                tokens.append(self.sampler.sample_ids(logits[j : j + 1], [row]))
            except Exception as e:
                logger.exception("sampling a token of request %s failed", reqs[j].rid)
                failed[j] = f"{type(e).__name__}: {e}"
                tokens.append(torch.zeros(1, dtype=torch.int64, device=logits.device))
        return torch.cat(tokens)

    @staticmethod
    def _plain_decode(it: ScheduledReq) -> bool:
        """One token that samples, no draft, no input log-probabilities: _step_lists' quick
        case."""
        return (
            it.num_tokens == 1
            and it.samples
            and not it.draft
            and it.node_rows is None
            and not it.req.wants_input_logprobs
        )

    @staticmethod
    def _pending_input(it: ScheduledReq) -> bool:
        """Whether this item's last input token is still on the device only."""
        return it.start + it.num_tokens - len(it.draft) > it.req.num_tokens

    def _write_decode_slots(self, plan: StepPlan) -> None:
        """The device table's entries for the plan's decodes (the scheduler wrote the host's)."""
        self.write_decode_slots(plan.rows, plan.seq_lens, plan.slots.tolist())

    def write_decode_slots(self, rows: list[int], seq_lens: list[int], slots: list[int]) -> None:
        """req_to_token[rows[i], seq_lens[i] - 1] = slots[i] on the device."""
        rows_t, positions, slots_t = packed_to_device(
            [rows, [n - 1 for n in seq_lens], slots], self.device
        )
        self.req_to_token[rows_t, positions] = slots_t.to(self.req_to_token.dtype)

    def _graph_for(self, lists: StepLists) -> str:
        """Which CUDA graphs a step that is not all plain decodes replays: "rows" (a verify step,
        or a step whose hidden states a drafter reads, of short items: RowGraphs), "prefill"
        (PrefillGraphs), or "" (none: it runs eagerly); "eager rows" for a step with a draft
        tree that no graph takes (it runs eagerly as decode rows)."""
        rg = self.row_graphs
        if lists.feature_rows:  # (of the graphs, only the decode rows' keep them)
            if (
                rg is not None
                and rg.aux_layers
                and rg.can_run(len(lists.input_ids), max(lists.extend_lens))
            ):
                return "rows"
            return "eager rows" if lists.tree else ""
        if (
            rg is not None
            and (lists.drafts or lists.keep_hidden)
            and (rg.keeps_hidden or not lists.keep_hidden)
            and rg.can_run(len(lists.input_ids), max(lists.extend_lens))
        ):
            return "rows"
        if lists.tree:
            return "eager rows"
        pg = self.prefill_graphs
        if (
            pg is not None
            and (pg.keeps_hidden or not lists.keep_hidden)
            and pg.can_run(len(lists.input_ids), len(lists.rows), len(lists.logits_rows))
        ):
            return "prefill"
        return ""

    def forward_lists(self, lists: StepLists, use_graph: str) -> torch.Tensor:
        """The logits (L, V) of an eager step given as its host lists, from the CUDA graphs
        `use_graph` names ("rows", "prefill"; `_graph_for`) or the model run eagerly."""
        if use_graph == "rows":
            logits, argmax = self.row_graphs.run(
                lists.input_ids, lists.positions, lists.token_rows, lists.pending
            )
            hidden = self.row_graphs.hidden if lists.keep_hidden else None
            if lists.feature_rows:
                lists.features = self.row_graphs.features[
                    to_device(int64_tensor(lists.feature_rows), logits.device)
                ]
            at = lists.logits_rows
            if at != list(range(len(lists.input_ids))):  # (a verify step's are every row)
                at_t = to_device(int64_tensor(at), logits.device)
                logits, argmax = logits[at_t], argmax[at_t]
                hidden = None if hidden is None else hidden[at_t]
            lists.hidden, lists.argmax = hidden, argmax
            return logits
        if use_graph == "eager rows":
            batch = self._rows_batch(lists)
            logits = self.model(batch, self.backend)
            lists.hidden, lists.features = batch.hidden_states, batch.aux_hidden_states
            return logits
        if use_graph:
            logits = self.prefill_graphs.run(
                lists.input_ids, lists.positions, lists.token_rows, lists.pending,
                lists.rows, lists.prefix_lens, lists.extend_lens, lists.logits_rows,
            )  # fmt: skip
            lists.hidden = self.prefill_graphs.hidden if lists.keep_hidden else None
            return logits
        if getattr(self.model, "stage", None) is not None:  # a pipeline stage: micro-batches
            return self.model.forward_lists(lists, self._to_batch, self.backend)
        batch = self._to_batch(lists)
        logits = self.model(batch, self.backend)
        lists.hidden, lists.features = batch.hidden_states, batch.aux_hidden_states
        return logits

    def _lockstep(self) -> contextlib.AbstractContextManager:
        """Around a step's device work once the other ranks were sent it: there an error leaves
        the group out of step, which stops the engine (the mirror's RankFailure)."""
        return contextlib.nullcontext() if self.mirror is None else self.mirror.lockstep()

    def set_tokens(
        self, pool_rows: torch.Tensor, tokens: torch.Tensor, written: bool = False
    ) -> None:
        """token_buf[pool_rows] = tokens (a step's sampled or verified tokens, on the device);
        `written`: the kernel that chose them wrote them there, the other ranks' only to do."""
        if not written:
            self.token_buf[pool_rows] = tokens
        if self.mirror is not None:
            self.mirror.tokens(pool_rows, tokens)

    def _graphable(self, plan: StepPlan) -> bool:
        """A step of single-token decodes only, small enough for a captured graph. (Their input
        is each request's newest token, which was sampled into token_buf: the graph reads it
        there, whether or not it has reached the host.)"""
        return (
            self.graphs is not None
            and not plan.items
            and self.graphs.can_run(len(plan))
            and not self._keeps_hidden(plan.decodes)
            and not (self.verifier is not None and self.verifier.feature_layers(plan.decodes))
        )

    def _feature_rows(self, items: list[ScheduledReq], lists: StepLists) -> None:
        """For an EAGLE-3 draft: the token rows of the items it drafts for, whose features the
        forward keeps (every token: a prompt chunk's, a decode's, a verify step's)."""
        if self.verifier is None:
            return
        lists.feature_layers = self.verifier.feature_layers(items)
        if not lists.feature_layers:
            return
        offset = 0
        for i, it in enumerate(items):
            if speculates(it.req):
                lists.feature_items.append((i, len(lists.feature_rows)))
                lists.feature_rows.extend(range(offset, offset + it.num_tokens))
            offset += it.num_tokens

    def _keep_features(self, items, order, lists: StepLists, verified) -> None:
        """Hand the step's features to the drafter: each item's from its first position, a
        verify step's up to its last accepted draft token (a tree's: along the path it took)."""
        spans, picked = [], []  # (picked: a step with a tree keeps these rows, in this order)
        for i, row in lists.feature_items:
            it = items[i]
            rows = range(row, row + it.num_tokens)
            if it.draft:  # (its own tokens, then the draft tokens it accepted)
                taken = verified[order[i]]
                own = it.num_tokens - len(it.draft)
                # (a tree's nodes are depth-first: the path it took picks them; a chain's first)
                nodes = taken.nodes if isinstance(taken, Accepted) else range(len(taken) - 1)
                rows = [*range(row, row + own), *(row + own + node for node in nodes)]
            if lists.tree:
                spans.append((it.req, it.start, len(picked), len(rows)))
                picked.extend(rows)
            else:  # (the rows are a run from `row`)
                spans.append((it.req, it.start, row, len(rows)))
        features = lists.features
        if lists.tree:
            features = features[to_device(int64_tensor(picked), features.device)]
        self.verifier.keep_features(spans, features)

    def _keeps_hidden(self, reqs) -> bool:
        """Whether a step of these requests keeps its final hidden states for the drafter (then
        it runs eagerly or through prompt-step graphs that keep them: the decode graphs return
        logits only)."""
        return self.verifier is not None and self.verifier.wants_hidden(reqs)

    # ---- batch ----------------------------------------------------------------------------

    def _step_lists(self, items: list[ScheduledReq]) -> StepLists:
        """The index lists of an eager step (multi-token items first), before the device."""
        out = StepLists()
        input_ids, positions, token_rows = out.input_ids, out.positions, out.token_rows
        rows, extend_lens, prefix_lens = out.rows, out.extend_lens, out.prefix_lens
        which, sample_rows, logits_rows = out.which, out.sample_rows, out.logits_rows
        offset = 0
        for i, it in enumerate(items):
            req = it.req
            if self._plain_decode(it):  # (most items at large batches) as the general path
                start, row, prompt = it.start, req.pool_row, req.input_ids
                if start >= len(prompt) + len(req.output_ids):  # (its token is on the device)
                    out.pending.append((len(input_ids), row))
                    input_ids.append(0)
                else:
                    n = len(prompt)
                    input_ids.append(prompt[start] if start < n else req.output_ids[start - n])
                positions.append(start)
                token_rows.append(row)
                rows.append(row)
                extend_lens.append(1)
                prefix_lens.append(start)
                which.append(i)
                sample_rows.append(len(logits_rows))
                logits_rows.append(offset)
                offset += 1
                continue
            # (a draft's tokens come after the request's own)
            start, end = it.start, it.start + it.num_tokens - len(it.draft)
            input_ids.extend(req.ids_slice(start, end))
            if self._pending_input(it):  # the newest token is on the device: fixed up there
                out.pending.append((len(input_ids), req.pool_row))
                input_ids.append(0)
            input_ids.extend(it.draft)
            if it.node_rows is not None:  # a draft tree (runtime/speculative/tree.py)
                root = it.start + it.num_tokens - len(it.draft) - 1
                positions.extend(range(it.start, root + 1))
                positions.extend(root + depth for depth in it.draft.depths())
                token_rows += [req.pool_row] * (root + 1 - it.start)
                token_rows += it.node_rows
                out.tree = True
            else:
                positions.extend(range(it.start, it.start + it.num_tokens))
                token_rows += [req.pool_row] * it.num_tokens
            out.rows.append(req.pool_row)
            out.extend_lens.append(it.num_tokens)
            out.prefix_lens.append(it.start)
            if it.num_tokens > 1:
                out.num_multi += 1
            if req.wants_input_logprobs:
                entries = self._input_logprob_positions(it)
                first_token_pending = (
                    req.logprob.logprob_start_len == 0
                    and not req.input_token_logprobs
                    and it.start == 0
                )
                if entries or first_token_pending:
                    out.input_lp_rows[i] = []
                    for pos, token_index in entries:
                        out.input_lp_rows[i].append((len(out.logits_rows), token_index))
                        out.logits_rows.append(offset + pos - it.start)
            if it.draft:  # verified: logits at the newest token and each draft token
                out.drafts.append((i, len(out.logits_rows)))
                first = offset + it.num_tokens - len(it.draft) - 1  # (after jump-forward's)
                out.logits_rows.extend(range(first, offset + it.num_tokens))
            elif it.samples:
                out.which.append(i)
                out.sample_rows.append(len(out.logits_rows))
                out.logits_rows.append(offset + it.num_tokens - 1)
            offset += it.num_tokens
        return out

    def _to_batch(self, lists: StepLists) -> ForwardBatch:
        """An eager step's ForwardBatch: its lists on the device, in one copy."""
        input_ids, positions, token_rows = lists.input_ids, lists.positions, lists.token_rows
        logits_rows = lists.logits_rows
        padding = 0
        if lists.num_multi and self.backend.pads_tokens:
            # cuBLAS chooses a kernel for each new matmul shape (~0.25 ms of host time a call, the
            # first time); as prompt chunks and decodes mix, nearly every step would be a new
            # shape. Padded to a few sizes, they are soon all known. The padding rows are tokens of
            # no request: position 0, K/V written to the padding slot 0, never a logits row. The
            # logits rows are padded with copies of row 0, computed and ignored.
            padding = _padded(len(input_ids)) - len(input_ids)
            input_ids = input_ids + [0] * padding
            positions = positions + [0] * padding
            token_rows = token_rows + [0] * padding
            logits_rows = logits_rows + [0] * (_padded(len(logits_rows)) - len(logits_rows))
        ids_t, pos_t, token_rows_t, req_rows, extend_t, prefix_t, logits_t, feature_t = (
            packed_to_device(
                [
                    input_ids, positions, token_rows, lists.rows, lists.extend_lens,
                    lists.prefix_lens, logits_rows, lists.feature_rows,
                ],
                self.device,
            )
        )  # fmt: skip
        if lists.pending:
            flat = [x for pair in lists.pending for x in pair]
            at, pool_rows = to_device(int64_tensor(flat), self.device).view(-1, 2).unbind(1)
            ids_t[at] = self.token_buf[pool_rows]
        out_cache_loc = self.req_to_token[token_rows_t, pos_t].long()
        if padding:
            out_cache_loc[-padding:] = 0
        return ForwardBatch(
            input_ids=ids_t,
            positions=pos_t,
            out_cache_loc=out_cache_loc,
            req_pool_indices=req_rows,
            prefix_lens=prefix_t,
            extend_lens=extend_t,
            seq_lens=prefix_t + extend_t,
            logits_indices=logits_t,
            hidden_indices=_kept_rows(lists, logits_t, feature_t),
            aux_layers=lists.feature_layers,
            extend_lens_cpu=lists.extend_lens,
            prefix_lens_cpu=lists.prefix_lens,
            num_multi=lists.num_multi,
            padding=padding,
        )

    def _rows_batch(self, lists: StepLists) -> ForwardBatch:
        """An eager step as decode rows, as RowGraphs computes one (runtime/cuda_graph.py): each
        token a row with the sequence length of its position, on its own request-table row,
        every row's K/V stored before any row attends."""
        ids_t, pos_t, rows_t, logits_t, feature_t = packed_to_device(
            [
                lists.input_ids, lists.positions, lists.token_rows, lists.logits_rows,
                lists.feature_rows,
            ],
            self.device,
        )  # fmt: skip
        if lists.pending:
            flat = [x for pair in lists.pending for x in pair]
            at, pool_rows = to_device(int64_tensor(flat), self.device).view(-1, 2).unbind(1)
            ids_t[at] = self.token_buf[pool_rows]
        batch = ForwardBatch.decode_rows(
            ids_t, pos_t, rows_t, self.req_to_token[rows_t, pos_t].long(), pos_t + 1,
            lists.positions, logits_t, _kept_rows(lists, logits_t, feature_t),
        )  # fmt: skip
        batch.aux_layers = lists.feature_layers
        return batch

    @staticmethod
    def _input_logprob_positions(it: ScheduledReq) -> list[tuple[int, int]]:
        """(position whose logits are needed, index of the prompt token they score) for the prompt
        tokens this step can score that have not been scored yet."""
        req = it.req
        start = req.logprob.logprob_start_len
        prompt_len = len(req.input_ids)
        first_unscored = start + len(req.input_token_logprobs)
        out = []
        for token_index in range(max(first_unscored, 1), prompt_len):
            pos = token_index - 1
            if it.start <= pos < it.start + it.num_tokens:
                out.append((pos, token_index))
        return out

    def _input_logprobs(self, logits, it: ScheduledReq, entries, result: ReqStepResult) -> None:
        """The prompt tokens' log-probabilities (and top lists) at `entries` (logits row, prompt
        index), a bounded slice of rows at a time (a log-softmax is rows x vocabulary float32)
        with one copy back per slice rather than one per token."""
        req = it.req
        k = req.logprob.top_logprobs_num
        result.input_logprobs, result.input_top_logprobs = [], []
        if req.logprob.logprob_start_len == 0 and not req.input_token_logprobs:
            # the first prompt token has no context to be scored from
            result.input_logprobs.append((None, req.input_ids[0]))
            result.input_top_logprobs.append(None)
        tokens = [req.input_ids[token_index] for _, token_index in entries]
        rows, ids = packed_to_device([[row for row, _ in entries], tokens], logits.device)
        for at in range(0, len(entries), _LOGPROB_ROWS):
            part = slice(at, at + _LOGPROB_ROWS)
            chosen, tops = logprobs_at(logits, rows[part], ids[part], k)
            result.input_logprobs.extend(zip(chosen, tokens[part]))
            result.input_top_logprobs.extend(tops if k else [None] * len(chosen))


def _sampling_row(req) -> SamplingRow:
    p = req.params
    banned: tuple[int, ...] = ()
    if len(req.output_ids) + req.num_pending < p.min_new_tokens and req.grammar is None:
        # (with a grammar, the grammar decides where EOS may come)
        banned = tuple(sorted(set(req.eos_token_ids) | set(p.stop_token_ids)))
    return SamplingRow(
        params=p,
        seed=req.seed,
        step=len(req.output_ids) + req.num_pending,
        input_ids=req.input_ids,
        output_ids=req.output_ids,
        banned_ids=banned,
        want_logprob=req.logprob.return_logprob,
        top_logprobs_num=req.logprob.top_logprobs_num if req.logprob.return_logprob else 0,
        grammar=req.grammar,
    )


def _kept_rows(lists: StepLists, logits_t: torch.Tensor, feature_t: torch.Tensor):
    """The rows whose hidden states an eager step keeps for a drafter: MEDUSA's, its logits
    rows' final states; an EAGLE-3 draft's, its feature rows' features; else none."""
    if lists.keep_hidden:
        return logits_t
    return feature_t if lists.feature_rows else None


def _padded(n: int) -> int:
    """`n` rounded up to a step of 1/16 of the next power of two (at least 16, at most 256): at
    most a few percent more rows, and few distinct sizes."""
    step = min(256, max(16, (1 << max(n - 1, 0).bit_length()) // 16))
    return -(-n // step) * step
