"""The examples finish with the right results on the default model (SmolLM2-135M-Instruct, CPU),
in-process and against a server: what they print is what a newcomer first sees of radixlm."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

import radixlm as sgl
from tests.live_server import serve_in_thread

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# what each text of examples/json_extraction.py says
FACTS = [
    {"name": "Ada Lovelace", "birth_year": 1815, "city": "London"},
    {"name": "Alan Turing", "birth_year": 1912, "city": "London"},
    {"name": "Marie Curie", "birth_year": 1867, "city": "Warsaw"},
    {"name": "Albert Einstein", "birth_year": 1879, "city": "Ulm"},
    {"name": "Grace Hopper", "birth_year": 1906, "city": "New York City"},
]


def load_example(name: str):
    path = EXAMPLES / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"radixlm_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def endpoint(engine):
    """A server over the shared engine, as the examples' --url reaches one."""
    with serve_in_thread(engine) as url:
        yield sgl.RuntimeEndpoint(url)


def test_every_example_is_tested_here():
    tested = {"agent_tools", "json_extraction", "tree_of_thought"}
    assert {p.stem for p in EXAMPLES.glob("*.py")} == tested


# ---- json_extraction --------------------------------------------------------------------------


def test_extraction_schemas_allow_only_values_the_text_contains():
    example = load_example("json_extraction")
    schema = example.schema_for("Albert Einstein was born in 1879 in Ulm, Germany.")
    by_name = {s["properties"]["name"]["const"]: s["properties"] for s in schema["anyOf"]}
    assert set(by_name) == {"Albert Einstein", "Ulm", "Germany"}
    assert by_name["Albert Einstein"]["city"] == {"enum": ["Ulm", "Germany"]}  # not the name
    assert by_name["Ulm"]["birth_year"] == {"enum": [1879]}
    # nothing to copy from: the fields stay as free as the plain schema
    assert example.schema_for("no names, no years") == example.PERSON


def test_example_json_extraction_gets_every_fact_right(engine, capsys):
    example = load_example("json_extraction")
    assert example.main(engine, progress_bar=False) == FACTS
    assert "-> {'name': 'Albert Einstein', 'birth_year': 1879, 'city': 'Ulm'}" in (
        capsys.readouterr().out
    )


@pytest.mark.slow
def test_example_json_extraction_against_a_server(endpoint):
    assert load_example("json_extraction").main(endpoint, progress_bar=False) == FACTS


# ---- agent_tools ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("question", "tool", "answer"),
    [
        ("What is 17 * 23?", "calculator", "391"),
        ("What is the capital of Japan?", "capital", "Tokyo"),
    ],
)
def test_example_agent_calls_the_tool_then_finishes_with_its_result(
    engine, capsys, question, tool, answer
):
    example = load_example("agent_tools")
    state = example.main(engine, question)
    assert state.error() is None
    assert state["action_0"] == tool and state["action_1"] == "finish"
    assert state["answer"] == answer and state["steps"] == 2
    assert capsys.readouterr().out.endswith(f"answer: {answer} (2 steps)\n")


def test_example_agent_says_so_when_its_step_budget_runs_out(engine, capsys):
    state = load_example("agent_tools").main(engine, "What is 17 * 23?", max_steps=1)
    assert state["answer"] is None and state["steps"] == 1  # finish is not allowed at step one
    assert "no answer after 1 step (the step budget)" in capsys.readouterr().out


def test_example_agent_tools_compute_safely():
    example = load_example("agent_tools")
    assert example.calculate("17 * 23") == "391" and example.calculate("2 ** 10") == "1024"
    assert example.calculate("__import__('os')").startswith("error")


@pytest.mark.slow
def test_example_agent_against_a_server(endpoint):
    state = load_example("agent_tools").main(endpoint, "What is 17 * 23?")
    assert state["answer"] == "391" and state["steps"] == 2
    json.loads(state["args_0"])


# ---- tree_of_thought --------------------------------------------------------------------------


def check_tree_of_thought(state) -> None:
    assert state.error() is None
    ideas = state["ideas"]
    assert 1 <= len(ideas) <= 3 and all(len(idea.split()) >= 3 for idea in ideas)
    scores = state.get_meta_info("best")["normalized_prompt_logprobs"]
    assert state["best"] == ideas[scores.index(max(scores))]  # the likeliest idea is chosen
    assert len(state["answer"].split()) >= 4  # a sentence explaining it


@pytest.mark.slow
def test_example_tree_of_thought_picks_the_likeliest_idea_and_explains_it(engine):
    check_tree_of_thought(load_example("tree_of_thought").main(engine))


@pytest.mark.slow
def test_example_tree_of_thought_against_a_server(endpoint):
    check_tree_of_thought(load_example("tree_of_thought").main(endpoint))
