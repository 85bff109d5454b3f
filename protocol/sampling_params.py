"""Sampling parameters, with SGLang's names, validated before a request reaches the engine."""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from typing import Any

_MAX_STOP_STRINGS = 64
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a logit bias: [-100, 100]
_MAX_TOP_K = 2**31 - 1


# a temperature below this samples as greedy (as in SGLang and vLLM)
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    n: int = 1
    seed: int | None = None
    # added to the logits of these token ids before sampling (greedy too): -100 all but bans a
    # token, +100 all but forces it. JSON's string keys ("42") are taken as ids
    logit_bias: dict[int, float] | None = None
    # constrained decoding: at most one of these
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    # free text in which each trigger opens a section held to its JSON schema until its end tag:
    # {"structures": [{"begin", "schema", "end"}], "triggers": [...]} (SGLang's and xgrammar's
    # structural tag), as JSON text
    structural_tag: str | None = None
    # JSON-schema keywords the mask cannot enforce are skipped instead of refused; the finished
    # output is then validated and the result reported in meta_info["grammar_validation"]
    json_schema_lenient: bool = False

    @classmethod
    def from_dict(cls, params: dict[str, Any] | SamplingParams | None) -> SamplingParams:
        """Build from a user's dict; unknown keys are an error naming the valid ones."""
        if params is None:
            return cls()
        if isinstance(params, SamplingParams):  # (built by hand: checked like a dict's)
            sp = dataclasses.replace(params)
            sp.validate()
            return sp
        if not isinstance(params, dict):
            raise TypeError(f"sampling params must be a dict, got {type(params).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(
                f"unknown sampling parameter(s) {unknown}; valid names are {sorted(known)}"
            )
        values = dict(params)
        if isinstance(values.get("stop"), str):
            values["stop"] = [values["stop"]]
        if values.get("stop") is None:
            values["stop"] = []
        if values.get("stop_token_ids") is None:
            values["stop_token_ids"] = []
        schema = values.get("json_schema")
        if schema is not None and not isinstance(schema, str):
            values["json_schema"] = json_schema_text(schema)
        tag = values.get("structural_tag")
        if isinstance(tag, dict):
            values["structural_tag"] = json.dumps(tag)
        sp = cls(**values)
        sp.validate()
        return sp

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"sampling params: {msg}")

        def check_int(name: str, low: int, high: int | None = None) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                bad(f"{name} must be an integer, got {value!r}")
            if value < low or (high is not None and value > high):
                rng = f">= {low}" if high is None else f"in [{low}, {high}]"
                bad(f"{name}={value} must be {rng}")

        def check_float(name: str, low: float, high: float, low_open: bool = False) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                bad(f"{name} must be a number, got {value!r}")
            if value != value or value > high or value < low or (low_open and value == low):
                opener = "(" if low_open else "["
                bad(f"{name}={value} must be in {opener}{low}, {high}]")
            setattr(self, name, float(value))

        check_int("max_new_tokens", 0)
        check_int("min_new_tokens", 0)
        if self.min_new_tokens > self.max_new_tokens:
            bad(
                f"min_new_tokens={self.min_new_tokens} exceeds max_new_tokens={self.max_new_tokens}"
            )
        check_float("temperature", 0.0, 100.0)
        check_float("top_p", 0.0, 1.0, low_open=True)
        check_int("top_k", -1)
        # (any top_k past the vocabulary keeps it all: held to int32 for the device's int64 math)
        self.top_k = min(self.top_k, _MAX_TOP_K)
        check_float("min_p", 0.0, 1.0)
        check_float("frequency_penalty", -2.0, 2.0)
        check_float("presence_penalty", -2.0, 2.0)
        check_float("repetition_penalty", 0.0, 2.0, low_open=True)
        check_int("n", 1, 128)
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                bad(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.seed is not None:  # any integer (OpenAI's are signed 64-bit), taken mod 2**64
            if isinstance(self.seed, bool) or not isinstance(self.seed, int):
                bad(f"seed must be an integer, got {self.seed!r}")
            self.seed %= 2**64
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop must be a non-empty string or a list of non-empty strings")
        if len(self.stop) > _MAX_STOP_STRINGS:
            bad(f"at most {_MAX_STOP_STRINGS} stop strings")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            bad("stop_token_ids must be a list of non-negative integers")
        if self.logit_bias is not None:
            self.logit_bias = _checked_logit_bias(self.logit_bias, bad)
        constraints = [k for k in CONSTRAINTS if getattr(self, k) is not None]
        if len(constraints) > 1:
            bad(f"give at most one of {', '.join(CONSTRAINTS)} (got {constraints})")
        if self.structural_tag is not None:
            try:
                structural_tag_parts(self.structural_tag)
            except ValueError as e:
                bad(str(e))
        if not isinstance(self.json_schema_lenient, bool):
            bad(f"json_schema_lenient must be true or false, got {self.json_schema_lenient!r}")
        if self.json_schema_lenient and self.json_schema is None:
            bad("json_schema_lenient applies to json_schema; give a json_schema with it")

    @property
    def is_greedy(self) -> bool:
        # below GREEDY_TEMPERATURE, logits / T overflows float32: the argmax is what it means
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """Whether sampling depends on the tokens so far (repetition, frequency, presence)."""
        return (
            self.repetition_penalty != 1.0
            or bool(self.frequency_penalty)
            or bool(self.presence_penalty)
        )

    @property
    def has_logit_bias(self) -> bool:
        return bool(self.logit_bias)

    @functools.cached_property
    def logit_bias_columns(self):
        """logit_bias as host tensors (token ids int64, biases float32), made once: the sampler
        lays them out every step, and a bias over much of the vocabulary would otherwise cost a
        Python loop a step."""
        import torch

        bias = self.logit_bias or {}
        return (
            torch.tensor(list(bias), dtype=torch.int64),
            torch.tensor(list(bias.values()), dtype=torch.float32),
        )

    @functools.cached_property
    def is_plain_argmax(self) -> bool:
        """Greedy over the model's own logits: no penalties or bias to change them first.
        (Asked of every request every step: kept once known. The engine's parameters are its
        own validated copy, never changed after.)"""
        return self.is_greedy and not self.has_penalties and not self.has_logit_bias

    @property
    def constraint(self) -> tuple[str, str] | None:
        for kind in CONSTRAINTS:
            value = getattr(self, kind)
            if value is not None:
                return kind, value
        return None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# a request's priority crosses between processes as a signed 64-bit integer
PRIORITY_RANGE = (-(2**63), 2**63 - 1)


def check_priority(value: Any) -> int | None:
    """A request's `priority` (SGLang's: an integer, or None for none); ValueError otherwise."""
    low, high = PRIORITY_RANGE
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high
    ):
        raise ValueError(
            f"priority must be an integer in [-2**63, 2**63 - 1] (or null for none), got {value!r}"
        )
    return value


# the output constraints, of which a request takes at most one
CONSTRAINTS = ("regex", "json_schema", "ebnf", "structural_tag")


def structural_tag_parts(text: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """(structures, triggers) of a structural tag given as JSON text; ValueError saying what to
    fix. Each structure's `begin` must start with one of the triggers (which is what opens it)."""
    try:
        tag = json.loads(text) if isinstance(text, str) else None
    except ValueError as e:
        raise ValueError(f"structural_tag is not valid JSON: {e}") from None
    if not isinstance(tag, dict):
        raise ValueError("structural_tag must be a JSON object with 'structures' and 'triggers'")
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(triggers, list) or not triggers:
        raise ValueError("structural_tag.triggers must be a non-empty list of strings")
    if not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("structural_tag.triggers must be non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structural_tag.structures must be a non-empty list")
    for i, item in enumerate(structures):
        where = f"structural_tag.structures[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"{where} must be an object with begin, schema and end")
        for key in ("begin", "end"):
            if not isinstance(item.get(key), str):
                raise ValueError(f"{where}.{key} must be a string")
        if not isinstance(item.get("schema"), (dict, bool)):
            raise ValueError(f"{where}.schema must be a JSON schema (an object)")
        if not any(item["begin"].startswith(t) for t in triggers):
            raise ValueError(f"{where}.begin {item['begin']!r} starts with none of the triggers")
    return structures, triggers


def _checked_logit_bias(value: Any, bad) -> dict[int, float] | None:
    """{token id: bias} with int ids and float biases in [-100, 100]; None when empty."""
    if not isinstance(value, dict):
        bad(f"logit_bias must be an object mapping token ids to biases, got {value!r}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = key
        if isinstance(key, str) and key.isascii() and key.isdigit():
            token = int(key)
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            bad(f"logit_bias key {key!r} must be a token id (a non-negative integer)")
        if (
            isinstance(bias, bool)
            or not isinstance(bias, (int, float))
            or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT  # NaN fails this too
        ):
            bad(
                f"logit_bias[{key!r}]={bias!r} must be a number in "
                f"[{-LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]"
            )
        out[token] = float(bias)
    return out or None


def json_schema_text(schema: Any) -> str:
    """A JSON schema given as a dict or a pydantic model class -> JSON text."""
    import json

    if isinstance(schema, dict):
        return json.dumps(schema)
    model_json_schema = getattr(schema, "model_json_schema", None)
    if callable(model_json_schema):
        return json.dumps(model_json_schema())
    raise TypeError(
        f"json_schema must be a JSON string, a dict or a pydantic model class, got {schema!r}"
    )
