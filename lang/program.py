"""`@function` programs: `run`, `run_batch`, `bind`."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

from radixlm.lang.backend import resolve_backend
from radixlm.lang.interpreter import (
    ProgramState,
    bind_arguments,
    run_program,
    run_program_batch,
)
from radixlm.lang.ir import default_params


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


def _run_defaults(n: Any, stop_regex: Any, **values: Any):
    """The defaults `run` and `run_batch` give the program's `gen` calls (SGLang's arguments:
    `n` samples each, as a list; stop_regex refused as `gen` refuses it)."""
    if stop_regex:
        raise ValueError("run: stop_regex is not supported by radixlm; use stop strings")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"run: n={n!r} must be a positive integer")
    return default_params(n=n if n > 1 else None, **values)
