"""OpenAI's Responses API, its stateless part: POST /v1/responses.

`input` (a string, or message items, function calls and their outputs), `instructions` (a system
message first), `tools` (functions), `tool_choice`, `max_output_tokens`, `temperature`, `top_p`,
`text.format` and `stream`. The request becomes a chat request and runs as /v1/chat/completions
runs one (the same prompt, tool grammars and output parsing); its output becomes Responses items:
a `reasoning` item (with a reasoning parser), a `message` with one `output_text` part, and a
`function_call` item per call. Streamed, the events are the Responses API's (`response.created`,
`response.output_item.added`, `response.output_text.delta`, ..., `response.completed`); a plain
text answer streams as it is generated, an answer with tools or thinking once it is complete.
Nothing is stored: `previous_response_id` is refused.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from radixlm.server.errors import bad_request, internal_error
from radixlm.server.generation import (
    arrival,
    cancel_on_disconnect,
    collect,
    finish_error,
    merge,
    start,
    stream_failure,
)
from radixlm.server.http_util import json_response, read_json
from radixlm.server.inflight import check_timeout
from radixlm.server.openai_api import chat_choice, check_model, prepare_chat
from radixlm.server.openai_protocol import ChatCompletionRequest, ResponsesRequest
from radixlm.server.state import ServerState

router = APIRouter()

_ROLES = {"user", "system", "developer", "assistant"}
_TEXT_PARTS = {"input_text", "output_text", "text"}


@router.post("/v1/responses")
async def responses(request: Request) -> Response:
    state: ServerState = request.app.state.server
    req = await read_json(request, ResponsesRequest)
    check_model(state, req.model)
    if req.previous_response_id is not None:
        raise bad_request(
            "this server stores no responses: send the whole conversation in input",
            "previous_response_id",
        )
    chat = _chat_request(req)
    item, output, _ = await prepare_chat(state, chat)
    response_id = f"resp_{uuid.uuid4().hex}"
    streams = await start(
        state,
        [item],
        getattr(request.state, "usage", None),
        arrival(request),
        ids=[response_id],
        timeout=check_timeout(req.request_timeout),
        streaming=bool(req.stream),
    )
    base = {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "model": state.served_model_name,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tools": [msgspec.to_builtins(t) for t in req.tools or []],
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "parallel_tool_calls": req.parallel_tool_calls,
        "text": req.text or {"format": {"type": "text"}},
        "store": False,
        "metadata": req.metadata or {},
        "error": None,
        "incomplete_details": None,
    }
    plain = not output.plan.active and output.reasoning is None
    if req.stream:
        events = _events(state, chat, output, streams, base, plain)
        return StreamingResponse(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
    (final,) = await cancel_on_disconnect(request, collect(streams))
    _raise_if_failed(final)
    return json_response(_response(base, _items(chat_choice(state, chat, output, 0, final)), final))


# ---- the request as a chat -------------------------------------------------------------------


def _chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    messages.extend(_input_messages(req.input))
    chat: dict[str, Any] = {"messages": messages, "stream": bool(req.stream)}
    for key, value in (
        ("max_tokens", req.max_output_tokens),
        ("temperature", req.temperature),
        ("top_p", req.top_p),
        ("parallel_tool_calls", req.parallel_tool_calls),
    ):
        if value is not None:
            chat[key] = value
    if req.tools:
        chat["tools"] = [_chat_tool(t, i) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        chat["tool_choice"] = _chat_tool_choice(req.tool_choice)
    if req.text is not None:
        chat["response_format"] = _response_format(req.text)
    try:
        return msgspec.convert(chat, ChatCompletionRequest)
    except msgspec.ValidationError as e:
        raise bad_request(f"invalid request: {e}") from e


def _input_messages(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        if not value:
            raise bad_request("input is empty; give some text or a list of items", "input")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_request("input must be a string or a non-empty list of input items", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object (a message or a function call)", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise bad_request(
                    f"{where}.role={role!r}; use user, system, developer or assistant", where
                )
            messages.append({"role": role, "content": _content(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _string(item, "name", where),
                    "arguments": _string(item, "arguments", where),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # calls made together: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                raise bad_request(f"{where}.output must be a string", where)
            messages.append(
                {"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": output}
            )
        else:
            raise bad_request(
                f"{where}.type={kind!r}; use message, function_call or function_call_output",
                where,
            )
    return messages


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_request(f"{where}.content must be a string or a list of text parts", where)
    texts = []
    for part in value:
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(
                f"{where}.content has a {kind!r} part; this model takes text only "
                "(input_text parts)",
                where,
            )
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.content has a text part without its text", where)
        texts.append(part["text"])
    return "\n".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{where}.{key} must be a non-empty string", where)
    return value


def _chat_tool(tool: Any, index: int) -> dict[str, Any]:
    if tool.type != "function":
        raise bad_request(
            f"tools[{index}].type={tool.type!r}; this server runs function tools only", "tools"
        )
    if not tool.name:
        raise bad_request(f"tools[{index}] needs a name", "tools")
    function = {"name": tool.name, "parameters": tool.parameters or {"type": "object"}}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _chat_tool_choice(value: Any) -> Any:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and value.get("name"):
        return {"type": "function", "function": {"name": value["name"]}}
    raise bad_request(
        'tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}',
        "tool_choice",
    )


def _response_format(text: dict[str, Any]) -> dict[str, Any]:
    fmt = text.get("format", {"type": "text"})
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise bad_request('text.format must be an object with a "type"', "text")
    if fmt["type"] == "json_schema":  # flat here, under "json_schema" in chat completions
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return {"type": fmt["type"]}


# ---- the output as Responses items -----------------------------------------------------------


def _items(choice: dict[str, Any]) -> list[dict[str, Any]]:
    message = choice["message"]
    items: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        items.append(
            {
                "id": f"rs_{uuid.uuid4().hex}",
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": message["reasoning_content"]}],
                "status": "completed",
            }
        )
    if message.get("content") or not message.get("tool_calls"):
        items.append(_message_item(message.get("content") or ""))
    for call in message.get("tool_calls") or []:
        items.append(
            {
                "id": f"fc_{uuid.uuid4().hex}",
                "type": "function_call",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
        )
    return items


def _message_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "id": item_id or f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def _response(base: dict[str, Any], items: list[dict[str, Any]], final: dict) -> dict[str, Any]:
    meta = final["meta_info"]
    reason = meta.get("finish_reason")
    cut = isinstance(reason, dict) and reason.get("type") == "length"
    prompt, completion = meta["prompt_tokens"], meta["completion_tokens"]
    return {
        **base,
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "output": items,
        "usage": {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": meta["cached_tokens"]},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion,
        },
    }


def _raise_if_failed(final: dict[str, Any]) -> None:
    error = finish_error(final["meta_info"])
    if error is not None:
        raise internal_error(f"generation failed: {error}")


# ---- streaming -------------------------------------------------------------------------------


class _Events:
    """The stream's events, numbered in order (`sequence_number`)."""

    def __init__(self) -> None:
        self._next = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self._next, **fields}
        self._next += 1
        return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(body) + b"\n\n"


async def _events(
    state: ServerState,
    chat: ChatCompletionRequest,
    output: Any,
    streams: list[AsyncIterator[dict[str, Any]]],
    base: dict[str, Any],
    plain: bool,
) -> AsyncIterator[bytes]:
    event = _Events()
    pending = {**base, "status": "in_progress", "output": [], "usage": None}
    yield event("response.created", response=pending)
    yield event("response.in_progress", response=pending)
    try:
        if plain:  # text only: it streams as it is generated
            item_id = f"msg_{uuid.uuid4().hex}"
            opened = {**_message_item("", item_id), "status": "in_progress", "content": []}
            yield event("response.output_item.added", output_index=0, item=opened)
            part = {"type": "output_text", "text": "", "annotations": []}
            at = {"item_id": item_id, "output_index": 0, "content_index": 0}
            yield event("response.content_part.added", **at, part=part)
            sent, final = 0, None
            async for _, snap in merge(streams):
                text = snap["text"]
                if len(text) > sent:
                    yield event("response.output_text.delta", **at, delta=text[sent:])
                    sent = len(text)
                if snap["meta_info"].get("finish_reason") is not None:
                    final = snap
            if final is None:
                raise internal_error("the engine ended a generation without a result")
            _raise_if_failed(final)
            item = _message_item(final["text"], item_id)
            yield event("response.output_text.done", **at, text=final["text"])
            yield event("response.content_part.done", **at, part=item["content"][0])
            yield event("response.output_item.done", output_index=0, item=item)
            items = [item]
        else:  # tools or thinking: read once the whole output is there
            (final,) = await collect(streams)
            _raise_if_failed(final)
            items = _items(chat_choice(state, chat, output, 0, final))
            for index, item in enumerate(items):
                for chunk in _item_events(event, index, item):
                    yield chunk
        yield event("response.completed", response=_response(base, items, final))
    except Exception as e:  # begun: reported in-band (stream_failure counts it)
        body = msgspec.json.decode(stream_failure(state, e).removeprefix(b"data: "))
        err = body.get("error", body)
        yield event("error", code=err.get("code"), message=err.get("message"), param=None)


def _item_events(event: _Events, index: int, item: dict[str, Any]) -> list[bytes]:
    """The events of a finished item, added to done."""
    out = []
    if item["type"] == "message":
        text = item["content"][0]["text"]
        opened = {**item, "status": "in_progress", "content": []}
        at = {"item_id": item["id"], "output_index": index, "content_index": 0}
        out.append(event("response.output_item.added", output_index=index, item=opened))
        empty = {"type": "output_text", "text": "", "annotations": []}
        out.append(event("response.content_part.added", **at, part=empty))
        if text:
            out.append(event("response.output_text.delta", **at, delta=text))
        out.append(event("response.output_text.done", **at, text=text))
        out.append(event("response.content_part.done", **at, part=item["content"][0]))
    elif item["type"] == "function_call":
        opened = {**item, "status": "in_progress", "arguments": ""}
        at = {"item_id": item["id"], "output_index": index}
        out.append(event("response.output_item.added", output_index=index, item=opened))
        out.append(event("response.function_call_arguments.delta", **at, delta=item["arguments"]))
        out.append(
            event("response.function_call_arguments.done", **at, arguments=item["arguments"])
        )
    else:
        out.append(event("response.output_item.added", output_index=index, item=item))
    out.append(event("response.output_item.done", output_index=index, item=item))
    return out
