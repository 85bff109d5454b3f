"""A request's state inside the engine core."""

from __future__ import annotations

import enum
import functools
import time
from dataclasses import dataclass, field
from typing import Any

from radixlm.protocol.sampling_params import SamplingParams
from radixlm.runtime.detokenizer import IncrementalDetokenizer


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class LogprobRequest:
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: output tokens only
    top_logprobs_num: int = 0


@dataclass(eq=False)  # a request is itself: compared and hashed by identity
class Req:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    seed: int
    detokenizer: IncrementalDetokenizer
    logprob: LogprobRequest = field(default_factory=LogprobRequest)
    eos_token_ids: frozenset[int] = frozenset()
    grammar: Any = None  # its grammar's matcher (constrained/), made when it is admitted
    # the compile of its grammar (a Future of the compiled grammar): the core holds the request
    # in its grammar queue until it is done, then admits it or fails it alone
    grammar_future: Any = None
    grammar_validation: dict[str, Any] | None = None  # lenient JSON schema: the output's check
    # SGLang's request priority (read only with priority scheduling; runtime/scheduler.py)
    priority: int | None = None

    output_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    finish_reason: dict[str, Any] | None = None
    error: str | None = None

    # KV bookkeeping, owned by the cache manager
    pool_row: int | None = None
    kv_len: int = 0  # tokens of all_ids whose K/V are in the pool (req_to_token row)
    locked_node: Any = None  # prefix-cache node locked on behalf of this request
    locked_len: int = 0  # tokens of the row that belong to the prefix cache (not ours to free)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    num_preemptions: int = 0
    # tokens known when it was last admitted after a preemption: those past its prompt are its
    # lost output, recomputed in chunks within the step budget as a prompt is
    recompute_len: int = 0
    # output tokens sampled on the device but not applied yet (overlapped scheduling): the next
    # step may already compute them, reading them from the device
    num_pending: int = 0
    # results of steps in flight to drop when they arrive: computed for the text before a
    # jump-forward appended (or re-tokenized) the output on the host
    num_discard: int = 0
    # whether its newest token was sampled into token_buf[pool_row] by a launched step, so that a
    # step computing just that token can read it there (false after admission to a new row and
    # after tokens are appended on the host, by jump-forward)
    token_in_buf: bool = False
    # the most output tokens it may have: max_new_tokens, or fewer where the context ends (set by
    # the engine core when it takes the request)
    max_output_len: int = 0

    # log-probabilities gathered so far: (logprob, token_id) and top lists
    input_token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    output_token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    # the same in the results' form, converted as entries arrive (`engine.request_output`), so
    # that a stream's snapshot each step costs a copy of references, not a conversion of all
    result_logprobs: dict[str, list[Any]] = field(default_factory=dict, repr=False)

    # speculative decoding: its drafter's state (NGRAM: the n-gram index, ngram.py; MEDUSA: the
    # next chain and the context length it follows, worker.py), and per request as
    # SGLang counts them: verify steps, draft tokens proposed and accepted in them, the tokens
    # they gave (accepted drafts and bonus tokens), and how many verifies accepted 0, 1, ...
    draft_index: Any = field(default=None, repr=False)
    spec_verify_ct: int = 0
    spec_num_proposed_drafts: int = 0
    spec_num_correct_drafts: int = 0
    spec_verify_tokens: int = 0
    spec_correct_drafts_histogram: list[int] = field(default_factory=list)

    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def all_ids(self) -> list[int]:
        """Prompt then output: every token whose K/V the next step needs (but the newest)."""
        return self.input_ids + self.output_ids

    def ids_slice(self, start: int, end: int | None = None) -> list[int]:
        """all_ids[start:end], without copying the context outside it as all_ids does."""
        prompt, out = self.input_ids, self.output_ids
        n = len(prompt)
        stop = n + len(out) if end is None else end
        if start >= n:
            return out[start - n : stop - n]
        if stop <= n:
            return prompt[start:stop]
        return prompt[start:] + out[: stop - n]

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @functools.cached_property
    def plain_greedy(self) -> bool:
        """Its next token is the argmax of the logits, always: no sampling, penalties, grammar,
        banned tokens or log-probabilities (so a step need not build its sampling row)."""
        p = self.params
        return (
            p.is_plain_argmax
            and self.grammar is None
            and p.min_new_tokens == 0
            and not self.logprob.return_logprob
        )

    @functools.cached_property
    def applied_inline(self) -> bool:
        """Applying a token is appending it, after the grammar (if any) takes it: no stop strings
        to look for, no log-probabilities to record."""
        return not self.logprob.return_logprob and not (
            self.detokenizer is not None and self.detokenizer.stop
        )

    @functools.cached_property
    def finish_token_ids(self) -> frozenset[int]:
        """Tokens that end the output: the stop tokens, and EOS unless ignored (a grammar that
        accepted EOS is complete, whatever ignore_eos says)."""
        p = self.params
        if p.ignore_eos and self.grammar is None:
            return frozenset(p.stop_token_ids)
        return frozenset(p.stop_token_ids) | self.eos_token_ids

    @functools.cached_property
    def needs_lockstep(self) -> bool:
        """Its step results need the device's answer before the next step is scheduled:
        log-probabilities to report (no overlapped scheduling meanwhile)."""
        return self.logprob.return_logprob

    @functools.cached_property
    def sampled_on_host(self) -> bool:
        """Its next token is sampled under what the host knows of the output so far (a grammar
        mask, penalties): with overlap, a step's sampling waits until the previous step's tokens
        are applied, while the device runs its forward."""
        return self.grammar is not None or self.params.has_penalties

    @property
    def sched_len(self) -> int:
        """Tokens known or being sampled: what the scheduler plans with."""
        return len(self.input_ids) + len(self.output_ids) + self.num_pending

    @property
    def is_finished(self) -> bool:
        return self.status is ReqStatus.FINISHED

    @property
    def prefill_done(self) -> bool:
        """True once every prompt token has K/V, and all but the newest of the tokens lost to a
        preemption: each step from then on decodes one token (or jump-forward's text)."""
        return self.kv_len >= len(self.input_ids) and self.kv_len + 1 >= self.recompute_len

    @property
    def wants_input_logprobs(self) -> bool:
        return self.logprob.return_logprob and 0 <= self.logprob.logprob_start_len < len(
            self.input_ids
        )

    def finish(self, reason: dict[str, Any]) -> None:
        self.status = ReqStatus.FINISHED
        self.finish_reason = reason
        self.finish_time = time.perf_counter()

    def fail(self, message: str) -> None:
        """Finish as aborted by an error, which the caller gets as its message."""
        self.error = message
        self.finish({"type": "abort", "message": message})
