"""What a drafter beside a tensor-parallel target reads of it. EAGLE, EAGLE-3 and Medusa drafts
run in rank 0's process alone and read the target's token embedding or LM head, of which each
rank holds a share of the vocabulary: rank 0 keeps a whole copy of both for them, read from the
checkpoint once more (the default model's, one tensor as its two are tied: 113 MB in float32)."""

from __future__ import annotations

import torch
from torch import nn


class WholeVocabTarget:
    """A tensor-parallel target as a drafter in rank 0's process reads it: with the whole token
    embedding and LM head, where each rank holds a share of the vocabulary (the drafter runs
    there alone, so it cannot take part in the ranks' collectives); everything else, the hidden
    states included (the residual stream, whole on every rank), is the target's own."""

    def __init__(self, target, embed_tokens: nn.Embedding, lm_head: nn.Linear) -> None:
        self._target = target
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head

    def __getattr__(self, name: str):
        return getattr(self._target, name)


def whole_vocab_target(target, folder, load_format: str, dtype, device, seed: int = 0):
    """`target` (one rank's part of a tensor-parallel model) seen with its whole token embedding
    and LM head, read once more from the checkpoint in `folder` (random ones for load_format
    dummy, as each rank's own part is); ValueError where the checkpoint holds them quantized."""
    cfg = target.cfg
    shape = (cfg.vocab_size, cfg.hidden_size)
    if load_format == "dummy":
        gen = torch.Generator().manual_seed(seed)
        embedding = torch.empty(shape).normal_(0.0, 0.02, generator=gen)
        head = (
            embedding
            if cfg.tie_word_embeddings
            else torch.empty(shape).normal_(0.0, 0.02, generator=gen)
        )
    else:
        from radixlm.runtime.model_loader import checkpoint_tensors

        found = checkpoint_tensors(folder, ("model.embed_tokens.weight", "lm_head.weight"))
        embedding = found.get("model.embed_tokens.weight")
        head = embedding if cfg.tie_word_embeddings else found.get("lm_head.weight")
        for name, tensor in (("embed_tokens", embedding), ("lm_head", head)):
            if tensor is None or tuple(tensor.shape) != shape or not tensor.is_floating_point():
                raise ValueError(
                    f"speculative decoding with EAGLE or MEDUSA under tp_size > 1 reads the "
                    f"model's whole {name} from its checkpoint, {shape} in floats: "
                    f"{'absent' if tensor is None else f'{tuple(tensor.shape)} {tensor.dtype}'} "
                    f"in {folder}"
                )
            if tensor.element_size() < 2:  # (float8: a scale would be needed)
                raise ValueError(
                    f"speculative decoding with EAGLE or MEDUSA under tp_size > 1 needs the "
                    f"checkpoint's {name} unquantized; it is {tensor.dtype}"
                )
    embed_tokens = nn.Embedding(*shape, device=device, dtype=dtype)
    lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=device, dtype=dtype)
    with torch.no_grad():
        embed_tokens.weight.copy_(embedding)
        if cfg.tie_word_embeddings:
            lm_head.weight = embed_tokens.weight
        else:
            lm_head.weight.copy_(head)
    for module in (embed_tokens, lm_head):
        module.requires_grad_(False)
    return WholeVocabTarget(target, embed_tokens.eval(), lm_head.eval())
