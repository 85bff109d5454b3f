"""STANDALONE speculative decoding: a smaller model of the same tokenizer drafts, the classic
draft-model method (SGLang's `speculative_algorithm="STANDALONE"` with
`speculative_draft_model_path`).

Before a step that drafts, `DraftModel.draft` runs the draft model greedily over the requests to
be drafted for, in one batch: first the tokens of each request's context it has not seen (its
whole prompt the first time; afterwards the tokens the last verify step took), then one decode
step per further draft token. The target verifies the chain as it verifies any other
(worker.py), so outputs are the target's whatever the draft model says: greedy ones token for
token, sampled ones by rejection sampling, which preserves the target's distribution for a
deterministic draft.

With speculative_eagle_topk above 1 a draft is a tree, as EAGLE3's: the chain of
`speculative_draft_depth` steps and, at each step, the draft model's next candidates as leaves
off it (eagle3.py `draft_tree`); the leaves are not run through the draft model, and one the
target takes is caught up on at the next draft as any token the target chose.

On a GPU the draft model's steps replay CUDA graphs of its decode forward (one token per
request a step: the few tokens it catches up on, then the draft tokens, each argmax left as the
next step's input on the device), and only a long catch-up (a new request's prompt) runs eagerly.

The draft model keeps a KV cache of its own (its own pool, request table, slot allocator and
attention backend; no prefix cache), holding per request the KV of the tokens it has seen: the
context, then the draft tokens it ran over. Which of those the target kept is found at the next
draft, by comparing them with the request's tokens then: the KV of the others is freed and
computed again from the request's own tokens. A finished request's KV is freed at the next draft;
when the pool is short, requests not drafted for in this step lose theirs (they catch up later).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from radixlm.runtime.forward_batch import ForwardBatch
from radixlm.runtime.memory_pool import ReqToTokenPool, SlotAllocator
from radixlm.runtime.request import Req
from radixlm.runtime.tensors import int64_tensor, to_device

# a request with more unseen tokens than this catches up in one eager forward, not in decode steps
_STEPPED_CATCH_UP = 4


@dataclass
class _Seen:
    """What the draft model's cache holds for one request: the slots of `tokens` (positions 0 ..
    len - 1) in row `row`; the first `known` of them are the request's own tokens."""

    req: Req
    row: int
    tokens: list[int] = field(default_factory=list)
    known: int = 0


class DraftModel:
    """A draft model with its KV cache, drafting greedy chains for a batch of requests. `load`
    builds the model (before the target's KV pool is sized: `kv_share` splits the room between
    the two pools), `make_cache` its KV cache."""

    def __init__(
        self, model, model_config, config, vocab: int, device, dtype, context_len: int
    ) -> None:
        self.model = model
        self.model_config = model_config
        self.config = config  # (the engine's, with the draft model's path)
        self.vocab = vocab  # the ids both models' logits share
        self.device, self.dtype, self.context_len = device, dtype, context_len
        self._seen: dict[int, _Seen] = {}  # by id(req)
        self.graphs = None  # its decode steps' graphs (`use_graphs`)
        self.token_buf: torch.Tensor | None = None
        # candidates a draft holds (speculative_eagle_topk): 1, a chain; more, a tree of the
        # chain (speculative_draft_depth steps) and each step's next candidates as leaves
        self.width = config.speculative_eagle_topk
        self.depth = config.speculative_draft_depth

    @classmethod
    def load(cls, config, target_tokenizer, dtype, device, context_len: int) -> DraftModel:
        """The model at `config.speculative_draft_model_path` (a Hugging Face folder or a GGUF
        file), in the target's dtype on its device (no cache yet: `make_cache`); ValueError when
        its tokenizer is not the target's."""
        from radixlm.runtime import model_loader, startup
        from radixlm.runtime.model_config import ModelConfig
        from radixlm.runtime.model_setup import build_model

        path = config.speculative_draft_model_path
        folder = model_loader.resolve_model_folder(
            path, config.cache_dir, need_weights=config.load_format != "dummy"
        )
        tokenizer = model_loader.load_tokenizer(folder)
        if tokenizer.get_vocab() != target_tokenizer.get_vocab():
            raise ValueError(
                f"speculative_draft_model_path={path!r}: its tokenizer is not the target "
                "model's (STANDALONE drafts token ids the target reads as they are); use a "
                "draft model of the same tokenizer"
            )
        mc = ModelConfig.from_hf(model_loader.load_hf_config(folder))
        own = dataclasses.replace(config, model_path=str(path), quantization=None)
        vocab = min(len(tokenizer), mc.vocab_size)
        startup.say(f"building the draft model {folder.name} on {device}")
        model = build_model(own, folder, mc, dtype, device, context_len, vocab)
        return cls(model, mc, own, vocab, device, dtype, context_len)

    def kv_share(self, num_slots: int, target_bytes_per_slot: int) -> int:
        """The slots each of the two pools gets when the target alone would have `num_slots`:
        every token a request holds needs a slot in both, so the room the target's pool would
        take is split in the ratio of their bytes per slot."""
        if self.config.max_total_tokens is not None:
            return num_slots  # (asked for: both pools hold that many)
        from radixlm.runtime.engine_core import kv_bytes_per_slot

        own = kv_bytes_per_slot(self.config, self.model_config, self.dtype)
        return max(16, num_slots * target_bytes_per_slot // (target_bytes_per_slot + own))

    def make_cache(self, num_slots: int) -> None:
        """Its KV pool of `num_slots` tokens, request table, slot allocator and attention
        backend; on a GPU, the graphs of its decode steps."""
        from radixlm.runtime.attention import create_backend
        from radixlm.runtime.model_setup import build_kv_pool

        config, device = self.config, self.device
        self.kv_pool = build_kv_pool(config, self.model_config, num_slots, self.dtype, device)
        self.rows = ReqToTokenPool(config.max_running_requests + 1, self.context_len + 1, device)
        self.backend = create_backend(
            config.attention_backend, self.kv_pool, self.rows.table, device,
            num_q_heads=self.model_config.num_heads,
        )  # fmt: skip
        self.allocator = SlotAllocator(self.kv_pool.num_slots)
        if device.type == "cuda" and not config.disable_cuda_graph:
            self.use_graphs(config.cuda_graph_max_bs or min(config.max_running_requests, 256))

    def use_graphs(self, max_batch: int, capture: bool = True) -> None:
        """Run the decode steps through runtime/cuda_graph.py DecodeGraphs of up to `max_batch`
        requests, after tuning the model's batch-1 matmuls (as the target's are); capture=False
        runs the same padded steps eagerly (a CPU test of this path)."""
        from radixlm.runtime.cuda_graph import DecodeGraphs

        if capture:
            from radixlm.runtime.engine_core import tune_small_matmuls

            tune_small_matmuls(self.model)
        self.token_buf = torch.zeros(self.rows.max_requests, dtype=torch.int64, device=self.device)
        self.graphs = DecodeGraphs(
            self.model, self.backend, self.rows.table, self.token_buf, max_batch,
            capture=capture, padding_row=self.rows.padding_row,
        )  # fmt: skip

    # ---- drafting ----------------------------------------------------------------------------

    @torch.inference_mode()
    def draft(self, reqs: list[Req], num: int) -> list[list[int] | tuple[int, ...]]:
        """Each request's greedy chain of `num` tokens after its newest one ([] for a request
        the cache has no room for this step). With `width` above 1, a tree of at most `num`
        nodes instead (eagle3.py `draft_tree`): a chain of `depth` steps and, at each, the
        draft model's next width - 1 candidates as leaves, the likeliest nodes kept."""
        self._forget_finished()
        steps = min(num, self.depth) if self.width > 1 else num
        seen = [self._catch_up_to(r) for r in reqs]
        new = [r.ids_slice(s.known) if s is not None else [] for r, s in zip(reqs, seen)]
        fits = self._make_room(
            [len(n) + steps - 1 for n, s in zip(new, seen) if s is not None], reqs
        )
        chosen = [i for i, s in enumerate(seen) if s is not None and fits]
        chains: list[list[int] | tuple[int, ...]] = [[] for _ in reqs]
        if not chosen or num <= 0:
            return chains
        tops: list[tuple[torch.Tensor, torch.Tensor]] | None = [] if self.width > 1 else None
        if self.graphs is not None and self.graphs.can_run(len(chosen)):
            made = self._stepped([seen[i] for i in chosen], [new[i] for i in chosen], steps, tops)
        else:
            made = self._eager_steps(
                [seen[i] for i in chosen], [new[i] for i in chosen], steps, tops
            )
        if tops is None:
            for i, chain in zip(chosen, made):
                chains[i] = chain
            return chains
        from radixlm.runtime.speculative.eagle3 import draft_tree

        probs = torch.stack([p for p, _ in tops], dim=1).tolist()  # (requests, steps, width + 1)
        ids = torch.stack([t for _, t in tops], dim=1).tolist()
        for i, chain, p, t in zip(chosen, made, probs, ids):
            chains[i] = draft_tree(chain, p, t, self.width, num)
        return chains

    def _eager_steps(
        self, seen: list[_Seen], new: list[list[int]], steps: int, tops=None
    ) -> list[list[int]]:
        """`draft` eagerly: the unseen tokens of each request in one forward, then one decode
        forward a further draft token; `tops` gets each step's candidates (`_top`)."""
        order = sorted(range(len(seen)), key=lambda k: len(new[k]) == 1)  # (ForwardBatch's order)
        seen, new = [seen[k] for k in order], [new[k] for k in order]
        chains: list[list[int]] = [[] for _ in seen]
        last = self._forward(seen, new, tops)
        for _ in range(steps):
            for chain, token in zip(chains, last):
                chain.append(token)
            if len(chains[0]) == steps:
                break
            last = self._forward(seen, [[t] for t in last], tops)
        back = [0] * len(order)  # (in the order the requests came)
        for k, j in enumerate(order):
            back[j] = k
        if tops is not None:
            tops[:] = [(p[back], t[back]) for p, t in tops]
        return [chains[back[j]] for j in range(len(order))]

    def _stepped(
        self, seen: list[_Seen], new: list[list[int]], num: int, tops=None
    ) -> list[list[int]]:
        """`draft` through the decode graphs: a long catch-up eagerly first (all but its last
        token), the rest of the catch-up a decode step per token, then `num` steps whose inputs
        are the argmaxes before them, left in `token_buf`; one copy to the host at the end.
        `tops` gets each draft step's candidates (`_top`)."""
        long = [k for k, toks in enumerate(new) if len(toks) > _STEPPED_CATCH_UP]
        if long:
            self._forward([seen[k] for k in long], [new[k][:-1] for k in long])
            for k in long:
                new[k] = new[k][-1:]
        for c in range(max(map(len, new)) - 1):  # the catch-up's tokens but the last
            some = [k for k, toks in enumerate(new) if len(toks) - 1 > c]
            self._graph_step([seen[k] for k in some], [new[k][c] for k in some])
        drafted = [self._graph_step(seen, [toks[-1] for toks in new], tops).clone()]
        for _ in range(num - 1):
            drafted.append(self._graph_step(seen, None, tops).clone())
        chains = torch.stack(drafted, dim=1).tolist()
        for s, chain in zip(seen, chains):  # the draft tokens run over, known now
            s.tokens[len(s.tokens) - num + 1 :] = chain[:-1]
        return chains

    def _top(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's width + 1 likeliest tokens (its argmax and its rivals) as (probabilities,
        ids), likeliest first."""
        probs = logits[:, : self.vocab].float().softmax(dim=-1)
        return probs.topk(self.width + 1, dim=-1)

    def _graph_step(self, seen: list[_Seen], tokens: list[int] | None, tops=None) -> torch.Tensor:
        """One decode step of the graphs over seen's requests, each computing `tokens[i]` (None:
        the token the step before left in `token_buf`) after what it holds; their argmaxes, on
        the device (a view of the graph's output). `tops`: the step's candidates appended."""
        rows = [s.row for s in seen]
        if tokens is not None:
            at = to_device(int64_tensor(rows), self.device)
            self.token_buf[at] = to_device(int64_tensor(tokens), self.device)
        slots = self.allocator.allocate(len(seen))
        seq_lens = []
        for s, token in zip(seen, tokens or [-1] * len(seen)):
            s.tokens.append(token)  # (-1: a draft token, written in by `_stepped`)
            seq_lens.append(len(s.tokens))
        self.rows.write_next_host(rows, seq_lens, slots)  # (the step writes the device's)
        logits, argmax = self.graphs.run(rows, seq_lens, slots)
        if tops is not None:  # (before the next replay overwrites the graph's logits)
            tops.append(self._top(logits))
        return argmax

    def _forward(self, seen: list[_Seen], tokens: list[list[int]], tops=None) -> list[int]:
        """Run the draft model over `tokens[i]` after what seen[i] holds (slots allocated, the
        request table written), and return each request's argmax after its last token (`tops`:
        the candidates there appended)."""
        rows, prefix, extend, ids, positions, logits_rows = [], [], [], [], [], []
        for s, toks in zip(seen, tokens):
            start = len(s.tokens)
            slots = self.allocator.allocate(len(toks))
            self.rows.write(s.row, start, slots)
            s.tokens.extend(toks)
            rows.append(s.row)
            prefix.append(start)
            extend.append(len(toks))
            ids.extend(toks)
            positions.extend(range(start, start + len(toks)))
            logits_rows.append(len(ids) - 1)
        ids_t, pos_t, rows_t, prefix_t, extend_t, logits_t = (
            to_device(int64_tensor(x), self.device)
            for x in (ids, positions, rows, prefix, extend, logits_rows)
        )
        token_rows = to_device(
            int64_tensor([r for r, n in zip(rows, extend) for _ in range(n)]), self.device
        )
        batch = ForwardBatch(
            input_ids=ids_t,
            positions=pos_t,
            out_cache_loc=self.rows.table[token_rows, pos_t].long(),
            req_pool_indices=rows_t,
            prefix_lens=prefix_t,
            extend_lens=extend_t,
            seq_lens=prefix_t + extend_t,
            logits_indices=logits_t,
            extend_lens_cpu=extend,
            prefix_lens_cpu=prefix,
            num_multi=sum(n > 1 for n in extend),
        )
        logits = self.model(batch, self.backend)
        if tops is not None:
            tops.append(self._top(logits))
        return logits[:, : self.vocab].argmax(dim=-1).tolist()

    # ---- the cache ---------------------------------------------------------------------------

    def _catch_up_to(self, req: Req) -> _Seen | None:
        """`req`'s entry, holding only the KV of its own tokens (the draft tokens the target did
        not take freed) and at least one token short of its context (the newest token's logits
        are what the first draft token comes from); None when no request row is free."""
        s = self._seen.get(id(req))
        if s is None:
            if not self.rows.num_free:
                return None
            s = self._seen[id(req)] = _Seen(req, self.rows.allocate())
        ids = req.input_ids
        out = req.output_ids
        n = len(ids) + len(out)

        def token(i: int) -> int:
            return ids[i] if i < len(ids) else out[i - len(ids)]

        keep = min(len(s.tokens), n - 1)
        if s.known and (s.known > n or s.tokens[s.known - 1] != token(s.known - 1)):
            s.known = 0  # (the context was rewritten: compared from the start)
        at = s.known
        while at < keep and s.tokens[at] == token(at):
            at += 1
        self._truncate(s, at)
        s.known = at
        return s

    def _truncate(self, s: _Seen, length: int) -> None:
        if length < len(s.tokens):
            held = self.rows.read(s.row, len(s.tokens))
            self.allocator.free(held[length:])
            del s.tokens[length:]

    def _drop(self, key: int) -> None:
        s = self._seen.pop(key)
        self._truncate(s, 0)
        self.rows.free(s.row)

    def _forget_finished(self) -> None:
        for key in [k for k, s in self._seen.items() if s.req.is_finished]:
            self._drop(key)

    def _make_room(self, need: list[int], keep: list[Req]) -> bool:
        """Whether `sum(need)` slots are free, after dropping the caches of requests outside
        `keep` if they are not."""
        total = sum(need)
        if self.allocator.can_allocate(total):
            return True
        kept = {id(r) for r in keep}
        for key in [k for k in self._seen if k not in kept]:
            self._drop(key)
            if self.allocator.can_allocate(total):
                return True
        return self.allocator.can_allocate(total)

    def release_all(self) -> None:
        """Forget every request (the engine's cache flush)."""
        for key in list(self._seen):
            self._drop(key)
