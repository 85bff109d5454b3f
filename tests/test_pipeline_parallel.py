"""Pipeline parallelism on the CPU: the stages as processes over gloo, against one process.

A small random model of four layers (untied LM head, weights drawn wide enough that greedy
decoding wanders over the vocabulary instead of repeating one token) split into 2 and 3 stages
gives the single process's greedy tokens exactly: each layer runs the same float32 arithmetic on
the same batch wherever it sits, so there is no near-tie to allow for. The batch mixes
concurrent requests, prompts longer than the prefill chunk, and prefixes from the radix cache.
A stage killed mid-run stops the engine with an error (requests failed, the server's 503 and
unhealthy /health), never a hang; more stages than layers are refused. Stages of two
tensor-parallel ranks each give the tokens of those two ranks alone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from radixlm.runtime.model_config import ModelConfig
from radixlm.runtime.pipeline import Stage

COMMON = {"max_total_tokens": 4096, "chunked_prefill_size": 16, "dist_timeout": 30}
GREEDY = {"max_new_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def four_layer_folder(tmp_path_factory, tiny_model_folder) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    from radixlm.runtime.model_loader import copy_tokenizer_files

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        eos_token_id=2, bos_token_id=1, tie_word_embeddings=False, initializer_range=0.2,
    )  # fmt: skip
    out = tmp_path_factory.mktemp("four-layers")
    LlamaForCausalLM(cfg).save_pretrained(out)
    copy_tokenizer_files(tiny_model_folder, out)  # (the default model's tokenizer)
    return str(out)


def _config(layers: int) -> ModelConfig:
    return ModelConfig(
        model_type="llama", vocab_size=100, hidden_size=32, intermediate_size=64,
        num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5,
        rope_theta=1e4, rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=True,
        attention_bias=False, qk_norm=False,
    )  # fmt: skip


def test_stages_split_the_layers_evenly():
    cfg = _config(30)  # SmolLM2-135M's 30 layers
    assert [(s.start, s.end) for s in (Stage.of(cfg, r, 4) for r in range(4))] == [
        (0, 7), (7, 15), (15, 22), (22, 30),
    ]  # fmt: skip
    assert Stage.of(cfg, 1, 4).local_config(cfg).num_layers == 8
    assert [(s.start, s.end) for s in (Stage.of(cfg, r, 30) for r in range(30))][-1] == (29, 30)
    with pytest.raises(ValueError, match="pp_size=31 exceeds the model's 30 layers"):
        Stage.of(cfg, 0, 31)


def test_a_stage_reads_only_its_own_weights():
    cfg = _config(4)
    names = [
        "model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight",
        "model.layers.2.self_attn.q_proj.weight", "model.layers.3.input_layernorm.weight",
        "model.norm.weight", "lm_head.weight",
    ]  # fmt: skip
    weights = [(n, None) for n in names]
    first, last = Stage.of(cfg, 0, 2), Stage.of(cfg, 1, 2)
    assert [n for n, _ in first.own_weights(weights, cfg)] == names[:2]
    # the last stage renumbers its layers from 0, and keeps the embedding its tied head reads
    assert [n for n, _ in last.own_weights(weights, cfg)] == [
        "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.input_layernorm.weight", "model.norm.weight", "lm_head.weight",
    ]  # fmt: skip


def _lists(extend_lens: list[int], logits_rows: list[int], pending=()):
    from radixlm.runtime.model_runner import StepLists

    tokens = sum(extend_lens)
    return StepLists(
        input_ids=list(range(100, 100 + tokens)), positions=list(range(tokens)),
        token_rows=[i for i, n in enumerate(extend_lens) for _ in range(n)],
        pending=list(pending), rows=list(range(len(extend_lens))), extend_lens=extend_lens,
        prefix_lens=[0] * len(extend_lens), num_multi=sum(n > 1 for n in extend_lens),
        logits_rows=logits_rows,
    )  # fmt: skip


def test_a_large_step_splits_into_micro_batches_of_whole_requests():
    from radixlm.runtime.pipeline import split_step

    # a prompt chunk of 6 (input log-probabilities at rows 1-5, its token at 5), then 4 decodes,
    # the last one's input still on the device
    lists = _lists([6, 1, 1, 1, 1], [1, 2, 3, 4, 5, 6, 7, 8, 9], pending=[(9, 4)])
    parts = split_step(lists, 2, 1)
    assert [p.extend_lens for p in parts] == [[6], [1, 1, 1, 1]]
    assert [p.rows for p in parts] == [[0], [1, 2, 3, 4]]
    assert [p.num_multi for p in parts] == [1, 0]
    assert [p.logits_rows for p in parts] == [[1, 2, 3, 4, 5], [0, 1, 2, 3]]  # (their own rows)
    assert parts[1].input_ids == [106, 107, 108, 109] and parts[1].pending == [(3, 4)]
    assert parts[1].positions == [6, 7, 8, 9] and parts[1].token_rows == [1, 2, 3, 4]
    # every token and logits row lands in exactly one part, in order
    three = split_step(lists, 3, 1)
    assert [p.extend_lens for p in three] == [[6], [1, 1], [1, 1]]
    assert sum((p.input_ids for p in three), []) == lists.input_ids
    # too small, or one request: whole
    assert split_step(lists, 2, 6) == [lists] and split_step(_lists([9], [8]), 2, 1)[0].rows == [0]
    assert len(split_step(lists, 2, 5)) == 2


def test_refusals_say_what_to_change(tiny_model_folder):
    import radixlm
    from radixlm.runtime.config import EngineConfig

    with pytest.raises(ValueError, match="pp_micro_batch_min_tokens=0; it must be at least 1"):
        EngineConfig(pp_micro_batch_min_tokens=0)
    with pytest.raises(ValueError, match="pp_size=0; it must be at least 1"):
        EngineConfig(pp_size=0)
    with pytest.raises(ValueError, match="nnodes=2 must be at least 1 and divide pp_size=3"):
        EngineConfig(pp_size=3, nnodes=2, dist_init_addr="127.0.0.1:5000")
    # a node holds whole stages of tensor-parallel ranks (four ranks a stage, two a node: no)
    with pytest.raises(ValueError, match="would split a stage's tensor-parallel ranks"):
        EngineConfig(tp_size=4, pp_size=2, nnodes=4, dist_init_addr="127.0.0.1:5000")
    EngineConfig(tp_size=4, pp_size=2, nnodes=2, dist_init_addr="127.0.0.1:5000")
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="pp_size=3 exceeds the model's 2 layers.*at most 2"):
        radixlm.Engine(tiny_model_folder, pp_size=3, max_total_tokens=1024)
    assert time.monotonic() - t0 < 30  # (refused before any stage's process starts)


def _workload(eng) -> list[dict]:
    """Concurrent requests (two threads, each a batch), prompts longer than the 16-token chunk,
    and a shared prefix cached before they come."""
    shared = "A careful librarian sorts the new books by their authors, then by year: "
    eng.flush_cache()
    eng.generate(shared + "first.", {"max_new_tokens": 1})
    batches = [
        [shared + "poetry.", "The sky is", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15"],
        [shared + "maps and atlases.", "Hello", "Once upon a time in a land far away there was"],
    ]
    outs: list[list[dict]] = [[], []]

    def run(i: int) -> None:
        outs[i] = eng.generate(batches[i], GREEDY)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return outs[0] + outs[1]


@pytest.fixture(scope="module")
def reference(four_layer_folder) -> list[dict]:
    import radixlm

    with radixlm.Engine(four_layer_folder, **COMMON) as eng:
        return _workload(eng)


@pytest.mark.parametrize(
    ("pp_size", "micro_batches"),
    [(2, False), (2, True), (3, True)],
    ids=["2", "2-micro", "3-micro"],
)
def test_greedy_outputs_equal_one_process_token_for_token(
    four_layer_folder, reference, pp_size, micro_batches
):
    """Whole steps, and micro-batches (every step of several requests split: the threshold at
    one token) through two stages and through three, the middle one passing them on."""
    import radixlm

    min_tokens = 1 if micro_batches else 256
    with radixlm.Engine(
        four_layer_folder, pp_size=pp_size, pp_micro_batch_min_tokens=min_tokens, **COMMON
    ) as eng:
        # each stage holds its own layers and their KV cache only
        assert len(eng.model.model.layers) == Stage.of(eng.model_config, 0, pp_size).end
        assert len(eng._core.kv_pool.k) == len(eng.model.model.layers)
        got = _workload(eng)
        assert (eng.model.num_micro_batched_steps > 0) == micro_batches
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in reference]
    assert len({tuple(o["output_ids"]) for o in reference}) == len(reference)  # (not degenerate)
    assert got[0]["meta_info"]["cached_tokens"] > 0 and got[3]["meta_info"]["cached_tokens"] > 0


@pytest.fixture(scope="module")
def tp_reference(four_layer_folder) -> list[dict]:
    """The workload on two tensor-parallel ranks, and a seeded sampled request."""
    import radixlm

    with radixlm.Engine(four_layer_folder, tp_size=2, **COMMON) as eng:
        return _workload(eng) + [eng.generate("The sky is", SAMPLED)]


SAMPLED = {"max_new_tokens": 12, "temperature": 0.9, "seed": 5}


@pytest.mark.parametrize("micro_batches", [False, True], ids=["whole", "micro"])
def test_stages_of_tensor_parallel_ranks_give_the_tokens_of_those_ranks_alone(
    four_layer_folder, tp_reference, micro_batches
):
    """tp_size=2 inside each of pp_size=2 stages (four processes): each stage's two ranks split
    its layers' heads and run their collectives in a group of their own, each passes its
    activations to its peer in the next stage, and the first of the last stage sends the
    logits back. The arithmetic of each layer is that of two tensor-parallel ranks, so the
    tokens are those of tp_size=2 alone, token for token, greedy and sampled (the sampled
    tokens reach the first stage's other rank by a broadcast in its group)."""
    import radixlm

    min_tokens = 1 if micro_batches else 256
    with radixlm.Engine(
        four_layer_folder, tp_size=2, pp_size=2, pp_micro_batch_min_tokens=min_tokens, **COMMON
    ) as eng:
        assert len(eng.model.model.layers) == 2  # (this stage's layers, their heads split:)
        assert eng.model.model.layers[0].self_attn.num_heads == 2
        got = _workload(eng) + [eng.generate("The sky is", SAMPLED)]
        assert (eng.model.num_micro_batched_steps > 0) == micro_batches
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in tp_reference]
    assert got[0]["meta_info"]["cached_tokens"] > 0


def test_a_draft_model_drafts_on_the_first_stage_and_outputs_stay_the_targets(
    four_layer_folder, reference
):
    """STANDALONE speculative decoding under pipeline parallelism: the draft model (here the
    target itself) runs whole in the first stage's process, the target verifies its chains
    through the stages; the outputs are those of one process without speculation."""
    import radixlm

    with radixlm.Engine(
        four_layer_folder, pp_size=2, speculative_algorithm="STANDALONE",
        speculative_draft_model_path=four_layer_folder, speculative_adaptive=False,
        speculative_num_draft_tokens=4, **COMMON,
    ) as eng:  # fmt: skip
        got = _workload(eng)
        stats = eng.get_stats()
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in reference]
    assert stats["spec_verify_ct"] > 0 and stats["spec_accept_length"] > 2.0, stats


def test_the_real_model_on_two_stages(engine, default_model_folder):
    import radixlm

    prompts = [
        engine.apply_chat_template([{"role": "user", "content": "Name three colours."}]),
        "The capital of France is",
    ]
    params = {"max_new_tokens": 16, "temperature": 0}
    with radixlm.Engine(default_model_folder, pp_size=2, dist_timeout=60) as eng:
        got = eng.generate(prompts, params)
    ref = engine.generate(prompts, params)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in ref]
    assert got[0]["text"].strip()


def _drafted(eng) -> list:
    """The engine's EAGLE drafter made to record every chain it drafts."""
    drafter, seen = eng._core.speculative.draft_model, []
    draft = drafter.draft

    def recording(reqs, num):
        chains = draft(reqs, num)
        seen.append([list(c) for c in chains])
        return chains

    drafter.draft = recording
    return seen


@pytest.mark.parametrize("algorithm", ["EAGLE3", "EAGLE"])
def test_eagle_drafts_read_every_stages_features_as_one_process_does(
    four_layer_folder, reference, algorithm, tmp_path
):
    """EAGLE-3's features are the inputs of three layers that different stages hold (EAGLE's the
    last stage's final state): each stage sends its own to the first, which joins them in the
    draft's order. An untrained draft's chains are a function of those features alone, so the
    chains drafted through two stages (micro-batched too) are the single process's, step for
    step; the outputs are the target's."""
    import radixlm
    from radixlm.runtime.speculative.eagle3_training import new_draft

    options = dict(
        speculative_algorithm=algorithm, speculative_draft_model_path=str(tmp_path),
        speculative_adaptive=False, **COMMON,
    )  # fmt: skip
    with radixlm.Engine(four_layer_folder, **COMMON) as eng:
        draft, raw = new_draft(eng.model, seed=0, algorithm=algorithm)
        draft.save(tmp_path, raw)
    with radixlm.Engine(four_layer_folder, **options) as eng:
        want = _drafted(eng)
        eng.generate(["The sky is", "1, 2, 3, 4, 5, 6, 7, 8, 9"], GREEDY)
    with radixlm.Engine(
        four_layer_folder, pp_size=2, pp_micro_batch_min_tokens=1, **options
    ) as eng:  # fmt: skip
        recorded = _drafted(eng)
        eng.generate(["The sky is", "1, 2, 3, 4, 5, 6, 7, 8, 9"], GREEDY)
        got = list(recorded)
        assert eng.model.num_micro_batched_steps > 0
        assert eng._core.speculative.eagle is not None  # (drafting never failed)
        outs = _workload(eng)
    assert got == want and len(want) > 3
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in reference]


def test_ngram_draft_trees_go_down_the_stages_as_one_process_verifies_them(
    engine, default_model_folder
):
    """speculative_eagle_topk=3: NGRAM's trees of several matches (their further paths in rows
    of the request table of their own) verified through two stages, micro-batched: the outputs
    and the tokens accepted a step are the single process's (the same arithmetic)."""
    import radixlm

    prompts = [
        ", ".join(str(i) for i in range(1, 21)) + ", 1, 2, 3, 4, 5,",
        engine.apply_chat_template(
            [{"role": "user", "content": "Copy exactly: apple, banana, cherry, date, fig."}]
        ),
    ]
    params = {"max_new_tokens": 32, "temperature": 0}
    options = dict(
        speculative_algorithm="NGRAM", speculative_eagle_topk=3, speculative_adaptive=False
    )
    with radixlm.Engine(default_model_folder, **options) as eng:
        want = eng.generate(prompts, params)
        want_stats = eng.get_stats()
    with radixlm.Engine(
        default_model_folder, pp_size=2, pp_micro_batch_min_tokens=1, dist_timeout=60, **options
    ) as eng:  # fmt: skip
        got = eng.generate(prompts, params)
        stats = eng.get_stats()
    plain = engine.generate(prompts, params)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert [o["output_ids"] for o in want] == [o["output_ids"] for o in plain]
    assert stats["spec_accept_length"] == want_stats["spec_accept_length"] > 2.0


def test_medusa_heads_draft_on_the_first_stage_from_the_last_stages_states(
    engine, default_model_folder
):
    """MEDUSA under pipeline parallelism: the last stage sends the final hidden states at the
    logits rows back with the logits, the shipped heads draft from them on the first stage; the
    outputs are those of one process without speculation, with drafts accepted."""
    import radixlm

    prompts = [
        engine.apply_chat_template([{"role": "user", "content": "Name three colours."}]),
        "1, 2, 3, 4, 5,",
    ]
    params = {"max_new_tokens": 16, "temperature": 0}
    with radixlm.Engine(
        default_model_folder, pp_size=2, dist_timeout=60, speculative_algorithm="MEDUSA",
        speculative_adaptive=False,
    ) as eng:  # fmt: skip
        got = eng.generate(prompts, params)
        stats = eng.get_stats()
    ref = engine.generate(prompts, params)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in ref]
    assert stats["spec_verify_ct"] > 0 and stats["spec_accept_length"] > 1.0, stats


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)
def test_two_gpus_match_one(default_model_folder):
    """NCCL send/recv, Triton attention, the overlap schedule: the real model in float32 on two
    stages against one GPU, greedy, in a batch with a grammar and a seeded sampled request, every
    multi-request step micro-batched (the order in which the two stages start their sends and
    recvs must agree, or NCCL deadlocks)."""
    import radixlm
    from tests.test_tensor_parallel import assert_same_greedy

    prompts = ["The capital of France is", "Give a colour as JSON:", "1, 2, 3,"]
    params = [
        {"max_new_tokens": 32, "temperature": 0},
        {"max_new_tokens": 24, "temperature": 0, "json_schema": '{"type": "object"}'},
        {"max_new_tokens": 32, "temperature": 0.7, "seed": 3},
    ]
    common = {"dtype": "float32", "max_total_tokens": 8192}
    with radixlm.Engine(
        default_model_folder, pp_size=2, pp_micro_batch_min_tokens=1, **common
    ) as eng:
        got = eng.generate(prompts, params)
        assert eng.model.num_micro_batched_steps > 0
    with radixlm.Engine(default_model_folder, **common) as ref_engine:
        ref = ref_engine.generate(prompts, params)
        for prompt, r, g in zip(prompts[:2], ref, got):
            assert_same_greedy(ref_engine, prompt, r, g)
    assert got[2]["output_ids"] == ref[2]["output_ids"]


# ---- failures ----------------------------------------------------------------------------------


def test_a_killed_stage_stops_the_engine_and_the_server_answers_503(tiny_model_folder):
    import httpx

    import radixlm
    from radixlm.errors import EngineShutDown
    from tests.live_server import serve_in_thread, wait_until

    eng = radixlm.Engine(tiny_model_folder, pp_size=2, max_total_tokens=2048, dist_timeout=20)
    try:
        with serve_in_thread(eng) as url:
            assert httpx.get(f"{url}/health", timeout=10).status_code == 200
            result: dict = {}

            def run() -> None:
                params = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}
                result["out"] = eng.generate("Count:", params)

            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            wait_until(lambda: eng.get_stats()["generated_tokens"] > 5, 60, "decoding begins")
            (last_stage,) = eng._tp.processes
            t0 = time.monotonic()
            os.kill(last_stage.pid, signal.SIGKILL)
            thread.join(timeout=30)
            assert not thread.is_alive(), "the request hung after its stage died"
            assert time.monotonic() - t0 < 30
            reason = result["out"]["meta_info"]["finish_reason"]
            assert reason["type"] == "abort" and "pipeline stage" in reason["message"], reason
            assert len(result["out"]["output_ids"]) < 400
            assert not eng.is_alive()
            with pytest.raises(EngineShutDown, match="pipeline stage"):
                eng.generate("Hello", {"max_new_tokens": 2})
            assert httpx.get(f"{url}/health", timeout=10).status_code == 503
            body = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}
            assert httpx.post(f"{url}/generate", json=body, timeout=30).status_code == 503
    finally:
        t0 = time.monotonic()
        eng.shutdown()
        assert time.monotonic() - t0 < 15


@pytest.mark.slow
def test_the_benchmark_runs_on_the_cpu_at_a_tiny_size():
    """benchmarks/tensor_parallel.py --pp-size (the GPU run's script) starts and reports."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [
            sys.executable, "-m", "benchmarks.tensor_parallel", "--device", "cpu", "--shape",
            "tiny", "--tp", "1", "--pp-size", "2", "--requests", "3", "--new-tokens", "6",
            "--repeats", "1", "--prompt-lens", "8-12", "--output-lens", "3-5", "--iters", "5",
            "--peak-mib", "1",
        ],
        cwd=root, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| 2 |" in done.stdout
    assert "pipeline messages per batch-1 decode step at pp=2" in done.stdout
