"""An agent that calls tools in a ReAct loop: it picks a tool with `select` and fills the tool's
arguments under the tool's JSON schema, so every call is well-formed.

    python examples/agent_tools.py ["your question"]
    python examples/agent_tools.py --url http://127.0.0.1:30000

Each step is Thought -> Action (select among the tools) -> Arguments (JSON) -> Observation (the
tool's result, fed back as a user message), until the agent picks `finish` (allowed from the
second step on) or runs out of steps.
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

SYSTEM = "You answer questions using tools, one step at a time. Tools:\n" + "\n".join(
    f"- {name}: {tool.description}, arguments {json.dumps(tool.schema['properties'])}"
    for name, tool in TOOLS.items()
)


@sgl.function
def agent(s, question, max_steps=3):
    s += sgl.system(SYSTEM)
    s += sgl.user(question)
    for step in range(max_steps):
        s += sgl.assistant_begin()
        s += "Thought: " + sgl.gen(f"thought_{step}", max_tokens=24, stop="\n")
        # the first step must use a tool: an answer comes after at least one observation
        allowed = [name for name in TOOLS if step > 0 or name != "finish"]
        s += "\nAction: " + sgl.select(f"action_{step}", choices=allowed)
        tool = TOOLS[s[f"action_{step}"]]  # waits for the select: the arguments depend on it
        s += "\nArguments: " + sgl.gen(f"args_{step}", max_tokens=40, json_schema=tool.schema)
        s += sgl.assistant_end()
        result = tool.call(json.loads(s[f"args_{step}"]))
        if s[f"action_{step}"] == "finish":
            s["answer"] = result
            return
        s += sgl.user(f"Observation: {result}\nUse finish once you know the answer.")
    s["answer"] = None  # out of steps


def main(backend=None, question: str = "What is 17 * 23?", max_steps: int = 3):
    state = agent.run(question=question, max_steps=max_steps, backend=backend, temperature=0)
    print(state.text())
    print(f"answer: {state['answer']}")
    return state


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="?", default="What is 17 * 23?")
    parser.add_argument("--url", help="a radixlm server (default: an in-process engine)")
    args = parser.parse_args()
    main(sgl.RuntimeEndpoint(args.url) if args.url else sgl.Engine(), args.question)
