"""Overlapped scheduling (step N+1 launched before step N's tokens are applied) gives exactly the
outputs of the plain loop: for every way a request ends (length, EOS, stop string, stop token), with
seeded sampling and min_new_tokens, under preemption in a small KV pool, and with requests that
force the loop back to lockstep (log-probabilities, penalties, grammars) in the same batch."""

from __future__ import annotations

import pytest

import radixlm
from tests.prompts import varied_prompts


def workload(tokenizer):
    prompts = varied_prompts()[:12]
    eos = tokenizer.eos_token_id
    params = [
        {"max_new_tokens": 24, "temperature": 0},
        {"max_new_tokens": 40, "temperature": 0, "stop": [".", "\n"]},
        {"max_new_tokens": 1, "temperature": 0},
        {"max_new_tokens": 30, "temperature": 0.9, "seed": 5, "top_p": 0.9},
        {"max_new_tokens": 16, "temperature": 0, "min_new_tokens": 12},
        {"max_new_tokens": 20, "temperature": 0, "stop_token_ids": [eos]},
        {"max_new_tokens": 33, "temperature": 1.2, "seed": 9, "top_k": 20, "ignore_eos": True},
        {"max_new_tokens": 8, "temperature": 0, "n": 3},
        {"max_new_tokens": 25, "temperature": 0.7, "seed": 1, "n": 2},
        {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
        {"max_new_tokens": 50, "temperature": 0},
        {"max_new_tokens": 6, "temperature": 0},
    ]
    return prompts, params


def run(folder, tokenizer, overlap: bool, extra=None, **engine_kw):
    prompts, params = workload(tokenizer)
    if extra:
        prompts, params = prompts + extra[0], params + extra[1]
    # on the CPU in float32: the reference path, where batch shape cannot move a rounding
    with radixlm.Engine(
        folder, device="cpu", dtype="float32", disable_overlap_schedule=not overlap, **engine_kw
    ) as eng:
        outs = eng.generate(prompts, params)
        stats = eng.get_stats()
    return [(o["output_ids"], o["meta_info"]["finish_reason"], o["text"]) for o in outs], stats


@pytest.mark.parametrize("small_pool", [False, True])
def test_overlapped_loop_equals_the_plain_loop(default_model_folder, tokenizer, small_pool):
    kw = {"max_total_tokens": 160, "max_running_requests": 8} if small_pool else {}
    plain, _ = run(default_model_folder, tokenizer, False, **kw)
    overlapped, stats = run(default_model_folder, tokenizer, True, **kw)
    assert stats["overlapped_steps"] > 10  # the overlapped path did run
    if small_pool:
        assert stats["num_preemptions"] > 0
    assert overlapped == plain


def test_requests_that_need_lockstep_share_the_batch(default_model_folder, tokenizer):
    extra = (
        ["The first three prime numbers are", "My favourite colour is", "List two fruits:"],
        [
            {"max_new_tokens": 10, "temperature": 0, "frequency_penalty": 0.5},
            {"max_new_tokens": 10, "temperature": 0, "regex": "(red|green|blue)"},
            {"max_new_tokens": 10, "temperature": 0, "repetition_penalty": 1.3},
        ],
    )
    plain, _ = run(default_model_folder, tokenizer, False, extra)
    overlapped, _ = run(default_model_folder, tokenizer, True, extra)
    assert overlapped == plain


def test_requests_arriving_mid_decode_keep_the_overlap(default_model_folder):
    """A request arriving while others decode joins the next step beside the step in flight:
    no step is applied early for it (each arrival used to complete the step in flight first,
    launching the next with nothing in flight), and every output is what it is without the
    staggering."""
    import asyncio

    prompts = varied_prompts()[:7]
    long = {"max_new_tokens": 60, "temperature": 0, "ignore_eos": True}
    short = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    with radixlm.Engine(default_model_folder, device="cpu", dtype="float32") as eng:
        core, events = eng._core, []
        launch, complete = core.runner.launch, core._complete
        core.runner.launch = lambda *a, **k: (events.append("L"), launch(*a, **k))[1]
        core._complete = lambda *a: (events.append("C"), complete(*a))[1]

        async def staggered():
            first = asyncio.ensure_future(eng.async_generate(prompts[0], long))
            later = []
            for prompt in prompts[1:]:
                await asyncio.sleep(0.05)
                later.append(asyncio.ensure_future(eng.async_generate(prompt, short)))
            return await asyncio.gather(first, *later)

        outs = asyncio.run(staggered())
        core.runner.launch, core._complete = launch, complete
        together = eng.generate(prompts, [long] + [short] * 6)
    assert events.count("L") > 40
    # a launch with nothing in flight is followed by the next launch, with no completion between
    assert not [i for i in range(1, len(events) - 1) if events[i] == events[i + 1] == "L"]
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in together]


def test_the_quick_case_of_a_steps_lists_equals_the_general_one(default_model_folder):
    """_step_lists builds a plain decode's entries in a quick case: every eager step of a mixed
    workload (prompt chunks beside decodes, tokens still on the device under overlap, input
    log-probabilities, a grammar) gives the lists the general path gives."""
    import dataclasses

    from radixlm.runtime.model_runner import ModelRunner

    checked = []
    quick = ModelRunner._step_lists

    def both(self, items):
        out = quick(self, items)
        self._plain_decode = lambda it: False  # (the instance's: the general path only)
        try:
            general = quick(self, items)
        finally:
            del self._plain_decode
        assert dataclasses.asdict(out) == dataclasses.asdict(general)
        checked.append(sum(ModelRunner._plain_decode(it) for it in items))
        return out

    prompts = varied_prompts()[:10]
    params = [{"max_new_tokens": 12 + 3 * i, "temperature": 0} for i in range(10)]
    params[3]["json_schema"] = '{"type": "object", "properties": {"a": {"type": "integer"}}}'
    with radixlm.Engine(
        default_model_folder, device="cpu", dtype="float32", chunked_prefill_size=16
    ) as eng:
        ModelRunner._step_lists = both
        try:
            eng.generate(prompts[:5], params[:5])
            eng.generate(prompts[5:], params[5:], return_logprob=True, logprob_start_len=0)
        finally:
            ModelRunner._step_lists = quick
    assert len(checked) > 10 and sum(checked) > 20  # (eager steps with plain decodes in them)
