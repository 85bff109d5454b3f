"""OpenAI's Responses API, its stateless part: POST /v1/responses.

`input` (a string, or message items, function calls and their outputs), `instructions` (a system
message first), `tools` (functions), `tool_choice`, `max_output_tokens`, `temperature`, `top_p`,
`text.format` and `stream`. The request becomes a chat request and runs as /v1/chat/completions
runs one (the same prompt, tool grammars and output parsing); its output becomes Responses items:
a `reasoning` item (with a reasoning parser), a `message` with one `output_text` part, and a
`function_call` item per call. Streamed, the events are the Responses API's (`response.created`,
`response.output_item.added`, `response.reasoning_text.delta`, `response.output_text.delta`,
`response.function_call_arguments.delta`, ..., `response.completed`), each item's as it is
generated: the chat stream's deltas (`chat_deltas`) in the Responses items, an item added when
its first piece comes and done when the next begins. Nothing is stored: `previous_response_id` is
refused.
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
    start,
    stream_failure,
)
from radixlm.server.http_util import json_response, read_json
from radixlm.server.inflight import check_timeout
from radixlm.server.openai_api import chat_choice, chat_deltas, check_model, prepare_chat
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
    item, output, stream_calls = await prepare_chat(state, chat)
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
    if req.stream:
        events = _events(state, chat, output, streams, base, stream_calls)
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
    stream_calls: bool,
) -> AsyncIterator[bytes]:
    event = _Events()
    pending = {**base, "status": "in_progress", "output": [], "usage": None}
    yield event("response.created", response=pending)
    yield event("response.in_progress", response=pending)
    try:
        items, final = _StreamedItems(event), None
        async for d in chat_deltas(state, chat, output, streams, stream_calls):
            for chunk in items.add(d.delta):
                yield chunk
            if d.finish_reason is not None:
                final = d.snap
        if final is None:
            raise internal_error("the engine ended a generation without a result")
        for chunk in items.finish():
            yield chunk
        yield event("response.completed", response=_response(base, items.items, final))
    except Exception as e:  # begun: reported in-band (stream_failure counts it)
        body = msgspec.json.decode(stream_failure(state, e).removeprefix(b"data: "))
        err = body.get("error", body)
        yield event("error", code=err.get("code"), message=err.get("message"), param=None)


class _StreamedItems:
    """The Responses items of a chat's deltas as they arrive, as `_items` makes them of the
    finished output: the thinking a `reasoning` item, the content one `message`, each call a
    `function_call`, each added when its first piece comes. The reasoning is done when the
    answer begins, a call when the next one begins, the message when the output ends (content
    may follow a call, and a call's last piece come after content that follows it in the same
    step). An output with neither content nor calls still has its (empty) message."""

    def __init__(self, event: _Events) -> None:
        self.event = event
        self.items: list[dict[str, Any]] = []  # by output index; open ones "in_progress"
        self._texts: list[str] = []  # each item's text or arguments so far
        self._reasoning: int | None = None  # the reasoning item while it is open
        self._message: int | None = None
        self._calls: dict[int, int] = {}  # a call's index in the deltas -> its item's

    def add(self, delta: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        if delta.get("reasoning_content"):
            if self._reasoning is None:
                item = {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": []}
                self._reasoning = self._begin(item, out)
            self._write(self._reasoning, delta["reasoning_content"], out)
        if delta.get("content"):
            self._close_reasoning(out)
            if self._message is None:
                self._message = self._begin(_message_item("", f"msg_{uuid.uuid4().hex}"), out)
            self._write(self._message, delta["content"], out)
        for call in delta.get("tool_calls") or []:
            self._close_reasoning(out)
            if "id" in call:
                for index in self._calls.values():  # (a call's arguments end where the next begins)
                    if self.items[index]["status"] == "in_progress":
                        self._close(index, out)
                item = {
                    "id": f"fc_{uuid.uuid4().hex}",
                    "type": "function_call",
                    "call_id": call["id"],
                    "name": call["function"]["name"],
                    "arguments": "",
                }
                self._calls[call["index"]] = self._begin(item, out)
            if call["function"].get("arguments"):
                self._write(self._calls[call["index"]], call["function"]["arguments"], out)
        return out

    def finish(self) -> list[bytes]:
        out: list[bytes] = []
        self._close_reasoning(out)
        if self._message is None and not self._calls:
            self._message = self._begin(_message_item("", f"msg_{uuid.uuid4().hex}"), out)
        for index, item in enumerate(self.items):
            if item["status"] == "in_progress":
                self._close(index, out)
        return out

    def _begin(self, item: dict[str, Any], out: list[bytes]) -> int:
        index = len(self.items)
        opened = {**item, "status": "in_progress"}
        if item["type"] != "function_call":
            opened["content"] = []
        self.items.append(opened)
        self._texts.append("")
        out.append(self.event("response.output_item.added", output_index=index, item=opened))
        if item["type"] != "function_call":
            part = self._part(index, "")
            out.append(self.event("response.content_part.added", **self._at(index), part=part))
        return index

    def _write(self, index: int, piece: str, out: list[bytes]) -> None:
        self._texts[index] += piece
        kind = {
            "reasoning": "response.reasoning_text.delta",
            "message": "response.output_text.delta",
            "function_call": "response.function_call_arguments.delta",
        }[self.items[index]["type"]]
        out.append(self.event(kind, **self._at(index), delta=piece))

    def _close_reasoning(self, out: list[bytes]) -> None:
        if self._reasoning is not None:
            self._close(self._reasoning, out)
            self._reasoning = None

    def _close(self, index: int, out: list[bytes]) -> None:
        item, at, text = self.items[index], self._at(index), self._texts[index]
        if item["type"] == "function_call":
            item = {**item, "arguments": text, "status": "completed"}
            out.append(self.event("response.function_call_arguments.done", **at, arguments=text))
        else:
            part = self._part(index, text)
            item = {**item, "content": [part], "status": "completed"}
            kind = "reasoning" if item["type"] == "reasoning" else "output"
            out.append(self.event(f"response.{kind}_text.done", **at, text=text))
            out.append(self.event("response.content_part.done", **at, part=part))
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        self.items[index] = item

    def _part(self, index: int, text: str) -> dict[str, Any]:
        if self.items[index]["type"] == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": []}

    def _at(self, index: int) -> dict[str, Any]:
        at = {"item_id": self.items[index]["id"], "output_index": index}
        return at if self.items[index]["type"] == "function_call" else {**at, "content_index": 0}
