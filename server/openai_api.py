"""The OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from radixlm.protocol.reasoning import ReasoningParser, ReasoningStream
from radixlm.protocol.sampling_params import CONSTRAINTS, structural_tag_parts
from radixlm.server.chat import render_chat_prompt
from radixlm.server.errors import bad_request, internal_error, not_found
from radixlm.server.generation import (
    GenerationInput,
    arrival,
    cancel_on_disconnect,
    check_batch,
    check_max_new_tokens,
    check_n,
    check_prompt,
    check_request_priority,
    check_text_fits,
    collect,
    fan_out,
    finish_error,
    item_ids,
    merge,
    start,
    stop_string_kept,
    stream_failure,
)
from radixlm.server.http_util import SSE_DONE, json_response, read_json, sse_event
from radixlm.server.inflight import check_timeout
from radixlm.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponseFormat,
)
from radixlm.server.sglang_fields import CHAT, COMPLETIONS, check_unsupported
from radixlm.server.state import ServerState
from radixlm.server.thinking import hold_after_thinking
from radixlm.server.tool_parsers import HermesParser, ToolCallParser, ToolCallStream
from radixlm.server.tools import (
    ContentFilter,
    ToolCallStreamer,
    ToolPlan,
    auto_output_regex,
    openai_call,
    parse_output,
    plan_tools,
)

router = APIRouter()

MAX_TOP_LOGPROBS = 20
# any JSON object: what response_format {"type": "json_object"} asks for
JSON_OBJECT_SCHEMA = {"type": "object"}


def _state(request: Request) -> ServerState:
    return request.app.state.server


def check_model(state: ServerState, model: str | None) -> None:
    if not state.accepts_model(model):
        raise not_found(
            f"the model {model!r} does not exist; this server serves {state.served_model_name!r}",
            "model",
            code="model_not_found",
        )


# ---- models --------------------------------------------------------------------------------


def _model_card(state: ServerState) -> dict[str, Any]:
    """OpenAI's model object (id, object, created, owned_by) with SGLang's additions: `root` (the
    base model's id: the served model itself), `parent` (a LoRA adapter's base: none here) and
    `max_model_len` (the context length, prompt and output)."""
    return {
        "id": state.served_model_name,
        "object": "model",
        "created": int(state.started_at),
        "owned_by": "radixlm",
        "root": state.served_model_name,
        "parent": None,
        "max_model_len": state.backend.model_info().context_len,
    }


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    return json_response({"object": "list", "data": [_model_card(_state(request))]})


@router.get("/v1/models/{model_id:path}")
async def get_model(request: Request, model_id: str) -> Response:
    state = _state(request)
    check_model(state, model_id)
    return json_response(_model_card(state))


# ---- shared request handling ---------------------------------------------------------------


def _sampling_params(
    state: ServerState,
    req: Any,
    max_tokens: int | None,
    max_tokens_param: str,
    prompt_len: int,
) -> dict[str, Any]:
    """The engine's sampling params from the fields both endpoints share."""
    if not req.stream and any(_stream_usage(req)):
        raise bad_request("stream_options applies to streams: set stream to true", "stream_options")
    info = state.backend.model_info()
    if max_tokens is None:  # as much as the context (and the KV pool) leaves
        room = info.context_len
        if info.kv_capacity_tokens is not None:
            room = min(room, info.kv_capacity_tokens)
        max_tokens = max(0, room - prompt_len)
        if state.limits.max_new_tokens is not None:
            max_tokens = min(max_tokens, state.limits.max_new_tokens)
    else:
        check_max_new_tokens(state, max_tokens, max_tokens_param)
        if prompt_len + max_tokens > info.context_len:
            raise bad_request(
                f"{max_tokens_param}={max_tokens} and the prompt's {prompt_len} tokens exceed the "
                f"model's context of {info.context_len} tokens: ask for at most "
                f"{max(0, info.context_len - prompt_len)}, or leave it unset",
                max_tokens_param,
                code="context_length_exceeded",
            )
    if req.min_tokens is not None and req.min_tokens > max_tokens:
        raise bad_request(
            f"min_tokens={req.min_tokens} exceeds the {max_tokens} new tokens this request can "
            f"have ({max_tokens_param}, or what the context leaves)",
            "min_tokens",
        )
    params: dict[str, Any] = {"max_new_tokens": max_tokens}
    for name, engine_name in (
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("seed", "seed"),
        ("frequency_penalty", "frequency_penalty"),
        ("presence_penalty", "presence_penalty"),
        ("top_k", "top_k"),
        ("min_p", "min_p"),
        ("repetition_penalty", "repetition_penalty"),
        ("min_tokens", "min_new_tokens"),
        ("stop_token_ids", "stop_token_ids"),
        ("ignore_eos", "ignore_eos"),
        ("skip_special_tokens", "skip_special_tokens"),
        ("regex", "regex"),
        ("ebnf", "ebnf"),
    ):
        value = getattr(req, name)
        if value is not None:
            params[engine_name] = value
    if req.temperature is not None and not 0.0 <= req.temperature <= 2.0:
        raise bad_request(f"temperature={req.temperature} must be in [0, 2]", "temperature")
    if req.stop is not None:
        params["stop"] = [req.stop] if isinstance(req.stop, str) else req.stop
    if req.logit_bias:
        params["logit_bias"] = req.logit_bias
    return params


def _apply_response_format(params: dict[str, Any], fmt: ResponseFormat | None) -> None:
    if fmt is not None and fmt.json_schema is not None and fmt.type != "json_schema":
        raise bad_request(
            f"response_format.json_schema comes with type 'json_schema', not {fmt.type!r}",
            "response_format",
        )
    if fmt is not None and fmt.type != "structural_tag" and (fmt.structures or fmt.triggers):
        raise bad_request(
            "response_format.structures and .triggers come with type 'structural_tag'",
            "response_format",
        )
    if fmt is None or fmt.type == "text":
        return
    if fmt.type == "json_object":
        schema: Any = JSON_OBJECT_SCHEMA
    elif fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema is None:
            raise bad_request(
                "response_format of type 'json_schema' needs json_schema.schema",
                "response_format",
            )
        schema = fmt.json_schema.schema
    elif fmt.type == "structural_tag":
        tag = json.dumps({"structures": fmt.structures, "triggers": fmt.triggers})
        try:
            structural_tag_parts(tag)
        except ValueError as e:
            raise bad_request(f"response_format: {e}", "response_format") from None
        _set_constraint(params, "structural_tag", tag, "response_format")
        return
    else:
        raise bad_request(
            f"response_format.type={fmt.type!r}; use 'text', 'json_object', 'json_schema' or "
            "'structural_tag'",
            "response_format",
        )
    _set_constraint(params, "json_schema", json.dumps(schema), "response_format")


def _constraints(params: dict[str, Any]) -> list[str]:
    """The output constraints `params` already carry (the engine takes at most one)."""
    return [k for k in CONSTRAINTS if k in params]


def _set_constraint(params: dict[str, Any], kind: str, value: str, param: str) -> None:
    others = _constraints(params)
    if others:
        raise bad_request(f"{param} cannot be combined with {others[0]}", param)
    params[kind] = value


def _finish_reason(meta: dict[str, Any]) -> str | None:
    reason = meta.get("finish_reason")
    if reason is None:
        return None
    kind = reason.get("type") if isinstance(reason, dict) else str(reason)
    return "length" if kind == "length" else "stop" if kind == "stop" else str(kind)


def _raise_if_failed(finals: list[dict[str, Any]]) -> None:
    for final in finals:
        error = finish_error(final["meta_info"])
        if error is not None:
            raise internal_error(f"generation failed: {error}")


def _usage(finals: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """Prompt tokens count once per prompt (its first sample), completion tokens per sample."""
    prompt = sum(f["meta_info"]["prompt_tokens"] for f in finals[::n])
    cached = sum(f["meta_info"]["cached_tokens"] for f in finals[::n])
    completion = sum(f["meta_info"]["completion_tokens"] for f in finals)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _live_usage(meta: dict[str, Any]) -> dict[str, Any]:
    """One choice's usage so far: what `stream_options.continuous_usage_stats` puts in a chunk."""
    prompt, completion = meta["prompt_tokens"], meta["completion_tokens"]
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _stream_usage(req: Any) -> tuple[bool, bool]:
    """(a usage chunk at the end, the usage so far in every chunk)."""
    options = req.stream_options
    if options is None or not options.include_usage:
        return False, False
    return True, bool(options.continuous_usage_stats)


def _keep_stop_strings(
    streams: list[AsyncIterator[dict[str, Any]]],
) -> list[AsyncIterator[dict[str, Any]]]:
    """`no_stop_trim`: the stop string that ended a generation stays at the end of its text."""

    async def keep(stream: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        async with contextlib.aclosing(stream):  # closing this aborts the generation
            async for snap in stream:
                yield {**snap, "text": stop_string_kept(snap["text"], snap["meta_info"])}

    return [keep(s) for s in streams]


def _sse_response(events: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(
        events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


async def _guarded(state: ServerState, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """An SSE body that reports a failure in-band and always ends with [DONE]."""
    try:
        async for event in events:
            yield event
    except Exception as e:
        yield stream_failure(state, e)
    yield SSE_DONE


# ---- /v1/completions -----------------------------------------------------------------------


@dataclass
class _Prompt:
    ids: list[int]
    text: str


def _completion_prompts(state: ServerState, prompt: Any) -> list[_Prompt]:
    backend = state.backend

    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in x
        )

    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        items = prompt
    elif isinstance(prompt, list) and prompt and is_ids(prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(is_ids(p) for p in prompt):
        items = prompt
    else:
        raise bad_request(
            "prompt must be a string, a list of strings, a list of token ids, or a list of "
            "lists of token ids (non-empty)",
            "prompt",
        )
    check_batch(state, len(items), "prompt")
    out = []
    vocab = backend.model_info().vocab_size
    for item in items:
        if isinstance(item, str):
            if not item:
                raise bad_request("the prompt is empty; give at least one character", "prompt")
            check_text_fits(state, item, "prompt")
            out.append(_Prompt(backend.tokenize(item), item))
        else:
            bad = [t for t in item if not 0 <= t < vocab]
            if bad:
                raise bad_request(
                    f"prompt token ids {bad[:5]} lie outside the vocabulary [0, {vocab})", "prompt"
                )
            out.append(_Prompt(list(item), backend.decode(item) if item else ""))
    for p in out:
        check_prompt(state, p.ids)
    return out


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    state = _state(request)
    req = await read_json(request, CompletionRequest)
    check_model(state, req.model)
    check_unsupported(COMPLETIONS, req, "/v1/completions")
    if req.prompt is None:
        raise bad_request("prompt is required", "prompt")
    if req.suffix:
        raise bad_request("suffix is not supported by this server", "suffix")
    n = check_n(state, req.n)
    if req.best_of is not None and req.best_of not in (1, n):
        raise bad_request("best_of other than n is not supported by this server", "best_of")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"logprobs={req.logprobs} must be in [0, {MAX_TOP_LOGPROBS}]", "logprobs")
    # tokenizing (long prompts take a while) off the event loop, which serves every stream
    prompts = await asyncio.to_thread(_completion_prompts, state, req.prompt)
    check_batch(state, len(prompts) * n, "n")
    items = []
    for p in prompts:
        params = _sampling_params(state, req, req.max_tokens, "max_tokens", len(p.ids))
        if req.json_schema is not None:
            schema = req.json_schema
            _set_constraint(
                params,
                "json_schema",
                schema if isinstance(schema, str) else json.dumps(schema),
                "json_schema",
            )
        _apply_response_format(params, req.response_format)
        want_lp = req.logprobs is not None
        item = GenerationInput(
            input_ids=p.ids,
            params=params,
            return_logprob=want_lp,
            logprob_start_len=0 if (want_lp and req.echo) else None,
            top_logprobs_num=req.logprobs or 0,
            priority=check_request_priority(req.priority),
        )
        items.extend(fan_out(item, n))
    usage_log = getattr(request.state, "usage", None)
    # one grammar (json_schema, regex, response_format) for every prompt of the list: refused, it
    # would abort every choice, so it stays the request's 400 (the native /generate batch, with a
    # grammar per prompt, aborts only the refused items)
    rid = f"cmpl-{uuid.uuid4().hex}"
    ids = item_ids(req.rid, [n] * len(prompts), len(items))  # (SGLang's: for /abort_request)
    streams = await start(
        state,
        items,
        usage_log,
        arrival(request),
        ids=ids or [rid] * len(items),
        timeout=check_timeout(req.request_timeout),
        streaming=bool(req.stream),
        unique_ids=ids is not None,
    )
    if req.no_stop_trim:
        streams = _keep_stop_strings(streams)
    created = int(time.time())
    if req.stream:
        events = _completion_events(state, req, prompts, n, streams, rid, created)
        return _sse_response(_guarded(state, events))
    finals = await cancel_on_disconnect(request, collect(streams))
    _raise_if_failed(finals)
    choices = []
    for i, final in enumerate(finals):
        prompt = prompts[i // n]
        text = (prompt.text if req.echo else "") + final["text"]
        choice = {
            "index": i,
            "text": text,
            "logprobs": _completion_logprobs(state, final["meta_info"], req.echo, 0)[0]
            if req.logprobs is not None
            else None,
            "finish_reason": _finish_reason(final["meta_info"]),
        }
        choices.append(choice)
    return json_response(
        {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": state.served_model_name,
            "choices": choices,
            "usage": _usage(finals, n),
        }
    )


def _completion_logprobs(
    state: ServerState, meta: dict[str, Any], echo: bool, skip: int, offset: int = 0
) -> tuple[dict[str, Any], int]:
    """OpenAI's legacy logprobs object for the tokens after the first `skip` (the prompt's tokens
    first, with echo), and the text offset after them."""
    entries = list(meta.get("output_token_logprobs") or [])
    tops = list(meta.get("output_top_logprobs") or [None] * len(entries))
    if echo:
        prompt_entries = list(meta.get("input_token_logprobs") or [])
        prompt_tops = meta.get("input_top_logprobs") or [None] * len(prompt_entries)
        entries = prompt_entries + entries
        tops = list(prompt_tops) + tops
    entries, tops = entries[skip:], tops[skip:]
    texts = state.backend.token_texts([e[1] for e in entries])
    offsets = []
    for t in texts:
        offsets.append(offset)
        offset += len(t)
    logprobs = {
        "tokens": texts,
        "token_logprobs": [e[0] for e in entries],
        "top_logprobs": [_top_dict(state, top) for top in tops],
        "text_offset": offsets,
    }
    return logprobs, offset


def _top_dict(state: ServerState, top: list[Any] | None) -> dict[str, float] | None:
    if top is None:
        return None
    texts = state.backend.token_texts([e[1] for e in top])
    return {t: e[0] for t, e in zip(texts, top)}


async def _completion_events(
    state: ServerState,
    req: CompletionRequest,
    prompts: list[_Prompt],
    n: int,
    streams: list[AsyncIterator[dict[str, Any]]],
    rid: str,
    created: int,
) -> AsyncIterator[bytes]:
    include_usage, continuous = _stream_usage(req)
    sent_text: dict[int, int] = {}
    sent_lp: dict[int, int] = {}
    offsets: dict[int, int] = {}
    finals: dict[int, dict[str, Any]] = {}

    def chunk(choices: list[dict[str, Any]], usage: Any = None) -> bytes:
        body: dict[str, Any] = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": state.served_model_name,
            "choices": choices,
        }
        if include_usage:
            body["usage"] = usage
        return sse_event(body)

    async for index, snap in merge(streams):
        meta = snap["meta_info"]
        first = index not in sent_text
        text = snap["text"]
        start_at = sent_text.get(index, 0)
        delta = text[start_at:] if text.startswith(text[:start_at]) else ""
        if first and req.echo:
            delta = prompts[index // n].text + delta
        sent_text[index] = max(start_at, len(text))
        logprobs = None
        if req.logprobs is not None:
            # the prompt's logprobs (with echo) are all in the first snapshot
            logprobs, offsets[index] = _completion_logprobs(
                state, meta, req.echo, sent_lp.get(index, 0), offsets.get(index, 0)
            )
            sent_lp[index] = sent_lp.get(index, 0) + len(logprobs["tokens"])
        reason = _finish_reason(meta)
        if reason is not None:
            error = finish_error(meta)
            if error is not None:
                raise internal_error(f"generation failed: {error}")
            finals[index] = snap
        if delta or reason is not None or (logprobs and logprobs["tokens"]):
            yield chunk(
                [{"index": index, "text": delta, "logprobs": logprobs, "finish_reason": reason}],
                _live_usage(meta) if continuous else None,
            )
    if include_usage:
        ordered = [finals[i] for i in sorted(finals)]
        yield chunk([], _usage(ordered, n))


# ---- /v1/chat/completions ------------------------------------------------------------------


async def prepare_chat(
    state: ServerState, req: ChatCompletionRequest
) -> tuple[GenerationInput, _ChatOutput, bool]:
    """A chat request's generation (its prompt, sampling params and the grammar of its tools),
    how its output is read, and whether its tool calls can stream as they are generated."""
    if req.modalities not in (None, ["text"]):
        raise bad_request("this model produces text only", "modalities")
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(
                f"top_logprobs={req.top_logprobs} must be in [0, {MAX_TOP_LOGPROBS}]",
                "top_logprobs",
            )
    plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    # the server's tool-call format (None: the default one, below)
    parser = state.tool_parser if plan.active else None
    # rendering and tokenizing (long chats take a while) off the event loop
    ids = await asyncio.to_thread(_chat_prompt_ids, state, req, plan, parser)
    max_tokens, max_param = req.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:
        max_tokens, max_param = req.max_tokens, "max_tokens"
    params = _sampling_params(state, req, max_tokens, max_param, len(ids))
    # A demanded call (tool_choice "required" or a named tool) is the whole output: the
    # response_format, which shapes a text answer, has nothing to shape in this turn, and the
    # tools' grammar applies. OpenAI takes the two together, as agent frameworks send them (an
    # agent with an output type whose first turn must call a tool); the format is still checked.
    _apply_response_format({} if plan.constrained else params, req.response_format)
    if parser is not None:
        _set_tool_grammar(state, params, plan, parser)
        stream_calls = False
    else:
        schema = plan.output_schema()
        if schema is not None:
            _set_constraint(params, "json_schema", json.dumps(schema), "tool_choice")
        stream_calls = plan.constrained
        # with "auto", calls follow their schemas once opened; streamed, calls then go out as
        # deltas while generated
        if plan.mode == "auto" and _set_auto_tools_grammar(state, params, plan):
            stream_calls = True
    reasoning = state.reasoning_parser if req.separate_reasoning else None
    if (
        reasoning is not None
        and _constraints(params)
        and not hold_after_thinking(
            params, reasoning, state.json_whitespace, user_regex=req.regex is not None
        )
    ):
        # a constraint that holds from the first token leaves no room for thinking: the output
        # is all answer
        reasoning = None
    item = GenerationInput(
        input_ids=ids,
        params=params,
        return_logprob=req.logprobs,
        top_logprobs_num=req.top_logprobs or 0,
        priority=check_request_priority(req.priority),
    )
    return item, _ChatOutput(plan, parser, reasoning), stream_calls


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = _state(request)
    req = await read_json(request, ChatCompletionRequest)
    check_model(state, req.model)
    check_unsupported(CHAT, req, "/v1/chat/completions")
    n = check_n(state, req.n)
    item, output, stream_calls = await prepare_chat(state, req)
    usage_log = getattr(request.state, "usage", None)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    ids = item_ids(req.rid, [n], n)  # (SGLang's: for /abort_request)
    streams = await start(
        state,
        fan_out(item, n),
        usage_log,
        arrival(request),
        ids=ids or [rid] * n,
        timeout=check_timeout(req.request_timeout),
        streaming=bool(req.stream),
        unique_ids=ids is not None,
    )
    if req.no_stop_trim:
        streams = _keep_stop_strings(streams)
    created = int(time.time())
    if req.stream:
        events = _chat_events(state, req, output, n, streams, rid, created, stream_calls)
        return _sse_response(_guarded(state, events))
    finals = await cancel_on_disconnect(request, collect(streams))
    _raise_if_failed(finals)
    choices = [chat_choice(state, req, output, i, f) for i, f in enumerate(finals)]
    return json_response(
        {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": state.served_model_name,
            "choices": choices,
            "usage": _usage(finals, n),
        }
    )


@dataclass(frozen=True)
class _ChatOutput:
    """How a chat output is read: its tools, their call format (None: the default one) and the
    reasoning parser that splits off its thinking (None: no thinking apart)."""

    plan: ToolPlan
    parser: ToolCallParser | None
    reasoning: ReasoningParser | None


def _set_tool_grammar(
    state: ServerState, params: dict[str, Any], plan: ToolPlan, parser: ToolCallParser
) -> None:
    """A demanded call is forced in the parser's own format; under "auto", Hermes-format calls
    follow their schemas once opened, other formats are read from free text."""
    if plan.constrained:
        try:
            regex = parser.forced_regex(
                plan.offered, plan.mode == "named" or not plan.parallel, state.json_whitespace
            )
        except ValueError as e:
            raise bad_request(f"cannot enforce the tools' parameter schemas: {e}", "tools") from e
        _set_constraint(params, "regex", regex, "tool_choice")
    elif isinstance(parser, HermesParser):
        _set_auto_tools_grammar(state, params, plan)


def _set_auto_tools_grammar(state: ServerState, params: dict[str, Any], plan: ToolPlan) -> bool:
    """tool_choice "auto" in the `<tool_call>` format: calls held to their schemas once opened,
    in free text; with a response_format's JSON schema, the answer in that schema or calls alone
    (OpenAI's model may call a tool or answer in the format, as an agent with an output type and
    tools expects). Whether it applies: not where another constraint holds the whole output, nor
    where the format cannot be written as the regex (the answer alone is then held to it, as the
    format is without tools)."""
    constraints = _constraints(params)
    if constraints not in ([], ["json_schema"]):
        return False
    answer = params.get("json_schema")
    try:
        regex = auto_output_regex(plan, state.json_whitespace, answer)
    except ValueError as e:
        if answer is not None:
            return False
        raise bad_request(f"cannot enforce the tools' parameter schemas: {e}", "tools") from e
    params.pop("json_schema", None)
    params["regex"] = regex
    return True


def _chat_prompt_ids(
    state: ServerState,
    req: ChatCompletionRequest,
    plan: ToolPlan,
    parser: ToolCallParser | None,
) -> list[int]:
    prompt = render_chat_prompt(state.backend, req.messages, plan, req.chat_template_kwargs, parser)
    check_text_fits(state, prompt, "messages")
    ids = state.backend.tokenize(prompt)
    check_prompt(state, ids, "messages")
    return ids


def chat_choice(
    state: ServerState, req: ChatCompletionRequest, output: _ChatOutput, index: int, final: dict
) -> dict[str, Any]:
    meta = final["meta_info"]
    text, thinking = final["text"], None
    if output.reasoning is not None:
        thinking, text = output.reasoning.split(text)
    if output.parser is not None:
        found = output.parser.parse(text, output.plan.names())
        calls = [openai_call(c.name, c.arguments) for c in found.calls]
        content = found.normal_text if found.normal_text or not calls else None
    else:
        parsed = parse_output(text, output.plan)
        content, calls = parsed.content, parsed.tool_calls
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if thinking:
        message["reasoning_content"] = thinking
    reason = _finish_reason(meta)
    if calls:
        message["tool_calls"] = calls
        reason = _reason_with_calls(reason)
    logprobs = None
    if req.logprobs:
        logprobs = {"content": _chat_logprobs(state, meta, 0)}
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}


def _reason_with_calls(reason: str | None) -> str | None:
    """The finish reason of a reply with tool calls: "tool_calls", unless max_tokens cut it."""
    return reason if reason == "length" else "tool_calls"


def _chat_logprobs(state: ServerState, meta: dict[str, Any], skip: int) -> list[dict[str, Any]]:
    entries = (meta.get("output_token_logprobs") or [])[skip:]
    tops = (meta.get("output_top_logprobs") or [None] * (skip + len(entries)))[skip:]
    texts = state.backend.token_texts([e[1] for e in entries])
    out = []
    for entry, text, top in zip(entries, texts, tops):
        top_entries = []
        if top:
            top_texts = state.backend.token_texts([t[1] for t in top])
            top_entries = [
                {"token": tt, "logprob": t[0], "bytes": list(tt.encode())}
                for t, tt in zip(top, top_texts)
            ]
        out.append(
            {
                "token": text,
                "logprob": entry[0],
                "bytes": list(text.encode()),
                "top_logprobs": top_entries,
            }
        )
    return out


@dataclass
class _ChoiceProgress:
    filter: ContentFilter
    calls: ToolCallStreamer | None  # tool calls streamed as they are generated
    thinking: ReasoningStream | None  # the thinking, split off as it arrives
    parsed: ToolCallStream | None  # content and calls of a parser's format
    text_sent: int = 0  # characters of the output shown (no tools)
    tokens_sent: int = 0  # output tokens whose logprobs were sent
    started: bool = False


@dataclass(frozen=True)
class ChoiceDelta:
    """What a choice's output added, as OpenAI's chat delta (`role`, `reasoning_content`,
    `content` or `tool_calls`; the last one of a choice empty, with its finish reason), and the
    engine's snapshot it came from."""

    index: int
    delta: dict[str, Any]
    snap: dict[str, Any]
    logprobs: Any = None
    finish_reason: str | None = None


async def chat_deltas(
    state: ServerState,
    req: ChatCompletionRequest,
    output: _ChatOutput,
    streams: list[AsyncIterator[dict[str, Any]]],
    stream_calls: bool,
) -> AsyncIterator[ChoiceDelta]:
    """The deltas of a chat's choices as their outputs arrive: the thinking apart, the content,
    and tool calls as they are generated (in a parser's format, or in the default one where a
    grammar wrote them; else found in the finished output)."""
    plan, parser, reasoning = output.plan, output.parser, output.reasoning
    progress = [
        _ChoiceProgress(
            ContentFilter(plan),
            ToolCallStreamer(plan) if stream_calls else None,
            reasoning.stream() if reasoning is not None else None,
            parser.stream(plan.names()) if parser is not None else None,
        )
        for _ in streams
    ]
    async for index, snap in merge(streams):
        p = progress[index]
        meta = snap["meta_info"]
        if not p.started:
            p.started = True
            yield ChoiceDelta(index, {"role": "assistant", "content": ""}, snap)
        text = snap["text"]
        finished = meta.get("finish_reason") is not None
        if finished:
            error = finish_error(meta)
            if error is not None:
                raise internal_error(f"generation failed: {error}")
        if p.thinking is not None:  # the thinking goes out apart; the rest is read as the answer
            if thinking := p.thinking.feed(text, finished):
                yield ChoiceDelta(index, {"reasoning_content": thinking}, snap)
            text = p.thinking.answer
        call_deltas: list[dict[str, Any]] = []
        if p.parsed is not None:
            content, call_deltas = p.parsed.feed(text, finished)
        elif plan.active:
            content = p.filter.visible(text)
        else:
            content = text[p.text_sent :]
            p.text_sent = max(p.text_sent, len(text))
        logprobs = None
        if req.logprobs:
            entries = _chat_logprobs(state, meta, p.tokens_sent)
            p.tokens_sent += len(entries)
            if entries:
                logprobs = {"content": entries}
        if content or logprobs:
            yield ChoiceDelta(index, {"content": content}, snap, logprobs)
        if p.calls is not None:
            call_deltas = p.calls.feed(text)
        if call_deltas:
            yield ChoiceDelta(index, {"tool_calls": call_deltas}, snap)
        if not finished:
            continue
        if p.parsed is not None:
            reason = _finish_reason(meta)
            reason = _reason_with_calls(reason) if p.parsed.count else reason
            yield ChoiceDelta(index, {}, snap, None, reason)
            continue
        calls_found = p.calls is not None and p.calls.count > 0
        # (no calls streamed: those of an output no grammar wrote, found now; the streamer's own
        # scan, which found none, is not run again)
        if not calls_found and (parsed := parse_output(text, plan, p.calls is None)).tool_calls:
            deltas = [
                {"index": k, **call}  # id, type and the whole function (name, arguments)
                for k, call in enumerate(parsed.tool_calls)
            ]
            yield ChoiceDelta(index, {"tool_calls": deltas}, snap)
            calls_found = True
        reason = _finish_reason(meta)
        if calls_found:
            reason = _reason_with_calls(reason)
        if plan.active and (rest := p.filter.rest(text, calls_found)):
            yield ChoiceDelta(index, {"content": rest}, snap)
        yield ChoiceDelta(index, {}, snap, None, reason)


async def _chat_events(
    state: ServerState,
    req: ChatCompletionRequest,
    output: _ChatOutput,
    n: int,
    streams: list[AsyncIterator[dict[str, Any]]],
    rid: str,
    created: int,
    stream_calls: bool,
) -> AsyncIterator[bytes]:
    include_usage, continuous = _stream_usage(req)

    def chunk(choices: list[dict[str, Any]], usage: Any) -> bytes:
        body: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": state.served_model_name,
            "choices": choices,
        }
        if include_usage:  # the last chunk's, or with continuous_usage_stats the choice's so far
            body["usage"] = usage
        return sse_event(body)

    finals: dict[int, dict[str, Any]] = {}
    async for d in chat_deltas(state, req, output, streams, stream_calls):
        choice = {
            "index": d.index,
            "delta": d.delta,
            "logprobs": d.logprobs,
            "finish_reason": d.finish_reason,
        }
        yield chunk([choice], _live_usage(d.snap["meta_info"]) if continuous else None)
        if d.finish_reason is not None:
            finals[d.index] = d.snap
    if include_usage:
        yield chunk([], _usage([finals[i] for i in sorted(finals)], n))
