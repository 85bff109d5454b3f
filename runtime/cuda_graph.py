"""Steps replayed from CUDA graphs: decode steps (`DecodeGraphs`), speculative verify steps run as
decode rows (`RowGraphs`), and every other step of up to a few thousand tokens (`PrefillGraphs`, at
the end of this module).

A decode step of a small model is a few hundred short kernels; launched one by one from Python the
GPU waits on the host between them. Here the whole forward of a decode batch (embedding, every layer,
the final norm and the LM head) is captured once per bucket batch size and replayed: a batch is
padded up to the next bucket, its inputs (per request: its row in the request table, its
sequence length and the KV slot of its new token) go to the device in one copy, and one replay
writes the slots into the request table, computes the logits and their argmax. Each request's
input is its newest token, which an earlier step sampled into `token_buf` (the scheduler plans
only such requests here: `Req.token_in_buf`): the graph reads it there, so a step can be launched
before the previous one's tokens reach the host; the argmax goes back into `token_buf` (a sampled
step overwrites it afterwards).

Padding rows point at the request table's padding row, which no request owns, with sequence length
0 and slot 0: they write their K/V to the padding slot, attend to nothing (the decode kernel gives
a zero output for an empty sequence), and their logits and tokens are ignored.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Any

import torch

from radixlm.kernels import fused
from radixlm.kernels.triton_attention import extend_blocks
from radixlm.runtime import startup
from radixlm.runtime.forward_batch import ForwardBatch
from radixlm.runtime.sampler import greedy_ids
from radixlm.runtime.tensors import int64_tensor

logger = logging.getLogger(__name__)


def graph_buckets(max_batch: int) -> list[int]:
    """Batch sizes to capture: fine steps for small batches, coarser ones above (padding stays under
    a quarter of the batch), up to and including `max_batch`."""
    candidates = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 64, 80, 96, 112, 128]
    candidates += list(range(160, max(max_batch, 160) + 1, 32))
    out = [b for b in candidates if b < max_batch] + [max_batch]
    return sorted(set(out))


class _BucketGraphs:
    """What the two kinds of graphs share: one graph per bucket (`buckets`, `_forward(bucket)`
    over the device buffer `_inputs`, `_padding_inputs(bucket)` filling it with padding), and two
    pinned host buffers the inputs are staged in, used in turn. The copy from one is only queued,
    and a step may be launched before the previous one ran (or, for a step that samples nothing,
    without ever waiting for it): before a buffer is written again, the host waits for the copy
    that last read it (long done, as a rule)."""

    def _setup(self, model, backend, req_to_token, token_buf, padding_row, buckets) -> None:
        self.model = model
        self.backend = backend
        self.req_to_token = req_to_token
        self.token_buf = token_buf  # the newest sampled token of each request row
        self.padding_row = req_to_token.shape[0] - 1 if padding_row is None else padding_row
        self.device = req_to_token.device
        self.buckets = buckets
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, Any] = {}

    def _capture(self, what: str) -> None:
        t0 = time.perf_counter()
        self._capture_all(what)
        logger.info(
            "captured %s CUDA graphs for %d sizes up to %d in %.1fs",
            what, len(self.buckets), self.buckets[-1], time.perf_counter() - t0,
        )  # fmt: skip

    def _capture_all(self, what: str) -> None:
        """A graph per bucket, largest first (smaller graphs reuse its memory), each after two
        warm-up runs (kernels compiled, cuBLAS's choices made, the backend's scratch allocated)."""
        pool = None
        stream = torch.cuda.Stream(self.device)
        doing = f"capturing {what} CUDA graphs"
        for bucket in startup.progress(reversed(self.buckets), len(self.buckets), doing, "graphs"):
            self._padding_inputs(bucket)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(bucket)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self._outputs[bucket] = self._forward(bucket)
            pool = graph.pool()
            self._graphs[bucket] = graph
        torch.cuda.synchronize(self.device)

    def _replay(self, bucket: int):
        """The bucket's graph replayed (or, not captured, its forward run): its outputs."""
        graph = self._graphs.get(bucket)
        if graph is None:
            return self._forward(bucket)
        graph.replay()
        return self._outputs[bucket]

    def _token_lists(
        self,
        input_ids: list[int],
        positions: list[int],
        token_rows: list[int],
        pending: list[tuple[int, int]],
        bucket: int,
    ) -> list[int]:
        """The four token lists of a step of tokens (RowGraphs, PrefillGraphs), padded to
        `bucket`: ids, positions, request rows (padding: the padding row) and, per token, the
        request row whose `token_buf` entry is its input (-1: its id is given)."""
        pad = bucket - len(input_ids)
        from_buf = [-1] * bucket
        for i, row in pending:
            from_buf[i] = row
        return (
            input_ids + [0] * pad
            + positions + [0] * pad
            + token_rows + [self.padding_row] * pad
            + from_buf
        )  # fmt: skip

    def _token_inputs(self, ids, positions, rows, from_buf) -> tuple[torch.Tensor, torch.Tensor]:
        """In a graph: the tokens' ids (those pending read from `token_buf`) and their KV slots
        from the request table (a padding token's: the padding slot 0)."""
        ids = torch.where(from_buf >= 0, self.token_buf[from_buf.clamp(min=0)], ids)
        slots = self.req_to_token[rows, positions].long()
        return ids, torch.where(rows == self.padding_row, 0, slots)

    def _init_staging(self, size: int, pinned: bool) -> None:
        self._staging = [torch.zeros(size, dtype=torch.int64) for _ in range(2)]
        if pinned:
            self._staging = [b.pin_memory() for b in self._staging]
        self._read: list[torch.cuda.Event | None] = [None, None]  # each buffer's last copy
        self._flip = 0

    def _staging_buffer(self) -> torch.Tensor:
        event = self._read[self._flip]
        if event is not None:
            event.synchronize()
        return self._staging[self._flip]

    def _copied(self) -> None:
        """The copy from the current buffer is queued: note it, and turn to the other buffer."""
        if self.device.type == "cuda":
            event = self._read[self._flip] or torch.cuda.Event()
            event.record()
            self._read[self._flip] = event
        self._flip ^= 1


class DecodeGraphs(_BucketGraphs):
    """CUDA graphs of the model's decode forward, one per bucket batch size."""

    def __init__(
        self,
        model,
        backend,
        req_to_token: torch.Tensor,
        token_buf: torch.Tensor,
        max_batch: int,
        capture: bool = True,
        padding_row: int | None = None,
    ) -> None:
        """With capture=False (a CPU test of the padding logic) each call runs the padded forward
        eagerly instead of replaying a graph. `padding_row` (by default the table's last row, which
        ReqToTokenPool never hands out) is where padding rows point."""
        self._setup(model, backend, req_to_token, token_buf, padding_row, graph_buckets(max_batch))
        self.max_batch = n = self.buckets[-1]
        # rows: request row in req_to_token, sequence length including the new token, its KV slot
        self._inputs = torch.zeros((3, n), dtype=torch.int64, device=self.device)
        self._inputs[0] = self.padding_row
        self._init_staging(3 * n, pinned=capture)
        self._ones = torch.ones(n, dtype=torch.int64, device=self.device)
        if capture:  # (the outputs: logits and their argmax)
            self._capture("decode")

    def can_run(self, batch_size: int) -> bool:
        return 0 < batch_size <= self.max_batch

    def run(
        self, rows: list[int], seq_lens: list[int], slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step: request row `rows[i]` computes its newest token (read from
        `token_buf`) at position `seq_lens[i] - 1` into KV slot `slots[i]` (CPU int64). Returns
        the logits (len(rows), vocab) in float32 and their argmax, which is also left in
        `token_buf`: views of the graph's output buffers, to be read before the next call."""
        bs = len(rows)
        bucket = self.buckets[bisect.bisect_left(self.buckets, bs)]
        pad = bucket - bs
        staging = self._staging_buffer()[: 3 * bucket].view(3, bucket)
        staging[:2].view(-1).copy_(
            int64_tensor(rows + [self.padding_row] * pad + seq_lens + [0] * pad)
        )
        staging[2, :bs] = slots
        staging[2, bs:] = 0
        self._inputs[:, :bucket].copy_(staging, non_blocking=True)
        self._copied()
        logits, tokens = self._replay(bucket)
        return logits[:bs], tokens[:bs]

    def rows_on_device(self, bs: int) -> torch.Tensor:
        """The request rows of the last `run` of `bs` requests, on the device."""
        return self._inputs[0, :bs]

    # ---- capture --------------------------------------------------------------------------

    def _forward(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows, seq_lens, slots = self._inputs[:, :bs]
        if fused.enabled(slots):  # one kernel for the few below
            input_ids, positions = fused.decode_inputs(
                rows, seq_lens, slots, self.req_to_token, self.token_buf
            )
        else:
            positions = (seq_lens - 1).clamp(min=0)
            self.req_to_token[rows, positions] = slots.to(self.req_to_token.dtype)
            input_ids = self.token_buf[rows]
        batch = ForwardBatch(
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=slots,
            req_pool_indices=rows,
            prefix_lens=positions,
            extend_lens=self._ones[:bs],
            seq_lens=seq_lens,
            logits_indices=None,  # every row (no gather)
            extend_lens_cpu=[1] * bs,
            prefix_lens_cpu=[0] * bs,  # unused by the graph-safe backend
            num_multi=0,
        )
        logits = self.model(batch, self.backend)
        tokens = greedy_ids(logits, into=self.token_buf, rows=rows)
        return logits, tokens

    def _padding_inputs(self, bs: int) -> None:
        self._inputs[0] = self.padding_row  # every row is padding: length 0, slot 0
        self._inputs[1:].zero_()


class RowGraphs(_BucketGraphs):
    """CUDA graphs of steps run as decode rows, one per token: a speculative verify step (a
    request's newest token and its draft, beside other requests' decodes), or, when a drafter
    reads the final hidden states (MEDUSA) or an EAGLE-3 draft the target's features, a decode
    step that keeps them.

    A prompt-step graph computes such a step as an extend over the cached prefix, whose attention
    tiles and padding suit chunks of hundreds of tokens: for a verify step of a few tokens it
    costs several decode steps. Here every token is a row of its own, with the sequence length of
    its position: row j of a request's [newest, d1 .. dk] attends to the prefix and to the rows
    before it, as the causal extend would, through the decode kernel, and the whole step costs
    about a decode step of as many rows. The rows' K/V are stored before any row attends
    (`ForwardBatch.store_kv_first`). One graph per bucket row count; the inputs are the step's
    token lists (tokens, positions, request rows, and the rows of `token_buf` a token is read
    from); each graph leaves every row's logits, their argmax (its own buffer: the rows of one
    request would overwrite each other's in `token_buf`), with `keep_hidden` the rows' final
    hidden states, and with `aux_layers` the rows' features (the input of those layers, side by
    side: ForwardBatch.aux_hidden_states). Padding rows point at the padding row with sequence
    length 0 and slot 0.
    """

    def __init__(
        self,
        model,
        backend,
        req_to_token: torch.Tensor,
        token_buf: torch.Tensor,
        max_rows: int,
        max_item_tokens: int,
        capture: bool = True,
        padding_row: int | None = None,
        keep_hidden: bool = False,
        aux_layers: tuple[int, ...] = (),
    ) -> None:
        """A step fits when it has at most `max_rows` tokens and no request has more than
        `max_item_tokens` (longer items, prompt chunks, are what extend attention is for)."""
        self._setup(model, backend, req_to_token, token_buf, padding_row, graph_buckets(max_rows))
        self.max_rows = n = self.buckets[-1]
        self.max_item_tokens = max_item_tokens
        self.keeps_hidden = keep_hidden
        self.aux_layers = aux_layers
        self.hidden: torch.Tensor | None = None  # (rows, H) of the last run, if kept
        self.features: torch.Tensor | None = None  # (rows, 3 H) of the last run, if kept
        self._inputs = torch.zeros((4, n), dtype=torch.int64, device=self.device)
        self._init_staging(4 * n, pinned=capture)
        self._all_rows = torch.arange(n, dtype=torch.int64, device=self.device)
        self._capturing = capture
        if capture:  # (the outputs: logits, argmax, the hidden states and features if kept)
            self._capture("verify")
        self._capturing = False

    def can_run(self, num_tokens: int, longest_item: int) -> bool:
        return 0 < num_tokens <= self.max_rows and longest_item <= self.max_item_tokens

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        token_rows: list[int],
        pending: list[tuple[int, int]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token i is `input_ids[i]` (or, for each (i, row) of `pending`, `token_buf[row]`) at
        `positions[i]` of request row `token_rows[i]`, whose KV slot the request table holds.
        Returns the float32 logits of every token (len(input_ids), vocab) and their argmax: views
        of the graph's outputs, to be read before the next call."""
        n = len(input_ids)
        bucket = self.buckets[bisect.bisect_left(self.buckets, n)]
        staging = self._staging_buffer()[: 4 * bucket]
        staging.copy_(
            int64_tensor(self._token_lists(input_ids, positions, token_rows, pending, bucket))
        )
        self._inputs[:, :bucket].copy_(staging.view(4, bucket), non_blocking=True)
        self._copied()
        logits, tokens, hidden, features = self._replay(bucket)
        self.hidden = None if hidden is None else hidden[:n]
        self.features = None if features is None else features[:n]
        return logits[:n], tokens[:n]

    # ---- capture --------------------------------------------------------------------------

    def _forward(self, n: int):
        ids, positions, rows, from_buf = self._inputs[:, :n]
        ids, slots = self._token_inputs(ids, positions, rows, from_buf)
        seq_lens = torch.where(rows == self.padding_row, 0, positions + 1)
        batch = ForwardBatch.decode_rows(
            ids, positions, rows, slots, seq_lens,
            # (read by the CPU's torch backend only, which runs uncaptured)
            [0] * n if self._capturing else positions.tolist(),
            hidden_indices=self._all_rows[:n] if self.keeps_hidden or self.aux_layers else None,
        )  # fmt: skip
        batch.aux_layers = self.aux_layers
        logits = self.model(batch, self.backend)
        return logits, greedy_ids(logits), batch.hidden_states, batch.aux_hidden_states

    def _padding_inputs(self, n: int) -> None:
        self._inputs.zero_()
        self._inputs[2] = self.padding_row
        self._inputs[3] = -1


def prefill_buckets(max_tokens: int) -> list[int]:
    """Token counts to capture prompt steps at: 16, 32, 48, 64, then steps of a half or a third of
    the power of two below (padding stays under a third of the step), up to `max_tokens`."""
    out, n = [16, 32, 48], 64
    while n < max_tokens:
        out += [n, n * 3 // 2]
        n *= 2
    out.append(n)
    top = next(b for b in out if b >= max_tokens)
    return [b for b in out if b <= top]


class PrefillGraphs(_BucketGraphs):
    """CUDA graphs of prompt steps (a ragged batch of prompt chunks and decodes, one logits row per
    request) of up to `max_tokens` tokens, one per bucket token count.

    Launched eagerly, such a step costs the host a Python call and a kernel launch for each of a
    few hundred kernels: ~12 ms on an H200 machine's host for a 32-token prompt of a 30-layer model,
    whose kernels take under a millisecond. Here the step's index lists (the tokens, their
    positions and request rows; each request's row, prefix and new-token counts; the rows that
    need logits; the extend attention's tiles) go to the device in one copy and one replay runs
    the forward. A bucket of T tokens takes up to min(T, max_reqs) requests (each has at least one
    token), and lists the attention tiles (`extend_blocks`) so that its grid does not depend on
    the batch. Padding tokens point at the request table's padding row: position 0, KV slot 0 (the
    padding slot), attention output zero, in no logits row. A token whose input is still on the
    device only (sampled by the previous step, not yet applied) is read from `token_buf`.

    A step may want more logits rows than it has requests (a speculative verify step, one per
    position it checks; prompt log-probabilities, one per prompt token): a bucket holds as many
    rows as request entries, min(T, max_reqs), and a step wanting more runs eagerly.

    With `keep_hidden` (a MEDUSA drafter reads them), every graph also keeps the final hidden
    states at the logits rows: `run` leaves them in `hidden` for its caller.
    """

    def __init__(
        self,
        model,
        backend,
        req_to_token: torch.Tensor,
        token_buf: torch.Tensor,
        max_tokens: int,
        max_reqs: int,
        capture: bool = True,
        padding_row: int | None = None,
        keep_hidden: bool = False,
    ) -> None:
        self._setup(
            model, backend, req_to_token, token_buf, padding_row, prefill_buckets(max_tokens)
        )
        self.keeps_hidden = keep_hidden
        self.hidden: torch.Tensor | None = None  # (logits rows, H) of the last run, if kept
        self.tokens_per_block = backend.extend_tokens_per_block()
        self.max_tokens = self.buckets[-1]
        self.max_reqs = max_reqs
        largest = max(self._layout(t)[-1] for t in self.buckets)
        self._inputs = torch.zeros(largest, dtype=torch.int64, device=self.device)
        self._init_staging(largest, pinned=capture)
        if capture:  # (the outputs: logits, and the hidden states if kept)
            self._capture("prompt-step")

    def _layout(self, tokens: int) -> tuple[int, int, int]:
        """(requests, tiles, input length) of the bucket of `tokens` tokens. The inputs are four
        token lists, four request lists and the (2, tiles) tile list, each of an even length (so
        every list starts 16-byte aligned)."""
        reqs = min(tokens, self.max_reqs)
        reqs += reqs % 2
        tiles = -(-tokens // self.tokens_per_block) + reqs
        tiles += tiles % 2
        return reqs, tiles, 4 * tokens + 4 * reqs + 2 * tiles

    def can_run(self, num_tokens: int, num_reqs: int, num_logits: int = 1) -> bool:
        """Whether a step of `num_tokens` tokens of `num_reqs` requests wanting `num_logits`
        logits rows fits a bucket."""
        if not 0 < num_tokens <= self.max_tokens or num_reqs > self.max_reqs:
            return False
        bucket = self.buckets[bisect.bisect_left(self.buckets, num_tokens)]
        return num_logits <= self._layout(bucket)[0]

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        token_rows: list[int],
        pending: list[tuple[int, int]],
        rows: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        logits_rows: list[int],
    ) -> torch.Tensor:
        """One step: token i is `input_ids[i]` (or, for each (i, row) of `pending`, the request
        row's entry of `token_buf`) at `positions[i]` of request row `token_rows[i]`; request j
        (row `rows[j]`) extends `prefix_lens[j]` cached tokens by `extend_lens[j]`. Returns the
        float32 logits of the token rows `logits_rows` (at most the bucket's request entries, as
        `can_run` checks): a view of the graph's output, to be read before the next call."""
        n, r = len(input_ids), len(rows)
        bucket = self.buckets[bisect.bisect_left(self.buckets, n)]
        reqs, tiles, size = self._layout(bucket)
        pad_reqs = reqs - r
        tile_reqs, tile_starts = extend_blocks(extend_lens, self.tokens_per_block)
        pad_tiles = tiles - len(tile_reqs)
        staging = self._staging_buffer()[:size]
        staging.copy_(
            int64_tensor(
                self._token_lists(input_ids, positions, token_rows, pending, bucket)
                + rows + [self.padding_row] * pad_reqs
                + prefix_lens + [0] * pad_reqs
                + extend_lens + [0] * pad_reqs
                + logits_rows + [0] * (reqs - len(logits_rows))
                + tile_reqs + [-1] * pad_tiles
                + tile_starts + [0] * pad_tiles
            )
        )  # fmt: skip
        self._inputs[:size].copy_(staging, non_blocking=True)
        self._copied()
        logits, hidden = self._replay(bucket)
        self.hidden = None if hidden is None else hidden[: len(logits_rows)]
        return logits[: len(logits_rows)]

    # ---- capture --------------------------------------------------------------------------

    def _forward(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        reqs, tiles, size = self._layout(tokens)
        flat = self._inputs[:size]
        ids, positions, token_rows, from_buf = flat[: 4 * tokens].view(4, tokens)
        rows, prefix_lens, extend_lens, logits_rows = flat[4 * tokens : 4 * (tokens + reqs)].view(
            4, reqs
        )
        blocks = flat[4 * (tokens + reqs) :].view(2, tiles)
        ids, out_cache_loc = self._token_inputs(ids, positions, token_rows, from_buf)
        batch = ForwardBatch(
            input_ids=ids,
            positions=positions,
            out_cache_loc=out_cache_loc,
            req_pool_indices=rows,
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            seq_lens=prefix_lens + extend_lens,
            logits_indices=logits_rows,
            extend_lens_cpu=[0] * reqs,  # (unused with extend_blocks)
            prefix_lens_cpu=[0] * reqs,
            num_multi=reqs,
            extend_blocks=blocks,
            hidden_indices=logits_rows if self.keeps_hidden else None,
        )
        logits = self.model(batch, self.backend)
        return logits, batch.hidden_states

    def _padding_inputs(self, tokens: int) -> None:
        """Every token padding (the padding row, not from token_buf), every tile empty."""
        reqs, tiles, _ = self._layout(tokens)
        self._inputs.zero_()
        self._inputs[2 * tokens : 3 * tokens] = self.padding_row
        self._inputs[3 * tokens : 4 * tokens] = -1
        self._inputs[4 * (tokens + reqs) : 4 * (tokens + reqs) + tiles] = -1
