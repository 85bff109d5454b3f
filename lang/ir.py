"""The expressions a program appends to its state (`s += ...`) and the parameters of `gen`.

An expression is data: the interpreter (`lang/interpreter.py`) executes it against a backend.
Strings and expressions concatenate (`"Q: " + gen("a")`) into an `ExprList`. This module sits
below the interpreter and imports nothing of it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixlm.lang.choices import ChoicesSamplingMethod

# SGLang's regexes for `gen(dtype=...)`, with the same meanings (trailing blanks end a number)
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""

_DTYPE_REGEX = {"int": REGEX_INT, "float": REGEX_FLOAT, "bool": REGEX_BOOL, "str": REGEX_STR}
# a number ends at the first blank: its regex allows trailing blanks, these stop strings cut them
_DTYPE_STOPS = {"int": [" ", "\n"], "float": [" ", "\n"]}


@dataclass
class GenParams:
    """Sampling parameters of one `gen`, with SGLang's names; None means "not set here".

    `Function.run(...)` gives the program's defaults and each `gen(...)` overrides them.
    """

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    dtype: str | None = None  # int | float | bool | str, turned into a regex
    regex: str | None = None
    json_schema: str | None = None  # JSON text

    def merged(self, overrides: GenParams) -> GenParams:
        """These parameters with every field set in `overrides` replaced."""
        out = dataclasses.replace(self)
        for f in dataclasses.fields(overrides):
            value = getattr(overrides, f.name)
            if value is not None:
                setattr(out, f.name, list(value) if isinstance(value, (list, tuple)) else value)
        return out

    def resolved(self, extra_stop: tuple[str, ...] = ()) -> GenParams:
        """Final parameters for a backend: `dtype` turned into its regex (and stop strings), the
        chat template's stop strings added, `stop` made a list."""
        out = dataclasses.replace(self)
        stop = [out.stop] if isinstance(out.stop, str) else list(out.stop or [])
        if out.dtype is not None:
            if out.regex is not None or out.json_schema is not None:
                raise ValueError("gen: give dtype, regex or json_schema, not several of them")
            out.regex = _DTYPE_REGEX[out.dtype]
            stop += [s for s in _DTYPE_STOPS.get(out.dtype, []) if s not in stop]
            out.dtype = None
        if out.regex is not None and out.json_schema is not None:
            raise ValueError("gen: give regex or json_schema, not both")
        stop += [s for s in extra_stop if s and s not in stop]
        out.stop = stop
        return out

    def sampling_params(self) -> dict[str, Any]:
        """The engine's / native API's `sampling_params` (only what is set)."""
        keys = (
            "max_new_tokens", "min_new_tokens", "n", "stop", "stop_token_ids", "temperature",
            "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "ignore_eos",
            "regex", "json_schema",
        )  # fmt: skip
        out = {}
        for key in keys:
            value = getattr(self, key)
            if value is not None and not (key in ("stop", "stop_token_ids") and not value):
                out[key] = value
        return out

    def logprob_options(self) -> dict[str, Any]:
        """`return_logprob`, `logprob_start_len`, `top_logprobs_num` when logprobs are asked."""
        if not self.return_logprob:
            return {}
        out: dict[str, Any] = {"return_logprob": True}
        if self.logprob_start_len is not None:
            out["logprob_start_len"] = self.logprob_start_len
        if self.top_logprobs_num:
            out["top_logprobs_num"] = self.top_logprobs_num
        return out


def default_params(**values: Any) -> GenParams:
    """The program-wide defaults of `run` / `run_batch` (SGLang's: 128 tokens, temperature 1)."""
    params = GenParams(max_new_tokens=128, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0)
    return params.merged(GenParams(**values))


def normalize_dtype(dtype: Any) -> str | None:
    if dtype is None:
        return None
    name = dtype.__name__ if isinstance(dtype, type) else dtype
    if name not in _DTYPE_REGEX:
        raise ValueError(f"gen: dtype={dtype!r}; use one of int, float, bool, str")
    return name


def normalize_json_schema(schema: Any) -> str | None:
    """A JSON schema given as JSON text, a dict or a pydantic model class -> JSON text."""
    if schema is None or isinstance(schema, str):
        if isinstance(schema, str):
            try:
                json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"gen: json_schema is not valid JSON: {e}") from None
        return schema
    from radixlm.protocol.sampling_params import json_schema_text  # (imports no torch)

    try:
        return json_schema_text(schema)
    except TypeError as e:
        raise TypeError(f"gen: {e}") from None


def check_regex(regex: str | None) -> None:
    if regex is None:
        return
    if not isinstance(regex, str):
        raise TypeError(f"gen: regex must be a string, got {regex!r}")
    try:
        re.compile(regex)
    except re.error as e:
        raise ValueError(f"gen: regex {regex!r} does not compile: {e}") from None


# ---- expressions ----------------------------------------------------------------------------


class Expr:
    """Something a program appends to its state."""

    def __add__(self, other: Any) -> ExprList:
        return ExprList([*_items(self), *_items(as_expr(other))])

    def __radd__(self, other: Any) -> ExprList:
        return ExprList([*_items(as_expr(other)), *_items(self)])


def as_expr(value: Any) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return ConstantText(value)
    if value is None:
        raise ValueError("cannot append None to a program state")
    raise TypeError(
        f"a program state takes strings and gen/select/role expressions, not {type(value).__name__}"
    )


def _items(expr: Expr) -> list[Expr]:
    return list(expr.exprs) if isinstance(expr, ExprList) else [expr]


class ExprList(Expr):
    def __init__(self, exprs: list[Expr]) -> None:
        self.exprs = exprs

    def __repr__(self) -> str:
        return f"ExprList({self.exprs!r})"


class ConstantText(Expr):
    def __init__(self, value: str) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"Constant({self.value!r})"


class Gen(Expr):
    def __init__(self, name: str | None, params: GenParams) -> None:
        self.name = name
        self.params = params

    def __repr__(self) -> str:
        return f"Gen({self.name!r})"


class Select(Expr):
    def __init__(
        self,
        name: str | None,
        choices: list[str],
        temperature: float,
        choices_method: ChoicesSamplingMethod,
    ) -> None:
        self.name = name
        self.choices = choices
        self.temperature = temperature
        self.choices_method = choices_method

    def __repr__(self) -> str:
        return f"Select({self.name!r}, choices={self.choices!r})"


class SeparateReasoning(Expr):
    """SGLang's `separate_reasoning`: after the named gen/select results in `expr` are made,
    split each into its thinking and its answer with the `model_type` reasoning parser
    (`deepseek-r1`, `qwen3`, ...): the variable keeps the answer, `{name}_reasoning_content`
    gets the thinking ("" if there is none), and the state's text, where it ends with the
    output, ends with the answer instead."""

    def __init__(self, model_type: str, expr: Expr | None) -> None:
        self.model_type = model_type
        self.names: list[str] = []
        for e in _items(expr) if expr is not None else []:
            if isinstance(e, (Gen, Select)):
                if e.name is None:
                    raise ValueError(
                        "separate_reasoning needs a named gen or select: its answer and its "
                        "thinking are stored under the name"
                    )
                self.names.append(e.name)

    def reasoning_name(self, name: str) -> str:
        return f"{name}_reasoning_content"

    def __repr__(self) -> str:
        return f"SeparateReasoning({self.model_type!r}, {self.names!r})"


class RoleBegin(Expr):
    def __init__(self, role: str) -> None:
        self.role = role

    def __repr__(self) -> str:
        return f"RoleBegin({self.role})"


class RoleEnd(Expr):
    def __init__(self, role: str) -> None:
        self.role = role

    def __repr__(self) -> str:
        return f"RoleEnd({self.role})"


class VarScopeBegin(Expr):
    def __init__(self, name: str) -> None:
        self.name = name


class VarScopeEnd(Expr):
    def __init__(self, name: str) -> None:
        self.name = name


class CommitLazy(Expr):
    """Compute the state's text so far in the backend's prefix cache (before a fork)."""


class ConcatenateAndAppend(Expr):
    """Append the text each fork added to the parent (join mode `concate_and_append`). The
    forks are `ProgramState`s, typed `Any` here: the interpreter defines them, above this."""

    def __init__(self, states: list[Any]) -> None:
        self.states = states
