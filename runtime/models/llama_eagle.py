"""An EAGLE-1/2 draft (Li et al., 2024) for a Llama-family target: one decoder layer over the
target's final hidden state, in the checkpoint layout of the EAGLE authors' releases (config.json
naming LlamaForCausalLM, pytorch_model.bin) and of SGLang's `LlamaForCausalLMEagle`
(speculative_algorithm="EAGLE").

The draft reads, at position t, the target's last hidden state there (the final norm's output:
what the target's LM head reads; ForwardBatch.aux_layers names it as layer `num_layers`) and the
embedding of token t + 1, and predicts token t + 2 through the target's own LM head:

    x      = fc(cat(embed(token), hidden))     (bias; every step, a draft step's own output too)
    s      = attention(x) + x                  (the layer has no input norm, as EAGLE's first)
    out    = mlp(post_attention_layernorm(s)) + s     the next draft step's `hidden`
    logits = lm_head(out)                      the target's LM head, no norm before it

The embedding and the LM head are the target's (a checkpoint's `embed_tokens` and `lm_head`
are copies of them and are not read: SGLang shares the target's too). The attention is the
model's own (runtime/attention.py backends over the draft's one-layer KV pool). The engine drafts
with it as with an EAGLE-3 draft (runtime/speculative/eagle3.py): chains, or trees with
speculative_eagle_topk above 1 (EAGLE-2's ranking of a tree's nodes by their path's
probability). `radixlm train-draft --algorithm EAGLE` makes one for a target
(runtime/speculative/eagle3_training.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from radixlm.runtime.forward_batch import ForwardBatch
from radixlm.runtime.layers import PlainMatmuls, RMSNorm, RotaryEmbedding, float32_linear
from radixlm.runtime.model_config import ModelConfig
from radixlm.runtime.models.eagle_draft import (
    OneLayerDraft,
    layer_config_for_target,
    one_layer_model,
    read_config,
)
from radixlm.runtime.models.llama import MLP, Attention
from radixlm.runtime.parallel import Comm, Partition

ARCHITECTURE = "LlamaForCausalLMEagle"


@dataclass(frozen=True)
class EagleConfig:
    """An EAGLE-1/2 draft's settings: its layer's shapes (`model`, a Llama config of one layer,
    the target's width and vocabulary) and whether fc has a bias."""

    model: ModelConfig
    fc_bias: bool
    architecture = ARCHITECTURE  # (what a config of this kind names)

    @property
    def draft_vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def features_size(self) -> int:
        """The width of the target features the draft reads at a position (its last hidden
        state)."""
        return self.model.hidden_size

    @classmethod
    def from_folder(cls, folder: str | Path) -> EagleConfig:
        """The config.json of an EAGLE checkpoint folder; ValueError saying what is not one."""
        return cls.from_dict(*read_config(folder, "EAGLE"))

    @classmethod
    def from_dict(cls, raw: dict, where: str = "the draft config") -> EagleConfig:
        names = raw.get("architectures") or []
        # (the EAGLE authors' releases name LlamaForCausalLM; SGLang's conversions the Eagle one)
        if ARCHITECTURE not in names and names != ["LlamaForCausalLM"]:
            raise ValueError(
                f"{where}: architectures {raw.get('architectures')} lack {ARCHITECTURE!r}; an "
                "EAGLE (EAGLE-1/2) draft's config names it, as SGLang reads it, or "
                "LlamaForCausalLM, as the EAGLE authors' releases do (an EAGLE-3 draft, "
                "LlamaForCausalLMEagle3, runs under speculative_algorithm=EAGLE3)"
            )
        model = one_layer_model(raw, where, "EAGLE")
        return cls(model=model, fc_bias=bool(raw.get("bias", True)))

    def target_layers(self, target: ModelConfig) -> tuple[int, ...]:
        """What the draft reads of the target: its final hidden state (layer `num_layers`,
        after the last). A draft made for another model (another width or vocabulary) is
        refused here, saying what does not match."""
        if self.model.hidden_size != target.hidden_size:
            raise ValueError(
                f"the EAGLE draft reads hidden states of size {self.model.hidden_size}; the "
                f"target model's are {target.hidden_size}: a draft made for another model"
            )
        if self.model.vocab_size != target.vocab_size:
            raise ValueError(
                f"the EAGLE draft's vocabulary ({self.model.vocab_size} tokens) is not the "
                f"target model's ({target.vocab_size}): a draft made for another model"
            )
        return (target.num_layers,)


def config_for_target(target: ModelConfig, intermediate_size: int | None = None) -> dict:
    """The config.json of a new EAGLE draft for `target`: a layer of the target's width and
    heads, its MLP `intermediate_size` wide (default: the target's)."""
    return {**layer_config_for_target(target, ARCHITECTURE, intermediate_size), "bias": True}


class EagleLayer(nn.Module):
    """The draft's decoder layer: a Llama layer without the input norm."""

    matmul = PlainMatmuls()

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        tp, comm = Partition.whole(cfg), Comm()
        self.self_attn = Attention(cfg, 0, tp, comm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp, comm)

    def forward(self, rope, x, batch, backend) -> torch.Tensor:
        """The layer's output plus its residual stream: the next draft step's hidden."""
        a = self.self_attn(rope, self.matmul(x, self.self_attn.qkv_proj), batch, backend)
        gate_up, summed = self.matmul.norm_linear(
            a, x, self.post_attention_layernorm, self.mlp.gate_up_proj
        )
        return self.mlp(gate_up) + summed


class LlamaEagleDraft(OneLayerDraft):
    """An EAGLE-1/2 draft over the KV pool of its one layer (layer id 0), reading the target's
    embedding and LM head (`share_target`)."""

    kind = "EAGLE"
    config_class = EagleConfig

    def __init__(self, config: EagleConfig, max_positions: int) -> None:
        super().__init__()
        cfg = config.model
        self.config = config
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=config.fc_bias)
        self.layers = nn.ModuleList([EagleLayer(cfg)])
        self._head: list[nn.Module] = []  # the target's LM head (not a submodule: `_shared`'s way)

    def share_target(self, target: nn.Module) -> None:
        """Read the target's token embedding and LM head."""
        self.share_embedding(target.embed_tokens)
        self._head = [target.lm_head]

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, backend, hidden: torch.Tensor, from_target: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's token (batch.input_ids) at its position, with `hidden`: the target's final
        hidden state (T, hidden) or a draft step's own output (the same to this draft, which
        puts both through fc; `from_target` is the EAGLE-3 draft's distinction) -> (logits (L,
        vocab) float32 at batch.logits_indices; every row's output (T, hidden), the next draft
        step's `hidden`)."""
        x = self.fc(torch.cat([self.embed_tokens(batch.input_ids), hidden], dim=-1))
        rope = self.rope.lookup(batch.positions)
        out = self.layers[0](rope, x, batch, backend)
        rows = out if batch.logits_indices is None else out[batch.logits_indices]
        return self.logits(rows), out

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """The target's LM head over the draft's outputs (float32)."""
        if not self._head:
            raise RuntimeError("the EAGLE draft needs the target's LM head: share_target")
        head = self._head[0]
        out = float32_linear(rows, head)
        return head.gather(out) if hasattr(head, "gather") else out

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids are the target's (one vocabulary)."""
        return draft_ids

    def share_head(self, head: nn.Module) -> None:
        """Read logits through `head` (training: a frozen float copy of the target's)."""
        self._head = [head]

    @property
    def layer(self) -> EagleLayer:
        return self.layers[0]

    def _checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> str | None:
        """The checkpoint's `embed_tokens` and `lm_head` are the target's: not read."""
        name = name.removeprefix("model.")
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return None
        return name
