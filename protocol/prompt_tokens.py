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
    ids = list(tokenizer.encode(text, add_special_tokens=False))
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
    plain = list(tokenizer.encode("a", add_special_tokens=False))
    special = list(tokenizer.encode("a", add_special_tokens=True))
    return bos if special[:1] == [bos] and plain[:1] != [bos] else None
