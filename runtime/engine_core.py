"""The engine core: model, KV memory, scheduler and the loop that drives them, in its own thread.

Clients submit requests from any thread; the core batches whatever is waiting at each step and
hands each request's progress to its sink (a callable run on the core thread, which must not block).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from radixlm.errors import EngineShutDown
from radixlm.radix_cache.base import NoPrefixCache
from radixlm.runtime.attention import create_backend
from radixlm.runtime.cache_manager import CacheManager
from radixlm.runtime.memory_pool import KVPool, ReqToTokenPool, SlotAllocator
from radixlm.runtime.model_runner import DeferredStep, ModelRunner, ReqStepResult
from radixlm.runtime.request import Req, ReqStatus
from radixlm.runtime.scheduler import Scheduler

logger = logging.getLogger(__name__)

Sink = Callable[[Req, bool], None]  # (request, finished) -> None
# The shortest forced text jumped over while the request has a step in flight, which the jump
# costs: about 3 tokens in a small batch, where the device's step is the time; about 10 in a large
# one, where the host's work is and the jump also waits for the masks filling in the background
# (measured on the H200 with 88 requests: 0.41x of unconstrained jumping from 8 bytes, 0.68x from 32)
_MIN_JUMP_BYTES_IN_FLIGHT = 8
_MIN_JUMP_BYTES_IN_FLIGHT_LARGE_BATCH = 32
_LARGE_BATCH = 16


def use_cuda_graphs(config, device, backend) -> bool:
    from radixlm.runtime.attention import TritonAttentionBackend

    return (
        not config.disable_cuda_graph
        and device.type == "cuda"
        and isinstance(backend, TritonAttentionBackend)
    )


def tune_batch1_matmuls(model) -> None:
    """For each weight shape, time cuBLAS against the Triton GEMV at batch 1 and route the layer
    to the faster (runtime/matmul_dispatch.py); then the same for each norm or SiLU with the
    matmul after it, fused into one kernel or not. Before graph capture, so graphs record the
    choice."""
    from radixlm.kernels.gemv import fused_gemv_enabled
    from radixlm.runtime.matmul_dispatch import LinearDispatch, choice_key

    dispatch = LinearDispatch()
    seen = {}
    head = getattr(model, "lm_head", None)  # its output is float32 (the logits)
    for linear in model.linears():
        key = choice_key("linear", 1, linear)
        if key not in seen:
            seen[key] = dispatch.tune(linear, rows=1, float32=linear is head)
    for op, linear, norm in model.fusable_matmuls() if fused_gemv_enabled() else []:
        key = choice_key(op, 1, linear)
        if key not in seen:
            seen[key] = dispatch.tune(linear, rows=1, op=op, norm=norm, float32=linear is head)
    model.use_matmul(dispatch)
    for (op, _, n, k, _), (base, best) in seen.items():
        logger.info(
            "batch-1 %s matmul %s: plain %.1f us, chosen %.1f us",
            op,
            (n, k),
            base * 1e3,
            best * 1e3,
        )


class SamplingFailed(RuntimeError):
    """One request's token could not be sampled (the rest of its step's were)."""


class EngineCore:
    def __init__(
        self, config, model_config, model, kv_pool: KVPool, context_len: int, device
    ) -> None:
        self.config = config
        self.context_len = context_len
        self.kv_pool = kv_pool
        self.device = device
        self.rows = ReqToTokenPool(config.max_running_requests + 1, context_len + 1, device)
        backend = create_backend(
            config.attention_backend, kv_pool, self.rows.table, device,
            num_q_heads=model_config.num_heads,
        )  # fmt: skip
        self.allocator = SlotAllocator(kv_pool.num_slots)
        if config.disable_radix_cache:
            prefix_cache = NoPrefixCache()
        else:
            from radixlm.radix_cache.radix_tree import RadixCache

            prefix_cache = RadixCache()
        self.cache = CacheManager(self.allocator, self.rows, prefix_cache)
        self.scheduler = Scheduler(
            self.cache,
            max_running_requests=config.max_running_requests,
            chunked_prefill_size=config.chunked_prefill_size,
            max_admission_delay=config.max_admission_delay,
            schedule_policy=config.schedule_policy,
        )
        graphs = prefill_graphs = None
        token_buf = torch.zeros(self.rows.max_requests, dtype=torch.int64, device=device)
        if use_cuda_graphs(config, device, backend):
            with on_device(device):  # tuning and capture follow the thread's current device
                graphs, prefill_graphs = self._capture_graphs(config, model, backend, token_buf)
        self.runner = ModelRunner(
            model, backend, self.rows.table, device, graphs, token_buf, prefill_graphs
        )
        self.overlap = not config.disable_overlap_schedule
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._sinks: dict[str, Sink] = {}
        self._progress: dict[str, Sink] = {}  # the sinks that also want every step's progress
        self._reqs: dict[str, Req] = {}
        # requests whose grammar is still compiling: not yet the scheduler's
        self._grammar_queue: dict[str, Req] = {}
        self._stop = threading.Event()
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_jump_forward_tokens = 0
        self.num_overlapped_steps = 0  # steps launched before the previous one was applied
        # the core thread's time by phase: planning, launching (with sampling unless deferred),
        # deferred sampling (grammar masks), waiting for the device, applying the tokens
        self.host_seconds = dict.fromkeys(("schedule", "launch", "sample", "wait", "apply"), 0.0)
        self._num_lockstep = 0  # unfinished requests whose steps need the previous step's tokens
        self._num_not_greedy = 0  # unfinished requests that are not plain greedy
        # unfinished requests sampled as the host says: grammar masks, penalties over the output
        self._num_sampled_on_host = 0
        self._next_masks: DeferredStep | None = None  # the step whose masks _complete begins
        self.error: str | None = None  # why the core thread stopped on its own, if it did
        # held while putting into the inbox and while stopping: what gets in is answered
        self._gate = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="radixlm-core", daemon=True)
        self._thread.start()

    def _capture_graphs(self, config, model, backend, token_buf):
        """The batch-1 matmul choices, then the decode and prompt-step CUDA graphs."""
        from radixlm.runtime.cuda_graph import DecodeGraphs, PrefillGraphs

        if os.environ.get("RADIXLM_DISABLE_GEMV") != "1":
            tune_batch1_matmuls(model)
        max_bs = config.cuda_graph_max_bs or min(config.max_running_requests, 256)
        graphs = DecodeGraphs(
            model, backend, self.rows.table, token_buf, max_bs, padding_row=self.rows.padding_row
        )
        prefill_graphs = None
        # (a step holds at most a prompt chunk and a token of every running request)
        most = config.chunked_prefill_size + config.max_running_requests
        if config.cuda_graph_max_prefill_tokens:
            prefill_graphs = PrefillGraphs(
                model, backend, self.rows.table, token_buf,
                min(config.cuda_graph_max_prefill_tokens, most), config.max_running_requests,
                padding_row=self.rows.padding_row,
            )  # fmt: skip
        return graphs, prefill_graphs

    @property
    def alive(self) -> bool:
        return not self._stop.is_set() and self._thread.is_alive()

    # ---- client side (any thread) ---------------------------------------------------------

    def submit(self, req: Req, sink: Sink, progress: bool = True) -> None:
        """Queue `req`; `sink(req, finished)` is called on the core thread when it finishes and,
        with `progress`, after every step that gives it tokens too."""
        with self._gate:
            if self._stop.is_set():
                raise EngineShutDown(self._stopped_because())
            self._inbox.put(("add", (req, sink, progress)))

    def abort(self, rid: str) -> None:
        self._inbox.put(("abort", rid))

    def call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Run `fn` on the core thread between steps and return its result."""
        done: queue.Queue = queue.Queue(maxsize=1)
        with self._gate:
            if self._stop.is_set():
                raise EngineShutDown(self._stopped_because())
            self._inbox.put(("call", (fn, done)))
        ok, value = done.get(timeout=timeout)
        if not ok:
            raise value
        return value

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(("stop", None))
        self._thread.join(timeout=30)

    def _stopped_because(self) -> str:
        if self.error is not None:
            return f"the engine stopped after an internal error ({self.error})"
        return "the engine is shut down"

    # ---- core thread ----------------------------------------------------------------------

    def _run(self) -> None:
        """The core thread. Its loop runs in inference mode: the engine's tensors may have been
        made under the caller's `torch.inference_mode()` (inference tensors take in-place updates
        only there). An error escaping the loop is a bug of ours: it stops the engine and fails
        every request, and every later call, with its message, rather than leaving them waiting."""
        message = "the engine shut down before the request finished"
        try:
            if self.device.type == "cuda":  # this thread's current device (Triton launches on it)
                torch.cuda.set_device(self.device)
            with torch.inference_mode():
                self._loop()
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}"
            message = self._stopped_because()
            logger.exception("the engine core stopped on an internal error")
        finally:
            with self._gate:  # from here on nothing more reaches the inbox
                self._stop.set()
            with torch.inference_mode():
                self._fail_everything(message)

    def _fail_everything(self, message: str) -> None:
        """Finish every request, queued or running, with `message`, and answer pending calls."""
        reqs = list(self._reqs.values()) + list(self._grammar_queue.values())
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                req, sink, _ = payload
                self._sinks[req.rid] = sink
                self._reqs[req.rid] = req
                reqs.append(req)
            elif kind == "call":
                payload[1].put((False, EngineShutDown(message)))
        for req in reqs:
            try:
                self._fail(req, message)
            except Exception:  # the state may be what broke: still tell the caller
                try:
                    req.fail(message)
                    sink = self._sinks.pop(req.rid, None)
                    if sink is not None:
                        sink(req, True)
                except Exception:
                    logger.exception("could not fail request %s", req.rid)

    def _loop(self) -> None:
        """Schedule, launch, apply. With overlap on, step N+1 is scheduled and launched before
        step N's tokens are applied, so the host's bookkeeping runs while the device computes; a
        request whose next input is N's token reads it on the device. A request N finishes has
        then computed one token too many in N+1: its result is dropped. Requests whose next step
        needs N's tokens on the host (grammar masks, penalties, log-probabilities) and anything
        arriving in the inbox make the loop apply N first."""
        inflight: tuple | None = None  # (plan, handle) of the step launched last
        while not self._stop.is_set():
            if inflight is not None and (not self._inbox.empty() or not self._can_overlap()):
                self._complete(*inflight)
                inflight = None
            self._drain_inbox(block=inflight is None and not self.scheduler.has_work())
            if self._stop.is_set():
                break
            t0 = time.perf_counter()
            plan = self.scheduler.schedule()
            t1 = time.perf_counter()
            self.host_seconds["schedule"] += t1 - t0
            if not plan:
                if inflight is not None:
                    self._complete(*inflight)
                    inflight = None
                continue
            try:
                handle = self.runner.launch(
                    plan,
                    greedy_only=not self._num_not_greedy,
                    defer_sampling=inflight is not None and self._num_sampled_on_host > 0,
                )
            except Exception as e:  # a failed step fails its requests, never the engine
                self._fail_step(plan, e)
                continue
            self.host_seconds["launch"] += time.perf_counter() - t1
            self.num_steps += 1
            for req in plan.decodes:
                req.num_pending += 1
            for item in plan.items:
                if item.samples:
                    item.req.num_pending += 1
                    item.req.token_in_buf = True
                if item.start < len(item.req.input_ids):
                    # share the prompt before it finishes: later steps, queued behind this one,
                    # may read these slots at once
                    self.cache.cache_prefix(item.req)
            if inflight is not None:
                # (a deferred step's masks begin filling once the grammars took N's tokens)
                self._next_masks = handle if isinstance(handle, DeferredStep) else None
                self._complete(*inflight)
                self._next_masks = None
                inflight = None
            if isinstance(handle, DeferredStep):
                # the previous step's tokens are applied (grammars advanced) while the device
                # runs this step's forward: now its masks and penalties can be known
                t2 = time.perf_counter()
                try:
                    handle = handle.sample()
                except Exception as e:
                    self._fail_step(plan, e)
                    continue
                self.host_seconds["sample"] += time.perf_counter() - t2
            if handle.ready or not self.overlap:
                self._complete(plan, handle)
            else:
                inflight = (plan, handle)
                self.num_overlapped_steps += 1
        if inflight is not None:
            self._complete(*inflight)

    def _can_overlap(self) -> bool:
        return self.overlap and not self._num_lockstep

    def _complete(self, plan, handle) -> None:
        t0 = time.perf_counter()
        try:
            results = handle.results()
        except Exception as e:
            self._fail_step(plan, e)
            return
        t1 = time.perf_counter()
        self.host_seconds["wait"] += t1 - t0
        self._apply_results(plan, results)
        self.host_seconds["apply"] += time.perf_counter() - t1

    def _apply_results(self, plan, results) -> None:
        tokens, extras = results.tokens, results.extras
        if self._num_sampled_on_host:
            self._advance_grammars(plan, tokens)
            if self._next_masks is not None:  # filled in the background while N is applied
                self._next_masks.begin_masks()
        apply = self._apply_contained
        if extras:
            for i, req in enumerate(plan.decodes):
                if req.num_discard:
                    req.num_discard -= 1
                    continue
                if req.num_pending:
                    req.num_pending -= 1
                apply(req, tokens[i], extras.get(i))
        else:
            self._apply_decodes(plan.decodes, tokens)
        for i, item in enumerate(plan.items, len(plan.decodes)):
            req = item.req
            if item.samples and req.num_discard:
                req.num_discard -= 1
                continue
            if item.samples and req.num_pending:
                req.num_pending -= 1
            apply(req, tokens[i], extras.get(i) if extras else None)

    @staticmethod
    def _advance_grammars(plan, tokens: list[int | None]) -> None:
        """The step's grammars take their tokens together (in the grammar backend's threads,
        where it has them), before each request's token is applied in turn."""
        matchers, taken = [], []
        sampled = [*plan.decodes, *(it.req if it.samples else None for it in plan.items)]
        for req, token in zip(sampled, tokens):
            if (
                req is not None
                and req.grammar is not None
                and token is not None
                and not req.num_discard
                and not req.is_finished
            ):
                matchers.append(req.grammar)
                taken.append(token)
        if matchers:
            from radixlm.constrained import accept_next_tokens

            accept_next_tokens(matchers, taken)

    def _apply_contained(self, req: Req, token: int, extra) -> None:
        try:
            if extra is not None and extra.error is not None:
                raise SamplingFailed(extra.error)
            self._apply(req, token, extra)
        except Exception as e:
            self._contain(req, e)

    def _contain(self, req: Req, e: Exception) -> None:
        """An error sampling or applying one request's token (its grammar's mask, detokenizer,
        stop checks) fails that request, not the engine with everyone in it."""
        what = "sampling" if isinstance(e, SamplingFailed) else "applying"
        logger.exception("%s a token of request %s failed", what, req.rid)
        if req.rid not in self._reqs:  # (finished already)
            return
        if req.status is ReqStatus.FINISHED:  # failed inside _finish: its memory is in doubt
            raise e
        if req.pool_row is not None and req.kv_len > len(req.all_ids):
            # its token was not applied: the K/V that a step in flight computes for it belongs to
            # no token (a step launched later may reuse the slot: it runs after that one)
            self.cache.truncate(req, len(req.all_ids))
        why = str(e) if isinstance(e, SamplingFailed) else f"{type(e).__name__}: {e}"
        self._fail(req, f"internal error {what} its token: {why}")

    def _apply_decodes(self, reqs: list[Req], tokens: list[int]) -> None:
        """`_apply` for a step's decodes when no request asked for log-probabilities, with the
        common case inline: a plain request (no grammar, stop strings or log-probabilities) that
        is running, has a first token already, and that this token does not finish."""
        progress = self._progress
        running = ReqStatus.RUNNING
        plain = 0
        for req, token in zip(reqs, tokens):
            if req.num_discard:  # computed before jump-forward changed its text
                req.num_discard -= 1
                continue
            if req.num_pending:
                req.num_pending -= 1
            out = req.output_ids
            try:
                if (
                    req.plain_output
                    and req.status is running
                    and out
                    and token not in req.finish_token_ids
                    and len(out) + 1 < req.max_output_len
                ):
                    out.append(token)
                    req.detokenizer.add_one(token)
                    plain += 1
                    if progress:
                        sink = progress.get(req.rid)
                        if sink is not None:
                            self._deliver(req, sink, False)
                else:
                    self._apply(req, token, None)
            except Exception as e:
                self._contain(req, e)
        self.num_generated_tokens += plain

    def _fail_step(self, plan, e: Exception) -> None:
        logger.error("step failed: %s\n%s", e, traceback.format_exc())
        for item in plan:
            req = item.req
            req.num_pending = 0
            if req.is_finished:
                continue
            keep = max(item.start, req.locked_len)
            if req.pool_row is not None and req.kv_len > keep:
                # the step's positions have no K/V: they must not reach the prefix cache. (A step
                # that fails after its launch has shared its prompt chunk with the cache already;
                # only a device error fails there, which leaves the engine unusable anyway.)
                self.cache.truncate(req, keep)
            self._fail(req, f"internal error during the forward step: {e}")

    def _drain_inbox(self, block: bool) -> None:
        try:
            msg = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = msg
            if kind == "add":
                self._add(*payload)
            elif kind == "grammar":
                req = self._grammar_queue.pop(payload, None)
                if req is not None:  # (not aborted meanwhile)
                    self._admit(req)
            elif kind == "abort":
                req = self._reqs.get(payload) or self._grammar_queue.get(payload)
                if req is not None:
                    req.finish({"type": "abort", "message": "aborted by the client"})
                    self._finish(req)
            elif kind == "call":
                fn, done = payload
                try:
                    done.put((True, fn()))
                except Exception as e:
                    done.put((False, e))
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, req: Req, sink: Sink, progress: bool) -> None:
        """A request from the inbox: to the scheduler, or to the grammar queue while its grammar
        compiles (every other request decodes meanwhile)."""
        self._sinks[req.rid] = sink
        if progress:
            self._progress[req.rid] = sink
        future = req.grammar_future
        if future is not None and not future.done():
            self._grammar_queue[req.rid] = req
            future.add_done_callback(lambda _, rid=req.rid: self._inbox.put(("grammar", rid)))
            return
        self._admit(req)

    def _admit(self, req: Req) -> None:
        """Hand `req` to the scheduler; a grammar that failed to compile (refused, too slow)
        finishes it alone, aborted with the reason."""
        try:
            future, req.grammar_future = req.grammar_future, None
            if future is not None:
                error = future.exception()
                if error is not None:
                    self._fail(req, str(error))
                    return
                req.grammar = future.result().matcher()
            req.max_output_len = min(
                req.params.max_new_tokens, self.context_len - len(req.input_ids)
            )
            lockstep, not_greedy = req.needs_lockstep, not req.plain_greedy
        except Exception as e:  # a request the checks let through: it alone fails
            self._fail(req, f"the request could not be admitted: {type(e).__name__}: {e}")
            return
        self._reqs[req.rid] = req
        self._num_lockstep += lockstep
        self._num_not_greedy += not_greedy
        self._num_sampled_on_host += req.sampled_on_host
        self.scheduler.add(req)

    def _apply(self, req: Req, token: int | None, extra: ReqStepResult | None) -> None:
        """Take one step's result for `req`: its new token (None if the step did not end at its
        newest token) and any log-probabilities. Runs for every request every step: keep it lean."""
        if req.status is ReqStatus.FINISHED:
            return
        if extra is not None and extra.input_logprobs:
            req.input_token_logprobs.extend(extra.input_logprobs)
            req.input_top_logprobs.extend(extra.input_top_logprobs)
        if token is None:
            return
        output_ids = req.output_ids
        if not output_ids:
            if req.params.max_new_tokens == 0:  # prompt scoring only
                req.finish({"type": "length", "length": 0})
                self._finish(req)
                return
            req.first_token_time = time.perf_counter()
        output_ids.append(token)
        self.num_generated_tokens += 1
        if req.logprob.return_logprob:
            lp, top = (extra.logprob, extra.top_logprobs) if extra is not None else (None, None)
            req.output_token_logprobs.append((lp, token))
            req.output_top_logprobs.append(top)
        grammar = req.grammar
        if grammar is not None and not grammar.accept_token(token):
            if not grammar.next_token_mask().any():  # every token masked: none was allowed
                self._fail(
                    req,
                    "the grammar cannot go on: no token of this model's vocabulary continues it "
                    "here (it asks for text the tokenizer cannot produce)",
                )
            else:
                self._fail(req, f"internal error: the grammar refused the sampled token {token}")
            return
        if token in req.finish_token_ids:
            req.finish({"type": "stop", "matched": token})
        else:
            detokenizer = req.detokenizer
            detokenizer.add_one(token)
            if (
                detokenizer.matched_stop is not None
                or len(output_ids) >= req.max_output_len
                or (grammar is not None and grammar.is_terminated())
            ):
                self._check_stop_or_length(req)
            elif grammar is not None and self.config.enable_jump_forward:
                self._jump_forward(req)
        if req.status is ReqStatus.FINISHED:
            self._finish(req)
        else:
            sink = self._progress.get(req.rid)
            if sink is not None:
                self._deliver(req, sink, False)

    def _check_stop_or_length(self, req: Req) -> None:
        if req.detokenizer.matched_stop is not None:
            req.finish({"type": "stop", "matched": req.detokenizer.matched_stop})
        elif req.grammar is not None and req.grammar.is_terminated():
            # complete, and nothing but EOS may follow: done now, not a step (or, at the length
            # limit, a "length") later; matched: its last token, as SGLang reports it
            req.finish({"type": "stop", "matched": req.output_ids[-1]})
        elif len(req.output_ids) >= req.max_output_len:
            req.finish({"type": "length", "length": len(req.output_ids)})

    def _jump_forward(self, req: Req) -> None:
        """Append the text the grammar forces next, tokenized the way the tokenizer tokenizes the
        whole output, so the next step computes it in one forward instead of a token a step.

        Where the forced text changes how the end of the output tokenizes (the model wrote `{` and
        `"` where the tokenizer has `{"`), those last tokens are rolled back (grammar state and KV)
        and replaced by the canonical ones. Skipped with log-probabilities on: forced tokens have
        none."""
        if req.logprob.return_logprob:
            return
        grammar = req.grammar
        text = grammar.jump_forward_string()
        if not text:
            return
        if req.num_pending:
            # with a step in flight, a jump costs that step (its token is dropped) and the next
            # one: a short forced text is cheaper sampled a token a step under the mask
            large = len(self.scheduler.running) >= _LARGE_BATCH
            if len(text.encode()) < (
                _MIN_JUMP_BYTES_IN_FLIGHT_LARGE_BATCH if large else _MIN_JUMP_BYTES_IN_FLIGHT
            ):
                return
        tokenizer = req.detokenizer.tokenizer
        ids = req.output_ids
        full = tokenizer.encode(tokenizer.decode(ids) + text, add_special_tokens=False)
        keep = _common_prefix_len(full, ids)
        dropped = ids[keep:]
        # no further than the request may go, and no more forced tokens than the grammar can
        # undo should one be refused (the rest come at the next jump)
        full = full[: min(req.max_output_len, keep + grammar.max_rollback)]
        if len(full) <= len(ids) or len(req.input_ids) + keep < req.locked_len:
            return  # nothing gained, or the tokens to replace belong to the prefix cache
        if len(dropped) > grammar.rollback_depth:
            return  # the model's own tokens to replace go back further than the grammar can undo
        grammar.rollback(len(dropped))
        accepted = grammar.accept_tokens(full[keep:])
        if accepted < len(full) - keep:  # restore the state the model's own tokens gave
            grammar.rollback(accepted)
            grammar.accept_tokens(dropped)
            return
        if dropped:
            self.cache.truncate(req, min(req.kv_len, len(req.input_ids) + keep))
            del ids[keep:]
            req.detokenizer.reset(ids)
        self.num_jump_forward_tokens += len(full) - len(ids)
        extra = full[len(ids) :]
        ids.extend(extra)
        req.token_in_buf = False  # its newest tokens are forced ones, on the host
        # a step in flight (overlap) sampled its next token after the text before the jump:
        # that token is dropped when it arrives, and the next step computes the forced text
        req.num_discard += req.num_pending
        req.num_pending = 0
        req.detokenizer.add(extra)
        self._check_stop_or_length(req)  # (the forced text may complete the grammar)

    def _finish(self, req: Req) -> None:
        if self._grammar_queue.pop(req.rid, None) is None:
            self.scheduler.remove(req)
        try:
            self._final_text(req)
        except Exception as e:  # this request's own text failed it; the engine goes on
            logger.exception("finishing the text of request %s failed", req.rid)
            req.fail(f"finishing the output failed: {type(e).__name__}: {e}")
        if self._reqs.pop(req.rid, None) is not None:
            self._num_lockstep -= req.needs_lockstep
            self._num_not_greedy -= not req.plain_greedy
            self._num_sampled_on_host -= req.sampled_on_host
        self._progress.pop(req.rid, None)
        sink = self._sinks.pop(req.rid, None)
        if sink is not None:
            self._deliver(req, sink, True)

    @staticmethod
    def _final_text(req: Req) -> None:
        req.detokenizer.flush()
        matched = req.detokenizer.matched_stop
        if matched is not None and (req.finish_reason or {}).get("type") in ("length", "stop"):
            # a stop string the held bytes completed: the text ends there, so does the reason
            req.finish_reason = {"type": "stop", "matched": matched}
        grammar = getattr(req.grammar, "grammar", None)
        if grammar is not None and grammar.lenient:  # skipped keywords: check what was made
            req.grammar_validation = grammar.validate_output(req.detokenizer.text)

    def _deliver(self, req: Req, sink: Sink, finished: bool) -> None:
        """Run a request's sink: the caller's code (a closed event loop raises there), so an error
        in it costs that request, aborted, and not the engine with everyone else's."""
        try:
            sink(req, finished)
        except Exception:
            logger.exception("the sink of request %s failed; it is aborted", req.rid)
            self._progress.pop(req.rid, None)
            self._sinks.pop(req.rid, None)
            if not finished:
                self.abort(req.rid)

    def _fail(self, req: Req, message: str) -> None:
        req.fail(message)
        self._finish(req)

    # ---- statistics -----------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        pc = self.cache.prefix_cache
        return {
            "num_running_reqs": len(self.scheduler.running),
            "num_waiting_reqs": len(self.scheduler.waiting),
            "num_grammar_queue_reqs": len(self._grammar_queue),
            "kv_pool_capacity_tokens": self.allocator.capacity,
            "kv_pool_free_tokens": self.allocator.num_free,
            "radix_cache_tokens": pc.total_size,
            "radix_cache_evictable_tokens": pc.evictable_size,
            "radix_cache_protected_tokens": pc.protected_size,
            "cache_hit_rate": self.cache.stats.hit_rate,
            "prompt_tokens": self.cache.stats.prompt_tokens,
            "cached_tokens": self.cache.stats.cached_tokens,
            "generated_tokens": self.num_generated_tokens,
            "num_steps": self.num_steps,
            "graph_steps": self.runner.num_graph_steps,
            "prefill_graph_steps": self.runner.num_prefill_graph_steps,
            "num_preemptions": self.scheduler.num_preemptions,
            "jump_forward_tokens": self.num_jump_forward_tokens,
            "overlapped_steps": self.num_overlapped_steps,
            **{f"host_seconds_{k}": v for k, v in self.host_seconds.items()},
        }


def kv_pool_tokens(
    config, model_config, dtype: torch.dtype, device: torch.device, context_len: int
) -> int:
    """Size the KV pool from free memory (or take `max_total_tokens`)."""
    per_token = KVPool.bytes_per_slot(
        model_config.num_layers, model_config.num_kv_heads, model_config.head_dim, dtype
    )
    free = free_memory(device)
    if config.max_total_tokens is not None:
        if config.max_total_tokens * per_token > free:
            raise ValueError(
                f"max_total_tokens={config.max_total_tokens} needs "
                f"{config.max_total_tokens * per_token / 2**30:.1f} GiB of KV cache and "
                f"{free / 2**30:.1f} GiB are free on {device}: ask for at most {free // per_token}"
            )
        return config.max_total_tokens
    fraction = config.mem_fraction_static or (0.85 if device.type == "cuda" else 0.25)
    tokens = int(free * fraction) // per_token
    # no use in more than every running request at full context
    tokens = min(tokens, config.max_running_requests * context_len)
    if tokens < 16:
        raise ValueError(
            f"not enough free memory for a KV cache ({free / 2**30:.1f} GiB free); "
            "lower the load, raise mem_fraction_static, or set max_total_tokens"
        )
    return tokens


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """`device` as the calling thread's current CUDA device meanwhile: Triton kernels launch,
    and CUDA graphs, streams and events are made, on the current device, not the tensors' (the
    engine on "cuda:1"); a no-op elsewhere."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def free_memory(device: torch.device) -> int:
    """Bytes free for new tensors on `device` (host: the kernel's MemAvailable)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return _available_host_memory()


def _available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
