"""The public names of the program language, with SGLang's signatures and meanings."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from radixlm.lang.choices import ChoicesSamplingMethod, token_length_normalized
from radixlm.lang.default_backend import get_default_backend, resolve_backend
from radixlm.lang.ir import (
    ExprList,
    Gen,
    GenParams,
    RoleBegin,
    RoleEnd,
    Select,
    SeparateReasoning,
    as_expr,
    check_regex,
    normalize_dtype,
    normalize_json_schema,
)
from radixlm.lang.program import Function


def function(func: Callable[..., Any] | None = None, num_api_spec_tokens: int | None = None) -> Any:
    """Make a program of a function `f(s, ...)`; usable as `@function` or `@function(...)`."""
    if func is not None:
        return Function(func, num_api_spec_tokens=num_api_spec_tokens)

    def decorator(f: Callable[..., Any]) -> Function:
        return Function(f, num_api_spec_tokens=num_api_spec_tokens)

    return decorator


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: type | str | None = None,
    choices: list[str] | None = None,
    choices_method: ChoicesSamplingMethod | None = None,
    regex: str | None = None,
    json_schema: Any = None,
) -> Gen | Select:
    """Generate text into the variable `name`. Unset arguments take the defaults given to
    `run`. `regex`, `json_schema` (JSON text, dict or pydantic class) and `dtype` (int, float,
    bool, str) constrain the text; `choices` makes this a `select`."""
    if name is not None and not isinstance(name, str):
        raise TypeError(f"gen: name must be a string, got {name!r}")
    if choices is not None:
        return select(
            name,
            choices,
            0.0 if temperature is None else temperature,
            choices_method or token_length_normalized,
        )
    if stop_regex:
        raise ValueError("gen: stop_regex is not supported by radixlm; use stop strings")
    check_regex(regex)
    params = GenParams(
        max_new_tokens=max_tokens, min_new_tokens=min_tokens, n=n, stop=stop,
        stop_token_ids=stop_token_ids, temperature=temperature, top_p=top_p, top_k=top_k,
        min_p=min_p, frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
        ignore_eos=ignore_eos, return_logprob=return_logprob,
        logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs, dtype=normalize_dtype(dtype),
        regex=regex, json_schema=normalize_json_schema(json_schema),
    )  # fmt: skip
    constraints = [k for k in ("dtype", "regex", "json_schema") if getattr(params, k) is not None]
    if len(constraints) > 1:
        raise ValueError(f"gen: give one of dtype, regex, json_schema (got {constraints})")
    return Gen(name, params)


def gen_int(name: str | None = None, **kwargs: Any) -> Gen | Select:
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs: Any) -> Gen | Select:
    return gen(name, dtype=str, **kwargs)


def select(
    name: str | None = None,
    choices: list[str] | None = None,
    temperature: float = 0.0,
    choices_method: ChoicesSamplingMethod = token_length_normalized,
) -> Select:
    """Append the choice the model scores highest (by `choices_method`) and store it in `name`;
    with a temperature above 0, sample a choice from the softmax of the scores."""
    if not choices or not isinstance(choices, (list, tuple)):
        raise ValueError("select needs choices: a non-empty list of strings")
    bad = [c for c in choices if not isinstance(c, str) or not c]
    if bad:
        raise ValueError(f"select: every choice must be a non-empty string, got {bad!r}")
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"select: temperature={temperature!r} must be >= 0")
    if not callable(choices_method):
        raise TypeError(f"select: choices_method must be a choices method, got {choices_method!r}")
    return Select(name, list(choices), float(temperature), choices_method)


def separate_reasoning(expr: Any = None, model_type: str | None = None) -> ExprList:
    """`expr` (a named gen or select, or a list of them), then its thinking split from its
    answer: the variable keeps the answer, `{name}_reasoning_content` the thinking.
    `model_type` names the reasoning parser, as SGLang's `--reasoning-parser` does."""
    from radixlm.protocol.reasoning import REASONING_PARSERS, reasoning_parser

    if model_type is None:
        raise ValueError(
            f"separate_reasoning needs model_type, one of {', '.join(REASONING_PARSERS)}"
        )
    reasoning_parser(model_type)  # (an unknown name is a ValueError naming the known ones)
    expr = None if expr is None else as_expr(expr)
    split = SeparateReasoning(model_type, expr)
    return ExprList([split] if expr is None else [expr, split])


def _role(role: str, expr: Any = None) -> ExprList:
    if expr is None:
        return ExprList([RoleBegin(role), RoleEnd(role)])
    return ExprList([RoleBegin(role), as_expr(expr), RoleEnd(role)])


def system(expr: Any = None) -> ExprList:
    return _role("system", expr)


def user(expr: Any = None) -> ExprList:
    return _role("user", expr)


def assistant(expr: Any = None) -> ExprList:
    return _role("assistant", expr)


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")


def image(expr: Any) -> Any:
    raise NotImplementedError("radixlm serves text models: images are not supported")


def video(path: str, num_frames: int) -> Any:
    raise NotImplementedError("radixlm serves text models: videos are not supported")


def flush_cache(backend: Any = None) -> bool:
    """Empty the backend's prefix cache (False when there is no backend or it is busy)."""
    if backend is None and get_default_backend() is None:
        return False
    return resolve_backend(backend).flush_cache()


def get_server_info(backend: Any = None) -> dict[str, Any] | None:
    if backend is None and get_default_backend() is None:
        return None
    return resolve_backend(backend).get_server_info()
