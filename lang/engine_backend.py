"""The in-process backend: a `radixlm.Engine` called directly (no HTTP, no serialization).

Forks and selects share their prefix's KV through the engine's radix cache: every call sends the
state's full text and the cache matches what earlier calls computed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from radixlm.lang.backend import Backend, BackendError, PromptContext, choice_tokens, pad_logprobs
from radixlm.lang.chat_template import ChatTemplate, derive_chat_template, plain_template
from radixlm.lang.choices import TokenLogprobs
from radixlm.lang.ir import GenParams
from radixlm.protocol.prompt_tokens import encode_prompt

logger = logging.getLogger(__name__)


class EngineBackend(Backend):
    """Runs programs on an in-process `radixlm.Engine`. `set_default_backend(engine)` and
    `run(backend=engine)` wrap an engine in one of these on their own."""

    def __init__(self, engine: Any, chat_template: ChatTemplate | str | None = None) -> None:
        super().__init__()
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.chat_template = _resolve_template(engine, chat_template)
        self._token_text: dict[int, str] = {}

    # ---- generation ----------------------------------------------------------------------

    def generate(self, prompt: PromptContext, params: GenParams) -> tuple[Any, Any]:
        out = self.engine.generate(
            prompt.text, params.sampling_params(), **params.logprob_options()
        )
        outs = out if isinstance(out, list) else [out]
        for o in outs:
            self._check(o)
            self._fill_texts(o["meta_info"], params)
        if (params.n or 1) > 1:
            return [o["text"] for o in outs], [o["meta_info"] for o in outs]
        return outs[0]["text"], outs[0]["meta_info"]

    def generate_stream(
        self, prompt: PromptContext, params: GenParams
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        if (params.n or 1) > 1:
            raise ValueError("gen with n > 1 cannot stream")
        sent = 0
        for snapshot in self.engine.generate(
            prompt.text, params.sampling_params(), stream=True, **params.logprob_options()
        ):
            self._check(snapshot)
            text = snapshot["text"]
            meta = snapshot["meta_info"]
            self._fill_texts(meta, params)
            yield text[sent:], meta
            sent = len(text)

    # ---- select --------------------------------------------------------------------------

    def score_choices(
        self, prefix: str, choices: list[str], unconditional: bool
    ) -> tuple[list[TokenLogprobs], list[TokenLogprobs] | None, dict[str, Any]]:
        """All choices in one engine call: each prompt is prefix + choice, scored from where the
        choice's tokens start (the prefix's KV comes from the radix cache)."""
        encode = self._encode
        prefix_ids = encode(prefix)  # (of an empty prefix: the BOS a tokenizer adds, if any)
        fulls, starts = [], []
        for choice in choices:
            ids = encode(prefix + choice)
            fulls.append(ids)
            starts.append(min(choice_tokens(prefix_ids, ids), len(ids) - 1))
        prompts, lp_starts = list(fulls), list(starts)
        if unconditional:  # the same choice tokens with no context, in the same call
            prompts += [ids[start:] for ids, start in zip(fulls, starts)]
            lp_starts += [0] * len(choices)
        outs = self.engine.generate(
            input_ids=prompts,
            sampling_params={"max_new_tokens": 0},
            return_logprob=True,
            logprob_start_len=lp_starts,
        )
        for o in outs:
            self._check(o)
        entries = [
            _input_logprobs(o["meta_info"], ids[start:], self._token_texts)
            for o, ids, start in zip(outs, prompts, lp_starts)
        ]
        k = len(choices)
        meta = {
            "prompt_tokens": [o["meta_info"]["prompt_tokens"] for o in outs[:k]],
            "cached_tokens": [o["meta_info"]["cached_tokens"] for o in outs[:k]],
        }
        return entries[:k], (entries[k:] if unconditional else None), meta

    # ---- cache ---------------------------------------------------------------------------

    def cache_prefix(self, prefix: str) -> None:
        if prefix:
            self._check(self.engine.generate(prefix, {"max_new_tokens": 0}))

    def flush_cache(self) -> bool:
        return bool(self.engine.flush_cache())

    def get_server_info(self) -> dict[str, Any]:
        return {"internal_states": [self.engine.get_stats().as_dict()]}

    def shutdown(self) -> None:
        self.engine.shutdown()

    # ---- helpers -------------------------------------------------------------------------

    def _encode(self, text: str) -> list[int]:
        return encode_prompt(self.tokenizer, text)  # as the engine tokenizes a text prompt

    def _token_texts(self, ids: list[int]) -> list[str]:
        out = []
        for t in ids:
            text = self._token_text.get(t)
            if text is None:
                text = self._token_text[t] = self.tokenizer.decode([t])
            out.append(text)
        return out

    def _fill_texts(self, meta: dict[str, Any], params: GenParams) -> None:
        """Each log-probability entry's token text, the top lists' too (as the server's native
        API gives them with return_text_in_logprobs)."""
        if not params.return_text_in_logprobs:
            return
        for key in ("input_token_logprobs", "output_token_logprobs"):
            entries = meta.get(key)
            if entries:
                meta[key] = self._with_texts(entries)
        for key in ("input_top_logprobs", "output_top_logprobs"):
            tops = meta.get(key)
            if tops:
                meta[key] = [self._with_texts(top) if top else top for top in tops]

    def _with_texts(self, entries: list) -> list:
        texts = self._token_texts([e[1] for e in entries])
        return [(e[0], e[1], t) for e, t in zip(entries, texts)]

    @staticmethod
    def _check(out: dict[str, Any]) -> None:
        meta = out["meta_info"]
        if meta.get("error"):
            raise BackendError(f"generation failed: {meta['error']}")


def _input_logprobs(meta: dict[str, Any], ids: list[int], token_texts) -> TokenLogprobs:
    got = pad_logprobs(list(meta.get("input_token_logprobs") or []), ids)
    texts = token_texts([e[1] for e in got])
    return [(e[0], e[1], text) for e, text in zip(got, texts)]


def _resolve_template(engine: Any, chat_template: ChatTemplate | str | None) -> ChatTemplate:
    if isinstance(chat_template, ChatTemplate):
        return chat_template
    tokenizer = engine.tokenizer
    if isinstance(chat_template, str):
        from radixlm.lang.chat_template import template_from_string

        tokens = {"bos_token": tokenizer.bos_token or "", "eos_token": tokenizer.eos_token or ""}
        named = template_from_string(chat_template, tokens, tokenizer.bos_token)
        if named is not None:
            return named
    if not getattr(tokenizer, "chat_template", None):
        logger.warning("the model has no chat template: roles use plain 'User:' labels")
        return plain_template()

    def render(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return engine.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)

    name = getattr(getattr(engine, "model_folder", None), "name", None) or "model"
    try:
        return derive_chat_template(render, name=name, bos_token=tokenizer.bos_token)
    except ValueError as e:
        logger.warning("%s; roles use plain 'User:' labels", e)
        return plain_template()
