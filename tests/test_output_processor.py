"""The output processor on its own: several tokens of one request taken at once (as a verified
speculative draft is) against the same tokens taken a step at a time, its plain twin."""

from __future__ import annotations

import pytest

from radixlm.protocol.sampling_params import SamplingParams
from radixlm.runtime.detokenizer import IncrementalDetokenizer
from radixlm.runtime.output_processor import OutputProcessor
from radixlm.runtime.request import Req, ReqStatus


class _Scheduler:
    def __init__(self) -> None:
        self.running: list[Req] = []
        self.removed: list[str] = []

    def remove(self, req: Req) -> None:
        self.removed.append(req.rid)


class _Cache:
    def truncate(self, req: Req, length: int) -> None:
        req.kv_len = min(req.kv_len, length)


@pytest.fixture(scope="module")
def hf_tokenizer(default_model_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_folder)


def _processor() -> tuple[OutputProcessor, _Scheduler]:
    scheduler = _Scheduler()
    return (
        OutputProcessor(_Cache(), scheduler, enable_jump_forward=True, abort=lambda rid: None),
        scheduler,
    )


def _req(tokenizer, rid: str, max_new_tokens: int, stop: list[str] | None = None) -> Req:
    params = SamplingParams(max_new_tokens=max_new_tokens, stop=stop or [])
    detok = IncrementalDetokenizer(tokenizer, stop=list(params.stop))
    req = Req(rid, [1, 2, 3], params, 0, detok, eos_token_ids=frozenset([tokenizer.eos_token_id]))
    req.max_output_len = max_new_tokens
    req.status = ReqStatus.RUNNING
    return req


def _run(tokenizer, tokens: list[int], at_once: bool, **req_args):
    """(output ids, text, finish reason, what the sink heard, tokens taken)"""
    processor, scheduler = _processor()
    req = _req(tokenizer, "r", **req_args)
    heard: list[tuple[int, bool]] = []
    processor.track(req, lambda r, done: heard.append((len(r.output_ids), done)), True)
    processor.register(req)
    if at_once:
        taken = processor.apply_tokens(req, tokens)
    else:
        taken = 0
        for token in tokens:
            if req.is_finished:
                break
            processor._apply(req, token, None)
            taken += 1
    finished = req.is_finished
    return req.output_ids, req.detokenizer.text, req.finish_reason, heard, taken, finished


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(
    "text, args, ends",
    [
        ("The cat sat on the mat.", {"max_new_tokens": 50}, None),  # all taken, still running
        ("The cat sat on the mat.", {"max_new_tokens": 3}, "length"),  # ends mid-draft
        ("The cat sat on the mat.", {"max_new_tokens": 50, "stop": [" on"]}, "stop"),
    ],
    ids=["running", "length", "stop-string"],
)
def test_tokens_taken_at_once_are_those_taken_a_step_at_a_time(hf_tokenizer, text, args, ends):
    tokens = _ids(hf_tokenizer, text)
    ids, out, reason, heard, taken, finished = _run(hf_tokenizer, tokens, True, **args)
    ids1, out1, reason1, heard1, taken1, finished1 = _run(hf_tokenizer, tokens, False, **args)
    assert (ids, out, reason, taken, finished) == (ids1, out1, reason1, taken1, finished1)
    assert heard == [heard1[-1]]  # one message for the whole draft: the last step's
    assert (reason or {}).get("type") == ends
    assert (taken < len(tokens)) == (ends is not None)  # what follows the end is not taken


def test_an_eos_inside_a_draft_ends_it_there(hf_tokenizer):
    eos = hf_tokenizer.eos_token_id
    tokens = [*_ids(hf_tokenizer, "Yes"), eos, *_ids(hf_tokenizer, " and more")]
    processor, scheduler = _processor()
    req = _req(hf_tokenizer, "r", 20)
    done: list[bool] = []
    processor.track(req, lambda r, finished: done.append(finished), False)
    processor.register(req)
    taken = processor.apply_tokens(req, tokens)
    assert taken == len(tokens) - len(_ids(hf_tokenizer, " and more"))
    assert req.finish_reason == {"type": "stop", "matched": eos}
    assert req.detokenizer.text == "Yes"
    assert done == [True] and scheduler.removed == ["r"]
    assert processor.reqs == {} and processor.sinks == {}


def test_a_failing_token_in_a_draft_fails_only_that_request(hf_tokenizer):
    class _Refusing:
        def accept_token(self, token: int) -> bool:
            return token != 99

        def next_token_mask(self):
            import torch

            return torch.ones(4, dtype=torch.bool)

        def is_terminated(self) -> bool:
            return False

        def jump_forward_string(self) -> str:
            return ""

    processor, _ = _processor()
    req = _req(hf_tokenizer, "r", 20)
    req.grammar = _Refusing()
    processor.track(req, lambda r, finished: None, False)
    processor.register(req)
    assert processor.num_sampled_on_host == 1
    assert processor.apply_tokens(req, [5, 99, 7]) == 2
    assert req.finish_reason["type"] == "abort"
    assert "refused the sampled token 99" in req.finish_reason["message"]
    assert processor.num_sampled_on_host == 0 and not processor.reqs
