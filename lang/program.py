"""`@function` programs: `run`, `run_batch`, `bind`, and the runners behind them.

`run` executes the program's body against a fresh `ProgramState` (in a thread of its own when
streamed); `run_batch` runs one program per argument set in a thread pool, each failure kept on
its own state.
"""

from __future__ import annotations

import functools
import inspect
import logging
import multiprocessing
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from radixlm.lang.backend import Backend
from radixlm.lang.default_backend import resolve_backend
from radixlm.lang.interpreter import ProgramState, StreamExecutor
from radixlm.lang.ir import GenParams, default_params

logger = logging.getLogger(__name__)


class Function:
    """A program: a Python function whose first argument is the state `s`."""

    def __init__(
        self,
        func: Callable[..., Any],
        num_api_spec_tokens: int | None = None,
        bind_arguments: dict[str, Any] | None = None,
    ) -> None:
        if not callable(func):
            raise TypeError(f"@function decorates a function, not {func!r}")
        params = list(inspect.signature(func).parameters.values())
        if not params or params[0].kind not in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        ):
            raise TypeError(f"{func.__name__}: a program's first argument is the state, `s`")
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens  # accepted for SGLang; no effect here
        self.bind_arguments = dict(bind_arguments or {})
        self.arg_names = [p.name for p in params[1:]]
        self._takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        functools.update_wrapper(self, func)

    @property
    def name(self) -> str:
        return getattr(self.func, "__name__", "program")

    def bind(self, **kwargs: Any) -> Function:
        """This program with some arguments fixed."""
        unknown = [k for k in kwargs if k not in self.arg_names] if not self._takes_any else []
        if unknown:
            raise TypeError(f"{self.name} has no argument(s) {unknown}; it takes {self.arg_names}")
        return Function(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    def arguments(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        twice = sorted(set(kwargs) & set(self.bind_arguments))
        if twice:
            raise TypeError(f"{self.name}: argument(s) {twice} are already bound by bind()")
        return bind_arguments(self.func, args, {**kwargs, **self.bind_arguments})

    def run(
        self,
        *args: Any,
        max_new_tokens: int = 128,
        stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        ignore_eos: bool = False,
        return_logprob: bool | None = None,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool | None = None,
        stream: bool = False,
        backend: Any = None,
        use_thread: bool = True,
        n: int = 1,
        stop_regex: str | list[str] | None = None,
        **kwargs: Any,
    ) -> ProgramState:
        """Run the program once. The sampling arguments are the defaults of its `gen` calls;
        the other keyword arguments go to the program. With `stream=True` it returns at once and
        `state.text_iter()` yields the text as it comes."""
        params = _run_defaults(
            n=n, stop_regex=stop_regex,
            max_new_tokens=max_new_tokens, stop=stop, stop_token_ids=stop_token_ids,
            temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
            frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
            ignore_eos=ignore_eos, return_logprob=return_logprob,
            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs,
        )  # fmt: skip
        return run_program(self, resolve_backend(backend), args, kwargs, params, stream)

    def run_batch(
        self,
        batch_kwargs: list[dict[str, Any]] | list[tuple[Any, ...]],
        *,
        max_new_tokens: int = 128,
        stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        ignore_eos: bool = False,
        return_logprob: bool | None = None,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool | None = None,
        backend: Any = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        generator_style: bool = False,
        n: int = 1,
        stop_regex: str | list[str] | None = None,
    ) -> list[ProgramState] | Iterator[ProgramState]:
        """Run the program once per argument dict (or tuple), concurrently. A program that fails
        keeps its error on its own state (`state.error()`); the others are not affected. With
        `generator_style`, the states are yielded in order as they finish."""
        if not isinstance(batch_kwargs, (list, tuple)):
            raise TypeError("run_batch takes a list of argument dicts (or of argument tuples)")
        if not batch_kwargs:
            return []
        batch = [self._as_kwargs(item) for item in batch_kwargs]
        params = _run_defaults(
            n=n, stop_regex=stop_regex,
            max_new_tokens=max_new_tokens, stop=stop, stop_token_ids=stop_token_ids,
            temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
            frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
            ignore_eos=ignore_eos, return_logprob=return_logprob,
            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs,
        )  # fmt: skip
        return run_program_batch(
            self,
            resolve_backend(backend),
            batch,
            params,
            num_threads,
            progress_bar,
            generator_style,
        )

    def _as_kwargs(self, item: Any) -> dict[str, Any]:
        if isinstance(item, dict):
            return item
        if isinstance(item, (list, tuple)):
            if len(item) > len(self.arg_names):
                raise TypeError(
                    f"{self.name} takes {len(self.arg_names)} arguments, got {len(item)}: {item!r}"
                )
            return dict(zip(self.arg_names, item))
        raise TypeError(f"run_batch: each item is a dict or a tuple of arguments, got {item!r}")

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<radixlm program {self.name}>"


def _run_defaults(n: Any, stop_regex: Any, **values: Any) -> GenParams:
    """The defaults `run` and `run_batch` give the program's `gen` calls (SGLang's arguments:
    `n` samples each, as a list; stop_regex refused as `gen` refuses it)."""
    if stop_regex:
        raise ValueError("run: stop_regex is not supported by radixlm; use stop strings")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"run: n={n!r} must be a positive integer")
    return default_params(n=n if n > 1 else None, **values)


# ---- running programs -----------------------------------------------------------------------


def run_program(
    program: Function,
    backend: Backend,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    params: GenParams,
    stream: bool,
    sync: bool = False,
) -> ProgramState:
    """Run `program` once with `params` as its gen defaults; streamed, its body runs in a thread
    of its own and the state is returned at once."""
    arguments = program.arguments(args, kwargs)
    state = ProgramState(StreamExecutor(backend, arguments[1], params, None, stream))
    if stream:
        thread = threading.Thread(
            target=_run_body, args=(state, program, arguments, False, True), daemon=True
        )
        state.stream_executor._body = thread
        thread.start()
        return state
    _run_body(state, program, arguments, sync, False)
    return state


def _run_body(
    state: ProgramState,
    program: Function,
    arguments: tuple[tuple[Any, ...], dict[str, Any]],
    sync: bool,
    keep_errors: bool,
) -> None:
    """Run the function body; with `keep_errors`, an exception it raises goes to the state."""
    executor = state.stream_executor
    try:
        args, kwargs = arguments
        state.ret_value = program.func(state, *args, **kwargs)
    except Exception as e:
        if not keep_errors:
            raise
        logger.warning("program %s failed: %s", program.name, e)
        logger.debug("program failure", exc_info=True)
        executor.sync()
        if executor.error_ is None:
            executor.error_ = e
    finally:
        executor.end()
    if sync:
        executor.sync()


def run_program_batch(
    program: Function,
    backend: Backend,
    batch_arguments: list[dict[str, Any]],
    params: GenParams,
    num_threads: int | str,
    progress_bar: bool,
    generator_style: bool = False,
) -> list[ProgramState] | Iterator[ProgramState]:
    """Run `program` once per argument dict in a pool of `num_threads` threads."""
    if num_threads == "auto":
        num_threads = max(96, multiprocessing.cpu_count() * 16)
    if not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads={num_threads!r}: give a positive integer or 'auto'")
    num_threads = min(num_threads, len(batch_arguments))

    def run_one(kwargs: dict[str, Any]) -> ProgramState:
        try:
            arguments = program.arguments((), kwargs)
        except TypeError as e:  # a bad argument list fails its own program only
            state = ProgramState(StreamExecutor(backend, {}, params, None, False))
            state.stream_executor.error_ = e
            state.stream_executor.end()
            return state
        state = ProgramState(StreamExecutor(backend, arguments[1], params, None, False))
        _run_body(state, program, arguments, True, True)
        return state

    states = _in_pool(run_one, batch_arguments, num_threads, progress_bar)
    return states if generator_style else list(states)


def _in_pool(
    run_one: Callable[[dict[str, Any]], ProgramState],
    batch_arguments: list[dict[str, Any]],
    num_threads: int,
    progress_bar: bool,
) -> Iterator[ProgramState]:
    """The programs' states in order, each as soon as it and those before it are done."""
    bar = _progress(len(batch_arguments)) if progress_bar else None
    pool = ThreadPoolExecutor(num_threads, thread_name_prefix="radixlm-batch")
    try:
        futures = [pool.submit(run_one, kwargs) for kwargs in batch_arguments]
        if bar is not None:
            for f in futures:
                f.add_done_callback(lambda _: bar.update(1))
        for f in futures:
            yield f.result()
    finally:
        # a generator closed early (the caller stopped reading): the programs not started yet
        # are not run, and only the running ones are waited for
        pool.shutdown(wait=True, cancel_futures=True)
        if bar is not None:
            bar.close()


def _progress(total: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return _PlainProgress(total)
    return tqdm(total=total)


class _PlainProgress:
    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0
        self._lock = threading.Lock()

    def update(self, n: int) -> None:
        with self._lock:
            self.done += n
            print(f"\r{self.done}/{self.total}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        print(file=sys.stderr)


def bind_arguments(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The program's (args, kwargs) after `s`, or a TypeError naming the problem."""
    signature = inspect.signature(func)
    try:
        bound = signature.bind(None, *args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{func.__name__}{signature}: {e}") from None
    bound.apply_defaults()
    return tuple(bound.args[1:]), dict(bound.kwargs)
