"""Running generations for the routes: limits, fan-out of `n`, metrics, and cancellation.

Every generation runs as an engine stream, also for a client that did not ask to stream: the server
then sees each token arrive, which is what time-to-first-token and inter-token latency are measured
from. A generation whose consumer goes away (a closed stream, a cancelled task) is aborted in the
engine, so its KV slots are freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request

from radixlm.errors import EngineShutDown, GrammarRefused
from radixlm.protocol.sampling_params import check_priority
from radixlm.server.errors import (
    APIError,
    ClientDisconnected,
    bad_request,
    internal_error,
    unavailable,
)
from radixlm.server.http_util import sse_event
from radixlm.server.inflight import Generation, effective_timeout, endable
from radixlm.server.state import RequestUsage, ServerState


@dataclass(frozen=True)
class GenerationInput:
    """One engine request: a tokenized prompt and sampling params with n = 1."""

    input_ids: list[int]
    params: dict[str, Any]
    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    priority: int | None = None  # SGLang's (used with --enable-priority-scheduling)


logger = logging.getLogger("radixlm.server")


def stream_failure(state: ServerState, error: Exception) -> bytes:
    """The SSE event that reports a stream failing after it began, in-band (no handler sees it,
    so it is counted here): an engine shut down meanwhile is a 503, as before the stream."""
    if isinstance(error, EngineShutDown):
        error = unavailable(str(error))
    elif not isinstance(error, APIError):
        logger.error("stream failed", exc_info=error)
        error = internal_error(f"generation failed: {error}")
    state.metrics.count_error(error.type)
    return sse_event(error.body())


def fan_out(item: GenerationInput, n: int) -> list[GenerationInput]:
    """n independent samples of one prompt; with a seed, sample k uses seed + k (as the engine)."""
    if n == 1:
        return [item]
    seed = item.params.get("seed")
    out = []
    for k in range(n):
        params = dict(item.params)
        if isinstance(seed, int) and not isinstance(seed, bool):  # (else the engine refuses it)
            params["seed"] = seed + k
        out.append(replace(item, params=params))
    return out


def check_prompt(state: ServerState, input_ids: list[int], param: str = "prompt") -> None:
    if not input_ids:
        raise bad_request("the prompt is empty; give at least one token of text", param)
    info = state.backend.model_info()
    limit = state.limits.max_prompt_tokens
    if limit is not None and len(input_ids) > limit:
        raise bad_request(
            f"the prompt has {len(input_ids)} tokens; this server accepts at most {limit}",
            param,
            code="context_length_exceeded",
        )
    if len(input_ids) >= info.context_len:
        raise bad_request(
            f"the prompt has {len(input_ids)} tokens; the model's context is {info.context_len} "
            "(the prompt and at least one new token must fit): shorten the prompt",
            param,
            code="context_length_exceeded",
        )


def check_text_fits(state: ServerState, text: str, param: str = "prompt") -> None:
    """Refuse, before tokenizing it, a text too long for any tokenization to fit the context
    (tokenizing megabytes of text takes seconds)."""
    info = state.backend.model_info()
    if info.max_token_chars is None:
        return
    tokens = info.context_len
    if state.limits.max_prompt_tokens is not None:
        tokens = min(tokens, state.limits.max_prompt_tokens)
    most = 2 * tokens * info.max_token_chars  # twice the bound: never refuse what would fit
    if len(text) > most:
        raise bad_request(
            f"the prompt has {len(text):,} characters, more than {tokens} tokens of this model "
            "can hold: shorten it",
            param,
            code="context_length_exceeded",
        )


def check_max_new_tokens(state: ServerState, value: Any, param: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{param} must be an integer, got {value!r}", param)
    if value < 0:
        raise bad_request(f"{param}={value} must be >= 0", param)
    limit = state.limits.max_new_tokens
    if limit is not None and value > limit:
        raise bad_request(f"{param}={value} exceeds this server's limit of {limit}", param)


def check_request_priority(value: Any) -> int | None:
    """A request's `priority` (SGLang's: an integer, or null); a 400 saying what to send."""
    try:
        return check_priority(value)
    except ValueError as e:
        raise bad_request(str(e), "priority") from e


def check_n(state: ServerState, n: Any, param: str = "n") -> int:
    if isinstance(n, bool) or not isinstance(n, int):
        raise bad_request(f"{param} must be an integer, got {n!r}", param)
    if not 1 <= n <= state.limits.max_n:
        raise bad_request(f"{param}={n} must be in [1, {state.limits.max_n}]", param)
    return n


def check_batch(state: ServerState, count: int, param: str) -> None:
    if count > state.limits.max_batch_size:
        raise bad_request(
            f"{count} prompts in one request; this server accepts at most "
            f"{state.limits.max_batch_size}",
            param,
        )


def arrival(request: Request) -> float:
    """When the request arrived (time.perf_counter()), as the guard noted it before the body was
    read: the time to first token counts from here."""
    arrived = getattr(request.state, "arrived", None)
    return time.perf_counter() if arrived is None else arrived


def item_ids(value: Any, prompt_ns: list[int], count: int) -> list[str] | None:
    """The ids of a request's `count` generations from its `rid`, as SGLang names them: one
    `rid` for one generation, or `rid_0`, `rid_1`, ... for several; a list of them, one a prompt
    (`rid_k` for its n samples, `prompt_ns` giving each prompt's n). None: no rid given."""
    if value is None:
        return None
    if isinstance(value, str) and value:
        return [value] if count == 1 else [f"{value}_{i}" for i in range(count)]
    if (
        isinstance(value, list)
        and all(isinstance(r, str) and r for r in value)
        and len(value) == len(prompt_ns)
    ):
        if len(set(value)) != len(value):
            raise bad_request("rid holds the same id twice; give each prompt its own", "rid")
        return [r if n == 1 else f"{r}_{k}" for r, n in zip(value, prompt_ns) for k in range(n)]
    raise bad_request(
        f"rid must be a non-empty string or a list of {len(prompt_ns)} of them, one a prompt",
        "rid",
    )


async def start(
    state: ServerState,
    items: list[GenerationInput],
    usage: RequestUsage | None,
    arrived: float,
    *,
    ids: list[str] | None = None,
    timeout: float | None = None,
    streaming: bool = False,
    unique_ids: bool = False,
    isolate_refusals: bool = False,
) -> list[AsyncIterator[dict[str, Any]]]:
    """Accept the items (a 503 past `max_queued_requests`), validate every one with the engine,
    then hand back their (not yet started) streams, observed by the metrics: latencies from
    `arrived` (see `arrival`), token counts, outcomes.

    `ids` are the generations' ids, one per item (default: new ones), the `meta_info["id"]` of
    their snapshots and what `/abort_request` takes (`unique_ids`: a 400 for one in use);
    `timeout` is the request's own deadline in seconds (the server's `request_timeout` bounds
    it). Nothing is queued until a stream is first advanced, so a bad item fails the whole
    request before any work is done. With `isolate_refusals` (the items of a list of prompts, as
    the engine's own list API treats them) an item whose grammar the engine refuses is no 400:
    its stream ends at once, aborted with the reason, and the other items run."""
    if ids is None:
        ids = [uuid.uuid4().hex for _ in items]
    deadline = effective_timeout(state.limits.request_timeout, timeout)
    generations = state.inflight.admit(ids, deadline_s=deadline, arrived=arrived, unique=unique_ids)
    if usage is not None:  # (released when the request is answered, whatever became of them)
        usage.generations.extend(generations)
    try:
        streams = await open_streams(state, items, isolate_refusals=isolate_refusals)
    except BaseException:
        for generation in generations:
            state.inflight.release(generation)
        raise
    request = _RequestOutcome()
    observed: list[AsyncIterator[dict[str, Any]]] = []
    for stream, item, generation in zip(streams, items, generations):
        if isinstance(stream, RefusedStream):
            stream.meta_info["id"] = generation.id
            stream.meta_info["e2e_latency"] = state.metrics.timer(arrived).refuse()
            state.inflight.release(generation)
            if usage is not None:
                usage.note_final(stream.meta_info, None)
            observed.append(stream)
        else:
            observed.append(
                _observed(state, stream, generation, item, usage, arrived, request, streaming)
            )
    return observed


@dataclass
class _RequestOutcome:
    """Shared by the generations of one request (a batch, n > 1)."""

    failed: bool = False  # one of them failed: the others are closed for that, not by the client


async def open_streams(
    state: ServerState, items: list[GenerationInput], *, isolate_refusals: bool = False
) -> list[AsyncIterator[dict[str, Any]]]:
    """`start` without the metrics: for the health probe, which is not user traffic. The items
    are opened together: their grammars compile side by side, not one after another."""

    async def open_one(item: GenerationInput) -> AsyncIterator[dict[str, Any]]:
        try:
            return await state.backend.stream(
                item.input_ids,
                item.params,
                return_logprob=item.return_logprob,
                logprob_start_len=item.logprob_start_len,
                top_logprobs_num=item.top_logprobs_num,
                priority=item.priority,
            )
        except GrammarRefused as e:
            if not isolate_refusals:
                raise
            return RefusedStream(len(item.input_ids), str(e))

    tasks = [asyncio.ensure_future(open_one(item)) for item in items]
    try:
        await asyncio.wait(tasks)
    except BaseException:  # cancelled: whatever opened meanwhile is closed
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await _close_all(_opened(tasks))
        raise
    error = next((t.exception() for t in tasks if t.exception() is not None), None)
    if error is None:
        return [t.result() for t in tasks]
    await _close_all(_opened(tasks))  # (a refused item: the streams opened are closed)
    if isinstance(error, (ValueError, TypeError)):
        raise bad_request(str(error)) from error
    if isinstance(error, EngineShutDown):
        raise unavailable(str(error)) from error
    raise error


def _opened(tasks: list[asyncio.Future]) -> list[AsyncIterator[dict[str, Any]]]:
    return [t.result() for t in tasks if t.done() and not t.cancelled() and t.exception() is None]


class RefusedStream:
    """The stream of an item whose grammar the engine refused (the others of its list run): one
    final snapshot, aborted with the reason, in the shape the engine gives such an item of a list
    (less its `error`, which marks a failure of the engine's own)."""

    def __init__(self, prompt_tokens: int, message: str) -> None:
        self.meta_info: dict[str, Any] = {
            "id": f"refused-{uuid.uuid4().hex[:12]}",
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 0,
            "cached_tokens": 0,
            "finish_reason": {"type": "abort", "message": message},
            "e2e_latency": 0.0,
        }
        self._done = False

    def __aiter__(self) -> RefusedStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._done:
            raise StopAsyncIteration
        self._done = True
        return {"text": "", "output_ids": [], "meta_info": dict(self.meta_info)}

    async def aclose(self) -> None:
        self._done = True


async def _observed(
    state: ServerState,
    stream: AsyncIterator[dict[str, Any]],
    generation: Generation,
    item: GenerationInput,
    usage: RequestUsage | None,
    arrived: float,
    request: _RequestOutcome,
    streaming: bool,
) -> AsyncIterator[dict[str, Any]]:
    timer = state.metrics.timer(arrived, streaming)
    finished = failed = False
    meta: dict[str, Any] | None = None  # the last snapshot's
    snapshots = endable(stream, generation, len(item.input_ids))
    try:
        async with contextlib.aclosing(snapshots):  # closing it aborts the engine request
            async for snapshot in snapshots:
                meta = {**snapshot["meta_info"], "id": generation.id}
                snapshot = {**snapshot, "meta_info": meta}
                if meta.get("finish_reason") is not None:
                    finished = True
                    request.failed = request.failed or finish_error(meta) is not None
                    timer.finish(meta)
                    if usage is not None:
                        usage.add(meta)
                        usage.note_final(meta, snapshot["text"])
                else:
                    timer.update(int(meta.get("completion_tokens", 0)))
                yield snapshot
    except (GeneratorExit, asyncio.CancelledError):  # closed early: the client went away
        raise
    except BaseException:  # the generation failed (its error is counted where it is answered)
        failed = request.failed = True
        raise
    finally:
        state.inflight.release(generation)
        if not finished:
            if usage is not None and meta is not None:  # cut off: the tokens it got so far
                usage.add(meta)
            if failed:
                timer.fail()
            elif request.failed:
                timer.cancel()
            else:
                timer.abandon()


async def last(stream: AsyncIterator[dict[str, Any]]) -> dict[str, Any]:
    """The final snapshot of a stream."""
    final = None
    async with contextlib.aclosing(stream):
        async for snapshot in stream:
            final = snapshot
    if final is None:
        raise APIError(500, "the engine ended a generation without a result", type="internal_error")
    return final


async def collect(streams: list[AsyncIterator[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The final snapshots of all streams, in order; if one fails, the others are cancelled."""
    if len(streams) == 1:
        return [await last(streams[0])]
    tasks = [asyncio.ensure_future(last(s)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        await _cancel(tasks)


async def merge(
    streams: list[AsyncIterator[dict[str, Any]]],
) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """(index, snapshot) from all streams as they come; closing this closes them all.

    A stream's next snapshot is read only once its last one was taken: snapshots are cumulative,
    so a reader that falls behind holds one of each stream, not one a step (the streams keep
    only their newest meanwhile)."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]):
            async for snapshot in streams[0]:
                yield 0, snapshot
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    taken = [asyncio.Event() for _ in streams]
    end = object()

    async def pump(index: int, stream: AsyncIterator[dict[str, Any]]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for snapshot in stream:
                    taken[index].clear()
                    queue.put_nowait((index, snapshot))
                    await taken[index].wait()
        except Exception as e:  # handed to the consumer, which raises it
            queue.put_nowait((index, e))
        finally:
            queue.put_nowait((index, end))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            taken[index].set()
            if item is end:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        await _cancel(tasks)


async def cancel_on_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work`; if the client disconnects first, cancel it (aborting its generations)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            await _cancel([task])
        await _cancel([watcher])
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    # the body has been read by now, so the next message can only be the disconnect
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _cancel(tasks: list[asyncio.Future[Any]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _close_all(streams: list[AsyncIterator[dict[str, Any]]]) -> None:
    for stream in streams:
        with contextlib.suppress(Exception):
            await stream.aclose()  # type: ignore[attr-defined]


def stop_string_kept(text: str, meta_info: dict[str, Any]) -> str:
    """`no_stop_trim`: the text with the stop string that ended its generation put back."""
    reason = meta_info.get("finish_reason")
    if (
        isinstance(reason, dict)
        and reason.get("type") == "stop"
        and isinstance(reason.get("matched"), str)
    ):
        return text + reason["matched"]
    return text


def finish_error(meta_info: dict[str, Any]) -> str | None:
    """The engine's error message when a generation failed inside the engine (not by the client)."""
    error = meta_info.get("error")
    return str(error) if error else None
