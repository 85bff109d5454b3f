"""The offline engine: SGLang's `Engine` API over radixlm's engine core.

engine = radixlm.Engine()   # the embedded default model
out = engine.generate("The capital of France is", {"max_new_tokens": 16, "temperature": 0})
out["text"], out["output_ids"], out["meta_info"]
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import itertools
import logging
import os
import queue
import random
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from typing import Any

import torch

from radixlm.errors import EngineShutDown
from radixlm.protocol.histogram import Histogram
from radixlm.protocol.prompt_tokens import encode_prompt
from radixlm.protocol.sampling_params import SamplingParams, check_priority
from radixlm.protocol.stats import EngineStats
from radixlm.runtime import gc_freeze, startup
from radixlm.runtime.config import EAGLE_ALGORITHMS, EngineConfig
from radixlm.runtime.detokenizer import IncrementalDetokenizer
from radixlm.runtime.engine_core import EngineCore, kv_bytes_per_slot
from radixlm.runtime.memory_pool import KVPool
from radixlm.runtime.model_config import ModelConfig, generation_eos_ids
from radixlm.runtime.model_setup import build_kv_pool, build_model, rank_kv_tokens
from radixlm.runtime.request import LogprobRequest, Req

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

GRAMMAR_COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


def auto_dtype(device: torch.device, hf_config: Any) -> str:
    """dtype "auto": float32 on the CPU; on a GPU the checkpoint's half type (a float16
    checkpoint stays float16: bfloat16 would drop three bits of each weight), else bfloat16,
    or float16 on a GPU without bfloat16 (before Ampere)."""
    if device.type != "cuda":
        return "float32"
    saved = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if saved in (torch.float16, "float16"):
        return "float16"
    return "bfloat16" if torch.cuda.get_device_capability(device) >= (8, 0) else "float16"


class Engine:
    """An in-process inference engine. Thread-safe: calls from many threads or coroutines are
    batched together by the engine core, which runs in its own thread."""

    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        self.config = config = EngineConfig.from_kwargs(model_path, **kwargs)
        t0 = time.perf_counter()
        from radixlm.runtime import model_loader

        self.device = torch.device(
            config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        )
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"device={config.device!r}, but torch {torch.__version__} has no CUDA device "
                "available; use device='cpu'"
            )
        if self.device.type == "cuda" and (self.device.index or 0) >= torch.cuda.device_count():
            raise ValueError(
                f"device={config.device!r}, but torch sees only {torch.cuda.device_count()} "
                "CUDA device(s), numbered from 0"
            )
        if self.device.type == "cuda" and self.device.index is None:  # "cuda": the current one
            self.device = torch.device("cuda", torch.cuda.current_device())
        dummy = config.load_format == "dummy"
        folder = model_loader.resolve_model_folder(
            config.model_path, config.cache_dir, need_weights=not dummy
        )
        self.model_folder = folder
        startup.say(f"loading {folder.name}: its tokenizer and settings")
        self.tokenizer = model_loader.load_tokenizer(config.tokenizer_path or folder)
        if config.chat_template is not None:
            from radixlm.runtime.chat_templates import load_chat_template

            self.tokenizer.chat_template = load_chat_template(config.chat_template)
        hf_config = model_loader.load_hf_config(folder)
        dtype_name = config.dtype
        if dtype_name == "auto":
            dtype_name = auto_dtype(self.device, hf_config)
        self.dtype = _DTYPES[dtype_name]
        self.model_config = mc = ModelConfig.from_hf(hf_config)
        self.context_len = mc.context_limit(config.context_length)
        if config.chunked_prefill_size in (None, -1):  # resolved here: the value in use reported
            chunk = 8192 if self.device.type == "cuda" else 2048
            if config.chunked_prefill_size == -1:  # no chunking: a whole prompt in one step
                chunk = self.context_len
            self.config = config = dataclasses.replace(config, chunked_prefill_size=chunk)
        # (sampled: the ids the tokenizer has; past them, padding)
        sampled_vocab = self._tokenizer_vocab_end(mc.vocab_size)
        # tensor or pipeline parallelism: this process is rank 0 (the first stage), whose engine
        # core decides every step
        self._tp = tp = partition = stage = None
        local = mc  # the model as this rank holds it (its own heads, its own layers, or both)
        if config.tp_size > 1:
            from radixlm.runtime.parallel import Partition

            partition = Partition.of(mc, 0, config.tp_size)
            local = partition.local_config(mc)
        if config.pp_size > 1:
            from radixlm.runtime.pipeline import Stage

            stage = Stage.of(mc, 0, config.pp_size)  # (more stages than layers: refused here)
            local = stage.local_config(local)
            if self.device.type == "cuda" and not config.disable_cuda_graph:
                startup.say("pipeline parallelism: CUDA graphs are off (not captured under pp)")
                self.config = config = dataclasses.replace(config, disable_cuda_graph=True)
            splits = [Stage.of(mc, r, config.pp_size) for r in range(config.pp_size)]
            startup.say(
                f"pipeline parallelism: {config.pp_size} stages of layers "
                + ", ".join(f"[{s.start}, {s.end})" for s in splits)
                + (f", each over {config.tp_size} tensor-parallel ranks" if partition else "")
            )
        if config.world_size > 1:
            from radixlm.runtime.tp_worker import TensorParallelGroup, rank_device

            # (a split that cannot be made, or too few GPUs: refused before any process starts)
            rank_device(str(self.device), config.world_size // config.nnodes - 1)
            self._tp = tp = TensorParallelGroup(config, self.device)
        try:
            if tp is not None:
                tp.start(
                    {
                        "config": dataclasses.asdict(config), "folder": str(folder),
                        "dtype": dtype_name, "context_len": self.context_len,
                        "sampled_vocab": sampled_vocab, "device": str(self.device),
                        "threads": torch.get_num_threads(),  # (on the CPU: as many as rank 0's)
                    }
                )  # fmt: skip
            startup.say(f"building the model on {self.device} ({dtype_name})")
            self.model = model = build_model(
                config, folder, mc, self.dtype, self.device, self.context_len, sampled_vocab,
                partition, None if partition is None else tp.stage_comm, stage=stage,
            )  # fmt: skip
            if stage is not None:
                from radixlm.runtime.pipeline import PipelineStageModel

                self.model = model = PipelineStageModel(
                    model, stage, tp.comm, self.dtype, self.device,
                    config.pp_micro_batch_min_tokens, tp_size=config.tp_size,
                )  # fmt: skip
            draft_model, draft_target = None, model
            if tp is not None and config.speculative_algorithm in (*EAGLE_ALGORITHMS, "MEDUSA"):
                from radixlm.runtime.speculative.whole_vocab import (
                    drafter_parts,
                    whole_vocab_target,
                )

                # (the drafter runs in this process alone: it reads the whole vocabulary's rows)
                draft_target = whole_vocab_target(
                    model, folder, config.load_format, self.dtype, self.device, config.random_seed,
                    drafter_parts(config), mc,
                )  # fmt: skip
            if config.speculative_algorithm == "STANDALONE":  # (its weights before the KV pools)
                from radixlm.runtime.speculative.standalone import DraftModel

                draft_model = DraftModel.load(
                    config, self.tokenizer, self.dtype, self.device, self.context_len
                )
            elif config.speculative_algorithm in EAGLE_ALGORITHMS:  # (its pool beside the target's)
                from radixlm.runtime.speculative.eagle3 import Eagle3Drafter

                draft_model = Eagle3Drafter.load(config, draft_target, self.dtype, self.device)
            num_slots = rank_kv_tokens(config, local, self.dtype, self.device, self.context_len)
            if draft_model is not None:  # (its pool holds as many tokens: the room split)
                num_slots = draft_model.kv_share(
                    num_slots, kv_bytes_per_slot(config, local, self.dtype)
                )
            if tp is not None:
                num_slots = tp.agree_kv_slots(num_slots)
            kv_pool = build_kv_pool(config, local, num_slots, self.dtype, self.device)
            if config.speculative_algorithm == "STANDALONE":  # (EAGLE3's: in the engine core)
                draft_model.make_cache(num_slots)
        except BaseException:
            if tp is not None:
                tp.shutdown()
            raise
        self.eos_token_ids = (
            frozenset(mc.eos_token_ids)
            | frozenset(generation_eos_ids(folder))
            | ({self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set())
        )
        startup.say(f"starting the engine core (KV pool: {num_slots} tokens, {_kv_name(kv_pool)})")
        try:
            self._core = EngineCore(
                config, local, model, kv_pool, self.context_len, self.device, tp, draft_model,
                draft_target,
            )  # fmt: skip
        except BaseException:
            if tp is not None:
                tp.shutdown()
            raise
        if tp is not None:  # a rank lost from here on stops the engine
            tp.watch(self._core.fail)
        # the grammar compiler reads the tokenizer (about a second) in a thread of its own from
        # now on, as the engine starts serving: the first constrained request finds it ready. Not
        # a daemon: the interpreter waits for it before it exits. As a daemon, still reading the
        # tokenizer in native code while the interpreter finalized, it crashed the process
        # (SIGSEGV with no Python frame, seen in short `radixlm generate` runs under load)
        self._grammar_setup: Future = Future()
        threading.Thread(
            target=self._build_grammar_compiler, name="radixlm-grammar-setup", daemon=False
        ).start()
        self._grammar_times = Histogram(GRAMMAR_COMPILE_BUCKETS)
        self._profiler: Any = None
        self._rng = random.Random(config.random_seed)
        self._ids = itertools.count()
        self._closed = False
        self._gc_frozen = False
        gc_freeze.watch(config.gc_warning_threshold_secs)
        if not config.disable_gc_freeze:
            self.freeze_gc()
        startup.say(
            f"engine ready in {time.perf_counter() - t0:.1f}s: {folder.name} on {self.device} "
            f"({dtype_name}), KV pool {num_slots} tokens ({_kv_name(kv_pool)})"
        )

    # ---- the API --------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] | None = None,
        stream: bool = False,
        priority: int | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Generate for one prompt (a dict back) or a list (a list back, n outputs per prompt).

        Grammars (regex, json_schema, ebnf) compile in worker threads while the engine runs the
        rest. In a list, an item whose grammar is refused or does not compile in time comes back
        alone with finish_reason {"type": "abort", "message": why}; for a single prompt it is a
        ValueError (GrammarError) raised here.

        With stream=True (one prompt, n=1), returns an iterator of snapshots whose `text` and
        `output_ids` are cumulative; the last one carries the finish reason.

        `priority` (SGLang's): with `enable_priority_scheduling`, more urgent requests are
        admitted first and may preempt less urgent ones (runtime/scheduler.py); without it the
        value is ignored."""
        reqs, single = self._make_requests(
            prompt, sampling_params, input_ids, return_logprob, logprob_start_len, top_logprobs_num,
            priority,
        )  # fmt: skip
        if stream:
            self._check_streamable(reqs)
            return self._stream_sync(reqs[0])
        done: queue.Queue[dict[str, Any]] = queue.Queue()
        for req in reqs:
            self._core.submit(req, _final_only(lambda out: done.put(out)), progress=False)
        outs = {}
        for _ in reqs:
            out = done.get()
            outs[out["meta_info"]["id"]] = out
        results = [outs[r.rid] for r in reqs]
        return results[0] if single and len(results) == 1 else results

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] | None = None,
        stream: bool = False,
        priority: int | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[dict[str, Any]]:
        """Like `generate`, from a coroutine; with stream=True it returns an async iterator."""
        # A long prompt's tokenizing can take a while: off the event loop. A short call's is
        # made here: handed to a thread, each is one more thread contending for the GIL, and
        # 96 requests at once kept the default executor's 20 threads (on a 16-core host) busy
        # while the engine core waited for the GIL at every torch call (a first step's
        # scheduling took 120-150 ms there). A grammar compiles in the compiler's threads
        # meanwhile; a single request waits for it here, without holding a thread.
        args = (
            prompt, sampling_params, input_ids, return_logprob, logprob_start_len, top_logprobs_num,
            priority, False,
        )  # fmt: skip
        if _short(prompt, input_ids):
            reqs, single = self._make_requests(*args)
        else:
            reqs, single = await asyncio.to_thread(self._make_requests, *args)
        if single and reqs[0].grammar_future is not None:
            await asyncio.wrap_future(reqs[0].grammar_future)  # (a refused grammar raises here)
        loop = asyncio.get_running_loop()
        if stream:
            self._check_streamable(reqs)
            return self._stream_async(reqs[0], loop)
        futures = []
        for req in reqs:
            fut = loop.create_future()
            self._core.submit(req, _final_only(_resolver(loop, fut)), progress=False)
            futures.append(fut)
        try:
            results = list(await asyncio.gather(*futures))
        except asyncio.CancelledError:  # a caller's timeout: free the seats and KV slots too
            for req in reqs:
                if not req.is_finished:
                    self._core.abort(req.rid)
            raise
        return results[0] if single and len(results) == 1 else results

    def flush_cache(self) -> bool:
        """Empty the prefix cache. False (nothing flushed) while any request is running."""

        def flush() -> bool:
            if self._core.scheduler.has_work() or not self._core.cache.flush():
                return False
            self._core.release_free_kv()  # (the cached prefixes' memory, on a CPU)
            spec = self._core.speculative
            if spec is not None and spec.draft_model is not None:
                spec.draft_model.release_all()
            return True

        return self._core.call(flush)

    def get_stats(self) -> EngineStats:
        """The core's levels and totals (a frozen record, also readable as a mapping), with
        `grammar_compile_seconds` (bucket counts, sum, count) of the time each constrained
        request waited for its grammar (a compile or a cache hit)."""
        stats = self._core.call(self._core.stats)
        return dataclasses.replace(stats, grammar_compile_seconds=self._grammar_times.snapshot())

    def start_profile(self, output_dir: str) -> None:
        """Start torch.profiler on the engine core's thread (CPU, and CUDA when on a GPU); the
        trace is written into `output_dir` by `stop_profile`."""
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        try:
            os.makedirs(output_dir, exist_ok=True)
        except OSError as e:  # the caller's folder: bad input, whichever process asks
            raise ValueError(f"output_dir {output_dir!r} cannot be used: {e}") from e

        def begin() -> None:
            if self._profiler is not None:
                raise ValueError("the profiler is already running; stop it first")
            prof = profile(activities=activities, record_shapes=True, with_stack=False)
            prof.start()
            self._profiler = (prof, output_dir)

        self._core.call(begin)

    def stop_profile(self) -> str:
        """Stop the profiler and write its Chrome trace; returns the trace file's path."""

        def end() -> tuple[Any, str]:
            if self._profiler is None:
                raise ValueError("the profiler is not running; start it first")
            prof, output_dir = self._profiler
            self._profiler = None
            prof.stop()
            return prof, output_dir

        prof, output_dir = self._core.call(end)
        path = os.path.join(
            output_dir, f"radixlm-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.trace.json"
        )
        prof.export_chrome_trace(path)
        return path

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def freeze_gc(self) -> None:
        """Collect garbage once, then freeze every object alive (gc.freeze, for the whole
        process; runtime/gc_freeze.py): the garbage collector's full passes then skip them. Done
        when the engine is ready (unless disable_gc_freeze); call it again after a warm-up
        (SGLang's freeze_gc) to freeze what that left alive too. Objects frozen are not
        collected until the last engine that froze shuts down, garbage among them included
        (requests in flight when it is called)."""
        if self._closed:
            raise EngineShutDown("the engine is shut down")
        count = gc_freeze.freeze(counted=not self._gc_frozen)
        self._gc_frozen = True
        logger.info("garbage collector: %d objects frozen", count)

    def is_alive(self) -> bool:
        """Whether the engine takes requests: not shut down, and not stopped by an internal error
        (which then fails every request with its message)."""
        return not self._closed and self._core.alive

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self._core.shutdown()
            if self._tp is not None:
                self._tp.shutdown()
            released = self._core.release_device_memory()
            if released:
                self.model = None
            # (the engine's objects refer to each other: collected once let go of, and unfrozen
            # first if this engine froze them, or they would never be)
            if self._gc_frozen:
                self._gc_frozen = False
                gc_freeze.release()
            elif released:
                gc.collect()
            if released and self.device.type == "cuda":
                torch.cuda.empty_cache()  # back to the device, for the next engine

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:  # best effort; call shutdown() explicitly
        with contextlib.suppress(Exception):
            self.shutdown()

    # ---- requests -------------------------------------------------------------------------

    def _make_requests(
        self,
        prompt,
        sampling_params,
        input_ids,
        return_logprob,
        logprob_start_len,
        top_logprobs_num,
        priority=None,
        wait_for_grammar: bool = True,
    ):
        """The requests of a call, their grammars compiling; with `wait_for_grammar`, a single
        request's grammar compiled (or its refusal raised) before this returns."""
        if self._closed:
            raise EngineShutDown("the engine is shut down")
        check_priority(priority)
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt (text) and input_ids")
        single = isinstance(prompt, str) or (
            input_ids is not None and (not input_ids or isinstance(input_ids[0], int))
        )
        prompts = [prompt] if isinstance(prompt, str) else prompt
        if input_ids is not None:
            prompts = [input_ids] if single else input_ids
        if not isinstance(prompts, list) or not prompts:
            raise ValueError("prompt must be a string or a non-empty list of strings")
        count = len(prompts)
        params_list = _broadcast(sampling_params, count, "sampling_params")
        lp_list = _broadcast(return_logprob, count, "return_logprob")
        start_list = _broadcast(logprob_start_len, count, "logprob_start_len")
        top_list = _broadcast(top_logprobs_num, count, "top_logprobs_num")
        reqs = []
        for i, item in enumerate(prompts):
            ids = self._tokenize(item)
            params = SamplingParams.from_dict(params_list[i])
            logprob = self._logprob_request(lp_list[i], start_list[i], top_list[i], len(ids))
            self._check_fits(ids, params)
            grammar = self._grammar_future(params)
            if grammar is not None and single and wait_for_grammar:
                # one request: a refused grammar is the caller's error, raised here (the compile
                # runs in a worker thread; this thread only waits for it)
                grammar.result()
            base_seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
            for k in range(params.n):
                req = self._new_req(ids, params, base_seed + k, logprob)
                req.grammar_future = grammar
                req.priority = priority
                reqs.append(req)
        return reqs, single

    def grammar_compiler(self):
        """The engine's GrammarCompiler, once it has read the tokenizer (it starts with the
        engine); GrammarError (a ValueError) if the grammar backend cannot read it."""
        return self._grammar_setup.result()

    def _build_grammar_compiler(self) -> None:
        try:
            compiler = self._new_grammar_compiler()
        except BaseException as e:  # (a tokenizer the backend cannot read: each request is told)
            self._grammar_setup.set_exception(e)
        else:
            self._grammar_setup.set_result(compiler)

    def _new_grammar_compiler(self):
        from radixlm.constrained import GrammarCompiler, NumberLimits

        config = self.config
        return GrammarCompiler(
            self.tokenizer,
            vocab_size=self.model_config.vocab_size,
            whitespace=config.json_whitespace,
            compile_timeout=config.grammar_compile_timeout,
            ebnf_recursion_depth=config.ebnf_recursion_depth,
            eos_token_ids=sorted(self.eos_token_ids),
            backend=config.grammar_backend,
            numbers=NumberLimits(
                config.json_integer_digits, config.json_fraction_digits, config.json_exponent_digits
            ),
        )

    def _grammar_future(self, params: SamplingParams):
        """Start compiling the request's regex / JSON schema / EBNF / choices in the compiler's
        worker threads (a cached grammar is ready at once; identical specs compiling at once
        compile once): a Future of the compiled grammar, which fails with GrammarError (a
        ValueError) naming what to fix, or past grammar_compile_timeout. The engine core holds
        the request until it is done; the caller's thread never compiles."""
        constraint = params.constraint
        if constraint is None:
            return None
        t0 = time.perf_counter()
        lenient = params.json_schema_lenient
        future: Future = Future()

        def start(setup: Future) -> None:
            """Once the compiler is ready (at once, in this thread, if it is already): the compile
            starts in its worker threads, its outcome relayed to `future`."""
            try:
                compiled = setup.result().compile_async(*constraint, lenient=lenient)
            except BaseException as e:  # (a compiler that could not be built, a bad spec)
                if future.set_running_or_notify_cancel():
                    future.set_exception(e)
            else:
                compiled.add_done_callback(lambda done: _relay(done, future))

        self._grammar_setup.add_done_callback(start)
        future.add_done_callback(
            lambda f: f.cancelled() or self._grammar_times.observe(time.perf_counter() - t0)
        )  # (a wait its caller gave up is no compile time)
        return future

    def _tokenize(self, item: Any) -> list[int]:
        if isinstance(item, str):
            if not item:
                raise ValueError("the prompt is empty; give at least one character")
            return encode_prompt(self.tokenizer, item) or _raise_empty()
        if (
            isinstance(item, list)
            and item
            and all(isinstance(t, int) and not isinstance(t, bool) for t in item)
        ):
            bad = [t for t in item if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise ValueError(
                    f"input_ids {bad[:5]} lie outside the vocabulary [0, {self.model_config.vocab_size})"
                )
            return list(item)
        raise ValueError("each prompt must be a non-empty string, or a non-empty list of token ids")

    def _logprob_request(self, return_logprob, start, top, prompt_len) -> LogprobRequest:
        if not return_logprob:
            return LogprobRequest()
        start = -1 if start is None else start
        if isinstance(start, bool) or not isinstance(start, int) or not -1 <= start <= prompt_len:
            raise ValueError(
                f"logprob_start_len={start} must be -1 (output only) or in [0, {prompt_len}]"
            )
        top = 0 if top is None else top
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 100:
            raise ValueError(f"top_logprobs_num={top} must be in [0, 100]")
        return LogprobRequest(True, start, top)

    def _tokenizer_vocab_end(self, model_vocab: int) -> int:
        """One past the highest id the tokenizer has (its added tokens included), at most the
        model's vocabulary: the ids that can be sampled."""
        try:
            ids = self.tokenizer.get_vocab().values()
        except Exception:  # a tokenizer that cannot list its vocabulary: every id
            return model_vocab
        return min(model_vocab, max(ids, default=model_vocab - 1) + 1)

    def _check_fits(self, ids: list[int], params: SamplingParams) -> None:
        # a stop id need only be a row of the model; a bias on an id that is never sampled (the
        # model's padding rows past the tokenizer's ids) would do nothing, so it is refused
        for name, token_ids, vocab in (
            ("stop_token_ids", params.stop_token_ids, self.model_config.vocab_size),
            ("logit_bias token ids", params.logit_bias or (), self.model.sampled_vocab),
        ):
            bad = sorted(t for t in token_ids if t >= vocab)
            if bad:
                raise ValueError(f"{name} {bad[:5]} lie outside the vocabulary [0, {vocab})")
        if len(ids) >= self.context_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; the model's context is {self.context_len}: shorten the prompt"
            )
        capacity = self._core.allocator.capacity
        need = len(ids) + min(params.max_new_tokens, self.context_len - len(ids))
        if need > capacity:
            raise ValueError(
                f"prompt ({len(ids)} tokens) plus max_new_tokens ({params.max_new_tokens}) needs {need} KV "
                f"slots, more than the pool's {capacity}: lower max_new_tokens or raise the pool size"
            )

    def _new_req(
        self, ids: list[int], params: SamplingParams, seed: int, logprob: LogprobRequest
    ) -> Req:
        detok = IncrementalDetokenizer(
            self.tokenizer,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            stop=list(params.stop),
            min_tokens=params.min_new_tokens,
        )
        return Req(
            rid=f"{uuid.uuid4().hex[:12]}-{next(self._ids)}",
            input_ids=ids,
            params=params,
            seed=seed,
            detokenizer=detok,
            logprob=logprob,
            eos_token_ids=self.eos_token_ids,
        )

    @staticmethod
    def _check_streamable(reqs: list[Req]) -> None:
        if len(reqs) != 1:
            raise ValueError("stream=True takes one prompt with n=1")

    def _stream_sync(self, req: Req) -> Iterator[dict[str, Any]]:
        updates = _Newest()
        self._core.submit(
            req, lambda r, finished: updates.put(request_output(r, stream=not finished))
        )
        try:
            while True:
                out = updates.get()
                yield out
                if out["meta_info"]["finish_reason"] is not None:
                    return
        finally:
            if not req.is_finished:
                self._core.abort(req.rid)

    async def _stream_async(self, req: Req, loop) -> AsyncIterator[dict[str, Any]]:
        updates = _NewestOnLoop()

        def sink(r: Req, finished: bool) -> None:
            if not _post(loop, updates.put, request_output(r, stream=not finished)):
                self._core.abort(r.rid)  # the consumer's event loop is gone: so is the consumer

        self._core.submit(req, sink)
        try:
            while True:
                out = await updates.get()
                yield out
                if out["meta_info"]["finish_reason"] is not None:
                    return
        finally:
            if not req.is_finished:
                self._core.abort(req.rid)


# a call of at most this many prompts, of at most this many characters (or token ids) in all, is
# made on the caller's event loop (its tokenizing ~50 us a thousand characters; text_ids keeps
# the GIL, so nothing else would run meanwhile either way)
_INLINE_PROMPTS = 64
_INLINE_PROMPT_SIZE = 8192


def _short(prompt, input_ids) -> bool:
    """Whether a call's requests are made on the event loop (async_generate) rather than in a
    thread: a few short prompts, as text or as token ids."""
    items = input_ids if input_ids is not None else prompt
    if isinstance(items, str) or (isinstance(items, list) and items and isinstance(items[0], int)):
        items = [items]  # one prompt
    if not isinstance(items, list):
        return True  # (refused at once by _make_requests)
    size = sum(len(item) if isinstance(item, (str, list)) else 0 for item in items)
    return len(items) <= _INLINE_PROMPTS and size <= _INLINE_PROMPT_SIZE


class _Newest:
    """The newest of a stream's snapshots not yet taken. They are cumulative, so an older one
    untaken is dropped (the newer holds all it did): a reader that falls behind holds one
    snapshot, not one a step, each as long as the output (a stalled reader of a long stream
    held hundreds of MB)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._item: dict[str, Any] | None = None

    def put(self, item: dict[str, Any]) -> None:
        with self._cond:
            self._item = item
            self._cond.notify()

    def get(self) -> dict[str, Any]:
        with self._cond:
            while self._item is None:
                self._cond.wait()
            item, self._item = self._item, None
            return item


class _NewestOnLoop:
    """_Newest for a reader on an event loop: `put` runs on that loop (posted there), `get` is
    awaited on it."""

    def __init__(self) -> None:
        self._ready = asyncio.Event()
        self._item: dict[str, Any] | None = None

    def put(self, item: dict[str, Any]) -> None:
        self._item = item
        self._ready.set()

    async def get(self) -> dict[str, Any]:
        while self._item is None:
            self._ready.clear()
            await self._ready.wait()
        item, self._item = self._item, None
        return item


def _kv_name(kv_pool: KVPool) -> str:
    """How the start-up lines name the pool's storage: "fp8_e4m3 KV", "bfloat16 KV"."""
    if kv_pool.quantized:
        return f"{kv_pool.kv_cache_dtype} KV"
    return f"{str(kv_pool.dtype).removeprefix('torch.')} KV"


def request_output(req: Req, stream: bool = False) -> dict[str, Any]:
    """The SGLang-shaped result of a request, as of now (called on the core thread)."""
    now = time.perf_counter()
    meta: dict[str, Any] = {
        "id": req.rid,
        "prompt_tokens": len(req.input_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,
        "finish_reason": req.finish_reason,
        "e2e_latency": (req.finish_time or now) - req.arrival_time,
    }
    if req.error is not None:
        meta["error"] = req.error
    if req.grammar_validation is not None:
        meta["grammar_validation"] = req.grammar_validation
    if req.spec_verify_ct:
        meta.update(spec_meta_info(req))
    if req.logprob.return_logprob:
        meta["input_token_logprobs"] = _results(req, "input_token_logprobs", _entry)
        meta["output_token_logprobs"] = _results(req, "output_token_logprobs", _entry)
        if req.logprob.top_logprobs_num:
            meta["input_top_logprobs"] = _results(req, "input_top_logprobs", _top)
            meta["output_top_logprobs"] = _results(req, "output_top_logprobs", _top)
    text = req.detokenizer.stream_text if stream else req.detokenizer.text
    return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}


def spec_meta_info(req: Req) -> dict[str, Any]:
    """A speculative request's counters under SGLang's meta_info names. spec_accept_length is
    the tokens per verify step (accepted draft tokens and the bonus token); SGLang divides all
    completion tokens by its verify steps, the same where every step verifies, as its NGRAM's do
    (here a step whose context has no match decodes plainly, and is not counted)."""
    proposed = req.spec_num_proposed_drafts
    return {
        "spec_verify_ct": req.spec_verify_ct,
        "spec_accept_length": req.spec_verify_tokens / req.spec_verify_ct,
        "spec_accept_rate": req.spec_num_correct_drafts / proposed if proposed else 0.0,
        "spec_num_correct_drafts": req.spec_num_correct_drafts,
        "spec_num_proposed_drafts": proposed,
        "spec_correct_drafts_histogram": list(req.spec_correct_drafts_histogram),
    }


def _results(req: Req, name: str, convert) -> list[Any]:
    """A copy of `req`'s log-probability list `name` in the results' form. The request's lists
    only grow, so the entries converted before are kept on it and only the new ones converted:
    a stream's snapshot every step is then a copy of references, where converting them all made
    a long stream with top log-probabilities cost the core thread, and so every request in its
    batch, more each step."""
    source = getattr(req, name)
    done = req.result_logprobs.setdefault(name, [])
    if len(done) > len(source):  # (never: the lists only grow)
        done.clear()
    if len(done) < len(source):
        done.extend(map(convert, source[len(done) :]))
    return list(done)


def _entry(entry):
    lp, t = entry
    return (lp, t, None)


def _top(entries):
    return None if entries is None else [(lp, t, None) for lp, t in entries]


def _final_only(deliver):
    """A sink for `submit(..., progress=False)`: called once, when the request finishes."""

    def sink(req: Req, _finished: bool) -> None:
        deliver(request_output(req))

    return sink


def _resolver(loop, fut):
    def deliver(out):
        _post(loop, lambda: fut.done() or fut.set_result(out))

    return deliver


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> bool:
    """Run `fn(*args)` on `loop`, after what was posted there before; False if the loop is
    closed (its caller has gone: an `asyncio.run` that ended), with no one left to tell.

    Posts to one loop go together: the first wakes the loop, those made before it runs join
    that wake-up. (A step of 96 streamed requests woke the loop 96 times, each a write to its
    self-pipe: a syscall a request a step on the core thread.)"""
    box = getattr(loop, "_radixlm_mailbox", None)
    if box is None:
        with _MAILBOX_LOCK:
            box = getattr(loop, "_radixlm_mailbox", None)
            if box is None:
                box = _Mailbox(loop)
                try:  # (kept on the loop: the two go together)
                    loop._radixlm_mailbox = box  # type: ignore[attr-defined]
                except AttributeError:  # (a loop that takes no attributes: each post wakes it)
                    box = None
    return _wake(loop, fn, *args) if box is None else box.post(fn, args)


def _wake(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> bool:
    """loop.call_soon_threadsafe(fn, *args); False if the loop is closed."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        if not loop.is_closed():
            raise
        return False
    return True


class _Mailbox:
    """What the engine core posted to one event loop, run there in order at one wake-up."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: list[tuple[Callable[..., Any], tuple]] = []
        self._lock = threading.Lock()
        self._woken = False  # a wake-up is on its way: posts join it

    def post(self, fn: Callable[..., Any], args: tuple) -> bool:
        loop = self._loop
        with self._lock:
            if loop.is_closed():  # (what a wake-up the loop never ran left here goes too)
                self._items.clear()
                return False
            self._items.append((fn, args))
            if self._woken:
                return True
            self._woken = True
        if _wake(loop, self._run):
            return True
        with self._lock:
            self._items.clear()
        return False

    def _run(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._woken = False
        for fn, args in items:
            try:
                fn(*args)
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as e:  # as the loop itself reports a failed callback
                self._loop.call_exception_handler(
                    {"message": "an engine result could not be delivered", "exception": e}
                )


_MAILBOX_LOCK = threading.Lock()


def _relay(done: Future, to: Future) -> None:
    """`done`'s outcome, result or exception, to `to` (unless its caller cancelled it)."""
    if not to.set_running_or_notify_cancel():
        return
    error = done.exception()
    if error is not None:
        to.set_exception(error)
    else:
        to.set_result(done.result())


def _broadcast(value: Any, count: int, name: str) -> list[Any]:
    if isinstance(value, list) and not (
        name == "sampling_params" and value and not isinstance(value[0], dict)
    ):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
        return value
    return [value] * count


def _raise_empty() -> list[int]:
    raise ValueError("the prompt tokenizes to nothing; give some text")
