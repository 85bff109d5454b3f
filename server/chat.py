"""OpenAI chat messages -> the model's prompt, through its chat template."""

from __future__ import annotations

from typing import Any

from radixlm.server.backend import GenerationBackend
from radixlm.server.errors import bad_request
from radixlm.server.openai_protocol import ChatMessage
from radixlm.server.tool_parsers import ToolCallParser
from radixlm.server.tools import (
    ToolPlan,
    arguments_dict,
    call_as_text,
    result_as_text,
    tools_system_prompt,
)

_ROLES = {"system", "user", "assistant", "tool"}


# apply_chat_template's own parameters: not template variables, so not for chat_template_kwargs
_TEMPLATE_CALL_PARAMS = frozenset(
    [
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    ]
)


def render_chat_prompt(
    backend: GenerationBackend,
    messages: list[ChatMessage],
    plan: ToolPlan,
    template_kwargs: dict[str, Any] | None = None,
    parser: ToolCallParser | None = None,
) -> str:
    """The prompt of a chat. Tools go to a template that takes them; otherwise they are described
    in the system prompt, with earlier calls written as `parser`'s format writes them (None: the
    default format's `<tool_call>` blocks)."""
    if not messages:
        raise bad_request("messages must hold at least one message", "messages")
    for key in template_kwargs or {}:
        if key in _TEMPLATE_CALL_PARAMS:
            raise bad_request(
                f"chat_template_kwargs.{key} is set by the server, not a template variable; "
                "leave it out",
                "chat_template_kwargs",
            )
    native_tools = backend.model_info().chat_template_has_tools
    dicts = chat_messages(messages, native_tools, parser)
    tools = None
    if plan.active:
        instructions = plan.instructions()
        if parser is not None:
            instructions = parser.instructions(plan.mode, plan.name, plan.parallel)
        if native_tools:
            tools = plan.offered
            if plan.constrained:
                _add_to_system(dicts, instructions)
        else:
            _add_to_system(dicts, tools_system_prompt(plan, instructions))
    try:
        if template_kwargs:
            return backend.render_chat(dicts, tools, template_kwargs)
        return backend.render_chat(dicts, tools)
    except Exception as e:  # a template that raises on these messages (e.g. role order)
        raise bad_request(f"the model's chat template cannot render these messages: {e}") from e


def chat_messages(
    messages: list[ChatMessage], native_tools: bool, parser: ToolCallParser | None = None
) -> list[dict[str, Any]]:
    """Plain dicts for the template; tool calls and results as text where it lacks tools."""
    out: list[dict[str, Any]] = []
    call_names: dict[str, str] = {}  # tool_call_id -> function name, for the results
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        if role not in _ROLES:
            raise bad_request(
                f"messages[{i}].role={m.role!r}; use system, developer, user, assistant or tool",
                f"messages[{i}].role",
            )
        content = _text(m.content, i)
        if role == "assistant" and m.tool_calls:
            for call in m.tool_calls:
                if call.id:
                    call_names[call.id] = call.function.name
            if native_tools:
                out.append(
                    {
                        "role": "assistant",
                        "content": content,
                        **_reasoning(m),
                        "tool_calls": [
                            {
                                "id": c.id,
                                "type": "function",
                                "function": {
                                    "name": c.function.name,
                                    "arguments": arguments_dict(c.function.arguments),
                                },
                            }
                            for c in m.tool_calls
                        ],
                    }
                )
            else:
                if parser is not None:
                    written = [
                        (c.function.name, arguments_dict(c.function.arguments))
                        for c in m.tool_calls
                    ]
                    calls = [parser.format_calls(written)]
                else:
                    calls = [
                        call_as_text(c.function.name, c.function.arguments) for c in m.tool_calls
                    ]
                text = "\n".join(filter(None, [content, *calls]))
                out.append({"role": "assistant", "content": text, **_reasoning(m)})
            continue
        if role == "tool":
            name = m.name or call_names.get(m.tool_call_id or "")
            if native_tools:
                entry = {"role": "tool", "content": content, "tool_call_id": m.tool_call_id}
                if name:
                    entry["name"] = name
                out.append(entry)
            elif out and out[-1].get("_tool_results"):  # consecutive results: one user turn
                out[-1]["content"] += "\n" + result_as_text(content)
            else:
                out.append(
                    {"role": "user", "content": result_as_text(content), "_tool_results": True}
                )
            continue
        out.append({"role": role, "content": content, **_reasoning(m)})
    for entry in out:
        entry.pop("_tool_results", None)
    return out


def _reasoning(message: ChatMessage) -> dict[str, str]:
    """An assistant's earlier thinking, for a template that writes it back (as Qwen3's does, in
    `<think>` before the answer); nothing for other messages, or without any."""
    if message.role == "assistant" and message.reasoning_content:
        return {"reasoning_content": message.reasoning_content}
    return {}


def _text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.type != "text":
            raise bad_request(
                f"messages[{index}] has a {part.type!r} part; this model takes text only",
                f"messages[{index}].content",
            )
        if part.text is None:
            raise bad_request(
                f"messages[{index}] has a text part without its 'text'",
                f"messages[{index}].content",
            )
        parts.append(part.text)
    return "\n".join(parts)


def _add_to_system(messages: list[dict[str, Any]], text: str) -> None:
    if messages and messages[0]["role"] == "system":
        first = messages[0]["content"]
        messages[0]["content"] = f"{first}\n\n{text}" if first else text
    else:
        messages.insert(0, {"role": "system", "content": text})
