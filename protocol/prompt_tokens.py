"""How a text prompt becomes token ids, the same wherever a prompt is tokenized (the engine, the
server, the program DSL's scoring of choices).

Special tokens written in the text (a chat template's markers) are recognised. A tokenizer that
adds a BOS token to what it encodes (Llama's) gets it in front, as SGLang's and vLLM's servers
give it, unless the text already starts with it (a rendered chat template that writes it).
"""

from __future__ import annotations

import functools
from typing import Any


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    ids = text_ids(tokenizer, text)
    bos = _added_bos(tokenizer)
    if bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    return ids


@functools.lru_cache(maxsize=16)
def _added_bos(tokenizer: Any) -> int | None:
    """The BOS id the tokenizer puts in front of what it encodes with its special tokens; None if
    it adds none (SmolLM2's, Qwen's)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    plain = text_ids(tokenizer, "a")
    special = list(tokenizer.encode("a", add_special_tokens=True))
    return bos if special[:1] == [bos] and plain[:1] != [bos] else None


def text_ids(tokenizer: Any, text: str) -> list[int]:
    """`tokenizer.encode(text, add_special_tokens=False)`, through the Rust tokenizer's one-text
    encode where that is the same (a fast tokenizer set to neither truncate nor pad, splitting
    special tokens as the Python side says). Hugging Face's `encode` goes through `encode_batch`,
    which lets the GIL go and then waits to get it back: whenever another thread runs Python
    (the engine core, a grammar compile, the server's event loop), up to the interpreter's switch
    interval, 5 ms, for a few tens of microseconds of work. The one-text encode keeps it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (
        backend is not None
        and backend.truncation is None
        and backend.padding is None
        and backend.encode_special_tokens == bool(getattr(tokenizer, "split_special_tokens", False))
    ):
        return backend.encode(text, add_special_tokens=False).ids
    return list(tokenizer.encode(text, add_special_tokens=False))
