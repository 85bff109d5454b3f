"""The program language end to end on the real default model (SmolLM2-135M-Instruct, CPU):
each construct against the engine's own answers, prefix sharing measured on the engine's
statistics, and the HTTP backends against the in-process one (the examples: test_examples.py)."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

import radixlm as sgl
from radixlm.lang import default_backend as default_backend_module
from radixlm.lang.backend import BackendError
from radixlm.lang.default_backend import resolve_backend
from radixlm.lang.engine_backend import EngineBackend
from radixlm.lang.interpreter import ProgramError
from tests.faults import fail_model_call
from tests.live_server import serve_in_thread, sse_payloads

API_KEY = "lang-test-key"
FRANCE = "What is the capital of France?"
CITIES = ["London", "Paris", "Berlin", "Madrid"]


def chat_prompt(engine, question: str) -> str:
    return engine.apply_chat_template([{"role": "user", "content": question}])


def computed_prompt_tokens(before: dict, after: dict) -> int:
    """Prompt tokens the engine computed (not served from the prefix cache) between two stats."""
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    return prompt - (after["cached_tokens"] - before["cached_tokens"])


class CountingEngine:
    """The engine, with its `generate` calls recorded and their overlap measured."""

    def __init__(self, engine):
        self._engine = engine
        self.calls: list[dict] = []
        self.active = self.max_active = 0
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def generate(self, *args, **kwargs):
        with self._lock:
            self.calls.append(kwargs)
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            return self._engine.generate(*args, **kwargs)
        finally:
            with self._lock:
                self.active -= 1


@sgl.function
def qa(s, question, max_tokens=12):
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=max_tokens))


# ---- roles and chat templates --------------------------------------------------------------


def test_roles_render_the_models_own_chat_template(engine, default_model_folder):
    @sgl.function
    def chat(s, with_system):
        if with_system:
            s += sgl.system("Be brief.")
        s += sgl.user("Hi!")
        s += sgl.assistant("Hello.")
        with s.user():
            s += "How are "
            s += "you?"
        s += sgl.assistant_begin() + "Fine." + sgl.assistant_end()

    turns = [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "How are you?"},
        {"role": "assistant", "content": "Fine."},
    ]
    state = chat.run(True, backend=engine)
    messages = [{"role": "system", "content": "Be brief."}, *turns]
    assert state.messages() == messages
    assert state.text() == engine.apply_chat_template(messages, add_generation_prompt=False)
    # no system message: the template's own default one, as the tokenizer renders it
    state = chat.run(False, backend=engine)
    assert state.text() == engine.apply_chat_template(turns, add_generation_prompt=False)
    assert state.messages()[0]["role"] == "system"
    # the torch-free reading of the tokenizer files gives the same markers
    from radixlm.lang.chat_template import template_from_tokenizer_files

    files = template_from_tokenizer_files(default_model_folder)
    assert files == resolve_backend(engine).chat_template


# ---- gen -----------------------------------------------------------------------------------


def test_gen_is_the_engines_generation_for_the_state_text(engine):
    state = qa.run(FRANCE, backend=engine, temperature=0)
    state.sync()  # run() returns while the last gen may still be running
    expected = engine.generate(
        chat_prompt(engine, FRANCE), {"max_new_tokens": 12, "temperature": 0}
    )
    assert state["answer"] == expected["text"]
    assert "Paris" in state["answer"]
    meta = state.get_meta_info("answer")
    assert meta["completion_tokens"] == expected["meta_info"]["completion_tokens"]
    # the program's prompt is exactly the chat prompt: the direct call found all of it cached
    assert expected["meta_info"]["cached_tokens"] >= expected["meta_info"]["prompt_tokens"] - 1
    assert state.text().endswith(expected["text"] + "<|im_end|>\n")


def test_few_shot_gen_with_stop_and_multi_turn_chat(engine):
    @sgl.function
    def few_shot(s, country):
        s += "Q: What is the capital of Italy?\nA: Rome\n"
        s += "Q: What is the capital of Japan?\nA: Tokyo\n"
        s += f"Q: What is the capital of {country}?\nA:" + sgl.gen("answer", stop="\n")

    state = few_shot.run("France", backend=engine, temperature=0, max_new_tokens=16)
    assert "\n" not in state["answer"] and "Paris" in state["answer"]
    assert state.get_meta_info("answer")["finish_reason"]["type"] == "stop"

    @sgl.function
    def multi_turn(s):
        s += sgl.user(FRANCE)
        s += sgl.assistant(sgl.gen("first", max_tokens=10))
        s += sgl.user("And the capital of Germany?")
        s += sgl.assistant(sgl.gen("second", max_tokens=10))

    state = multi_turn.run(backend=engine, temperature=0)
    roles = [m["role"] for m in state.messages()]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    assert state.messages()[-1]["content"] == state["second"]
    assert "Berlin" in state["second"]


def test_constrained_gen_dtype_regex_json_schema_and_min_tokens(engine):
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=16)
        age: int = Field(ge=0, le=120)

    @sgl.function
    def prog(s):
        s += sgl.user("How many legs does a spider have?")
        s += sgl.assistant(sgl.gen("legs", dtype=int, max_tokens=4))
        s += sgl.user("Name a primary color.")
        s += sgl.assistant(sgl.gen("color", regex=r"(red|yellow|blue)"))
        s += sgl.user("Describe a person as JSON with name and age.")
        s += sgl.assistant(sgl.gen("person", json_schema=Person, max_tokens=32))
        s += sgl.user("Say yes.")
        s += sgl.assistant(sgl.gen("long", min_tokens=6, max_tokens=8))

    state = prog.run(backend=engine, temperature=0)
    assert state.error() is None
    assert int(state["legs"]) >= 0
    assert state["color"] in ("red", "yellow", "blue")
    person = Person.model_validate_json(state["person"])
    assert person.name
    assert state.get_meta_info("long")["completion_tokens"] >= 6


# ---- select --------------------------------------------------------------------------------


@sgl.function
def capital(s, method=sgl.token_length_normalized):
    s += sgl.user(FRANCE)
    s += sgl.assistant(
        "The capital of France is " + sgl.select("city", choices=CITIES, choices_method=method)
    )


def direct_choice_logprobs(engine, prefix: str, choice: str) -> list[float]:
    """The log-probabilities of the choice's tokens, asked of the engine directly."""
    tok = engine.tokenizer
    prefix_ids = tok.encode(prefix, add_special_tokens=False)
    ids = tok.encode(prefix + choice, add_special_tokens=False)
    start = next(i for i, (a, b) in enumerate(zip(prefix_ids + [None], ids)) if a != b)
    out = engine.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=start,
    )
    return [e[0] for e in out["meta_info"]["input_token_logprobs"]]


def test_select_picks_the_choice_the_model_scores_highest(engine):
    state = capital.run(backend=engine)
    prefix = chat_prompt(engine, FRANCE) + "The capital of France is "
    expected = [
        sum(lps) / len(lps) for lps in (direct_choice_logprobs(engine, prefix, c) for c in CITIES)
    ]
    assert state["city"] == CITIES[expected.index(max(expected))] == "Paris"
    meta = state.get_meta_info("city")
    assert meta["normalized_prompt_logprobs"] == pytest.approx(expected, abs=1e-3)
    # the prefix ends with a space that merges into the choice's first token: " Paris"
    assert "".join(e[2] for e in meta["input_token_logprobs"][1]) == " Paris"
    assert state.text().endswith("The capital of France is Paris<|im_end|>\n")


@pytest.mark.parametrize(
    "method",
    [
        sgl.token_length_normalized,
        sgl.greedy_token_selection,
        sgl.unconditional_likelihood_normalized,
    ],
)
def test_each_choices_method_in_one_batched_call_over_the_cached_prefix(engine, method):
    counting = CountingEngine(engine)
    state = capital.run(method, backend=EngineBackend(counting))
    assert state["city"] == "Paris"
    assert len(counting.calls) == 1  # every choice (and unconditional score) in one call
    prompts = counting.calls[0]["input_ids"]
    assert len(prompts) == len(CITIES) * (2 if method.requires_unconditional_logprobs else 1)
    meta = state.get_meta_info("city")
    prefix_len = len(engine.tokenizer.encode(chat_prompt(engine, FRANCE)))
    # scored over the shared prefix, computed once (by the first, unless cached before)
    assert min(sorted(meta["cached_tokens"])[1:]) >= prefix_len
    if method is sgl.unconditional_likelihood_normalized:
        first = meta["unconditional_token_logprobs"][1][0]
        assert first[0] is None and first[1] == meta["input_token_logprobs"][1][0][1]
        scores = meta["normalized_unconditional_prompt_logprobs"]
        assert CITIES[scores.index(max(scores))] == "Paris"


# ---- fork ----------------------------------------------------------------------------------


def test_fork_computes_the_shared_context_once_and_join_gathers(engine):
    context = " ".join(f"Item {i} weighs {i * 7 % 50} grams." for i in range(110))

    @sgl.function
    def forked(s, context):
        s += sgl.user(context + "\nName one item.")
        forks = s.fork(8)
        for i, f in enumerate(forks):
            f += sgl.assistant(f"Item {i}" + sgl.gen("item", max_tokens=3))
        forks.join()

    context_tokens = len(engine.tokenizer.encode(context))
    assert context_tokens >= 1000
    before = engine.get_stats()
    state = forked.run(context, backend=engine, temperature=0)
    state.sync()
    after = engine.get_stats()
    assert len(state["item"]) == 8 and all(isinstance(x, str) for x in state["item"])
    computed = computed_prompt_tokens(before, after)
    # the context once (plus the chat prefix), and a few tokens per fork: not 8 contexts
    assert context_tokens <= computed < context_tokens + 8 * 20 + 50
    for meta in state.get_meta_info("item"):
        assert meta["cached_tokens"] >= context_tokens


def test_concatenate_and_append_appends_the_forks_texts_and_reuses_the_first_forks_kv(engine):
    context = " ".join(f"Fact {i}: {i} is {'even' if i % 2 == 0 else 'odd'}." for i in range(60))
    forks_seen = []

    @sgl.function
    def joined(s):
        s += context + "\n"
        forks = s.fork(2)
        forks += lambda i: f"Fork {i} says:" + sgl.gen("part", max_tokens=6)
        forks_seen.extend(forks.states)
        forks.join("concate_and_append")
        s += "\nSo:" + sgl.gen("after", max_tokens=3)

    state = joined.run(backend=engine, temperature=0)
    added = [f.text().removeprefix(context + "\n") for f in forks_seen]
    assert added[0].startswith("Fork 0 says:") and added[1].startswith("Fork 1 says:")
    # the text is the parent's with each fork's new text appended in order
    assert state.text() == context + "\n" + "".join(added) + "\nSo:" + state["after"]
    # the request after the join found the prefix and the first fork, computed at these positions,
    # in the cache (the second fork's KV was computed at other positions: it is computed again)
    first = len(engine.tokenizer.encode(context + "\n" + added[0]))
    assert state.get_meta_info("after")["cached_tokens"] >= first - 2


# ---- run_batch -----------------------------------------------------------------------------


def test_run_batch_runs_concurrently_and_keeps_failures_on_their_own_state(engine, capfd):
    rules = " ".join(f"Rule {i}: answer politely and briefly." for i in range(80))

    @sgl.function
    def prog(s, i):
        if i == 3:
            raise ValueError("boom in program 3")
        s += sgl.system(rules)
        s += sgl.user(f"What is {i % 4} plus {i % 4}?")
        s += sgl.assistant(sgl.gen("answer", max_tokens=-1 if i == 5 else 4))

    counting = CountingEngine(engine)
    before = engine.get_stats()
    states = prog.run_batch(
        [{"i": i} for i in range(32)],
        backend=EngineBackend(counting),
        temperature=0,
        progress_bar=True,
    )
    after = engine.get_stats()
    assert "32/32" in capfd.readouterr().err
    assert counting.max_active > 1  # the programs overlapped
    assert isinstance(states[3].error(), ValueError) and "boom" in str(states[3].error())
    assert "max_new_tokens" in str(states[5].error())
    with pytest.raises(ProgramError, match="max_new_tokens"):
        states[5]["answer"]
    ok = [s for i, s in enumerate(states) if i not in (3, 5)]
    assert all(s.error() is None and isinstance(s["answer"], str) for s in ok)
    by_question = {}
    for i, s in enumerate(states):
        if i not in (3, 5):
            by_question.setdefault(i % 4, set()).add(s["answer"])
    assert all(len(answers) == 1 for answers in by_question.values())  # greedy: same answer
    # the long constant prefix (system rules, ~800 tokens) is computed once, not 30 times
    rules_tokens = len(engine.tokenizer.encode(rules))
    assert rules_tokens <= computed_prompt_tokens(before, after) < 1.5 * rules_tokens + 400


# ---- streaming -----------------------------------------------------------------------------


def test_stream_text_iter_and_async_iter(engine):
    expected = qa.run(FRANCE, backend=engine, temperature=0, max_tokens=12)["answer"]
    state = qa.run(FRANCE, backend=engine, temperature=0, stream=True, max_tokens=12)
    chunks = list(state.text_iter("answer"))
    assert len(chunks) > 1 and "".join(chunks) == expected == state["answer"]

    state = qa.run(FRANCE, backend=engine, temperature=0, stream=True, max_tokens=12)
    assert "".join(state.text_iter()) == state.text()

    async def collect():
        state = qa.run(FRANCE, backend=engine, temperature=0, stream=True, max_tokens=12)
        return [c async for c in state.text_async_iter("answer")]

    assert "".join(asyncio.run(collect())) == expected


# ---- default backend, bind, positional arguments ---------------------------------------------


def test_set_default_backend_bind_and_positional_batches(engine, monkeypatch):
    monkeypatch.setattr(default_backend_module, "_default", [])
    sgl.set_default_backend(engine)
    assert isinstance(sgl.get_default_backend(), EngineBackend)
    ask_france = qa.bind(question=FRANCE)
    assert "Paris" in ask_france.run(temperature=0)["answer"]
    states = qa.run_batch([(FRANCE, 4), (FRANCE,)], temperature=0)
    assert states[0].get_meta_info("answer")["completion_tokens"] <= 4
    assert "Paris" in states[1]["answer"]


def test_run_takes_sglangs_n_and_clears_the_default_backend(engine, monkeypatch):
    monkeypatch.setattr(default_backend_module, "_default", [])
    state = qa.run(FRANCE, 4, backend=engine, temperature=0.8, n=2)
    answers = state["answer"]
    assert isinstance(answers, list) and len(answers) == 2
    (batched,) = qa.run_batch([(FRANCE, 4)], backend=engine, temperature=0.8, n=2)
    assert len(batched["answer"]) == 2
    for bad, message in (({"n": 0}, "positive integer"), ({"stop_regex": "x"}, "stop_regex")):
        with pytest.raises(ValueError, match=message):
            qa.run(FRANCE, backend=engine, **bad)
    sgl.set_default_backend(engine)
    sgl.set_default_backend(None)  # as SGLang: no default any more
    assert sgl.get_default_backend() is None


def test_top_logprob_lists_carry_token_texts_as_the_server_gives_them(engine):
    @sgl.function
    def scored(s):
        s += sgl.user(FRANCE)
        s += sgl.assistant(
            sgl.gen("answer", max_tokens=3, return_logprob=True, top_logprobs_num=2,
                    return_text_in_logprobs=True)
        )  # fmt: skip

    meta = scored.run(backend=engine, temperature=0).get_meta_info("answer")
    tops = meta["output_top_logprobs"]
    assert tops and all(len(top) == 2 for top in tops)
    for top in tops:
        for _, token_id, text in top:
            assert text == engine.tokenizer.decode([token_id])


def test_an_sglang_template_name_means_the_models_own_template(engine, caplog):
    @sgl.function
    def hi(s):
        s += sgl.user("Hi!")

    own = hi.run(backend=engine).text()
    named = EngineBackend(engine, chat_template="llama-3-instruct")
    assert hi.run(backend=named).text() == own
    assert "no chat template named 'llama-3-instruct'" in caplog.text


# ---- HTTP backends against our own server ------------------------------------------------------


@pytest.fixture(scope="module")
def server_url(engine):
    with serve_in_thread(engine, API_KEY) as url:
        yield url


@sgl.function
def mixed(s):
    s += sgl.system("You answer briefly.")
    s += sgl.user(FRANCE)
    s += sgl.assistant(
        "The capital is "
        + sgl.select("city", choices=["Paris", "a big city", "London"])
        + ". "
        + sgl.gen("more", max_tokens=8, stop=".")
    )
    s += sgl.user("Give a two-digit number.")
    s += sgl.assistant(sgl.gen("number", regex=r"[1-9][0-9]"))


def test_runtime_endpoint_gives_the_engine_backends_results(engine, server_url):
    endpoint = sgl.RuntimeEndpoint(server_url, api_key=API_KEY)
    assert endpoint.chat_template == resolve_backend(engine).chat_template
    local = mixed.run(backend=engine, temperature=0)
    remote = mixed.run(backend=endpoint, temperature=0)
    assert remote.error() is None
    assert remote.text() == local.text()
    assert remote["city"] == local["city"]
    assert remote.get_meta_info("city")["normalized_prompt_logprobs"] == pytest.approx(
        local.get_meta_info("city")["normalized_prompt_logprobs"], abs=1e-3
    )
    state = qa.run(FRANCE, backend=endpoint, temperature=0, stream=True)
    chunks = list(state.text_iter("answer"))
    assert (
        len(chunks) > 1
        and "".join(chunks) == qa.run(FRANCE, backend=engine, temperature=0)["answer"]
    )
    # a request the server refuses: its message, on the state
    state = qa.run(FRANCE, -1, backend=endpoint)
    assert isinstance(state.error(), BackendError) and "max_new_tokens" in str(state.error())
    with pytest.raises(BackendError, match="401"):
        sgl.RuntimeEndpoint(server_url, api_key="wrong")


@sgl.function
def count(s):
    s += "Count: " + sgl.gen("n", max_tokens=16, ignore_eos=True, temperature=0)


def test_a_generation_the_engine_fails_mid_stream_fails_the_remote_gen(tiny_model_folder):
    """The server ends the stream with an error event, as SGLang's does; the streamed gen over
    RuntimeEndpoint fails with the engine's message, and its variable is not set."""
    import httpx

    with sgl.Engine(tiny_model_folder) as engine:
        fail_model_call(engine, 4)
        with serve_in_thread(engine) as url:
            body = {
                "text": "Count: ",
                "sampling_params": {"max_new_tokens": 16, "ignore_eos": True},
                "stream": True,
            }
            with httpx.stream("POST", url + "/generate", json=body, timeout=60) as r:
                events = sse_payloads(r.iter_lines())
            assert events[-1] == "[DONE]"
            assert "text" not in events[-2]
            error = events[-2]["error"]
            assert error["code"] == 500 and "injected failure" in error["message"]

            fail_model_call(engine, 4)  # the same failure again, for the program
            state = count.run(backend=sgl.RuntimeEndpoint(url), stream=True)
            state.sync()
            assert isinstance(state.error(), BackendError)
            assert "injected failure" in str(state.error())
            with pytest.raises(ProgramError, match="injected failure"):
                state["n"]


def test_openai_backend_chats_and_refuses_what_the_api_cannot_express(engine, server_url):
    backend = sgl.OpenAI(base_url=server_url + "/v1", api_key=API_KEY)

    @sgl.function
    def chat(s):
        s += sgl.user(FRANCE)
        s += sgl.assistant(sgl.gen("first", max_tokens=10))
        s += sgl.user("And the capital of Germany?")
        s += sgl.assistant(sgl.gen("second", max_tokens=10))

    remote = chat.run(backend=backend, temperature=0)
    assert remote.error() is None
    local = chat.run(backend=engine, temperature=0)
    # the server applies the same chat template to the same messages
    assert remote.messages()[-4:] == local.messages()[-4:]
    assert "Paris" in remote["first"]

    for program, match in (
        (mixed, "select is not available"),
        (sgl.function(lambda s: s.__iadd__(sgl.assistant(sgl.gen("n", dtype=int)))), "regex"),
        (sgl.function(lambda s: s.__iadd__(sgl.user(sgl.gen("n")))), "assistant turn"),
    ):
        state = program.run(backend=backend)
        assert isinstance(state.error(), ValueError) and match in str(state.error())

    @sgl.function
    def as_json(s):
        s += sgl.user("Describe a city as JSON.")
        s += sgl.assistant(
            sgl.gen(
                "city",
                max_tokens=24,
                json_schema={
                    "type": "object",
                    "properties": {"name": {"type": "string", "maxLength": 12}},
                    "required": ["name"],
                },
            )
        )

    assert "name" in json.loads(as_json.run(backend=backend, temperature=0)["city"])
