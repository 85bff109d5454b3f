"""A backend for any OpenAI-compatible server (`/v1/chat/completions`, or `/v1/completions`).

A chat model generates whole assistant messages from the conversation so far: `gen` must open
an assistant turn (`assistant(gen(...))`). What the API cannot express, `select`, `regex` and
`dtype`, raises a clear error; `json_schema` becomes `response_format`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from radixlm.lang.backend import Backend, PromptContext
from radixlm.lang.chat_template import ChatTemplate, plain_template
from radixlm.lang.http_client import HttpClient
from radixlm.lang.ir import GenParams

if TYPE_CHECKING:
    import random

# sampling parameters outside OpenAI's API, sent only when set away from their defaults (servers
# such as radixlm, SGLang and vLLM accept them)
_EXTENSIONS = {
    "top_k": -1,
    "min_p": 0.0,
    "min_new_tokens": 0,
    "ignore_eos": False,
    "stop_token_ids": [],
}


class OpenAI(Backend):
    """`OpenAI("gpt-4o-mini")`, or `OpenAI(base_url="http://127.0.0.1:30000/v1")` for a local
    server (the model then defaults to the server's first). The API key defaults to
    $OPENAI_API_KEY, the base URL to $OPENAI_BASE_URL or OpenAI's."""

    def __init__(
        self,
        model_name: str | None = None,
        is_chat_model: bool = True,
        chat_template: ChatTemplate | None = None,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float | None = None,
    ) -> None:
        super().__init__()
        base_url = base_url or os.environ.get("OPENAI_BASE_URL") or "https://api.openai.com/v1"
        api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        self._http = HttpClient(base_url, api_key, timeout)
        self.is_chat_model = is_chat_model
        self.chat_template = chat_template or plain_template()
        if model_name is None:
            models = self._http.get("/models").get("data") or []
            if not models:
                raise ValueError(f"the server at {base_url} lists no models; give model_name")
            model_name = models[0]["id"]
        self.model_name = model_name

    def get_model_name(self) -> str:
        return self.model_name

    def _body(self, prompt: PromptContext, params: GenParams) -> dict[str, Any]:
        if params.regex is not None:
            raise ValueError(
                "the OpenAI backend cannot constrain gen by regex or dtype: the OpenAI API has no "
                "such parameter; use json_schema, or a radixlm.Engine / RuntimeEndpoint backend"
            )
        body: dict[str, Any] = {"model": self.model_name}
        if self.is_chat_model:
            if prompt.role != "assistant":
                raise ValueError(
                    "with the OpenAI chat backend, gen must open an assistant turn: write "
                    "s += assistant(gen(...))"
                )
            if prompt.text[prompt.role_begin or 0 :].strip():
                raise ValueError(
                    "the OpenAI chat backend cannot continue a partly written assistant message: "
                    "put gen first in the assistant turn"
                )
            body["messages"] = list(prompt.messages)
        else:
            body["prompt"] = prompt.text
        mapping = {
            "max_new_tokens": "max_tokens",
            "temperature": "temperature",
            "top_p": "top_p",
            "frequency_penalty": "frequency_penalty",
            "presence_penalty": "presence_penalty",
            "n": "n",
        }
        for ours, theirs in mapping.items():
            value = getattr(params, ours)
            if value is not None:
                body[theirs] = value
        if params.stop:
            body["stop"] = params.stop
        for ours, default in _EXTENSIONS.items():
            value = getattr(params, ours)
            if value is not None and value != default:
                body["min_tokens" if ours == "min_new_tokens" else ours] = value
        if params.json_schema is not None:
            if not self.is_chat_model:
                body["json_schema"] = params.json_schema
            else:
                body["response_format"] = {
                    "type": "json_schema",
                    "json_schema": {"name": "output", "schema": json.loads(params.json_schema)},
                }
        if params.return_logprob:
            body["logprobs"] = True if self.is_chat_model else (params.top_logprobs_num or 0)
            if self.is_chat_model and params.top_logprobs_num:
                body["top_logprobs"] = params.top_logprobs_num
        return body

    def _path(self) -> str:
        return "/chat/completions" if self.is_chat_model else "/completions"

    def _text(self, choice: dict[str, Any]) -> str:
        if self.is_chat_model:
            return (choice.get("message") or {}).get("content") or ""
        return choice.get("text") or ""

    def generate(self, prompt: PromptContext, params: GenParams) -> tuple[Any, Any]:
        out = self._http.post(self._path(), self._body(prompt, params))
        choices = out.get("choices") or []
        metas = [
            {
                "id": out.get("id"),
                "finish_reason": c.get("finish_reason"),
                "usage": out.get("usage"),
            }
            for c in choices
        ]
        if (params.n or 1) > 1:
            return [self._text(c) for c in choices], metas
        return self._text(choices[0]), metas[0]

    def generate_stream(
        self, prompt: PromptContext, params: GenParams
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        if (params.n or 1) > 1:
            raise ValueError("gen with n > 1 cannot stream")
        body = {**self._body(prompt, params), "stream": True}
        for event in self._http.stream(self._path(), body):
            for choice in event.get("choices") or []:
                if self.is_chat_model:
                    text = (choice.get("delta") or {}).get("content") or ""
                else:
                    text = choice.get("text") or ""
                meta = {"id": event.get("id"), "finish_reason": choice.get("finish_reason")}
                if text or choice.get("finish_reason"):
                    yield text, meta

    def select(
        self,
        prompt: PromptContext,
        choices: list[str],
        temperature: float,
        choices_method: Any,
        rng: random.Random,
    ) -> Any:
        raise ValueError(
            "select is not available with the OpenAI backend: the OpenAI API cannot score given "
            "choices; use a radixlm.Engine or RuntimeEndpoint backend"
        )
