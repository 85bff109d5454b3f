"""Tensor parallelism, the model's side: which part of the model a rank holds, the layers that hold
it, and the collectives that join the parts (Megatron-style).

- q/k/v and gate/up are column-parallel: each rank computes its own heads and its own slice of
  the MLP's intermediate features, with no communication.
- o_proj and down_proj are row-parallel: each rank multiplies its slice of the input features,
  giving a partial sum of the whole output; one all-reduce adds them (`RowParallelLinear.reduce`).
- The vocabulary is split by rows (padded to a multiple of the ranks): the embedding looks up the
  ids its rows hold, zero elsewhere, and all-reduces; the LM head computes its rows' logits, which
  are all-gathered so that every rank holds the whole row (rank 0 samples from it; the others
  need it only where a CUDA graph takes the argmax into its token buffer).
- KV heads are split in contiguous groups, each rank holding the query heads that attend to its
  KV heads (an uneven split where the heads do not divide: SmolLM2-135M's 3 KV heads on 2 ranks);
  with fewer KV heads than ranks, each KV head is replicated on tp_size / num_kv_heads ranks,
  which split its query heads.

With one rank (`Partition.whole`, `Comm`) every layer is the plain one and no collective runs:
the single-device model is this code too. Process groups, the step channel and the other ranks'
processes are `runtime/tp_worker.py`'s.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.runtime.model_config import ModelConfig
from radixlm.runtime.quantization.base import scheme_of


class RankFailure(RuntimeError):
    """Another rank of the tensor-parallel group failed or is gone (a collective raised or timed
    out, its channel closed): the engine stops, failing every request, rather than hang."""


class Part(NamedTuple):
    """This rank's rows [start, end) of a dimension of `size` in all (features or vocabulary)."""

    size: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


def _balanced(n: int, parts: int, index: int) -> tuple[int, int]:
    """Part `index` of `n` items split into `parts` contiguous runs differing by at most one."""
    return index * n // parts, (index + 1) * n // parts


@dataclass(frozen=True)
class Partition:
    """What rank `rank` of `size` holds: query heads, KV heads, intermediate features and
    vocabulary rows, each a [start, end) range."""

    rank: int
    size: int
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]  # rows of the padded vocabulary
    padded_vocab: int

    @classmethod
    def whole(cls, cfg: ModelConfig) -> Partition:
        return cls.of(cfg, 0, 1)

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, size: int) -> Partition:
        """Rank `rank`'s part of `cfg`'s model over `size` ranks; ValueError for a split that
        cannot be made (saying which sizes can)."""
        heads, kv = cfg.num_heads, cfg.num_kv_heads
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"rank {rank} of a tensor-parallel group of {size}")
        if size <= kv:  # whole KV heads to each rank, each with its query heads
            group = heads // kv
            k0, k1 = _balanced(kv, size, rank)
            head_range, kv_range = (k0 * group, k1 * group), (k0, k1)
        else:  # fewer KV heads than ranks: each replicated on size // kv ranks
            if size % kv or heads % size:
                raise ValueError(
                    f"tp_size={size} does not fit this model's {heads} attention heads and {kv} "
                    f"KV heads: with more ranks than KV heads, tp_size must be a multiple of the "
                    f"KV heads and divide the attention heads; use a tp_size of at most {kv}"
                )
            kv_index = rank // (size // kv)
            head_range, kv_range = _balanced(heads, size, rank), (kv_index, kv_index + 1)
        if cfg.intermediate_size < size:
            raise ValueError(f"tp_size={size} exceeds the MLP's {cfg.intermediate_size} features")
        per_rank = -(-cfg.vocab_size // size)
        return cls(
            rank=rank,
            size=size,
            heads=head_range,
            kv_heads=kv_range,
            intermediate=_balanced(cfg.intermediate_size, size, rank),
            vocab=(rank * per_rank, (rank + 1) * per_rank),
            padded_vocab=per_rank * size,
        )

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    def q_part(self, cfg: ModelConfig) -> Part:
        d = cfg.head_dim
        return Part(cfg.num_heads * d, self.heads[0] * d, self.heads[1] * d)

    def kv_part(self, cfg: ModelConfig) -> Part:
        d = cfg.head_dim
        return Part(cfg.num_kv_heads * d, self.kv_heads[0] * d, self.kv_heads[1] * d)

    def intermediate_part(self, cfg: ModelConfig) -> Part:
        return Part(cfg.intermediate_size, *self.intermediate)

    def vocab_part(self) -> Part:
        return Part(self.padded_vocab, *self.vocab)

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """`cfg` as this rank's KV pool and attention see it: its own heads."""
        return dataclasses.replace(cfg, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads)


class Comm:
    """The collectives of a tensor-parallel group of one rank: nothing to do."""

    rank = 0
    size = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        return x


class GroupComm(Comm):
    """The collectives over a torch.distributed process group (NCCL on GPUs, gloo on the CPU),
    called on the group object itself: no default group, so two engines in one process keep
    apart. Every collective has the group's timeout; an error or a timeout is a RankFailure."""

    def __init__(self, group, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of `x` (contiguous), in place."""
        self._wait(self.group.allreduce([x]), "all-reduce")
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Each rank's `x` (rows, n) side by side: (rows, size * n), rank 0's columns first."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._wait(self.group.allgather([parts], [x.contiguous()]), "all-gather")
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` into every rank's `x` (same shape and dtype), in place."""
        from torch.distributed import BroadcastOptions

        opts = BroadcastOptions()
        opts.rootRank = 0
        self._wait(self.group.broadcast([x], opts), "broadcast")
        return x

    def _wait(self, work, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as e:
            raise RankFailure(
                f"a tensor-parallel {what} failed (another rank is gone?): {e}"
            ) from e


def shard_rows(tensor: torch.Tensor, part: Part) -> torch.Tensor:
    """Rows [start, end) of a checkpoint tensor of `part.size` rows or fewer (a vocabulary padded
    past the checkpoint's rows: zero rows there)."""
    if tensor.shape[0] >= part.end:
        return tensor[part.start : part.end]
    out = tensor.new_zeros((part.length, *tensor.shape[1:]))
    have = max(0, tensor.shape[0] - part.start)
    out[:have] = tensor[part.start : part.start + have]
    return out


class ColumnParallelLinear(nn.Linear):
    """A linear layer whose output features are split across the ranks, each part of a fused
    projection (q, k, v; gate, up) split on its own: the local weight is this rank's rows of each
    part, one after the other. Its output stays split (the attention or the MLP uses it as is)."""

    def __init__(self, in_features: int, parts: list[Part], bias: bool) -> None:
        super().__init__(in_features, sum(p.length for p in parts), bias=bias)
        self.parts = parts

    def part_rows(self, index: int) -> tuple[int, int]:
        """The local rows of part `index` of the fused projection."""
        start = sum(p.length for p in self.parts[:index])
        return start, start + self.parts[index].length

    def shard(self, tensor: torch.Tensor, index: int = 0) -> torch.Tensor:
        """This rank's rows of the checkpoint's tensor for part `index` (weight or bias)."""
        return shard_rows(tensor, self.parts[index])

    def part_size(self, index: int = 0) -> int:
        """The rows of part `index` in the checkpoint (on all ranks together)."""
        return self.parts[index].size


class RowParallelLinear(nn.Linear):
    """A linear layer whose input features are split across the ranks: each multiplies its slice,
    giving a partial sum of the whole output, and `reduce` adds the ranks' sums."""

    def __init__(self, part: Part, out_features: int, comm: Comm) -> None:
        super().__init__(part.length, out_features, bias=False)  # (a bias would be added per rank)
        self.part, self.comm = part, comm

    def shard(self, tensor: torch.Tensor, index: int = 0) -> torch.Tensor:
        if self.part.length == self.part.size:  # all of it (a GGUF's rows are bytes, not columns)
            return tensor
        return tensor[:, self.part.start : self.part.end]

    def part_size(self, index: int = 0) -> int:
        """The rows of its weight in the checkpoint (every rank holds them all)."""
        return self.out_features

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(partial)


class VocabParallelEmbedding(nn.Embedding):
    """An embedding whose rows (token ids) are split across the ranks: each looks up the ids it
    holds, zero for the others, and the all-reduce gives every rank every token's row."""

    def __init__(self, part: Part, dim: int, comm: Comm) -> None:
        super().__init__(part.length, dim)
        self.part, self.comm = part, comm

    def shard(self, tensor: torch.Tensor, index: int = 0) -> torch.Tensor:
        return shard_rows(tensor, self.part)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.comm.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.part.start
        outside = (local < 0) | (local >= self.part.length)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # (T, dim)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.comm.all_reduce(out)


class ParallelLMHead(ColumnParallelLinear):
    """The LM head over this rank's vocabulary rows; `gather` joins the ranks' logits into whole
    rows of the model's vocabulary (the padding past it dropped)."""

    def __init__(self, in_features: int, part: Part, vocab_size: int, comm: Comm) -> None:
        super().__init__(in_features, [part], bias=False)
        self.vocab_size, self.comm = vocab_size, comm

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        """(L, local vocab) -> (L, vocab)."""
        if self.comm.size == 1:
            return logits
        whole = self.comm.all_gather(logits)
        return (
            whole
            if whole.shape[-1] == self.vocab_size
            else whole[:, : self.vocab_size].contiguous()
        )


def shard_for(
    module: nn.Module, tensor: torch.Tensor, index: int | None, leaf: str = "weight"
) -> torch.Tensor:
    """This rank's part of a checkpoint tensor for `module`'s parameter `leaf` (its part `index`
    of a fused projection); the whole tensor for a module every rank holds whole (norms). A
    quantized layer's scheme first puts the tensor in its parameter's unsharded shape (a scale
    per row, whose rows shard as the weight's)."""
    scheme = scheme_of(module)
    tensor = scheme.checkpoint_tensor(module, leaf, tensor, index)
    if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
        return module.shard(tensor, index or 0)
    if isinstance(module, RowParallelLinear) and tensor.dim() == 2:
        return scheme.row_shard(module, tensor)  # (packed or grouped columns: the scheme's)
    return tensor
