"""An agent that calls tools in a loop: it picks a tool with `select` and fills the tool's
arguments under the tool's JSON schema, so every call is well-formed.

    python examples/agent_tools.py ["your question"]
    python examples/agent_tools.py --url http://127.0.0.1:30000

Each step is Action (select among the tools) -> Arguments (JSON) -> Observation (the tool's
result, fed back as a user message), until the agent picks `finish` (allowed from the second step
on) or runs out of steps, which it says.

What makes this work on a small model (the default, SmolLM2-135M-Instruct):
- worked examples of whole runs before the question, as chat turns: a small model copies the
  shape of a conversation far better than it follows a description of one;
- no free-text "Thought" before the action: a 135M model's reasoning is more often wrong than
  right (it wrote "17 * 23 = 321"), and the wrong text then steers the choice;
- a call repeated with the same arguments is not run again: the agent is told it already has
  that result, and the loop stops after `max_steps` saying so.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import radixlm as sgl

_OPS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.Pow: operator.pow, ast.USub: operator.neg,
}  # fmt: skip


def calculate(expression: str) -> str:
    """Arithmetic only (+ - * / **), evaluated from the syntax tree: no eval."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("not arithmetic")

    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as e:
        return f"error: {e}"


CAPITALS = {"france": "Paris", "germany": "Berlin", "japan": "Tokyo", "italy": "Rome"}


@dataclass(frozen=True)
class Tool:
    description: str
    schema: dict[str, Any]
    call: Callable[[dict[str, Any]], str]


def _args(**props: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
    }


TOOLS = {
    "calculator": Tool(
        "evaluates an arithmetic expression",
        _args(expression={"type": "string", "maxLength": 40}),
        lambda a: calculate(a["expression"]),
    ),
    "capital": Tool(
        "gives the capital city of a country",
        _args(country={"type": "string", "maxLength": 30}),
        lambda a: CAPITALS.get(a["country"].strip().lower(), "unknown country"),
    ),
    "finish": Tool(
        "gives the final answer",
        _args(answer={"type": "string", "maxLength": 60}),
        lambda a: a["answer"],
    ),
}

SYSTEM = (
    "You answer questions using tools, one step at a time. Tools:\n"
    + "\n".join(
        f"- {name}: {tool.description}, arguments {json.dumps(tool.schema['properties'])}"
        for name, tool in TOOLS.items()
    )
    + "\nAs soon as an observation answers the question, use finish."
)

# Whole runs shown before the question (one per tool): (question, [(tool, arguments)...]); each
# tool's observation is computed by the tool itself.
WORKED_EXAMPLES = [
    ("What is 12 + 30?", [("calculator", {"expression": "12 + 30"}), ("finish", {"answer": "42"})]),
    (
        "What is the capital of Germany?",
        [("capital", {"country": "Germany"}), ("finish", {"answer": "Berlin"})],
    ),
]


def _step_text(action: str, arguments: dict[str, Any]) -> str:
    return f"Action: {action}\nArguments: {json.dumps(arguments)}"


def _observation(result: str) -> str:
    return f"Observation: {result}"


@sgl.function
def agent(s, question, max_steps=4):
    s += sgl.system(SYSTEM)
    for example, steps in WORKED_EXAMPLES:
        s += sgl.user(example)
        for action, arguments in steps:
            s += sgl.assistant(_step_text(action, arguments))
            if action != "finish":
                s += sgl.user(_observation(TOOLS[action].call(arguments)))
    s += sgl.user(question)
    calls: dict[tuple[str, str], str] = {}  # (tool, arguments) -> result: the calls made
    s["steps"] = 0
    for step in range(max_steps):
        s["steps"] = step + 1
        s += sgl.assistant_begin()
        # the first step must use a tool: an answer comes after at least one observation
        allowed = [name for name in TOOLS if step > 0 or name != "finish"]
        s += "Action: " + sgl.select(f"action_{step}", choices=allowed)
        action = s[f"action_{step}"]  # waits for the select: the arguments depend on it
        tool = TOOLS[action]
        s += "\nArguments: " + sgl.gen(f"args_{step}", max_tokens=40, json_schema=tool.schema)
        s += sgl.assistant_end()
        arguments = json.loads(s[f"args_{step}"])
        if action == "finish":
            s["answer"] = tool.call(arguments)
            return
        key = (action, json.dumps(arguments, sort_keys=True))
        if key in calls:  # the same call again would give the same result: say so instead
            result = f"{calls[key]} (you already made this call: use finish)"
        else:
            result = calls[key] = tool.call(arguments)
        s[f"observation_{step}"] = result
        s += sgl.user(_observation(result))
    s["answer"] = None  # out of steps


def main(backend=None, question: str = "What is 17 * 23?", max_steps: int = 4):
    state = agent.run(question=question, max_steps=max_steps, backend=backend, temperature=0)
    if state.error() is not None:
        print(f"the agent failed: {state.error()}")
        return state
    for step in range(state["steps"]):
        seen = state[f"observation_{step}"] if state[f"action_{step}"] != "finish" else None
        print(f"step {step + 1}: {state[f'action_{step}']} {state[f'args_{step}']}")
        if seen is not None:
            print(f"  observation: {seen}")
    if state["answer"] is None:
        steps = "1 step" if max_steps == 1 else f"{max_steps} steps"
        print(f"no answer after {steps} (the step budget); raise max_steps to go on")
    else:
        print(f"answer: {state['answer']} ({state['steps']} steps)")
    return state


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="?", default="What is 17 * 23?")
    parser.add_argument("--url", help="a radixlm server (default: an in-process engine)")
    parser.add_argument("--max-steps", type=int, default=4, help="tool calls at most")
    args = parser.parse_args()
    if args.url:
        main(sgl.RuntimeEndpoint(args.url), args.question, args.max_steps)
    else:
        with sgl.Engine() as engine:  # shut down when done
            main(engine, args.question, args.max_steps)
