"""What one forward step computes, as tensors: built once per step by the model runner."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """A batch of requests, each extending its KV from `prefix_lens[i]` by `extend_lens[i]` tokens.

    Requests with more than one new token (prefill chunks) come first, then the single-token ones
    (decodes): `num_multi` counts the former. Tokens are packed request after request.
    """

    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    out_cache_loc: torch.Tensor  # (T,) int64: the KV slot of each new token
    req_pool_indices: torch.Tensor  # (B,) int64: each request's row in req_to_token
    prefix_lens: torch.Tensor  # (B,) int64
    extend_lens: torch.Tensor  # (B,) int64
    seq_lens: torch.Tensor  # (B,) int64: prefix + extend
    # (L,) int64: rows of the packed hidden states that need logits; None: every row
    logits_indices: torch.Tensor | None
    # host copies, for control flow without device syncs
    extend_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    num_multi: int
    # trailing token rows of no request (shapes padded to few sizes): position 0, K/V written to
    # the padding slot 0, never in logits_indices
    padding: int = 0
    # a prompt step replayed from a CUDA graph (runtime/cuda_graph.py PrefillGraphs): the extend
    # attention tiles as (2, NB) (request, first new token; request -1 past the batch's), since the
    # host lists above describe the graph's capture, not this batch; padding rows then belong to no
    # tile and attention leaves them zero
    extend_blocks: torch.Tensor | None = None
    # rows of the final hidden states (the last norm's output, what the LM head reads) that the
    # model keeps in `hidden_states` (len(hidden_indices), hidden), for a speculative drafter
    # (runtime/speculative/medusa.py); None: none are kept
    hidden_indices: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    # with hidden_indices, the layers whose input (the residual stream entering them: the
    # embeddings for layer 0, else the layer before's output; for the number of layers, the
    # final norm's output, what the LM head reads) the model keeps at those rows instead of the
    # final hidden states, side by side in `aux_hidden_states` (len(hidden_indices),
    # len(aux_layers) * hidden): the features an EAGLE-3 draft reads (three layers':
    # runtime/models/llama_eagle3.py) or an EAGLE one (the final norm's: llama_eagle.py)
    aux_layers: tuple[int, ...] = ()
    aux_hidden_states: torch.Tensor | None = None
    # decode rows of which several may be one request's, at consecutive positions (a verify step
    # run as decode rows, runtime/cuda_graph.py RowGraphs): every row's K/V is stored before any
    # row attends, so a backend must not fold the store into its decode kernel
    store_kv_first: bool = False

    @classmethod
    def decode_rows(
        cls,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        rows: torch.Tensor,
        slots: torch.Tensor,
        seq_lens: torch.Tensor,
        positions_cpu: list[int],
        logits_indices: torch.Tensor | None = None,
        hidden_indices: torch.Tensor | None = None,
    ) -> ForwardBatch:
        """A step of decode rows, every token a row of its own (`store_kv_first`): a verify step
        or a draft tree's (runtime/cuda_graph.py RowGraphs, ModelRunner's eager twin). Row i is
        token input_ids[i] at positions[i] on request-table row rows[i], its K/V into slots[i],
        attending to seq_lens[i] keys; `positions_cpu` is read by the torch backend only."""
        n = len(input_ids)
        return cls(
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=slots,
            req_pool_indices=rows,
            prefix_lens=positions,
            extend_lens=torch.ones_like(positions),
            seq_lens=seq_lens,
            logits_indices=logits_indices,
            extend_lens_cpu=[1] * n,
            prefix_lens_cpu=positions_cpu,
            num_multi=0,
            hidden_indices=hidden_indices,
            store_kv_first=True,
        )

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens_cpu)

    @property
    def num_tokens(self) -> int:
        """Token rows, padding included."""
        return int(self.input_ids.shape[0])

    @property
    def is_decode(self) -> bool:
        return self.num_multi == 0
