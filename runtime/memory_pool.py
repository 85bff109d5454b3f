"""KV memory: the per-token slot pool, its allocator, and the request-to-slot table.

Three owners of three things: `KVPool` holds the K/V tensors (one flat buffer sliced per layer),
`SlotAllocator` hands out free slot indices, `ReqToTokenPool` maps each running request's positions
to slots. Policy (what to evict, whom to preempt) lives in `cache_manager.py`.

The pool holds K/V in the model's dtype (`kv_cache_dtype="auto"`) or as float8_e4m3fn with a scale
per layer for K and for V (`"fp8_e4m3"`, SGLang's name and scheme): half the bytes a token, so twice
the tokens in the same memory. How values are quantized and read back is `kernels/attention_ref.py`'s
(`quantize_kv`, `dequantize_kv`); every attention backend reads the pool through it or its twin.
"""

from __future__ import annotations

import numpy as np
import torch

from radixlm.runtime.host_memory import release_pages
from radixlm.runtime.tensors import int64_tensor, to_device

_MAX_PENDING_PIECES = 256  # freed pieces kept apart before they are joined

# kv_cache_dtype -> what the pool stores (None: the model's dtype)
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8_e4m3": torch.float8_e4m3fn,
}


def kv_cache_storage_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The element type of a KV pool for `kv_cache_dtype` in a model computing in `dtype`."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not supported; use one of "
            f"{', '.join(KV_CACHE_DTYPES)}"
        )
    return KV_CACHE_DTYPES[kv_cache_dtype] or dtype


class KVPool:
    """K and V for every layer, addressed per token slot: k[layer] is (num_slots, num_kv_heads, head_dim).

    `dtype` is what the pool stores; `compute_dtype` is the model's, what K/V are written in and
    read back as. A float8 pool reads layer l's keys as their stored value times `k_scale[l]` and
    its values times `v_scale[l]` (1.0 unless given: SGLang's per-tensor scales, which a
    checkpoint may carry)."""

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_cache_dtype: str = "auto",
        k_scale: list[float] | None = None,
        v_scale: list[float] | None = None,
    ) -> None:
        self.num_slots = num_slots
        self.compute_dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.dtype = kv_cache_storage_dtype(kv_cache_dtype, dtype)
        if (k_scale is not None or v_scale is not None) and self.dtype == dtype:
            raise ValueError(
                "k_scale and v_scale are for a float8 pool (kv_cache_dtype=fp8_e4m3); a pool of "
                "the model's dtype stores K and V as they are"
            )
        self.k_scale = _layer_scales("k_scale", k_scale, num_layers)
        self.v_scale = _layer_scales("v_scale", v_scale, num_layers)
        # one buffer so a single allocation holds it all; (2, layers, slots, kv_heads, head_dim)
        self._buffer = torch.empty(
            (2, num_layers, num_slots, num_kv_heads, head_dim), dtype=self.dtype, device=device
        )
        # slot 0 is padding that masked-out reads point at: it must hold finite values, since a
        # NaN times a zero attention weight is still NaN
        self._buffer[:, :, 0].zero_()
        self.k = list(self._buffer[0].unbind(0))
        self.v = list(self._buffer[1].unbind(0))

    @property
    def quantized(self) -> bool:
        return self.dtype != self.compute_dtype

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot in one layer's K (or V)."""
        return self._buffer[0, 0, 0].nbytes

    def release_slots(self, first: int, end: int) -> int:
        """On a CPU, give the memory of slots [first, end) back to the system (their pages are
        mapped again, zero, when next written): after a burst of load an idle engine holds only
        the slots in use (SlotAllocator.reclaim_free_tail says which are free above them).
        Returns the bytes released; 0 on a GPU, whose pool stays allocated whole."""
        if self._buffer.device.type != "cpu" or end <= first:
            return 0
        row = self.slot_bytes  # one slot of one layer's K (or V)
        released = 0
        for part in self._buffer.flatten(0, 1):  # every layer's K, then V: (slots, heads, dim)
            released += release_pages(part.data_ptr() + first * row, (end - first) * row)
        return released

    @property
    def nbytes(self) -> int:
        return self._buffer.nbytes

    @staticmethod
    def bytes_per_slot(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes a token's K and V take over all layers in a pool storing `dtype`."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


def _layer_scales(name: str, scales: list[float] | None, num_layers: int) -> list[float]:
    if scales is None:
        return [1.0] * num_layers
    scales = [float(s) for s in scales]
    if len(scales) != num_layers:
        raise ValueError(f"{name} has {len(scales)} values for {num_layers} layers")
    if not all(s > 0 and s != float("inf") for s in scales):
        raise ValueError(f"{name} values must be positive and finite, got {scales}")
    return scales


class SlotAllocator:
    """Free-list of KV slot indices (CPU int64). Slot 0 is never handed out: padding points at it.

    The slots freed most recently are handed out first, and a slot never used only when none freed
    is left: the pool's memory is mapped lazily by the OS on a CPU (pages become resident when
    first written), so handing out fresh slots while freed ones wait would sweep the whole pool
    and the engine's resident memory would grow with every token served, to the pool's size
    (4.5 GB with the default model on a CPU), whatever the load at any one time."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.reset()

    def reset(self) -> None:
        self._free = torch.arange(1, self.num_slots, dtype=torch.int64)  # never used yet
        self._pending: list[torch.Tensor] = []  # freed slots, the newest piece last
        self._num_pending = 0

    @property
    def capacity(self) -> int:
        return self.num_slots - 1

    @property
    def num_free(self) -> int:
        return len(self._free) + self._num_pending

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> torch.Tensor:
        """Take n free slots, the most recently freed first. Raises RuntimeError when fewer are
        free (check `can_allocate` first)."""
        if n > self.num_free:
            raise RuntimeError(f"KV pool exhausted: asked for {n} slots, {self.num_free} free")
        taken: list[torch.Tensor] = []
        need = n
        while need and self._pending:
            piece = self._pending[-1]
            if len(piece) <= need:
                taken.append(self._pending.pop())
            else:
                taken.append(piece[len(piece) - need :])
                self._pending[-1] = piece[: len(piece) - need]
            need -= len(taken[-1])
        self._num_pending -= n - need
        if need or not taken:
            taken.append(self._free[:need])
            self._free = self._free[need:]
        return taken[0] if len(taken) == 1 else torch.cat(taken)

    def reclaim_free_tail(self) -> tuple[int, int]:
        """Take back the freed slots above the highest slot in use into the never-used ones, so
        that they are handed out last again; returns the slot range [first, end) that was used
        before and is free now (empty when there is none), whose memory the pool may release
        (KVPool.release_slots). For an idle engine: it costs a pass over the slots used so far."""
        top = self.num_slots - len(self._free)  # slots below this were handed out at some time
        if not self._num_pending or top <= 1:
            return (top, top)
        pending = torch.cat(self._pending) if len(self._pending) > 1 else self._pending[0]
        free = torch.zeros(top, dtype=torch.bool)
        free[pending] = True
        free[0] = False  # (slot 0: padding, never handed out)
        used = torch.nonzero(~free[1:])
        first = int(used[-1]) + 2 if used.numel() else 1  # above the highest slot in use
        if first >= top:
            return (top, top)
        kept = pending[pending < first]
        self._pending = [kept] if kept.numel() else []
        self._num_pending = kept.numel()
        self._free = torch.arange(first, self.num_slots, dtype=torch.int64)
        return (first, top)

    def free_runs(self, min_len: int) -> list[tuple[int, int]]:
        """The runs [start, end) of at least `min_len` consecutive free slots among those handed
        out so far (below the never-used ones): where a burst's freed slots lie between slots
        still in use (the prefix cache's, as a rule), the pool can release the pages wholly
        inside them. For an idle engine: a pass over the slots used so far."""
        top = self.num_slots - len(self._free)
        if not self._num_pending or top <= 1:
            return []
        free = torch.zeros(top + 2, dtype=torch.bool)  # (a used slot each side: runs close)
        free[torch.cat(self._pending) + 1] = True
        edges = torch.nonzero(free[1:].int() - free[:-1].int()).flatten().tolist()
        # edges alternate: a run's first slot, then the slot after its last
        return [(a, b) for a, b in zip(edges[::2], edges[1::2]) if b - a >= min_len]

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            # a compact copy: `slots` is often a slice of a request's whole row of slots, which
            # a view would keep alive until it is handed out again
            self._pending.append(slots.to(torch.int64, copy=True))
            self._num_pending += slots.numel()
            if len(self._pending) > _MAX_PENDING_PIECES:  # one tensor, not thousands of small ones
                self._pending = [torch.cat(self._pending)]


class ReqToTokenPool:
    """Rows of slot indices, one per running request: table[row, pos] is the slot of position pos.

    The table lives on the model's device; on a GPU a host copy is kept in step, so that reading a
    row (when a request finishes or is cached) never waits for the GPU. The last row is never
    handed out: the padding rows of a decode graph point at it (`padding_row`). With
    `spare_rows`, that many more rows before it are lent for a step at a time (`lend`): a
    speculative draft tree's further paths (runtime/speculative/tree.py)."""

    def __init__(
        self, max_requests: int, max_context: int, device: torch.device, spare_rows: int = 0
    ) -> None:
        max_requests += spare_rows  # (the table's rows)
        self.table = torch.zeros((max_requests, max_context), dtype=torch.int32, device=device)
        self.host = (
            self.table
            if self.table.device.type == "cpu"
            else torch.zeros_like(self.table, device="cpu")
        )
        self.padding_row = max_requests - 1
        self._spare_rows = list(range(max_requests - 2, max_requests - 2 - spare_rows, -1))
        self._free_rows = list(range(max_requests - 2 - spare_rows, -1, -1))
        self.max_requests = max_requests

    @property
    def host(self) -> torch.Tensor:
        return self._host

    @host.setter
    def host(self, table: torch.Tensor) -> None:
        self._host = table
        # the same memory as numpy: a step's bookkeeping reads and writes it without a torch
        # call per request (each costs microseconds, more where the core thread waits to get
        # the GIL back after the call let it go)
        self._host_np = table.numpy()

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def allocate(self) -> int:
        if not self._free_rows:
            raise RuntimeError("no free request row")
        return self._free_rows.pop()

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    @property
    def num_spare(self) -> int:
        return len(self._spare_rows)

    def lend(self) -> int:
        """A spare row, until `give_back`."""
        return self._spare_rows.pop()

    def give_back(self, row: int) -> None:
        self._spare_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """table[row, start:start + len(slots)] = slots: the host copy through numpy, the device's
        from it (three torch calls where there were five: each lets the GIL go, and the core
        thread, admitting a request, waits to get it back whenever other threads run Python)."""
        end = start + len(slots)
        if slots.device.type != "cpu":
            slots = slots.cpu()
        self._host_np[row, start:end] = slots.numpy()
        if self.host is not self.table:
            written = torch.from_numpy(self._host_np[row, start:end])
            self.table[row, start:end] = to_device(written, self.table.device)

    def write_many(
        self, rows: list[int], starts: list[int], counts: list[int], slots: torch.Tensor
    ) -> None:
        """`write(rows[i], starts[i], ...)` for each i, the slots taken in order from `slots`
        (counts[i] each), with one copy to the device table."""
        if not rows:
            return
        num = np.asarray(counts, dtype=np.int64)
        row_index = np.repeat(np.asarray(rows, dtype=np.int64), num)
        first = np.cumsum(num) - num  # where each row's slots begin in `slots`
        col_index = np.repeat(np.asarray(starts, dtype=np.int64) - first, num)
        col_index += np.arange(len(row_index))
        values = slots.numpy().astype(np.int64, copy=False)
        self._host_np[row_index, col_index] = values
        if self.host is not self.table:
            at = to_device(
                torch.from_numpy(np.stack([row_index, col_index, values])), self.table.device
            )
            self.table[at[0], at[1]] = at[2].to(torch.int32)

    def write_next_host(self, rows: list[int], seq_lens: list[int], slots: torch.Tensor) -> None:
        """host[rows[i], seq_lens[i] - 1] = slots[i] for all i: the slots of a step's decodes.
        The device copy is written by that step itself, from its inputs (ModelRunner), which
        saves a copy and a kernel a step."""
        index = int64_tensor(rows + seq_lens).view(2, -1)
        index[1] -= 1
        self.host[index[0], index[1]] = slots.to(torch.int32)

    def read(self, row: int, length: int) -> torch.Tensor:
        return self.host[row, :length].to(torch.int64)

    def view(self, row: int, start: int, end: int) -> np.ndarray:
        """The slots of positions start..end of `row`: an int32 view of the host table (valid
        until the row is written again)."""
        return self._host_np[row, start:end]
