"""The messages between the HTTP server process and its engine process, and their framing.

Each side writes frames to a stream socket: a 4-byte big-endian length, then a msgpack array of
messages (msgspec structs, tagged by class name). One frame carries every message queued in one
turn of the sender's event loop, so that the engine's updates of one step cross in one write.

A streamed generation crosses as deltas (`Update`): the text as (characters kept, text after them),
the output ids and log-probability lists as their new items only. `SnapshotBuilder` (server side)
turns them back into the cumulative snapshots the routes expect, `DeltaEncoder` (engine side) makes
them, so a long generation costs O(new tokens) per step on the wire, not O(all tokens).
"""

from __future__ import annotations

import asyncio
import os
import struct
from collections.abc import Callable
from typing import Any

import msgspec

from radixlm.errors import EngineShutDown, GrammarRefused

# ---- server -> engine ----------------------------------------------------------------------


class Generate(msgspec.Struct, tag=True, array_like=True):
    """Validate one generation (n = 1) and hold it until `Start`; answered by Accepted/Rejected."""

    rid: int
    input_ids: list[int]
    sampling_params: dict[str, Any]
    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    priority: int | None = None


class Start(msgspec.Struct, tag=True, array_like=True):
    rid: int


class Abort(msgspec.Struct, tag=True, array_like=True):
    """Drop a held generation or abort a running one (its KV slots are freed)."""

    rid: int


class Call(msgspec.Struct, tag=True, array_like=True):
    """A request/response call on the engine: answered by `CallResult` with the same id."""

    cid: int
    method: str  # one of ENGINE_CALLS
    arg: str | None = None


ENGINE_CALLS = ("flush_cache", "freeze_gc", "stats", "start_profile", "stop_profile")


# ---- engine -> server ----------------------------------------------------------------------


class Ready(msgspec.Struct, tag=True, array_like=True):
    """The engine has loaded: what the server needs to know about it."""

    model_info: dict[str, Any]  # the fields of backend.ModelInfo
    engine_config: dict[str, Any]
    tokenizer_path: str  # a folder the server loads the same tokenizer from


class StartupFailed(msgspec.Struct, tag=True, array_like=True):
    kind: str  # an error_kind: "invalid" (bad options) or "error"
    message: str


class Accepted(msgspec.Struct, tag=True, array_like=True):
    rid: int


class Rejected(msgspec.Struct, tag=True, array_like=True):
    rid: int
    # an error_kind: "invalid" (the client's fault), "grammar" (its grammar refused, the client's
    # fault too), "unavailable" (shut down), "error"
    kind: str
    message: str


class Update(msgspec.Struct, tag=True, array_like=True):
    """The new part of a generation's snapshot; `finished` on its last one."""

    rid: int
    text_keep: int  # characters of the previous text that stay
    text: str  # what follows them
    new_ids: list[int]
    meta: dict[str, Any]  # meta_info; its list entries carry only the items after `lists_keep`
    lists_keep: dict[str, int]
    finished: bool


class Failed(msgspec.Struct, tag=True, array_like=True):
    """A generation ended by an error outside the engine core (the core reports its own
    failures in a final Update with meta_info.error)."""

    rid: int
    message: str


class CallResult(msgspec.Struct, tag=True, array_like=True):
    cid: int
    value: Any = None
    error: str | None = None
    error_kind: str | None = None  # an error_kind: "invalid" or "error"


ToEngine = Generate | Start | Abort | Call
ToServer = Ready | StartupFailed | Accepted | Rejected | Update | Failed | CallResult


# ---- failures ------------------------------------------------------------------------------

# An engine-side failure crosses the channel as a kind and a message; the server raises it again
# as the in-process engine would have raised it, so both backends fail alike.
INVALID = "invalid"  # the caller's fault: a 400
GRAMMAR = "grammar"  # the caller's grammar refused: a 400, or in a list of prompts its item aborted
UNAVAILABLE = "unavailable"  # the engine is shut down: a 503
ERROR = "error"  # anything else: the engine's fault


# what a request's own checks raise on bad input: TypeError too (sampling params of the wrong type);
# elsewhere (start-up, engine calls) a TypeError is a bug, not the caller's fault
REQUEST_INVALID: tuple[type[BaseException], ...] = (ValueError, TypeError)


def error_kind(exc: BaseException, invalid: tuple[type[BaseException], ...] = (ValueError,)) -> str:
    """GRAMMAR for a refused grammar, INVALID for what the engine raises on other bad input
    (`invalid`), ERROR for anything else."""
    if isinstance(exc, GrammarRefused):
        return GRAMMAR
    return INVALID if isinstance(exc, invalid) else ERROR


def is_callers_fault(kind: str) -> bool:
    """Whether a failure of this kind is bad input (answered in its own words, not logged)."""
    return kind in (INVALID, GRAMMAR)


def exception_for(kind: str, message: str, failed: Callable[[str], Exception]) -> Exception:
    """The server-side exception for a failure that crossed as `kind`: ValueError (INVALID),
    GrammarRefused (GRAMMAR) or EngineShutDown (UNAVAILABLE), as the in-process backend raises
    them, else `failed(message)`."""
    if kind == INVALID:
        return ValueError(message)
    if kind == GRAMMAR:
        return GrammarRefused(message)
    if kind == UNAVAILABLE:
        return EngineShutDown(message)
    return failed(message)


_HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 1 << 30


class Codec:
    """Encodes outgoing messages and frames, decodes incoming frames, for one side."""

    def __init__(self, incoming: Any) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(list[incoming])

    def encode(self, message: Any) -> msgspec.Raw:
        """One message, encoded now (so that a value msgpack cannot carry fails its sender)."""
        return msgspec.Raw(self._encoder.encode(message))

    def frame(self, encoded: list[msgspec.Raw]) -> bytes:
        body = self._encoder.encode(encoded)
        return _HEADER.pack(len(body)) + body

    def decode(self, body: bytes) -> list[Any]:
        return self._decoder.decode(body)


async def read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """The next frame's body, or None at a clean end of stream."""
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as e:
        if e.partial:
            raise ConnectionError("the channel closed inside a frame header") from None
        return None
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise ConnectionError(f"a frame of {size} bytes: the channel is out of step")
    try:
        return await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        raise ConnectionError("the channel closed inside a frame") from None


def read_frame_blocking(sock: Any) -> bytes | None:
    """Like read_frame, on a blocking socket (the handshake, before any event loop runs)."""
    header = _recv_exactly(sock, _HEADER.size)
    if header is None:
        return None
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise ConnectionError(f"a frame of {size} bytes: the channel is out of step")
    body = _recv_exactly(sock, size)
    if body is None:
        raise ConnectionError("the channel closed inside a frame")
    return body


def _recv_exactly(sock: Any, size: int) -> bytes | None:
    chunks = []
    got = 0
    while got < size:
        chunk = sock.recv(size - got)
        if not chunk:
            if got:
                raise ConnectionError("the channel closed inside a frame")
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


class Outbox:
    """Messages queued from the event loop, written as one frame at the end of the loop's turn."""

    def __init__(self, codec: Codec, writer: asyncio.StreamWriter) -> None:
        self._codec = codec
        self._writer = writer
        self._pending: list[msgspec.Raw] = []
        self._scheduled = False

    def send(self, message: Any) -> None:
        self._pending.append(self._codec.encode(message))
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        messages, self._pending = self._pending, []
        if messages and not self._writer.is_closing():
            self._writer.write(self._codec.frame(messages))


# ---- streamed snapshots as deltas ----------------------------------------------------------

# meta_info entries that only ever grow by appending
LIST_KEYS = (
    "input_token_logprobs",
    "output_token_logprobs",
    "input_top_logprobs",
    "output_top_logprobs",
)


class DeltaEncoder:
    """Engine side: one generation's cumulative snapshots -> `Update` deltas."""

    def __init__(self, rid: int) -> None:
        self.rid = rid
        self._text = ""
        self._ids = 0
        self._lists: dict[str, int] = {}

    def update(self, snapshot: dict[str, Any], finished: bool) -> Update:
        text = snapshot["text"]
        if text.startswith(self._text):  # the usual case, checked at C speed
            keep = len(self._text)
        else:
            keep = len(os.path.commonprefix([self._text, text]))
        self._text = text
        ids = snapshot["output_ids"]
        new_ids = ids[self._ids :] if len(ids) >= self._ids else ids  # never shrinks in practice
        self._ids = len(ids)
        meta = dict(snapshot["meta_info"])
        lists_keep = {}
        for key in LIST_KEYS:
            items = meta.get(key)
            if items is None:
                continue
            sent = self._lists.get(key, 0)
            if len(items) < sent:
                sent = 0
            meta[key] = items[sent:]
            lists_keep[key] = sent
            self._lists[key] = len(items)
        return Update(self.rid, keep, text[keep:], new_ids, meta, lists_keep, finished)


class SnapshotBuilder:
    """Server side: `Update` deltas -> cumulative snapshots `{"text", "output_ids", "meta_info"}`."""

    def __init__(self) -> None:
        self._text = ""
        self._ids: list[int] = []
        self._lists: dict[str, list[Any]] = {}

    def apply(self, update: Update) -> dict[str, Any]:
        self._text = self._text[: update.text_keep] + update.text
        if update.new_ids:
            self._ids.extend(update.new_ids)
        meta = update.meta
        for key, keep in update.lists_keep.items():
            items = self._lists.get(key, [])
            del items[keep:]
            items.extend(meta[key])
            self._lists[key] = items
            meta[key] = list(items)
        # every snapshot owns its lists: a consumer may keep one while the next arrives
        return {"text": self._text, "output_ids": list(self._ids), "meta_info": meta}
