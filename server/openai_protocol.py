"""Request bodies of the OpenAI API, as msgspec structs (decoding is validation).

Unknown fields are refused, as OpenAI does. Fields OpenAI defines that change nothing here (`user`,
`metadata`, `store`, `service_tier`, ...) are accepted and ignored. A few SGLang and vLLM extensions
are accepted too (`top_k`, `min_p`, `repetition_penalty`, `regex`, `ebnf`, `chat_template_kwargs`,
...); so is every field of SGLang's own requests (server/sglang_fields.py: which are acted on,
which ignored, which refused unless at their default). Fields the OpenAI spec marks nullable take
null as their default, as clients that send every unset field as null expect.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec


class _Strict(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    # nullable fields whose null means this default (typed `T | None` so that null decodes)
    _NULL_MEANS: ClassVar[dict[str, Any]] = {}

    def __post_init__(self) -> None:
        for name, default in self._NULL_MEANS.items():
            if getattr(self, name) is None:
                setattr(self, name, default)


class _Lenient(msgspec.Struct, omit_defaults=True):
    pass


class StreamOptions(_Strict):
    _NULL_MEANS = {"include_usage": False, "continuous_usage_stats": False}
    include_usage: bool | None = False
    # vLLM's: the usage so far in every chunk (with include_usage)
    continuous_usage_stats: bool | None = False


class FunctionDef(_Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Lenient):
    function: FunctionDef
    type: str = "function"


class ToolChoiceFunction(_Lenient):
    name: str


class ToolChoiceNamed(_Lenient):
    function: ToolChoiceFunction
    type: str = "function"


class ToolCallFunction(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Lenient):
    function: ToolCallFunction
    id: str | None = None
    type: str = "function"


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class ChatMessage(_Lenient):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    reasoning_content: str | None = None


class JsonSchemaFormat(_Lenient):
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Strict):
    type: str
    json_schema: JsonSchemaFormat | None = None
    # type "structural_tag" (SGLang's): sections opened by triggers, each held to its schema
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None


class _SamplingFields(_Strict):
    _NULL_MEANS = {"n": 1, "stream": False}
    model: str | None = None
    n: int | None = 1
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # SGLang extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    regex: str | None = None
    ebnf: str | None = None
    rid: Any = None  # SGLang's: the generations' ids, what /abort_request takes
    # SGLang's fields that this server does not act on, any value (server/sglang_fields.py:
    # ignored) or only at SGLang's default (default only: checked by the route)
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    routed_dp_rank: Any = None
    data_parallel_rank: Any = None
    disagg_prefill_dp_rank: Any = None
    return_hidden_states: Any = None
    return_routed_experts: Any = None
    routed_experts_start_len: Any = None
    return_cached_tokens_details: Any = None
    return_spec_tokens_details: Any = None
    return_token_ids: Any = None
    lora_path: Any = None
    session_id: Any = None
    session_params: Any = None
    custom_logit_processor: Any = None
    custom_params: Any = None
    watermark: Any = None
    stop_regex: Any = None
    images_config: Any = None
    mm_processor_kwargs: Any = None
    extra_key: Any = None
    cache_salt: Any = None
    # SGLang's: with --enable-priority-scheduling, more urgent requests are admitted first and
    # may preempt less urgent ones; without it, accepted and ignored
    priority: int | None = None
    custom_labels: Any = None
    # radixlm: seconds before the generation is aborted (the server's --request-timeout bounds it)
    request_timeout: float | None = None


class CompletionRequest(_SamplingFields):
    _NULL_MEANS = {**_SamplingFields._NULL_MEANS, "echo": False, "max_tokens": 16}
    # a string, a list of strings, a list of token ids or a list of lists (checked by hand:
    # msgspec unions hold one array type at most)
    prompt: Any = None
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None
    json_schema: str | dict[str, Any] | None = None
    response_format: ResponseFormat | None = None


class ChatCompletionRequest(_SamplingFields):
    _NULL_MEANS = {
        **_SamplingFields._NULL_MEANS,
        "logprobs": False,
        "parallel_tool_calls": True,
        "separate_reasoning": True,
    }
    messages: list[ChatMessage] = msgspec.field(default_factory=list)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: str | ToolChoiceNamed | None = None
    parallel_tool_calls: bool | None = True
    # extra variables for the model's chat template (vLLM's and SGLang's name), e.g. Qwen3's
    # {"enable_thinking": false}
    chat_template_kwargs: dict[str, Any] | None = None
    # SGLang's: with a reasoning parser, the thinking apart as reasoning_content (false: all of
    # the output is content)
    separate_reasoning: bool | None = True
    # accepted, no effect here
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None  # a hint only
    # SGLang's chat fields that this server does not act on (server/sglang_fields.py)
    stream_reasoning: Any = None
    continue_final_message: Any = None
    thinking: Any = None
    task: Any = None
    input_ids: Any = None
    return_prompt_token_ids: Any = None
    return_meta_info: Any = None
    return_input_ids_in_sglext: Any = None
    return_output_ids_in_sglext: Any = None
    return_sampling_mask: Any = None
    sampling_logprobs_mode: Any = None
    return_flat_raw_output_top_logprobs: Any = None
    return_flat_raw_top_logprobs_b64: Any = None
    max_dynamic_patch: Any = None
    min_dynamic_patch: Any = None
    use_audio_in_video: Any = None
    video_config: Any = None


class TokenizeRequest(_Strict):
    """SGLang's /tokenize (and /v1/tokenize): a prompt (or a list of them), or chat messages
    rendered as a chat completion renders them."""

    _NULL_MEANS = {"add_special_tokens": True, "continue_final_message": False}
    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    tool_choice: str | ToolChoiceNamed | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = True
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = False
    reasoning_effort: str | None = None  # accepted, no effect here


class DetokenizeRequest(_Strict):
    """SGLang's /detokenize (and /v1/detokenize)."""

    _NULL_MEANS = {"skip_special_tokens": True}
    model: str | None = None
    # a list of token ids or a list of such lists (checked by hand, as CompletionRequest.prompt)
    tokens: Any = None
    skip_special_tokens: bool | None = True


class ResponsesTool(_Lenient):
    """A tool of the Responses API: a function, described flat (not under "function")."""

    type: str = "function"
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(_Strict):
    """The stateless part of OpenAI's /v1/responses: nothing is stored, so `previous_response_id`
    is refused and `store` changes nothing."""

    _NULL_MEANS = {"stream": False, "parallel_tool_calls": True}
    model: str | None = None
    # a string, or a list of input items (messages, function calls and their outputs), checked
    # by hand
    input: Any = None
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Any = None  # "auto" | "none" | "required" | {"type": "function", "name"}
    parallel_tool_calls: bool | None = True
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | ...}}
    previous_response_id: str | None = None
    # radixlm: seconds before the generation is aborted (the server's --request-timeout bounds it)
    request_timeout: float | None = None
    # accepted, no effect here
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    service_tier: str | None = None
    include: list[str] | None = None
