"""One forward step: build the batch tensors once, run the model, sample.

`ModelRunner.launch` queues a step on the device (plan -> ForwardBatch or a CUDA graph -> logits ->
tokens) and returns a `StepHandle` whose `results()` waits for it. Each sampled
token is also left on the device in `token_buf[request row]`, so the next step can be launched
before this one's tokens reach the host: a request whose newest token is still pending
(`req.num_pending`) reads it from there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlm.runtime.forward_batch import ForwardBatch
from radixlm.runtime.sampler import Sampler, SamplingRow, top_logprobs
from radixlm.runtime.scheduler import ScheduledReq


@dataclass(slots=True)
class ReqStepResult:
    next_token: int | None = None  # None when this step did not end at the request's newest token
    logprob: float | None = None
    top_logprobs: list[tuple[float, int]] | None = None
    # input log-probabilities for prompt positions computed in this step: (logprob, token_id);
    # None when there are none (most steps: made on demand)
    input_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None


class StepHandle:
    """A launched step. `results()` waits for the device and returns the results in plan order."""

    def __init__(self, finish) -> None:
        self._finish = finish
        self._results: list[ReqStepResult] | None = None

    @classmethod
    def done(cls, results: list[ReqStepResult]) -> StepHandle:
        handle = cls(None)
        handle._results = results
        return handle

    @property
    def ready(self) -> bool:
        return self._results is not None

    def results(self) -> list[ReqStepResult]:
        if self._results is None:
            self._results = self._finish()
        return self._results


class ModelRunner:
    def __init__(
        self,
        model,
        backend,
        req_to_token: torch.Tensor,
        device: torch.device,
        graphs=None,
        token_buf: torch.Tensor | None = None,
    ) -> None:
        self.model = model
        self.backend = backend
        self.req_to_token = req_to_token
        self.device = device
        self.graphs = graphs  # a cuda_graph.DecodeGraphs, or None
        self.sampler = Sampler()
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

    def _host_buffer(self) -> torch.Tensor:
        buf = torch.zeros(self.token_buf.shape[0], dtype=torch.int64)
        return buf.pin_memory() if self.device.type == "cuda" else buf

    def launch(self, plan: list[ScheduledReq]) -> StepHandle:
        """Queue one step on the device. Sampling without log-probabilities does not wait for
        the device; anything else is finished here (the handle is then `ready`)."""
        order = sorted(range(len(plan)), key=lambda i: plan[i].num_tokens == 1)  # multi-token first
        items = [plan[i] for i in order]
        if self._graphable(items):
            logits = self._run_graph(items)
            sample_rows = {
                i: _SampleSlot(i, None if it.req.plain_greedy else _sampling_row(it.req))
                for i, it in enumerate(items)
                if it.samples
            }
            input_lp_rows: dict[int, list[tuple[int, int]]] = {}
        else:
            batch, sample_rows, input_lp_rows = self._build_batch(items)
            logits = self.model(batch, self.backend)  # (L, V)

        which = list(sample_rows)
        row_logits = logits
        logit_rows = [sample_rows[i].logit_row for i in which]
        if logit_rows != list(range(logits.shape[0])):
            row_logits = logits[torch.tensor(logit_rows, device=logits.device)]
        if all(sample_rows[i].row is None for i in which):  # plain greedy: no sampling rows built
            rows: list[SamplingRow] = []
            tokens = row_logits.argmax(dim=-1) if which else None
        else:
            rows = [sample_rows[i].row or _sampling_row(items[i].req) for i in which]
            tokens = self.sampler.sample_ids(row_logits, rows)
        if tokens is not None:
            pool_rows = torch.tensor([items[i].req.pool_row for i in which])
            self.token_buf[pool_rows.to(self.device, non_blocking=True)] = tokens

        def finish(host: torch.Tensor | None = None) -> list[ReqStepResult]:
            results = [ReqStepResult() for _ in items]
            if tokens is not None:
                ids = host[: len(which)].tolist() if host is not None else tokens.tolist()
                lps = self.sampler.logprobs(row_logits, rows, ids)
                for j, i in enumerate(which):
                    results[i].next_token = ids[j]
                    results[i].logprob, results[i].top_logprobs = lps[j]
            for i, entries in input_lp_rows.items():
                self._input_logprobs(logits, items[i], entries, results[i])
            unsorted = [ReqStepResult()] * len(plan)
            for pos, i in enumerate(order):
                unsorted[i] = results[pos]
            return unsorted

        if tokens is None or input_lp_rows or any(r.want_logprob for r in rows):
            return StepHandle.done(finish())
        host = self._host_tokens[self._flip][: len(which)]
        self._flip ^= 1
        host.copy_(tokens, non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()

        def wait() -> list[ReqStepResult]:
            if event is not None:
                event.synchronize()
            return finish(host)

        return StepHandle(wait)  # (on the CPU the tokens are there already; applied just as late)

    @staticmethod
    def _pending_input(it: ScheduledReq) -> bool:
        """Whether this item's last input token is still on the device only."""
        return it.start + it.num_tokens > it.req.num_tokens

    def _run_graph(self, items: list[ScheduledReq]) -> torch.Tensor:
        tokens, rows, seq_lens, on_device = [], [], [], []
        for it in items:
            req, pos = it.req, it.start
            pending = self._pending_input(it)  # then read from token_buf on the device
            prompt = req.input_ids
            if pending:
                tokens.append(0)
            elif pos < len(prompt):
                tokens.append(prompt[pos])
            else:
                tokens.append(req.output_ids[pos - len(prompt)])
            on_device.append(pending)
            rows.append(req.pool_row)
            seq_lens.append(pos + 1)
        return self.graphs.run(tokens, rows, seq_lens, on_device)

    def _graphable(self, items: list[ScheduledReq]) -> bool:
        """A step of single-token decodes only, small enough for a captured graph."""
        return (
            self.graphs is not None
            and self.graphs.can_run(len(items))
            and items[0].num_tokens == 1  # multi-token items sort first
            and not any(it.req.wants_input_logprobs for it in items)
        )

    # ---- batch ----------------------------------------------------------------------------

    def _build_batch(self, items: list[ScheduledReq]):
        input_ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        logits_rows: list[int] = []
        sample_rows: dict[int, _SampleSlot] = {}
        input_lp_rows: dict[int, list[tuple[int, int]]] = {}  # item -> [(logit_row, token index)]
        pending: list[tuple[int, int]] = []  # (index in input_ids, request row)
        offset = 0
        for i, it in enumerate(items):
            req = it.req
            ids = req.all_ids
            input_ids.extend(ids[it.start : it.start + it.num_tokens])
            if self._pending_input(it):  # the newest token is on the device: fixed up below
                pending.append((len(input_ids), req.pool_row))
                input_ids.append(0)
            positions.extend(range(it.start, it.start + it.num_tokens))
            rows.append(req.pool_row)
            if req.wants_input_logprobs:
                entries = self._input_logprob_positions(it)
                first_token_pending = (
                    req.logprob.logprob_start_len == 0
                    and not req.input_token_logprobs
                    and it.start == 0
                )
                if entries or first_token_pending:
                    input_lp_rows[i] = []
                    for pos, token_index in entries:
                        input_lp_rows[i].append((len(logits_rows), token_index))
                        logits_rows.append(offset + pos - it.start)
            if it.samples:
                sample_rows[i] = _SampleSlot(len(logits_rows), _sampling_row(req))
                logits_rows.append(offset + it.num_tokens - 1)
            offset += it.num_tokens

        extend_lens = [it.num_tokens for it in items]
        prefix_lens = [it.start for it in items]
        token_rows = [r for r, n in zip(rows, extend_lens) for _ in range(n)]
        # every index list travels to the device in one copy
        t, b = len(input_ids), len(items)
        packed = torch.tensor(
            input_ids + positions + token_rows + rows + extend_lens + prefix_lens + logits_rows,
            dtype=torch.int64,
        ).to(self.device, non_blocking=True)
        ids_t, pos_t, token_rows_t = packed[: 3 * t].view(3, t)
        req_rows, extend_t, prefix_t = packed[3 * t : 3 * t + 3 * b].view(3, b)
        if pending:
            at, pool_rows = torch.tensor(pending, dtype=torch.int64).to(self.device).unbind(1)
            ids_t[at] = self.token_buf[pool_rows]
        batch = ForwardBatch(
            input_ids=ids_t,
            positions=pos_t,
            out_cache_loc=self.req_to_token[token_rows_t, pos_t].long(),
            req_pool_indices=req_rows,
            prefix_lens=prefix_t,
            extend_lens=extend_t,
            seq_lens=prefix_t + extend_t,
            logits_indices=packed[3 * t + 3 * b :],
            extend_lens_cpu=extend_lens,
            prefix_lens_cpu=prefix_lens,
            num_multi=sum(1 for n in extend_lens if n > 1),
        )
        return batch, sample_rows, input_lp_rows

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
        req = it.req
        k = req.logprob.top_logprobs_num
        result.input_logprobs, result.input_top_logprobs = [], []
        idx = torch.tensor([row for row, _ in entries], dtype=torch.long)
        lp = torch.log_softmax(logits[idx], dim=-1)
        if req.logprob.logprob_start_len == 0 and not req.input_token_logprobs:
            # the first prompt token has no context to be scored from
            result.input_logprobs.append((None, req.input_ids[0]))
            result.input_top_logprobs.append(None)
        for j, (_, token_index) in enumerate(entries):
            token = req.input_ids[token_index]
            result.input_logprobs.append((float(lp[j, token]), token))
            result.input_top_logprobs.append(top_logprobs(lp[j], k) if k else None)


@dataclass
class _SampleSlot:
    logit_row: int
    row: SamplingRow | None  # None: a plain greedy request (argmax, nothing else)


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
