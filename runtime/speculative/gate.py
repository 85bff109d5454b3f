"""Whether speculation pays at the batch size the engine runs now, decided by measurement.

While a batch is small a step is bound by reading the weights, and verifying k tokens a request
costs about what decoding one does; as the batch grows the verify step's rows grow k-fold, the step
becomes bound by compute, and a verify step costs up to k decode steps while it gives fewer than k
tokens a request. Where that happens depends on the model, the GPU, the drafts' acceptance and
the contexts' lengths, so it is measured, not guessed: per batch-size bucket (powers of two) the
gate keeps a moving average of the output tokens per second of the steps that verified drafts and
of the steps that did not, and lets the scheduler draft where the former is the higher.

A bucket's first step drafts (speculation was asked for) and its second goes plain, so both are
measured at once: a large batch, where a wrong choice costs most, runs few steps in each bucket
(on the H100 a batch of 128 with drafting throughout ran at 0.10-0.35x of plain decoding before
the gate measured early). From then on each step goes the way the averages point, and every
`explore`-th step the other way, so that a change (longer contexts, drafts that stopped
matching) is seen; a first measurement that paid for compiling new kernel shapes is corrected
when its way is explored again. A step that also computes a prompt chunk measures neither; one
whose requests were all left without a draft counts as a plain step (it decoded plainly).
"""

from __future__ import annotations


class SpeculationGate:
    def __init__(self, explore: int = 16, weight: float = 0.25) -> None:
        """`explore`: every this many steps of a bucket try the other way; `weight`: of each new
        measurement in the moving averages."""
        self.explore = explore
        self.weight = weight
        self._rate: dict[tuple[int, bool], float] = {}  # (bucket, verified) -> tokens per second
        self._steps: dict[int, int] = {}  # bucket -> drafting decisions made
        self.plain_steps = 0  # steps the gate kept from drafting

    @staticmethod
    def bucket(batch: int) -> int:
        """1, 2-3, 4-7, ... requests: a bucket each."""
        return max(1, batch).bit_length()

    def drafting(self, batch: int) -> bool:
        """Whether the next step of `batch` decoding requests drafts."""
        b = self.bucket(batch)
        n = self._steps[b] = self._steps.get(b, 0) + 1
        spec, plain = self._rate.get((b, True)), self._rate.get((b, False))
        if spec is None:  # (until both are measured: draft, then plain, in turn)
            draft = True
        elif plain is None:
            draft = n % 2 == 1
        else:
            best = spec >= plain
            draft = best if n % self.explore else not best
        self.plain_steps += not draft
        return draft

    def observe(self, batch: int, verified: bool, tokens: int, seconds: float) -> None:
        """A step of `batch` decoding requests (`verified`: it checked drafts) gave `tokens`
        output tokens in `seconds` (scheduling to its tokens applied)."""
        if tokens <= 0 or seconds <= 0:
            return
        key = (self.bucket(batch), verified)
        rate = tokens / seconds
        old = self._rate.get(key)
        self._rate[key] = rate if old is None else old + self.weight * (rate - old)

    def rates(self) -> dict[tuple[int, bool], float]:
        """(bucket, verified) -> the moving average of tokens per second (for stats and tests)."""
        return dict(self._rate)
