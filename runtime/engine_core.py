"""The engine core: model, KV memory, scheduler and the loop that drives them, in its own thread.

Clients submit requests from any thread; the core batches whatever is waiting at each step, and
its output processor (output_processor.py) takes each step's tokens into their requests and hands
their progress to their sinks (callables run on the core thread, which must not block).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from radixlm.errors import EngineShutDown
from radixlm.protocol.stats import EngineStats
from radixlm.radix_cache.base import NoPrefixCache
from radixlm.runtime import gc_freeze
from radixlm.runtime.attention import create_backend
from radixlm.runtime.cache_manager import CacheManager
from radixlm.runtime.config import EAGLE_ALGORITHMS
from radixlm.runtime.host_memory import page_size, trim_free_heap
from radixlm.runtime.memory_pool import (
    KVPool,
    ReqToTokenPool,
    SlotAllocator,
    kv_cache_storage_dtype,
)
from radixlm.runtime.model_runner import DeferredStep, ModelRunner
from radixlm.runtime.output_processor import OutputProcessor, Sink
from radixlm.runtime.parallel import RankFailure
from radixlm.runtime.request import Req
from radixlm.runtime.scheduler import Scheduler

logger = logging.getLogger(__name__)

# the most decode rows a verify step's graphs take (requests x tokens each verifies); a larger
# verify step replays the prompt-step graphs
_MAX_VERIFY_ROWS = 256


def tree_rows(config) -> int:
    """The request table's spare rows for draft trees' further paths (each tree of k paths
    borrows k - 1 for its step; a tree that finds too few left is verified as its first path)."""
    if config.speculative_algorithm is None or config.speculative_eagle_topk <= 1:
        return 0
    paths = config.speculative_eagle_topk
    if config.speculative_algorithm in (*EAGLE_ALGORITHMS, "STANDALONE"):
        # (a chain and leaves: a leaf a path off the main chain)
        # (a budget under the chain's depth cuts the chain: then up to a path a node)
        paths = max(
            config.speculative_num_draft_tokens - config.speculative_draft_depth,
            min(config.speculative_eagle_topk, config.speculative_num_draft_tokens),
        )
    return (paths - 1) * min(config.max_running_requests, 16)


def use_cuda_graphs(config, device, backend) -> bool:
    from radixlm.runtime.attention import TritonAttentionBackend

    return (
        not config.disable_cuda_graph
        and device.type == "cuda"
        and isinstance(backend, TritonAttentionBackend)
    )


def tune_small_matmuls(model, verify_rows: tuple[int, ...] = ()) -> None:
    """For each weight shape, time cuBLAS against the Triton GEMV at batch 1 and route the layer
    to the faster (runtime/matmul_dispatch.py); then the same for each norm or SiLU with the
    matmul after it, fused into one kernel or not. `verify_rows`: the row counts of speculative
    verify steps (their graphs' buckets): the plain matmuls are tuned at those too, over the
    tl.dot tiles only (the norm and SiLU before them stay kernels of their own there). Before
    graph capture, so graphs record the choice."""
    from radixlm.kernels.gemv import MAX_ROWS, fused_gemv_enabled
    from radixlm.runtime.matmul_dispatch import LinearDispatch, choice_key
    from radixlm.runtime.quantization.base import scheme_of

    dispatch = LinearDispatch()
    seen = {}
    head = getattr(model, "lm_head", None)  # its output is float32 (the logits)
    # (layers whose weights the GEMV cannot read, GGUF blocks, keep their scheme's matmul)
    gemv_linears = [m for m in model.linears() if scheme_of(m).has_gemv]
    for linear in gemv_linears:
        key = choice_key("linear", 1, linear)
        if key not in seen:
            seen[key] = dispatch.tune(linear, rows=1, float32=linear is head)
    for op, linear, norm in model.fusable_matmuls() if fused_gemv_enabled() else []:
        if not scheme_of(linear).has_gemv:
            continue
        key = choice_key(op, 1, linear)
        if key not in seen:
            seen[key] = dispatch.tune(linear, rows=1, op=op, norm=norm, float32=linear is head)
    for rows in sorted({r for r in verify_rows if 1 < r <= MAX_ROWS}):
        for linear in gemv_linears:
            key = choice_key("linear", rows, linear)
            if key not in seen:
                seen[key] = dispatch.tune(linear, rows, float32=linear is head, dot_only=True)
    model.use_matmul(dispatch)
    for (op, rows, n, k, *_), (base, best) in seen.items():
        logger.info(
            "%d-row %s matmul %s: plain %.1f us, chosen %.1f us", rows, op, (n, k), base * 1e3,
            best * 1e3,
        )  # fmt: skip


def capture_graphs(
    config,
    model,
    backend,
    rows: ReqToTokenPool,
    token_buf: torch.Tensor,
    keep_hidden: bool = False,
    verify_tokens: int | None = None,
    aux_layers: tuple[int, ...] = (),
):
    """The batch-1 matmul choices, then the decode and prompt-step CUDA graphs (the latter keeping
    the final hidden states with `keep_hidden`, for a drafter that reads them) and, with
    speculative decoding (`verify_tokens`: the most tokens a request verifies in a step), the
    graphs of verify steps run as decode rows (keeping the features an EAGLE-3 draft reads, the
    input of `aux_layers`, where it drafts). (Every rank of a tensor-parallel group captures
    the same graphs in the same order: their warm-up runs and captures hold the group's
    collectives.)"""
    from radixlm.runtime.cuda_graph import DecodeGraphs, PrefillGraphs, RowGraphs, graph_buckets

    max_bs, prompt_tokens, max_rows = graph_sizes(config, verify_tokens)
    if os.environ.get("RADIXLM_DISABLE_GEMV") != "1":
        tune_small_matmuls(model, tuple(graph_buckets(max_rows)) if verify_tokens else ())
    graphs = DecodeGraphs(
        model, backend, rows.table, token_buf, max_bs, padding_row=rows.padding_row
    )
    prefill_graphs = None
    if prompt_tokens:
        prefill_graphs = PrefillGraphs(
            model, backend, rows.table, token_buf, prompt_tokens, config.max_running_requests,
            padding_row=rows.padding_row, keep_hidden=keep_hidden,
        )  # fmt: skip
    row_graphs = None
    if verify_tokens:
        row_graphs = RowGraphs(
            model, backend, rows.table, token_buf, max_rows, verify_tokens,
            padding_row=rows.padding_row, keep_hidden=keep_hidden, aux_layers=aux_layers,
        )  # fmt: skip
    return graphs, prefill_graphs, row_graphs


class EngineCore:
    def __init__(
        self,
        config,
        model_config,
        model,
        kv_pool: KVPool,
        context_len: int,
        device,
        tp=None,
        draft_model=None,
        draft_target=None,
    ) -> None:
        """`model_config` is this rank's (its own heads); `tp`, under tensor parallelism, is rank
        0's runtime.tp_worker.TensorParallelGroup, whose other ranks run each step's plan too;
        `draft_model`: STANDALONE speculative decoding's (runtime/speculative/standalone.py) or
        EAGLE3's (runtime/speculative/eagle3.py); `draft_target`: the target as MEDUSA's heads
        read it (under tensor parallelism with its whole LM head, runtime/speculative/
        whole_vocab.py; None: `model`)."""
        self.config = config
        self.context_len = context_len
        self.kv_pool = kv_pool
        self.device = device
        table = ReqToTokenPool if tp is None else tp.request_table  # (tp: writes go to them too)
        self.rows = table(
            config.max_running_requests + 1, context_len + 1, device, tree_rows(config)
        )
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
        # speculative decoding: the worker beside the plain decode path, drafting for the
        # scheduler and verifying for the model runner (runtime/speculative/)
        self.speculative = None
        if config.speculative_algorithm is not None:
            from radixlm.runtime.speculative.worker import SpeculativeWorker

            if config.speculative_algorithm in EAGLE_ALGORITHMS:  # (its slots are the target's)
                draft_model.make_cache(
                    kv_pool.num_slots, self.rows.table, config.speculative_draft_depth - 1,
                    self.rows.padding_row,
                )  # fmt: skip
                # (its entry at a cached prefix's last position is made with the token after it)
                self.cache.recompute_cached = 1

            self.speculative = SpeculativeWorker(config, draft_target or model, draft_model)
        self.scheduler = Scheduler(
            self.cache,
            max_running_requests=config.max_running_requests,
            chunked_prefill_size=config.chunked_prefill_size,
            max_admission_delay=config.max_admission_delay,
            schedule_policy=config.schedule_policy,
            enable_priority_scheduling=config.enable_priority_scheduling,
            schedule_low_priority_values_first=config.schedule_low_priority_values_first,
            priority_scheduling_preemption_threshold=config.priority_scheduling_preemption_threshold,
            drafter=self.speculative.propose if self.speculative is not None else None,
            drafting=self.speculative.drafting if self.speculative is not None else None,
            prepare_drafts=self.speculative.prepare if self.speculative is not None else None,
        )
        graphs = prefill_graphs = row_graphs = None
        token_buf = torch.zeros(self.rows.max_requests, dtype=torch.int64, device=device)
        if use_cuda_graphs(config, device, backend):
            spec = self.speculative
            with on_device(device):  # tuning and capture follow the thread's current device
                graphs, prefill_graphs, row_graphs = capture_graphs(
                    config, model, backend, self.rows, token_buf,
                    keep_hidden=spec is not None and spec.medusa is not None,
                    aux_layers=() if spec is None or spec.eagle is None else spec.eagle.aux_layers,
                    verify_tokens=None if spec is None else spec.num_draft_tokens,
                )  # fmt: skip
        if row_graphs is not None:
            self.scheduler.max_verify_rows = row_graphs.max_rows
        self.runner = ModelRunner(
            model, backend, self.rows.table, device, graphs, token_buf, prefill_graphs,
            verifier=self.speculative, mirror=None if tp is None else tp.mirror(self.rows),
            row_graphs=row_graphs,
        )  # fmt: skip
        # (with speculation on, a step overlaps only while the gate keeps drafting off: a draft
        # is made from the newest tokens on the host; see `_can_overlap`)
        self.overlap = not config.disable_overlap_schedule
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        # the unfinished requests, and what each step's tokens do to them
        self.output = OutputProcessor(
            self.cache,
            self.scheduler,
            enable_jump_forward=config.enable_jump_forward,
            abort=self.abort,
            speculative=self.speculative,
        )
        self._stop = threading.Event()
        self.num_steps = 0
        self._trimmed_at_step = 0  # the step count when free heap memory was last given back
        self._last_step_at = 0.0  # (time.perf_counter) when the last step was launched
        self.num_overlapped_steps = 0  # steps launched before the previous one was applied
        # the core thread's time by phase: planning, launching (with sampling unless deferred),
        # deferred sampling (grammar masks), waiting for the device, applying the tokens
        self.host_seconds = dict.fromkeys(("schedule", "launch", "sample", "wait", "apply"), 0.0)
        self._next_masks: DeferredStep | None = None  # the step whose masks _complete begins
        self.error: str | None = None  # why the core thread stopped on its own, if it did
        # held while putting into the inbox and while stopping: what gets in is answered
        self._gate = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="radixlm-core", daemon=True)
        self._thread.start()

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

    def fail(self, error: Exception) -> None:
        """Stop the engine on `error`, from any thread (a tensor-parallel rank lost while the
        core waits for work): every request fails with it, as on an internal error."""
        self._inbox.put(("fatal", error))

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(("stop", None))
        self._thread.join(timeout=30)

    def release_device_memory(self) -> bool:
        """After `shutdown`: let go of the KV pool, the model runner (the weights, the CUDA
        graphs and their memory) and the request rows, so that one process can build engine after
        engine (a notebook, a benchmark's ablations) without running out of device memory.
        False, holding on to them, when the core thread has not stopped."""
        if self._thread.is_alive():
            return False
        self.kv_pool = self.runner = self.rows = self.cache = self.allocator = None
        self.scheduler = self.output = self.speculative = None
        return True

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
        submitted = []
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                req, sink, _ = payload
                submitted.append((req, sink))
            elif kind == "call":
                payload[1].put((False, EngineShutDown(message)))
        self.output.fail_all(message, submitted)

    def _loop(self) -> None:
        """Schedule, launch, apply. With overlap on, step N+1 is scheduled and launched before
        step N's tokens are applied, so the host's bookkeeping runs while the device computes; a
        request whose next input is N's token reads it on the device. A request N finishes has
        then computed one token too many in N+1: its result is dropped. Requests whose next step
        needs N's tokens on the host (log-probabilities) and anything arriving in the inbox but
        new requests (an abort, a call) make the loop apply N first."""
        inflight: tuple | None = None  # (plan, handle, its scheduling and launch's seconds)
        while not self._stop.is_set():
            gc_freeze.report()  # (long garbage collections noted since, if any)
            if inflight is not None and not self._can_overlap(inflight[0]):
                self._complete(*inflight)
                inflight = None
            inflight = self._drain_inbox(
                block=inflight is None and not self.scheduler.has_work(), inflight=inflight
            )
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
                    greedy_only=not self.output.num_not_greedy,
                    defer_sampling=inflight is not None and self.output.num_sampled_on_host > 0,
                )
            except RankFailure:  # (the group cannot run another step: the engine stops)
                raise
            except Exception as e:  # a failed step fails its requests, never the engine
                self.output.fail_step(plan, e)
                continue
            launched = time.perf_counter() - t0  # (its own host time; a deferred sampling adds)
            self.host_seconds["launch"] += launched - (t1 - t0)
            self.num_steps += 1
            self._last_step_at = t1
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
                except RankFailure:
                    raise
                except Exception as e:
                    self.output.fail_step(plan, e)
                    continue
                self.host_seconds["sample"] += time.perf_counter() - t2
                launched += time.perf_counter() - t2
            if handle.ready or not self._can_overlap(plan):
                self._complete(plan, handle, launched, waited_at_once=self._plain_overlaps())
            else:
                inflight = (plan, handle, launched)
                self.num_overlapped_steps += 1
        if inflight is not None:
            self._complete(*inflight)

    def _plain_overlaps(self) -> bool:
        """Whether plain steps would overlap once the speculation gate keeps them plain: overlap
        scheduling is on and no running request needs each step's tokens first (log-probabilities)."""
        return self.overlap and not self.output.num_lockstep

    def _can_overlap(self, plan) -> bool:
        """Whether the step after `plan` may be scheduled and launched before `plan`'s tokens
        are applied."""
        if not self.overlap or self.output.num_lockstep:
            return False
        return self.speculative is None or self.speculative.may_overlap(plan)

    def _complete(self, plan, handle, launched: float, waited_at_once: bool = False) -> None:
        """Wait for the tokens of `plan` (scheduled and launched in `launched` seconds) and
        apply them. `waited_at_once`: nothing was launched beside it, where a plain step would
        have overlapped (`_plain_overlaps`): the gate is told what it would have cost so."""
        t0 = time.perf_counter()
        try:
            results = handle.results()
        except RankFailure:
            raise
        except Exception as e:
            self.output.fail_step(plan, e)
            return
        t1 = time.perf_counter()
        self.host_seconds["wait"] += t1 - t0
        self.output.apply_step(plan, results, self._next_masks)
        t2 = time.perf_counter()
        self.host_seconds["apply"] += t2 - t1
        if self.speculative is not None:
            # the step's own host time, which in lockstep is all of it, and overlapped is what
            # each step adds to the run (its device time hidden under the next one's launch);
            # a plain step run in lockstep (the gate measuring, or trying plain once) would have
            # cost overlapped the longer of its host work and its wait for the device
            host, wait = launched + t2 - t1, t1 - t0
            self.speculative.observe_step(
                plan, results, host + wait, max(host, wait) if waited_at_once else None
            )

    def _drain_inbox(self, block: bool, inflight: tuple | None = None) -> tuple | None:
        """Take what the inbox holds. New requests (and those whose grammar is ready) join the
        scheduler beside a step in flight, `inflight`: they are in none of its work. Anything
        else (an abort, a call, a failure) first completes that step. Returns `inflight`, or
        None once it is completed."""
        if block:
            self._give_back_idle_memory()
        try:
            msg = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return inflight
        while True:
            kind, payload = msg
            if inflight is not None and kind not in ("add", "grammar"):
                self._complete(*inflight)
                inflight = None
            if kind == "add":
                self._add(*payload)
            elif kind == "grammar":
                req = self.output.grammar_queue.pop(payload, None)
                if req is not None:  # (not aborted meanwhile)
                    self._admit(req)
            elif kind == "abort":
                req = self.output.get(payload)
                if req is not None:
                    req.finish({"type": "abort", "message": "aborted by the client"})
                    self.output.finish(req)
            elif kind == "fatal":
                raise payload
            elif kind == "call":
                fn, done = payload
                try:
                    done.put((True, fn()))
                except Exception as e:
                    done.put((False, e))
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return inflight

    def _give_back_idle_memory(self) -> None:
        """Idle for half a second after some steps: their freed host memory goes back to the
        system (runtime/host_memory.py); under load this never runs."""
        if self._trimmed_at_step == self.num_steps:
            return
        if time.perf_counter() - self._last_step_at >= 0.5:
            self._trimmed_at_step = self.num_steps
            trim_free_heap()
            self.release_free_kv()

    def release_free_kv(self) -> None:
        """Give back the KV pool's memory of the slots used and freed since: those above the
        slots still in use, then the runs between them long enough to hold whole pages (on a
        CPU; the pool's pages become resident when written). When idle, and after the prefix
        cache is flushed (core thread)."""
        pool = self.kv_pool
        pool.release_slots(*self.allocator.reclaim_free_tail())
        if pool.k[0].device.type == "cpu":
            # (a run of two pages' worth of slots holds a whole page in each layer's K and V)
            for start, end in self.allocator.free_runs(-(-2 * page_size() // pool.slot_bytes)):
                pool.release_slots(start, end)

    def _add(self, req: Req, sink: Sink, progress: bool) -> None:
        """A request from the inbox: to the scheduler, or to the grammar queue while its grammar
        compiles (every other request decodes meanwhile)."""
        self.output.track(req, sink, progress)
        future = req.grammar_future
        if future is not None and not future.done():
            self.output.grammar_queue[req.rid] = req
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
                    self.output.fail(req, str(error))
                    return
                req.grammar = future.result().matcher()
            req.max_output_len = min(
                req.params.max_new_tokens, self.context_len - len(req.input_ids)
            )
            self.output.register(req)
        except Exception as e:  # a request the checks let through: it alone fails
            self.output.fail(req, f"the request could not be admitted: {type(e).__name__}: {e}")
            return
        self.scheduler.add(req)

    # ---- statistics -----------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """The levels and totals (on the core thread, between two steps: see `call`)."""
        pc = self.cache.prefix_cache
        return EngineStats(
            num_running_reqs=len(self.scheduler.running),
            num_waiting_reqs=len(self.scheduler.waiting),
            num_grammar_queue_reqs=len(self.output.grammar_queue),
            kv_pool_capacity_tokens=self.allocator.capacity,
            kv_pool_free_tokens=self.allocator.num_free,
            radix_cache_tokens=pc.total_size,
            radix_cache_evictable_tokens=pc.evictable_size,
            radix_cache_protected_tokens=pc.protected_size,
            cache_hit_rate=self.cache.stats.hit_rate,
            prompt_tokens=self.cache.stats.prompt_tokens,
            cached_tokens=self.cache.stats.cached_tokens,
            generated_tokens=self.output.num_generated_tokens,
            num_steps=self.num_steps,
            graph_steps=self.runner.num_graph_steps,
            prefill_graph_steps=self.runner.num_prefill_graph_steps,
            num_preemptions=self.scheduler.num_preemptions,
            num_priority_preemptions=self.scheduler.num_priority_preemptions,
            jump_forward_tokens=self.output.num_jump_forward_tokens,
            overlapped_steps=self.num_overlapped_steps,
            **{f"host_seconds_{k}": v for k, v in self.host_seconds.items()},
            host_seconds_sample_masks=self.runner.sampler.mask_seconds if self.runner else 0.0,
            **(self.speculative.stats() if self.speculative is not None else {}),
        )


def kv_bytes_per_slot(config, model_config, dtype: torch.dtype) -> int:
    """The bytes one token takes in a KV pool of `model_config`'s heads (all its layers), for a
    model computing in `dtype` and a pool storing what `config.kv_cache_dtype` says."""
    return KVPool.bytes_per_slot(
        model_config.num_layers, model_config.num_kv_heads, model_config.head_dim,
        kv_cache_storage_dtype(config.kv_cache_dtype, dtype),
    )  # fmt: skip


def graph_sizes(config, verify_tokens: int | None) -> tuple[int, int, int]:
    """What `capture_graphs` captures: the decode graphs' largest batch, the prompt-step graphs'
    most tokens (0: none) and the verify graphs' most rows (0: none; `verify_tokens`, the most
    tokens a request verifies in a step, None without speculative decoding)."""
    max_bs = config.cuda_graph_max_bs or min(config.max_running_requests, 256)
    max_rows = min(max_bs * verify_tokens, _MAX_VERIFY_ROWS) if verify_tokens else 0
    # (a step holds at most a prompt chunk and a token of every running request)
    most = (config.chunked_prefill_size or 0) + config.max_running_requests
    return max_bs, min(config.cuda_graph_max_prefill_tokens, most), max_rows


def graph_output_bytes(config, vocab_size: int) -> int:
    """The bytes the CUDA graphs of `capture_graphs` keep as their outputs: each graph its own
    float32 logits, a row a request of a decode graph's batch, a row a request of a prompt-step
    graph and a row a token of a verify graph (graphs share their working memory, not their
    outputs; the hidden states some keep add under 1% to this). On an 80 GB GPU an 8B model's
    graphs for 1,000 requests keep ~11 GB this way: the KV pool is sized from what is free less
    this. (Where the drafter alone knows how many tokens a request verifies, MEDUSA's heads, the
    verify graphs are counted at their most rows.)"""
    from radixlm.runtime.cuda_graph import graph_buckets, prefill_buckets

    if config.disable_cuda_graph or config.attention_backend == "torch":
        return 0  # (no graphs: see use_cuda_graphs)
    verify = None
    if config.speculative_algorithm:
        verify = config.speculative_num_draft_tokens or _MAX_VERIFY_ROWS
    max_bs, prompt_tokens, max_rows = graph_sizes(config, verify)
    rows = sum(graph_buckets(max_bs))
    if prompt_tokens:
        rows += sum(min(t, config.max_running_requests) for t in prefill_buckets(prompt_tokens))
    if max_rows:
        rows += sum(graph_buckets(max_rows))
    return rows * vocab_size * 4


def kv_pool_tokens(
    config, model_config, dtype: torch.dtype, device: torch.device, context_len: int
) -> int:
    """Size the KV pool from free memory (or take `max_total_tokens`), for a model computing in
    `dtype` and a pool storing what `config.kv_cache_dtype` says."""
    per_token = kv_bytes_per_slot(config, model_config, dtype)
    free = free_memory(device)
    graphs = graph_output_bytes(config, model_config.vocab_size) if device.type == "cuda" else 0
    free = max(free - graphs, 0)  # (what the graphs captured after the pool will keep)
    kept = (
        f" (past the {graphs / 2**30:.1f} GiB the CUDA graphs' outputs keep: less with a smaller "
        "cuda_graph_max_bs or cuda_graph_max_prefill_tokens)"
        if graphs
        else ""
    )
    if config.max_total_tokens is not None:
        if config.max_total_tokens * per_token > free:
            raise ValueError(
                f"max_total_tokens={config.max_total_tokens} needs "
                f"{config.max_total_tokens * per_token / 2**30:.1f} GiB of KV cache and "
                f"{free / 2**30:.1f} GiB are free on {device}{kept}: ask for at most "
                f"{free // per_token}"
            )
        return config.max_total_tokens
    fraction = config.mem_fraction_static or (0.85 if device.type == "cuda" else 0.25)
    tokens = int(free * fraction) // per_token
    # no use in more than every running request at full context
    tokens = min(tokens, config.max_running_requests * context_len)
    if tokens < 16:
        raise ValueError(
            f"not enough free memory for a KV cache ({free / 2**30:.1f} GiB free{kept}); "
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
