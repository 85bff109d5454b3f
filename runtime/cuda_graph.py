"""Decode steps replayed from CUDA graphs.

A decode step of a small model is a few hundred short kernels; launched one by one from Python the
GPU waits on the host between them. Here the whole forward of a decode batch (embedding, every layer,
the final norm and the LM head) is captured once per bucket batch size and replayed: a batch is
padded up to the next bucket, its inputs (per request: its row in the request table and its
sequence length) go to the device in one copy, and one replay computes the logits. Each request's
input is its newest token, which the previous step sampled into `token_buf`: the graph reads it
there, so a step can be launched before the previous one's tokens reach the host.

Padding rows have sequence length 0: they write their K/V to the padding slot 0, attend to nothing
(the decode kernel gives a zero output for an empty sequence) and their logits are ignored. The
positions and KV slots of the real rows are derived inside the graph from the `req_to_token` table.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from radixlm.runtime.forward_batch import ForwardBatch
from radixlm.runtime.tensors import int64_tensor

logger = logging.getLogger(__name__)


def graph_buckets(max_batch: int) -> list[int]:
    """Batch sizes to capture: fine steps for small batches, coarser ones above (padding stays under
    a quarter of the batch), up to and including `max_batch`."""
    candidates = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 64, 80, 96, 112, 128]
    candidates += list(range(160, max(max_batch, 160) + 1, 32))
    out = [b for b in candidates if b < max_batch] + [max_batch]
    return sorted(set(out))


class DecodeGraphs:
    """CUDA graphs of the model's decode forward, one per bucket batch size."""

    def __init__(
        self,
        model,
        backend,
        req_to_token: torch.Tensor,
        token_buf: torch.Tensor,
        max_batch: int,
        capture: bool = True,
    ) -> None:
        """With capture=False (a CPU test of the padding logic) each call runs the padded forward
        eagerly instead of replaying a graph."""
        self.model = model
        self.backend = backend
        self.req_to_token = req_to_token
        self.token_buf = token_buf  # the newest sampled token of each request row
        self.device = req_to_token.device
        self.buckets = graph_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        n = self.max_batch
        # rows: request row in req_to_token, sequence length including the new token
        self._inputs = torch.zeros((2, n), dtype=torch.int64, device=self.device)
        # two host buffers used in turn: a step may be launched before the previous one's copy ran
        self._staging = [torch.zeros(2 * n, dtype=torch.int64) for _ in range(2)]
        if capture:
            self._staging = [b.pin_memory() for b in self._staging]
        self._flip = 0
        self._arange = torch.arange(n, dtype=torch.int64, device=self.device)
        self._ones = torch.ones(n, dtype=torch.int64, device=self.device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        if not capture:
            return
        t0 = time.perf_counter()
        self._capture_all()
        logger.info(
            "captured decode CUDA graphs for %d batch sizes up to %d in %.1fs",
            len(self.buckets), n, time.perf_counter() - t0,
        )  # fmt: skip

    def can_run(self, batch_size: int) -> bool:
        return 0 < batch_size <= self.max_batch

    def run(self, rows: list[int], seq_lens: list[int]) -> torch.Tensor:
        """Logits (len(rows), vocab) in float32 of one decode step: request row `rows[i]` computes
        its newest token, at position `seq_lens[i] - 1`, reading it from `token_buf`. The returned
        tensor is a view of the graph's output buffer: read it before the next call."""
        bs = len(rows)
        bucket = self.buckets[bisect.bisect_left(self.buckets, bs)]
        pad = [0] * (bucket - bs)
        staging = self._staging[self._flip][: 2 * bucket].view(2, bucket)
        self._flip ^= 1
        staging.view(-1).copy_(int64_tensor(rows + pad + seq_lens + pad))
        self._inputs[:, :bucket].copy_(staging, non_blocking=True)
        graph = self._graphs.get(bucket)
        if graph is None:  # not captured
            return self._forward(bucket)[:bs]
        graph.replay()
        return self._logits[bucket][:bs]

    def rows_on_device(self, bs: int) -> torch.Tensor:
        """The request rows of the last `run` of `bs` requests, on the device."""
        return self._inputs[0, :bs]

    # ---- capture --------------------------------------------------------------------------

    def _forward(self, bs: int) -> torch.Tensor:
        rows, seq_lens = self._inputs[:, :bs]
        tokens = self.token_buf[rows]
        positions = (seq_lens - 1).clamp(min=0)
        slots = self.req_to_token[rows, positions].long()
        batch = ForwardBatch(
            input_ids=tokens,
            positions=positions,
            out_cache_loc=torch.where(seq_lens > 0, slots, torch.zeros_like(slots)),
            req_pool_indices=rows,
            prefix_lens=positions,
            extend_lens=self._ones[:bs],
            seq_lens=seq_lens,
            logits_indices=self._arange[:bs],
            extend_lens_cpu=[1] * bs,
            prefix_lens_cpu=[0] * bs,  # unused by the graph-safe backend
            num_multi=0,
        )
        return self.model(batch, self.backend)

    def _capture_all(self) -> None:
        self._inputs.zero_()  # every row is padding while capturing
        pool = None
        stream = torch.cuda.Stream(self.device)
        for bs in reversed(self.buckets):  # largest first: smaller graphs reuse its memory
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # compiles kernels and allocates the backend's scratch
                    self._forward(bs)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self._logits[bs] = self._forward(bs)
            pool = graph.pool()
            self._graphs[bs] = graph
        torch.cuda.synchronize(self.device)
