"""Output processing: what each step's sampled tokens do to their requests.

The engine core's loop decides what runs and launches it; this module takes what came back. It
owns the table of the engine's unfinished requests and their sinks, appends tokens (one a step, or
several at once for a step that verified a draft), advances grammars, jumps over forced text,
checks stops and lengths, finishes requests and delivers their progress. All of it runs on the core
thread. An error in one request's token fails that request, never the engine.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from radixlm.protocol.prompt_tokens import text_ids
from radixlm.runtime.request import Req, ReqStatus

logger = logging.getLogger(__name__)

Sink = Callable[[Req, bool], None]  # (request, finished) -> None
# The shortest forced text jumped over while the request has a step in flight, which the jump
# costs: about 3 tokens in a small batch, where the device's step is the time; about 10 in a large
# one, where the host's work is and the jump also waits for the masks filling in the background
# (measured on the H200 with 88 requests: 0.41x of unconstrained jumping from 8 bytes, 0.68x from 32)
_MIN_JUMP_BYTES_IN_FLIGHT = 8
_MIN_JUMP_BYTES_IN_FLIGHT_LARGE_BATCH = 32
_LARGE_BATCH = 16


class SamplingFailed(RuntimeError):
    """One request's token could not be sampled (the rest of its step's were)."""


class OutputProcessor:
    """The engine's unfinished requests, and what their tokens do to them.

    A request is tracked from the inbox (`track`: its sinks), waits in `grammar_queue` while its
    grammar compiles, is counted in once the scheduler has it (`register`), and leaves with
    `finish`. `apply_step` takes a whole step's tokens; `apply_tokens` takes several tokens of one
    request at once."""

    def __init__(
        self,
        cache,
        scheduler,
        *,
        enable_jump_forward: bool,
        abort: Callable[[str], None],
        speculative=None,
    ) -> None:
        self.cache = cache
        self.speculative = speculative  # counts verified drafts (runtime/speculative/worker.py)
        self.scheduler = scheduler
        self.enable_jump_forward = enable_jump_forward
        self._abort = abort  # asks the core to abort a request (a sink that failed)
        self.reqs: dict[str, Req] = {}  # the scheduler's unfinished requests
        self.grammar_queue: dict[str, Req] = {}  # grammar still compiling: not yet the scheduler's
        self.sinks: dict[str, Sink] = {}
        self.progress: dict[str, Sink] = {}  # the sinks that also want every step's progress
        self.num_generated_tokens = 0
        self.num_jump_forward_tokens = 0
        self.num_lockstep = 0  # unfinished requests whose steps need the previous step's tokens
        self.num_not_greedy = 0  # unfinished requests that are not plain greedy
        # unfinished requests sampled as the host says: grammar masks, penalties over the output
        self.num_sampled_on_host = 0

    # ---- the request table ----------------------------------------------------------------

    def track(self, req: Req, sink: Sink, progress: bool) -> None:
        self.sinks[req.rid] = sink
        if progress:
            self.progress[req.rid] = sink

    def register(self, req: Req) -> None:
        """`req` is the scheduler's now: counted among the running ones until it finishes."""
        lockstep, not_greedy, on_host = (
            req.needs_lockstep,
            not req.plain_greedy,
            req.sampled_on_host,
        )
        self.reqs[req.rid] = req
        self.num_lockstep += lockstep
        self.num_not_greedy += not_greedy
        self.num_sampled_on_host += on_host

    def get(self, rid: str) -> Req | None:
        return self.reqs.get(rid) or self.grammar_queue.get(rid)

    # ---- a step's tokens --------------------------------------------------------------------

    def apply_step(self, plan, results, next_masks=None) -> None:
        """Every token of a step: the grammars take theirs together, then each request its own.
        `next_masks` (the next step's deferred sampling) begins filling masks as soon as the
        grammars have advanced."""
        tokens, extras = results.tokens, results.extras
        if self.num_sampled_on_host:
            self._advance_grammars(plan, tokens)
            if next_masks is not None:  # filled in the background while this step is applied
                next_masks.begin_masks()
        apply = self._apply_contained
        if extras:
            for i, req in enumerate(plan.decodes):
                if req.num_discard:
                    req.num_discard -= 1
                    continue
                if req.num_pending:
                    req.num_pending -= 1
                apply(req, tokens[i], extras.get(i))
        else:
            self._apply_decodes(plan.decodes, tokens)
        verified = results.verified
        if verified:
            self._truncate_chains(plan, verified)
        for i, item in enumerate(plan.items, len(plan.decodes)):
            req = item.req
            if item.samples and req.num_discard:
                req.num_discard -= 1
                continue
            if item.samples and req.num_pending:
                req.num_pending -= 1
            if verified and i in verified:
                self._apply_verified(req, len(item.draft), verified[i])
            else:
                apply(req, tokens[i], extras.get(i) if extras else None)

    def _truncate_chains(self, plan, verified: dict[int, list[int]]) -> None:
        """The K/V of every verified chain's rejected draft positions dropped at once, before
        the step's tokens are applied (what `_apply_verified` would drop of each in turn): the
        newest token's and the accepted tokens' stay, and the last token, as after any step,
        has none yet."""
        reqs, lengths = [], []
        for i, item in enumerate(plan.items, len(plan.decodes)):
            tokens = verified.get(i)
            req = item.req
            if (
                tokens is None
                or getattr(tokens, "nodes", None) is not None  # (a tree: _apply_verified's)
                or (item.samples and req.num_discard)  # (its tokens are not applied)
                or req.status is ReqStatus.FINISHED  # (aborted meanwhile: memory released)
            ):
                continue
            reqs.append(req)
            lengths.append(req.num_tokens + len(tokens) - 1)
        if reqs:
            self.cache.truncate_many(reqs, lengths)

    def _apply_verified(self, req: Req, num_drafted: int, tokens: list[int]) -> None:
        """A verified draft's tokens (accepted draft tokens, then the target's own); a chain's
        rejected positions were dropped by `_truncate_chains`. For a draft tree `tokens`
        carries the accepted path's nodes (runtime/speculative/tree.py Accepted): the accepted
        path's slots go to its positions here."""
        if req.status is ReqStatus.FINISHED:  # (aborted meanwhile: its memory is released)
            return
        accepted = len(tokens) - 1
        nodes = getattr(tokens, "nodes", None)
        if nodes is not None:
            self.cache.keep_path(req, req.num_tokens - 1, num_drafted, nodes)
        if self.speculative is not None:  # (before: the tokens may finish it, and its meta_info
            # is made then; what the verify accepted counts, a stop among them or not)
            self.speculative.record(req, num_drafted, len(tokens), accepted)
        self.apply_tokens(req, tokens)

    def apply_tokens(self, req: Req, tokens: Sequence[int], extras: Sequence[Any] = ()) -> int:
        """Several tokens of one request at once (a verified draft), each taken as a step's
        token would be, up to the one that finishes it; its sink hears once. Jump-forward looks
        only after the last. Returns how many were taken."""
        taken = 0
        try:
            for i, token in enumerate(tokens):
                if req.status is ReqStatus.FINISHED:
                    break
                extra = extras[i] if i < len(extras) else None
                if extra is not None and extra.error is not None:
                    raise SamplingFailed(extra.error)
                taken += 1
                if not self._take(req, token, extra, jump=i == len(tokens) - 1):
                    return taken  # it failed itself, or was a prompt scored alone: finished
            self._settle(req)
        except Exception as e:
            self.contain(req, e)
        return taken

    @staticmethod
    def _advance_grammars(plan, tokens: list[int | None]) -> None:
        """The step's grammars take their tokens together (in the grammar backend's threads,
        where it has them), before each request's token is applied in turn."""
        matchers, taken = [], []
        sampled = [*plan.decodes, *(it.req if it.samples else None for it in plan.items)]
        for req, token in zip(sampled, tokens):
            if (
                req is not None
                and req.grammar is not None
                and token is not None
                and not req.num_discard
                and not req.is_finished
            ):
                matchers.append(req.grammar)
                taken.append(token)
        if matchers:
            from radixlm.constrained import accept_next_tokens

            accept_next_tokens(matchers, taken)

    def _apply_contained(self, req: Req, token: int | None, extra) -> None:
        try:
            if extra is not None and extra.error is not None:
                raise SamplingFailed(extra.error)
            self._apply(req, token, extra)
        except Exception as e:
            self.contain(req, e)

    def contain(self, req: Req, e: Exception) -> None:
        """An error sampling or applying one request's token (its grammar's mask, detokenizer,
        stop checks) fails that request, not the engine with everyone in it."""
        what = "sampling" if isinstance(e, SamplingFailed) else "applying"
        logger.exception("%s a token of request %s failed", what, req.rid)
        if req.rid not in self.reqs:  # (finished already)
            return
        if req.status is ReqStatus.FINISHED:  # failed inside finish: its memory is in doubt
            raise e
        if req.pool_row is not None and req.kv_len > len(req.all_ids):
            # its token was not applied: the K/V that a step in flight computes for it belongs to
            # no token (a step launched later may reuse the slot: it runs after that one)
            self.cache.truncate(req, len(req.all_ids))
        why = str(e) if isinstance(e, SamplingFailed) else f"{type(e).__name__}: {e}"
        self.fail(req, f"internal error {what} its token: {why}")

    def _apply_decodes(self, reqs: list[Req], tokens: list[int]) -> None:
        """`_apply` for a step's decodes when no request asked for log-probabilities, with the
        common case inline: a request that is running, has a first token already, looks for no
        stop strings and records no log-probabilities (`Req.applied_inline`), whose token does
        not finish it, after its grammar, if it has one, takes the token."""
        progress = self.progress
        running = ReqStatus.RUNNING
        jump = self.enable_jump_forward
        inline = 0
        for req, token in zip(reqs, tokens):
            if req.num_discard:  # computed before jump-forward changed its text
                req.num_discard -= 1
                continue
            if req.num_pending:
                req.num_pending -= 1
            out = req.output_ids
            try:
                if (
                    req.status is not running
                    or not out
                    or token in req.finish_token_ids
                    or len(out) + 1 >= req.max_output_len
                    or not req.applied_inline
                ):
                    self._apply(req, token, None)
                    continue
                grammar = req.grammar
                if grammar is not None and not grammar.accept_token(token):
                    self._apply(req, token, None)  # (it fails there, with its own message)
                    continue
                out.append(token)
                req.detokenizer.add_one(token)
                if grammar is not None:
                    if grammar.is_terminated():  # complete: it finishes now
                        self.num_generated_tokens += 1
                        self._check_stop_or_length(req)
                        self._settle(req)
                        continue
                    if jump:
                        self._jump_forward(req)
                        if req.status is not running:  # (the jump finished it)
                            self.num_generated_tokens += 1
                            self._settle(req)
                            continue
                inline += 1
                if progress:
                    sink = progress.get(req.rid)
                    if sink is not None:
                        self.deliver(req, sink, False)
            except Exception as e:
                self.contain(req, e)
        self.num_generated_tokens += inline

    def _apply(self, req: Req, token: int | None, extra) -> None:
        """Take one step's result for `req`: its new token (None if the step did not end at its
        newest token) and any log-probabilities. Runs for every request every step: keep it lean."""
        if self._take(req, token, extra, jump=True):
            self._settle(req)

    def _take(self, req: Req, token: int | None, extra, jump: bool) -> bool:
        """Append `token` (and its log-probabilities) to `req`, without telling its sink; False
        when that finished the request already (a failure, a prompt scored alone), which then
        needs nothing more."""
        if req.status is ReqStatus.FINISHED:
            return False
        if extra is not None and extra.input_logprobs:
            req.input_token_logprobs.extend(extra.input_logprobs)
            req.input_top_logprobs.extend(extra.input_top_logprobs)
        if token is None:
            return True
        output_ids = req.output_ids
        if not output_ids:
            if req.params.max_new_tokens == 0:  # prompt scoring only
                req.finish({"type": "length", "length": 0})
                self.finish(req)
                return False
            req.first_token_time = time.perf_counter()
        output_ids.append(token)
        self.num_generated_tokens += 1
        if req.logprob.return_logprob:
            lp, top = (extra.logprob, extra.top_logprobs) if extra is not None else (None, None)
            req.output_token_logprobs.append((lp, token))
            req.output_top_logprobs.append(top)
        grammar = req.grammar
        if grammar is not None and not grammar.accept_token(token):
            if not grammar.next_token_mask().any():  # every token masked: none was allowed
                self.fail(
                    req,
                    "the grammar cannot go on: no token of this model's vocabulary continues it "
                    "here (it asks for text the tokenizer cannot produce)",
                )
            else:
                self.fail(req, f"internal error: the grammar refused the sampled token {token}")
            return False
        if token in req.finish_token_ids:
            req.finish({"type": "stop", "matched": token})
        else:
            detokenizer = req.detokenizer
            detokenizer.add_one(token)
            if (
                detokenizer.matched_stop is not None
                or len(output_ids) >= req.max_output_len
                or (grammar is not None and grammar.is_terminated())
            ):
                self._check_stop_or_length(req)
            elif jump and grammar is not None and self.enable_jump_forward:
                self._jump_forward(req)
        return True

    def _settle(self, req: Req) -> None:
        """After its tokens: a finished request leaves, a running one shows its progress."""
        if req.status is ReqStatus.FINISHED:
            self.finish(req)
        else:
            sink = self.progress.get(req.rid)
            if sink is not None:
                self.deliver(req, sink, False)

    def _check_stop_or_length(self, req: Req) -> None:
        if req.detokenizer.matched_stop is not None:
            req.finish({"type": "stop", "matched": req.detokenizer.matched_stop})
        elif req.grammar is not None and req.grammar.is_terminated():
            # complete, and nothing but EOS may follow: done now, not a step (or, at the length
            # limit, a "length") later; matched: its last token, as SGLang reports it
            req.finish({"type": "stop", "matched": req.output_ids[-1]})
        elif len(req.output_ids) >= req.max_output_len:
            req.finish({"type": "length", "length": len(req.output_ids)})

    def _jump_forward(self, req: Req) -> None:
        """Append the text the grammar forces next, tokenized the way the tokenizer tokenizes the
        whole output, so the next step computes it in one forward instead of a token a step.

        Where the forced text changes how the end of the output tokenizes (the model wrote `{` and
        `"` where the tokenizer has `{"`), those last tokens are rolled back (grammar state and KV)
        and replaced by the canonical ones. Skipped with log-probabilities on: forced tokens have
        none."""
        if req.logprob.return_logprob:
            return
        grammar = req.grammar
        text = grammar.jump_forward_string()
        if not text:
            return
        if req.num_pending:
            # with a step in flight, a jump costs that step (its token is dropped) and the next
            # one: a short forced text is cheaper sampled a token a step under the mask
            large = len(self.scheduler.running) >= _LARGE_BATCH
            if len(text.encode()) < (
                _MIN_JUMP_BYTES_IN_FLIGHT_LARGE_BATCH if large else _MIN_JUMP_BYTES_IN_FLIGHT
            ):
                return
        tokenizer = req.detokenizer.tokenizer
        ids = req.output_ids
        full = text_ids(tokenizer, tokenizer.decode(ids) + text)
        keep = _common_prefix_len(full, ids)
        dropped = ids[keep:]
        # no further than the request may go, and no more forced tokens than the grammar can
        # undo should one be refused (the rest come at the next jump)
        full = full[: min(req.max_output_len, keep + grammar.max_rollback)]
        if len(full) <= len(ids) or len(req.input_ids) + keep < req.locked_len:
            return  # nothing gained, or the tokens to replace belong to the prefix cache
        if len(dropped) > grammar.rollback_depth:
            return  # the model's own tokens to replace go back further than the grammar can undo
        grammar.rollback(len(dropped))
        accepted = grammar.accept_tokens(full[keep:])
        if accepted < len(full) - keep:  # restore the state the model's own tokens gave
            grammar.rollback(accepted)
            grammar.accept_tokens(dropped)
            return
        if dropped:
            self.cache.truncate(req, min(req.kv_len, len(req.input_ids) + keep))
            del ids[keep:]
            req.detokenizer.reset(ids)
        self.num_jump_forward_tokens += len(full) - len(ids)
        extra = full[len(ids) :]
        ids.extend(extra)
        req.token_in_buf = False  # its newest tokens are forced ones, on the host
        # a step in flight (overlap) sampled its next token after the text before the jump:
        # that token is dropped when it arrives, and the next step computes the forced text
        req.num_discard += req.num_pending
        req.num_pending = 0
        req.detokenizer.add(extra)
        self._check_stop_or_length(req)  # (the forced text may complete the grammar)

    # ---- finishing ----------------------------------------------------------------------------

    def fail_step(self, plan, e: Exception) -> None:
        """A step that raised as a whole fails the requests in it."""
        logger.error("step failed: %s\n%s", e, traceback.format_exc())
        for item in plan:
            req = item.req
            req.num_pending = 0
            if req.is_finished:
                continue
            keep = max(item.start, req.locked_len)
            if req.pool_row is not None and req.kv_len > keep:
                # the step's positions have no K/V: they must not reach the prefix cache. (A step
                # that fails after its launch has shared its prompt chunk with the cache already;
                # only a device error fails there, which leaves the engine unusable anyway.)
                self.cache.truncate(req, keep)
            self.fail(req, f"internal error during the forward step: {e}")

    def fail_all(self, message: str, more: list[tuple[Req, Sink]]) -> None:
        """Finish every request, tracked or only just submitted (`more`), with `message`."""
        for req, sink in more:
            self.sinks[req.rid] = sink
            self.reqs[req.rid] = req
        for req in [*self.reqs.values(), *self.grammar_queue.values()]:
            try:
                self.fail(req, message)
            except Exception:  # the state may be what broke: still tell the caller
                try:
                    req.fail(message)
                    sink = self.sinks.pop(req.rid, None)
                    if sink is not None:
                        sink(req, True)
                except Exception:
                    logger.exception("could not fail request %s", req.rid)

    def finish(self, req: Req) -> None:
        if self.grammar_queue.pop(req.rid, None) is None:
            self.scheduler.remove(req)
        try:
            self._final_text(req)
        except Exception as e:  # this request's own text failed it; the engine goes on
            logger.exception("finishing the text of request %s failed", req.rid)
            req.fail(f"finishing the output failed: {type(e).__name__}: {e}")
        if self.reqs.pop(req.rid, None) is not None:
            self.num_lockstep -= req.needs_lockstep
            self.num_not_greedy -= not req.plain_greedy
            self.num_sampled_on_host -= req.sampled_on_host
        self.progress.pop(req.rid, None)
        sink = self.sinks.pop(req.rid, None)
        if sink is not None:
            self.deliver(req, sink, True)

    @staticmethod
    def _final_text(req: Req) -> None:
        req.detokenizer.flush()
        matched = req.detokenizer.matched_stop
        if matched is not None and (req.finish_reason or {}).get("type") in ("length", "stop"):
            # a stop string the held bytes completed: the text ends there, so does the reason
            req.finish_reason = {"type": "stop", "matched": matched}
        grammar = getattr(req.grammar, "grammar", None)
        if grammar is not None and grammar.lenient:  # skipped keywords: check what was made
            req.grammar_validation = grammar.validate_output(req.detokenizer.text)

    def deliver(self, req: Req, sink: Sink, finished: bool) -> None:
        """Run a request's sink: the caller's code (a closed event loop raises there), so an error
        in it costs that request, aborted, and not the engine with everyone else's."""
        try:
            sink(req, finished)
        except Exception:
            logger.exception("the sink of request %s failed; it is aborted", req.rid)
            self.progress.pop(req.rid, None)
            self.sinks.pop(req.rid, None)
            if not finished:
                self._abort(req.rid)

    def fail(self, req: Req, message: str) -> None:
        req.fail(message)
        self.finish(req)


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
