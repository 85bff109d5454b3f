"""How `select` picks among its choices from their token log-probabilities (SGLang's methods).

Every method sees, per choice, the log-probabilities of the choice's own tokens given the prompt
(`input_token_logprobs`: a list of `(logprob, token_id, text)` per choice) and their mean
(`normalized_prompt_logprobs`).

- `token_length_normalized` (default): the highest mean log-probability per token.
- `greedy_token_selection`: the highest first-token log-probability; ties go to the next token,
  a shorter choice being padded with its own mean log-probability.
- `unconditional_likelihood_normalized`: the highest mean of (conditional - unconditional) token
  log-probabilities, the unconditional ones scored on the choice alone (its first token counts 0).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)


TokenLogprobs = list[tuple[Any, int, Any]]  # (logprob or None, token id, token text or None)


def mean_logprob(entries: TokenLogprobs) -> float:
    values = [e[0] for e in entries if e[0] is not None]
    return sum(values) / len(values) if values else float("-inf")


class ChoicesSamplingMethod:
    """Picks a choice. `scores` ranks the choices (higher is better); with a temperature above 0
    `select` samples from softmax(scores / temperature) instead of taking the best."""

    name = "choices_method"
    requires_unconditional_logprobs = False

    def scores(
        self,
        input_token_logprobs: list[TokenLogprobs],
        unconditional_token_logprobs: list[TokenLogprobs] | None,
    ) -> list[float]:
        return [mean_logprob(e) for e in input_token_logprobs]

    def best(self, scores: list[float], input_token_logprobs: list[TokenLogprobs]) -> int:
        return max(range(len(scores)), key=scores.__getitem__)

    def extra_meta(
        self,
        input_token_logprobs: list[TokenLogprobs],
        unconditional_token_logprobs: list[TokenLogprobs] | None,
        scores: list[float],
    ) -> dict[str, Any]:
        return {}

    def __call__(
        self,
        *,
        choices: list[str],
        input_token_logprobs: list[TokenLogprobs],
        unconditional_token_logprobs: list[TokenLogprobs] | None = None,
        temperature: float = 0.0,
        rng: random.Random | None = None,
        meta_info: dict[str, Any] | None = None,
    ) -> ChoicesDecision:
        if self.requires_unconditional_logprobs and unconditional_token_logprobs is None:
            raise ValueError(f"{self.name} needs the choices' unconditional log-probabilities")
        scores = self.scores(input_token_logprobs, unconditional_token_logprobs)
        if temperature > 0:
            index = _sample(scores, temperature, rng or random.Random())
        else:
            index = self.best(scores, input_token_logprobs)
        meta = {
            "normalized_prompt_logprobs": [mean_logprob(e) for e in input_token_logprobs],
            "input_token_logprobs": input_token_logprobs,
            "output_token_logprobs": [[] for _ in choices],
            **self.extra_meta(input_token_logprobs, unconditional_token_logprobs, scores),
            **(meta_info or {}),
        }
        return ChoicesDecision(choices[index], meta)

    def __repr__(self) -> str:
        return self.name


class TokenLengthNormalized(ChoicesSamplingMethod):
    name = "token_length_normalized"


class GreedyTokenSelection(ChoicesSamplingMethod):
    name = "greedy_token_selection"

    def best(self, scores: list[float], input_token_logprobs: list[TokenLogprobs]) -> int:
        matrix = _padded_matrix(input_token_logprobs)
        remaining = list(range(len(matrix)))
        for j in range(len(matrix[0]) if matrix else 0):
            top = max(matrix[i][j] for i in remaining)
            remaining = [i for i in remaining if matrix[i][j] == top]
            if len(remaining) == 1:
                break
        return remaining[0]

    def scores(self, input_token_logprobs, unconditional_token_logprobs):
        # for sampling with a temperature: the first token's log-probability
        return [_first(e) for e in input_token_logprobs]

    def extra_meta(self, input_token_logprobs, unconditional_token_logprobs, scores):
        return {"greedy_logprob_matrix": _padded_matrix(input_token_logprobs)}


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    name = "unconditional_likelihood_normalized"
    requires_unconditional_logprobs = True

    def scores(self, input_token_logprobs, unconditional_token_logprobs):
        assert unconditional_token_logprobs is not None  # checked in __call__
        out = []
        for cond, uncond in zip(input_token_logprobs, unconditional_token_logprobs):
            if len(cond) != len(uncond):
                raise ValueError("conditional and unconditional token counts differ")
            diffs = [(c[0] or 0.0) - (u[0] or 0.0) for c, u in zip(cond, uncond)]
            out.append(sum(diffs) / len(diffs) if diffs else float("-inf"))
        return out

    def extra_meta(self, input_token_logprobs, unconditional_token_logprobs, scores):
        return {
            "unconditional_token_logprobs": unconditional_token_logprobs,
            "normalized_unconditional_prompt_logprobs": scores,
        }


def _first(entries: TokenLogprobs) -> float:
    for e in entries:
        if e[0] is not None:
            return e[0]
    return float("-inf")


def _padded_matrix(input_token_logprobs: list[TokenLogprobs]) -> list[list[float]]:
    """Per choice its token log-probabilities, a shorter choice padded with its mean."""
    width = max((len(e) for e in input_token_logprobs), default=0)
    rows = []
    for entries in input_token_logprobs:
        mean = mean_logprob(entries)
        row = [e[0] if e[0] is not None else mean for e in entries]
        rows.append(row + [mean] * (width - len(row)))
    return rows


def _sample(scores: list[float], temperature: float, rng: random.Random) -> int:
    finite = [s for s in scores if math.isfinite(s)]
    if not finite:
        return 0
    top = max(finite)
    weights = [math.exp((s - top) / temperature) if math.isfinite(s) else 0.0 for s in scores]
    return rng.choices(range(len(scores)), weights=weights)[0]


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
