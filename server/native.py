"""The native API, compatible with SGLang's server and its frontend client (`RuntimeEndpoint`).

POST /generate          text or input_ids, single or batch; sampling_params; stream (SSE).
                        In a batch (a list of prompts) an item whose grammar is refused ends
                        alone, finish_reason {"type": "abort", "message"}; a single request with
                        one is a 400. Streamed, text and output_ids are cumulative and each
                        log-probability list holds only what is new since the last chunk
POST /concate_and_append_request   SGLang's fork(...).join(mode="concate_and_append")
GET  /model_info        (and /get_model_info)
GET  /server_info       (and /get_server_info); 503 if the engine does not answer in time
GET  /health            liveness (503 once the engine process is gone), no engine work, no API key
GET  /health_generate   generates one token (not counted in the metrics), no API key
POST /flush_cache       (GET too, as SGLang)
POST /freeze_gc         collect garbage, then freeze the objects alive (gc.freeze; GET too)
POST /start_profile     torch.profiler on the engine's core thread; {"output_dir"} optional
POST /stop_profile      writes the Chrome trace, answers {"trace_file"}
POST /abort_request     {"rid"} (or {"abort_all": true}): ends running generations, finish_reason
                        {"type": "abort", "message"}, their KV freed; 404 for an id not running

/flush_cache, /freeze_gc, the profiler and /abort_request are admin routes (--admin-api-key, server/guard.py).
A /generate may carry `rid` (the generations' ids, as SGLang's) and `request_timeout` (seconds).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from typing import Any

from fastapi import APIRouter, Request, Response

from radixlm import __version__
from radixlm.server.backend import engine_stats
from radixlm.server.errors import bad_request, internal_error, not_found, unavailable
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
    last,
    merge,
    open_streams,
    start,
    stop_string_kept,
    stream_failure,
)
from radixlm.server.http_util import SSE_DONE, json_response, read_json, sse_event
from radixlm.server.inflight import check_timeout
from radixlm.server.sglang_fields import GENERATE as GENERATE_FIELDS
from radixlm.server.sglang_fields import check_field
from radixlm.server.state import RequestUsage, ServerState

router = APIRouter()

_GENERATE_KEYS = {
    "rid",  # the generations' ids (meta_info "id", what /abort_request takes), as SGLang's
    "request_timeout",  # seconds before the generations are aborted (the server's bounds it)
    "priority",  # SGLang's: with --enable-priority-scheduling, admission order and preemption
    "text",
    "input_ids",
    "sampling_params",
    "stream",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
}

# Sampling keys of SGLang's server that this engine lacks, accepted while unset.
_INERT_SAMPLING_KEYS = {"stop_regex", "custom_params"}

# SGLang's `dtype` constraint (older clients send it; newer ones turn it into `regex` themselves)
_DTYPE_REGEX = {
    "int": r"[-+]?[0-9]+[ \n]*",
    "float": r"[-+]?[0-9]*\.?[0-9]+[ \n]*",
    "bool": r"(True|False)",
    "str": r"\"[\w\d\s]*\"",
}


@dataclass(frozen=True)
class NativeSampling:
    params: dict[str, Any]  # for the engine, n removed
    n: int
    no_stop_trim: bool


def translate_sampling_params(state: ServerState, value: Any) -> NativeSampling:
    """SGLang's sampling_params -> the engine's, handling the keys SGLang's client adds."""
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise bad_request("sampling_params must be a JSON object", "sampling_params")
    params: dict[str, Any] = {}
    no_stop_trim = False
    dtype = None
    for key, v in value.items():
        if v is None:  # SGLang's client sends every unset parameter as null
            continue
        if key == "no_stop_trim":
            if not isinstance(v, bool):
                raise bad_request("sampling_params.no_stop_trim must be true or false", key)
            no_stop_trim = v
        elif key == "dtype":
            dtype = v
        elif key in _INERT_SAMPLING_KEYS:
            if v not in ([], {}, "", False):
                raise bad_request(
                    f"sampling_params.{key} is not supported by this server; leave it unset",
                    f"sampling_params.{key}",
                )
        elif key == "sampling_seed":
            params["seed"] = v
        else:
            params[key] = v
    if dtype is not None:
        regex = _DTYPE_REGEX.get(dtype) if isinstance(dtype, str) else None
        if regex is None:
            raise bad_request(
                f"sampling_params.dtype={dtype!r}; use one of {sorted(_DTYPE_REGEX)}",
                "sampling_params.dtype",
            )
        if params.get("regex") not in (None, regex):
            raise bad_request(
                "give sampling_params.dtype or sampling_params.regex, not both",
                "sampling_params.regex",
            )
        params["regex"] = regex
    n = check_n(state, params.pop("n", 1), "sampling_params.n")
    if "max_new_tokens" in params:
        check_max_new_tokens(state, params["max_new_tokens"], "sampling_params.max_new_tokens")
    elif state.limits.max_new_tokens is not None:
        params["max_new_tokens"] = min(128, state.limits.max_new_tokens)
    return NativeSampling(params, n, no_stop_trim)


@dataclass(frozen=True)
class NativeRequest:
    items: list[GenerationInput]  # after fan-out: prompt-major, n per prompt
    samplings: list[NativeSampling]  # one per item
    single: bool  # one prompt and n = 1: a dict back, not a list
    listed: bool  # the prompts came as a list: a refused grammar aborts its item, not the request
    stream: bool
    return_text_in_logprobs: bool
    rids: list[str] | None  # one per item; None: the server names them
    timeout: float | None


def parse_generate(state: ServerState, payload: Any) -> NativeRequest:
    if not isinstance(payload, dict):
        raise bad_request("the body of /generate must be a JSON object")
    for key, value in payload.items():
        if key in _GENERATE_KEYS:
            continue
        # SGLang's other fields: ignored, or refused unless at their default; others unknown
        check_field(GENERATE_FIELDS, key, value, "/generate")
    prompts, single = _prompts(state, payload.get("text"), payload.get("input_ids"))
    check_batch(state, len(prompts), "text" if payload.get("text") is not None else "input_ids")
    count = len(prompts)
    sps = _per_prompt(payload.get("sampling_params"), count, "sampling_params", dict)
    lps = _per_prompt(payload.get("return_logprob"), count, "return_logprob", bool)
    starts = _per_prompt(payload.get("logprob_start_len"), count, "logprob_start_len", int)
    tops = _per_prompt(payload.get("top_logprobs_num"), count, "top_logprobs_num", int)
    priority = check_request_priority(payload.get("priority"))
    stream = payload.get("stream", False)
    text_in_lp = payload.get("return_text_in_logprobs", False)
    for name, flag in (("stream", stream), ("return_text_in_logprobs", text_in_lp)):
        if not isinstance(flag, bool) and flag is not None:
            raise bad_request(f"{name} must be true or false", name)

    items: list[GenerationInput] = []
    samplings: list[NativeSampling] = []
    n_total = 0
    prompt_ns: list[int] = []
    for i, ids in enumerate(prompts):
        check_prompt(state, ids, "text" if payload.get("text") is not None else "input_ids")
        sampling = translate_sampling_params(state, sps[i])
        item = GenerationInput(
            input_ids=ids,
            params=sampling.params,
            return_logprob=bool(lps[i]),
            logprob_start_len=starts[i],
            top_logprobs_num=tops[i],
            priority=priority,
        )
        for copy in fan_out(item, sampling.n):
            items.append(copy)
            samplings.append(sampling)
        n_total += sampling.n
        prompt_ns.append(sampling.n)
    check_batch(state, n_total, "sampling_params.n")
    rids = item_ids(payload.get("rid"), prompt_ns, len(items))
    return NativeRequest(
        items=items,
        samplings=samplings,
        single=single and n_total == 1,
        listed=not single,
        stream=bool(stream),
        return_text_in_logprobs=bool(text_in_lp),
        rids=rids,
        timeout=check_timeout(payload.get("request_timeout")),
    )


def _prompts(state: ServerState, text: Any, input_ids: Any) -> tuple[list[list[int]], bool]:
    if (text is None) == (input_ids is None):
        raise bad_request("give exactly one of text and input_ids", "text")
    if text is not None:
        if isinstance(text, str):
            texts, single = [text], True
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            texts, single = text, False
        else:
            raise bad_request("text must be a string or a non-empty list of strings", "text")
        for t in texts:
            if not t:
                raise bad_request("the prompt text is empty; give at least one character", "text")
        for t in texts:
            check_text_fits(state, t, "text")
        return [state.backend.tokenize(t) for t in texts], single
    if _is_ids(input_ids):
        return [list(input_ids)], True
    if isinstance(input_ids, list) and input_ids and all(_is_ids(x) for x in input_ids):
        return [list(x) for x in input_ids], False
    raise bad_request(
        "input_ids must be a non-empty list of token ids, or a non-empty list of such lists",
        "input_ids",
    )


def _is_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _per_prompt(value: Any, count: int, name: str, kind: type) -> list[Any]:
    if isinstance(value, list):
        if len(value) != count:
            raise bad_request(f"{name} has {len(value)} entries for {count} prompts", name)
        values = value
    else:
        values = [value] * count
    for v in values:
        if v is not None and (not isinstance(v, kind) or (kind is int and isinstance(v, bool))):
            raise bad_request(f"{name} must be a {kind.__name__} or a list of them", name)
    return values


# The log-probability lists of a meta_info. In a stream each chunk carries only the entries new
# since the chunk before it (the prompt's in the first chunk, then each step's new tokens), with
# the count so far in `output_token_logprobs_length`, as SGLang streams them; `text` and
# `output_ids` stay cumulative (SGLang's frontend slices the text itself).
_LOGPROB_LISTS = (
    "input_token_logprobs",
    "input_top_logprobs",
    "output_token_logprobs",
    "output_top_logprobs",
)


def native_output(
    state: ServerState,
    snapshot: dict[str, Any],
    sampling: NativeSampling,
    return_text_in_logprobs: bool,
    index: int | None = None,
    logprobs_sent: dict[str, int] | None = None,
) -> dict[str, Any]:
    """The native API's output for a snapshot. In a stream, `logprobs_sent` counts the entries of
    each log-probability list sent so far for this generation: the chunk carries the rest, and
    the counts move on."""
    meta = dict(snapshot["meta_info"])
    text = snapshot["text"]
    if sampling.no_stop_trim:
        text = stop_string_kept(text, meta)
    if meta.get("output_token_logprobs") is not None:
        meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"])
    if logprobs_sent is not None:
        _new_logprobs_only(meta, logprobs_sent)
    if return_text_in_logprobs:
        _fill_logprob_texts(state, meta)
    out: dict[str, Any] = {"text": text, "output_ids": snapshot["output_ids"], "meta_info": meta}
    if index is not None:
        out["index"] = index
    return out


def _new_logprobs_only(meta: dict[str, Any], sent: dict[str, int]) -> None:
    for key in _LOGPROB_LISTS:
        entries = meta.get(key)
        if entries is None:
            continue
        start = sent.get(key, 0)
        meta[key] = entries[start:]
        sent[key] = max(start, len(entries))


def _fill_logprob_texts(state: ServerState, meta: dict[str, Any]) -> None:
    for key in ("input_token_logprobs", "output_token_logprobs"):
        if meta.get(key) is not None:
            meta[key] = _with_texts(state, meta[key])
    for key in ("input_top_logprobs", "output_top_logprobs"):
        if meta.get(key) is not None:
            meta[key] = [None if e is None else _with_texts(state, e) for e in meta[key]]


def _with_texts(state: ServerState, entries: list[Any]) -> list[tuple[Any, int, str]]:
    texts = state.backend.token_texts([e[1] for e in entries])
    return [(e[0], e[1], t) for e, t in zip(entries, texts)]


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _usage(request: Request) -> RequestUsage | None:
    return getattr(request.state, "usage", None)


@router.post("/generate")
async def generate(request: Request) -> Response:
    state = _state(request)
    payload = await read_json(request)
    # tokenizing (long prompts take a while) off the event loop, which serves every stream
    req = await asyncio.to_thread(parse_generate, state, payload)
    streams = await start(
        state,
        req.items,
        _usage(request),
        arrival(request),
        ids=req.rids,
        timeout=req.timeout,
        streaming=req.stream,
        unique_ids=req.rids is not None,
        isolate_refusals=req.listed,
    )
    if req.stream:
        from fastapi.responses import StreamingResponse

        return StreamingResponse(
            _sse(state, req, streams),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    finals = await cancel_on_disconnect(request, collect(streams))
    for final in finals:
        error = finish_error(final["meta_info"])
        if error is not None:
            raise internal_error(f"generation failed: {error}")
    outputs = [
        native_output(state, f, s, req.return_text_in_logprobs)
        for f, s in zip(finals, req.samplings)
    ]
    return json_response(outputs[0] if req.single else outputs)


async def _sse(
    state: ServerState, req: NativeRequest, streams: list[AsyncIterator[dict[str, Any]]]
) -> AsyncIterator[bytes]:
    many = len(streams) > 1
    merged = merge(streams)
    logprobs_sent: list[dict[str, int]] = [{} for _ in streams]
    try:
        async for index, snapshot in merged:
            error = finish_error(snapshot["meta_info"])
            if error is not None:  # the engine failed it: an error event, not its cut-off text
                raise internal_error(f"generation failed: {error}")
            out = native_output(
                state,
                snapshot,
                req.samplings[index],
                req.return_text_in_logprobs,
                index if many else None,
                logprobs_sent[index],
            )
            yield sse_event(out)
    except Exception as e:  # the stream has begun: report in-band, never hang
        yield stream_failure(state, e)
    finally:
        await merged.aclose()  # type: ignore[attr-defined]  # aborts a batch's other generations
    yield SSE_DONE


def _model_info(state: ServerState) -> dict[str, Any]:
    info = state.backend.model_info()
    return {
        "model_path": info.model_path,
        "tokenizer_path": info.tokenizer_path,
        "is_generation": True,
        "served_model_name": state.served_model_name,
        "context_length": info.context_len,
        "vocab_size": info.vocab_size,
        "preferred_sampling_params": None,
        "chat_template": info.chat_template,
        "weight_version": "default",
    }


@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(request: Request) -> Response:
    return json_response(_model_info(_state(request)))


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(request: Request) -> Response:
    state = _state(request)
    stats = await engine_stats(state.backend)
    info = {
        **state.backend.engine_config(),
        **state.extra_server_info,
        "served_model_name": state.served_model_name,
        "version": __version__,
        "limits": asdict(state.limits),
        "api_key_required": state.api_key is not None,
        "model_info": _model_info(state),
        "internal_states": [stats.as_dict()],
    }
    return json_response(info)


@router.api_route("/health", methods=["GET", "HEAD"])  # (some load balancers probe with HEAD)
async def health(request: Request) -> Response:
    if not _state(request).backend.is_alive():
        raise unavailable("the engine is not running")
    return Response(status_code=200)


HEALTH_GENERATE_TIMEOUT_S = 60.0


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """Generate one token, outside the request metrics (a probe is not user traffic)."""
    state = _state(request)
    ids = state.backend.tokenize("Hi")
    item = GenerationInput(ids, {"max_new_tokens": 1, "temperature": 0.0})

    async def probe() -> dict[str, Any]:
        (stream,) = await open_streams(state, [item])
        return await last(stream)

    try:
        final = await asyncio.wait_for(probe(), HEALTH_GENERATE_TIMEOUT_S)
    except (TimeoutError, asyncio.TimeoutError) as e:
        raise unavailable("the engine did not generate a token in time") from e
    error = finish_error(final["meta_info"])
    if error is not None:
        raise unavailable(f"the engine failed to generate: {error}")
    return Response(status_code=200)


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    flushed = await _state(request).backend.flush_cache()
    if not flushed:
        # as SGLang: a 400 while requests run (their prefixes are in use)
        raise bad_request("cache not flushed: requests are running; retry when the server is idle")
    return Response("Cache flushed.\n", status_code=200, media_type="text/plain")


@router.api_route("/freeze_gc", methods=["GET", "POST"])
async def freeze_gc(request: Request) -> Response:
    """SGLang's route: collect garbage, then freeze what is alive (after a warm-up, so that the
    collector's full passes skip what it left too); the engine did so once at start."""
    await _state(request).backend.freeze_gc()
    return Response("Garbage collector frozen.\n", status_code=200, media_type="text/plain")


@router.post("/concate_and_append_request")
async def concatenate_and_append(request: Request) -> Response:
    """SGLang's frontend joins forks with `join(mode="concate_and_append")` by appending each
    fork's text to its own state, after sending each fork's text as a prompt (`max_new_tokens`
    0), then posts {"src_rids", "dst_rid"} here and reads only the status. Those ids are its
    program states', which no request carries, so there is nothing to copy by them; and
    concatenating the forks' KV as computed (each fork's tokens at the positions after the
    shared prefix) would change what follows. The next request sends the joined text, whose KV
    comes from the prefix cache as far as it matches (the shared prefix and the first fork's
    tokens, sitting where they were computed) and is computed past that: the same result as
    appending the texts."""
    payload = await read_json(request)
    if not isinstance(payload, dict):
        raise bad_request("the body of /concate_and_append_request must be a JSON object")
    unknown = sorted(set(payload) - {"src_rids", "dst_rid"})
    if unknown:
        raise bad_request(
            f"unknown field(s) {unknown} for /concate_and_append_request; "
            "known: ['dst_rid', 'src_rids']"
        )
    src, dst = payload.get("src_rids"), payload.get("dst_rid")
    if not isinstance(src, list) or not src or not all(isinstance(r, str) for r in src):
        raise bad_request("src_rids must be a non-empty list of request ids (strings)", "src_rids")
    if not isinstance(dst, str) or not dst:
        raise bad_request("dst_rid must be a request id (a non-empty string)", "dst_rid")
    return json_response({"success": True, "src_rids": src, "dst_rid": dst})


PROFILER_DIR_ENV = "RADIXLM_TORCH_PROFILER_DIR"


@router.api_route("/start_profile", methods=["GET", "POST"])  # (SGLang's client sends a GET)
async def start_profile(request: Request) -> Response:
    """Profile the engine (torch.profiler) until /stop_profile; the trace goes into `output_dir`
    of the body, else $RADIXLM_TORCH_PROFILER_DIR, else the system's temporary folder."""
    payload = await read_json(request, empty={})
    if not isinstance(payload, dict):
        raise bad_request("the body of /start_profile must be a JSON object (or empty)")
    unknown = sorted(set(payload) - {"output_dir"})
    if unknown:
        raise bad_request(f"unknown field(s) {unknown} for /start_profile; known: ['output_dir']")
    output_dir = payload.get("output_dir") or os.environ.get(PROFILER_DIR_ENV)
    if output_dir is not None and not isinstance(output_dir, str):
        raise bad_request("output_dir must be a string", "output_dir")
    output_dir = output_dir or tempfile.gettempdir()
    try:
        await _state(request).backend.start_profile(output_dir)
    except (ValueError, OSError) as e:
        raise bad_request(f"cannot start the profiler: {e}") from e
    return json_response({"output_dir": output_dir, "message": "profiling started"})


@router.api_route("/stop_profile", methods=["GET", "POST"])
async def stop_profile(request: Request) -> Response:
    try:
        path = await _state(request).backend.stop_profile()
    except ValueError as e:
        raise bad_request(f"cannot stop the profiler: {e}") from e
    return json_response({"trace_file": path, "message": "profiling stopped"})


@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    """SGLang's route: end a running request by its id (`meta_info["id"]`, or the id of an OpenAI
    response), or every one with `abort_all`. Each ends with finish_reason {"type": "abort"} and
    its KV slots are freed; its client gets what was generated so far."""
    payload = await read_json(request)
    if not isinstance(payload, dict):
        raise bad_request("the body of /abort_request must be a JSON object")
    unknown = sorted(set(payload) - {"rid", "abort_all"})
    if unknown:
        raise bad_request(
            f"unknown field(s) {unknown} for /abort_request; known: ['abort_all', 'rid']"
        )
    rid, abort_all = payload.get("rid"), payload.get("abort_all", False)
    if not isinstance(abort_all, bool):
        raise bad_request("abort_all must be true or false", "abort_all")
    inflight = _state(request).inflight
    if abort_all:
        count = inflight.abort_all("aborted by /abort_request (abort_all)")
        return json_response({"success": True, "aborted": count})
    if not isinstance(rid, str) or not rid:
        raise bad_request("rid must be the id of a running request (a non-empty string)", "rid")
    count = inflight.abort(rid, "aborted by /abort_request")
    if count == 0:
        raise not_found(f"no request with rid {rid!r} is running (finished, or never was)", "rid")
    return json_response({"success": True, "aborted": count})
