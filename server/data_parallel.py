"""Data parallelism: `--dp-size N` engine replicas behind one server, each request sent to one.

    backend = DataParallelBackend([EngineProcessBackend(kwargs_0), EngineProcessBackend(kwargs_1)])
    app = create_app(backend)

Each replica is a whole engine (its own process and GPU, its own radix cache). A request goes
where its prompt's prefix is most likely cached: the router remembers, per replica, the prompts
it sent there, as hashes of their block-aligned prefixes (blocks of `BLOCK_TOKENS` tokens, the
most recent `max_blocks` kept), and sends a request to the replica that holds the longest of its
prefixes, unless that replica has `balance_abs_threshold` more requests in flight than the least
loaded one; a request with no remembered prefix goes to the least loaded replica (of equals, the
one caching the least). This is the
policy SGLang's router calls cache-aware, kept on token ids rather than text. `round_robin`
and `shortest_queue` are there too, as SGLang's `--load-balance-method` names them.

The text side (tokenizing, chat templates) is the first replica's: every replica serves the same
model. Statistics are the replicas' summed (the hit rate recomputed from the summed tokens);
flushing the cache flushes every replica's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from typing import Any

from radixlm.protocol.stats import EngineStats
from radixlm.server.backend import GenerationBackend, ModelInfo

BLOCK_TOKENS = 16
LOAD_BALANCE_METHODS = ("cache_aware", "round_robin", "shortest_queue")


class PrefixRouter:
    """Chooses a replica for each prompt (see the module's docstring). Not thread-safe: the
    server's event loop is its only caller."""

    def __init__(
        self,
        num_replicas: int,
        method: str = "cache_aware",
        balance_abs_threshold: int = 32,
        max_blocks: int = 1 << 18,
    ) -> None:
        if method not in LOAD_BALANCE_METHODS:
            raise ValueError(
                f"load_balance_method={method!r}; use one of {', '.join(LOAD_BALANCE_METHODS)}"
            )
        if num_replicas < 1:
            raise ValueError(f"dp_size={num_replicas}; it must be at least 1")
        self.method = method
        self.balance_abs_threshold = balance_abs_threshold
        self.max_blocks = max_blocks
        self.in_flight = [0] * num_replicas
        # per replica: prefix hash -> None, oldest first (an LRU set)
        self._prefixes: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]
        self._turn = itertools.cycle(range(num_replicas))

    def choose(self, input_ids: Sequence[int]) -> int:
        """The replica for a prompt; remembers the prompt's prefixes there."""
        if self.method == "round_robin":
            return next(self._turn)
        if self.method == "shortest_queue":
            return min(range(len(self.in_flight)), key=self.in_flight.__getitem__)
        # the least loaded; among equals, the one remembered to cache the least (as SGLang's
        # router picks the smallest tree), so distinct prefixes spread over the replicas
        least = min(
            range(len(self.in_flight)), key=lambda r: (self.in_flight[r], len(self._prefixes[r]))
        )
        hashes = prefix_hashes(input_ids)
        best, best_blocks = least, 0
        for replica, known in enumerate(self._prefixes):
            blocks = _matched(hashes, known)
            if blocks > best_blocks or (
                blocks == best_blocks and self.in_flight[replica] < self.in_flight[best]
            ):
                best, best_blocks = replica, blocks
        if self.in_flight[best] - self.in_flight[least] > self.balance_abs_threshold:
            best = least  # (the cache is worth less than the queue there)
        self._remember(best, hashes)
        return best

    def matched_blocks(self, replica: int, input_ids: Sequence[int]) -> int:
        """How many leading blocks of the prompt the replica is remembered to hold."""
        return _matched(prefix_hashes(input_ids), self._prefixes[replica])

    def _remember(self, replica: int, hashes: list[int]) -> None:
        known = self._prefixes[replica]
        for h in hashes:
            known[h] = None
            known.move_to_end(h)
        while len(known) > self.max_blocks:
            known.popitem(last=False)


def prefix_hashes(input_ids: Sequence[int]) -> list[int]:
    """A hash of each block-aligned prefix of the prompt (of its whole blocks), each chained to
    the one before, so equal hashes mean equal prefixes (up to collisions)."""
    out, h = [], 0
    for start in range(0, len(input_ids) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        h = hash((h, tuple(input_ids[start : start + BLOCK_TOKENS])))
        out.append(h)
    return out


def _matched(hashes: list[int], known: OrderedDict[int, None]) -> int:
    n = 0
    for h in hashes:
        if h not in known:
            break
        n += 1
    return n


class DataParallelBackend:
    """`GenerationBackend` over several replicas of one model (see the module's docstring)."""

    def __init__(
        self,
        replicas: Sequence[GenerationBackend],
        load_balance_method: str = "cache_aware",
        balance_abs_threshold: int = 32,
    ) -> None:
        if not replicas:
            raise ValueError("data parallelism needs at least one replica")
        self.replicas = list(replicas)
        self.router = PrefixRouter(len(self.replicas), load_balance_method, balance_abs_threshold)
        self.routed = [0] * len(self.replicas)  # requests sent to each, since the start
        first = self.replicas[0]
        self.tokenize = first.tokenize
        self.decode = first.decode
        self.token_texts = first.token_texts
        self.render_chat = first.render_chat

    def model_info(self) -> ModelInfo:
        return self.replicas[0].model_info()

    def engine_config(self) -> dict[str, Any]:
        config = dict(self.replicas[0].engine_config())
        config["dp_size"] = len(self.replicas)
        pids = [r.engine_config().get("engine_pid") for r in self.replicas]
        if any(pid is not None for pid in pids):
            config["engine_pids"] = pids
        config["load_balance_method"] = self.router.method
        return config

    def is_alive(self) -> bool:
        """Every replica is: one that died fails its requests, so the server is unhealthy."""
        return all(r.is_alive() for r in self.replicas)

    async def stream(self, input_ids: list[int], sampling_params: dict[str, Any], **kwargs: Any):
        replica = self.router.choose(input_ids)
        self.router.in_flight[replica] += 1
        try:
            inner = await self.replicas[replica].stream(input_ids, sampling_params, **kwargs)
        except BaseException:
            self.router.in_flight[replica] -= 1
            raise
        self.routed[replica] += 1
        return _Counted(inner, self.router.in_flight, replica)

    async def flush_cache(self) -> bool:
        done = await asyncio.gather(*(r.flush_cache() for r in self.replicas))
        return all(done)

    async def freeze_gc(self) -> None:
        await asyncio.gather(*(r.freeze_gc() for r in self.replicas))

    async def stats(self) -> EngineStats:
        # (asked of every replica at once: a scrape waits for the slowest, not for their sum)
        return merge_stats(await asyncio.gather(*(_typed(r.stats()) for r in self.replicas)))

    async def start_profile(self, output_dir: str) -> None:
        await asyncio.gather(
            *(r.start_profile(f"{output_dir}/dp{i}") for i, r in enumerate(self.replicas))
        )

    async def stop_profile(self) -> str:
        return ", ".join(await asyncio.gather(*(r.stop_profile() for r in self.replicas)))

    def shutdown(self) -> None:
        for r in self.replicas:
            r.shutdown()


class _Counted:
    """A replica's stream, counted in flight until it ends, fails or is closed."""

    def __init__(self, inner: Any, in_flight: list[int], replica: int) -> None:
        self._inner = inner
        self._in_flight = in_flight
        self._replica = replica
        self._done = False

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        return self

    async def __anext__(self) -> dict[str, Any]:
        try:
            return await self._inner.__anext__()
        except BaseException:
            self._finish()
            raise

    async def aclose(self) -> None:
        self._finish()
        close = getattr(self._inner, "aclose", None)
        if close is not None:
            await close()

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._in_flight[self._replica] -= 1

    def __del__(self) -> None:  # (dropped unread: no longer counted)
        self._finish()


async def _typed(stats: Any) -> EngineStats:
    stats = await stats
    return stats if isinstance(stats, EngineStats) else EngineStats.from_dict(stats)


def merge_stats(parts: Sequence[EngineStats]) -> EngineStats:
    """The replicas' statistics as one engine's: counts and seconds summed, the cache hit rate
    and the speculative ratios recomputed from the summed counts, the grammar histograms'
    buckets added."""
    values: dict[str, Any] = {}
    for field in dataclasses.fields(EngineStats):
        present = [getattr(p, field.name) for p in parts if getattr(p, field.name) is not None]
        if not present:
            continue
        if field.name in ("grammar_compile_seconds", "spec_accept_length_histogram"):
            values[field.name] = _merge_histograms(present)
        else:
            values[field.name] = sum(present)
    prompt = values.get("prompt_tokens", 0)
    values["cache_hit_rate"] = values.get("cached_tokens", 0) / prompt if prompt else 0.0
    verify = values.get("spec_verify_ct")
    if verify is not None:
        proposed, correct = values["spec_num_proposed_drafts"], values["spec_num_correct_drafts"]
        values["spec_accept_rate"] = correct / proposed if proposed else 0.0
        lengths = [
            (p.spec_accept_length or 0.0) * (p.spec_verify_ct or 0)
            for p in parts
            if p.spec_verify_ct is not None
        ]
        values["spec_accept_length"] = sum(lengths) / verify if verify else 0.0
    return EngineStats(**values)


def _merge_histograms(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    first = snapshots[0]
    if any(s.get("buckets") != first.get("buckets") for s in snapshots):
        return first  # (one engine version: the same buckets everywhere)
    counts = [sum(c) for c in zip(*(s["counts"] for s in snapshots))]
    return {
        "buckets": first["buckets"],
        "counts": counts,
        "sum": sum(s["sum"] for s in snapshots),
        "count": sum(s["count"] for s in snapshots),
    }
