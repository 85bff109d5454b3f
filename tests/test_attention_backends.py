"""The engine gives the same tokens through the Triton attention backend as through the torch oracle
(on the CPU through Triton's interpreter, at a tiny size; on a GPU for real)."""

from __future__ import annotations

import pytest
import torch

import radixlm

pytest.importorskip("triton")

# The same engine on a GPU as on the CPU: float32 (the 1e-4 log-probability bound is float32's) and
# no captured graphs, so the paths each test installs or watches are the ones that run.
EAGER = {"dtype": "float32", "disable_cuda_graph": True}
# The graphs a test installs itself are captured and replayed on a GPU, run eagerly on the CPU.
CAPTURE = torch.cuda.is_available()


def install_prefill_graphs(eng, max_tokens: int, max_reqs: int, keep_hidden: bool = False):
    """Give `eng`'s model runner prompt-step graphs of its own (captured and replayed on a GPU,
    run eagerly on the CPU); the graphs."""
    from radixlm.runtime.cuda_graph import PrefillGraphs

    runner = eng._core.runner
    runner.prefill_graphs = PrefillGraphs(
        runner.model, runner.backend, runner.req_to_token, runner.token_buf,
        max_tokens=max_tokens, max_reqs=max_reqs, capture=CAPTURE,
        padding_row=eng._core.rows.padding_row, keep_hidden=keep_hidden,
    )  # fmt: skip
    return runner.prefill_graphs


def write_random_medusa_heads(model_folder, out) -> int:
    """Three MEDUSA heads of random weights (large enough that their top tokens differ) for
    the tiny model, written to `out`; the model's hidden size."""
    from transformers import AutoModelForCausalLM

    from radixlm.runtime.speculative import medusa

    target = AutoModelForCausalLM.from_pretrained(model_folder)
    hidden, vocab = target.config.hidden_size, target.config.vocab_size
    torch.manual_seed(3)
    heads = medusa.MedusaHeads(hidden, 3)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.5)
    config = medusa.MedusaConfig(3, 1, hidden, vocab, "tiny")
    medusa.save_heads(out, heads, config, medusa.lm_head_sample(target.lm_head.weight))
    return hidden


def assert_same_outputs(want: list[dict], got: list[dict]) -> None:
    """The same tokens, and their log-probabilities within 1e-4 (where they were asked for)."""
    assert len(want) == len(got)
    for a, b in zip(want, got):
        assert a["output_ids"] == b["output_ids"]
        lps_a = a["meta_info"].get("output_token_logprobs", [])
        lps_b = b["meta_info"].get("output_token_logprobs", [])
        assert len(lps_a) == len(lps_b)
        for (lp_a, _, _), (lp_b, _, _) in zip(lps_a, lps_b):
            assert abs(lp_a - lp_b) < 1e-4


def test_triton_backend_matches_torch_backend_end_to_end(tiny_model_folder, monkeypatch):
    """Alone and batched with chunked prompts: the batched run has steps of prompt chunks and
    decodes together, in one launch of the extend kernel."""
    from radixlm.runtime.attention import TritonAttentionBackend

    mixed = []
    real = TritonAttentionBackend.forward

    def forward(self, q, k, v, layer_id, batch, *args, **kwargs):
        mixed.append(0 < batch.num_multi < batch.batch_size)
        return real(self, q, k, v, layer_id, batch, *args, **kwargs)

    monkeypatch.setattr(TritonAttentionBackend, "forward", forward)
    prompts = [list(range(100, 100 + n)) for n in (1, 7, 33, 70)]
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    outs = {}
    for backend in ("torch", "triton"):
        with radixlm.Engine(
            tiny_model_folder, **EAGER, attention_backend=backend, chunked_prefill_size=32
        ) as eng:
            alone = [
                eng.generate(input_ids=p, sampling_params=params, return_logprob=True)
                for p in prompts
            ]
            # (other prompts: the cached ones would be extends of their last token only)
            others = [[t + 200 for t in p] for p in prompts]
            batched = eng.generate(input_ids=others, sampling_params=params, return_logprob=True)
        outs[backend] = (alone, batched)
    assert_same_outputs(outs["torch"][0], outs["triton"][0])
    assert_same_outputs(outs["torch"][1], outs["triton"][1])
    assert any(mixed)


@pytest.mark.slow  # (the Triton interpreter on the CPU: tens of seconds)
def test_padded_decode_graph_path_matches_eager(tiny_model_folder):
    """The CUDA-graph decode path (inputs padded to a bucket, positions and KV slots derived from
    the request table) gives the tokens of the ordinary path; run eagerly here, replayed on a GPU."""
    from radixlm.runtime.cuda_graph import DecodeGraphs

    prompts = [list(range(200, 200 + n)) for n in (3, 9, 17, 30, 5)]  # 5 requests: bucket 8
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    outs, calls, plain, sampled = [], [], [], []
    for graphs in (False, True):
        with radixlm.Engine(tiny_model_folder, **EAGER, attention_backend="triton") as eng:
            runner = eng._core.runner
            if graphs:
                runner.graphs = DecodeGraphs(
                    runner.model, runner.backend, runner.req_to_token, runner.token_buf,
                    max_batch=6, capture=CAPTURE,
                )  # fmt: skip
                assert runner.graphs.buckets == [1, 2, 4, 6]
                run = runner.graphs.run
                runner.graphs.run = lambda *a, run=run: calls.append(len(a[0])) or run(*a)
            outs.append(
                eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
            )
            # plain greedy (the graph's own argmax) and seeded sampling, over the same rows
            plain.append(eng.generate(input_ids=prompts, sampling_params=params))
            sampled.append(
                eng.generate(
                    input_ids=prompts, sampling_params={**params, "temperature": 0.9, "seed": 3}
                )
            )
    assert 5 in calls  # decode steps of all five went through the padded path
    assert [o["output_ids"] for o in plain[0]] == [o["output_ids"] for o in plain[1]]
    assert [o["output_ids"] for o in plain[0]] == [o["output_ids"] for o in outs[0]]
    assert [o["output_ids"] for o in sampled[0]] == [o["output_ids"] for o in sampled[1]]
    for a, b in zip(*outs):
        assert a["output_ids"] == b["output_ids"]
        lps_a = [lp for lp, _, _ in a["meta_info"]["output_token_logprobs"]]
        lps_b = [lp for lp, _, _ in b["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(lps_a, lps_b)) < 1e-4


def test_padded_prefill_rows_leave_outputs_and_the_padding_slot_alone(
    tiny_model_folder, monkeypatch
):
    """Prefill batches on the Triton backend are padded to a few sizes (runtime/model_runner.py
    `_padded`); the padding rows must not change any request's tokens, and must leave the padding
    slot's K/V finite even when fresh buffers hold NaN (as uninitialized memory may)."""

    from radixlm.runtime.model_runner import _padded

    assert [_padded(n) for n in (1, 16, 17, 100, 1000, 1025, 8193)] == [
        16, 16, 32, 112, 1024, 1152, 8448,
    ]  # fmt: skip
    prompts = [list(range(300, 300 + n)) for n in (5, 19, 41)]  # 65 tokens: 15 rows of padding
    params = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    with radixlm.Engine(tiny_model_folder, **EAGER, attention_backend="torch") as eng:
        want = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True)

    real_empty_like = torch.empty_like
    monkeypatch.setattr(
        torch, "empty_like", lambda t, **kw: real_empty_like(t, **kw).fill_(float("nan"))
        if (kw.get("dtype") or t.dtype).is_floating_point else real_empty_like(t, **kw)
    )  # fmt: skip
    with radixlm.Engine(tiny_model_folder, **EAGER, attention_backend="triton") as eng:
        paddings = []
        build = eng._core.runner._to_batch
        eng._core.runner._to_batch = lambda lists: (
            lambda out: paddings.append(out.padding) or out
        )(build(lists))
        got = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        pool = eng._core.kv_pool
        assert all(torch.isfinite(k[0]).all() and torch.isfinite(v[0]).all()
                   for k, v in zip(pool.k, pool.v))  # fmt: skip
    assert any(paddings), paddings
    assert_same_outputs(want, got)


@pytest.mark.slow  # (the Triton interpreter on the CPU: tens of seconds)
def test_graph_decodes_read_each_requests_newest_token_after_preemption(tiny_model_folder):
    """A preempted request resumes on a new request row by recomputing its tokens in prompt
    chunks; when a chunk stops one token short of its newest token, the next step computes that
    token as a one-token decode whose input is on the host only (nothing was sampled into the new
    row's token_buf entry). Every graph step must read each request's newest token: checked at
    each launch, with freed rows' token_buf entries scribbled over as a next owner would."""
    from radixlm.runtime.cuda_graph import DecodeGraphs

    prompts = [list(range(400 + 7 * i, 410 + 7 * i)) for i in range(4)]
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    outs, checked, wrong, host_inputs = [], [], [], []
    for graphs in (False, True):
        with radixlm.Engine(
            tiny_model_folder, **EAGER, attention_backend="triton", disable_radix_cache=True,
            max_total_tokens=60, chunked_prefill_size=9,  # (scheduling hits the case here)
        ) as eng:  # fmt: skip
            core, runner = eng._core, eng._core.runner
            if graphs:
                runner.graphs = DecodeGraphs(
                    runner.model, runner.backend, runner.req_to_token, runner.token_buf,
                    max_batch=16, capture=CAPTURE,
                )  # fmt: skip
                runner.launch = _checking_graph_inputs(runner, checked, wrong)
                core.scheduler.schedule = _noting_host_input_decodes(
                    core.scheduler.schedule, host_inputs
                )
            release = core.cache.release

            def release_and_scribble(req, release=release, buf=runner.token_buf):
                if req.pool_row is not None:
                    buf[req.pool_row] = 5
                release(req)

            core.cache.release = release_and_scribble
            outs.append(
                [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
            )
            stats = eng.get_stats()
    assert stats["num_preemptions"] > 0 and stats["graph_steps"] > 0, stats
    # the case at stake arose, and went as an eager item reading the host's token; no graph step
    # read a stale token_buf entry
    assert host_inputs
    assert not wrong, (wrong, len(checked))
    assert outs[0] == outs[1]


def _checking_graph_inputs(runner, checked: list, wrong: list):
    """`runner.launch`, first checking for a graph step that token_buf holds the newest token of
    every decode whose newest token is known on the host (pending ones are sampled into it)."""
    launch = runner.launch

    def wrapped(plan, greedy_only=False, **kwargs):
        if runner._graphable(plan):
            for req, row, seq_len in zip(plan.decodes, plan.rows, plan.seq_lens):
                if not req.num_pending:
                    checked.append(req.rid)
                    if int(runner.token_buf[row]) != req.all_ids[seq_len - 1]:
                        wrong.append((req.rid, seq_len))
        return launch(plan, greedy_only, **kwargs)

    return wrapped


def _noting_host_input_decodes(schedule, noted: list):
    """`schedule`, noting the one-token decodes planned as items (their input on the host)."""

    def wrapped():
        plan = schedule()
        noted.extend(
            it for it in plan.items if it.num_tokens == 1 and it.start >= len(it.req.input_ids)
        )
        return plan

    return wrapped


def fake_flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    """flash-attn's varlen attention as documented (2.1+: GQA by head groups; with causal and
    fewer queries than keys, query j of n sees the keys up to n_keys - n + j), in plain torch."""
    # what flash-attn checks
    assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.is_contiguous() and cu_k.is_contiguous()
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    assert q.shape[0] == int(cu_q[-1]) and k.shape[0] == v.shape[0] == int(cu_k[-1])
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    for i in range(len(cu_q) - 1):
        qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        assert qe - qs <= max_q and ke - ks <= max_k
        qi = q[qs:qe].float()
        ki = k[ks:ke].float().repeat_interleave(group, 1)
        vi = v[ks:ke].float().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", qi, ki) * softmax_scale
        if causal:
            nq, nk = qe - qs, ke - ks
            pos_q, pos_k = torch.arange(nq, device=q.device), torch.arange(nk, device=q.device)
            visible = pos_k[None, :] <= (nk - nq + pos_q)[:, None]
            scores = scores.masked_fill(~visible, float("-inf"))
        out[qs:qe] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vi).to(q.dtype)
    return out


def test_flash_attn_prompt_path_gathers_prefix_and_new_keys(tiny_model_folder):
    """Where flash-attn is installed, prompt steps go through its varlen kernel (here a torch
    stand-in with its documented semantics, flash-attn not being installed): chunked prompts after
    cached prefixes, mixed with decodes, padded, must give the torch oracle's results."""
    shared = list(range(600, 640))
    prompts = [shared + list(range(700 + 9 * i, 705 + 11 * i)) for i in range(5)]
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    outs, prompt_tokens, keys, mixes = {}, [], [], []
    for backend in ("torch", "triton"):
        with radixlm.Engine(
            tiny_model_folder, **EAGER, attention_backend=backend, chunked_prefill_size=24
        ) as eng:
            if backend == "triton":
                eng._core.runner.backend.flash = lambda *a, **kw: (
                    prompt_tokens.append(a[0].shape[0])
                    or keys.append(a[1].shape[0])
                    or fake_flash_varlen(*a, **kw)
                )
                backend_obj = eng._core.runner.backend
                extend = backend_obj._extend_flash

                def noting(q, k_pool, v_pool, batch, sm_scale, out, extend=extend):
                    mixes.append((batch.num_multi, batch.batch_size))
                    return extend(q, k_pool, v_pool, batch, sm_scale, out)

                backend_obj._extend_flash = noting
            first = eng.generate(input_ids=prompts[0], sampling_params=params, return_logprob=True)
            rest = eng.generate(input_ids=prompts[1:], sampling_params=params, return_logprob=True)
            outs[backend] = [first, *rest]
    assert prompt_tokens and max(keys) > max(prompt_tokens)  # chunks after cached prefixes
    assert any(size > multi for multi, size in mixes)  # and steps mixing them with decodes
    assert_same_outputs(outs["torch"], outs["triton"])


@pytest.mark.slow  # (the Triton interpreter on the CPU: tens of seconds)
def test_prompt_steps_padded_for_prefill_graphs_match_eager(tiny_model_folder):
    """Prompt steps through PrefillGraphs (inputs padded to a bucket in one buffer, attention tiles
    listed, a newest token still on the device read from token_buf), run eagerly here and replayed
    on a GPU, give the ordinary path's tokens and log-probabilities: chunked prompts after cached
    prefixes, mixed with decodes, and prompt log-probabilities (a logits row per prompt token:
    replayed where the bucket holds that many rows, else eager)."""
    from radixlm.runtime.cuda_graph import prefill_buckets

    assert prefill_buckets(100) == [16, 32, 48, 64, 96, 128]
    shared = list(range(600, 640))
    prompts = [shared + list(range(700 + 9 * i, 705 + 11 * i)) for i in range(5)]
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    sampled_params = {**params, "temperature": 0.8, "seed": 11}
    outs, runs = [], []
    for graphs in (False, True):
        with radixlm.Engine(
            tiny_model_folder, **EAGER, attention_backend="triton", chunked_prefill_size=24
        ) as eng:
            runner = eng._core.runner
            if graphs:
                install_prefill_graphs(eng, max_tokens=40, max_reqs=6)
                run = runner.prefill_graphs.run

                def noting(*a, run=run):
                    runs.append((len(a[0]), len(a[3]), len(a[4])))  # tokens, pending, requests
                    return run(*a)

                runner.prefill_graphs.run = noting
            first = eng.generate(input_ids=prompts[0], sampling_params=params, return_logprob=True)
            rest = eng.generate(input_ids=prompts[1:], sampling_params=params, return_logprob=True)
            sampled = eng.generate(input_ids=prompts[1:3], sampling_params=sampled_params)
            with_input_lps = eng.generate(
                input_ids=prompts[3], sampling_params=params, return_logprob=True,
                logprob_start_len=0,
            )  # fmt: skip
            outs.append(([first, *rest], sampled, with_input_lps))
            stats = eng.get_stats()
    assert stats["prefill_graph_steps"] == len(runs) > 0
    assert any(pending for _, pending, _ in runs)  # newest tokens read from token_buf
    assert any(reqs > 1 for _, _, reqs in runs)  # chunks mixed with decodes
    (eager, eager_sampled, eager_lps), (graphed, graphed_sampled, graphed_lps) = outs
    assert [o["output_ids"] for o in eager_sampled] == [o["output_ids"] for o in graphed_sampled]
    assert eager_lps["output_ids"] == graphed_lps["output_ids"]
    want, got = (o["meta_info"]["input_token_logprobs"] for o in (eager_lps, graphed_lps))
    assert len(want) == len(got) == len(prompts[3])
    assert [t for _, t, _ in want] == [t for _, t, _ in got]
    assert all(a is b is None or abs(a - b) < 1e-4 for (a, _, _), (b, _, _) in zip(want, got))
    assert_same_outputs(eager, graphed)


@pytest.mark.slow  # (the Triton interpreter on the CPU: tens of seconds)
def test_speculative_verify_steps_through_prefill_graphs_match_eager(tiny_model_folder):
    """A verify step (a request's newest token and its draft, a logits row for every position)
    fits a prompt-step graph whose bucket holds that many rows: replayed (run eagerly here), it
    gives the eager verify's tokens, greedy and seeded; a step wanting more rows than its bucket
    holds runs eagerly."""

    # prompts that repeat themselves, so that the n-gram drafter always has a draft to verify
    prompts = [[300 + (j % (4 + i)) for j in range(20 + 5 * i)] for i in range(2)]
    params = [
        {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
        {"max_new_tokens": 6, "temperature": 0.9, "seed": 5, "ignore_eos": True},
    ]
    outs, runs, verifies = [], [], []
    for graphs in (False, True):
        with drafting(tiny_model_folder, "NGRAM", speculative_num_draft_tokens=4) as eng:
            runner = eng._core.runner
            if graphs:
                install_prefill_graphs(eng, max_tokens=32, max_reqs=16)
                run = runner.prefill_graphs.run

                def noting(*a, run=run):
                    runs.append((len(a[4]), len(a[7])))  # requests, logits rows
                    return run(*a)

                runner.prefill_graphs.run = noting
            got = eng.generate(input_ids=prompts, sampling_params=params)
            outs.append([o["output_ids"] for o in got])
            verifies.append(eng.get_stats()["spec_verify_ct"])
    assert verifies[0] == verifies[1] > 0
    assert any(rows > reqs for reqs, rows in runs), "no verify step replayed a graph"
    assert outs[0] == outs[1]


def test_medusa_steps_through_prefill_graphs_keep_the_hidden_states(tiny_model_folder, tmp_path):
    """MEDUSA drafts from the final hidden states of each step's logits rows: prompt-step graphs
    built with keep_hidden give them (replayed on a GPU, run eagerly here), so its verify steps
    need not run eagerly, and the tokens are those of the eager steps."""
    hidden = write_random_medusa_heads(tiny_model_folder, tmp_path)
    prompts = [[300 + (j % (4 + i)) for j in range(20 + 5 * i)] for i in range(2)]
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    outs, kept = [], []
    for graphs in (False, True):
        with drafting(
            tiny_model_folder, "MEDUSA", speculative_draft_model_path=str(tmp_path)
        ) as eng:
            runner = eng._core.runner
            if graphs:
                install_prefill_graphs(eng, max_tokens=32, max_reqs=16, keep_hidden=True)
                run = runner.prefill_graphs.run

                def noting(*a, run=run, graphs=runner.prefill_graphs):
                    logits = run(*a)
                    kept.append((len(a[7]), None if graphs.hidden is None else graphs.hidden.shape))
                    return logits

                runner.prefill_graphs.run = noting
            got = eng.generate(input_ids=prompts, sampling_params=params)
            outs.append([o["output_ids"] for o in got])
    assert kept and all(shape == (rows, hidden) for rows, shape in kept), kept
    assert any(rows > 2 for rows, _ in kept), "no verify step replayed a graph"
    assert outs[0] == outs[1]


def drafting(folder: str, algorithm: str, **kw) -> radixlm.Engine:
    """An eager engine on the Triton backend drafting with `algorithm` at every step."""
    return radixlm.Engine(
        folder, **EAGER, attention_backend="triton", speculative_algorithm=algorithm,
        speculative_adaptive=False, **kw,
    )  # fmt: skip


def install_row_graphs(
    eng, max_rows: int, max_item_tokens: int, keep_hidden: bool = False, aux_layers=()
):
    """Give `eng`'s model runner verify-step graphs of its own (runtime/cuda_graph.py RowGraphs:
    captured and replayed on a GPU, run eagerly on the CPU), noting each run's (rows, the shape
    of the hidden states or features that came back); the list of notes."""
    from radixlm.runtime.cuda_graph import RowGraphs

    runner = eng._core.runner
    graphs = runner.row_graphs = RowGraphs(
        runner.model, runner.backend, runner.req_to_token, runner.token_buf,
        max_rows=max_rows, max_item_tokens=max_item_tokens, capture=CAPTURE,
        padding_row=eng._core.rows.padding_row, keep_hidden=keep_hidden, aux_layers=aux_layers,
    )  # fmt: skip
    notes, run = [], graphs.run

    def noting(*a):
        logits, argmax = run(*a)
        assert torch.equal(argmax, logits.argmax(dim=-1))
        kept = graphs.features if aux_layers else graphs.hidden
        notes.append((len(a[0]), None if kept is None else tuple(kept.shape)))
        return logits, argmax

    graphs.run = noting
    return notes


def test_verify_steps_as_decode_rows_match_eager(tiny_model_folder):
    """A verify step run as decode rows (every token a row of the decode kernel with the sequence
    length of its position, every row's K/V stored first) gives the eager extend's tokens: NGRAM
    drafts verified greedy and seeded, beside a request that decodes plainly in the same steps
    (log-probabilities asked: it is not drafted for), whose log-probabilities match too; a step
    with a longer item (a prompt chunk) does not take these graphs."""
    prompts = [[300 + (j % (4 + i)) for j in range(20 + 5 * i)] for i in range(2)]
    prompts.append(list(range(500, 540)))
    params = [
        {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
        {"max_new_tokens": 8, "temperature": 0.9, "seed": 5, "ignore_eos": True},
        {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
    ]
    outs, verifies, notes = [], [], []
    for graphs in (False, True):
        with drafting(tiny_model_folder, "NGRAM", speculative_num_draft_tokens=4) as eng:
            if graphs:
                notes = install_row_graphs(eng, max_rows=16, max_item_tokens=4)
            got = eng.generate(
                input_ids=prompts, sampling_params=params, return_logprob=[False, False, True]
            )
            outs.append(got)
            verifies.append(eng.get_stats()["spec_verify_ct"])
            assert eng._core.runner.num_row_graph_steps == len(notes)
    assert verifies[0] == verifies[1] > 0
    assert any(rows > 3 for rows, _ in notes), "no verify step ran as decode rows"
    assert_same_outputs(outs[0], outs[1])


@pytest.mark.parametrize("topk", [1, 2])
def test_medusa_steps_as_decode_rows_keep_the_hidden_states(tiny_model_folder, tmp_path, topk):
    """MEDUSA's steps (its verify steps, and its plain decodes, whose hidden states it drafts
    from) run as decode rows with the rows' final hidden states kept: the tokens are those of
    the eager steps; with speculative_eagle_topk 2 its drafts are trees (their nodes on lent
    request-table rows), through the graphs and eagerly as decode rows alike."""
    hidden = write_random_medusa_heads(tiny_model_folder, tmp_path)
    prompts = [[300 + (j % (4 + i)) for j in range(20 + 5 * i)] for i in range(2)]
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    outs, notes = [], []
    for graphs in (False, True):
        with drafting(
            tiny_model_folder, "MEDUSA", speculative_draft_model_path=str(tmp_path),
            speculative_eagle_topk=topk,
        ) as eng:  # fmt: skip
            if graphs:
                notes = install_row_graphs(
                    eng, max_rows=16, max_item_tokens=1 + 3 * topk, keep_hidden=True
                )
            got = eng.generate(input_ids=prompts, sampling_params=params)
            outs.append([o["output_ids"] for o in got])
    with radixlm.Engine(tiny_model_folder, **EAGER, attention_backend="triton") as eng:
        plain = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
    assert notes and all(shape == (rows, hidden) for rows, shape in notes), notes
    assert any(rows > 2 for rows, _ in notes), "no verify step ran as decode rows"
    assert outs[0] == outs[1] == plain


def _recording(draft, made: list):
    def recorded(reqs, num):
        made.append(draft(reqs, num))
        return made[-1]

    return recorded


@pytest.mark.parametrize("algorithm", ["EAGLE3", "EAGLE"])
def test_eagle3_steps_as_decode_rows_keep_the_targets_features(
    tiny_model_folder, tmp_path, algorithm
):
    """EAGLE3's steps (its verify steps, and the plain decodes whose features it drafts from)
    run as decode rows with every row's features kept, and its draft's rounds through its own
    graphs: its tokens are those of the eager steps and plain decoding's, and (on the CPU, where
    both compute alike) so are its drafts. EAGLE alike, its features the final hidden state."""
    from radixlm.runtime.speculative.eagle3_training import new_draft

    prompts = [[300 + (j % (4 + i)) for j in range(20 + 5 * i)] for i in range(2)]
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    with radixlm.Engine(tiny_model_folder, **EAGER, attention_backend="triton") as eng:
        plain = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
        draft, raw = new_draft(eng.model, seed=0, algorithm=algorithm)
        draft.save(tmp_path, raw)
        width = (3 if algorithm == "EAGLE3" else 1) * eng.model.cfg.hidden_size
    outs, drafts, notes = [], [], []
    for graphs in (False, True):
        with drafting(
            tiny_model_folder, algorithm, speculative_draft_model_path=str(tmp_path)
        ) as eng:
            drafter = eng._core.speculative.eagle
            if graphs:  # (the target's steps as decode rows, the draft's rounds through its own)
                notes = install_row_graphs(
                    eng, max_rows=16, max_item_tokens=4, aux_layers=drafter.aux_layers
                )
                drafter.use_graphs(4, capture=CAPTURE)
            drafter.draft = _recording(drafter.draft, made := [])
            got = eng.generate(input_ids=prompts, sampling_params=params)
            assert eng._core.speculative.eagle is not None  # (drafting never failed)
            outs.append([o["output_ids"] for o in got])
            drafts.append(made)
    assert notes and all(shape == (rows, width) for rows, shape in notes), notes
    assert any(rows > 2 for rows, _ in notes), "no verify step ran as decode rows"
    assert outs[0] == outs[1] == plain
    assert any(any(c) for c in drafts[0]) and any(any(c) for c in drafts[1])
    if not CAPTURE:  # (on a GPU the decode rows' features round apart from the extend's, and
        assert drafts[0] == drafts[1]  # an untrained draft's best tokens are near ties)


@pytest.mark.slow  # (the Triton interpreter on the CPU: tens of seconds)
def test_prefill_graph_layout_under_load_matches_eager(tiny_model_folder):
    """Many requests with shared prefixes (radix hits), small chunks, a cap of 5 running (buckets
    whose request lists fill up), greedy and seeded sampling, arriving in two waves: the padded
    prompt-step path (run eagerly on the CPU, replayed on a GPU) gives the tokens of the ordinary path."""
    import random

    rng = random.Random(9)
    shared = [rng.randrange(100, 4000) for _ in range(30)]
    prompts = [
        (shared[: rng.randint(0, 30)] if i % 2 else [])
        + [rng.randrange(100, 4000) for _ in range(rng.randint(1, 40))]
        for i in range(12)
    ]
    params = [
        {"max_new_tokens": rng.randint(3, 9), "temperature": 0, "ignore_eos": True}
        | ({"temperature": 0.7, "seed": i} if i % 3 == 0 else {})
        for i in range(12)
    ]
    outs, steps = [], []
    for graphs in (False, True):
        with radixlm.Engine(
            tiny_model_folder, **EAGER, attention_backend="triton", chunked_prefill_size=16,
            max_running_requests=5,
        ) as eng:  # fmt: skip
            if graphs:
                install_prefill_graphs(eng, max_tokens=24, max_reqs=5)
            first = eng.generate(input_ids=prompts[:6], sampling_params=params[:6])
            second = eng.generate(input_ids=prompts[6:], sampling_params=params[6:])
            outs.append([o["output_ids"] for o in first + second])
            steps.append(eng.get_stats()["prefill_graph_steps"])
    assert steps[0] == 0 and steps[1] > 10, steps
    assert outs[0] == outs[1]
