"""Small HTTP helpers shared by the routes: JSON bodies in and out, SSE framing."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
from fastapi import Request, Response
from starlette.requests import ClientDisconnect

from radixlm.server.errors import ClientDisconnected, bad_request

T = TypeVar("T")

_encoder = msgspec.json.Encoder()


def json_response(content: Any, status_code: int = 200) -> Response:
    return Response(
        _encoder.encode(content), status_code=status_code, media_type="application/json"
    )


def sse_event(content: Any) -> bytes:
    return b"data: " + _encoder.encode(content) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


_REQUIRED: Any = object()


async def read_json(
    request: Request, type: type[T] | None = None, *, empty: Any = _REQUIRED
) -> T | Any:
    """The request body decoded as JSON (into `type`, when given); a 400 for anything malformed.
    An empty body is a 400 too, unless `empty` is given: then that is returned for it."""
    try:
        body = await request.body()
    except ClientDisconnect as e:  # gone while sending its body: nobody to answer
        raise ClientDisconnected() from e
    if not body.strip():
        if empty is not _REQUIRED:
            return empty
        raise bad_request("the request body is empty; send a JSON object")
    try:
        if type is None:
            return msgspec.json.decode(body)
        return msgspec.json.decode(body, type=type)
    except msgspec.ValidationError as e:
        raise bad_request(f"invalid request: {e}", _param_of(str(e))) from e
    except msgspec.DecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from e
    except RecursionError as e:
        raise bad_request("the request body is nested too deeply") from e


def _param_of(message: str) -> str | None:
    """The field a msgspec validation message points at: `$.a.b[0]` -> `a.b[0]`."""
    where = message.split("at `$.", 1)[1].split("`", 1)[0] if "at `$." in message else None
    if "unknown field `" in message:
        field = message.split("unknown field `", 1)[1].split("`", 1)[0]
        return f"{where}.{field}" if where else field
    return where
