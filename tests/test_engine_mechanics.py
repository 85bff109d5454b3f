"""KV pool and scheduler mechanics on a tiny random model: no slot is ever leaked or shared wrongly,
whatever arrives, finishes, is preempted or aborted."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

import radixlm
from tests.faults import fail_model_call


def owners_of_slots(core) -> dict[int, str]:
    """Every slot's owner (free list, prefix cache, or a running request); fails on a double owner."""
    owner: dict[int, str] = {}

    def claim(slots, who):
        for s in slots.tolist():
            assert s not in owner, f"slot {s} owned by {owner[s]} and {who}"
            owner[s] = who

    alloc = core.allocator
    claim(torch.cat([alloc._free, *alloc._pending]) if alloc._pending else alloc._free, "free")
    cache = core.cache.prefix_cache
    stack = list(getattr(cache, "root", None).children.values()) if hasattr(cache, "root") else []
    while stack:
        node = stack.pop()
        claim(node.slots, "cache")
        stack.extend(node.children.values())
    for req in core.scheduler.running:
        # the locked prefix belongs to the cache; the rest of the row to the request
        claim(core.rows.read(req.pool_row, req.kv_len)[req.locked_len :], f"req {req.rid}")
    return owner


@pytest.mark.parametrize("disable_radix_cache", [False, True])
def test_random_arrivals_finishes_and_aborts_keep_every_slot_owned_once(
    tiny_model_folder, disable_radix_cache
):
    rng = random.Random(1234)
    eng = radixlm.Engine(
        tiny_model_folder, max_total_tokens=400, chunked_prefill_size=24, max_running_requests=12,
        disable_radix_cache=disable_radix_cache,
    )  # fmt: skip
    core = eng._core
    capacity = core.allocator.capacity
    checks = []

    def check():
        owners = owners_of_slots(core)
        assert len(owners) == capacity and set(owners) == set(range(1, capacity + 1))
        checks.append(len(core.scheduler.running))

    shared = [rng.randrange(3, 40000) for _ in range(60)]  # a common prefix for some requests
    results = []
    try:

        def client(seed: int) -> None:
            r = random.Random(seed)
            for _ in range(12):
                length = r.randint(1, 150)
                ids = (shared[: r.randint(0, 60)] + [r.randrange(3, 40000) for _ in range(length)])[
                    :200
                ]
                params = {
                    "max_new_tokens": r.randint(1, 30),
                    "ignore_eos": True,
                    "temperature": r.choice([0, 1]),
                }
                if r.random() < 0.2:
                    stream = eng.generate(input_ids=ids, sampling_params=params, stream=True)
                    next(stream)
                    stream.close()  # aborts the request mid-way
                else:
                    out = eng.generate(input_ids=ids, sampling_params=params)
                    results.append((out, params))

        threads = [threading.Thread(target=client, args=(s,)) for s in range(6)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            core.call(check)
            for t in threads:
                t.join(timeout=0.05)
        core.call(check)
        stats = eng.get_stats()
    finally:
        eng.shutdown()
    assert len(results) > 40 and max(checks) > 1
    for out, params in results:
        assert len(out["output_ids"]) == params["max_new_tokens"], out["meta_info"]
        assert out["meta_info"]["finish_reason"] == {
            "type": "length",
            "length": params["max_new_tokens"],
        }
    assert stats["num_running_reqs"] == 0
    assert stats["kv_pool_free_tokens"] + stats["radix_cache_tokens"] == capacity
    assert stats["radix_cache_protected_tokens"] == 0


def test_request_too_large_for_the_pool_is_refused_and_others_still_run(tiny_model_folder):
    with radixlm.Engine(tiny_model_folder, max_total_tokens=64) as eng:
        with pytest.raises(ValueError, match="KV"):
            eng.generate(input_ids=list(range(10, 60)), sampling_params={"max_new_tokens": 40})
        out = eng.generate(
            input_ids=list(range(10, 30)),
            sampling_params={"max_new_tokens": 20, "ignore_eos": True},
        )
        assert len(out["output_ids"]) == 20


def test_a_failed_step_fails_its_requests_and_leaves_no_uncomputed_kv_in_the_cache(
    tiny_model_folder,
):
    prompt = list(range(500, 540))
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    with radixlm.Engine(tiny_model_folder) as eng:
        want = eng.generate(input_ids=prompt, sampling_params=params)["output_ids"]
    with radixlm.Engine(tiny_model_folder) as eng:
        fail_model_call(eng, 1)
        failed = eng.generate(input_ids=prompt, sampling_params=params)
        reason = failed["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "injected failure" in reason["message"], reason
        # the failed step computed nothing: none of its positions may go into the prefix cache
        assert eng.get_stats()["radix_cache_tokens"] == 0
        again = eng.generate(input_ids=prompt, sampling_params=params)
        assert again["output_ids"] == want
        stats = eng.get_stats()
        assert (
            stats["kv_pool_free_tokens"] + stats["radix_cache_tokens"]
            == stats["kv_pool_capacity_tokens"]
        )


def test_an_engine_made_under_inference_mode_serves(tiny_model_folder):
    """Its tensors are then inference tensors, which take in-place updates only in inference
    mode: the core thread runs in it (before, its first update killed the thread and every
    request waited forever)."""
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    with radixlm.Engine(tiny_model_folder) as eng:
        want = eng.generate(input_ids=[5, 6, 7], sampling_params=params)["output_ids"]
    with torch.inference_mode(), radixlm.Engine(tiny_model_folder) as eng:
        assert eng.generate(input_ids=[5, 6, 7], sampling_params=params)["output_ids"] == want


def test_an_internal_error_stops_the_engine_and_fails_every_request_with_its_message(
    tiny_model_folder,
):
    """A bug escaping the core loop (here in scheduling) must not leave callers waiting: the
    running requests finish with the error, later calls raise EngineShutDown naming it, and the
    engine reports itself dead."""
    from radixlm.errors import EngineShutDown

    params = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}
    with radixlm.Engine(tiny_model_folder) as eng:
        schedule = eng._core.scheduler.schedule
        calls = [0]

        def failing_schedule():
            calls[0] += 1
            if calls[0] == 5:
                raise KeyError("a scheduling bug")
            return schedule()

        eng._core.scheduler.schedule = failing_schedule
        results = []
        worker = threading.Thread(
            target=lambda: results.append(
                eng.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params=params)
            )
        )
        worker.start()
        worker.join(timeout=60)
        assert not worker.is_alive(), "generate waited forever"
        for out in results[0]:
            reason = out["meta_info"]["finish_reason"]
            assert reason["type"] == "abort" and "a scheduling bug" in reason["message"]
        assert not eng.is_alive()
        with pytest.raises(EngineShutDown, match="internal error.*a scheduling bug"):
            eng.generate(input_ids=[1, 2], sampling_params=params)
        with pytest.raises(EngineShutDown):
            eng.flush_cache()


def test_ids_past_the_tokenizers_vocabulary_are_never_sampled(tmp_path, default_model_folder):
    """A checkpoint whose vocabulary is padded past its tokenizer's (Qwen2.5's is): the padded
    ids' logits are -inf, even where their weights would make them the argmax; a logit_bias on
    one (it would do nothing) is refused, a stop id there is a row of the model and allowed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from radixlm.runtime.model_loader import copy_tokenizer_files

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152 + 64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # the padded rows far ahead of every real token's
        model.lm_head.weight[49152:] = model.lm_head.weight[:64] * 50
    model.save_pretrained(tmp_path)
    copy_tokenizer_files(default_model_folder, tmp_path)
    with radixlm.Engine(str(tmp_path)) as eng:
        outs = eng.generate(
            ["Hello", "One two"],
            [{"max_new_tokens": 16, "temperature": t, "ignore_eos": True} for t in (0, 1.0)],
        )
        assert eng.model.sampled_vocab == 49152
        with pytest.raises(ValueError, match=r"logit_bias token ids \[49160\] .*\[0, 49152\)"):
            eng.generate("Hello", {"logit_bias": {49160: 5}})
        stopped = {"max_new_tokens": 2, "stop_token_ids": [49160], "ignore_eos": True}
        assert len(eng.generate("Hello", stopped)["output_ids"]) == 2
    for out in outs:
        assert out["output_ids"] and max(out["output_ids"]) < 49152


def test_a_request_whose_text_cannot_be_finished_fails_alone(tiny_model_folder, monkeypatch):
    """An error finishing one request's text (its detokenizer, its grammar's check) fails that
    request; it escaped the core loop before, and stopped the engine for everyone."""
    from radixlm.runtime.output_processor import OutputProcessor

    final_text = OutputProcessor._final_text

    def failing(req):
        if req.input_ids[0] == 7:
            raise TypeError("injected in the text")
        final_text(req)

    monkeypatch.setattr(OutputProcessor, "_final_text", staticmethod(failing))
    params = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    with radixlm.Engine(tiny_model_folder) as eng:
        bad, good = eng.generate(input_ids=[[7, 8, 9], [5, 8, 9]], sampling_params=params)
        reason = bad["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "injected in the text" in reason["message"], reason
        assert len(good["output_ids"]) == 3
        assert eng.generate(input_ids=[5, 8], sampling_params=params)["output_ids"]


def test_an_error_applying_one_requests_token_fails_that_request_alone(
    tiny_model_folder, monkeypatch
):
    from radixlm.runtime.output_processor import OutputProcessor

    apply = OutputProcessor._apply

    def failing(self, req, token, extra):
        if req.input_ids[0] == 7 and req.output_ids:  # its second token, on the decode path
            raise TypeError("injected while applying")
        apply(self, req, token, extra)

    monkeypatch.setattr(OutputProcessor, "_apply", failing)
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True, "stop": ["\x00"]}
    with radixlm.Engine(tiny_model_folder) as eng:
        bad, good = eng.generate(input_ids=[[7, 8, 9], [5, 8, 9]], sampling_params=params)
        reason = bad["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "injected while applying" in reason["message"]
        assert len(good["output_ids"]) == 4
        assert len(eng.generate(input_ids=[7, 8], sampling_params=params)["output_ids"]) == 1
        stats = eng.get_stats()
        assert stats["num_running_reqs"] == 0
        assert (
            stats["kv_pool_free_tokens"] + stats["radix_cache_tokens"]
            == stats["kv_pool_capacity_tokens"]
        )


def test_an_error_sampling_one_requests_token_fails_that_request_alone(
    tiny_model_folder, monkeypatch
):
    """Sampling a batch raised (here a penalty of one request): each row is sampled alone, the
    request whose row fails is failed with the error, and the others get the tokens they get
    without it in the batch."""
    from radixlm.runtime import sampler

    penalize = sampler._apply_penalties

    def failing(logits, row):
        if row.params.frequency_penalty == 0.5:
            raise ValueError("injected while sampling")
        penalize(logits, row)

    prompts = [[7, 8, 9], [5, 8, 9], [6, 8, 9]]
    greedy = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    params = [
        {**greedy, "frequency_penalty": 0.5},
        {**greedy, "temperature": 0.8, "seed": 4},
        {**greedy, "presence_penalty": 0.3},
    ]
    with radixlm.Engine(tiny_model_folder) as eng:
        want = [eng.generate(input_ids=p, sampling_params=s) for p, s in zip(prompts, params)]
        monkeypatch.setattr(sampler, "_apply_penalties", failing)
        bad, *good = eng.generate(input_ids=prompts, sampling_params=params)
        reason = bad["meta_info"]["finish_reason"]
        assert reason["type"] == "abort", reason
        assert "sampling its token" in reason["message"]
        assert "injected while sampling" in reason["message"]
        assert [g["output_ids"] for g in good] == [w["output_ids"] for w in want[1:]]
        stats = eng.get_stats()
        assert stats["num_running_reqs"] == 0
        assert (
            stats["kv_pool_free_tokens"] + stats["radix_cache_tokens"]
            == stats["kv_pool_capacity_tokens"]
        )


def test_a_resumed_request_recomputes_its_lost_output_within_the_chunk_budget(tiny_model_folder):
    """A preempted request comes back with only part of its tokens cached: the rest, output
    included, is recomputed in chunks of at most chunked_prefill_size (it went as one decode of
    every lost token, past the budget, and was preempted again and again), to the same tokens."""
    prompts = [list(range(100, 105)), list(range(200, 205))]
    params = [
        {"max_new_tokens": n, "ignore_eos": True, "temperature": 0} for n in (85, 60)
    ]  # (155 tokens in all, a pool of 100)
    with radixlm.Engine(tiny_model_folder, chunked_prefill_size=8, max_total_tokens=1000) as eng:
        want = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
    sizes = []
    with radixlm.Engine(
        tiny_model_folder, chunked_prefill_size=8, max_total_tokens=100, max_running_requests=4
    ) as eng:
        schedule = eng._core.scheduler.schedule

        def noting():
            plan = schedule()
            sizes.extend(item.num_tokens for item in plan.items)
            return plan

        eng._core.scheduler.schedule = noting
        got = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
        assert eng.get_stats()["num_preemptions"] > 0
    assert got == want
    assert sizes and max(sizes) <= 8


def test_objects_alive_at_start_are_frozen_and_long_collections_logged(
    tiny_model_folder, caplog, monkeypatch
):
    """Once ready, the engine freezes the objects alive then (gc.freeze), so that the garbage
    collector's full passes skip them (a pass over a loaded model's objects stalled every request
    for 0.1-0.3 s). The freeze is the process's: while another engine that froze lives, shutting
    one down keeps the rest frozen; the last one unfreezes. disable_gc_freeze leaves them; a pass
    longer than gc_warning_threshold_secs is logged; freeze_gc on a shut-down engine is refused."""
    import gc
    import logging
    import weakref

    from radixlm.runtime import gc_freeze

    monkeypatch.setattr(gc_freeze, "_threshold", 0.0)
    before = gc_freeze._frozen_by  # (engines of other tests may live, frozen)
    first = radixlm.Engine(tiny_model_folder, max_total_tokens=256, gc_warning_threshold_secs=1e-9)
    second = radixlm.Engine(tiny_model_folder, max_total_tokens=256)
    try:
        assert gc.get_freeze_count() > 0 and gc_freeze._frozen_by == before + 2
        with caplog.at_level(logging.WARNING, logger="radixlm.runtime.gc_freeze"):
            gc.collect()
            # (an engine's core loop may take the note first and log it from its thread)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not any(
                "garbage collection of generation 2" in r.getMessage() for r in caplog.records
            ):
                gc_freeze.report()
                time.sleep(0.01)
        assert any("garbage collection of generation 2" in r.getMessage() for r in caplog.records)
        first.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
        held = [weakref.ref(x) for x in (first.model, first._core.kv_pool, first._core.runner)]
        first.shutdown()
        assert gc.get_freeze_count() > 0  # (the second engine's freeze kept)
        assert gc_freeze._frozen_by == before + 1
        # its memory let go of though another frozen engine lives
        assert [ref() for ref in held] == [None, None, None]
        with pytest.raises(radixlm.EngineShutDown):
            first.freeze_gc()
    finally:
        first.shutdown()
        second.shutdown()
        gc.callbacks.remove(gc_freeze._note)
    assert gc_freeze._frozen_by == before
    if not before:  # (the last engine that froze unfreezes)
        assert gc.get_freeze_count() == 0
    with radixlm.Engine(tiny_model_folder, max_total_tokens=256, disable_gc_freeze=True):
        assert gc_freeze._frozen_by == before
    with pytest.raises(ValueError, match="gc_warning_threshold_secs"):
        radixlm.Engine(tiny_model_folder, gc_warning_threshold_secs=-1)


def test_a_shut_down_engine_lets_go_of_its_weights_and_kv_pool(tiny_model_folder):
    """One process builds engine after engine (a notebook, a benchmark's ablations): shutdown
    drops the weights, the KV pool and the model runner even while the caller still holds the
    engine, so their memory goes back to the device for the next one."""
    import gc
    import weakref

    eng = radixlm.Engine(tiny_model_folder, max_total_tokens=256)
    eng.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
    held = [weakref.ref(eng.model), weakref.ref(eng._core.kv_pool), weakref.ref(eng._core.runner)]
    eng.shutdown()
    gc.collect()
    assert [ref() for ref in held] == [None, None, None]
    with pytest.raises(radixlm.EngineShutDown):
        eng.get_stats()
