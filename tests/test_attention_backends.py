"""The engine gives the same tokens through the Triton attention backend as through the torch oracle
(on the CPU through Triton's interpreter, at a tiny size; on a GPU for real)."""

from __future__ import annotations

import pytest

import radixlm

pytest.importorskip("triton")


def test_triton_backend_matches_torch_backend_end_to_end(tiny_model_folder):
    prompts = [list(range(100, 100 + n)) for n in (1, 7, 33, 70)]
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    outs = {}
    for backend in ("torch", "triton"):
        with radixlm.Engine(
            tiny_model_folder, attention_backend=backend, chunked_prefill_size=32
        ) as eng:
            alone = [
                eng.generate(input_ids=p, sampling_params=params, return_logprob=True)
                for p in prompts
            ]
            batched = eng.generate(input_ids=prompts, sampling_params=params)
        outs[backend] = (alone, batched)
    for a, b in zip(outs["torch"][0], outs["triton"][0]):
        assert a["output_ids"] == b["output_ids"]
        for (lp_a, _, _), (lp_b, _, _) in zip(
            a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]
        ):
            assert abs(lp_a - lp_b) < 1e-4
    assert [o["output_ids"] for o in outs["torch"][1]] == [
        o["output_ids"] for o in outs["triton"][1]
    ]


def test_padded_decode_graph_path_matches_eager(tiny_model_folder):
    """The CUDA-graph decode path (inputs padded to a bucket, positions and KV slots derived from
    the request table) gives the tokens of the ordinary path; run eagerly here, replayed on a GPU."""
    from radixlm.runtime.cuda_graph import DecodeGraphs

    prompts = [list(range(200, 200 + n)) for n in (3, 9, 17, 30, 5)]  # 5 requests: bucket 8
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    outs, calls, plain, sampled = [], [], [], []
    for graphs in (False, True):
        with radixlm.Engine(tiny_model_folder, attention_backend="triton") as eng:
            runner = eng._core.runner
            if graphs:
                runner.graphs = DecodeGraphs(
                    runner.model, runner.backend, runner.req_to_token, runner.token_buf,
                    max_batch=6, capture=False,
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
    import torch

    from radixlm.runtime.model_runner import _padded

    assert [_padded(n) for n in (1, 16, 17, 100, 1000, 1025, 8193)] == [
        16, 16, 32, 112, 1024, 1152, 8448,
    ]  # fmt: skip
    prompts = [list(range(300, 300 + n)) for n in (5, 19, 41)]  # 65 tokens: 15 rows of padding
    params = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    with radixlm.Engine(tiny_model_folder, attention_backend="torch") as eng:
        want = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True)

    real_empty_like = torch.empty_like
    monkeypatch.setattr(
        torch, "empty_like", lambda t, **kw: real_empty_like(t, **kw).fill_(float("nan"))
        if (kw.get("dtype") or t.dtype).is_floating_point else real_empty_like(t, **kw)
    )  # fmt: skip
    with radixlm.Engine(tiny_model_folder, attention_backend="triton") as eng:
        paddings = []
        build = eng._core.runner._build_batch
        eng._core.runner._build_batch = lambda items: (
            lambda out: paddings.append(out[0].padding) or out
        )(build(items))
        got = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        pool = eng._core.kv_pool
        assert all(torch.isfinite(k[0]).all() and torch.isfinite(v[0]).all()
                   for k, v in zip(pool.k, pool.v))  # fmt: skip
    assert any(paddings), paddings
    for a, b in zip(want, got):
        assert a["output_ids"] == b["output_ids"]
        for (lp_a, _, _), (lp_b, _, _) in zip(
            a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]
        ):
            assert abs(lp_a - lp_b) < 1e-4
