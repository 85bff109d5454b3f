"""SGLang's own frontend client (`RuntimeEndpoint` of the `sglang` pip package) drives our server.

The client lives in its own test-only environment, `.venv-sglang` (`make test` creates it: the
`sglang` package without its runtime, plus the modules its import needs), because its pins clash
with ours. This test starts our server on a free port of 127.0.0.1 over the real default model, runs
tests/sglang_programs.py with that environment's interpreter, and checks what the programs got:
greedy `gen` text equal to our engine's for the very prompt and sampling params SGLang sent,
`select` picking the choice our engine scores highest, regex / dtype / JSON-schema output matching
its constraint, roles, `fork`, `run_batch` and streaming. Then SGLang's own test programs
(`sglang/test/test_programs.py`, by tests/sglang_test_programs.py) run against the same server:
each must pass, or fail only at its own check of the model's answer where that answer is a fact
the small default model may not know. Skipped when the environment is absent (plain `pytest`
without `make`); RADIXLM_SGLANG_PYTHON names another interpreter that has `sglang`.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.live_server import serve_in_thread

ROOT = Path(__file__).resolve().parent.parent
SGLANG_PYTHON = Path(
    os.environ.get("RADIXLM_SGLANG_PYTHON", ROOT / ".venv-sglang" / "bin" / "python")
)
PROGRAMS = Path(__file__).resolve().parent / "sglang_programs.py"
TEST_PROGRAMS = Path(__file__).resolve().parent / "sglang_test_programs.py"
# SGLang's test programs whose check is the model's answer (a capital, hours in a day, a product,
# a country): the small default model may get it wrong, but the program must run to that check.
# decode_json samples (it sets no temperature) under SGLang's REGEX_STR, "[\w\d\s]*" in quotes,
# which admits whitespace JSON refuses raw (a newline, a tab): its json.loads of the answer is such
# a check, and fails on whichever seed draws one
ANSWER_CHECKED = {"few_shot_qa", "decode_int", "tool_use", "react", "decode_json"}
# SGLang's test programs not run here, and why: they need what no server of text models gives
NOT_RUN = {
    "image_qa": "an image in the prompt: a vision model (this server refuses image_data)",
    "completion_speculative": "API speculative execution, for OpenAI-style backends: it reads "
    "the backend's token_usage, which RuntimeEndpoint has not",
    "chat_completion_speculative": "the same for chat: it needs the backend's is_chat_model, "
    "which RuntimeEndpoint has not",
}
# their gens' max_new_tokens capped (the tests check what comes back, not its length), and the
# time they may take together
TEST_PROGRAMS_MAX_NEW_TOKENS = 16
TEST_PROGRAMS_TIMEOUT_S = 240
API_KEY = "sglang-key"
# SGLang's REGEX_INT (sent for dtype=int, with stop strings " " and "\n")
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
IP_REGEX = r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)"

pytestmark = pytest.mark.skipif(
    not SGLANG_PYTHON.exists(),
    reason=f"SGLang's client environment is absent ({SGLANG_PYTHON}); `make test` creates it",
)


@pytest.fixture(scope="module")
def base_url(engine):
    with serve_in_thread(engine, API_KEY) as url:
        yield url


@pytest.fixture(scope="module")
def out(base_url) -> dict[str, Any]:
    """What SGLang's client got from our server, running all the programs once."""
    proc = subprocess.run(
        [str(SGLANG_PYTHON), str(PROGRAMS), base_url, API_KEY],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=PROGRAMS.parent,
    )
    assert proc.returncode == 0, f"the SGLang programs failed:\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout)


def sent_params(out: dict[str, Any], prompt: str) -> dict[str, Any]:
    """The sampling params of the generating request SGLang sent for `prompt`."""
    found = [
        r["body"]["sampling_params"]
        for r in out["requests"]
        if r["url"].endswith("/generate")
        and r["body"].get("text") == prompt
        and r["body"]["sampling_params"].get("max_new_tokens")
    ]
    assert found, f"SGLang sent no generating request for {prompt!r}"
    return found[0]


def engine_texts(engine, out: dict[str, Any], prompts: list[str]) -> list[str]:
    """Our engine's own output for each prompt, with the sampling params SGLang sent for it."""
    params = [
        {k: v for k, v in sent_params(out, p).items() if v is not None and k != "stop_regex"}
        for p in prompts
    ]
    results = engine.generate(prompts, params)
    return [r["text"] for r in results]


def test_every_request_succeeded(out):
    assert out["requests"]
    for r in out["requests"]:
        assert r["status"] == 200, r
    assert out["model_path"]
    assert "internal_states" in out["server_info_keys"]


def test_sent_params_reach_the_server(out):
    sp = sent_params(out, out["plain_gen"]["prompt"])
    # what the program asked for, plus the chat template's stop string SGLang adds to every gen
    assert sp["max_new_tokens"] == 8
    assert sp["temperature"] == 0
    assert sp["stop"] == ["\n", "<|im_end|>"]
    assert sp["stop_regex"] == []  # inert while empty


def test_gen_equals_engine(engine, out):
    cases = [
        (out["plain_gen"]["prompt"], out["plain_gen"]["answer"]),
        (out["stop_gen"]["prompt"], out["stop_gen"]["answer"]),
        *((b["prompt"], b["answer"]) for b in out["batch"]),
        *zip(out["branches"]["prompts"], out["branches"]["tips"]),
    ]
    prompts = [p for p, _ in cases]
    assert [v for _, v in cases] == engine_texts(engine, out, prompts)
    assert out["plain_gen"]["answer"] == " The capital of France is Paris."
    # the stop string ends the text and is trimmed, as SGLang's server does
    assert out["stop_gen"]["answer"] and "," not in out["stop_gen"]["answer"]
    for b in out["batch"]:
        assert b["text"] == b["prompt"] + b["answer"]
        assert b["answer"] and "\n" not in b["answer"]
    assert [b["prompt"] for b in out["batch"]] == [
        "Q: What is 2 + 2?\nA:",
        "Q: Name a fruit.\nA:",
        "Q: What color is grass?\nA:",
    ]


def test_fork(out):
    b = out["branches"]
    assert b["prompts"] == [
        "Give two tips for staying healthy.\n1.",
        "Give two tips for staying healthy.\n2.",
    ]
    assert all(t and "," not in t and "\n" not in t for t in b["tips"])
    assert b["tips"][0] != b["tips"][1]
    expected = "Give two tips for staying healthy.\n"
    expected += "".join(f"{i + 1}.{t}\n" for i, t in enumerate(b["tips"]))
    assert b["text"] == expected


def test_roles(engine, out):
    c = out["chat"]
    assert c["prompt"] == engine.apply_chat_template(
        [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Name one primary color."},
        ]
    )
    tail = c["second"] + "<|im_end|>\n"
    assert c["text"].endswith(tail)
    second_prompt = c["text"][: -len(tail)]
    assert second_prompt.endswith(
        "<|im_start|>user\nAnd another one?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert [c["answer"], c["second"]] == engine_texts(engine, out, [c["prompt"], second_prompt])
    assert [m["role"] for m in c["messages"]] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    assert c["messages"][2]["content"] == c["answer"]
    assert c["messages"][4]["content"] == c["second"]


def test_constrained_gen(engine, out):
    c = out["constrained"]
    assert re.fullmatch(r"[0-9]{1,2}", c["number"])
    assert re.fullmatch(IP_REGEX, c["ip"])
    assert re.fullmatch(REGEX_INT, c["as_int"]) and c["as_int"].strip()
    assert isinstance(json.loads(c["json"])["name"], str)
    assert sent_params(out, c["prompt"])["regex"] == r"[0-9]{1,2}"
    assert sent_params(out, c["int_prompt"])["regex"] == REGEX_INT  # dtype=int, on the client
    assert json.loads(sent_params(out, c["json_prompt"])["json_schema"])["required"] == ["name"]
    prompts = [c["prompt"], c["ip_prompt"], c["int_prompt"], c["json_prompt"]]
    values = [c["number"], c["ip"], c["as_int"], c["json"]]
    assert values == engine_texts(engine, out, prompts)


def test_select_picks_what_the_engine_scores_highest(engine, out):
    p = out["pick"]
    choices = [" yes", " no", " maybe"]
    assert p["answer"] in choices
    assert p["text"] == p["prompt"] + p["answer"] + "\nQ: Is fire cold?\nA:" + p["greedy"]
    assert p["greedy"] in (" yes", " no")
    # SGLang's default method (token_length_normalized): the mean logprob of each
    # prompt + choice from two tokens before the choice, scored here by our engine directly
    start = len(engine.tokenizer.encode(p["prompt"], add_special_tokens=False)) - 2
    results = engine.generate(
        [p["prompt"] + c for c in choices],
        {"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=start,
    )
    ours = [r["meta_info"]["input_token_logprobs"] for r in results]
    scores = [sum(e[0] for e in lp) / len(lp) for lp in ours]
    assert p["answer"] == choices[scores.index(max(scores))]
    theirs = p["meta_info"]["input_token_logprobs"]
    assert [[e[1] for e in lp] for lp in theirs] == [[e[1] for e in lp] for lp in ours]
    for a, b in zip(p["meta_info"]["normalized_prompt_logprobs"], scores):
        assert math.isclose(a, b, abs_tol=1e-4)


def test_stream(out):
    s = out["stream"]
    assert len(s["pieces"]) > 1
    assert "".join(s["pieces"]) == s["answer"] == out["plain_gen"]["answer"]


def test_gen_logprobs(engine, out):
    lp = out["logprobs"]
    meta = lp["meta_info"]
    params = {k: v for k, v in sent_params(out, lp["prompt"]).items() if v is not None}
    params.pop("stop_regex")
    ours = engine.generate(lp["prompt"], params, return_logprob=True, top_logprobs_num=2)
    assert lp["answer"] == ours["text"]
    theirs = meta["output_token_logprobs"]
    assert (
        [e[1] for e in theirs]
        == ours["output_ids"]
        == [e[1] for e in ours["meta_info"]["output_token_logprobs"]]
    )
    for (a, _, text), (b, token, _) in zip(theirs, ours["meta_info"]["output_token_logprobs"]):
        assert math.isclose(a, b, abs_tol=1e-4)
        assert text == engine.tokenizer.decode([token])  # return_text_in_logprobs
    assert [[e[1] for e in top] for top in meta["output_top_logprobs"]] == [
        [e[1] for e in top] for top in ours["meta_info"]["output_top_logprobs"]
    ]
    assert meta["input_token_logprobs"] == []  # no logprob_start_len: output logprobs only


@pytest.fixture(scope="module")
def sglang_tests(base_url) -> dict[str, Any]:
    """How SGLang's own test programs fared against our server."""
    args = [str(TEST_PROGRAMS_MAX_NEW_TOKENS), str(TEST_PROGRAMS_TIMEOUT_S)]
    proc = subprocess.run(
        [str(SGLANG_PYTHON), str(TEST_PROGRAMS), base_url, API_KEY, *args],
        capture_output=True,
        text=True,
        timeout=TEST_PROGRAMS_TIMEOUT_S + 90,  # (and SGLang's import, which takes a while)
        cwd=TEST_PROGRAMS.parent,
    )
    assert proc.returncode == 0, f"the SGLang test programs failed:\n{proc.stderr[-6000:]}"
    # the result is the runner's last line: SGLang's programs print to stdout too (its JSON
    # decoding program prints the model's text when that text is not JSON)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_sglang_own_test_programs_run_against_our_server(sglang_tests):
    results = sglang_tests["results"]
    # every one of SGLang's test programs is run, or said here why not
    assert sorted([*results, *NOT_RUN]) == sorted(sglang_tests["available"])
    failed = {
        name: r
        for name, r in results.items()
        if r["status"] != "passed" and not (name in ANSWER_CHECKED and r.get("answer_check"))
    }
    # (among them stream_logprobs: streamed logprobs of the new tokens only, with the count so
    # far; parallel_encoding: fork(...).join(mode="concate_and_append"); gen_min_new_tokens:
    # min_tokens, its answer counted by /tokenize)
    assert not failed, json.dumps(failed, indent=1)
