"""The offline Engine API on the real default model: shapes of results, streaming, stop strings,
seeds, n, and clear errors for bad input."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

import radixlm
from radixlm.protocol.sampling_params import SamplingParams
from radixlm.runtime.detokenizer import IncrementalDetokenizer

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "My favourite food is", "Water boils at"]


def test_result_shape_and_meta_info(engine):
    out = engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == 5 and meta["completion_tokens"] == len(out["output_ids"]) <= 8
    assert meta["finish_reason"]["type"] in ("stop", "length") and meta["e2e_latency"] > 0
    assert out["text"] == engine.tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    assert "Paris" in out["text"]


def test_list_in_list_out_and_input_ids(engine):
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    outs = engine.generate(PROMPTS, params)
    assert isinstance(outs, list) and len(outs) == len(PROMPTS)
    ids = [engine.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    by_ids = engine.generate(input_ids=ids, sampling_params=params)
    assert [o["output_ids"] for o in by_ids] == [o["output_ids"] for o in outs]


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine):
    params = {"max_new_tokens": 12, "temperature": 1.0, "top_p": 0.9, "seed": 7, "ignore_eos": True}
    alone = engine.generate(PROMPTS[0], params)["output_ids"]
    noisy = engine.generate(
        [PROMPTS[0], *PROMPTS[1:]] * 4, [params] + [{"max_new_tokens": 20, "temperature": 0.8}] * 15
    )
    assert noisy[0]["output_ids"] == alone
    other_seed = engine.generate(PROMPTS[0], {**params, "seed": 8})["output_ids"]
    assert other_seed != alone


def test_n_samples_share_the_prompt_and_differ(engine):
    outs = engine.generate(
        PROMPTS[2],
        {"max_new_tokens": 10, "temperature": 1.0, "n": 4, "seed": 3, "ignore_eos": True},
    )
    assert len(outs) == 4
    assert len({tuple(o["output_ids"]) for o in outs}) > 1
    # sample k of n is the same as a single request seeded seed + k
    single = engine.generate(
        PROMPTS[2], {"max_new_tokens": 10, "temperature": 1.0, "seed": 5, "ignore_eos": True}
    )
    assert single["output_ids"] == outs[2]["output_ids"]


def test_stop_string_is_trimmed_and_reported(engine):
    out = engine.generate("1, 2, 3, 4,", {"max_new_tokens": 20, "temperature": 0, "stop": ["7"]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "7"}
    assert out["text"].strip().endswith(",") and "7" not in out["text"]


def test_stop_token_ids_and_min_new_tokens(engine):
    free = engine.generate(
        "1, 2, 3, 4,", {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    )
    first = free["output_ids"][0]
    out = engine.generate(
        "1, 2, 3, 4,", {"max_new_tokens": 6, "temperature": 0, "stop_token_ids": [first]}
    )
    assert out["output_ids"] == [first] and out["meta_info"]["finish_reason"] == {
        "type": "stop",
        "matched": first,
    }
    held = engine.generate(
        "1, 2, 3, 4,",
        {"max_new_tokens": 6, "temperature": 0, "stop_token_ids": [first], "min_new_tokens": 2},
    )
    assert held["output_ids"][0] != first and len(held["output_ids"]) >= 2


def test_a_stop_token_mid_output_ends_it_there_and_every_token_is_counted(engine):
    params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    free = engine.generate(PROMPTS, params)
    stops = [o["output_ids"][4] for o in free]  # each output's fifth token
    before = engine.get_stats()["generated_tokens"]
    outs = engine.generate(PROMPTS, [{**params, "stop_token_ids": [t]} for t in stops])
    for f, o, t in zip(free, outs, stops):
        cut = f["output_ids"].index(t) + 1
        assert o["output_ids"] == f["output_ids"][:cut]
        assert o["meta_info"]["finish_reason"] == {"type": "stop", "matched": t}
    counted = engine.get_stats()["generated_tokens"] - before
    assert counted == sum(len(o["output_ids"]) for o in outs)


def test_streaming_is_cumulative_and_ends_with_the_full_result(engine):
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    chunks = list(engine.generate("Emoji test: 🙂🚀 are", params, stream=True))
    full = engine.generate("Emoji test: 🙂🚀 are", params)
    assert len(chunks) >= 2
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert chunks[-1]["text"] == full["text"] and chunks[-1]["output_ids"] == full["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_streamed_logprobs_are_each_snapshots_own_and_end_as_the_full_result(engine):
    """Snapshots' log-probability lists are converted as entries arrive (kept on the request);
    each snapshot still owns lists as long as its tokens, which later steps do not change."""
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    kwargs = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3}
    chunks = list(engine.generate("One, two, three,", params, stream=True, **kwargs))
    full = engine.generate("One, two, three,", params, **kwargs)
    assert len(chunks) >= 2
    for chunk in chunks:
        meta = chunk["meta_info"]
        assert len(meta["output_token_logprobs"]) == len(chunk["output_ids"])
        assert len(meta["output_top_logprobs"]) == len(chunk["output_ids"])
        assert [t for _, t, _ in meta["output_token_logprobs"]] == chunk["output_ids"]
    assert (
        chunks[0]["meta_info"]["output_token_logprobs"]
        is not (chunks[-1]["meta_info"]["output_token_logprobs"])
    )
    for key in ("input_token_logprobs", "output_token_logprobs", "output_top_logprobs"):
        assert chunks[-1]["meta_info"][key] == full["meta_info"][key], key


def test_async_generate_and_async_stream(engine):
    async def main():
        params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
        outs = await asyncio.gather(*(engine.async_generate(p, params) for p in PROMPTS))
        chunks = [c async for c in await engine.async_generate(PROMPTS[0], params, stream=True)]
        return outs, chunks

    outs, chunks = asyncio.run(main())
    assert [o["output_ids"] for o in outs] == [
        o["output_ids"]
        for o in engine.generate(
            PROMPTS, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
        )
    ]
    assert chunks[-1]["output_ids"] == outs[0]["output_ids"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"prompt": ""}, "empty"),
        ({"prompt": "hi", "sampling_params": {"max_tokens": 3}}, "unknown sampling parameter"),
        ({"prompt": "hi", "sampling_params": {"temperature": -1}}, "temperature"),
        ({"prompt": "hi", "sampling_params": {"top_p": 0}}, "top_p"),
        ({"prompt": "hi", "sampling_params": {"max_new_tokens": -5}}, "max_new_tokens"),
        ({"prompt": "hi", "sampling_params": {"n": 10_000}}, "n="),
        ({"prompt": "hi", "sampling_params": {"stop": [""]}}, "stop"),
        ({"prompt": "hi", "sampling_params": {"regex": "a", "json_schema": "{}"}}, "at most one"),
        ({"input_ids": [1, 2, 10**9]}, "vocabulary"),
        ({"prompt": "x " * 9000}, "context"),
        ({"prompt": None}, "exactly one"),
        # a SamplingParams built by hand is checked as a dict is (it skipped the checks, and a
        # non-boolean skip_special_tokens then stopped the engine)
        ({"prompt": "hi", "sampling_params": SamplingParams(skip_special_tokens=1)}, "skip_"),
        ({"prompt": "hi", "sampling_params": SamplingParams(temperature="0.5")}, "temperature"),
        ({"prompt": "hi", "return_logprob": True, "top_logprobs_num": True}, "top_logprobs"),
        ({"prompt": "hi", "return_logprob": True, "logprob_start_len": True}, "logprob_start"),
    ],
)
def test_bad_input_raises_a_clear_value_error(engine, kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine.generate(**kwargs)
    # and the engine keeps serving
    assert engine.generate("Hi", {"max_new_tokens": 1})["meta_info"]["completion_tokens"] == 1


def test_bad_engine_options_and_model_paths(tmp_path):
    with pytest.raises(ValueError, match="unknown engine option"):
        radixlm.Engine(batch_size=3)
    for bad, message in (
        ({"max_total_tokens": "100"}, "max_total_tokens='100' must be int or None"),
        ({"disable_overlap_schedule": 1}, "disable_overlap_schedule=1 must be bool"),
        ({"random_seed": True}, "random_seed=True must be int"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            radixlm.Engine(**bad)
    with pytest.raises(ValueError, match="does not exist"):
        radixlm.Engine(str(tmp_path / "nope"))
    corrupt = tmp_path / "broken.gguf"
    corrupt.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ValueError, match="GGUF"):
        radixlm.Engine(str(corrupt), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="config.json"):
        radixlm.Engine(str(tmp_path))
    with pytest.raises(ValueError, match="model path is empty"):
        radixlm.Engine("")


def test_bad_model_files_and_sizes_are_clear_value_errors(tiny_model_folder, tmp_path):
    import json
    import shutil

    with pytest.raises(ValueError, match="or -1 for no chunking"):
        radixlm.Engine(tiny_model_folder, chunked_prefill_size=-2)
    with radixlm.Engine(tiny_model_folder, chunked_prefill_size=-1) as eng:  # SGLang's "off"
        assert eng.config.chunked_prefill_size == eng.context_len == 512
        assert (
            len(
                eng.generate(input_ids=list(range(5, 400)), sampling_params={"max_new_tokens": 2})[
                    "output_ids"
                ]
            )
            == 2
        )
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        radixlm.Engine(tiny_model_folder, context_length=4096)  # the tiny model has 512
    with pytest.raises(ValueError, match=r"max_total_tokens=\d+ needs .* GiB are free"):
        radixlm.Engine(tiny_model_folder, max_total_tokens=10**14)
    with pytest.raises(ValueError, match="tokenizer folder .* has none of"):
        radixlm.Engine(tiny_model_folder, tokenizer_path=str(tmp_path))
    with pytest.raises(ValueError, match="is not a folder"):
        radixlm.Engine(tiny_model_folder, tokenizer_path=str(tmp_path / "nope"))
    import torch
    from safetensors.torch import load_file, save_file

    partial = tmp_path / "partial"
    shutil.copytree(tiny_model_folder, partial)
    tensors = load_file(partial / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, partial / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"missing weights: \['model.layers.1.mlp.up_proj.weight'\]"
    ):
        radixlm.Engine(str(partial))  # named as the checkpoint names it, not as fused here
    quantized = tmp_path / "quantized"
    shutil.copytree(tiny_model_folder, quantized)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method 'fp8' are not supported yet.*Supported"):
        radixlm.Engine(str(quantized))
    mistral = tmp_path / "mistral"  # its own format next to Hugging Face's: the latter is read
    shutil.copytree(tiny_model_folder, mistral)
    save_file({"tok_embeddings.weight": torch.zeros(2, 2)}, mistral / "consolidated.safetensors")
    with radixlm.Engine(str(mistral)) as eng:
        assert eng.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 1})["output_ids"]
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_folder, broken)
    (broken / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="cannot read the weights file .*model.safetensors"):
        radixlm.Engine(str(broken))


def test_detokenizer_never_splits_a_character_and_finds_stops_across_chunks(tokenizer):
    text = "naïve café 🙂 — 東京 ok STOP here"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=["STOP"])
    seen = []
    for t in ids:
        detok.add([t])
        seen.append(detok.stream_text)
        assert "\ufffd" not in detok.stream_text
    assert detok.matched_stop == "STOP"
    assert detok.text == "naïve café 🙂 — 東京 ok "
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:]))


def test_a_stop_string_completed_by_a_token_with_a_partial_character_is_found(tokenizer):
    """A token such as ' ' + the first byte of a multi-byte character completes "User: " while
    its last byte is held back: the stop is found then (not leaked by the flush at the end)."""
    partial = next(
        t
        for t in range(tokenizer.vocab_size)
        if (s := tokenizer.decode([t])).startswith(" ") and s.endswith("\ufffd") and len(s) == 2
    )
    ids = tokenizer.encode("Hello User:", add_special_tokens=False) + [partial]
    detok = IncrementalDetokenizer(tokenizer, stop=["User: "])
    detok.add(ids)
    assert detok.matched_stop == "User: " and detok.text == "Hello "
    # the same tokens a token at a time, then flushed: still trimmed at the stop
    detok = IncrementalDetokenizer(tokenizer, stop=["User: "])
    for t in ids:
        detok.add_one(t)
    detok.flush()
    assert detok.matched_stop == "User: " and detok.text == "Hello "


def test_flush_trims_a_stop_string_in_the_held_back_text(tokenizer):
    # a stop string with the replacement character: only the flush's text can complete it
    ids = tokenizer.encode("ok", add_special_tokens=False)
    lone = tokenizer.encode("🙂", add_special_tokens=False)[:1]  # a partial character
    detok = IncrementalDetokenizer(tokenizer, stop=["k\ufffd"])
    detok.add(ids + lone)
    assert detok.matched_stop is None
    detok.flush()
    assert detok.matched_stop == "k\ufffd" and detok.text == "o"


def test_a_cancelled_async_generate_is_aborted_and_the_engine_lives(engine):
    """A caller's timeout on a non-streaming async_generate frees its seat (and its asyncio.run
    closing the loop does not stop the engine when the aborted result comes back)."""
    params = {"max_new_tokens": 2000, "ignore_eos": True}

    async def timed_out():
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(engine.async_generate("Count:", params), 0.3)

    asyncio.run(timed_out())
    deadline = time.monotonic() + 30
    while engine.get_stats()["num_running_reqs"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.get_stats()["num_running_reqs"] == 0
    assert engine.is_alive()
    assert engine.generate("Hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


def test_a_sink_that_raises_costs_its_request_not_the_engine(engine):
    req = engine._make_requests(
        "Count:", {"max_new_tokens": 500, "ignore_eos": True}, None, False, None, None
    )[0][0]

    def sink(r, finished):
        raise RuntimeError("the caller's code broke")

    engine._core.submit(req, sink)
    deadline = time.monotonic() + 30
    while not req.is_finished and time.monotonic() < deadline:
        time.sleep(0.05)
    assert req.finish_reason["type"] == "abort"
    assert engine.is_alive()
    assert engine.generate("Hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


def test_input_logprobs_of_a_one_token_prompt(engine):
    out = engine.generate(
        input_ids=[504],
        sampling_params={"max_new_tokens": 1},
        return_logprob=True,
        logprob_start_len=0,
    )
    assert out["meta_info"]["input_token_logprobs"] == [(None, 504, None)]


@pytest.mark.parametrize(
    "options",
    [
        {"cuda_graph_max_prefill_tokens": -1},
        {"cuda_graph_max_bs": 0},
        {"max_running_requests": 0},
        {"chunked_prefill_size": 0},
        {"mem_fraction_static": 1.5},
    ],
)
def test_bad_engine_options_are_refused_naming_the_option(options):
    from radixlm.runtime.config import EngineConfig

    (name,) = options
    with pytest.raises(ValueError, match=name):
        EngineConfig(**options)


def test_paths_may_be_pathlib_paths(tmp_path):
    from radixlm.runtime.config import EngineConfig

    config = EngineConfig(model_path=tmp_path, speculative_draft_model_path=tmp_path / "draft",
                          speculative_algorithm="MEDUSA")  # fmt: skip
    assert config.model_path == str(tmp_path)
    assert config.speculative_draft_model_path == str(tmp_path / "draft")
    with pytest.raises(ValueError, match="max_running_requests"):  # (a path is no number)
        EngineConfig(max_running_requests=tmp_path)


class _BosTokenizer:
    """Llama-like: encoding with special tokens puts BOS (1) in front; a character an id each."""

    bos_token_id = 1

    def encode(self, text, add_special_tokens=True):
        written = text.startswith("<s>")  # the BOS marker written in the text
        ids = ([1] if written else []) + [ord(c) for c in text[3 if written else 0 :]]
        return ([1] if add_special_tokens else []) + ids


def test_a_prompt_gets_the_bos_its_tokenizer_adds_once(tokenizer):
    from radixlm.protocol.prompt_tokens import encode_prompt

    bos = _BosTokenizer()
    assert encode_prompt(bos, "ab") == [1, ord("a"), ord("b")]
    assert encode_prompt(bos, "<s>ab") == [1, ord("a"), ord("b")]  # written in the text: once
    assert encode_prompt(bos, "") == [1]
    # SmolLM2's tokenizer adds none: its prompts are the text's tokens alone
    text = "<|im_start|>user\nHi"
    assert encode_prompt(tokenizer, text) == tokenizer.encode(text, add_special_tokens=False)


def test_text_ids_are_hugging_faces_ids_and_keep_the_gil(tokenizer):
    """text_ids (the Rust tokenizer's one-text encode) gives what Hugging Face's encode gives,
    special tokens, whitespace, other scripts and the empty text included, and falls back to it
    where the backend would cut or pad; and, unlike it, does not let the GIL go: beside a thread
    running Python it takes no longer than alone (Hugging Face's waits for the GIL's hand-over,
    up to the 5 ms switch interval, at every call)."""
    import copy
    import threading
    import time

    from radixlm.protocol.prompt_tokens import text_ids

    texts = [
        "", " ", "Hi", "  two  spaces\n\n\tand a tab", "<|im_start|>user\nHi<|im_end|>",
        "naïve café — 東京 🙂", "x" * 3000, '{"a": [1, 2.5e-3, null]}',
    ]  # fmt: skip
    for text in texts:
        assert text_ids(tokenizer, text) == tokenizer.encode(text, add_special_tokens=False)
    cutting = copy.copy(tokenizer)
    cutting._tokenizer = copy.copy(tokenizer.backend_tokenizer)
    cutting._tokenizer.enable_truncation(4)
    assert text_ids(cutting, "x" * 3000) == tokenizer.encode("x" * 3000, add_special_tokens=False)

    stop: list = []

    def busy() -> None:
        while not stop:
            pass

    thread = threading.Thread(target=busy)
    thread.start()
    try:
        t0 = time.perf_counter()
        for _ in range(20):
            text_ids(tokenizer, texts[4])
        ours = time.perf_counter() - t0
    finally:
        stop.append(1)
        thread.join()
    assert ours < 20 * 0.002, ours  # (about 50 us each; a hand-over per call would be ~5 ms)


def test_stop_token_ids_outside_the_vocabulary_are_refused_up_front(engine):
    """(Banned until min_new_tokens, an id past the logits' width failed every request of the
    step it ran in.)"""
    with pytest.raises(ValueError, match="stop_token_ids .* outside the vocabulary"):
        engine.generate("Hi", {"stop_token_ids": [10**6], "min_new_tokens": 1})
    assert engine.generate("Hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


def test_logit_bias_bans_and_forces_tokens(engine):
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    free = engine.generate("1, 2, 3, 4,", params)["output_ids"]
    # the free run's first token banned: a different first token, and the rest follow from it
    banned = engine.generate("1, 2, 3, 4,", {**params, "logit_bias": {str(free[0]): -100}})
    assert free[0] not in banned["output_ids"]
    # a token forced at every step
    forced = engine.generate("1, 2, 3, 4,", {**params, "logit_bias": {free[1]: 100}})
    assert forced["output_ids"] == [free[1]] * 6
    # batched with plain greedy requests, which stay as they were
    outs = engine.generate(["1, 2, 3, 4,"] * 2, [params, {**params, "logit_bias": {free[1]: 100}}])
    assert [o["output_ids"] for o in outs] == [free, [free[1]] * 6]
    with pytest.raises(ValueError, match="logit_bias token ids .* outside the vocabulary"):
        engine.generate("Hi", {"logit_bias": {10**6: 1}})


def test_min_new_tokens_holds_stop_strings_back_too(engine):
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    free = engine.generate("1, 2, 3, 4,", params)
    stop = free["text"].split(",")[0].strip() or free["text"][:2]  # met at once, greedily
    early = engine.generate("1, 2, 3, 4,", {**params, "stop": [stop]})
    assert early["meta_info"]["completion_tokens"] < 6
    held = engine.generate("1, 2, 3, 4,", {**params, "stop": [stop], "min_new_tokens": 6})
    assert held["meta_info"]["completion_tokens"] >= 6


def test_detokenizer_looks_for_stop_strings_from_min_tokens_on(tokenizer):
    ids = [tokenizer.encode(c, add_special_tokens=False)[0] for c in "abab"]
    detok = IncrementalDetokenizer(tokenizer, stop=["b"], min_tokens=3)
    for t in ids[:3]:
        detok.add_one(t)
    assert detok.matched_stop is None and detok.text == "aba"
    detok.add_one(ids[3])
    assert detok.matched_stop == "b" and detok.text == "aba"


def test_a_tiny_temperature_is_greedy_and_any_integer_is_a_seed(engine):
    params = {"max_new_tokens": 6, "ignore_eos": True}
    greedy = engine.generate("The sky is", {**params, "temperature": 0})["output_ids"]
    for t in (1e-38, 1e-6):  # logits / T would overflow float32
        assert engine.generate("The sky is", {**params, "temperature": t})["output_ids"] == greedy
    sampled = {**params, "temperature": 1.0}
    a = engine.generate("The sky is", {**sampled, "seed": 5})["output_ids"]
    assert engine.generate("The sky is", {**sampled, "seed": 5 + 2**64})["output_ids"] == a
    assert engine.generate("The sky is", {**sampled, "seed": -1})["meta_info"]["completion_tokens"]


def test_a_stream_read_late_holds_its_newest_snapshot_not_one_a_step(engine):
    """Snapshots are cumulative: a reader that falls behind gets the newest one (older ones
    untaken are dropped), which still ends with the full result."""
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    stream = engine.generate("Count: one, two,", params, stream=True)
    first = next(stream)
    deadline = time.monotonic() + 60
    while engine.get_stats()["num_running_reqs"] and time.monotonic() < deadline:
        time.sleep(0.05)  # the whole generation ends while nothing is read
    rest = list(stream)
    # the newest only: the final one (or the last step's, if read just before the finish came)
    assert len(rest) <= 2 and rest[-1]["meta_info"]["finish_reason"] is not None
    full = engine.generate("Count: one, two,", params)
    assert first["meta_info"]["finish_reason"] is None
    assert rest[-1]["output_ids"] == full["output_ids"] and rest[-1]["text"] == full["text"]

    async def read_late():
        stream = await engine.async_generate("Count: one, two,", params, stream=True)
        first = await stream.__anext__()
        await asyncio.sleep(0)
        while engine.get_stats()["num_running_reqs"]:
            await asyncio.sleep(0.05)
        return first, [c async for c in stream]

    first, rest = asyncio.run(read_late())
    assert len(rest) <= 2 and rest[-1]["output_ids"] == full["output_ids"]


def test_auto_dtype_keeps_a_float16_checkpoint_in_float16_on_a_gpu(monkeypatch):
    from types import SimpleNamespace

    import torch

    from radixlm.runtime.engine import auto_dtype

    cpu, gpu = torch.device("cpu"), torch.device("cuda:0")
    saved = {name: SimpleNamespace(dtype=name) for name in ("float16", "bfloat16", "float32")}
    assert auto_dtype(cpu, saved["float16"]) == "float32"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert auto_dtype(gpu, saved["float16"]) == "float16"
    assert auto_dtype(gpu, SimpleNamespace(torch_dtype=torch.float16)) == "float16"
    assert auto_dtype(gpu, saved["bfloat16"]) == "bfloat16"
    assert auto_dtype(gpu, saved["float32"]) == "bfloat16"
    assert auto_dtype(gpu, SimpleNamespace()) == "bfloat16"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert auto_dtype(gpu, saved["bfloat16"]) == "float16"  # no bfloat16 before Ampere


def test_results_posted_to_an_event_loop_arrive_in_order_at_few_wake_ups():
    """The engine core's posts to one event loop go together: those made before the loop runs
    join one wake-up (not a self-pipe write each), run in the order posted; a closed loop says
    so (its consumer has gone)."""
    import threading

    from radixlm.runtime.engine import _post

    loop = asyncio.new_event_loop()
    got, wakes = [], []
    real = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda *a, **k: (wakes.append(1), real(*a, **k))[1]

    def core():
        for i in range(200):
            assert _post(loop, got.append, i)

    thread = threading.Thread(target=core)
    thread.start()
    thread.join()
    loop.run_until_complete(asyncio.sleep(0.01))
    assert got == list(range(200))
    assert len(wakes) == 1  # (the loop did not run while the thread posted)
    assert _post(loop, got.append, 200)
    loop.run_until_complete(asyncio.sleep(0.01))
    assert got[-1] == 200 and len(wakes) == 2
    assert _post(loop, got.append, 201)  # (a wake-up the loop never runs: it closes first)
    loop.close()
    assert _post(loop, got.append, 202) is False
    assert loop._radixlm_mailbox._items == []  # (what waited is let go, not kept with the loop)
    assert got[-1] == 200
