"""The engine in a process of its own, so that the HTTP front and the engine core do not share a GIL.

    backend = EngineProcessBackend({"max_total_tokens": 4096})   # spawns the engine, waits for it
    app = create_app(backend)

The server process keeps the HTTP work: parsing, tokenizing and chat templates (its own copy of the
model's tokenizer), JSON and SSE, metrics. The engine process runs a `radixlm.Engine` (its core
thread schedules and runs the model) behind a small asyncio loop that validates requests and
compiles grammars in worker threads, and streams each generation back as deltas (ipc.py). The two
talk over a socket pair in msgspec-encoded frames.

A request crosses as `Generate` (validated, answered by Accepted or Rejected, so a bad request is
a 400 before anything runs), `Start` when its stream is first read, and `Abort` when its stream is
closed early (a client that went away): the engine then frees its KV slots.

If the engine process dies, every open stream and call fails at once with a 503, new requests get a
503, and `is_alive()` (which /health reports) turns false. The engine process ignores SIGINT and
SIGTERM: the server stops it (closing the channel) once its own graceful shutdown is done, and it
exits by itself when the server process goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import signal
import socket
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

from radixlm.errors import EngineShutDown
from radixlm.protocol.stats import EngineStats
from radixlm.server.backend import LocalEngineBackend, ModelInfo, TokenizerSide
from radixlm.server.errors import APIError, internal_error, unavailable
from radixlm.server.ipc import (
    ENGINE_CALLS,
    ERROR,
    INVALID,
    REQUEST_INVALID,
    UNAVAILABLE,
    Abort,
    Accepted,
    Call,
    CallResult,
    Codec,
    DeltaEncoder,
    Failed,
    Generate,
    Outbox,
    Ready,
    Rejected,
    SnapshotBuilder,
    Start,
    StartupFailed,
    ToEngine,
    ToServer,
    Update,
    error_kind,
    exception_for,
    is_callers_fault,
    read_frame,
    read_frame_blocking,
)

logger = logging.getLogger("radixlm.server")

STOP_TIMEOUT_S = 30.0  # for the engine process to finish its shutdown before it is killed


class EngineProcessBackend(TokenizerSide):
    """`GenerationBackend` over a `radixlm.Engine` in a spawned child process.

    `engine_kwargs` are `radixlm.Engine`'s keyword arguments (EngineConfig fields). Bad options
    raise ValueError here, as `radixlm.Engine` would; the constructor returns once the model is
    loaded. `startup_timeout` (seconds, None: no limit) bounds the load. The channel is bound to
    the first event loop that uses the backend (the server's).
    """

    def __init__(
        self,
        engine_kwargs: dict[str, Any] | None = None,
        *,
        log_level: str = "info",
        startup_timeout: float | None = None,
    ) -> None:
        from radixlm.runtime.config import EngineConfig

        kwargs = dict(engine_kwargs or {})
        EngineConfig.from_kwargs(**kwargs)  # bad options fail here, before a process is started
        self._codec = Codec(ToServer)
        self._sock, theirs = socket.socketpair()
        self._process = multiprocessing.get_context("spawn").Process(
            target=run_engine_process,
            args=(theirs, kwargs, log_level),
            name="radixlm-engine",
        )
        self._process.start()
        theirs.close()  # the child holds its own copy: its exit is our end of stream
        self._closed = False
        self._lost: str | None = None  # why the engine is gone, once it is
        self._ids = itertools.count(1)
        self._streams: dict[int, _RemoteStream] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._connected: asyncio.Future[Outbox] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox: Outbox | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._stats_call: asyncio.Future[Any] | None = None
        try:
            ready = self._wait_ready(startup_timeout)
            from radixlm.runtime import startup
            from radixlm.runtime.model_loader import load_tokenizer

            startup.say("loading the tokenizer in the HTTP server's process")
            tokenizer = load_tokenizer(ready.tokenizer_path)
            if kwargs.get("chat_template") is not None:  # the engine's, as it resolved it
                tokenizer.chat_template = ready.model_info["chat_template"]
            super().__init__(tokenizer)
        except BaseException:
            self._stop_process()
            raise
        self._info = ModelInfo(**ready.model_info)
        self._engine_config = {**ready.engine_config, "engine_pid": self._process.pid}

    # ---- GenerationBackend ----------------------------------------------------------------

    def model_info(self) -> ModelInfo:
        return self._info

    def engine_config(self) -> dict[str, Any]:
        return dict(self._engine_config)

    def is_alive(self) -> bool:
        return self._lost is None and not self._closed and self._process.is_alive()

    async def stream(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        *,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        priority: int | None = None,
    ) -> _RemoteStream:
        outbox = await self._channel()
        self._check_alive(EngineShutDown)  # as the in-process engine, once shut down
        rid = next(self._ids)
        message = Generate(
            rid,
            list(input_ids),
            dict(sampling_params),
            bool(return_logprob),
            logprob_start_len,
            top_logprobs_num,
            priority,
        )
        stream = _RemoteStream(self, rid)
        try:
            outbox.send(message)
        except (TypeError, OverflowError, ValueError) as e:  # msgpack cannot carry a value
            raise ValueError(f"invalid request: {e}") from None
        self._streams[rid] = stream
        try:
            await stream.accepted
        except asyncio.CancelledError:
            self._send(Abort(rid))
            self._streams.pop(rid, None)
            raise
        except BaseException:
            self._streams.pop(rid, None)
            raise
        return stream

    async def flush_cache(self) -> bool:
        return bool(await self._call("flush_cache"))

    async def freeze_gc(self) -> None:
        await self._call("freeze_gc")

    async def stats(self) -> EngineStats:
        # concurrent scrapes share one round trip (the engine answers between two steps)
        if self._stats_call is None or self._stats_call.done():
            self._stats_call = asyncio.ensure_future(self._call("stats"))
        return EngineStats.from_dict(await asyncio.shield(self._stats_call))

    async def start_profile(self, output_dir: str) -> None:
        await self._call("start_profile", output_dir)

    async def stop_profile(self) -> str:
        return str(await self._call("stop_profile"))

    def shutdown(self) -> None:
        """Stop the engine process: close the channel (aborting what still runs), wait for it to
        exit, kill it if it does not."""
        if self._closed:
            return
        self._closed = True
        self._stop_process()

    # ---- the channel ----------------------------------------------------------------------

    def _wait_ready(self, timeout: float | None) -> Ready:
        ready = wait([self._sock, self._process.sentinel], timeout)
        if not ready:
            raise RuntimeError(f"the engine process did not load the model in {timeout:g} s")
        body = read_frame_blocking(self._sock) if self._sock in ready else None
        if body is None:
            self._process.join(5)
            raise RuntimeError(
                f"the engine process exited while loading (exit code {self._process.exitcode}); "
                "its log above says why"
            )
        (message,) = self._codec.decode(body)
        if isinstance(message, StartupFailed):
            raise exception_for(
                message.kind,
                message.message,
                lambda m: RuntimeError(f"the engine failed to start: {m}"),
            )
        if not isinstance(message, Ready):
            raise RuntimeError(f"the engine process sent {type(message).__name__} before Ready")
        return message

    async def _channel(self) -> Outbox:
        if self._connected is None:
            self._connected = asyncio.ensure_future(self._connect())
        return await asyncio.shield(self._connected)

    async def _connect(self) -> Outbox:
        self._loop = asyncio.get_running_loop()
        self._sock.setblocking(False)
        reader, self._writer = await asyncio.open_connection(sock=self._sock)
        self._outbox = Outbox(Codec(ToEngine), self._writer)
        self._reader_task = asyncio.ensure_future(self._read(reader))
        return self._outbox

    async def _read(self, reader: asyncio.StreamReader) -> None:
        reason = "the engine process closed the channel"
        try:
            while (body := await read_frame(reader)) is not None:
                for message in self._codec.decode(body):
                    self._dispatch(message)
        except asyncio.CancelledError:
            reason = "the server is shutting down"
        except Exception as e:
            reason = f"the channel to the engine process failed: {e}"
        self._on_lost(reason)

    def _on_lost(self, reason: str) -> None:
        if not self._closed:
            with contextlib.suppress(Exception):
                self._process.join(0.2)
            code = self._process.exitcode
            if code is not None:
                reason = f"the engine process exited (exit code {code})"
            logger.error("%s: failing its %d open requests", reason, len(self._streams))
        else:
            reason = "the engine is shut down"
        self._lost = reason
        error = unavailable(reason)
        for stream in list(self._streams.values()):
            stream.fail(error)
        for future in list(self._calls.values()):
            if not future.done():
                future.set_exception(error)

    def _dispatch(self, message: Any) -> None:
        if isinstance(message, Update):
            stream = self._streams.get(message.rid)
            if stream is not None:
                stream.put(message)
        elif isinstance(message, CallResult):
            future = self._calls.pop(message.cid, None)
            if future is not None and not future.done():
                if message.error is None:
                    future.set_result(message.value)
                else:
                    error = exception_for(
                        message.error_kind or ERROR,
                        message.error,
                        lambda m: internal_error(f"the engine failed: {m}"),
                    )
                    future.set_exception(error)
        elif isinstance(message, Accepted):
            stream = self._streams.get(message.rid)
            if stream is not None and not stream.accepted.done():
                stream.accepted.set_result(None)
        elif isinstance(message, Rejected):
            stream = self._streams.pop(message.rid, None)
            if stream is not None and not stream.accepted.done():
                error = exception_for(
                    message.kind,
                    message.message,
                    lambda m: internal_error(f"the engine failed to take the request: {m}"),
                )
                stream.accepted.set_exception(error)
        elif isinstance(message, Failed):
            stream = self._streams.get(message.rid)
            if stream is not None:
                stream.fail(internal_error(f"generation failed: {message.message}"))
        else:
            logger.warning("unexpected message from the engine process: %r", message)

    def _check_alive(self, error: Callable[[str], Exception]) -> None:
        if self._lost is not None or self._closed:
            raise error(self._lost or "the engine is shut down")

    def _send(self, message: Any) -> None:
        if self._outbox is not None and self._lost is None and not self._closed:
            self._outbox.send(message)

    def _send_threadsafe(self, message: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._send, message)

    async def _call(self, method: str, arg: str | None = None) -> Any:
        outbox = await self._channel()
        self._check_alive(unavailable)
        cid = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[cid] = future
        try:
            outbox.send(Call(cid, method, arg))
            return await future
        finally:
            self._calls.pop(cid, None)

    def _stop_process(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # the engine process sees the end and exits
        self._process.join(STOP_TIMEOUT_S)
        if self._process.is_alive():
            logger.warning("the engine process did not stop in %g s: killing it", STOP_TIMEOUT_S)
            self._process.kill()
            self._process.join(5)
        loop = self._loop
        if self._writer is not None and loop is not None and not loop.is_closed():
            self._writer.close()
        else:  # (no writer, or its event loop is gone: a second Ctrl-C skipped the shutdown)
            self._sock.close()


class _RemoteStream:
    """One generation in the engine process, as the async iterator of snapshots the routes read.

    The engine holds it after validation; the first `__anext__` starts it, `aclose` before the
    last snapshot aborts it."""

    def __init__(self, backend: EngineProcessBackend, rid: int) -> None:
        self._backend = backend
        self.rid = rid
        loop = asyncio.get_running_loop()
        self.accepted: asyncio.Future[None] = loop.create_future()
        self._queue: asyncio.Queue[Update | APIError] = asyncio.Queue()
        self._builder = SnapshotBuilder()
        self._state = "held"  # held -> running -> done (or closed, by the consumer)

    def __aiter__(self) -> _RemoteStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._state in ("done", "closed"):
            raise StopAsyncIteration
        if self._state == "held":
            self._state = "running"
            self._backend._send(Start(self.rid))
        item = await self._queue.get()
        if isinstance(item, APIError):
            self._end("done")
            raise item
        snapshot = self._builder.apply(item)
        if item.finished:
            self._end("done")
        return snapshot

    async def aclose(self) -> None:
        if self._state in ("held", "running"):
            self._backend._send(Abort(self.rid))
            self._end("closed")

    def put(self, update: Update) -> None:
        self._queue.put_nowait(update)

    def fail(self, error: APIError) -> None:
        if not self.accepted.done():
            self.accepted.set_exception(error)
        self._queue.put_nowait(error)

    def _end(self, state: str) -> None:
        self._state = state
        self._backend._streams.pop(self.rid, None)

    def __del__(self) -> None:  # a stream dropped unread or half read: free its engine request
        if self._state in ("held", "running"):
            with contextlib.suppress(Exception):
                self._backend._send_threadsafe(Abort(self.rid))


# ---- the engine process --------------------------------------------------------------------


def run_engine_process(sock: socket.socket, engine_kwargs: dict[str, Any], log_level: str) -> None:
    """The engine process's main: load the engine, say Ready, serve the channel until it closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server process decides when we stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    codec = Codec(ToEngine)
    try:
        from radixlm.runtime.engine import Engine

        engine = Engine(**engine_kwargs)
    except Exception as e:
        kind = error_kind(e)
        if kind != INVALID:
            logger.exception("the engine failed to start")
        with contextlib.suppress(OSError):
            sock.sendall(codec.frame([codec.encode(StartupFailed(kind, str(e)))]))
        return
    try:
        backend = LocalEngineBackend(engine)
        ready = Ready(
            model_info=dataclasses.asdict(backend.model_info()),
            engine_config=backend.engine_config(),
            tokenizer_path=str(engine.config.tokenizer_path or engine.model_folder),
        )
        sock.sendall(codec.frame([codec.encode(ready)]))
        asyncio.run(_EngineServer(backend, codec).serve(sock))
    except OSError as e:  # the server went away during the handshake
        logger.warning("engine process: the channel failed: %s", e)
    finally:
        engine.shutdown()


class _EngineServer:
    """The engine process's loop: requests from the channel to the engine, its updates back."""

    def __init__(self, backend: LocalEngineBackend, codec: Codec) -> None:
        self._backend = backend
        self._codec = codec
        self._preparing: dict[int, asyncio.Task[None]] = {}
        self._held: dict[int, Any] = {}  # rid -> a validated stream not yet started
        self._running: dict[int, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._out: Outbox | None = None

    async def serve(self, sock: socket.socket, poll: float = 0.5) -> None:
        sock.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=sock)
        self._out = Outbox(self._codec, writer)
        watch = asyncio.ensure_future(self._watch(writer, poll))
        try:
            while (body := await read_frame(reader)) is not None:
                for message in self._codec.decode(body):
                    self._handle(message)
        except ConnectionError as e:
            logger.warning("engine process: %s", e)
        finally:
            watch.cancel()
            # the server is gone or shutting down: abort everything (freeing its KV) and stop
            work = [*self._preparing.values(), *self._running.values(), *self._tasks]
            for task in work:
                task.cancel()
            await asyncio.gather(*work, return_exceptions=True)
            for stream in self._held.values():
                await stream.aclose()
            writer.close()

    async def _watch(self, writer: asyncio.StreamWriter, poll: float) -> None:
        """Close the channel once the engine has stopped on its own (an internal error, which
        failed its requests): the server then answers 503 and reports itself unhealthy, as for an
        engine process that died, instead of sending requests to an engine that refuses them."""
        while self._backend.is_alive():
            await asyncio.sleep(poll)
        logger.error("engine process: the engine stopped; closing the channel")
        if self._running:  # let the failed requests' last updates go out first
            await asyncio.wait(list(self._running.values()), timeout=5)
        writer.close()

    def _handle(self, message: Any) -> None:
        if isinstance(message, Generate):
            self._preparing[message.rid] = asyncio.ensure_future(self._prepare(message))
        elif isinstance(message, Start):
            stream = self._held.pop(message.rid, None)
            if stream is not None:
                self._running[message.rid] = asyncio.ensure_future(self._pump(message.rid, stream))
        elif isinstance(message, Abort):
            self._abort(message.rid)
        elif isinstance(message, Call):
            task = asyncio.ensure_future(self._call(message))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            logger.warning("engine process: unexpected message %r", message)

    def _send(self, message: Any) -> None:
        assert self._out is not None
        self._out.send(message)

    async def _prepare(self, message: Generate) -> None:
        """Validate and tokenize-check the request, compile its grammar (worker threads)."""
        rid = message.rid
        try:
            stream = await self._backend.stream(
                message.input_ids,
                message.sampling_params,
                return_logprob=message.return_logprob,
                logprob_start_len=message.logprob_start_len,
                top_logprobs_num=message.top_logprobs_num,
                priority=message.priority,
            )
        except EngineShutDown as e:
            self._send(Rejected(rid, UNAVAILABLE, str(e)))
        except Exception as e:
            kind, text = _failure(e, REQUEST_INVALID)
            if not is_callers_fault(kind):
                logger.exception("engine process: request %d failed validation", rid)
            self._send(Rejected(rid, kind, text))
        else:
            self._held[rid] = stream
            self._send(Accepted(rid))
        finally:
            self._preparing.pop(rid, None)

    async def _pump(self, rid: int, stream: Any) -> None:
        encoder = DeltaEncoder(rid)
        finished = False
        try:
            async for snapshot in stream:
                finished = snapshot["meta_info"].get("finish_reason") is not None
                self._send(encoder.update(snapshot, finished))
            if not finished:
                self._send(Failed(rid, "the engine ended the generation without a result"))
        except Exception as e:
            logger.exception("engine process: request %d failed", rid)
            self._send(Failed(rid, f"{type(e).__name__}: {e}"))
        finally:
            self._running.pop(rid, None)

    def _abort(self, rid: int) -> None:
        task = self._preparing.pop(rid, None) or self._running.pop(rid, None)
        if task is not None:
            task.cancel()  # a running stream's generator aborts its engine request as it unwinds
            return
        stream = self._held.pop(rid, None)
        if stream is not None:
            closing = asyncio.ensure_future(stream.aclose())
            self._tasks.add(closing)
            closing.add_done_callback(self._tasks.discard)

    async def _call(self, message: Call) -> None:
        try:
            if message.method not in ENGINE_CALLS:
                raise ValueError(f"unknown engine call {message.method!r}")
            method = getattr(self._backend, message.method)
            args = () if message.arg is None else (message.arg,)
            value = await method(*args)
            if isinstance(value, EngineStats):  # (across the boundary as its mapping form)
                value = value.as_dict()
            self._send(CallResult(message.cid, value))
        except Exception as e:
            kind, text = _failure(e)
            if not is_callers_fault(kind):
                logger.exception("engine process: %s failed", message.method)
            self._send(CallResult(message.cid, error=text, error_kind=kind))


def _failure(exc: Exception, invalid: tuple[type[BaseException], ...] = (ValueError,)):
    """(error_kind, message) of a failure in the engine process: bad input (`invalid`) in its own
    words, anything else with the exception's type."""
    kind = error_kind(exc, invalid)
    return kind, str(exc) if is_callers_fault(kind) else f"{type(exc).__name__}: {exc}"
