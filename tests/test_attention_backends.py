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
