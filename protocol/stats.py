"""The engine's statistics as the server, the metrics and programs read them: one frozen, typed
record, made by the engine core between two steps and carried across the engine process's
boundary as a plain mapping of the same names."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class EngineStats(Mapping):
    """What `Engine.get_stats()` returns: the engine core's levels (at the moment it answered)
    and running totals (since it started). Read it by attribute (`stats.num_running_reqs`). It is
    also a read-only mapping of the same names, which is what `/get_server_info` shows as
    `internal_states`; the speculative counters are in it only while speculation is on."""

    # levels
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_grammar_queue_reqs: int = 0  # waiting for their grammar to compile
    kv_pool_capacity_tokens: int = 0
    kv_pool_free_tokens: int = 0  # neither a request's nor the radix cache's
    radix_cache_tokens: int = 0
    radix_cache_evictable_tokens: int = 0
    radix_cache_protected_tokens: int = 0
    cache_hit_rate: float = 0.0
    # running totals
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    num_steps: int = 0
    graph_steps: int = 0  # decode steps replayed from a CUDA graph
    prefill_graph_steps: int = 0  # other steps replayed from a prompt-step graph
    num_preemptions: int = 0
    num_priority_preemptions: int = 0
    jump_forward_tokens: int = 0
    overlapped_steps: int = 0  # launched before the previous step's tokens reached the host
    # the core thread's seconds by phase
    host_seconds_schedule: float = 0.0
    host_seconds_launch: float = 0.0
    host_seconds_sample: float = 0.0
    host_seconds_wait: float = 0.0  # for the device
    host_seconds_apply: float = 0.0
    # of host_seconds_sample: waiting for the grammar masks filled in the background, and
    # filling those that were not (grammars that changed meanwhile, a jump forward; a backend
    # without threads of its own, the DFA backend's)
    host_seconds_sample_masks: float = 0.0
    # speculative decoding (None while it is off), with SGLang's names
    spec_verify_ct: int | None = None
    spec_num_proposed_drafts: int | None = None
    spec_num_correct_drafts: int | None = None
    spec_accept_length: float | None = None
    spec_accept_rate: float | None = None
    # tokens each verify step gave (accepted draft tokens + the bonus token): a
    # protocol.histogram snapshot with buckets 1, 2, 3, ...
    spec_accept_length_histogram: dict[str, Any] | None = None
    # how long each constrained request waited for its grammar: a protocol.histogram snapshot
    grammar_compile_seconds: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EngineStats:
        """The record of its mapping form; a name this version does not know is an error (the
        two sides of the process boundary are one version)."""
        unknown = sorted(set(data) - _NAMES)
        if unknown:
            raise ValueError(f"unknown engine statistics {unknown}: known are {sorted(_NAMES)}")
        return cls(**data)

    def as_dict(self) -> dict[str, Any]:
        """The mapping form, leaving out what is None (off, or not measured)."""
        return {name: v for name in _ORDER if (v := getattr(self, name)) is not None}

    def __getitem__(self, name: str) -> Any:
        value = getattr(self, name) if name in _NAMES else None
        if value is None:
            raise KeyError(name)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self.as_dict())

    def __len__(self) -> int:
        return len(self.as_dict())


_ORDER = tuple(f.name for f in dataclasses.fields(EngineStats))
_NAMES = frozenset(_ORDER)
