"""An EAGLE-3 draft (Li et al., 2025) for a Llama-family target: one decoder layer that reads the
target's own features, in the checkpoint layout SGLang's `LlamaForCausalLMEagle3` reads.

The target keeps, for each token it runs, the residual stream entering three of its layers (a
low, a middle and a high one: `aux_layers`; ForwardBatch.aux_layers), side by side: 3 x the
target's hidden size. The draft reads, at position t, those features of the target at t and the
embedding of token t + 1, and predicts token t + 2:

    hidden = fc(features)                     (target features; a draft step's own output needs no fc)
    a      = attention(cat(input_layernorm(embed(token)), hidden_norm(hidden)))   q/k/v from 2 x hidden
    s      = a + hidden;  m = mlp(post_attention_layernorm(s))
    out    = m + s                            the next draft step's `hidden`
    logits = lm_head(norm(out))               over the draft's vocabulary (`draft_vocab_size`)

A draft id d is the target's id d + d2t[d] (a draft vocabulary of the target's most frequent
tokens); without `d2t` the two vocabularies are the same. The attention is the model's own
(runtime/attention.py backends over the draft's own KV pool, a one-layer model's), so the draft
attends over every position it has run: the context, from the target's features, then its own
draft steps. The embedding is the target's unless the checkpoint carries its own.

`save` writes the checkpoint `load` reads; `radixlm train-draft --algorithm EAGLE3` makes a
draft for a target and trains it with training-time test (runtime/speculative/eagle3_training.py
`new_draft`, `ttt_forward`); the engine drafts with it under `speculative_algorithm="EAGLE3"`
(runtime/speculative/eagle3.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from radixlm.runtime.forward_batch import ForwardBatch
from radixlm.runtime.layers import PlainMatmuls, RMSNorm, RotaryEmbedding
from radixlm.runtime.model_config import ModelConfig
from radixlm.runtime.models.eagle_draft import (
    OneLayerDraft,
    layer_config_for_target,
    one_layer_model,
    read_config,
)
from radixlm.runtime.models.llama import MLP, Attention
from radixlm.runtime.parallel import ColumnParallelLinear, Comm, Partition

ARCHITECTURE = "LlamaForCausalLMEagle3"


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """The target layers whose input the draft reads when its config names none: a low, the
    middle and a high one, SGLang's choice for EAGLE-3 (2, L/2, L - 3), kept within a target of
    fewer than five layers."""
    return (min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0))


@dataclass(frozen=True)
class Eagle3Config:
    """An EAGLE-3 draft's settings: its layer's shapes (`model`, a Llama config of one layer),
    the target hidden size its features have, its vocabulary, and which target layers feed it."""

    model: ModelConfig
    target_hidden_size: int
    draft_vocab_size: int
    fc_bias: bool
    aux_layers: tuple[int, ...] | None  # None: `default_aux_layers` of the target
    architecture = ARCHITECTURE  # (what a config of this kind names)

    @property
    def features_size(self) -> int:
        """The width of the target features the draft reads at a position (three layers')."""
        return 3 * self.target_hidden_size

    @classmethod
    def from_folder(cls, folder: str | Path) -> Eagle3Config:
        """The config.json of an EAGLE-3 checkpoint folder; ValueError saying what is not one."""
        return cls.from_dict(*read_config(folder, "EAGLE-3"))

    @classmethod
    def from_dict(cls, raw: dict, where: str = "the draft config") -> Eagle3Config:
        if ARCHITECTURE not in (raw.get("architectures") or []):
            raise ValueError(
                f"{where}: architectures {raw.get('architectures')} lack {ARCHITECTURE!r}; "
                "an EAGLE-3 draft's config names it (as SGLang's and SpecForge's do)"
            )
        model = one_layer_model(raw, where, "EAGLE-3")
        ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        return cls(
            model=model,
            target_hidden_size=int(raw.get("target_hidden_size") or model.hidden_size),
            draft_vocab_size=int(raw.get("draft_vocab_size") or model.vocab_size),
            fc_bias=bool(raw.get("bias", False)),
            # a layer's output is the next layer's input: the layer after each one named
            aux_layers=None if ids is None else tuple(int(i) + 1 for i in ids),
        )

    def target_layers(self, target: ModelConfig) -> tuple[int, ...]:
        """The target layers whose input the draft reads, checked against the target: a draft
        made for another model (another hidden size, vocabulary or depth) is refused here,
        saying what does not match."""
        if self.target_hidden_size != target.hidden_size:
            raise ValueError(
                f"the EAGLE-3 draft reads features of hidden size {self.target_hidden_size}; "
                f"the target model's is {target.hidden_size}: a draft made for another model"
            )
        if self.model.vocab_size != target.vocab_size or self.draft_vocab_size > target.vocab_size:
            raise ValueError(
                f"the EAGLE-3 draft's vocabulary ({self.model.vocab_size} tokens, drafting "
                f"{self.draft_vocab_size}) is not the target model's ({target.vocab_size})"
            )
        layers = self.aux_layers or default_aux_layers(target.num_layers)
        if len(layers) != 3 or not all(0 <= i < target.num_layers for i in layers):
            raise ValueError(
                f"the EAGLE-3 draft reads the input of target layers {list(layers)}; the target "
                f"has {target.num_layers} layers (three of them must be named)"
            )
        return layers


def config_for_target(
    target: ModelConfig,
    aux_layers: tuple[int, ...] | None = None,
    draft_vocab_size: int | None = None,
    intermediate_size: int | None = None,
) -> dict:
    """The config.json of a new draft for `target`: a layer of the target's width and heads
    (its MLP `intermediate_size` wide, default the target's), drafting `draft_vocab_size` of its
    tokens (default: all), reading the input of `aux_layers` (default: SGLang's three)."""
    layers = aux_layers or default_aux_layers(target.num_layers)
    return {
        **layer_config_for_target(target, ARCHITECTURE, intermediate_size),
        "draft_vocab_size": draft_vocab_size or target.vocab_size,
        "target_hidden_size": target.hidden_size,
        # (named as SGLang names them: the layers whose output is read)
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in layers]},
    }


class Eagle3Layer(nn.Module):
    """The draft's decoder layer: attention over the normed embedding and hidden side by side."""

    matmul = PlainMatmuls()

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        tp, comm = Partition.whole(cfg), Comm()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, 0, tp, comm)
        q, kv = tp.q_part(cfg), tp.kv_part(cfg)
        self.self_attn.qkv_proj = ColumnParallelLinear(
            2 * cfg.hidden_size, [q, kv, kv], cfg.attention_bias
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp, comm)

    def forward(self, rope, embeds, hidden, batch, backend) -> torch.Tensor:
        """The layer's output plus its residual stream: the next draft step's hidden."""
        both = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        x = self.self_attn(rope, self.matmul(both, self.self_attn.qkv_proj), batch, backend)
        gate_up, summed = self.matmul.norm_linear(
            x, hidden, self.post_attention_layernorm, self.mlp.gate_up_proj
        )
        return self.mlp(gate_up) + summed


class LlamaEagle3Draft(OneLayerDraft):
    """An EAGLE-3 draft over the KV pool of its one layer (layer id 0). Its token embeddings
    are the target's (`share_target`) unless the checkpoint carried its own."""

    kind = "EAGLE-3"
    config_class = Eagle3Config

    def __init__(self, config: Eagle3Config, max_positions: int) -> None:
        super().__init__()
        cfg = config.model
        self.config = config
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.fc = nn.Linear(3 * config.target_hidden_size, cfg.hidden_size, bias=config.fc_bias)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, config.draft_vocab_size, bias=False)
        # draft id -> target id offset (0 where the vocabularies are one)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, backend, hidden: torch.Tensor, from_target: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's token (batch.input_ids) at its position, with `hidden`: the target's
        features (T, 3 x target hidden; `from_target`, through fc) or a draft step's own output
        (T, hidden) -> (logits (L, draft vocab) float32 at batch.logits_indices; every row's
        output (T, hidden), the next draft step's `hidden`)."""
        if from_target:
            hidden = self.fc(hidden)
        rope = self.rope.lookup(batch.positions)
        out = self.midlayer(rope, self.embed_tokens(batch.input_ids), hidden, batch, backend)
        rows = out if batch.logits_indices is None else out[batch.logits_indices]
        return self.lm_head(self.norm(rows)).float(), out

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft vocabulary ids -> the target's."""
        return draft_ids + self.d2t[draft_ids]

    @property
    def layer(self) -> Eagle3Layer:
        return self.midlayer

    # ---- weights (`OneLayerDraft.load_weights`, `save`) ----------------------------------------

    def _checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> str | None:
        """`t2d` is not needed; `d2t` is kept; an `embed_tokens` of its own replaces the
        target's."""
        name = name.removeprefix("model.").replace("midlayers.0.", "midlayer.")
        if name == "t2d":
            return None
        if name == "d2t":
            self.d2t.copy_(tensor.long())
            return None
        if name == "embed_tokens.weight":
            self._take_embedding(tensor)
            return None
        return name

    def _saved_extra(self) -> dict[str, torch.Tensor]:
        return {"d2t": self.d2t}
