"""SGLang's request fields, and what this server does with each.

SGLang's router (`sglang-router`) forwards SGLang's full request objects, every field at its
default, and SGLang's own clients send theirs; so every field SGLang's server accepts on /generate
(`GenerateReqInput`), /v1/completions and /v1/chat/completions (`CompletionRequest`,
`ChatCompletionRequest`) is a known field here. Each is one of:

- `honoured`: this server acts on it.
- `ignored`: accepted with any value; it cannot change what is generated (ids, routing and
  tracing hints, metric labels, the knobs of an input this server refuses anyway).
- `default only`: accepted at SGLang's default (null, or the default value, or empty); any other
  value asks for a feature this server lacks and is a 400 that names the field and why.

A field neither SGLang nor OpenAI defines stays an unknown field (a 400): SGLang's server drops
such fields silently, which hides a misspelt parameter. `tests/test_server_sglang_fields.py`
lists the fields of SGLang's dataclasses and fails on one this table does not place, and checks
that `docs/sglang_fields.md` (written by `markdown_table()`) is current.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from radixlm.server.errors import bad_request

Treatment = Literal["honoured", "ignored", "default only"]


@dataclass(frozen=True)
class FieldRule:
    treatment: Treatment
    why: str
    default: Any = None  # SGLang's default: accepted, as null and empty values are
    also_accepted: tuple[Any, ...] = ()  # other values that change nothing here


def _honoured(why: str) -> FieldRule:
    return FieldRule("honoured", why)


def _ignored(why: str) -> FieldRule:
    return FieldRule("ignored", why)


def _default_only(why: str, default: Any = None, *also: Any) -> FieldRule:
    return FieldRule("default only", why, default, also)


_TEXT_ONLY = "this server runs text-only models"
_MM_KNOB = "shapes image/video preprocessing; without image or video data (refused) it does nothing"
_PD = "prefill/decode disaggregation: a radixlm worker prefills and decodes itself"
_DP = "data-parallel routing: a radixlm worker is one data-parallel rank, 0"
_NO_LORA = "this server loads no LoRA adapters"
_EXTRA_OUTPUT = "asks for an output this server does not produce"
_CACHE_NS = "prefix-cache namespaces: every request here shares one prefix cache"

# Fields of all three requests.
_COMMON: dict[str, FieldRule] = {
    "rid": _honoured("the generations' ids (what /abort_request takes; rid_0, rid_1, ... for n)"),
    "bootstrap_host": _default_only(_PD),
    "bootstrap_port": _default_only(_PD),
    "bootstrap_room": _default_only(_PD),
    "routed_dp_rank": _default_only(_DP, None, 0),
    "data_parallel_rank": _default_only(_DP, None, 0),
    "disagg_prefill_dp_rank": _default_only(_PD),
    "return_hidden_states": _default_only(_EXTRA_OUTPUT + " (hidden states)", False),
    "return_routed_experts": _default_only(_EXTRA_OUTPUT + " (MoE routing)", False),
    "routed_experts_start_len": _ignored("only shapes return_routed_experts' output"),
    "lora_path": _default_only(_NO_LORA),
    "session_id": _ignored("an identity only; it does not change the prompt"),
    "session_params": _default_only("continued sessions are not supported; send the whole prompt"),
    "custom_logit_processor": _default_only("custom logit processors are not supported"),
    "watermark": _default_only("watermarking is not supported"),
    "images_config": _ignored(_MM_KNOB),
    "mm_processor_kwargs": _ignored(_MM_KNOB),
    "extra_key": _default_only(_CACHE_NS),
    "cache_salt": _default_only(_CACHE_NS),
    "priority": _honoured(
        "with --enable-priority-scheduling: admission order and preemption (ignored without it)"
    ),
    "custom_labels": _ignored("metric labels"),
}

_OPENAI_COMMON: dict[str, FieldRule] = {
    **_COMMON,
    "model": _honoured("checked against the served model name (404 otherwise)"),
    "frequency_penalty": _honoured("sampling"),
    "presence_penalty": _honoured("sampling"),
    "repetition_penalty": _honoured("sampling"),
    "temperature": _honoured("sampling"),
    "top_p": _honoured("sampling"),
    "top_k": _honoured("sampling"),
    "min_p": _honoured("sampling"),
    "min_tokens": _honoured("sampling (min_new_tokens)"),
    "seed": _honoured("sampling"),
    "logit_bias": _honoured("sampling"),
    "n": _honoured("n samples"),
    "stop": _honoured("stop strings"),
    "stop_token_ids": _honoured("stop tokens"),
    "stop_regex": _default_only("stop regexes are not supported; use stop strings"),
    "ignore_eos": _honoured("sampling"),
    "no_stop_trim": _honoured("the stop string stays in the text"),
    "skip_special_tokens": _honoured("detokenization"),
    "regex": _honoured("constrained decoding"),
    "ebnf": _honoured("constrained decoding"),
    "response_format": _honoured("constrained decoding (text, json_object, json_schema)"),
    "stream": _honoured("server-sent events"),
    "stream_options": _honoured("include_usage, continuous_usage_stats"),
    "logprobs": _honoured("log-probabilities"),
    "user": _ignored("OpenAI's end-user id"),
    "custom_params": _default_only("custom logit processors are not supported"),
    "return_cached_tokens_details": _default_only(
        _EXTRA_OUTPUT + " (usage.prompt_tokens_details.cached_tokens is always there)", False
    ),
    "return_spec_tokens_details": _default_only(_EXTRA_OUTPUT, False),
    "return_token_ids": _default_only(_EXTRA_OUTPUT + " (token ids; /generate has them)", False),
}

GENERATE: dict[str, FieldRule] = {
    **_COMMON,
    "rid": _honoured("the generations' ids (meta_info id; what /abort_request takes)"),
    "text": _honoured("the prompt(s)"),
    "input_ids": _honoured("the prompt(s) as token ids"),
    "sampling_params": _honoured("the engine's sampling parameters"),
    "return_logprob": _honoured("log-probabilities"),
    "logprob_start_len": _honoured("log-probabilities"),
    "top_logprobs_num": _honoured("log-probabilities"),
    "return_text_in_logprobs": _honoured("log-probabilities"),
    "stream": _honoured("server-sent events"),
    "model": _ignored(
        "not SGLang's field (its server drops it); SGLang's router adds it; one model here"
    ),
    "stream_options": _ignored("not SGLang's field; usage is in every meta_info"),
    "log_metrics": _ignored("metrics are always kept"),
    "background": _ignored("the Responses API's background mode; /generate always answers"),
    "input_embeds": _default_only("prompts are text or token ids here"),
    "image_data": _default_only(_TEXT_ONLY),
    "video_data": _default_only(_TEXT_ONLY),
    "audio_data": _default_only(_TEXT_ONLY),
    "modalities": _default_only(_TEXT_ONLY),
    "mm_hashes": _ignored("hashes of image data, which is refused"),
    "mm_content_hashes": _ignored("hashes of image data, which is refused"),
    "use_audio_in_video": _ignored(_MM_KNOB),
    "video_config": _ignored(_MM_KNOB),
    "max_dynamic_patch": _ignored(_MM_KNOB),
    "min_dynamic_patch": _ignored(_MM_KNOB),
    "image_max_dynamic_patch": _ignored(_MM_KNOB),
    "video_max_dynamic_patch": _ignored(_MM_KNOB),
    "positional_embed_overrides": _default_only("embedding overrides are not supported"),
    "need_wait_for_mm_inputs": _default_only("encoder disaggregation is not supported"),
    "num_items_assigned": _default_only("encoder disaggregation is not supported"),
    "encoder_urls": _default_only("encoder disaggregation is not supported"),
    "token_ids_logprob": _default_only("log-probabilities of chosen token ids are not supported"),
    "return_sampling_mask": _default_only(_EXTRA_OUTPUT + " (sampling support)", False),
    "sampling_logprobs_mode": _ignored("only shapes return_sampling_mask's output"),
    "return_flat_raw_top_logprobs": _default_only(_EXTRA_OUTPUT + " (flat arrays)", False),
    "return_flat_raw_output_top_logprobs": _default_only(_EXTRA_OUTPUT + " (flat arrays)", False),
    "return_flat_raw_top_logprobs_b64": _ignored("only shapes the flat arrays' output"),
    "return_indexer_topk": _default_only(_EXTRA_OUTPUT, False),
    "return_bytes": _default_only(_EXTRA_OUTPUT + " (image bytes)", False),
    "return_entropy": _default_only(_EXTRA_OUTPUT + " (entropy)", False),
    "return_prompt_token_ids": _default_only(_EXTRA_OUTPUT + " (prompt token ids)", False),
    "lora_id": _default_only(_NO_LORA),
    "bootstrap_pair_key": _default_only(_PD),
    "decode_tp_size": _default_only(_PD),
    "routing_key": _ignored("a routing hint for a router"),
    "conversation_id": _ignored("a tracking id"),
    "http_worker_ipc": _ignored("SGLang's internal field"),
    "require_reasoning": _default_only("reasoning cannot be required of the model", False),
    "max_thinking_tokens": _default_only("thinking budgets are not supported"),
    "no_logs": _default_only("this server cannot keep one request out of its logs", False),
    "external_trace_header": _ignored("tracing context"),
    "received_time": _ignored("SGLang's internal timing"),
    "multi_item_delimiter_indices": _default_only("multi-item scoring is not supported"),
    "token_indices_to_pool": _default_only("pooling readouts are not supported"),
    "kv_hints": _ignored("hints to a hierarchical-cache storage backend, which there is not"),
}

COMPLETIONS: dict[str, FieldRule] = {
    **_OPENAI_COMMON,
    "prompt": _honoured("the prompt(s)"),
    "max_tokens": _honoured("max_new_tokens"),
    "echo": _honoured("the prompt before the completion"),
    "logprobs": _honoured("the top log-probabilities per token"),
    "best_of": _honoured("equal to n, or refused"),
    "suffix": _default_only("insertion (suffix) is not supported"),
    "json_schema": _honoured("constrained decoding"),
}

CHAT: dict[str, FieldRule] = {
    **_OPENAI_COMMON,
    "messages": _honoured("rendered with the model's chat template"),
    "max_tokens": _honoured("max_new_tokens"),
    "max_completion_tokens": _honoured("max_new_tokens"),
    "logprobs": _honoured("log-probabilities"),
    "top_logprobs": _honoured("log-probabilities"),
    "tools": _honoured("tool calls"),
    "tool_choice": _honoured("tool calls"),
    "parallel_tool_calls": _honoured("tool calls"),
    "chat_template_kwargs": _honoured("variables for the chat template"),
    "separate_reasoning": _honoured("reasoning_content apart (with a reasoning parser)"),
    "reasoning_effort": _ignored("no reasoning-effort control here"),
    "stream_reasoning": _default_only("reasoning is streamed as it is generated", True),
    "continue_final_message": _default_only(
        "the chat always ends with the assistant's turn opened", False
    ),
    "thinking": _default_only("pass the chat template's variables in chat_template_kwargs"),
    "task": _ignored("read only by DeepSeek-V4's chat encoders, as in SGLang"),
    "input_ids": _default_only("the prompt is rendered from messages; send token ids to /generate"),
    "return_prompt_token_ids": _default_only(_EXTRA_OUTPUT + " (prompt token ids)", False),
    "return_meta_info": _default_only(_EXTRA_OUTPUT + " (meta_info)", False),
    "return_input_ids_in_sglext": _default_only(_EXTRA_OUTPUT + " (token ids)", False),
    "return_output_ids_in_sglext": _default_only(_EXTRA_OUTPUT + " (token ids)", False),
    "return_sampling_mask": _default_only(_EXTRA_OUTPUT + " (sampling support)", False),
    "sampling_logprobs_mode": _ignored("only shapes return_sampling_mask's output"),
    "return_flat_raw_output_top_logprobs": _default_only(_EXTRA_OUTPUT + " (flat arrays)", False),
    "return_flat_raw_top_logprobs_b64": _ignored("only shapes the flat arrays' output"),
    "max_dynamic_patch": _ignored(_MM_KNOB),
    "min_dynamic_patch": _ignored(_MM_KNOB),
    "use_audio_in_video": _ignored(_MM_KNOB),
    "video_config": _ignored(_MM_KNOB),
}


def is_unset(value: Any, rule: FieldRule) -> bool:
    """Whether `value` leaves a `default only` field at SGLang's default (null, empty, or a list
    of such values, one per prompt of a batch)."""
    if value is None or value in ("", [], {}):
        return True
    if isinstance(value, list):
        return all(is_unset(v, rule) for v in value)
    return any(_same(value, v) for v in (rule.default, *rule.also_accepted))


def _same(a: Any, b: Any) -> bool:
    # `True == 1` in Python: a flag and a number are never the same value here
    return type(a) is type(b) and a == b


def check_field(table: Mapping[str, FieldRule], key: str, value: Any, route: str) -> None:
    """A 400 for a field of a request to `route` that is unknown, or that asks for what this
    server lacks; nothing for one that is honoured (the route reads it), ignored, or unset."""
    rule = table.get(key)
    if rule is None:
        raise bad_request(
            f"unknown field {key!r} for {route}: neither SGLang nor this server defines it",
            key,
        )
    if rule.treatment == "default only" and not is_unset(value, rule):
        unset = "leave it unset" if rule.default is None else f"leave it at {rule.default!r}"
        raise bad_request(
            f"{key}={_short(value)} is not supported by this server: {rule.why}; {unset}", key
        )


def check_unsupported(table: Mapping[str, FieldRule], request: Any, route: str) -> None:
    """`check_field` over the `default only` fields of a decoded request struct."""
    for key, rule in table.items():
        if rule.treatment == "default only":
            check_field(table, key, getattr(request, key, None), route)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def markdown_table() -> str:
    """docs/sglang_fields.md: every SGLang field of the three requests and what is done with it."""
    routes = (
        ("/generate", GENERATE),
        ("/v1/completions", COMPLETIONS),
        ("/v1/chat/completions", CHAT),
    )
    lines = [
        "# SGLang's request fields in radixlm",
        "",
        "Written by `radixlm.server.sglang_fields.markdown_table()`; "
        "`tests/test_server_sglang_fields.py` checks it is current and that it places every "
        "field of SGLang's `GenerateReqInput`, `CompletionRequest` and `ChatCompletionRequest`.",
        "",
        "- **honoured**: acted on.",
        "- **ignored**: accepted with any value; it cannot change what is generated.",
        "- **default only**: accepted at SGLang's default (or null, or empty); any other value is "
        "a 400 naming the field and why.",
        "",
        "A field that neither SGLang nor OpenAI defines is a 400 (`unknown field`).",
    ]
    for route, table in routes:
        lines += ["", f"## {route}", "", "| field | treatment | why |", "|---|---|---|"]
        for key in sorted(table):
            rule = table[key]
            treatment = rule.treatment
            if rule.treatment == "default only" and rule.default is not None:
                treatment += f" ({json.dumps(rule.default)})"
            lines.append(f"| `{key}` | {treatment} | {rule.why} |")
    return "\n".join(lines) + "\n"
