"""Llama-family decoders (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3), written once.

Differences between the members are flags of `ModelConfig`: Qwen2 has q/k/v biases, Qwen3 has an
RMSNorm on q and k per head. q/k/v and gate/up projections are fused into one matmul each at load.

Under tensor parallelism each rank builds this model over its `Partition` (runtime/parallel.py): its
heads, its slice of the MLP and of the vocabulary; the row-parallel projections' `reduce` and the LM
head's `gather` are the only places the ranks meet. With one rank they do nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import nn

from radixlm.runtime.forward_batch import ForwardBatch
from radixlm.runtime.layers import PlainMatmuls, RMSNorm, RopeInputs, RotaryEmbedding
from radixlm.runtime.model_config import ModelConfig
from radixlm.runtime.parallel import (
    ColumnParallelLinear,
    Comm,
    ParallelLMHead,
    Partition,
    RowParallelLinear,
    VocabParallelEmbedding,
    shard_for,
)
from radixlm.runtime.quantization.base import scheme_of

# a checkpoint's projection -> (our fused parameter holding it, its index in the fused order)
STACKED_PARTS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class FusableMatmul(NamedTuple):
    """A matmul that runs with the op before it (see `PlainMatmuls`): op is "rms_norm",
    "rms_norm_residual" (`norm` set) or "silu_and_mul"."""

    op: str
    linear: nn.Linear
    norm: RMSNorm | None


class Attention(nn.Module):
    matmul = PlainMatmuls()  # replaced by a runtime.matmul_dispatch.LinearDispatch on CUDA

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: Partition, comm: Comm) -> None:
        super().__init__()
        self.layer_id = layer_id
        # (this rank's heads)
        self.num_heads, self.num_kv_heads, self.head_dim = (
            tp.num_heads,
            tp.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        q, kv = tp.q_part(cfg), tp.kv_part(cfg)
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [q, kv, kv], cfg.attention_bias)
        self.o_proj = RowParallelLinear(q, cfg.hidden_size, comm)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        rope: RopeInputs,
        qkv: torch.Tensor,
        batch: ForwardBatch,
        backend,
    ) -> torch.Tensor:
        """qkv (T, q + 2 kv) is qkv_proj's output, which the layer computes with its input norm."""
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            q.copy_(self.q_norm(q))  # (in place: views of qkv)
            k.copy_(self.k_norm(k))
        if rope.positions is not None and backend.rotates_qk:
            # the backend rotates q and k as it stores k and v: one kernel
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            o = backend.forward(q, k, v, self.layer_id, batch, self.scale, rope=rope)
        else:
            # q and k heads rotate together: one rope for both
            q, k = RotaryEmbedding.apply(rope, qk).split([self.num_heads, self.num_kv_heads], dim=1)
            o = backend.forward(q, k, v, self.layer_id, batch, self.scale)  # (T, Hq, D)
        return self.o_proj.reduce(self.matmul(o.reshape(-1, self.q_size), self.o_proj))


class MLP(nn.Module):
    matmul = PlainMatmuls()

    def __init__(self, cfg: ModelConfig, tp: Partition, comm: Comm) -> None:
        super().__init__()
        part = tp.intermediate_part(cfg)
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [part, part], bias=False)
        self.down_proj = RowParallelLinear(part, cfg.hidden_size, comm)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up (T, 2 intermediate) is gate_up_proj's output, which the layer computes with its
        norm."""
        return self.down_proj.reduce(self.matmul.silu_linear(gate_up, self.down_proj))


class DecoderLayer(nn.Module):
    matmul = PlainMatmuls()

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: Partition, comm: Comm) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id, tp, comm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp, comm)

    def forward(self, rope, x, residual, batch, backend):
        # each norm runs with the matmul after it: one kernel where the dispatch fuses them
        attn, mlp = self.self_attn, self.mlp
        qkv, residual = self.matmul.norm_linear(x, residual, self.input_layernorm, attn.qkv_proj)
        x = attn(rope, qkv, batch, backend)
        gate_up, residual = self.matmul.norm_linear(
            x, residual, self.post_attention_layernorm, mlp.gate_up_proj
        )
        return mlp(gate_up), residual

    def fusable_matmuls(self, first: bool) -> list[FusableMatmul]:
        return [
            FusableMatmul(
                "rms_norm" if first else "rms_norm_residual",
                self.self_attn.qkv_proj,
                self.input_layernorm,
            ),
            FusableMatmul(
                "rms_norm_residual", self.mlp.gate_up_proj, self.post_attention_layernorm
            ),
            FusableMatmul("silu_and_mul", self.mlp.down_proj, None),
        ]


def layer_input(x: torch.Tensor, residual: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    """The residual stream entering a decoder layer at `rows` (what an EAGLE-3 draft reads of
    it): the layer before's output plus its residual, or the embedding before the first."""
    return x[rows] if residual is None else x[rows] + residual[rows]


class LlamaForCausalLM(nn.Module):
    matmul = PlainMatmuls()

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        sampled_vocab: int | None = None,
        tp: Partition | None = None,
        comm: Comm | None = None,
    ) -> None:
        """`tp` and `comm`: this rank's part of the model and its group's collectives (default:
        the whole model, on one device)."""
        super().__init__()
        self.cfg = cfg
        tp = Partition.whole(cfg) if tp is None else tp
        comm = Comm() if comm is None else comm
        # one rope table, looked up once a step for all layers (kept out of the state dict)
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = VocabParallelEmbedding(tp.vocab_part(), cfg.hidden_size, comm)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp, comm) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.hidden_size, tp.vocab_part(), cfg.vocab_size, comm)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # logit columns from `sampled_vocab` on are ids no token has (a checkpoint's vocabulary
        # padded past its tokenizer's, e.g. Qwen2.5's 151,936 rows for 151,665 tokens): -inf,
        # never sampled
        self.sampled_vocab = cfg.vocab_size if sampled_vocab is None else sampled_vocab

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, backend) -> torch.Tensor:
        """Logits (L, vocab) in float32 for the rows `batch.logits_indices` (None: every row)."""
        x = self.embed_tokens(batch.input_ids)
        rope = self.rope.lookup(batch.positions)
        residual = None
        keep = batch.hidden_indices
        aux: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if keep is not None and i in batch.aux_layers:  # (an EAGLE-3 draft's features)
                aux[i] = layer_input(x, residual, keep)
            x, residual = layer(rope, x, residual, batch, backend)
        last = len(self.layers)
        if keep is not None and last in batch.aux_layers:  # (an EAGLE draft's: the final norm's)
            aux[last] = self.final_hidden(x, residual, keep)
        if aux:  # an EAGLE draft's (in the order asked for; a layer named twice, twice)
            batch.aux_hidden_states = torch.cat([aux[i] for i in batch.aux_layers], dim=-1)
        elif keep is not None:  # MEDUSA's
            batch.hidden_states = self.final_hidden(x, residual, keep)
        return self.logits(x, residual, batch)

    def logits(
        self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> torch.Tensor:
        """The last layer's output -> logits (L, vocab) in float32 at `batch.logits_indices`
        (the last pipeline stage calls this on its own: runtime/pipeline.py)."""
        logits, _ = self.matmul.norm_linear(
            x, residual, self.norm, self.lm_head, rows=batch.logits_indices, float32=True
        )
        logits = self.lm_head.gather(logits)
        if self.sampled_vocab < logits.shape[-1]:
            logits[:, self.sampled_vocab :] = float("-inf")
        return logits

    def final_hidden(
        self, x: torch.Tensor, residual: torch.Tensor | None, rows: torch.Tensor
    ) -> torch.Tensor:
        """The last norm's output at `rows` (what the LM head reads): (len(rows), hidden)."""
        if residual is None:
            return self.norm(x[rows])
        return self.norm(x[rows], residual[rows])[0]

    def linears(self) -> list[nn.Linear]:
        return [m for m in self.modules() if isinstance(m, nn.Linear)]

    def fusable_matmuls(self) -> list[FusableMatmul]:
        """Every matmul that runs with the op before it, in order (for tuning the fused kernels)."""
        out = [m for i, layer in enumerate(self.layers) for m in layer.fusable_matmuls(i == 0)]
        op = "rms_norm" if not self.layers else "rms_norm_residual"
        return [*out, FusableMatmul(op, self.lm_head, self.norm)]

    def use_matmul(self, matmul: PlainMatmuls) -> None:
        """Route every matmul through `matmul` (e.g. a tuned runtime.matmul_dispatch.LinearDispatch)."""
        for m in self.modules():
            if isinstance(m, (Attention, MLP, DecoderLayer, LlamaForCausalLM)):
                m.matmul = matmul

    # ---- weights -------------------------------------------------------------------------

    _STACKED = STACKED_PARTS

    def tie_weights_if_needed(self) -> None:
        # (a quantized head keeps its own weight: a GGUF's blocks of the embedding)
        if self.cfg.tie_word_embeddings and not scheme_of(self.lm_head).quantized:
            # moving off the meta device unties them
            self.lm_head.weight = self.embed_tokens.weight

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face named tensors into this model; every parameter must be covered."""
        self.tie_weights_if_needed()
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            target, offset_rows, index = name, None, None
            for part, (fused, i) in self._STACKED.items():
                if f".{part}." in name:
                    target, index = name.replace(part, fused), i
                    offset_rows = self._fused_rows(target, index)
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(f"unexpected weight {hf_name!r} for a {self.cfg.model_type} model")
            # (this rank's part of it: all of it on one device)
            module_name, _, leaf = target.rpartition(".")
            tensor = shard_for(self.get_submodule(module_name), tensor, index, leaf)
            with torch.no_grad():
                if offset_rows is None:
                    _check_shape(hf_name, param.shape, tensor.shape)
                    param.copy_(tensor)
                else:
                    start, end = offset_rows
                    _check_shape(hf_name, param[start:end].shape, tensor.shape)
                    param[start:end].copy_(tensor)
            loaded.add(f"{target}:{offset_rows}")
        expected = self._expected_loads()
        missing = sorted(hf for key, hf in expected.items() if key not in loaded)
        if missing:
            raise ValueError(
                f"checkpoint is missing weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}"
            )

    def _fused_rows(self, param_name: str, index: int) -> tuple[int, int]:
        """The rows of part `index` (q, k, v; gate, up) in a fused parameter, on this rank."""
        return self.get_submodule(param_name.rpartition(".")[0]).part_rows(index)

    def _expected_loads(self) -> dict[str, str]:
        """Each load the checkpoint must give (parameter:rows, as `load_weights` marks them) ->
        the checkpoint's name for it (a missing one is named as the checkpoint names it)."""
        out = {}
        for name, _ in self.named_parameters():
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            hf = name if name == "lm_head.weight" else f"model.{name}"
            fused = [(p, f, i) for p, (f, i) in self._STACKED.items() if f".{f}." in name]
            if fused:
                for part, fused_name, index in fused:
                    rows = self._fused_rows(name, index)
                    out[f"{name}:{rows}"] = hf.replace(fused_name, part)
            else:
                out[f"{name}:None"] = hf
        return out


def _check_shape(name: str, want: torch.Size, got: torch.Size) -> None:
    if tuple(want) != tuple(got):
        raise ValueError(f"weight {name!r} has shape {tuple(got)}, the model expects {tuple(want)}")
