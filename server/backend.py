"""What the HTTP server needs from an engine, and its implementation over the in-process `Engine`.

The server talks to the engine only through `GenerationBackend`: `LocalEngineBackend` runs the
engine in this process (its core in a thread), `EngineProcessBackend` (engine_process.py) in a
process of its own behind a msgspec channel. The HTTP side owns tokenization and chat templating;
the engine side owns scheduling, the model and grammar compilation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any, Protocol

from radixlm.errors import GrammarRefused
from radixlm.protocol.prompt_tokens import encode_prompt, text_ids
from radixlm.protocol.stats import EngineStats
from radixlm.server.errors import unavailable

# How long /metrics and /server_info wait for the engine's stats: an engine stuck in a step (or a
# stopped engine process) must not hold up the server's own metrics.
ENGINE_STATS_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ModelInfo:
    name: str  # a short default for the served model name
    model_path: str
    tokenizer_path: str
    context_len: int
    vocab_size: int
    chat_template_has_tools: bool
    kv_capacity_tokens: int | None = None  # the most tokens one request can hold in the KV pool
    chat_template: str | None = None  # the tokenizer's Jinja template, for remote program clients
    # the most characters one token can stand for: a text longer than context x this cannot fit
    max_token_chars: int | None = None


class GenerationBackend(Protocol):
    """The engine as the server sees it.

    `stream` validates its arguments when awaited (raising ValueError for bad input, before any
    work is queued; `GrammarRefused`, a ValueError, for a grammar the engine refuses or could not
    compile in time) and returns an async iterator of cumulative snapshots
    `{"text", "output_ids", "meta_info"}`; the request starts when the iterator is first advanced
    and is aborted if the iterator is closed before its last snapshot.
    """

    def model_info(self) -> ModelInfo: ...

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...

    def token_texts(self, ids: list[int]) -> list[str]: ...

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str: ...

    async def stream(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        *,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        priority: int | None = None,
    ) -> AsyncIterator[dict[str, Any]]: ...

    async def flush_cache(self) -> bool: ...

    async def freeze_gc(self) -> None: ...

    async def stats(self) -> EngineStats | Mapping[str, Any]: ...

    async def start_profile(self, output_dir: str) -> None: ...

    async def stop_profile(self) -> str: ...

    def engine_config(self) -> dict[str, Any]: ...

    def is_alive(self) -> bool: ...

    def shutdown(self) -> None: ...


async def engine_stats(backend: GenerationBackend) -> EngineStats:
    """The engine's stats, or a 503 if it does not answer within ENGINE_STATS_TIMEOUT_S."""
    timeout = ENGINE_STATS_TIMEOUT_S
    try:
        stats = await asyncio.wait_for(backend.stats(), timeout)
        return stats if isinstance(stats, EngineStats) else EngineStats.from_dict(stats)
    except (TimeoutError, asyncio.TimeoutError):
        raise unavailable(
            f"the engine did not answer within {timeout:g} s: it is stuck or very busy "
            "(/metrics still reports the server's own metrics)"
        ) from None


class TokenizerSide:
    """The text work of the HTTP side over a Hugging Face tokenizer: tokenizing prompts,
    rendering chats, decoding token ids for logprob texts and tool-call parsing."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._token_text: dict[int, str] = {}

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of a text prompt as the engine tokenizes one; without `add_special_tokens`,
        the text's own tokens only (no BOS put in front)."""
        if not add_special_tokens:
            return text_ids(self._tokenizer, text)
        return encode_prompt(self._tokenizer, text)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_texts(self, ids: list[int]) -> list[str]:
        out = []
        for token in ids:
            text = self._token_text.get(token)
            if text is None:
                text = self._tokenizer.decode([token], skip_special_tokens=False)
                self._token_text[token] = text
            out.append(text)
        return out

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt of a chat: the template's text with the generation prompt; `template_kwargs`
        become template variables (e.g. `enable_thinking`)."""
        kwargs = dict(template_kwargs or {})
        if tools:
            kwargs["tools"] = tools
        return self._tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **kwargs
        )


def _longest_token(tokenizer: Any) -> int | None:
    """The longest token's spelling in the vocabulary, in characters: an upper bound on what one
    token decodes to (a byte-level token's spelling has a character a byte; None if unknown)."""
    try:
        return max(map(len, tokenizer.get_vocab()))
    except Exception:  # a tokenizer without a vocabulary to list
        return None


class LocalEngineBackend(TokenizerSide):
    """`GenerationBackend` over an in-process `radixlm.Engine` (whose core runs in a thread)."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine.tokenizer)
        self._engine = engine
        self._stats_call: asyncio.Future[EngineStats] | None = None
        template = getattr(engine.tokenizer, "chat_template", None) or ""
        config = engine.config
        self._info = ModelInfo(
            name=_model_name(config.model_path, engine.model_folder, config.cache_dir),
            model_path=str(config.model_path or engine.model_folder),
            tokenizer_path=str(config.tokenizer_path or config.model_path or engine.model_folder),
            context_len=int(engine.context_len),
            vocab_size=int(engine.model_config.vocab_size),
            chat_template_has_tools=isinstance(template, str) and "tools" in template,
            chat_template=template if isinstance(template, str) else None,
            kv_capacity_tokens=engine.get_stats().get("kv_pool_capacity_tokens"),
            max_token_chars=_longest_token(engine.tokenizer),
        )

    def model_info(self) -> ModelInfo:
        return self._info

    async def stream(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        *,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        priority: int | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        try:
            return await self._engine.async_generate(
                input_ids=input_ids,
                sampling_params=sampling_params,
                return_logprob=return_logprob,
                logprob_start_len=logprob_start_len,
                top_logprobs_num=top_logprobs_num,
                stream=True,
                priority=priority,
            )
        except ValueError as e:
            # (imported here: the grammar code brings torch, loaded already with the engine)
            from radixlm.constrained.errors import GrammarError

            if isinstance(e, GrammarError):
                raise GrammarRefused(str(e)) from e
            raise

    async def flush_cache(self) -> bool:
        # the engine answers between two steps of its core thread: wait off the event loop
        return await asyncio.to_thread(self._engine.flush_cache)

    async def freeze_gc(self) -> None:
        await asyncio.to_thread(self._engine.freeze_gc)

    async def stats(self) -> EngineStats:
        # concurrent callers share one call: a stuck core then holds one worker thread, not one
        # for each caller that gave up waiting
        call = self._stats_call
        if call is None or call.done() or call.get_loop() is not asyncio.get_running_loop():
            call = asyncio.ensure_future(asyncio.to_thread(self._engine.get_stats))
            self._stats_call = call
        return await asyncio.shield(call)

    async def start_profile(self, output_dir: str) -> None:
        await asyncio.to_thread(self._engine.start_profile, output_dir)

    async def stop_profile(self) -> str:
        return await asyncio.to_thread(self._engine.stop_profile)

    def engine_config(self) -> dict[str, Any]:
        config = self._engine.config
        values = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else {}
        values["device"] = str(self._engine.device)
        values["dtype"] = str(self._engine.dtype).removeprefix("torch.")
        values["context_length"] = self._info.context_len
        return values

    def is_alive(self) -> bool:
        return self._engine.is_alive()

    def shutdown(self) -> None:
        self._engine.shutdown()


def _model_name(model_path: str | None, folder: Any, cache_dir: str | None) -> str:
    """`Qwen2.5-0.5B-Instruct` for a folder or a GGUF file of that name; for a model converted
    into the cache (the embedded default, a GGUF), its folder's name less the quantization and
    the cache's hash suffix."""
    path = PurePath(str(model_path or folder))
    name = path.name
    if path.suffix == ".gguf":
        name = path.stem
    elif cache_dir and PurePath(str(folder)).parent == PurePath(cache_dir):
        name = re.sub(r"-[0-9a-f]{16}$", "", name)
    return re.sub(r"\.(Q\d\w*|F16|F32|BF16)$", "", name, flags=re.IGNORECASE) or str(path)
