"""The HTTP backend: a radixlm (or SGLang) server's native API, `/generate` and `/get_model_info`.

Imports neither torch nor transformers: a client process that only talks HTTP starts fast. The
role markers come from the model's chat template, read from the tokenizer files when the server's
tokenizer folder is visible from here (same machine or shared disk), else from `chat_template=`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from radixlm.lang.backend import Backend, BackendError, PromptContext, choice_tokens, pad_logprobs
from radixlm.lang.chat_template import (
    ChatTemplate,
    derive_chat_template,
    jinja_renderer,
    plain_template,
    template_from_string,
    template_from_tokenizer_files,
)
from radixlm.lang.choices import TokenLogprobs
from radixlm.lang.http_client import HttpClient
from radixlm.lang.ir import GenParams

logger = logging.getLogger(__name__)

# prompt tokens before a choice that are re-scored, in case the choice's first token merges with
# the end of the prefix (the window grows when that reaches further back)
_BOUNDARY_WINDOW = 8


class RuntimeEndpoint(Backend):
    """`RuntimeEndpoint("http://127.0.0.1:30000", api_key=None)`: run programs on a server.

    `chat_template` is a `ChatTemplate`, the name of a built-in one ("chatml", "plain") or
    the Jinja text of a Hugging Face chat template; by default the server's own.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        verify: Any = None,  # SGLang's TLS option: accepted, the system's CA store is used
        chat_template_name: str | None = None,
        chat_template: ChatTemplate | str | None = None,
        timeout: float | None = None,
    ) -> None:
        super().__init__()
        self.base_url = base_url.rstrip("/") if isinstance(base_url, str) else base_url
        self._http = HttpClient(base_url, api_key, timeout)
        self.model_info = self._http.get("/get_model_info")
        self.chat_template = self._resolve_template(chat_template or chat_template_name)

    def get_model_name(self) -> str:
        return str(self.model_info.get("model_path"))

    # ---- generation ----------------------------------------------------------------------

    def _payload(self, prompt: PromptContext, params: GenParams) -> dict[str, Any]:
        payload: dict[str, Any] = {"text": prompt.text, "sampling_params": params.sampling_params()}
        payload.update(params.logprob_options())
        if params.return_logprob and params.return_text_in_logprobs:
            payload["return_text_in_logprobs"] = True
        return payload

    def generate(self, prompt: PromptContext, params: GenParams) -> tuple[Any, Any]:
        out = self._http.post("/generate", self._payload(prompt, params))
        if isinstance(out, list):
            if (params.n or 1) > 1:
                return [o["text"] for o in out], [o["meta_info"] for o in out]
            out = out[0]
        return out["text"], out["meta_info"]

    def generate_stream(
        self, prompt: PromptContext, params: GenParams
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        if (params.n or 1) > 1:
            raise ValueError("gen with n > 1 cannot stream")
        payload = {**self._payload(prompt, params), "stream": True}
        sent = 0
        logprobs = _StreamedLogprobs()
        for event in self._http.stream("/generate", payload):
            _check(event)
            text = event["text"]
            yield text[sent:], logprobs.so_far(event["meta_info"])
            sent = len(text)

    # ---- select --------------------------------------------------------------------------

    def score_choices(
        self, prefix: str, choices: list[str], unconditional: bool
    ) -> tuple[list[TokenLogprobs], list[TokenLogprobs] | None, dict[str, Any]]:
        """One batched call scores every choice over the prefix (which an earlier call put in
        the prefix cache). The server tokenizes: where a choice's tokens start is found by
        comparing the prefix's last tokens with those of prefix + choice."""
        prompt_len = 0
        if prefix:
            warm = self._http.post("/generate", _score_payload(prefix, 0, logprobs=False))
            prompt_len = warm["meta_info"]["prompt_tokens"]
        window = _BOUNDARY_WINDOW
        while True:
            start = max(prompt_len - window, 0)
            texts = ([prefix] if prefix else []) + [prefix + c for c in choices]
            outs = self._http.post("/generate", _score_payload(texts, start, logprobs=True))
            tail = [e[1] for e in outs[0]["meta_info"]["input_token_logprobs"]] if prefix else []
            scored = outs[1:] if prefix else outs
            entries, ok = [], True
            for out in scored:
                got = out["meta_info"]["input_token_logprobs"]
                ids = [e[1] for e in got]
                common = choice_tokens(tail, ids)
                if common == 0 and start > 0:
                    ok = False  # the choice changes tokens before the window: look further back
                    break
                common = min(common, len(ids) - 1)
                entries.append(pad_logprobs(got[common:], ids[common:]))
            if ok:
                break
            window *= 4
        meta = {
            "prompt_tokens": [o["meta_info"]["prompt_tokens"] for o in scored],
            "cached_tokens": [o["meta_info"]["cached_tokens"] for o in scored],
        }
        uncond = None
        if unconditional:
            ids = [[e[1] for e in entry] for entry in entries]
            outs = self._http.post(
                "/generate",
                {
                    "input_ids": ids,
                    "sampling_params": {"max_new_tokens": 0},
                    "return_logprob": True,
                    "logprob_start_len": 0,
                    "return_text_in_logprobs": True,
                },
            )
            uncond = [
                pad_logprobs(o["meta_info"]["input_token_logprobs"], i) for o, i in zip(outs, ids)
            ]
        return entries, uncond, meta

    # ---- cache and server ----------------------------------------------------------------

    def cache_prefix(self, prefix: str) -> None:
        if prefix:
            self._http.post("/generate", {"text": prefix, "sampling_params": {"max_new_tokens": 0}})

    def flush_cache(self) -> bool:
        return self._http.status("POST", "/flush_cache") == 200

    def get_server_info(self) -> dict[str, Any]:
        return self._http.get("/get_server_info")

    # ---- chat template -------------------------------------------------------------------

    def _resolve_template(self, given: ChatTemplate | str | None) -> ChatTemplate:
        if isinstance(given, ChatTemplate):
            return given
        if isinstance(given, str) and (named := template_from_string(given)) is not None:
            return named
        for key in ("tokenizer_path", "model_path"):
            path = self.model_info.get(key)
            if not isinstance(path, str) or not path:
                continue
            try:
                template = template_from_tokenizer_files(Path(path))
            except (OSError, ValueError) as e:
                logger.warning("cannot read the chat template at %s: %s", path, e)
                continue
            if template is not None:
                return template
        # a remote server: the template it serves (without the tokenizer's special-token values)
        served = self.model_info.get("chat_template")
        if isinstance(served, str) and served:
            return derive_chat_template(jinja_renderer(served), "served")
        logger.warning(
            "the server's chat template is not readable from here (model %s): roles use plain "
            "'User:' labels; pass chat_template='chatml' or the template text to match the model",
            self.model_info.get("model_path"),
        )
        return plain_template()


class _StreamedLogprobs:
    """The log-probabilities of a stream so far. A chunk of the server's stream carries only what
    is new of each list (the prompt's in the first chunk, then the new tokens'), with the count
    so far in `output_token_logprobs_length`; a server that sends whole lists each time (SGLang's
    default) is read too: its lists are as long as that count."""

    def __init__(self) -> None:
        self._lists: dict[str, list[Any]] = {}

    def so_far(self, meta: dict[str, Any]) -> dict[str, Any]:
        meta = dict(meta)
        total = meta.get("output_token_logprobs_length")
        new = meta.get("output_token_logprobs")
        had = self._lists.get("output_token_logprobs", [])
        appended = isinstance(total, int) and new is not None and len(had) + len(new) == total
        for key in ("output_token_logprobs", "output_top_logprobs"):
            if meta.get(key) is not None:
                kept = self._lists.get(key, []) if appended else []
                self._lists[key] = kept + list(meta[key])
        for key in ("input_token_logprobs", "input_top_logprobs"):
            if meta.get(key):  # the prompt's come whole, once
                self._lists[key] = list(meta[key])
        for key, entries in self._lists.items():
            if key in meta:
                meta[key] = list(entries)
        return meta


def _check(out: dict[str, Any]) -> None:
    """An output whose generation the engine failed (its text stops where it failed) is an
    error, as `EngineBackend` treats it."""
    error = out["meta_info"].get("error")
    if error:
        raise BackendError(f"generation failed: {error}")


def _score_payload(text: Any, start: int, logprobs: bool) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "text": text,
        "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
    }
    if logprobs:
        payload.update(
            {"return_logprob": True, "logprob_start_len": start, "return_text_in_logprobs": True}
        )
    return payload


__all__ = ["BackendError", "RuntimeEndpoint"]
