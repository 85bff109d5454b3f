"""Whether speculation pays at the batch size the engine runs now, decided by measurement.

While a batch is small a step is bound by reading the weights, and verifying k tokens a request
costs about what decoding one does; as the batch grows the verify step's rows grow k-fold, the step
becomes bound by compute, and a verify step costs up to k decode steps while it gives fewer than k
tokens a request. Where that happens depends on the model, the GPU, the drafts' acceptance and
the contexts' lengths, so it is measured, not guessed: per batch-size bucket (powers of two) the
gate keeps an estimate of the output tokens per second of the steps that verified drafts and of
the steps that did not, and lets the scheduler draft where the former is the higher.

A bucket's first steps draft and go plain in turn until each way is measured twice, and each
way's estimate starts from the faster of its two: a step that paid for compiling new kernel
shapes, or for a first graph replay, is slow once, and a way judged by it alone could lose for
long (with the rates an H100 measured at batch 128 and a slow first plain step, the gate before
drafted 21 of 128 steps in tests/test_speculative_units.py's simulation; this one drafts the
two measuring steps). From then on each step goes the way the
estimates point, each new measurement moving its way's estimate by `weight`, and now and then
a step goes the other way, so that a change (longer contexts, drafts that stopped matching) is
seen. How often is `explore` steps times how many times faster the winner is (a step of the
loser costs about that many of the winner's), and twice as long each time such a step confirms
the loser, up to `explore` x `max_backoff`: where a verify step costs twenty plain ones, trying
it every 16 steps alone more than doubled the time. A step that also computes a prompt chunk
measures neither, so while a bucket is still being measured such a step does not draft (at a
large batch a verify step can cost a dozen plain ones, and the ramp of a batch's admission is
many such steps); one whose requests were all left without a draft counts as a plain step (it
decoded plainly).
"""

from __future__ import annotations


class SpeculationGate:
    def __init__(
        self, explore: int = 16, weight: float = 0.25, first: int = 2, max_backoff: int = 64
    ) -> None:
        """`explore`: steps of a bucket between tries of the other way, at first; `weight`: of
        each new measurement in an estimate; `first`: measurements of each way before the
        estimates decide (the faster counts); `max_backoff`: the most the exploring interval
        grows (a factor of `explore`)."""
        if explore < 1 or first < 1 or max_backoff < 1 or not 0 < weight <= 1:
            raise ValueError(
                "SpeculationGate: explore, first and max_backoff must be >= 1, weight in (0, 1]"
            )
        self.explore = explore
        self.weight = weight
        self.first = first
        self.max_backoff = max_backoff
        self._rate: dict[tuple[int, bool], float] = {}  # (bucket, verified) -> tokens per second
        self._count: dict[tuple[int, bool], int] = {}  # (bucket, verified) -> measurements
        self._steps: dict[int, int] = {}  # bucket -> drafting decisions made
        self._backoff: dict[int, int] = {}  # bucket -> the exploring interval's factor
        self._explored: dict[int, int] = {}  # bucket -> the step that last tried the loser
        self.plain_steps = 0  # steps the gate kept from drafting
        self.draft_steps = 0  # steps it let draft

    @staticmethod
    def bucket(batch: int) -> int:
        """1, 2-3, 4-7, ... requests: a bucket each."""
        return max(1, batch).bit_length()

    def drafting(self, batch: int, measured: bool = True) -> bool:
        """Whether the next step of `batch` decoding requests drafts. `measured`: the step will
        be measured (no prompt chunk in it); one that will not, does not draft while its bucket
        is still being measured, and does not count as one of its steps."""
        b = self.bucket(batch)
        spec_n, plain_n = self._count.get((b, True), 0), self._count.get((b, False), 0)
        if not measured and min(spec_n, plain_n) < self.first:
            self.plain_steps += 1
            return False
        n = self._steps[b] = self._steps.get(b, 0) + 1
        if min(spec_n, plain_n) < self.first:  # (measuring: the way measured less, drafting first)
            draft = spec_n < plain_n if spec_n != plain_n else n % 2 == 1
        else:
            self._explored.setdefault(b, n - 1)  # (measuring ended at the step before)
            best, explore_at = self._decided(b)
            draft = best
            if n >= explore_at:
                draft, self._explored[b] = not best, n
        self.plain_steps += not draft
        self.draft_steps += draft
        return draft

    def _decided(self, b: int) -> tuple[bool, int]:
        """A measured bucket's way (True: drafting) and the step that next tries the other."""
        spec, plain = self._rate[(b, True)], self._rate[(b, False)]
        # a step of the losing way costs about (winner / loser) steps of the winning way
        ratio = max(spec, plain) / max(min(spec, plain), 1e-9)
        factor = min(self.max_backoff, self._backoff.get(b, 1) * max(1, int(ratio)))
        return spec >= plain, self._explored[b] + self.explore * factor

    def quiet(self, batch: int, ahead: int) -> bool:
        """Whether none of the next `ahead` steps of `batch` decoding requests will draft: plain
        decoding leads and no try of drafting is due in that time. A drafter that prepares for
        drafts at every step (EAGLE3 keeps the target's features) may rest meanwhile."""
        b = self.bucket(batch)
        if b not in self._explored:  # (still measuring)
            return False
        best, explore_at = self._decided(b)
        return not best and self._steps.get(b, 0) + ahead < explore_at

    def observe(self, batch: int, verified: bool, tokens: int, seconds: float) -> None:
        """A step of `batch` decoding requests (`verified`: it checked drafts) gave `tokens`
        output tokens in `seconds` (scheduling to its tokens applied)."""
        if tokens <= 0 or seconds <= 0:
            return
        b = self.bucket(batch)
        key, other = (b, verified), (b, not verified)
        rate = tokens / seconds
        count = self._count[key] = self._count.get(key, 0) + 1
        old, theirs = self._rate.get(key), self._rate.get(other)
        # (both measured `first` times before this one: the estimates decide the steps now)
        deciding = min(count - 1, self._count.get(other, 0)) >= self.first
        if old is None or (count <= self.first and rate > old):
            self._rate[key] = rate
        elif count > self.first:
            self._rate[key] = old + self.weight * (rate - old)
        if deciding and theirs is not None and old is not None and old < theirs:
            # an exploring step of the losing way: it lost again (backing off), or now leads
            lost = self._rate[key] < theirs
            factor = self._backoff.get(b, 1)
            self._backoff[b] = min(self.max_backoff, factor * 2) if lost else 1

    def rates(self) -> dict[tuple[int, bool], float]:
        """(bucket, verified) -> the estimate of tokens per second (for stats and tests)."""
        return dict(self._rate)
