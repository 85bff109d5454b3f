"""Pipeline parallelism: the model's layers split into stages, one process each (SGLang's pp_size).

- Stage `r` of `pp_size` holds a contiguous run of the decoder layers (split as evenly as they go,
  `Stage.of`), their KV cache and nothing more: the first stage also holds the embedding, the last
  the final norm and the LM head (with tied embeddings, the embedding as the head's weight).
- The stages are the ranks of the group runtime/tp_worker.py builds, its processes, channels,
  watcher and step loop unchanged: the first stage is the engine, whose scheduler decides each
  step; the step's host lists go to every other stage down its channel, and each stage's model
  runner builds the same batch from them. So no stage has a scheduler, cache or sampler to keep
  in step, and every stage's request table and KV slots are the first stage's.
- Activations go down the pipeline by point-to-point send/recv on the group (gloo on the CPU, NCCL
  on GPUs): the hidden states and the residual, (2, T, hidden) in the model's dtype, from stage r
  to r + 1. The last stage computes the logits rows (L, vocab) in float32 and sends them back to
  the first, which samples as a single process does (grammar masks, penalties, log-probabilities
  and draft verification unchanged). No shape is sent: every stage built the same batch.
- Micro-batches: a step of several requests and at least 2 x `pp_micro_batch_min_tokens` tokens
  is split into up to pp_size micro-batches of whole requests (`split_step`; no more than its
  tokens / pp_micro_batch_min_tokens), which go down the pipeline one after the other: while
  stage r + 1 runs the first, stage r runs the second. Every stage splits the step alike (the
  split is a function of the step's lists), and the first stage joins the micro-batches' logits
  rows back in order. A small step runs whole: its time is that of reading the weights, which
  each micro-batch would read again. Steps still run one
  at a time (the scheduler's next step waits for this one's logits), so the pipeline drains
  between steps: a stage idles while the micro-batches ahead of it fill the pipeline.
- A send or recv that fails (its peer's process is gone) or outlasts dist_timeout is a
  RankFailure, which stops the engine as a lost tensor-parallel rank does.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from radixlm.runtime.model_config import ModelConfig
from radixlm.runtime.model_runner import StepLists
from radixlm.runtime.models.llama import layer_input
from radixlm.runtime.parallel import GroupComm, RankFailure

_LAYER_NAME = re.compile(r"^(?:model\.)?layers\.(\d+)\.")
_ACTIVATIONS, _LOGITS, _HIDDEN, _FEATURES = 1, 2, 3, 4  # message tags


@dataclass(frozen=True)
class Stage:
    """Stage `index` of `size`: the model's decoder layers [start, end) of `num_layers`."""

    index: int
    size: int
    start: int
    end: int
    num_layers: int

    @classmethod
    def of(cls, cfg: ModelConfig, index: int, size: int) -> Stage:
        """Stage `index` of `size` over `cfg`'s layers; ValueError for more stages than layers."""
        layers = cfg.num_layers
        if size > layers:
            raise ValueError(
                f"pp_size={size} exceeds the model's {layers} layers: each pipeline stage needs "
                f"at least one; use a pp_size of at most {layers}"
            )
        if not 0 <= index < size:
            raise ValueError(f"stage {index} of a pipeline of {size}")
        return cls(index, size, index * layers // size, (index + 1) * layers // size, layers)

    def sibling(self, index: int) -> Stage:
        """Stage `index` of the pipeline this stage is in."""
        layers, size = self.num_layers, self.size
        return Stage(index, size, index * layers // size, (index + 1) * layers // size, layers)

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.size - 1

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """`cfg` as this stage's KV pool sees it: its own layers."""
        return dataclasses.replace(cfg, num_layers=self.end - self.start)

    def holds_embedding(self, cfg: ModelConfig) -> bool:
        return self.first or (self.last and cfg.tie_word_embeddings)

    def trim(self, model: nn.Module) -> nn.Module:
        """`model` (a whole LlamaForCausalLM, on the meta device) cut down to this stage's
        parts, its layers numbered from 0 (as the stage's KV pool numbers them)."""
        cfg = model.cfg
        model.layers = nn.ModuleList(list(model.layers)[self.start : self.end])
        for i, layer in enumerate(model.layers):
            layer.self_attn.layer_id = i
        if not self.holds_embedding(cfg):
            del model.embed_tokens
        if not self.last:
            del model.norm, model.lm_head
        if cfg.tie_word_embeddings and not self.last:  # (no head here to tie)
            model.cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
        return model

    def own_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors this stage holds, its layers renamed to their local index."""
        for name, tensor in weights:
            match = _LAYER_NAME.match(name)
            if match is not None:
                i = int(match[1])
                if self.start <= i < self.end:
                    yield f"{name[: match.start(1)]}{i - self.start}{name[match.end(1) :]}", tensor
                continue
            bare = name.removeprefix("model.")
            if bare.startswith("embed_tokens."):
                if self.holds_embedding(cfg):
                    yield name, tensor
            elif bare.startswith(("norm.", "lm_head.")):
                if self.last:
                    yield name, tensor
            else:
                yield name, tensor


class StageLink:
    """Send/recv between the stages over the group's process group (no default group)."""

    def __init__(self, comm: GroupComm) -> None:
        self.comm = comm

    def start_send(self, x: torch.Tensor, to: int, tag: int):
        """Start sending `x` (kept alive until then); the returned callable waits for it."""
        work = self.comm.group.send([x], to, tag)
        return lambda: self._wait(work, "send to", to, x)

    def recv(self, x: torch.Tensor, source: int, tag: int) -> torch.Tensor:
        self.start_recv(x, source, tag)()
        return x

    def start_recv(self, x: torch.Tensor, source: int, tag: int):
        """Start receiving into `x`; the returned callable waits for it (on a GPU: makes the
        current stream wait)."""
        work = self.comm.group.recv([x], source, tag)
        return lambda: self._wait(work, "receive from", source)

    @staticmethod
    def _wait(work, what: str, peer: int, _keep: torch.Tensor | None = None) -> None:
        try:
            work.wait()
        except RuntimeError as e:
            raise RankFailure(
                f"a pipeline {what} stage {peer} failed (the pipeline stage is gone?): {e}"
            ) from e


class PipelineStageModel(nn.Module):
    """A stage's part of the model, run as the model runner runs a whole one: `forward(batch,
    backend)` gives the step's logits on the rank that samples (the first stage's first) and on
    the last stage's, None on the others."""

    def __init__(
        self,
        model: nn.Module,
        stage: Stage,
        comm: GroupComm,
        dtype: torch.dtype,
        device,
        micro_batch_min_tokens: int = 256,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        """`comm`: the whole group's (the stages' ranks); `tp_rank` of `tp_size`: this rank's
        place among its stage's tensor-parallel ranks (each sends on to its own peer of the
        next stage, whose activations are the same; the first of the last stage sends the
        logits back)."""
        super().__init__()
        self.model, self.stage, self.link = model, stage, StageLink(comm)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.micro_batch_min_tokens = micro_batch_min_tokens
        self.num_micro_batched_steps = 0  # steps split into micro-batches (on this stage)
        self.dtype, self.device = dtype, device
        self.cfg, self.rope = model.cfg, model.rope
        self.sampled_vocab = model.sampled_vocab
        self.vocab_size = model.cfg.vocab_size

    @torch.inference_mode()
    def forward(self, batch, backend) -> torch.Tensor | None:
        """One batch through this stage: the logits (L, vocab) on the rank that samples and on
        the last stage's, None on the others."""
        return self._run([batch], backend)[0]

    def forward_lists(self, lists: StepLists, to_batch, backend) -> torch.Tensor | None:
        """A step given as its host lists (the model runner's `to_batch` makes a ForwardBatch of
        each part): in micro-batches where it is large enough, their logits rows joined."""
        parts = split_step(lists, self.stage.size, self.micro_batch_min_tokens)
        batches = [to_batch(p) for p in parts]
        with torch.inference_mode():
            logits = self._run(batches, backend)
        if len(parts) > 1:
            self.num_micro_batched_steps += 1
        if not self._samples:
            return None
        if lists.keep_hidden:  # (MEDUSA's: the last stage's final states at the logits rows)
            lists.hidden = torch.cat(
                [b.hidden_states[: len(p.logits_rows)] for b, p in zip(batches, parts)]
            )
        if lists.feature_rows:  # (an EAGLE draft's: its layers' features, from every stage)
            lists.features = torch.cat(
                [b.aux_hidden_states[: len(p.feature_rows)] for b, p in zip(batches, parts)]
            )
        # (each part's own rows: a padded batch has copies of its row 0 after them)
        return torch.cat([x[: len(p.logits_rows)] for x, p in zip(logits, parts)])

    def _run(self, batches: list, backend) -> list[torch.Tensor | None]:
        """The micro-batches in order through this stage's layers, each sent on as soon as it is
        done (the sends finish while the next one computes).

        Every operation is started in one order that all stages agree on, and none is waited for
        before the next micro-batch's layers are queued, except the recv they read: NCCL runs a
        pair of stages' sends and recvs in the order each started them, so the first stage of two
        starts the recv of a micro-batch's logits right after its activations' send (had it
        started the next send first, the two stages would each wait on the other's send)."""
        m, stage, link = self.model, self.stage, self.link
        tp, t = self.tp_size, self.tp_rank
        pending, out = [], []  # (the waits of the sends and recvs started)
        joins = []  # (batch, {stage: (its layers, features)}): the features to join on rank 0
        for batch in batches:
            keep = batch.hidden_indices
            wanted = batch.aux_layers if keep is not None else ()
            aux: dict[int, torch.Tensor] = {}  # (this stage's features of `wanted`'s layers)
            if stage.first:
                x, residual = m.embed_tokens(batch.input_ids), None
            else:
                buf = torch.empty(
                    (2, batch.num_tokens, self.cfg.hidden_size), dtype=self.dtype,
                    device=self.device,
                )  # fmt: skip
                x, residual = link.recv(buf, (stage.index - 1) * tp + t, _ACTIVATIONS).unbind(0)
            rope = m.rope.lookup(batch.positions)
            for i, layer in enumerate(m.layers):
                if stage.start + i in wanted:  # (an EAGLE-3 draft's features: the layer's input)
                    aux[stage.start + i] = layer_input(x, residual, keep)
                x, residual = layer(rope, x, residual, batch, backend)
            if stage.last and stage.num_layers in wanted:  # (an EAGLE draft's: the final norm's)
                aux[stage.num_layers] = m.final_hidden(x, residual, keep)
            if not stage.last:
                activations = torch.stack((x, residual))
                pending.append(
                    link.start_send(activations, (stage.index + 1) * tp + t, _ACTIVATIONS)
                )
                if self._samples:  # the last stage's logits of this micro-batch, when they come
                    logits = self._logits_buffer(batch)
                    pending.append(link.start_recv(logits, (stage.size - 1) * tp, _LOGITS))
                    if keep is not None and not wanted:  # (and MEDUSA's final states)
                        batch.hidden_states = torch.empty(
                            (len(batch.hidden_indices), self.cfg.hidden_size), dtype=self.dtype,
                            device=self.device,
                        )  # fmt: skip
                        pending.append(
                            link.start_recv(batch.hidden_states, (stage.size - 1) * tp, _HIDDEN)
                        )
                    out.append(logits)
                else:
                    out.append(None)
            else:
                logits = m.logits(x, residual, batch)  # (whole rows on each of the stage's ranks)
                if not stage.first and t == 0:
                    pending.append(link.start_send(logits.contiguous(), 0, _LOGITS))
                    if keep is not None and not wanted:
                        hidden = m.final_hidden(x, residual, keep).contiguous()
                        pending.append(link.start_send(hidden, 0, _HIDDEN))
                out.append(logits)
            if wanted:  # (after the logits: each pair of stages starts its operations alike)
                joins.append((batch, self._exchange_features(batch, aux, pending)))
        for wait in pending:
            wait()
        for batch, parts in joins:  # (rank 0: every stage's features have come)
            if parts:
                by_layer: dict[int, torch.Tensor] = {}
                for layers, tensor in parts.values():
                    by_layer.update(zip(layers, tensor.split(self.cfg.hidden_size, dim=-1)))
                batch.aux_hidden_states = torch.cat([by_layer[g] for g in batch.aux_layers], -1)
        return out

    def _held(self, index: int, wanted) -> list[int]:
        """The layers of `wanted` whose features stage `index` makes, each once, in order."""
        s = self.stage.sibling(index)
        held = [g for g in dict.fromkeys(wanted) if s.start <= g < s.end]
        return held + [s.num_layers] if s.last and s.num_layers in wanted else held

    def _exchange_features(
        self, batch, aux: dict[int, torch.Tensor], pending: list
    ) -> dict[int, tuple[list[int], torch.Tensor]]:
        """This stage's features of `batch` sent to rank 0 (by the stage's first rank); on rank
        0, the receives of every other stage's started: {stage: (its layers, its features)}
        there, {} elsewhere."""
        wanted, link = batch.aux_layers, self.link
        if not self._samples:
            mine = self._held(self.stage.index, wanted)
            if mine and self.tp_rank == 0:
                tensor = torch.cat([aux[g] for g in mine], dim=-1).contiguous()
                pending.append(link.start_send(tensor, 0, _FEATURES))
            return {}
        parts: dict[int, tuple[list[int], torch.Tensor]] = {}
        for index in range(self.stage.size):
            held = self._held(index, wanted)
            if not held:
                continue
            if index == 0:
                parts[0] = (held, torch.cat([aux[g] for g in held], dim=-1))
                continue
            buf = torch.empty(
                (len(batch.hidden_indices), len(held) * self.cfg.hidden_size),
                dtype=self.dtype, device=self.device,
            )  # fmt: skip
            pending.append(link.start_recv(buf, index * self.tp_size, _FEATURES))
            parts[index] = (held, buf)
        return parts

    @property
    def _samples(self) -> bool:
        """Whether this rank gets the step's logits: the engine's (the first stage's first)."""
        return self.stage.first and self.tp_rank == 0

    def _logits_buffer(self, batch) -> torch.Tensor:
        rows = batch.num_tokens if batch.logits_indices is None else len(batch.logits_indices)
        return torch.empty((rows, self.vocab_size), dtype=torch.float32, device=self.device)

    def linears(self) -> list[nn.Linear]:
        return self.model.linears()


def split_step(lists: StepLists, parts: int, min_tokens: int) -> list[StepLists]:
    """`lists` as up to `parts` micro-batches of whole requests in their order (multi-token
    items stay first in each), balanced by tokens as whole requests allow, no more of them than
    the step's tokens / `min_tokens`; `[lists]` when that is one, or the step has one request."""
    items, tokens = len(lists.rows), len(lists.input_ids)
    parts = min(parts, items, tokens // max(min_tokens, 1))
    if parts < 2:
        return [lists]
    ends, done = [], 0  # the item each part ends before; the tokens since the last end
    left_tokens, left_parts = tokens, parts
    for i, n in enumerate(lists.extend_lens):
        done += n
        if done * left_parts >= left_tokens and items - (i + 1) >= left_parts - 1:
            ends.append(i + 1)
            left_tokens, left_parts, done = left_tokens - done, left_parts - 1, 0
            if left_parts == 1:
                break
    ends.append(items)
    out, first, start = [], 0, 0
    for end in ends:
        if end > first:
            count = sum(lists.extend_lens[first:end])
            out.append(_part(lists, first, end, start, start + count))
            first, start = end, start + count
    return out


def _part(lists: StepLists, first: int, end: int, start: int, stop: int) -> StepLists:
    """Items [first, end) of `lists`, whose tokens are [start, stop), as a step of their own."""
    extend = lists.extend_lens[first:end]
    return StepLists(
        input_ids=lists.input_ids[start:stop],
        positions=lists.positions[start:stop],
        token_rows=lists.token_rows[start:stop],
        pending=[(t - start, row) for t, row in lists.pending if start <= t < stop],
        rows=lists.rows[first:end],
        extend_lens=extend,
        prefix_lens=lists.prefix_lens[first:end],
        num_multi=sum(n > 1 for n in extend),
        logits_rows=[r - start for r in lists.logits_rows if start <= r < stop],
        keep_hidden=lists.keep_hidden,
        feature_layers=lists.feature_layers,
        feature_rows=[r - start for r in lists.feature_rows if start <= r < stop],
    )
