"""The generations in flight: their ids, their deadlines, how one is ended early, and the bound on
how many are accepted at once.

A generation is *accepted* once the server has taken it (before its grammar compiles or its prompt
reaches the engine) and counts until it finishes, fails or is aborted; `max_queued_requests`
bounds that count (SGLang's option, whose scheduler bounds its waiting queue). Past the bound a
new request is refused at once with a 503 and `Retry-After`, before any work is done for it, so an
overloaded server answers quickly instead of queueing without end; every request accepted runs to
its end.

Each generation has an id: the `meta_info["id"]` the native API answers with (a client's own
`rid`, as SGLang takes it, or one the server makes), or the id of an OpenAI response (all of its
choices). `/abort_request` and a deadline end a generation by its id: the engine request is
aborted (its KV slots freed at once) and the stream ends with finish_reason
`{"type": "abort", "message": ...}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator
from typing import Any

from radixlm.server.errors import APIError, bad_request

# what a refused client is told to wait; a generation takes seconds, so a second is a fair retry
RETRY_AFTER_S = 1


class Generation:
    """One accepted generation: its id, and, once something ended it early, why."""

    __slots__ = ("id", "ended", "_wake", "_timer", "_released")

    def __init__(self, id: str) -> None:
        self.id = id
        self.ended: str | None = None  # the abort message, once ended early
        self._wake: asyncio.Event | None = None  # set by `end` for the stream that follows it
        self._timer: asyncio.TimerHandle | None = None
        self._released = False

    def end(self, message: str) -> None:
        """End the generation early (the first reason given wins)."""
        if self.ended is None and not self._released:
            self.ended = message
            if self._wake is not None:
                self._wake.set()


class InFlight:
    """The accepted generations of one app, by id (no module globals: two apps are apart)."""

    def __init__(self, max_queued: int | None = None) -> None:
        if max_queued is not None and max_queued < 1:
            raise ValueError("max_queued_requests must be at least 1 (or None: no bound)")
        self.max_queued = max_queued
        self.count = 0
        self._by_id: dict[str, list[Generation]] = {}

    def overloaded(self) -> APIError | None:
        """The 503 for a new request while the bound is reached (checked before its body is
        read), else None."""
        if self.max_queued is not None and self.count >= self.max_queued:
            return _overloaded(self.count, self.max_queued)
        return None

    def admit(
        self,
        ids: list[str],
        *,
        deadline_s: float | None = None,
        arrived: float | None = None,
        unique: bool = False,
    ) -> list[Generation]:
        """Accept one generation for each id (an id may repeat: the choices of one response), or
        raise: a 503 past `max_queued`, a 400 for a request larger than it could ever be, or (with
        `unique`) for an id already in flight. With `deadline_s`, each is ended that many
        seconds after `arrived` (time.perf_counter())."""
        limit = self.max_queued
        if limit is not None:
            if len(ids) > limit:
                raise bad_request(
                    f"this request asks for {len(ids)} generations and this server accepts at "
                    f"most {limit} at once (--max-queued-requests): split it"
                )
            if self.count + len(ids) > limit:
                raise _overloaded(self.count, limit)
        if unique:
            for id in ids:
                if id in self._by_id:
                    raise bad_request(f"rid {id!r} is already in use by a running request", "rid")
        generations = [Generation(id) for id in ids]
        if deadline_s is not None:
            start = time.perf_counter() if arrived is None else arrived
            delay = max(0.0, start + deadline_s - time.perf_counter())
            loop = asyncio.get_running_loop()
            message = f"the request timed out after {deadline_s:g} s"
            for g in generations:
                g._timer = loop.call_later(delay, g.end, message)
        for g in generations:
            self._by_id.setdefault(g.id, []).append(g)
        self.count += len(generations)
        return generations

    def release(self, generation: Generation) -> None:
        """The generation is over (finished, failed, aborted, or its request answered): it no
        longer counts. Releasing twice does nothing."""
        if generation._released:
            return
        generation._released = True
        if generation._timer is not None:
            generation._timer.cancel()
        same = self._by_id.get(generation.id)
        if same is not None:
            with contextlib.suppress(ValueError):
                same.remove(generation)
            if not same:
                del self._by_id[generation.id]
        self.count -= 1

    def abort(self, id: str, message: str) -> int:
        """End the generations of `id`; how many there were."""
        generations = list(self._by_id.get(id, ()))
        for g in generations:
            g.end(message)
        return len(generations)

    def abort_all(self, message: str) -> int:
        generations = [g for gs in self._by_id.values() for g in gs]
        for g in generations:
            g.end(message)
        return len(generations)


def _overloaded(count: int, limit: int) -> APIError:
    return APIError(
        503,
        f"the server is at capacity ({count} requests accepted, --max-queued-requests "
        f"{limit}); retry in {RETRY_AFTER_S} s",
        type="service_unavailable",
        code="server_overloaded",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def check_timeout(value: Any, param: str = "request_timeout") -> float | None:
    """A request's own deadline in seconds (None: none asked for), or a 400."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"{param} must be a number of seconds, got {value!r}", param)
    if not (value > 0 and math.isfinite(value)):
        raise bad_request(f"{param}={value} must be a positive number of seconds", param)
    return float(value)


def effective_timeout(server: float | None, request: float | None) -> float | None:
    """The deadline that applies: a request may ask for less time than the server's
    `--request-timeout`, never more."""
    given = [t for t in (server, request) if t is not None]
    return min(given) if given else None


async def endable(
    stream: AsyncIterator[dict[str, Any]], generation: Generation, prompt_tokens: int
) -> AsyncIterator[dict[str, Any]]:
    """`stream`'s snapshots until it ends or `generation` is ended early. Then the engine
    request is aborted (closing its stream: its KV slots are freed at once) and one last
    snapshot, the newest output with finish_reason `{"type": "abort", "message": why}`, ends it.

    The stream is read by a task of its own, one snapshot ahead at most (snapshots are
    cumulative: a slow reader holds one), so that an end can interrupt a wait for the next."""
    wake = asyncio.Event()
    taken = asyncio.Event()
    generation._wake = wake
    pending: list[dict[str, Any]] = []  # the snapshot read and not yet taken (one at most)
    outcome: list[BaseException | None] = []  # set once the stream is over

    async def pump() -> None:
        try:
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for snapshot in stream:
                    taken.clear()
                    pending.append(snapshot)
                    wake.set()
                    await taken.wait()
            outcome.append(None)
        except Exception as e:  # handed to the reader, which raises it
            outcome.append(e)
        finally:
            wake.set()

    task = asyncio.ensure_future(pump())
    last: dict[str, Any] | None = None
    try:
        while True:
            if pending:
                last = pending.pop()
                taken.set()
                yield last
                if last["meta_info"].get("finish_reason") is not None:
                    return
            elif generation.ended is not None:
                break
            elif outcome:
                if outcome[0] is not None:
                    raise outcome[0]
                return
            else:
                wake.clear()
                if not (pending or outcome or generation.ended is not None):
                    await wake.wait()
        # ended early: abort the engine request, then say so
        await _stop(task)
        with contextlib.suppress(Exception):
            await stream.aclose()  # type: ignore[attr-defined]  # (not started: never opened)
        yield _aborted(last, prompt_tokens, generation.ended)
    finally:
        generation._wake = None
        await _stop(task)


async def _stop(task: asyncio.Future[Any]) -> None:
    if not task.done():
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _aborted(last: dict[str, Any] | None, prompt_tokens: int, message: str) -> dict[str, Any]:
    if last is None:
        meta: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": 0}
        meta["cached_tokens"] = 0
        text, ids = "", []
    else:
        meta, text, ids = dict(last["meta_info"]), last["text"], last["output_ids"]
    meta["finish_reason"] = {"type": "abort", "message": message}
    return {"text": text, "output_ids": ids, "meta_info": meta}
