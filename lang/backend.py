"""What the interpreter needs from a backend, and the scoring of `select` shared by backends.

A backend turns the state's prompt into completions (`generate`, `generate_stream`), scores the
choices of a `select`, and warms the prefix cache before a fork (`cache_prefix`). Backends:
`EngineBackend` (an in-process `radixlm.Engine`), `RuntimeEndpoint` (a radixlm or SGLang server's
native API), `OpenAI` (any `/v1/chat/completions` server). Which one a program runs on is
`lang/default_backend.py`'s business.

A backend is given a `PromptContext`, the part of a program's state it reads, never the state
itself: this module sits below the interpreter and imports nothing above it.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from radixlm.lang.chat_template import ChatTemplate
from radixlm.lang.choices import ChoicesDecision, ChoicesSamplingMethod, TokenLogprobs, mean_logprob
from radixlm.lang.ir import GenParams


class BackendError(RuntimeError):
    """The backend could not serve a call (a server error, a failed generation)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class PromptContext:
    """What a backend reads of a program's state at one call: the text so far, the finished
    messages, and the open role (if any) with where its content begins in `text`."""

    text: str
    messages: tuple[dict[str, Any], ...] = ()
    role: str | None = None
    role_begin: int | None = None


class Backend:
    is_chat_model = False

    def __init__(self) -> None:
        self.chat_template: ChatTemplate

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def generate(self, prompt: PromptContext, params: GenParams) -> tuple[Any, Any]:
        """Complete the prompt's text: (text, meta_info), or (list of texts, list of meta_info)
        when params.n > 1."""
        raise NotImplementedError

    def generate_stream(
        self, prompt: PromptContext, params: GenParams
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Complete the prompt's text, yielding (new text, meta_info so far)."""
        raise NotImplementedError

    def select(
        self,
        prompt: PromptContext,
        choices: list[str],
        temperature: float,
        choices_method: Any,
        rng: random.Random,
    ) -> ChoicesDecision:
        """The choice to append after the prompt's text, scored by `score_choices`."""
        conditional, unconditional, meta = self.score_choices(
            prompt.text, choices, _needs_unconditional(choices_method)
        )
        return decide(choices_method, choices, conditional, unconditional, temperature, rng, meta)

    def score_choices(
        self, prefix: str, choices: list[str], unconditional: bool
    ) -> tuple[list[TokenLogprobs], list[TokenLogprobs] | None, dict[str, Any]]:
        """Per choice the log-probabilities of its tokens after `prefix` (and, when asked, of
        the same tokens alone), plus meta info about the scoring call."""
        raise NotImplementedError(f"{type(self).__name__} cannot score the choices of select")

    def cache_prefix(self, prefix: str) -> None:
        """Put the prefix's KV into the server's prefix cache (no-op where there is none)."""

    def commit_lazy_operations(self, prompt: PromptContext) -> None:
        """Compute the prompt's text in the prefix cache (before a fork shares it)."""
        if prompt.text:
            self.cache_prefix(prompt.text)

    def flush_cache(self) -> bool:
        return False

    def get_server_info(self) -> dict[str, Any]:
        return {}

    def shutdown(self) -> None:
        pass


def _needs_unconditional(method: Any) -> bool:
    return bool(getattr(method, "requires_unconditional_logprobs", False))


def decide(
    method: Any,
    choices: list[str],
    conditional: list[TokenLogprobs],
    unconditional: list[TokenLogprobs] | None,
    temperature: float,
    rng: random.Random,
    meta: dict[str, Any],
) -> ChoicesDecision:
    if isinstance(method, ChoicesSamplingMethod):
        return method(
            choices=choices,
            input_token_logprobs=conditional,
            unconditional_token_logprobs=unconditional,
            temperature=temperature,
            rng=rng,
            meta_info=meta,
        )
    # a method written for SGLang's interface (a callable taking these keywords)
    if temperature > 0:
        raise ValueError("select with temperature > 0 needs one of radixlm's choices methods")
    decision = method(
        choices=choices,
        normalized_prompt_logprobs=[mean_logprob(e) for e in conditional],
        input_token_logprobs=conditional,
        output_token_logprobs=[[] for _ in choices],
        unconditional_token_logprobs=unconditional,
    )
    return ChoicesDecision(decision.decision, {**(decision.meta_info or {}), **meta})


def pad_logprobs(entries: list[Any], ids: list[int]) -> TokenLogprobs:
    """The (logprob, id, text) entries of a prompt's tail `ids`, as tuples. A prompt scored from
    its first token has no logprob for it: missing leading entries get None."""
    got = [tuple(e) + (None,) * (3 - len(e)) for e in entries]
    missing = len(ids) - len(got)
    return [(None, t, None) for t in ids[:missing]] + got  # type: ignore[misc]


def choice_tokens(prefix_ids: list[int], full_ids: list[int]) -> int:
    """Where a choice's tokens start in the tokens of prefix + choice: after the longest common
    prefix with the prefix's own tokens (the last prefix token may merge with the choice)."""
    n = 0
    limit = min(len(prefix_ids), len(full_ids))
    while n < limit and prefix_ids[n] == full_ids[n]:
        n += 1
    return n
