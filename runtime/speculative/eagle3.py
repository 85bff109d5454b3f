"""EAGLE-3 drafting inside the engine: the draft (runtime/models/llama_eagle3.py) reads the
target's own features, kept by the target's forward, and drafts a chain the target verifies as
it verifies any other (worker.py). An EAGLE-1/2 draft (speculative_algorithm="EAGLE",
runtime/models/llama_eagle.py) drafts here the same way: its features are the target's final
hidden state (ForwardBatch.aux_layers names it as the layer past the last), and it reads them,
and its own outputs, through its fc at every step.

The target keeps, for every token it runs of a request that may be drafted for (prompt chunks,
decodes, the accepted positions of a verify step), the residual stream entering the draft's three
layers (ForwardBatch.aux_layers; the model runner hands them over with `keep_features`). They
wait, per request, for the next draft: the draft's cache entry at position t is its layer's K/V
from (the features at t, token t + 1), so an entry can be made only once token t + 1 is known.

A draft for a request whose newest token sits at position n (not yet run by the target) first
catches up: one forward of the draft over the waiting positions ctx .. n - 1 (an extend over its
cache), whose last row reads (features at n - 1, the newest token) and gives the first draft
token. Each further draft step is a decode row at the next position, reading the token drafted
before it and the draft's own output there (no fc), as training-time test taught it
(eagle3_training.py). Draft steps write their K/V to scratch slots of the request's row; the next
round drops them (the entries from the target's features replace them as the verify step's
accepted positions come back).

The draft's KV pool is one layer's, indexed by the target's own slots: a position's draft entry
lives at the slot of the target's KV for it. The draft's request table copies the target's row
before each catch-up, then points the draft steps' positions at the scratch slots. A prompt that
starts from the prefix cache finds the draft's entries of that prefix where the request that
computed it left them, but for its last position, whose entry is made with the token after it,
which the two requests need not share: with EAGLE3 the engine computes a cached prefix's last
position again (CacheManager.recompute_cached), so the request hands over its features there and
catches up on it with its own next token. Two kinds of entry stay stale: one the request that
cached the prefix never caught up on (it finished before drafting), and the last shared one of
requests that computed a prefix in the same step (the cache then keeps one request's slots for
both, and the entry there is made with one of their next tokens): a worse draft, never another
output, since the target verifies every token.

On a GPU a round replays CUDA graphs: a catch-up of a few positions a request (what a verify
step or a decode step leaves) as decode rows, every position a row (runtime/cuda_graph.py
RowGraphs over `_CatchUpRows`, the features copied into its buffer first), and the draft steps
after the first as decode steps (DecodeGraphs over `_ChainStep`), each step's argmax left on the
device as the next step's input, its output as the next step's hidden; the chain comes to the
host once, at the end. A longer catch-up (a prompt) runs eagerly.

With speculative_eagle_topk above 1 the draft steps are the same; each step's likeliest
candidates besides its own token become leaves off the chain, and the likeliest nodes of the
chain and those leaves (by the draft's probability of their paths, as EAGLE-2 ranks a tree's
nodes) make a tree the target verifies in one step (tree.py). A verify that takes a leaf hands
over the features along the path it took.

Features that wait are bounded: a request whose waiting positions pass `_MAX_WAITING` (steps the
gate kept plain, a long prompt) is caught up when its next features come, without drafting.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from radixlm.runtime.forward_batch import ForwardBatch
from radixlm.runtime.request import Req
from radixlm.runtime.speculative.tree import merge_chains
from radixlm.runtime.tensors import int64_tensor, packed_to_device, to_device

logger = logging.getLogger(__name__)

# positions a request's features may wait for before it is caught up without a draft
_MAX_WAITING = 16
# the most positions a catch-up replayed as decode rows holds (more run eagerly)
_MAX_CATCH_UP_ROWS = 256
# config.json's record of the target a draft was made for: the first columns of a few LM head
# rows (medusa.py `lm_head_sample`), by which a shipped draft is found for its model
SAMPLE_KEY = "radixlm_target_sample"
_SAMPLE_COLUMNS = 32


def target_sample(target) -> list[list[float]]:
    """What a draft's config.json records of the target it is made for (`SAMPLE_KEY`)."""
    from radixlm.runtime.speculative.medusa import float_lm_head, lm_head_sample

    rows = lm_head_sample(float_lm_head(target.lm_head))[:, :_SAMPLE_COLUMNS]
    return [[round(v, 6) for v in row] for row in rows.tolist()]


def find_shipped_draft(target, algorithm: str = "EAGLE3"):
    """The folder under draft_heads/ of a draft of `algorithm` (EAGLE3, EAGLE) made for
    `target`, if one ships."""
    import json

    from radixlm.runtime.speculative.medusa import _SAMPLE_ATOL, _SAMPLE_RTOL, shipped_heads_dir

    architecture = _draft_class(algorithm).config_class.architecture

    root = shipped_heads_dir()
    sample = None
    for folder in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        try:
            raw = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError):
            continue
        if architecture not in (raw.get("architectures") or []) or not raw.get(SAMPLE_KEY):
            continue
        if sample is None:
            sample = torch.tensor(target_sample(target))
        stored = torch.tensor(raw[SAMPLE_KEY])
        if stored.shape == sample.shape and torch.allclose(
            stored, sample, _SAMPLE_RTOL, _SAMPLE_ATOL
        ):
            return folder
    return None


@dataclass
class _Entry:
    """One request's place in the draft's cache: positions 0 .. ctx - 1 hold entries made from
    the target's features; `waiting` holds the features of ctx .. end - 1, (position, (m, F))."""

    req: Req
    ctx: int = 0
    waiting: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.ctx + sum(f.shape[0] for _, f in self.waiting)


def _draft_class(algorithm: str):
    """The draft model class of `algorithm`: EAGLE3's or EAGLE's (EAGLE-1/2)."""
    if algorithm == "EAGLE":
        from radixlm.runtime.models.llama_eagle import LlamaEagleDraft

        return LlamaEagleDraft
    from radixlm.runtime.models.llama_eagle3 import LlamaEagle3Draft

    return LlamaEagle3Draft


class Eagle3Drafter:
    """An EAGLE-3 draft (or an EAGLE-1/2 one: the same drafting over other features) beside its
    target, drafting greedy chains. `load` builds it (before the target's KV pool is sized:
    `kv_share`), `make_cache` gives it its KV pool once the target's request table exists."""

    def __init__(self, draft, target, config, device, dtype) -> None:
        self.model = draft
        self.config = config
        self.device, self.dtype = device, dtype
        self.aux_layers = draft.config.target_layers(target.cfg)
        # candidates a draft holds (speculative_eagle_topk): 1, a chain; more, a tree
        self.width = config.speculative_eagle_topk
        # target ids past this are padding, never drafted (a draft of the target's whole vocabulary)
        self.sampled_vocab = getattr(target, "sampled_vocab", target.cfg.vocab_size)
        self._entries: dict[int, _Entry] = {}  # by id(req)
        self.table: torch.Tensor | None = None
        self.graphs = None  # the draft steps' graphs (`use_graphs`)
        self.row_graphs = None  # the catch-ups' graphs, decode rows (`use_graphs`)
        self.folder = None  # where the draft was loaded from

    @classmethod
    def load(cls, config, target, dtype, device) -> Eagle3Drafter:
        """The draft of config.speculative_algorithm (EAGLE3 or EAGLE) at
        `config.speculative_draft_model_path` for `target` (without a path, the one that ships
        for it); ValueError saying what is missing or does not fit."""
        from pathlib import Path

        algorithm = config.speculative_algorithm
        draft_class = _draft_class(algorithm)
        path = config.speculative_draft_model_path
        if path is None:
            path = find_shipped_draft(target, algorithm)
            if path is None:
                shipped = (
                    " (one ships for the embedded default model)" if algorithm == "EAGLE3" else ""
                )
                raise ValueError(
                    f"speculative_algorithm={algorithm}: no {draft_class.kind} draft ships for "
                    f"this model{shipped}; make one with `radixlm train-draft --algorithm "
                    f"{algorithm} --model-path MODEL --output DIR` and pass "
                    "speculative_draft_model_path=DIR"
                )
        folder = Path(path).expanduser()
        if not (folder / "config.json").is_file():
            raise ValueError(
                f"speculative_draft_model_path={path!r} is not an {draft_class.kind} draft folder "
                f"(no config.json); pass the folder `radixlm train-draft --algorithm {algorithm}` "
                f"writes, or an {draft_class.kind} checkpoint made for this model"
            )
        draft = draft_class.load(folder, target, device, dtype, target.rope.max_positions)
        drafter = cls(draft.eval(), target, config, device, dtype)
        drafter.folder = folder
        return drafter

    def kv_share(self, num_slots: int, target_bytes_per_slot: int) -> int:
        """The target's slots when it alone would have `num_slots`: the draft's pool has a slot
        for each of the target's (one layer's), so the room is split in that ratio."""
        if self.config.max_total_tokens is not None:
            return num_slots
        return max(
            16, num_slots * target_bytes_per_slot // (target_bytes_per_slot + self._slot_bytes())
        )

    def _slot_bytes(self) -> int:
        from radixlm.runtime.memory_pool import KVPool

        m = self.model.config.model
        return KVPool.bytes_per_slot(1, m.num_kv_heads, m.head_dim, self.dtype)

    def make_cache(
        self,
        target_slots: int,
        target_table: torch.Tensor,
        max_steps: int,
        padding_row: int | None = None,
    ) -> None:
        """The draft's KV pool: a slot for each of the target pool's `target_slots` (its padding
        slot 0 among them), then `max_steps` scratch slots for each request row (the draft
        steps after the first); its request table, of the target's shape (`padding_row`: the
        row no request has); its attention backend; on a GPU, the graphs of its draft steps."""
        from radixlm.runtime.attention import create_backend
        from radixlm.runtime.memory_pool import KVPool

        m = self.model.config.model
        self.target_table = target_table
        rows = target_table.shape[0]
        self.scratch_base, self.max_steps = target_slots, max(max_steps, 1)
        self.kv_pool = KVPool(
            self.scratch_base + rows * self.max_steps, 1, m.num_kv_heads, m.head_dim, self.dtype,
            self.device,
        )  # fmt: skip
        self.kv_pool._buffer.zero_()  # (an entry never written reads as zeros, not garbage)
        self.table = torch.zeros_like(target_table)
        self.backend = create_backend(
            self.config.attention_backend, self.kv_pool, self.table, self.device,
            num_q_heads=m.num_heads,
        )  # fmt: skip
        self.padding_row = padding_row
        config = self.config
        if self.device.type == "cuda" and not getattr(config, "disable_cuda_graph", True):
            self.use_graphs(config.cuda_graph_max_bs or min(config.max_running_requests, 256))

    def use_graphs(self, max_batch: int, capture: bool = True) -> None:
        """Run the draft steps after the first through DecodeGraphs of up to `max_batch`
        requests, and catch-ups of up to `max_steps` + 2 positions a request (a verify step's
        most) through RowGraphs; capture=False runs the same padded steps eagerly (a CPU test
        of this path)."""
        from radixlm.runtime.cuda_graph import DecodeGraphs, RowGraphs

        self.chain_step = _ChainStep(
            self.model, max_batch, self.device, self.dtype, self.sampled_vocab
        )
        self.token_buf = torch.zeros(self.table.shape[0], dtype=torch.int64, device=self.device)
        self.graphs = DecodeGraphs(
            self.chain_step, self.backend, self.table, self.token_buf, max_batch,
            capture=capture, padding_row=self.padding_row,
        )  # fmt: skip
        per_request = self.max_steps + 2
        max_rows = min(max_batch * per_request, _MAX_CATCH_UP_ROWS)
        self.catch_up_rows = _CatchUpRows(self.model, max_rows, self.device, self.dtype)
        self.row_graphs = RowGraphs(
            self.catch_up_rows, self.backend, self.table, self.token_buf, max_rows, per_request,
            capture=capture, padding_row=self.padding_row,
        )  # fmt: skip

    # ---- features (the model runner hands them over) -------------------------------------------

    def keep_features(self, spans: list[tuple[Req, int, int, int]], features: torch.Tensor) -> None:
        """spans: (request, first position, first row of `features`, rows) for each request of a
        step: the target's features at those positions, kept until the request's next draft."""
        self._forget_finished()  # (their features, where the gate keeps drafting off)
        overdue = []
        for req, start, row, count in spans:
            if count <= 0:
                continue
            e = self._entries.get(id(req))
            if e is None:
                e = self._entries[id(req)] = _Entry(req)
            end = e.end
            if start < end:  # (positions run again: a rewritten or recomputed context)
                if start <= e.ctx:
                    e.ctx, e.waiting = start, []
                else:
                    e.waiting = [(pos, f[: start - pos]) for pos, f in e.waiting if pos < start]
            elif start > end:  # (the positions between came from the prefix cache)
                e.ctx, e.waiting = start, []
            elif end - e.ctx >= _MAX_WAITING:
                overdue.append(e)
            # (a copy: a view would keep the whole step's features alive)
            e.waiting.append((start, features[row : row + count].clone()))
        if overdue:  # all but their newest positions (this step's), without drafting
            self._catch_up(overdue, lambda e: e.waiting[-1][0], want_logits=False)

    # ---- drafting ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def draft(self, reqs: list[Req], num: int) -> list[list[int] | tuple[int, ...]]:
        """Each request's greedy chain of `num` draft tokens after its newest one ([] for a request
        whose features do not reach its newest token), at most `max_steps` + 1 (the draft's
        depth). With `width` above 1, a tree of `num` nodes instead (`draft_tree`): that chain
        and, at each of its positions, the draft's next width - 1 candidates, the likeliest
        nodes kept."""
        self._forget_finished()
        chains: list[list[int] | tuple[int, ...]] = [[] for _ in reqs]
        width = self.width
        steps = min(num, self.max_steps + 1)
        # (a draft step's position must have a request-table column and a rope row: a request
        # this close to the context's end is not drafted for)
        last = min(self.table.shape[1], self.model.rope.cos.shape[0]) - 1
        ready, which = [], []
        for i, req in enumerate(reqs):
            e = self._entries.get(id(req))
            newest = len(req.input_ids) + len(req.output_ids) - 1
            if e is not None and e.waiting and e.end == newest and newest + steps - 1 <= last:
                ready.append(e)
                which.append(i)
        if not ready or num <= 0:
            return chains
        logits, hidden = self._catch_up(ready, lambda e: e.end, want_logits=True)
        positions = [e.ctx for e in ready]  # (the newest token's: caught up to it)
        rows = [e.req.pool_row for e in ready]
        tops: list[tuple[torch.Tensor, torch.Tensor]] | None = [] if width > 1 else None
        if self.graphs is not None and self.graphs.can_run(len(ready)):
            drafted = self._stepped(logits, hidden, rows, positions, steps, tops, width)
        else:
            drafted = self._eager_steps(logits, hidden, rows, positions, steps, tops, width)
        made = torch.stack(drafted, dim=1).tolist()
        if tops is None:
            for i, chain in zip(which, made):
                chains[i] = chain
            return chains
        probs = torch.stack([p for p, _ in tops], dim=1).tolist()  # (requests, steps, width + 1)
        ids = torch.stack([t for _, t in tops], dim=1).tolist()
        for i, chain, p, t in zip(which, made, probs, ids):
            chains[i] = draft_tree(chain, p, t, width, num)
        return chains

    def _scratch(self, rows: list[int], step: int) -> list[int]:
        """The scratch slot of draft step `step` (1 ..) of each request row."""
        return [self.scratch_base + r * self.max_steps + step - 1 for r in rows]

    def _eager_steps(
        self, logits, hidden, rows, positions, steps, tops=None, width=1
    ) -> list[torch.Tensor]:
        """The chain from the catch-up's logits and output: each further step a decode row at
        the next position, reading the token before and its own output there. `tops`: each
        step's likeliest width + 1 candidates are added to it (`_top`)."""
        tokens = self._pick(logits)
        if tops is not None:
            tops.append(self._top(logits, width))
        drafted = [tokens]
        for step in range(1, steps):
            at = [p + step - 1 for p in positions]  # the position of draft token `step`
            slots = self._scratch(rows, step)
            rows_t, at_t, slots_t = packed_to_device([rows, at, slots], self.device)
            self.table[rows_t, at_t] = slots_t.to(self.table.dtype)
            batch = ForwardBatch.decode_rows(tokens, at_t, rows_t, slots_t, at_t + 1, at)
            logits, hidden = self.model(batch, self.backend, hidden, from_target=False)
            tokens = self._pick(logits)
            if tops is not None:
                tops.append(self._top(logits, width))
            drafted.append(tokens)
        return drafted

    def _stepped(
        self, logits, hidden, rows, positions, steps, tops=None, width=1
    ) -> list[torch.Tensor]:
        """`_eager_steps` through the draft steps' graphs: the first draft token (a draft id)
        and the catch-up's output go into the graphs' buffers, each step leaves its argmax
        there for the next."""
        first = self._sampled(logits).argmax(dim=-1)
        if tops is not None:
            tops.append(self._top(logits, width))
        rows_t = to_device(int64_tensor(rows), self.device)
        self.token_buf[rows_t] = first
        self.chain_step.hidden[: len(rows)] = hidden
        drafted = [first]
        for step in range(1, steps):
            seq_lens = [p + step for p in positions]
            out, argmax = self.graphs.run(rows, seq_lens, int64_tensor(self._scratch(rows, step)))
            if tops is not None:  # (before the next replay overwrites the graph's logits)
                tops.append(self._top(out, width))
            drafted.append(argmax.clone())
        return [self.model.target_ids(d) for d in drafted]

    def _top(self, logits: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's width + 1 likeliest draft tokens (its argmax and its rivals), as
        (probabilities, target ids), likeliest first."""
        probs, ids = self._sampled(logits).float().softmax(dim=-1).topk(width + 1, dim=-1)
        return probs, self.model.target_ids(ids)

    def _pick(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's greedy draft token, as a target id."""
        return self.model.target_ids(self._sampled(logits).argmax(dim=-1))

    def _sampled(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits without the padding ids past the sampled vocabulary (a draft of
        the target's whole vocabulary has them)."""
        return logits[:, : self.sampled_vocab] if logits.shape[-1] > self.sampled_vocab else logits

    def _catch_up(self, entries: list[_Entry], upto, want_logits: bool):
        """Run the draft over each entry's waiting positions ctx .. upto(e) - 1 (tokens ctx + 1 ..
        upto(e), known on the host), writing their cache entries; with `want_logits`, the logits
        and output at each entry's last position (the first draft step's), in `entries`' order
        (each then has a position to catch up on)."""
        ids, positions, feats, rows, prefix, extend, last = [], [], [], [], [], [], []
        stops = [upto(e) for e in entries]
        # (a batch holds its items of several tokens first: ForwardBatch's order)
        order = sorted(range(len(entries)), key=lambda i: stops[i] - entries[i].ctx == 1)
        for i in order:
            e, stop = entries[i], stops[i]
            if stop <= e.ctx:
                continue
            req = e.req
            rows.append(req.pool_row)
            prefix.append(e.ctx)
            extend.append(stop - e.ctx)
            ids.extend(req.ids_slice(e.ctx + 1, stop + 1))
            positions.extend(range(e.ctx, stop))
            need, kept = stop - e.ctx, []
            for pos, f in e.waiting:
                take = min(need, f.shape[0])
                if take:
                    feats.append(f[:take])
                if take < f.shape[0]:
                    kept.append((pos + take, f[take:]))
                need -= take
            e.ctx, e.waiting = stop, kept
            last.append(len(ids) - 1)
        if not rows:
            return None, None
        token_rows = [r for r, n in zip(rows, extend) for _ in range(n)]
        back = sorted(range(len(order)), key=order.__getitem__) if want_logits else []
        ids_t, pos_t, rows_t, prefix_t, extend_t, last_t, token_rows_t, back_t = packed_to_device(
            [ids, positions, rows, prefix, extend, last, token_rows, back], self.device
        )  # (one copy)
        # the target's slots of every position the draft attends (and, past them, entries the
        # draft steps overwrite with their scratch slots)
        self.table[rows_t] = self.target_table[rows_t]
        rg = self.row_graphs
        if rg is not None and rg.can_run(len(ids), max(extend)):  # (as decode rows)
            rows_in = self.catch_up_rows
            rows_in.features[: len(ids)] = torch.cat(feats)
            logits, _ = rg.run(ids, positions, token_rows, [])
            if not want_logits:
                return None, None
            at = last_t[back_t]
            return logits[at], rows_in.out[at]
        slots = self.table[token_rows_t, pos_t].long()
        batch = ForwardBatch(
            input_ids=ids_t, positions=pos_t, out_cache_loc=slots, req_pool_indices=rows_t,
            prefix_lens=prefix_t, extend_lens=extend_t, seq_lens=prefix_t + extend_t,
            logits_indices=last_t, extend_lens_cpu=extend, prefix_lens_cpu=prefix,
            num_multi=sum(n > 1 for n in extend),
        )  # fmt: skip
        logits, out = self.model(batch, self.backend, torch.cat(feats), from_target=True)
        if not want_logits:
            return None, None
        return logits[back_t], out[last_t][back_t]

    # ---- the cache ----------------------------------------------------------------------------

    def _forget_finished(self) -> None:
        """Drop finished requests, and the waiting features of preempted ones (a preempted
        request runs its context again, handing them over again)."""
        for key in [k for k, e in self._entries.items() if e.req.is_finished]:
            del self._entries[key]
        for e in self._entries.values():
            if e.waiting and e.req.pool_row is None:
                e.waiting = []

    def release_all(self) -> None:
        """Forget every request (the engine's cache flush)."""
        self._entries.clear()


def draft_tree(
    chain: list[int],
    probs: list[list[float]],
    ids: list[list[int]],
    width: int,
    budget: int,
) -> list[int] | tuple[int, ...]:
    """A draft tree of at most `budget` nodes from a drafted chain and each of its steps' likeliest
    candidates (`probs[d]`, `ids[d]`: step d's, likeliest first): the chain's tokens and, at each
    depth, the width - 1 likeliest others, each a leaf off the chain before it. A node's score is
    the draft's probability of its path (the chain's tokens' probabilities before it, times its
    own); the `budget` best are kept, as EAGLE-2 ranks its tree's nodes. A path's score never
    exceeds its parent's, so the kept nodes are a tree: the chain cut at some depth, and leaves
    off it. The chain alone (a list) where no other candidate is kept."""
    scored: list[tuple[float, int, int, int]] = []  # (score, depth, 0 chain / 1 leaf, token)
    path = 1.0
    for d, token in enumerate(chain):
        rivals = [(p, t) for p, t in zip(probs[d], ids[d]) if t != token][: width - 1]
        scored.extend((path * p, d, 1, t) for p, t in rivals)
        mine = max([p for p, t in zip(probs[d], ids[d]) if t == token], default=probs[d][0])
        path *= mine
        scored.append((path, d, 0, token))
    scored.sort(key=lambda s: (-s[0], s[1], s[2]))
    kept = scored[:budget]
    depth = sum(1 for s in kept if s[2] == 0)  # (the chain's kept nodes: its first `depth`)
    leaves = [(d, t) for _, d, kind, t in kept if kind == 1 and d <= depth]
    if not leaves:
        return list(chain[:depth])
    chains = [chain[:depth]] + [chain[:d] + [t] for d, t in sorted(leaves, key=lambda x: x[0])]
    return merge_chains(chains, budget)


class _ChainStep(nn.Module):
    """The draft's decode step as DecodeGraphs runs a model: its input ids are draft ids (the
    graphs leave each step's argmax as the next step's input), and row i reads `hidden[i]` as
    its hidden, which its output then replaces."""

    def __init__(self, draft, max_batch: int, device, dtype, sampled_vocab: int) -> None:
        super().__init__()
        self.draft = draft
        width = draft.config.model.hidden_size
        self.hidden = torch.zeros(max_batch, width, device=device, dtype=dtype)
        self.sampled_vocab = sampled_vocab  # (draft ids past it are padding, as in `_pick`)

    def forward(self, batch: ForwardBatch, backend) -> torch.Tensor:
        n = batch.input_ids.shape[0]
        batch = dataclasses.replace(batch, input_ids=self.draft.target_ids(batch.input_ids))
        logits, out = self.draft(batch, backend, self.hidden[:n], from_target=False)
        self.hidden[:n].copy_(out)
        return logits[:, : self.sampled_vocab]


class _CatchUpRows(nn.Module):
    """The draft over a catch-up's positions as RowGraphs runs a model, every position a decode
    row: row i reads the target's features `features[i]`, and its output goes to `out[i]`."""

    def __init__(self, draft, max_rows: int, device, dtype) -> None:
        super().__init__()
        self.draft = draft
        cfg = draft.config
        self.features = torch.zeros(max_rows, cfg.features_size, device=device, dtype=dtype)
        self.out = torch.zeros(max_rows, cfg.model.hidden_size, device=device, dtype=dtype)

    def forward(self, batch: ForwardBatch, backend) -> torch.Tensor:
        n = batch.input_ids.shape[0]
        logits, out = self.draft(batch, backend, self.features[:n], from_target=True)
        self.out[:n].copy_(out)
        return logits
