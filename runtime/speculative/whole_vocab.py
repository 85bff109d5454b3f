"""What a drafter beside a split target reads of it. EAGLE, EAGLE-3 and Medusa drafts run in rank
0's process alone and read the target's token embedding or LM head, of which each tensor-parallel
rank holds a share of the vocabulary (and a pipeline's first stage no LM head at all): rank 0 keeps a whole copy of what its drafter reads, read
from the checkpoint once more (the default model's, one tensor as its two are tied: 113 MB in
float32; an 8B model's, untied, 1 GB each in bfloat16)."""

from __future__ import annotations

import torch
from torch import nn


class WholeVocabTarget:
    """A tensor-parallel target as a drafter in rank 0's process reads it: with the whole token
    embedding and LM head, where each rank holds a share of the vocabulary (the drafter runs
    there alone, so it cannot take part in the ranks' collectives); everything else, the hidden
    states included (the residual stream, whole on every rank), is the target's own."""

    def __init__(
        self, target, embed_tokens: nn.Embedding | None, lm_head: nn.Linear | None
    ) -> None:
        self._target = target
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head

    def __getattr__(self, name: str):
        return getattr(self._target, name)


def whole_vocab_target(
    target,
    folder,
    load_format: str,
    dtype,
    device,
    seed: int = 0,
    parts: tuple[str, ...] = ("embed_tokens", "lm_head"),
    cfg=None,
):
    """`target` (one rank's part of a tensor-parallel model) seen with its whole token embedding
    and LM head (those of `parts` the drafter reads; None for the other), read once more from the
    checkpoint in `folder` (random ones for load_format dummy, as each rank's own part is);
    ValueError where the checkpoint lacks them or holds them quantized. `cfg`: the whole model's
    config (default the target's; a pipeline stage's own says nothing of a tied head)."""
    cfg = cfg or target.cfg
    shape = (cfg.vocab_size, cfg.hidden_size)
    tied = cfg.tie_word_embeddings
    if load_format == "dummy":
        gen = torch.Generator().manual_seed(seed)
        embedding = torch.empty(shape).normal_(0.0, 0.02, generator=gen)
        head = embedding if tied else torch.empty(shape).normal_(0.0, 0.02, generator=gen)
    else:
        from radixlm.runtime.model_loader import checkpoint_tensors

        names = ("model.embed_tokens.weight", "embed_tokens.weight", "lm_head.weight",
                 "model.lm_head.weight")  # fmt: skip
        found = {n.removeprefix("model."): t for n, t in checkpoint_tensors(folder, names).items()}
        embedding = found.get("embed_tokens.weight")
        head = embedding if tied else found.get("lm_head.weight")
        wanted = {"embed_tokens": embedding, "lm_head": head}
        for name in parts:
            tensor = wanted[name]
            if tensor is None or tuple(tensor.shape) != shape or not tensor.is_floating_point():
                got = "absent (or stored quantized)" if tensor is None else (
                    f"{tuple(tensor.shape)} {tensor.dtype}"
                )  # fmt: skip
                raise ValueError(
                    f"speculative decoding with EAGLE or MEDUSA under tp_size > 1 reads the "
                    f"model's whole {name} from its checkpoint, {shape} in floats: {got} in "
                    f"{folder}"
                )
            if tensor.element_size() < 2:  # (float8: a scale would be needed)
                raise ValueError(
                    f"speculative decoding with EAGLE or MEDUSA under tp_size > 1 needs the "
                    f"checkpoint's {name} unquantized; it is {tensor.dtype}"
                )
    embed_tokens = lm_head = None
    with torch.no_grad():
        if "embed_tokens" in parts or ("lm_head" in parts and tied):
            embed_tokens = nn.Embedding(*shape, device=device, dtype=dtype)
            embed_tokens.weight.copy_(embedding)
            embed_tokens.requires_grad_(False).eval()
        if "lm_head" in parts:
            lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=device,
                                dtype=dtype)  # fmt: skip
            if tied:
                lm_head.weight = embed_tokens.weight
            else:
                lm_head.weight.copy_(head)
            lm_head.requires_grad_(False).eval()
    return WholeVocabTarget(target, embed_tokens, lm_head)


def drafter_parts(config) -> tuple[str, ...]:
    """What of the target's vocabulary rows `config`'s drafter reads: Medusa's heads its LM head;
    an EAGLE-1/2 draft both; an EAGLE-3 draft the embedding (unless its checkpoint has its own),
    and the LM head only to find the draft that ships for the model (no path given)."""
    algorithm = config.speculative_algorithm
    if algorithm == "MEDUSA":
        return ("lm_head",)
    if algorithm == "EAGLE3" and config.speculative_draft_model_path is not None:
        return ("embed_tokens",)
    return ("embed_tokens", "lm_head")
