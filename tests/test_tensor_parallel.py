"""Tensor parallelism on the CPU: two processes over gloo, against one.

The real default model at tp_size=2 (its 3 KV heads split 2 + 1, its 9 query heads 6 + 3) gives
the tokens the single-process engine gives, alone and in a mixed batch with a JSON schema, a
shared prefix from the radix cache and a sampled request; the sums run in another order, so a
greedy choice may differ only where the single-process engine's two best tokens are tied to
float32 rounding, which the test then shows. A rank killed mid-run stops the engine with an
error (requests failed, the server's 503 and unhealthy /health), and never hangs; rank 0 killed
makes the other rank exit. The two-node switches are tried as two processes on this machine.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from radixlm.runtime.model_config import ModelConfig
from radixlm.runtime.parallel import Partition
from tests.live_server import wait_until

# a near-tie: the single-process engine's two best log-probabilities closer than this
NEAR_TIE = 1e-3


def _config(heads: int, kv_heads: int, intermediate: int = 64, vocab: int = 100) -> ModelConfig:
    return ModelConfig(
        model_type="llama", vocab_size=vocab, hidden_size=heads * 8,
        intermediate_size=intermediate, num_layers=1, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=8, rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None,
        max_position_embeddings=64, tie_word_embeddings=True, attention_bias=False,
        qk_norm=False,
    )  # fmt: skip


def test_partition_keeps_each_query_head_with_its_kv_head():
    # SmolLM2-135M: 9 query heads in 3 groups, on 2 ranks: groups 1 + 2
    cfg = _config(9, 3, intermediate=1536, vocab=49153)
    parts = [Partition.of(cfg, r, 2) for r in range(2)]
    assert [(p.kv_heads, p.heads) for p in parts] == [((0, 1), (0, 3)), ((1, 3), (3, 9))]
    assert [p.intermediate for p in parts] == [(0, 768), (768, 1536)]
    assert [p.vocab for p in parts] == [(0, 24577), (24577, 49154)]  # padded to 2 x 24577
    # fewer KV heads than ranks: each KV head on two ranks, which split its query heads
    cfg = _config(8, 2)
    parts = [Partition.of(cfg, r, 4) for r in range(4)]
    assert [p.kv_heads for p in parts] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [p.heads for p in parts] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match="use a tp_size of at most 3"):
        Partition.of(_config(9, 3), 0, 4)


def test_an_error_of_rank_0_inside_a_sent_step_stops_the_engine():
    """The other ranks are inside that step's collectives: going on would pair the next step's
    collectives with theirs, so the error becomes a RankFailure (which stops the engine)."""
    from radixlm.runtime.parallel import RankFailure
    from radixlm.runtime.tp_worker import StepMirror

    mirror = StepMirror(group=None, rows=None)
    with pytest.raises(RankFailure, match="cannot be brought back into step"), mirror.lockstep():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")


def _first_divergence(ref: list[int], got: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(ref, got)):
        if x != y:
            return i
    return None if len(ref) == len(got) else min(len(ref), len(got))


def assert_same_greedy(ref_engine, prompt: str | list[int], ref: dict, got: dict) -> None:
    """`got` (tp_size=2) has `ref`'s tokens (tp_size=1), up to a near-tie where it may take the
    other token: the single-process engine's own log-probabilities of the two, scored on the
    same context, closer than NEAR_TIE (shown when it happens)."""
    a, b = ref["output_ids"], got["output_ids"]
    i = _first_divergence(a, b)
    if i is None:
        return
    assert i < min(len(a), len(b)), f"one output stops early: {a} vs {b}"
    from radixlm.protocol.prompt_tokens import encode_prompt

    ids = prompt if isinstance(prompt, list) else encode_prompt(ref_engine.tokenizer, prompt)
    scored = ref_engine.generate(
        input_ids=ids + a[:i], sampling_params={"max_new_tokens": 1, "temperature": 0},
        return_logprob=True, top_logprobs_num=20,
    )  # fmt: skip
    top = {t: lp for lp, t, _ in scored["meta_info"]["output_top_logprobs"][0]}
    print(
        f"tensor parallel: diverged at output token {i}: tp=1 chose {a[i]} "
        f"(logprob {top.get(a[i])}), tp=2 chose {b[i]} (logprob {top.get(b[i])})"
    )
    assert a[i] in top and b[i] in top, f"not both among the top 20: {a} vs {b}"
    assert abs(top[a[i]] - top[b[i]]) < NEAR_TIE, (
        f"tp=2 diverged at token {i}, not at a near-tie ({top[a[i]]} vs {top[b[i]]}): {a} vs {b}"
    )


@pytest.fixture(scope="module")
def tp_engine(default_model_folder):
    import radixlm

    with radixlm.Engine(default_model_folder, tp_size=2) as eng:
        yield eng


GREEDY = {"max_new_tokens": 16, "temperature": 0}


def test_greedy_decoding_matches_one_process(engine, tp_engine):
    prompt = engine.apply_chat_template([{"role": "user", "content": "Name three colours."}])
    ref = engine.generate(prompt, GREEDY)
    got = tp_engine.generate(prompt, GREEDY)
    assert_same_greedy(engine, prompt, ref, got)
    assert got["text"].strip()


def test_mixed_batch_with_a_grammar_a_shared_prefix_and_sampling(engine, tp_engine):
    system = (
        "You are a careful assistant for a library. You answer in one short sentence and you "
        "never invent facts about the books you are asked about. "
    )
    schema = {
        "type": "object",
        "properties": {"title": {"type": "string"}, "year": {"type": "integer"}},
        "required": ["title", "year"],
    }
    prompts = [
        system + "Which book would you recommend for a long train ride?",
        system + "Describe a library in winter.",
        "Give a book as JSON with its title and year:",
        "Once upon a time",
    ]
    short = {**GREEDY, "max_new_tokens": 10}
    params = [
        short,
        short,
        {**GREEDY, "max_new_tokens": 24, "json_schema": json.dumps(schema)},
        {"max_new_tokens": 8, "temperature": 0.7, "seed": 7},
    ]
    outs = {}
    for name, eng in (("ref", engine), ("tp", tp_engine)):
        assert eng.flush_cache()
        eng.generate(system + "Hello.", {"max_new_tokens": 1})  # the prefix, cached
        outs[name] = eng.generate(prompts, params)
    for prompt, ref, got in zip(prompts[:3], outs["ref"], outs["tp"]):
        assert_same_greedy(engine, prompt, ref, got)
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in outs["tp"][:2])  # the radix cache
    assert json.loads(outs["tp"][2]["text"]).keys() == {"title", "year"}
    # the sampled request: the same seeded draws over (all but) the same logits, its tokens
    # broadcast to the other rank under the overlap schedule (a flip needs a float32 tie)
    assert outs["tp"][3]["output_ids"] == outs["ref"][3]["output_ids"]


def test_a_draft_model_drafts_on_rank_0_and_outputs_stay_the_targets(engine, default_model_folder):
    """STANDALONE speculative decoding under tensor parallelism: the draft model (here the
    target itself) runs whole in rank 0's process, the target verifies its chains over both
    ranks; greedy outputs are those of one process without speculation (but at a near-tie)."""
    import radixlm

    prompts = [
        engine.apply_chat_template([{"role": "user", "content": "Name three colours."}]),
        "The capital of France is",
    ]
    with radixlm.Engine(
        default_model_folder, tp_size=2, speculative_algorithm="STANDALONE",
        speculative_draft_model_path=default_model_folder, speculative_adaptive=False,
        speculative_num_draft_tokens=4,
    ) as eng:  # fmt: skip
        got = eng.generate(prompts, GREEDY)
        stats = eng.get_stats()
    for prompt, ref, out in zip(prompts, engine.generate(prompts, GREEDY), got):
        assert_same_greedy(engine, prompt, ref, out)
    assert stats["spec_verify_ct"] > 0 and stats["spec_accept_length"] > 2.0, stats


@pytest.mark.parametrize("topk", [1, 2])
def test_the_shipped_eagle3_draft_drafts_on_rank_0_and_outputs_stay_the_targets(engine, topk):
    """EAGLE3 under tensor parallelism: the draft runs in rank 0's process on the target's
    features (the residual stream, whole on every rank) with the whole embedding read from the
    checkpoint (the ranks hold half the vocabulary each); the shipped head is found by the whole
    LM head, as in one process. Greedy outputs are those of one process without speculation (but
    at a near-tie), with drafts taken; as chains and (topk 2) as trees."""
    import radixlm

    prompts = [
        engine.apply_chat_template([{"role": "user", "content": "Name three colours."}]),
        "The capital of France is",
    ]
    options = dict(
        speculative_algorithm="EAGLE3", speculative_adaptive=False, speculative_eagle_topk=topk
    )
    with radixlm.Engine(engine.model_folder, tp_size=2, **options) as eng:
        got = eng.generate(prompts, GREEDY)
        stats = eng.get_stats()
    for prompt, ref, out in zip(prompts, engine.generate(prompts, GREEDY), got):
        assert_same_greedy(engine, prompt, ref, out)
    assert stats["spec_verify_ct"] > 0 and stats["spec_accept_length"] > 1.2, stats


def test_an_eagle_draft_runs_under_tensor_parallelism_with_the_whole_lm_head(engine, tmp_path):
    """EAGLE (EAGLE-1/2) under tensor parallelism: its draft reads the target's final hidden
    state and its whole embedding and LM head (a random draft here: outputs must stay the
    target's whatever it proposes)."""
    import radixlm
    from radixlm.runtime.speculative.eagle3_training import new_draft

    draft, raw = new_draft(engine.model, seed=0, algorithm="EAGLE")
    draft.save(tmp_path, raw)
    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    with radixlm.Engine(
        engine.model_folder, tp_size=2, speculative_algorithm="EAGLE",
        speculative_draft_model_path=str(tmp_path), speculative_adaptive=False,
    ) as eng:  # fmt: skip
        got = eng.generate(prompts, GREEDY)
        stats = eng.get_stats()
        assert eng._core.speculative.eagle is not None  # (drafting never failed)
    for prompt, ref, out in zip(prompts, engine.generate(prompts, GREEDY), got):
        assert_same_greedy(engine, prompt, ref, out)
    assert stats["spec_verify_ct"] > 0 and stats["spec_num_proposed_drafts"] > 0, stats


def test_the_shipped_medusa_heads_draft_under_tensor_parallelism(engine):
    """MEDUSA under tensor parallelism: the heads read the final hidden state (whole on rank 0)
    through the whole LM head; the shipped heads are found by it, and outputs stay the target's."""
    import radixlm

    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    with radixlm.Engine(
        engine.model_folder, tp_size=2, speculative_algorithm="MEDUSA", speculative_adaptive=False
    ) as eng:
        got = eng.generate(prompts, GREEDY)
        stats = eng.get_stats()
    for prompt, ref, out in zip(prompts, engine.generate(prompts, GREEDY), got):
        assert_same_greedy(engine, prompt, ref, out)
    assert stats["spec_verify_ct"] > 0 and stats["spec_accept_length"] > 1.0, stats


# ---- failures (the tiny model: only the processes matter) ------------------------------------


def _long_generation(eng) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run():
        try:
            result["out"] = eng.generate(
                "Count:", {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}
            )
        except Exception as e:  # (an engine already stopped refuses instead)
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def test_a_killed_rank_stops_the_engine_and_the_server_answers_503(tiny_model_folder):
    import httpx

    import radixlm
    from radixlm.errors import EngineShutDown
    from tests.live_server import serve_in_thread

    eng = radixlm.Engine(tiny_model_folder, tp_size=2, max_total_tokens=2048, dist_timeout=20)
    try:
        with serve_in_thread(eng) as url:
            assert httpx.get(f"{url}/health", timeout=10).status_code == 200
            thread, result = _long_generation(eng)
            wait_until(lambda: eng.get_stats()["generated_tokens"] > 5, 60, "decoding begins")
            (follower,) = eng._tp.processes
            t0 = time.monotonic()
            os.kill(follower.pid, signal.SIGKILL)
            thread.join(timeout=30)
            assert not thread.is_alive(), "the request hung after its rank died"
            assert time.monotonic() - t0 < 30
            out = result["out"]
            assert out["meta_info"]["finish_reason"]["type"] == "abort"
            assert "tensor-parallel" in out["meta_info"]["finish_reason"]["message"]
            assert len(out["output_ids"]) < 400
            assert not eng.is_alive()
            with pytest.raises(EngineShutDown, match="tensor-parallel"):
                eng.generate("Hello", {"max_new_tokens": 2})
            assert httpx.get(f"{url}/health", timeout=10).status_code == 503
            body = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}
            assert httpx.post(f"{url}/generate", json=body, timeout=30).status_code == 503
    finally:
        t0 = time.monotonic()
        eng.shutdown()
        assert time.monotonic() - t0 < 15


_RANK0 = textwrap.dedent(
    """
    import sys, time
    import radixlm
    eng = radixlm.Engine(sys.argv[1], tp_size=2, max_total_tokens=2048, dist_timeout=20)
    print(eng._tp.processes[0].pid, flush=True)
    eng.generate("Count:", {"max_new_tokens": 100000, "temperature": 0, "ignore_eos": True})
    """
)


def _exited(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # (a zombie has exited)
    except FileNotFoundError:
        return True


def test_the_other_rank_exits_when_rank_0_is_killed(tiny_model_folder):
    rank0 = subprocess.Popen(
        [sys.executable, "-c", _RANK0, tiny_model_folder], stdout=subprocess.PIPE, text=True
    )
    try:
        follower = int(rank0.stdout.readline())
        time.sleep(0.5)  # (decoding)
        rank0.kill()
        rank0.wait(timeout=10)
        wait_until(lambda: _exited(follower), 30, "rank 1 exits after rank 0 died")
    finally:
        rank0.kill()
        rank0.wait()


def test_two_nodes_on_one_machine(tiny_model_folder):
    """Node 1 as `radixlm serve --node-rank 1` in its own process, node 0 the Engine here."""
    import radixlm
    from tests.live_server import free_port

    addr = f"127.0.0.1:{free_port()}"
    common = {"max_total_tokens": 2048, "dist_timeout": 60}
    node1 = subprocess.Popen(
        [
            sys.executable, "-m", "radixlm", "serve", "--model-path", tiny_model_folder,
            "--tp-size", "2", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr,
            "--max-total-tokens", "2048", "--dist-timeout", "60",
        ],
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        params = {"max_new_tokens": 8, "temperature": 0}
        with radixlm.Engine(
            tiny_model_folder, tp_size=2, nnodes=2, node_rank=0, dist_init_addr=addr, **common
        ) as eng:
            got = eng.generate(["The sky is", "1, 2, 3,"], params)
        assert node1.wait(timeout=30) == 0  # (node 0's engine stopped: so does node 1)
        with radixlm.Engine(tiny_model_folder, **common) as eng:
            ref = eng.generate(["The sky is", "1, 2, 3,"], params)
            for prompt, r, g in zip(["The sky is", "1, 2, 3,"], ref, got):
                assert_same_greedy(eng, prompt, r, g)
    finally:
        node1.kill()
        node1.wait()


@pytest.mark.slow
def test_the_benchmark_runs_on_the_cpu_at_a_tiny_size(default_model_folder):
    """benchmarks/tensor_parallel.py (two GPUs, the 8B shape) starts and reports on gloo."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [
            sys.executable, "-m", "benchmarks.tensor_parallel", "--device", "cpu", "--shape",
            "tiny", "--tp", "2", "--requests", "3", "--new-tokens", "6", "--repeats", "1",
            "--prompt-lens", "8-12", "--output-lens", "3-5", "--iters", "5", "--peak-mib", "1",
        ],
        cwd=root, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| 2 |" in done.stdout and "all-reduce time per batch-1 decode step at tp=2" in (
        done.stdout
    )


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)
def test_two_gpus_match_one(default_model_folder):
    """NCCL, CUDA graphs (their collectives captured), Triton attention, the overlap schedule:
    the real model in float32 at tp_size=2 against tp_size=1, greedy, in a batch with a grammar."""
    import radixlm

    prompts = ["The capital of France is", "Give a colour as JSON:", "1, 2, 3,"]
    params = [
        {"max_new_tokens": 32, "temperature": 0},
        {"max_new_tokens": 24, "temperature": 0, "json_schema": '{"type": "object"}'},
        {"max_new_tokens": 32, "temperature": 0.7, "seed": 3},
    ]
    common = {"dtype": "float32", "max_total_tokens": 8192, "cuda_graph_max_bs": 8}
    with radixlm.Engine(default_model_folder, tp_size=2, **common) as eng:
        got = eng.generate(prompts, params)
        assert eng.get_stats()["graph_steps"] > 0
    with radixlm.Engine(default_model_folder, **common) as ref_engine:
        ref = ref_engine.generate(prompts, params)
        for prompt, r, g in zip(prompts[:2], ref, got):
            assert_same_greedy(ref_engine, prompt, r, g)
    assert got[2]["output_ids"] == ref[2]["output_ids"]


def test_a_rank_that_never_comes_fails_the_start_within_the_timeout(tiny_model_folder):
    import radixlm
    from tests.live_server import free_port

    addr = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] did not connect within 3s"):
        radixlm.Engine(
            tiny_model_folder, tp_size=2, nnodes=2, dist_init_addr=addr, dist_timeout=3,
            max_total_tokens=1024,
        )  # fmt: skip
    assert time.monotonic() - t0 < 60
    with socket.create_server(("127.0.0.1", int(addr.rpartition(":")[2]))):
        pass  # (the rendezvous port is free again: nothing left listening)
