"""Tensor parallelism, the processes' side: the group of ranks, the channel each step's plan goes
down, and the loop of every rank but 0.

One scheduler decides: rank 0's engine core. Its model runner, before running a step on the
device, sends the step to the other ranks as the host lists it builds the step's tensors from
(the slots the scheduler wrote into the request table since the last step, the tokens,
positions, rows and lengths, and whether a CUDA graph runs it); each other rank runs the same
runner methods on them over its own part of the model and of the KV pool, and the collectives
inside the forward meet. A token rank 0 writes into its device token buffer outside a graph (a
sampled, not greedy, token; an accepted draft) is broadcast to the others' buffers, so that a
later step reading a token still on the device reads the same one everywhere. Greedy tokens a
decode graph takes need no broadcast: every rank holds the same gathered logits.

So the other ranks need no scheduler, radix cache, grammar or sampler of their own, and cannot
drift from rank 0: there is nothing for them to decide.

The channel is a TCP connection from each rank to rank 0 carrying msgpack frames: a rank blocks
on it while the engine is idle with no timeout to run out, and its closing says the other side is
gone. Collectives are on a torch.distributed process group (NCCL on GPUs, gloo on the CPU) made
from a TCPStore at `dist_init_addr` (default: a free loopback port), each with `dist_timeout`.

Pipeline stages (runtime/pipeline.py) are this group's ranks too, with pp_size in place of
tp_size: the same processes, channel, step messages and failure handling; their model passes
activations on by send/recv where a tensor-parallel one runs collectives, and no token broadcast
is needed (only the first stage embeds tokens). With both, rank r is stage r // tp_size's rank
r % tp_size (`place`); a stage's ranks run their collectives in a process group of their own
(`stage_group`), the whole group's carrying the stages' messages, and the token broadcast goes
to the first stage's ranks only.

Failure: a rank that raises tells rank 0 why and exits; a rank that dies closes its channel and
connections. Rank 0's watcher thread sees either and stops the engine (every request failed with
the reason, `is_alive()` false: the server's 503 and unhealthy /health); a step blocked in a
collective meanwhile fails with the peer's connection or at the timeout, a RankFailure that stops
the engine too. When rank 0 goes, the others see their channel close (or their collective fail)
and exit.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
import torch

from radixlm.runtime.memory_pool import ReqToTokenPool
from radixlm.runtime.parallel import GroupComm, Partition, RankFailure

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("!I")


class Channel:
    """Length-prefixed msgpack frames over a socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder()

    def encode(self, message: Any) -> bytes:
        body = self._encoder.encode(message)
        return _HEADER.pack(len(body)) + body

    def send(self, message: Any) -> None:
        self.send_frame(self.encode(message))

    def send_frame(self, frame: bytes) -> None:
        self.sock.sendall(frame)

    def recv(self) -> Any:
        """The next message; None when the other side has closed the connection."""
        header = self._read(_HEADER.size)
        if header is None:
            return None
        body = self._read(_HEADER.unpack(header)[0])
        return None if body is None else self._decoder.decode(body)

    def _read(self, n: int) -> bytes | None:
        chunks, left = [], n
        while left:
            try:
                chunk = self.sock.recv(min(left, 1 << 20))
            except (ConnectionError, OSError):
                return None
            if not chunk:
                return None
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def rank_name(config) -> str:
    """What a process of the group is called in messages."""
    if config.pp_size > 1 and config.tp_size > 1:
        return "rank"
    return "pipeline stage" if config.pp_size > 1 else "tensor-parallel rank"


def parse_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


def ranks_of_node(config) -> range:
    per_node = config.world_size // config.nnodes
    return range(config.node_rank * per_node, (config.node_rank + 1) * per_node)


def rank_device(rank0_device: str, local_rank: int) -> torch.device:
    """A rank's device: the CPU, or the GPU `local_rank` places after rank 0's on its node."""
    device = torch.device(rank0_device)
    if device.type != "cuda":
        return device
    index = (device.index or 0) + local_rank
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"tensor-parallel rank on GPU {index}, but torch sees {torch.cuda.device_count()} "
            "GPU(s): lower tp_size or pp_size (or use more nodes)"
        )
    return torch.device("cuda", index)


def _process_group(
    store,
    rank: int,
    size: int,
    device: torch.device,
    timeout: float,
    name: str = "tp",
    global_ranks: list[int] | None = None,
):
    """The process group `name` of `size` ranks (`global_ranks`: theirs in the whole group), this
    process its rank `rank`, made over `store`."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore(name, store)
    delta = datetime.timedelta(seconds=timeout)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = delta  # (as init_process_group sets it up)
        options.is_high_priority_stream = False
        options.global_ranks_in_group = global_ranks or list(range(size))
        options.group_name = f"radixlm-{name}-{store.port}"  # (one group per engine)
        return dist.ProcessGroupNCCL(prefixed, rank, size, options)
    return dist.ProcessGroupGloo(prefixed, rank, size, delta)


def place(config, rank: int) -> tuple[int, int]:
    """(pipeline stage, tensor-parallel rank within it) of rank `rank` of the whole group: the
    ranks of a stage are consecutive (a stage's tensor-parallel group on one node where it can
    be), stage 0's first."""
    return divmod(rank, config.tp_size)


def stage_group(store, config, rank: int, device: torch.device):
    """The process group of the tensor-parallel ranks of rank `rank`'s pipeline stage (tp_size
    and pp_size both above 1), this process its member."""
    stage, tp_rank = place(config, rank)
    first = stage * config.tp_size
    return _process_group(
        store, tp_rank, config.tp_size, device, config.dist_timeout, name=f"tp-stage{stage}",
        global_ranks=list(range(first, first + config.tp_size)),
    )  # fmt: skip


# ---- rank 0 ----------------------------------------------------------------------------------


class JournaledReqToTokenPool(ReqToTokenPool):
    """Rank 0's request table, which keeps each write until the next step sends it along."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.journal: list[list[Any]] = []

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        super().write(row, start, slots)
        self.journal.append([row, start, slots.tolist()])

    def write_many(
        self, rows: list[int], starts: list[int], counts: list[int], slots: torch.Tensor
    ) -> None:
        super().write_many(rows, starts, counts, slots)
        at, values = 0, slots.tolist()
        for row, start, n in zip(rows, starts, counts):
            self.journal.append([row, start, values[at : at + n]])
            at += n

    def take_journal(self) -> list[list[Any]]:
        out, self.journal = self.journal, []
        return out


class StepMirror:
    """Rank 0's model runner's link to the other ranks: each step's work, as sent to them."""

    def __init__(self, group: TensorParallelGroup, rows: JournaledReqToTokenPool) -> None:
        self.group, self.rows = group, rows

    def graph_step(self, rows: list[int], seq_lens: list[int], slots: torch.Tensor) -> None:
        self.group.send({"w": self.rows.take_journal(), "g": [rows, seq_lens, slots.tolist()]})

    def eager_step(self, plan, lists, use_graph: str) -> None:
        decodes = None if plan is None else [plan.rows, plan.seq_lens, plan.slots.tolist()]
        self.group.send(
            {
                "w": self.rows.take_journal(),
                "d": decodes,
                "e": [
                    lists.input_ids, lists.positions, lists.token_rows,
                    [x for pair in lists.pending for x in pair], lists.rows, lists.extend_lens,
                    lists.prefix_lens, lists.num_multi, lists.logits_rows, use_graph,
                    lists.keep_hidden, list(lists.feature_layers), lists.feature_rows,
                ],
            }
        )  # fmt: skip

    @contextlib.contextmanager
    def lockstep(self):
        """Rank 0's part of a step the other ranks were sent: if it raises, they are left inside
        its collectives and the next step's would meet theirs, so the engine must stop."""
        try:
            yield
        except RankFailure:
            raise
        except Exception as e:
            raise RankFailure(
                f"rank 0 failed in a tensor-parallel step ({type(e).__name__}: {e}); the other "
                "ranks cannot be brought back into step"
            ) from e

    def tokens(self, pool_rows: torch.Tensor, tokens: torch.Tensor) -> None:
        # (only the first stage reads tokens, which it embeds: its tensor-parallel ranks)
        if self.group.config.tp_size == 1:
            return
        n = int(pool_rows.shape[0])
        self.group.send({"t": n}, ranks=range(1, self.group.config.tp_size))  # (stage 0's)
        self.group.stage_comm.broadcast(
            torch.cat([pool_rows.to(torch.int64), tokens.to(torch.int64)])
        )


class TensorParallelGroup:
    """Rank 0's view of the group: the rendezvous store, a channel to every other rank, the
    processes it started (this node's other ranks), the collectives (`comm`).

    `start` publishes what every rank needs to build its part of the model and starts this
    node's other ranks (other nodes start theirs with `radixlm serve --node-rank N`, `run_node`),
    which connect and begin loading; `agree_kv_slots` waits until all have loaded and sizes the
    KV pool for the rank with the least room; `watch` then stops the engine if any is lost."""

    def __init__(self, config, device: torch.device) -> None:
        import torch.distributed as dist

        self.config, self.device, self.size = config, device, config.world_size
        self.what = rank_name(config)  # (what its error messages call a rank)
        self.comm = GroupComm(None, 0, self.size)
        # the collectives of the first stage's tensor-parallel ranks: the whole group's, unless
        # it is split into pipeline stages too
        both = config.tp_size > 1 and config.pp_size > 1
        self.stage_comm = GroupComm(None, 0, config.tp_size) if both else self.comm
        self.processes: list[subprocess.Popen] = []
        self.channels: dict[int, Channel] = {}
        self._closing = False
        self._send_lock = threading.Lock()
        host, port = parse_addr(config.dist_init_addr or "127.0.0.1:0")
        self.store = dist.TCPStore(
            host, port, None, True,
            timeout=datetime.timedelta(seconds=config.dist_timeout), wait_for_workers=False,
        )  # fmt: skip
        self.addr = f"{host}:{self.store.port}"
        self._listener = socket.create_server((host, 0))

    def start(self, spec: dict[str, Any]) -> None:
        """Publish `spec` (what build_rank_model needs) and start this node's other ranks."""
        spec = {**spec, "channel_port": self._listener.getsockname()[1]}
        self.store.set("spec", json.dumps(spec))
        for rank in ranks_of_node(self.config)[1:]:
            self.processes.append(spawn_rank(self.addr, rank, rank))
        self._accept()

    def _accept(self) -> None:
        """Each other rank's channel (it says its rank first), within dist_timeout."""
        deadline = time.monotonic() + self.config.dist_timeout
        while len(self.channels) < self.size - 1:
            self._check_processes()
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, self.size)) - set(self.channels))
                raise RuntimeError(
                    f"{self.what}(s) {missing} did not connect within "
                    f"{self.config.dist_timeout:.0f}s (dist_timeout): with nnodes > 1, start "
                    f"each node's `radixlm serve --node-rank N --dist-init-addr {self.addr}`"
                )
            self._listener.settimeout(min(left, 0.5))
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            sock.settimeout(self.config.dist_timeout)
            channel = Channel(sock)
            hello = channel.recv()
            sock.settimeout(None)
            if isinstance(hello, dict) and isinstance(hello.get("rank"), int):
                self.channels[hello["rank"]] = channel
            else:
                channel.close()

    def _check_processes(self) -> None:
        for proc in self.processes:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"a {self.what}'s process exited (code {proc.returncode}) before "
                    "the engine started; its log above says why"
                )

    def agree_kv_slots(self, own_tokens: int) -> int:
        """The KV pool's slots on every rank: the fewest any rank has room for. Waits for every
        rank to have loaded its part of the model (a rank that failed to says why)."""
        counts = [own_tokens]
        for rank, channel in self.channels.items():
            reply = self._recv_ready(rank, channel)
            if "error" in reply:
                raise RuntimeError(f"{self.what} {rank} failed to start: {reply['error']}")
            counts.append(int(reply["kv_tokens"]))
        tokens = min(counts)
        self.send({"start": tokens})
        self.comm.group = _process_group(
            self.store, 0, self.size, self.device, self.config.dist_timeout
        )
        if self.stage_comm is not self.comm:
            self.stage_comm.group = stage_group(self.store, self.config, 0, self.device)
        return tokens

    def _recv_ready(self, rank: int, channel: Channel) -> dict[str, Any]:
        """A rank's ready or error message. Loading its part takes about as long as rank 0's,
        done by now: dist_timeout more at most, or until its process exits."""
        deadline = time.monotonic() + self.config.dist_timeout
        while time.monotonic() < deadline:
            self._check_processes()
            readable, _, _ = select.select([channel.sock], [], [], 0.5)
            if readable:
                reply = channel.recv()
                if reply is None:
                    raise RuntimeError(f"{self.what} {rank} exited while loading")
                return reply
        raise RuntimeError(
            f"{self.what} {rank} did not load the model within "
            f"{self.config.dist_timeout:.0f}s (dist_timeout) of rank 0"
        )

    def request_table(self, *args: Any, **kwargs: Any) -> JournaledReqToTokenPool:
        return JournaledReqToTokenPool(*args, **kwargs)

    def mirror(self, rows: JournaledReqToTokenPool) -> StepMirror:
        return StepMirror(self, rows)

    def send(self, message: Any, ranks: Iterable[int] | None = None) -> None:
        """To every other rank (or to `ranks`); a rank that cannot take it is lost
        (RankFailure)."""
        frame = next(iter(self.channels.values())).encode(message)
        to = self.channels if ranks is None else {r: self.channels[r] for r in ranks}
        with self._send_lock:
            for rank, channel in to.items():
                try:
                    channel.send_frame(frame)
                except OSError as e:
                    raise RankFailure(f"{self.what} {rank} is gone ({e})") from e

    def watch(self, on_lost: Callable[[Exception], None]) -> None:
        """Call `on_lost(RankFailure)` (from a thread of its own) when any rank says it failed
        or its channel closes."""
        threading.Thread(
            target=self._watch, args=(on_lost,), name="radixlm-tp-watch", daemon=True
        ).start()

    def _watch(self, on_lost: Callable[[Exception], None]) -> None:
        by_socket = {channel.sock: (rank, channel) for rank, channel in self.channels.items()}
        while not self._closing:
            try:
                readable, _, _ = select.select(list(by_socket), [], [], 0.5)
            except (OSError, ValueError):  # (closed by shutdown)
                return
            for sock in readable:
                rank, channel = by_socket[sock]
                message = channel.recv()
                if self._closing:
                    return
                why = (
                    f"{self.what} {rank} failed: {message['error']}"
                    if isinstance(message, dict) and "error" in message
                    else f"{self.what} {rank} is gone (its process exited)"
                )
                logger.error("%s; stopping the engine", why)
                self._abort_collectives()
                on_lost(RankFailure(why))
                return

    def _abort_collectives(self) -> None:
        """Make a collective blocked on the lost rank fail now (NCCL would wait for its
        timeout; gloo fails by itself when the peer's connection closes)."""
        for comm in {id(c): c for c in (self.comm, self.stage_comm)}.values():
            abort = getattr(comm.group, "abort", None)
            if self.device.type == "cuda" and abort is not None:
                try:
                    abort()
                except Exception:  # (best effort: the timeout still bounds the wait)
                    logger.exception("aborting the NCCL communicator failed")

    def shutdown(self) -> None:
        """Tell the other ranks to stop, and wait for this node's processes (killed past 10 s)."""
        if self._closing:
            return
        self._closing = True
        for channel in self.channels.values():
            with contextlib.suppress(OSError):
                channel.send({"stop": True})
        deadline = time.monotonic() + 10
        for proc in self.processes:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s process %d did not stop: killed", self.what, proc.pid)
                proc.kill()
                proc.wait()
        for channel in self.channels.values():
            channel.close()
        self._listener.close()
        self.comm.group = self.stage_comm.group = self.store = None  # (the process groups,
        # and the store's port)


# ---- the other ranks ---------------------------------------------------------------------------


def spawn_rank(store_addr: str, rank: int, local_rank: int) -> subprocess.Popen:
    """A process for tensor-parallel rank `rank` (`python -m radixlm.runtime.tp_worker`)."""
    return subprocess.Popen(
        [sys.executable, "-m", "radixlm.runtime.tp_worker", store_addr, str(rank), str(local_rank)],
        stdin=subprocess.DEVNULL,
    )


def run_node(config) -> int:
    """Node `config.node_rank` (> 0) of a multi-node group: start its ranks and wait for them
    (until rank 0's engine stops); the exit code is the first failure's, else 0."""
    host, port = parse_addr(config.dist_init_addr)
    ranks = ranks_of_node(config)
    procs = [spawn_rank(f"{host}:{port}", rank, i) for i, rank in enumerate(ranks)]
    code = 0
    for proc in procs:
        code = proc.wait() or code
    return code


def follower_main(store_addr: str, rank: int, local_rank: int) -> int:
    """A rank other than 0: build its part of the model, then run rank 0's steps until told to
    stop or until rank 0 is gone. 0 when stopped, 1 on a failure (told to rank 0 first)."""
    import torch.distributed as dist

    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank {rank} %(message)s")
    host, port = parse_addr(store_addr)
    store = dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=600))
    spec = json.loads(store.get("spec"))
    from radixlm.runtime.config import EngineConfig

    config = EngineConfig(**spec["config"])
    store.set_timeout(datetime.timedelta(seconds=config.dist_timeout))
    channel = Channel(socket.create_connection((host, spec["channel_port"]), config.dist_timeout))
    channel.sock.settimeout(None)
    channel.send({"rank": rank})
    try:
        device = rank_device(spec["device"], local_rank)
        if device.type == "cpu":
            torch.set_num_threads(spec["threads"])
        if device.type == "cuda":
            torch.cuda.set_device(device)
        runner = _Follower.build(config, spec, rank, device, store, channel)
    except Exception as e:
        logger.exception("tensor-parallel rank %d failed to start", rank)
        _tell(channel, f"{type(e).__name__}: {e}")
        return 1
    if runner is None:  # rank 0 went away while this rank loaded
        return 0
    if not config.disable_gc_freeze:  # (as rank 0's engine: its collector's full passes would
        from radixlm.runtime import gc_freeze  # stall every collective; the process's own)

        gc_freeze.freeze()
    try:
        with torch.inference_mode():
            runner.run()
    except RankFailure as e:  # rank 0 or another rank is gone: nothing to say to it
        logger.error("%s; exiting", e)
        return 1
    except Exception as e:
        logger.exception("tensor-parallel rank %d failed", rank)
        _tell(channel, f"{type(e).__name__}: {e}")
        return 1
    return 0


def _tell(channel: Channel, error: str) -> None:
    with contextlib.suppress(OSError):
        channel.send({"error": error})


class _Follower:
    """A rank other than 0: its part of the model, KV pool, request table and token buffer, and a
    model runner that runs what rank 0's sends."""

    def __init__(
        self, runner, rows: ReqToTokenPool, channel: Channel, comm: GroupComm | None
    ) -> None:
        """`comm`: the collectives rank 0 broadcasts tokens over (its stage's tensor-parallel
        group); None for a rank that reads no tokens (a later pipeline stage's)."""
        self.runner, self.rows, self.channel, self.comm = runner, rows, channel, comm

    @classmethod
    def build(cls, config, spec, rank: int, device, store, channel: Channel) -> _Follower | None:
        from pathlib import Path

        from radixlm.runtime.attention import create_backend
        from radixlm.runtime.engine_core import (
            capture_graphs,
            on_device,
            tree_rows,
            use_cuda_graphs,
        )
        from radixlm.runtime.model_config import ModelConfig
        from radixlm.runtime.model_loader import load_hf_config
        from radixlm.runtime.model_runner import ModelRunner
        from radixlm.runtime.model_setup import build_kv_pool, build_model, rank_kv_tokens

        mc = ModelConfig.from_hf(load_hf_config(Path(spec["folder"])))
        comm = GroupComm(None, rank, config.world_size)
        dtype = getattr(torch, spec["dtype"])
        stage_index, tp_rank = place(config, rank)
        both = config.tp_size > 1 and config.pp_size > 1
        # the collectives of this rank's tensor-parallel group: the whole group's, or its stage's
        tp_comm = GroupComm(None, tp_rank, config.tp_size) if both else comm
        tp = Partition.of(mc, tp_rank, config.tp_size) if config.tp_size > 1 else None
        local = mc if tp is None else tp.local_config(mc)
        if config.pp_size > 1:  # a pipeline stage: its layers (runtime/pipeline.py)
            from radixlm.runtime.pipeline import PipelineStageModel, Stage

            stage = Stage.of(mc, stage_index, config.pp_size)
            local = stage.local_config(local)
            model = build_model(
                config, Path(spec["folder"]), mc, dtype, device, spec["context_len"],
                spec["sampled_vocab"], tp, tp_comm if tp is not None else None, stage=stage,
            )  # fmt: skip
            model = PipelineStageModel(
                model, stage, comm, dtype, device, config.pp_micro_batch_min_tokens,
                tp_rank=tp_rank, tp_size=config.tp_size,
            )  # fmt: skip
        else:
            model = build_model(
                config, Path(spec["folder"]), mc, dtype, device, spec["context_len"],
                spec["sampled_vocab"], tp, comm,
            )  # fmt: skip
        channel.send(
            {"kv_tokens": rank_kv_tokens(config, local, dtype, device, spec["context_len"])}
        )
        start = channel.recv()
        if start is None or "start" not in start:
            return None
        comm.group = _process_group(store, rank, config.world_size, device, config.dist_timeout)
        if tp_comm is not comm:
            tp_comm.group = stage_group(store, config, rank, device)
        context_len = spec["context_len"]
        kv_pool = build_kv_pool(config, local, start["start"], dtype, device)
        rows = ReqToTokenPool(
            config.max_running_requests + 1, context_len + 1, device, tree_rows(config)
        )
        backend = create_backend(
            config.attention_backend, kv_pool, rows.table, device, num_q_heads=local.num_heads
        )
        token_buf = torch.zeros(rows.max_requests, dtype=torch.int64, device=device)
        graphs = prefill_graphs = row_graphs = None
        if use_cuda_graphs(config, device, backend):
            verify = config.speculative_num_draft_tokens if config.speculative_algorithm else None
            with on_device(device), torch.inference_mode():
                graphs, prefill_graphs, row_graphs = capture_graphs(
                    config, model, backend, rows, token_buf, verify_tokens=verify
                )
        runner = ModelRunner(
            model, backend, rows.table, device, graphs, token_buf, prefill_graphs,
            row_graphs=row_graphs,
        )  # fmt: skip
        reads_tokens = config.tp_size > 1 and stage_index == 0
        return cls(runner, rows, channel, tp_comm if reads_tokens else None)

    def run(self) -> None:
        from radixlm.runtime.model_runner import StepLists

        runner = self.runner
        while True:
            message = self.channel.recv()
            if message is None:
                raise RankFailure("rank 0 is gone (its channel closed)")
            if "stop" in message:
                return
            for row, start, slots in message.get("w", ()):
                self.rows.write(row, start, torch.tensor(slots, dtype=torch.int64))
            if "g" in message:
                rows, seq_lens, slots = message["g"]
                runner.graphs.run(rows, seq_lens, torch.tensor(slots, dtype=torch.int64))
            elif "e" in message:
                if message["d"] is not None:
                    runner.write_decode_slots(*message["d"])
                (ids, pos, token_rows, pending, rows, ext, pre, multi, logit_rows, graph, keep,
                 layers, feature_rows) = message["e"]  # fmt: skip
                lists = StepLists(
                    input_ids=ids, positions=pos, token_rows=token_rows,
                    pending=list(zip(pending[::2], pending[1::2])), rows=rows, extend_lens=ext,
                    prefix_lens=pre, num_multi=multi, logits_rows=logit_rows, keep_hidden=keep,
                    feature_layers=tuple(layers), feature_rows=feature_rows,
                )  # fmt: skip
                runner.forward_lists(lists, graph)
            elif "t" in message:  # (sent to the first stage's ranks only)
                n = message["t"]
                buf = torch.empty(2 * n, dtype=torch.int64, device=runner.device)
                self.comm.broadcast(buf)
                runner.token_buf[buf[:n]] = buf[n:]


if __name__ == "__main__":
    sys.exit(follower_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
