"""SGLang's tokenizer routes: text or chat messages to token ids, and back.

POST /tokenize    (and /v1/tokenize)    {"prompt": str | [str]} or {"messages": [...], "tools"}
                  -> {"tokens", "count", "max_model_len"}
POST /detokenize  (and /v1/detokenize)  {"tokens": [int] | [[int]], "skip_special_tokens"}
                  -> {"text"}

A prompt's ids are those /generate and /v1/completions run it as (with `add_special_tokens`, the
default: a BOS the tokenizer adds goes in front once); messages are rendered as
/v1/chat/completions renders them, tools included, so `count` is that request's prompt_tokens.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request, Response

from radixlm.server.chat import render_chat_prompt
from radixlm.server.errors import bad_request
from radixlm.server.http_util import json_response, read_json
from radixlm.server.openai_api import check_model
from radixlm.server.openai_protocol import DetokenizeRequest, TokenizeRequest
from radixlm.server.state import ServerState
from radixlm.server.tools import plan_tools

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.server


@router.post("/tokenize")
@router.post("/v1/tokenize")
async def tokenize(request: Request) -> Response:
    state = _state(request)
    req = await read_json(request, TokenizeRequest)
    check_model(state, req.model)
    # (off the event loop: a long text takes a while)
    return json_response(await asyncio.to_thread(_tokenize, state, req))


def _tokenize(state: ServerState, req: TokenizeRequest) -> dict[str, Any]:
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of prompt and messages", "prompt")
    max_model_len = state.backend.model_info().context_len
    if req.messages is not None:
        ids = _chat_ids(state, req)
        return {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}
    for key in ("tools", "tool_choice", "chat_template_kwargs", "add_generation_prompt"):
        if getattr(req, key) is not None:
            raise bad_request(f"{key} applies to messages, not to a prompt", key)
    if isinstance(req.prompt, str):
        ids = state.backend.tokenize(req.prompt, req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}
    if not req.prompt:
        raise bad_request("prompt is an empty list; give a string or a list of strings", "prompt")
    lists = [state.backend.tokenize(p, req.add_special_tokens) for p in req.prompt]
    return {"tokens": lists, "count": [len(ids) for ids in lists], "max_model_len": max_model_len}


def _chat_ids(state: ServerState, req: TokenizeRequest) -> list[int]:
    if req.add_generation_prompt is False or req.continue_final_message:
        raise bad_request(
            "messages are rendered as a chat completion renders them, ending with the "
            "assistant's turn opened: leave add_generation_prompt and continue_final_message "
            "unset",
            "add_generation_prompt" if req.add_generation_prompt is False else "messages",
        )
    plan = plan_tools(req.tools, req.tool_choice, True)
    parser = state.tool_parser if plan.active else None
    prompt = render_chat_prompt(
        state.backend, req.messages or [], plan, req.chat_template_kwargs, parser
    )
    return state.backend.tokenize(prompt)


@router.post("/detokenize")
@router.post("/v1/detokenize")
async def detokenize(request: Request) -> Response:
    state = _state(request)
    req = await read_json(request, DetokenizeRequest)
    check_model(state, req.model)
    tokens = req.tokens
    vocab = state.backend.model_info().vocab_size
    if _is_ids(tokens):
        _check_vocab(tokens, vocab)
        text: Any = state.backend.decode(tokens, bool(req.skip_special_tokens))
    elif isinstance(tokens, list) and all(_is_ids(t) for t in tokens):
        for ids in tokens:
            _check_vocab(ids, vocab)
        text = [state.backend.decode(ids, bool(req.skip_special_tokens)) for ids in tokens]
    else:
        raise bad_request(
            "tokens must be a list of token ids (integers) or a list of such lists", "tokens"
        )
    return json_response({"text": text})


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def _check_vocab(ids: list[int], vocab: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"token ids {bad[:5]} lie outside the vocabulary [0, {vocab})", "tokens")
