"""The program language's parts that need no model: choices methods, chat-template markers,
expressions and parameters, the interpreter over a scripted backend, and clear errors."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import threading
import time

import pytest

import radixlm as sgl
from radixlm.lang import default_backend as default_backend_module
from radixlm.lang.backend import Backend, BackendError, choice_tokens, pad_logprobs
from radixlm.lang.chat_template import (
    ChatTemplate,
    derive_chat_template,
    get_chat_template,
    jinja_renderer,
)
from radixlm.lang.choices import (
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from radixlm.lang.default_backend import resolve_backend
from radixlm.lang.http_client import HttpClient
from radixlm.lang.interpreter import ProgramError
from radixlm.lang.ir import REGEX_INT, GenParams, default_params

# ---- choices methods: SGLang's meanings on hand-made log-probabilities ------------------------

CHOICES = ["organ", "organism", "antidisestablishmentarianism"]
LOGPROBS = [
    [(-0.1, 1, None)],
    [(-0.1, 1, None), (-0.3, 2, None)],
    [(-0.4, 3, None), (-0.25, 4, None), (-0.1, 5, None), (-0.05, 6, None)],
]
UNCONDITIONAL = [
    [(None, 1, None)],
    [(None, 1, None), (-0.4, 2, None)],
    [(None, 3, None), (-2.0, 4, None), (-2.0, 5, None), (-2.0, 6, None)],
]


def test_token_length_normalized_takes_the_best_mean():
    d = token_length_normalized(choices=CHOICES, input_token_logprobs=LOGPROBS)
    assert d.decision == "organ"  # -0.1 beats -0.2 and -0.2
    assert d.meta_info["normalized_prompt_logprobs"] == pytest.approx([-0.1, -0.2, -0.2])


def test_greedy_token_selection_compares_token_by_token_padding_with_the_mean():
    # organ and organism tie on the first token; organ is padded with its mean (-0.1) > -0.3
    d = greedy_token_selection(choices=CHOICES, input_token_logprobs=LOGPROBS)
    assert d.decision == "organ"
    assert d.meta_info["greedy_logprob_matrix"][0] == pytest.approx([-0.1, -0.1, -0.1, -0.1])
    flipped = [LOGPROBS[0], [(-0.1, 1, None), (-0.01, 2, None)], LOGPROBS[2]]
    assert greedy_token_selection(choices=CHOICES, input_token_logprobs=flipped).decision == (
        "organism"
    )


def test_unconditional_likelihood_normalized_subtracts_the_unconditional_logprobs():
    d = unconditional_likelihood_normalized(
        choices=CHOICES, input_token_logprobs=LOGPROBS, unconditional_token_logprobs=UNCONDITIONAL
    )
    # the long word: (-0.4 - 0 + 1.75 + 1.9 + 1.95) / 4 = 1.3, far above the others
    assert d.decision == "antidisestablishmentarianism"
    scores = d.meta_info["normalized_unconditional_prompt_logprobs"]
    assert scores == pytest.approx([-0.1, (-0.1 + 0.1) / 2, 1.3])
    with pytest.raises(ValueError, match="unconditional"):
        unconditional_likelihood_normalized(choices=CHOICES, input_token_logprobs=LOGPROBS)


def test_select_with_a_temperature_samples_by_the_scores():
    import random

    rng = random.Random(0)
    picks = [
        token_length_normalized(
            choices=["a", "b"],
            input_token_logprobs=[[(-0.1, 1, None)], [(-0.2, 2, None)]],
            temperature=1.0,
            rng=rng,
        ).decision
        for _ in range(200)
    ]
    assert 70 < picks.count("b") < 130  # e^-0.1 vs e^-0.2: close to even, not always "a"


def test_choice_tokens_start_where_prefix_and_prefix_plus_choice_tokens_differ():
    assert choice_tokens([5, 6, 7], [5, 6, 7, 8, 9]) == 3
    assert choice_tokens([5, 6, 7], [5, 6, 70, 8]) == 2  # the last prefix token merged
    assert pad_logprobs([[-0.5, 8, "x"]], [7, 8]) == [(None, 7, None), (-0.5, 8, "x")]


# ---- chat templates: markers computed from the Jinja text ---------------------------------

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' "
    "else message['role'] %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + "
    "'<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}"
    "{% endif %}"
)


def test_chatml_markers_and_default_system_prompt():
    t = derive_chat_template(jinja_renderer(CHATML))
    assert t.role_prefix_and_suffix == {
        "system": ("<|im_start|>system\n", "<|im_end|>\n"),
        "user": ("<|im_start|>user\n", "<|im_end|>\n"),
        "assistant": ("<|im_start|>assistant\n", "<|im_end|>\n"),
    }
    assert t.default_system_prompt == "You are helpful."
    assert t.stop_str == ("<|im_end|>",)
    assert t.begin == ""
    assert t.role_prefix_and_suffix == get_chat_template("chatml").role_prefix_and_suffix


def test_llama3_markers_keep_the_bos_token_for_the_first_message_only():
    render = jinja_renderer(LLAMA3, {"bos_token": "<|begin_of_text|>"})
    t = derive_chat_template(render, bos_token="<|begin_of_text|>")
    assert t.begin == "<|begin_of_text|>"
    assert t.role_prefix_and_suffix["user"] == (
        "<|start_header_id|>user<|end_header_id|>\n\n",
        "<|eot_id|>",
    )
    assert t.stop_str == ("<|eot_id|>",)
    assert t.default_system_prompt is None
    assert t.get_prefix_and_suffix("system", [])[0].startswith("<|begin_of_text|><|start_header")
    assert not t.get_prefix_and_suffix("user", [{"role": "system"}])[0].startswith("<|begin")


def test_template_without_a_system_role():
    t = derive_chat_template(jinja_renderer(GEMMA, {"bos_token": "<bos>"}), bos_token="<bos>")
    assert "system" not in t.role_prefix_and_suffix
    assert t.begin == "<bos>"
    assert t.role_prefix_and_suffix["assistant"] == ("<start_of_turn>model\n", "<end_of_turn>\n")
    with pytest.raises(ValueError, match="role 'system' is not in the chat template"):
        t.get_prefix_and_suffix("system", [])


def test_template_that_rewrites_earlier_text_is_refused():
    rewriting = "{% for m in messages|reverse %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="give a chat template explicitly"):
        derive_chat_template(jinja_renderer(rewriting))


# ---- expressions and parameters ----------------------------------------------------------


def test_gen_params_merge_over_run_defaults_and_dtype_becomes_a_regex():
    defaults = default_params(max_new_tokens=64, temperature=0.0, stop=["\n\n"])
    gen = sgl.gen("x", max_tokens=5, dtype=int)
    params = defaults.merged(gen.params).resolved(("<|im_end|>",))
    sp = params.sampling_params()
    assert sp["max_new_tokens"] == 5 and sp["temperature"] == 0.0
    assert sp["regex"] == REGEX_INT
    assert sp["stop"] == ["\n\n", " ", "\n", "<|im_end|>"]
    assert "dtype" not in sp
    assert GenParams(return_logprob=True, top_logprobs_num=2).logprob_options() == {
        "return_logprob": True,
        "top_logprobs_num": 2,
    }


def test_gen_with_choices_is_a_select_and_json_schema_forms_are_normalized():
    from pydantic import BaseModel

    class Point(BaseModel):
        x: int

    sel = sgl.gen("c", choices=["a", "b"])
    assert type(sel).__name__ == "Select" and sel.temperature == 0.0
    texts = {
        sgl.gen("p", json_schema=Point).params.json_schema,
        sgl.gen("p", json_schema=Point.model_json_schema()).params.json_schema,
    }
    assert len(texts) == 1
    expr = "Q: " + sgl.gen("a") + "\n"
    assert [type(e).__name__ for e in expr.exprs] == ["ConstantText", "Gen", "ConstantText"]


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: sgl.select("x", choices=[]), ValueError, "non-empty list"),
        (lambda: sgl.select("x", choices=["a", ""]), ValueError, "non-empty string"),
        (lambda: sgl.gen("x", dtype=list), ValueError, "use one of int, float, bool, str"),
        (lambda: sgl.gen("x", regex="("), ValueError, "does not compile"),
        (lambda: sgl.gen("x", json_schema=3), TypeError, "pydantic model class"),
        (lambda: sgl.gen("x", json_schema="{bad"), ValueError, "not valid JSON"),
        (lambda: sgl.gen("x", regex="a", dtype=int), ValueError, "one of dtype, regex"),
        (lambda: sgl.gen("x", stop_regex="a+"), ValueError, "stop_regex"),
        (lambda: sgl.function(lambda: None), TypeError, "first argument is the state"),
    ],
)
def test_bad_arguments_fail_at_the_call_with_a_clear_error(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_unknown_or_missing_backend_is_a_clear_error(monkeypatch):
    with pytest.raises(TypeError, match="unknown backend"):
        resolve_backend(object())
    monkeypatch.setattr(default_backend_module, "_default", [])

    @sgl.function
    def prog(s):
        s += "hi"

    with pytest.raises(RuntimeError, match="set_default_backend"):
        prog.run()
    with pytest.raises(Exception, match="cannot reach"):
        sgl.RuntimeEndpoint("http://127.0.0.1:9")  # nothing listens on the discard port


# ---- the interpreter over a scripted backend ---------------------------------------------


class ScriptedBackend(Backend):
    """Answers gen with the text of its `answers` (or echoes the call count); records calls."""

    def __init__(self, answers=None):
        super().__init__()
        self.gates = [threading.Event(), threading.Event()]
        self.chat_template = get_chat_template("chatml")
        self.answers = answers or {}
        self.calls: list[str] = []
        self.lock = threading.Lock()

    def generate(self, prompt, params):
        with self.lock:
            self.calls.append(prompt.text)
            n = len(self.calls)
        return self.answers.get(prompt.text.rsplit("\n", 1)[-1], f"gen{n}"), {"params": params}

    def generate_stream(self, prompt, params):
        # each piece waits until the test has read the previous one: chunks cannot coalesce
        for i, piece in enumerate(("one ", "two ", "three")):
            if i:
                assert self.gates[i - 1].wait(10)
            yield piece, {}

    def score_choices(self, prefix, choices, unconditional):
        scores = [[(-float(len(c)), 1, c)] for c in choices]  # the shortest choice wins
        return scores, (scores if unconditional else None), {}


def test_roles_fork_join_and_variables_over_a_scripted_backend():
    backend = ScriptedBackend()

    @sgl.function
    def prog(s, topic):
        s += sgl.system("sys")
        with s.user():
            s += "Tell me about " + topic
        s += sgl.assistant(sgl.gen("first"))
        forks = s.fork(3)
        forks += lambda i: f"branch {i}: " + sgl.gen("idea")
        forks.join()
        s += sgl.user_begin() + "pick" + sgl.user_end()
        s += sgl.assistant(sgl.select("pick", choices=["long choice", "short"]))
        with s.var_scope("tail"):
            s += "end"

    state = prog.run("cats", backend=backend)
    assert state["first"] == "gen1"
    assert sorted(state["idea"]) == ["gen2", "gen3", "gen4"]  # gathered from the forks
    assert state["pick"] == "short"
    assert state["tail"] == "end"
    assert state.messages() == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "Tell me about cats"},
        {"role": "assistant", "content": "gen1"},
        {"role": "user", "content": "pick"},
        {"role": "assistant", "content": "short"},
    ]
    assert state.text().startswith("<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\n")
    assert state.error() is None


def test_a_failed_step_is_kept_on_the_state_and_later_reads_name_it():
    @sgl.function
    def nested(s):
        s += sgl.user_begin()
        s += sgl.assistant("oops")  # roles do not nest
        s += sgl.gen("never")

    state = nested.run(backend=ScriptedBackend())
    assert isinstance(state.error(), ValueError)
    assert "do not nest" in str(state.error())
    with pytest.raises(ProgramError, match="roles do not nest"):
        state["never"]


def test_program_arguments_are_checked_and_bind_fixes_some():
    @sgl.function
    def prog(s, a, b="B"):
        s += a + b + sgl.gen("x")

    backend = ScriptedBackend()
    with pytest.raises(TypeError, match=r"prog\(s, a, b='B'\)"):
        prog.run(backend=backend, c=1)
    assert prog.bind(b="Z").run("A", backend=backend).text().startswith("AZ")
    with pytest.raises(TypeError, match="no argument"):
        prog.bind(zzz=1)
    with pytest.raises(ValueError, match="positive integer"):
        prog.run("A", backend=backend).fork(0)


def test_run_batch_with_positional_arguments_and_generator_style():
    @sgl.function
    def prog(s, a, b="B"):
        s += a + b

    backend = ScriptedBackend()
    states = prog.run_batch([("x",), ("y", "Z"), {"a": "w"}], backend=backend, num_threads=2)
    assert [s.text() for s in states] == ["xB", "yZ", "wB"]
    gen = prog.run_batch([("x",), ("y",)], backend=backend, generator_style=True)
    assert [s.text() for s in gen] == ["xB", "yB"]
    with pytest.raises(TypeError, match="takes 2 arguments"):
        prog.run_batch([("x", "y", "z")], backend=backend)
    failed = prog.run_batch([{"nope": 1}, {"a": "ok"}], backend=backend)
    assert isinstance(failed[0].error(), TypeError) and failed[1].text() == "okB"


def test_stream_without_a_model():
    @sgl.function
    def prog(s):
        s += "Count: " + sgl.gen("n")

    backend = ScriptedBackend()
    state = prog.run(backend=backend, stream=True)
    chunks = state.text_iter("n")
    assert next(chunks) == "one "
    backend.gates[0].set()
    assert next(chunks) == "two "
    backend.gates[1].set()
    assert list(chunks) == ["three"]
    assert state.text() == "Count: one two three"


class FailingBackend(ScriptedBackend):
    """A generation after "fail " raises; a stream gives one piece, then raises."""

    def generate(self, prompt, params):
        if prompt.text.endswith("fail "):
            raise BackendError("the server failed")
        return "ok", {}

    def generate_stream(self, prompt, params):
        yield "partial ", {}
        raise BackendError("the server failed mid-stream")


def test_a_fork_taken_by_index_adds_in_place():
    @sgl.function
    def prog(s):
        forks = s.fork(2)
        for i in range(2):
            forks[i] += f"fork {i}: " + sgl.gen("v")
        with pytest.raises(TypeError, match="its own state"):
            forks[0] = forks[1]
        with pytest.raises(TypeError, match="its own state"):
            forks[1] = "text"
        forks.join()

    backend = ScriptedBackend(answers={"fork 0: ": "zero", "fork 1: ": "one"})
    state = prog.run(backend=backend)
    assert state.error() is None
    assert state["v"] == ["zero", "one"]


def test_a_program_forking_in_a_loop_lets_its_joined_forks_go():
    """Each joined fork holds a copy of the text; a loop of fork-and-join kept them all."""
    held = []

    @sgl.function
    def prog(s):
        for round_ in range(5):
            forks = s.fork(3)
            forks += lambda i, r=round_: f"round {r} fork {i}: " + sgl.gen(f"v{r}")
            forks.join()
            held.append(len(s.stream_executor._children))

    state = prog.run(backend=ScriptedBackend())
    assert state.error() is None
    assert held == [3] * 5  # only the forks of the newest round
    assert [len(state[f"v{r}"]) for r in range(5)] == [3] * 5


def test_a_variable_generated_twice_is_read_after_its_last_write():
    """Both gens are queued before the read: the read waits for the second (it got the first,
    as SGLang's interpreter does too)."""

    class Slow(ScriptedBackend):
        def generate(self, prompt, params):
            time.sleep(0.2)
            return super().generate(prompt, params)

    @sgl.function
    def prog(s):
        s += "a " + sgl.gen("x")
        s += " b " + sgl.gen("x")
        s["read"] = s["x"]
        s += " c " + sgl.gen("x")

    state = prog.run(backend=Slow())
    assert state["read"] == "gen2"
    assert state["x"] == "gen3"
    assert state.text() == "a gen1 b gen2 c gen3"


def test_a_generator_style_batch_closed_early_runs_no_more_programs():
    class Slow(ScriptedBackend):
        def generate(self, prompt, params):
            time.sleep(0.05)
            return super().generate(prompt, params)

    @sgl.function
    def prog(s, i):
        s += f"{i}: " + sgl.gen("x")

    backend = Slow()
    states = prog.run_batch(
        [{"i": i} for i in range(40)], backend=backend, num_threads=2, generator_style=True
    )
    first = next(states)
    assert first["x"].startswith("gen")
    states.close()  # the caller stops reading: those not started are dropped
    assert len(backend.calls) <= 4


def test_a_failed_stream_leaves_no_partial_variable():
    @sgl.function
    def prog(s):
        s += "Count: " + sgl.gen("n")

    state = prog.run(backend=FailingBackend(), stream=True)
    assert "".join(state.text_iter("n")) in ("", "partial ")
    assert isinstance(state.error(), BackendError)
    with pytest.raises(ProgramError, match="failed mid-stream"):
        state["n"]
    assert state.get_meta_info("n") is None


def test_a_failed_fork_fails_the_gathered_variables_instead_of_shifting_them():
    @sgl.function
    def prog(s):
        forks = s.fork(3)
        forks += lambda i: f"fork {i} " + ("fail " if i == 1 else "") + sgl.gen("v")
        forks.join()

    state = prog.run(backend=FailingBackend())
    assert isinstance(state.error(), BackendError)
    with pytest.raises(ProgramError, match="the server failed"):
        state["v"]


def test_a_failed_fork_fails_concatenate_and_append():
    @sgl.function
    def prog(s):
        s += "Q: "
        forks = s.fork(2)
        forks += lambda i: f"fork {i} " + ("fail " if i == 1 else "") + sgl.gen("v")
        forks.join("concate_and_append")
        s += "A: " + sgl.gen("after")

    state = prog.run(backend=FailingBackend())
    assert isinstance(state.error(), BackendError)
    assert state.text() == "Q: "  # nothing of the forks appended, nothing generated after
    with pytest.raises(ProgramError, match="the server failed"):
        state["after"]


def stub_sse(monkeypatch, body: bytes) -> sgl.RuntimeEndpoint:
    """A RuntimeEndpoint whose every stream answers `body`, with no server."""
    monkeypatch.setattr(HttpClient, "get", lambda self, path: {"model_path": "stub"})
    monkeypatch.setattr(HttpClient, "_open", lambda self, method, path, payload: io.BytesIO(body))
    return sgl.RuntimeEndpoint("http://127.0.0.1:9", chat_template="chatml")


@pytest.mark.parametrize(
    "body, match",
    [
        (
            b'data: {"text": "par", "meta_info": {}}\n\n'
            b'data: {"text": "partial", "meta_info": {"error": "out of memory"}}\n\n'
            b"data: [DONE]\n\n",
            "out of memory",
        ),
        (b'data: {"text": "par", "meta_info": {}}\n\n', r"without \[DONE\]"),
    ],
    ids=["error-in-meta-info", "no-done"],
)
def test_a_remote_stream_that_failed_is_an_error(monkeypatch, body, match):
    @sgl.function
    def prog(s):
        s += "Count: " + sgl.gen("n")

    state = prog.run(backend=stub_sse(monkeypatch, body), stream=True)
    state.sync()
    assert isinstance(state.error(), BackendError)
    assert re.search(match, str(state.error()))
    with pytest.raises(ProgramError):
        state["n"]


def test_a_streamed_run_syncs_with_steps_its_body_has_not_submitted_yet(monkeypatch):
    """sync() on a streamed state waits for the program body (run in its own thread) too:
    it returned at once when the body had not queued its first step yet."""
    body = b'data: {"text": "7", "meta_info": {}}\n\ndata: [DONE]\n\n'

    @sgl.function
    def prog(s):
        time.sleep(0.2)
        s += "Count: " + sgl.gen("n")

    state = prog.run(backend=stub_sse(monkeypatch, body), stream=True)
    state.sync()
    assert state.stream_executor.variables.get("n") == "7"
    assert state.text() == "Count: 7"


def test_import_radixlm_and_the_language_stay_free_of_torch():
    code = (
        "import sys, radixlm as sgl\n"
        "sgl.function, sgl.gen, sgl.select, sgl.RuntimeEndpoint, sgl.OpenAI\n"
        "import radixlm.lang.engine_backend\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_chat_template_type_is_exported():
    assert sgl.ChatTemplate is ChatTemplate


def test_forks_never_joined_end_with_their_program():
    """A program that forks and then fails without joining: its forks' worker threads end with
    it, even while the failed states (and so the forks, through the exception) are kept."""
    import threading
    import time

    @sgl.function
    def prog(s):
        s += "ctx "
        forks = s.fork(3)  # held by the frame, which the kept exception holds
        forks[0] += "more"
        raise ValueError("the program's own bug")

    def program_threads() -> int:
        return sum(t.name.startswith("radixlm-program") for t in threading.enumerate())

    before = program_threads()
    states = prog.run_batch([{}] * 20, backend=ScriptedBackend(), num_threads=4)
    assert all(isinstance(s.stream_executor.error_, ValueError) for s in states)
    deadline = time.monotonic() + 10
    while program_threads() > before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert program_threads() <= before


def test_separate_reasoning_splits_thinking_from_the_answer():
    backend = ScriptedBackend({"": "<think>\nIt is 4.\n</think>\n\nFour.", "again: ": "Just this."})

    @sgl.function
    def prog(s):
        s += sgl.user("What is 2 + 2?")
        s += sgl.assistant(sgl.separate_reasoning(sgl.gen("answer"), model_type="qwen3"))
        s += "again: " + sgl.separate_reasoning(sgl.gen("plain"), model_type="qwen3")

    state = prog.run(backend=backend)
    assert state["answer"] == "Four."
    assert state["answer_reasoning_content"] == "It is 4."
    assert "<think>" not in state.text() and "Four.<|im_end|>" in state.text()
    assert state.messages()[-1] == {"role": "assistant", "content": "Four."}
    # no thinking: the answer as it was, and empty thinking
    assert state["plain"] == "Just this." and state["plain_reasoning_content"] == ""


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: sgl.separate_reasoning(sgl.gen("x")), "needs model_type, one of deepseek-r1"),
        (lambda: sgl.separate_reasoning(sgl.gen("x"), model_type="o1"), "use one of"),
        (lambda: sgl.separate_reasoning(sgl.gen(), model_type="qwen3"), "named gen or select"),
    ],
)
def test_separate_reasoning_arguments_are_checked(make, match):
    with pytest.raises(ValueError, match=match):
        make()
