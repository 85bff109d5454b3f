"""Speculative decoding (NGRAM, and MEDUSA with the heads shipped for the model) on the real
default model, on the CPU in float32: greedy outputs are token-for-token those of plain decoding
(stops, stop strings, stop tokens, max_new_tokens reached inside a draft, EOS), under preemption
in a small KV pool with the prefix cache on and off, beside requests that decode plainly
(grammar, log-probabilities, penalties); the KV pool is whole again afterwards, and prompts that
copy from their input accept more than one token per verify step."""

from __future__ import annotations

import json

import pytest

import radixlm


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


_RECORD = "Name: Alice Johnson\nEmail: alice.johnson@example.com\nPhone: 555-0142"
_CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
_NUMBERS = chat("Write the numbers 1, 2, 3, 1, 2, 3 three more times.")
_OTHER_RECORD = "Name: Bob Stone\nEmail: bob.stone@mail.org\nCity: Springfield"
_PARAGRAPH = (
    "Each layer hid the one below it, and each made new things possible for people who never "
    "saw the lower layers at all. "
)
# prompts whose outputs copy from their input: drafts are accepted there
COPYING = [0, 1, 6]


def workload(tokenizer) -> tuple[list[str], list[dict]]:
    newline = tokenizer.encode("\n", add_special_tokens=False)[-1]
    g = {"temperature": 0}
    prompts = [
        chat(f"Repeat this record exactly, line by line:\n{_RECORD}"),
        _NUMBERS,
        chat("Write the numbers 4, 5, 6, 4, 5, 6 three more times."),
        chat("Say hi."),
        "The capital of France is",
        _CODE,
        _PARAGRAPH * 3 + "In short, each layer hid",
        chat(f"Copy this record:\n{_OTHER_RECORD}"),
    ]
    params = [
        {**g, "max_new_tokens": 24},
        {**g, "max_new_tokens": 30, "stop": ["3, 1, 2, 3, 1"]},  # a stop string inside a draft
        {**g, "max_new_tokens": 9},  # the length limit cuts the drafts short
        {**g, "max_new_tokens": 40},  # ends on EOS
        {**g, "max_new_tokens": 12, "stop_token_ids": [tokenizer.eos_token_id]},
        {**g, "max_new_tokens": 16, "stop_token_ids": [newline]},  # a stop token
        {**g, "max_new_tokens": 20},
        {**g, "max_new_tokens": 20, "stop": ["Stone\n"]},
    ]
    return prompts, params


# requests that decode plainly in a speculative engine, in the same batch
PLAIN_ONES = (
    [_NUMBERS, chat("Pick a colour."), _CODE],
    [
        {"temperature": 0, "max_new_tokens": 10, "frequency_penalty": 0.5},
        {"temperature": 0, "max_new_tokens": 10, "regex": "(red|green|blue)"},
        {"temperature": 0, "max_new_tokens": 8, "min_new_tokens": 4},
    ],
)

# (drafting at every step: the gate that turns it off where it does not pay has its own tests)
SPEC = {
    "speculative_algorithm": "NGRAM",
    "speculative_num_draft_tokens": 6,
    "speculative_adaptive": False,
}
MEDUSA = {"speculative_algorithm": "MEDUSA", "speculative_adaptive": False}  # the shipped heads


def results(outs) -> list[tuple]:
    return [(o["output_ids"], o["meta_info"]["finish_reason"], o["text"]) for o in outs]


def kv_whole(stats) -> bool:
    return (
        stats["kv_pool_free_tokens"] + stats["radix_cache_tokens"]
        == stats["kv_pool_capacity_tokens"]
    )


def start(folder, **kw) -> radixlm.Engine:
    return radixlm.Engine(folder, device="cpu", dtype="float32", **kw)


@pytest.fixture(scope="module")
def spec_engine(default_model_folder):
    with start(default_model_folder, **SPEC) as eng:
        yield eng


@pytest.fixture(scope="module")
def tokenizer(spec_engine):
    return spec_engine.tokenizer


@pytest.fixture(scope="module")
def plain_outputs(default_model_folder, tokenizer):
    """The plain loop's outputs (the oracle), and those of the requests that decode plainly."""
    prompts, params = workload(tokenizer)
    with start(default_model_folder, disable_overlap_schedule=True) as eng:
        outs = eng.generate(prompts + PLAIN_ONES[0], params + PLAIN_ONES[1])
    return outs


def test_greedy_speculation_gives_the_plain_tokens(spec_engine, plain_outputs, tokenizer):
    prompts, params = workload(tokenizer)
    outs = spec_engine.generate(prompts + PLAIN_ONES[0], params + PLAIN_ONES[1])
    assert results(outs) == results(plain_outputs)
    stats = spec_engine.get_stats()
    assert kv_whole(stats), stats
    assert stats["spec_verify_ct"] > 0 and stats["spec_num_correct_drafts"] > 0
    for i in COPYING:
        meta = outs[i]["meta_info"]
        assert meta["spec_verify_ct"] > 0
        assert meta["spec_accept_length"] > 1.0, (i, meta)
        assert sum(meta["spec_correct_drafts_histogram"]) == meta["spec_verify_ct"]
    # the requests that sample on the host's say never verify a draft
    for o in outs[len(prompts) :]:
        assert "spec_verify_ct" not in o["meta_info"]
    # the stop string and the length limit did cut verified drafts short
    assert outs[1]["meta_info"]["finish_reason"]["type"] == "stop"
    assert len(outs[2]["output_ids"]) == 9


@pytest.mark.parametrize("disable_radix_cache", [False, True])
def test_speculation_under_preemption_gives_the_plain_tokens(
    default_model_folder, tokenizer, plain_outputs, disable_radix_cache
):
    prompts, params = workload(tokenizer)
    # every prompt is admitted at once into a pool with room for a few decode steps only
    pool = sum(len(tokenizer.encode(p, add_special_tokens=False)) for p in prompts) + 4
    with start(
        default_model_folder, max_total_tokens=pool, max_running_requests=8,
        disable_radix_cache=disable_radix_cache, **SPEC,
    ) as eng:  # fmt: skip
        outs = eng.generate(prompts, params)
        stats = eng.get_stats()
    assert stats["num_preemptions"] > 0, stats
    assert stats["spec_verify_ct"] > 0
    assert results(outs) == results(plain_outputs[: len(prompts)])
    assert kv_whole(stats), stats


def test_medusa_gives_the_plain_tokens_under_preemption_and_seeded_samples_repeat(
    default_model_folder, tokenizer, plain_outputs
):
    prompts, params = workload(tokenizer)
    # a pool a little smaller than the workload's prompts, 8 requests at once: the plain ones
    # wait, and requests are preempted (MEDUSA's drafts are dropped when memory is short and its
    # rejected slots freed at once, so it takes a smaller pool than NGRAM to preempt)
    pool = sum(len(tokenizer.encode(p, add_special_tokens=False)) for p in prompts) - 8
    prompts, params = prompts + PLAIN_ONES[0], params + PLAIN_ONES[1]
    sampled = {"temperature": 0.8, "max_new_tokens": 12, "seed": 5}
    with start(
        default_model_folder, max_total_tokens=pool, max_running_requests=8, **MEDUSA
    ) as eng:
        outs = eng.generate(prompts, params)
        stats = eng.get_stats()
        first = eng.generate([_NUMBERS, prompts[3]], sampled)
        again = eng.generate([prompts[3], _NUMBERS], sampled)
    assert results(outs) == results(plain_outputs)
    assert stats["num_preemptions"] > 0, stats
    assert kv_whole(stats), stats
    # the heads' chains are verified, and some of their tokens accepted
    assert stats["spec_verify_ct"] > 0 and stats["spec_num_correct_drafts"] > 0, stats
    for o in outs[-len(PLAIN_ONES[0]) :]:
        assert "spec_verify_ct" not in o["meta_info"]
    assert results(first) == results(again[::-1])
    assert first[0]["meta_info"]["spec_verify_ct"] > 0


def test_streaming_a_speculative_request_ends_with_its_full_result(spec_engine, plain_outputs):
    prompt, params = _NUMBERS, {"temperature": 0, "max_new_tokens": 30, "stop": ["3, 1, 2, 3, 1"]}
    chunks = list(spec_engine.generate(prompt, params, stream=True))
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert results(chunks[-1:]) == results(plain_outputs[1:2])
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_seeded_sampling_with_speculation_repeats(spec_engine):
    params = {"temperature": 0.8, "max_new_tokens": 12, "seed": 11}
    first = spec_engine.generate([_NUMBERS, _CODE], params)
    again = spec_engine.generate([_CODE, _NUMBERS], params)
    assert results(first) == results(again[::-1])
    assert first[0]["meta_info"]["spec_verify_ct"] > 0


# constrained requests the speculative tests run: a regex (jump-forward's text, too), a JSON
# schema, a seeded sampled regex
REGEX = "(hello world ){3,12}done"
SCHEMA = {
    "type": "object",
    "properties": {"tags": {"type": "array", "items": {"enum": ["abc", "abd"]}}},
    "required": ["tags"],
}
CONSTRAINED_PROMPT = "hello world hello world hello world " * 3
CONSTRAINED = [
    {"max_new_tokens": 48, "temperature": 0, "regex": REGEX},
    {"max_new_tokens": 48, "temperature": 0, "json_schema": json.dumps(SCHEMA)},
    {"max_new_tokens": 48, "temperature": 0.8, "seed": 3, "regex": REGEX},
]


def test_constrained_requests_are_drafted_for_within_their_grammar(tiny_model_folder):
    """A request with a regex or a JSON schema is drafted for too: its drafts are cut where its
    grammar stops allowing them and each verify row is masked by the grammar's state there, so
    greedy outputs are plain constrained decoding's token for token, a seeded one repeats, and
    every output matches its constraint."""
    import re

    import jsonschema

    regex, schema, prompt = REGEX, SCHEMA, CONSTRAINED_PROMPT
    params = [
        *CONSTRAINED,
        {"max_new_tokens": 24, "temperature": 0, "regex": "(hello| world| done)+"},
    ]
    outs, stats = [], []
    for spec in ({}, {**SPEC, "speculative_num_draft_tokens": 4}, {**SPEC}):
        with radixlm.Engine(tiny_model_folder, **spec) as eng:
            got = eng.generate([prompt] * 4, params)
            outs.append(got)
            stats.append(eng.get_stats())
    plain, spec4, spec6 = outs
    for got in outs:
        assert re.fullmatch(regex, got[0]["text"]), got[0]["text"]
        jsonschema.validate(json.loads(got[1]["text"]), schema)
        assert re.fullmatch(regex, got[2]["text"]), got[2]["text"]
    greedy = [0, 1, 3]
    for got in (spec4, spec6):
        assert [got[i]["output_ids"] for i in greedy] == [plain[i]["output_ids"] for i in greedy]
        assert all(got[i]["meta_info"]["spec_verify_ct"] > 0 for i in (0, 2, 3))
    assert stats[1]["spec_num_correct_drafts"] > 0 and stats[2]["spec_num_correct_drafts"] > 0
    # (a sampled request's tokens are a different draw than plain sampling's: seeded, they repeat)
    with radixlm.Engine(tiny_model_folder, **SPEC) as eng:
        again = eng.generate(prompt, params[2])
    assert again["output_ids"] == spec6[2]["output_ids"]


def test_constrained_requests_hold_their_grammar_while_the_gate_overlaps_plain_steps(
    tiny_model_folder,
):
    """With the gate on and its measurements saying plain decoding pays, the steps overlap as
    plain decoding's (grammar masks deferred, jump-forward beside a step in flight) between
    the gate's tries of drafting: every constrained output still matches its constraint, the
    sampled one repeats from its seed, and the plain request beside them is plain decoding's."""
    import re

    import jsonschema

    regex, schema, prompt = REGEX, SCHEMA, CONSTRAINED_PROMPT
    params = [*CONSTRAINED, {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}]
    with radixlm.Engine(tiny_model_folder) as eng:
        plain = eng.generate(prompt, params[3])
    runs = []
    for _ in range(2):
        with radixlm.Engine(
            tiny_model_folder, **{**SPEC, "speculative_adaptive": True}
        ) as eng:  # fmt: skip
            gate = eng._core.speculative.gate

            def seed(gate=gate):
                # every bucket measured already, verifying far slower than plain decoding (the
                # grammars arrive as they compile, so the buckets the steps pass through vary)
                for b in range(1, 5):
                    for verified, rate in ((True, 1.0), (False, 1e12)):
                        gate._rate[(b, verified)] = rate
                        gate._count[(b, verified)] = gate.first

            eng._core.call(seed)
            runs.append(eng.generate([prompt] * 4, params))
            overlapped = eng._core.num_overlapped_steps
        assert overlapped > 0
    for got in runs:
        assert re.fullmatch(regex, got[0]["text"]), got[0]["text"]
        jsonschema.validate(json.loads(got[1]["text"]), schema)
        assert re.fullmatch(regex, got[2]["text"]), got[2]["text"]
        assert got[3]["output_ids"] == plain["output_ids"]
    assert runs[0][2]["output_ids"] == runs[1][2]["output_ids"]


@pytest.mark.parametrize(
    "kw, logprobs, lockstep_estimates",
    [({}, False, True), ({"disable_overlap_schedule": True}, False, False), ({}, True, False)],
    ids=["overlap", "overlap-off", "logprobs"],
)
def test_the_gate_gets_an_overlapped_cost_only_where_plain_steps_overlap(
    tiny_model_folder, kw, logprobs, lockstep_estimates
):
    """A plain step run in lockstep is offered to the gate at what it would cost overlapped
    only where plain steps do overlap once kept plain: not with overlap scheduling off, nor
    while a request asks for log-probabilities (its steps stay in lockstep)."""
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    with radixlm.Engine(
        tiny_model_folder, **{**SPEC, "speculative_adaptive": True}, **kw
    ) as eng:  # fmt: skip
        worker = eng._core.speculative
        seen: list[float | None] = []
        observe = worker.observe_step

        def record(plan, results, seconds, overlapped=None):
            if not results.verified:
                seen.append(overlapped)
            observe(plan, results, seconds, overlapped)

        worker.observe_step = record
        eng.generate(["a b c a b c a b", "x y z"], params, return_logprob=logprobs)
    assert seen
    assert any(o is not None for o in seen) == lockstep_estimates, seen


@pytest.mark.parametrize(
    "spec",
    [
        {**SPEC, "speculative_num_draft_tokens": 8, "speculative_eagle_topk": 3},
        {**MEDUSA, "speculative_eagle_topk": 2},
    ],
    ids=["ngram-tree", "medusa-tree"],
)
def test_draft_trees_give_the_plain_tokens(
    default_model_folder, tokenizer, plain_outputs, spec, monkeypatch
):
    """With speculative_eagle_topk above 1 a greedy request's draft is a tree (NGRAM: matches of
    different lengths; MEDUSA: the first head's top-k), verified in one step as decode rows on
    lent request-table rows: the tokens are plain decoding's, beside requests that decode
    plainly, and the pool and the lent rows are whole afterwards."""
    from radixlm.runtime import scheduler

    laid_out = []
    real = scheduler.lay_out

    def counting(tree, *a):
        laid_out.append(len(tree.paths()))
        return real(tree, *a)

    monkeypatch.setattr(scheduler, "lay_out", counting)
    prompts, params = workload(tokenizer)
    with start(default_model_folder, **spec) as eng:
        outs = eng.generate(prompts + PLAIN_ONES[0], params + PLAIN_ONES[1])
        stats = eng.get_stats()
        rows = eng._core.rows
        spare = rows.num_spare + len(eng._core.scheduler._lent)
        expected_spare = eng._core.rows.table.shape[0] - 1 - (eng._core.config.max_running_requests)
    assert results(outs) == results(plain_outputs)
    assert any(paths > 1 for paths in laid_out), laid_out
    assert stats["spec_verify_ct"] > 0 and stats["spec_num_correct_drafts"] > 0
    assert kv_whole(stats), stats
    assert spare == expected_spare


def test_sampled_requests_verify_draft_trees_and_seeded_ones_repeat(tiny_model_folder):
    """A sampled request's draft is a tree too (rejection sampling tries a node's children in
    turn): a seeded request gives the same tokens twice, and the pool is whole afterwards."""
    from radixlm.runtime import scheduler

    prompt = [300 + (j % 5) for j in range(24)] + [400 + (j % 3) for j in range(24)]
    params = {"max_new_tokens": 32, "temperature": 0.7, "top_k": 2, "seed": 11, "ignore_eos": True}
    spec = {**SPEC, "speculative_eagle_topk": 3}
    outs, trees = [], []
    real = scheduler.lay_out
    try:
        scheduler.lay_out = lambda tree, *a: trees.append(len(tree.paths())) or real(tree, *a)
        for _ in range(2):
            with radixlm.Engine(tiny_model_folder, **spec) as eng:
                outs.append(eng.generate(input_ids=prompt, sampling_params=params))
                stats = eng.get_stats()
            assert kv_whole(stats), stats
    finally:
        scheduler.lay_out = real
    assert outs[0]["output_ids"] == outs[1]["output_ids"]
    assert outs[0]["meta_info"]["spec_verify_ct"] > 0
    assert any(paths > 1 for paths in trees), trees
