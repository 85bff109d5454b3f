"""The program language: `@function` programs of `gen` / `select` / `fork`, SGLang-compatible.

    import radixlm as sgl

    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=64))

    sgl.set_default_backend(sgl.Engine())   # or sgl.RuntimeEndpoint("http://127.0.0.1:30000")
    state = qa.run(question="What is the capital of France?")
    state["answer"], state.text(), state.messages()

Nothing here imports torch: only a `radixlm.Engine` backend does.
"""

from radixlm.lang.api import (
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    get_server_info,
    image,
    select,
    separate_reasoning,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
    video,
)
from radixlm.lang.backend import Backend, BackendError, PromptContext
from radixlm.lang.chat_template import ChatTemplate, get_chat_template
from radixlm.lang.choices import (
    ChoicesDecision,
    ChoicesSamplingMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from radixlm.lang.default_backend import get_default_backend, set_default_backend
from radixlm.lang.engine_backend import EngineBackend
from radixlm.lang.interpreter import ProgramError, ProgramState, ProgramStateGroup
from radixlm.lang.openai_backend import OpenAI
from radixlm.lang.program import Function
from radixlm.lang.runtime_endpoint import RuntimeEndpoint

__all__ = [
    "Backend",
    "BackendError",
    "ChatTemplate",
    "ChoicesDecision",
    "ChoicesSamplingMethod",
    "EngineBackend",
    "Function",
    "OpenAI",
    "ProgramError",
    "ProgramState",
    "ProgramStateGroup",
    "PromptContext",
    "RuntimeEndpoint",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "flush_cache",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_chat_template",
    "get_default_backend",
    "get_server_info",
    "greedy_token_selection",
    "image",
    "select",
    "separate_reasoning",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
    "video",
]
