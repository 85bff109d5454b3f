"""The server's OpenAPI document (`/openapi.json`).

The routes read their bodies themselves (raw JSON decoded into the msgspec structs of
server/openai_protocol.py, or checked by hand for the native routes), so FastAPI's own document
would show none of them. This one is FastAPI's with each body added: the OpenAI routes' from the
same structs that decode them (msgspec writes their JSON schemas; a struct that refuses unknown
fields says so), the native /generate's from its keys, the engine's sampling parameters and
SGLang's field table, and the small admin bodies as their routes check them. Every error has one
documented shape (server/errors.py), under each operation's `default` response.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from radixlm.protocol.sampling_params import PRIORITY_RANGE, SamplingParams
from radixlm.server import openai_protocol as proto
from radixlm.server.sglang_fields import CHAT as CHAT_FIELDS
from radixlm.server.sglang_fields import COMPLETIONS as COMPLETION_FIELDS
from radixlm.server.sglang_fields import GENERATE as GENERATE_FIELDS
from radixlm.server.sglang_fields import FieldRule

_REF = "#/components/schemas/{name}"

# route path -> the struct its body decodes into
_STRUCT_BODIES: dict[str, type] = {
    "/v1/completions": proto.CompletionRequest,
    "/v1/chat/completions": proto.ChatCompletionRequest,
    "/v1/responses": proto.ResponsesRequest,
    "/tokenize": proto.TokenizeRequest,
    "/v1/tokenize": proto.TokenizeRequest,
    "/detokenize": proto.DetokenizeRequest,
    "/v1/detokenize": proto.DetokenizeRequest,
}


def _one_or_list(schema: dict[str, Any]) -> dict[str, Any]:
    """A value given once for every prompt of a batch, or as a list of one per prompt."""
    return {"anyOf": [schema, {"type": "array", "items": schema}]}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def native_sampling_params_schema() -> dict[str, Any]:
    """/generate's `sampling_params`: the engine's parameters (protocol/sampling_params.py) and
    the keys SGLang's client adds, which the route translates (server/native.py); null means
    unset, as SGLang's client sends every unset parameter."""
    (schema,), components = msgspec.json.schema_components([SamplingParams], ref_template=_REF)
    params = components[schema["$ref"].rsplit("/", 1)[1]]
    properties: dict[str, Any] = {}
    for f in dataclasses.fields(SamplingParams):
        prop = dict(params["properties"][f.name])
        prop.pop("default", None)
        properties[f.name] = _nullable(prop) if "anyOf" not in prop else prop
    properties["stop"] = _nullable(
        {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}
    )
    properties["json_schema"] = _nullable({"anyOf": [{"type": "string"}, {"type": "object"}]})
    properties["structural_tag"] = _nullable({"anyOf": [{"type": "string"}, {"type": "object"}]})
    properties.update(
        no_stop_trim=_nullable({"type": "boolean"}),
        dtype=_nullable({"type": "string", "enum": ["int", "float", "bool", "str"]}),
        sampling_seed=_nullable({"type": "integer"}),
        stop_regex={"description": "accepted only unset (null, empty)"},
        custom_params={"description": "accepted only unset (null, empty)"},
    )
    return {
        "title": "NativeSamplingParams",
        "type": "object",
        "properties": properties,
        "additionalProperties": False,
    }


def _token_ids(vocab_size: int) -> dict[str, Any]:
    """A non-empty list of token ids of the model's vocabulary."""
    token = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    return {"type": "array", "items": token, "minItems": 1}


def _sglang_field(rule: FieldRule) -> dict[str, Any]:
    """One of SGLang's fields that this server does not act on: any value where it is ignored;
    where only its default is taken, that default or an unset value (null, empty)."""
    schema: dict[str, Any] = {"description": f"{rule.treatment}: {rule.why}"}
    if rule.treatment == "default only":
        values = [
            None,
            "",
            *([rule.default] if rule.default is not None else []),
            *rule.also_accepted,
        ]
        schema["anyOf"] = [
            {"enum": values},
            {"type": "array", "maxItems": 0},
            {"type": "object", "maxProperties": 0},
        ]
    return schema


def generate_request_schema(vocab_size: int) -> dict[str, Any]:
    """The body of the native /generate (SGLang's GenerateReqInput, as server/native.py reads
    it): exactly one of `text` and `input_ids`, one prompt or a list of them."""
    ids = _token_ids(vocab_size)
    properties: dict[str, Any] = {
        name: _sglang_field(rule) for name, rule in GENERATE_FIELDS.items()
    }
    properties.update(
        text={
            "anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
            ]
        },
        input_ids={"anyOf": [ids, {"type": "array", "items": ids, "minItems": 1}]},
        sampling_params=_nullable(_one_or_list({"$ref": _REF.format(name="NativeSamplingParams")})),
        stream=_nullable({"type": "boolean"}),
        return_logprob=_nullable(_one_or_list(_nullable({"type": "boolean"}))),
        logprob_start_len=_nullable(_one_or_list(_nullable({"type": "integer"}))),
        top_logprobs_num=_nullable(_one_or_list(_nullable({"type": "integer"}))),
        return_text_in_logprobs=_nullable({"type": "boolean"}),
        rid=_nullable(
            {
                "anyOf": [
                    {"type": "string", "minLength": 1},
                    {"type": "array", "items": {"type": "string", "minLength": 1}},
                ]
            }
        ),
        request_timeout=_nullable({"type": "number", "exclusiveMinimum": 0}),
        priority=_nullable(
            {"type": "integer", "minimum": PRIORITY_RANGE[0], "maximum": PRIORITY_RANGE[1]}
        ),
    )
    return {
        "title": "GenerateRequest",
        "type": "object",
        "properties": properties,
        "additionalProperties": False,
        "oneOf": [{"required": ["text"]}, {"required": ["input_ids"]}],
    }


_ADMIN_BODIES: dict[str, dict[str, Any]] = {
    "/abort_request": {
        "title": "AbortRequest",
        "type": "object",
        "properties": {
            "rid": {"type": "string", "minLength": 1},
            "abort_all": {"type": "boolean"},
        },
        "additionalProperties": False,
    },
    "/start_profile": {
        "title": "StartProfileRequest",
        "type": "object",
        "properties": {"output_dir": _nullable({"type": "string"})},
        "additionalProperties": False,
    },
    "/concate_and_append_request": {
        "title": "ConcateAndAppendRequest",
        "type": "object",
        "properties": {
            "src_rids": {"type": "array", "items": {"type": "string"}, "minItems": 1},
            "dst_rid": {"type": "string", "minLength": 1},
        },
        "required": ["src_rids", "dst_rid"],
        "additionalProperties": False,
    },
}
_OPTIONAL_BODIES = {"/start_profile"}  # an empty body is taken as {}

ERROR_SCHEMA: dict[str, Any] = {
    "title": "Error",
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": _nullable({"type": "string"}),
                "code": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
            },
            "required": ["message", "type", "param", "code"],
        }
    },
    "required": ["error"],
}


def _refine(components: dict[str, dict[str, Any]], vocab_size: int) -> None:
    """What the OpenAI routes check by hand beyond their structs' types: the fields they
    require, and the shapes of the fields typed `Any` (prompts, token lists, Responses input)."""
    ids = _token_ids(vocab_size)
    text = {"type": "string", "minLength": 1}
    completion = components["CompletionRequest"]
    completion["properties"]["prompt"] = {
        "anyOf": [
            text,
            {"type": "array", "items": text, "minItems": 1},
            ids,
            {"type": "array", "items": ids, "minItems": 1},
        ]
    }
    completion["required"] = ["prompt"]
    chat = components["ChatCompletionRequest"]
    chat["properties"]["messages"]["minItems"] = 1
    chat["required"] = ["messages"]
    roles = ["system", "developer", "user", "assistant", "tool"]
    components["ChatMessage"]["properties"]["role"] = {"enum": roles}
    for name, table in (
        ("CompletionRequest", COMPLETION_FIELDS),
        ("ChatCompletionRequest", CHAT_FIELDS),
    ):
        properties = components[name]["properties"]
        for key, rule in table.items():
            if rule.treatment != "honoured" and properties.get(key) in ({}, {"default": None}):
                properties[key] = _sglang_field(rule)
    detokenize = components["DetokenizeRequest"]
    some_ids = {**ids, "minItems": 0}
    detokenize["properties"]["tokens"] = {"anyOf": [some_ids, {"type": "array", "items": some_ids}]}
    detokenize["required"] = ["tokens"]
    responses = components["ResponsesRequest"]
    responses["properties"]["input"] = {
        "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}, "minItems": 1}]
    }
    responses["required"] = ["input"]


def body_components(vocab_size: int) -> dict[str, dict[str, Any]]:
    """Every schema the request bodies refer to, by name, for a model of `vocab_size` tokens."""
    structs = sorted(set(_STRUCT_BODIES.values()), key=lambda t: t.__name__)
    _, components = msgspec.json.schema_components(structs, ref_template=_REF)
    for name, schema in components.items():
        struct = getattr(proto, name, None)
        config = getattr(struct, "__struct_config__", None)
        if config is not None and config.forbid_unknown_fields:
            schema["additionalProperties"] = False
    _refine(components, vocab_size)
    components["GenerateRequest"] = generate_request_schema(vocab_size)
    components["NativeSamplingParams"] = native_sampling_params_schema()
    for schema in _ADMIN_BODIES.values():
        components[schema["title"]] = schema
    components["Error"] = ERROR_SCHEMA
    return components


def _body_ref(path: str) -> str | None:
    if path in _STRUCT_BODIES:
        return _STRUCT_BODIES[path].__name__
    if path == "/generate":
        return "GenerateRequest"
    if path in _ADMIN_BODIES:
        return _ADMIN_BODIES[path]["title"]
    return None


# What a success returns: the JSON bodies the clients read (each field they rely on required;
# more may come), and the media type where it is not JSON.
_INT = {"type": "integer"}
_USAGE = {
    "type": "object",
    "properties": {"prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT},
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
}
_FINISH_REASON = _nullable({"type": "string"})
_GENERATE_OUTPUT = {
    "type": "object",
    "properties": {
        "text": {"type": "string"},
        "output_ids": {"type": "array", "items": _INT},
        "meta_info": {
            "type": "object",
            "properties": {
                "id": {"type": "string"},
                "prompt_tokens": _INT,
                "completion_tokens": _INT,
                "cached_tokens": _INT,
                # {"type": "stop" | "length" | "abort", ...}
                "finish_reason": _nullable({"type": "object"}),
            },
            "required": ["id", "prompt_tokens", "completion_tokens", "finish_reason"],
        },
    },
    "required": ["text", "output_ids", "meta_info"],
}


def _choices(item: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"index": _INT, "finish_reason": _FINISH_REASON, **item},
            "required": ["index", "finish_reason", *item],
        },
    }


def _completion_object(kind: str, item: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "object": {"const": kind},
            "created": _INT,
            "model": {"type": "string"},
            "choices": _choices(item),
            "usage": _USAGE,
        },
        "required": ["id", "object", "created", "model", "choices", "usage"],
    }


# one server-sent event (before OpenAPI 3.2, an event stream's `schema` describes each event):
# its `data` is a chunk's JSON, or the closing "[DONE]"
_EVENT = {
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}


def _json_or_events(schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "application/json": {"schema": schema},
        "text/event-stream": {"schema": _EVENT},  # with "stream": true
    }


def _json(properties: dict[str, Any]) -> dict[str, Any]:
    schema = {"type": "object", "properties": properties, "required": list(properties)}
    return {"application/json": {"schema": schema}}


_MODEL_CARD = {
    "type": "object",
    "properties": {"id": {"type": "string"}, "object": {"const": "model"}},
    "required": ["id", "object"],
}
_IDS = {"type": "array", "items": _INT}
_SUCCESS_CONTENT: dict[str, dict[str, Any] | None] = {
    "/health": None,  # a status, no body
    "/health_generate": None,
    "/flush_cache": {"text/plain": {"schema": {"type": "string"}}},
    "/metrics": {"text/plain": {"schema": {"type": "string"}}},  # Prometheus' text format
    "/generate": _json_or_events(
        {"anyOf": [_GENERATE_OUTPUT, {"type": "array", "items": _GENERATE_OUTPUT}]}
    ),
    "/v1/completions": _json_or_events(
        _completion_object("text_completion", {"text": {"type": "string"}})
    ),
    "/v1/chat/completions": _json_or_events(
        _completion_object(
            "chat.completion",
            {"message": {"type": "object", "properties": {"role": {"const": "assistant"}}}},
        )
    ),
    "/v1/responses": _json_or_events({"type": "object"}),
    "/tokenize": _json(
        {
            "tokens": {"anyOf": [_IDS, {"type": "array", "items": _IDS}]},
            "count": {"anyOf": [_INT, {"type": "array", "items": _INT}]},
            "max_model_len": _INT,
        }
    ),
    "/detokenize": _json(
        {"text": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}}
    ),
    "/abort_request": _json({"success": {"const": True}, "aborted": _INT}),
    "/concate_and_append_request": _json(
        {
            "success": {"const": True},
            "src_rids": {"type": "array", "items": {"type": "string"}},
            "dst_rid": {"type": "string"},
        }
    ),
    "/v1/models": _json(
        {"object": {"const": "list"}, "data": {"type": "array", "items": _MODEL_CARD}}
    ),
    "/v1/models/{model_id}": {"application/json": {"schema": _MODEL_CARD}},
    "/model_info": _json(
        {"model_path": {"type": "string"}, "context_length": _INT, "vocab_size": _INT}
    ),
}
for _alias, _path in (
    ("/v1/tokenize", "/tokenize"),
    ("/v1/detokenize", "/detokenize"),
    ("/get_model_info", "/model_info"),
):
    _SUCCESS_CONTENT[_alias] = _SUCCESS_CONTENT[_path]


def add_bodies(document: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """FastAPI's document with the request bodies, what a success returns where it is not
    JSON, and the error response added (in place)."""
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(body_components(vocab_size))
    error = {
        "description": "An error: what to fix, and the field it is about",
        "content": {"application/json": {"schema": {"$ref": _REF.format(name="Error")}}},
    }
    seen: set[str] = set()
    for path, operations in document.get("paths", {}).items():
        name = _body_ref(path)
        for method, operation in operations.items():
            # (FastAPI names a route's operations for its first method: each must be unique)
            if operation.get("operationId") in seen:
                operation["operationId"] = f"{operation['operationId']}_{method}"
            seen.add(operation.get("operationId", ""))
            responses = operation.setdefault("responses", {})
            responses["default"] = error
            if path in _SUCCESS_CONTENT and "200" in responses:
                content = _SUCCESS_CONTENT[path]
                if content is None:
                    responses["200"].pop("content", None)
                else:
                    responses["200"]["content"] = content
            if name is None or method not in ("post", "put", "patch"):
                continue
            operation["requestBody"] = {
                "required": path not in _OPTIONAL_BODIES,
                "content": {"application/json": {"schema": {"$ref": _REF.format(name=name)}}},
            }
    return document
