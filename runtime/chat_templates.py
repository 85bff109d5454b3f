"""Chat templates given by name or file: `--chat-template` (`Engine(chat_template=...)`).

As SGLang's `--chat-template`, the value is the name of a template shipped here or a file: a
Jinja file (any name but `*.json`), or a `*.json` file holding Hugging Face's
`{"chat_template": "..."}` (SGLang's own JSON conversation format is not read: give its Jinja
equivalent). The template replaces the tokenizer's own wherever a chat is rendered: the server's
chat completions and /tokenize of messages, `Engine.apply_chat_template`, and the role markers
of programs (which the server also reports in /model_info).

The shipped names are those of the program DSL's built-in role markers (lang/chat_template.py),
and render the same markers: "chatml" and "plain". Torch-free.
"""

from __future__ import annotations

import json
from pathlib import Path

NAMED_CHAT_TEMPLATES: dict[str, str] = {
    "chatml": (
        "{%- for message in messages -%}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    ),
    "plain": (
        "{%- for message in messages -%}"
        "{%- if message['role'] == 'system' -%}{{- message['content'] + '\\n\\n' -}}"
        "{%- elif message['role'] == 'user' -%}{{- 'User: ' + message['content'] + '\\n' -}}"
        "{%- elif message['role'] == 'assistant' -%}"
        "{{- 'Assistant: ' + message['content'] + '\\n' -}}"
        "{%- else -%}{{- message['role'] + ': ' + message['content'] + '\\n' -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- 'Assistant: ' -}}{%- endif -%}"
    ),
}


def load_chat_template(value: str) -> str:
    """The Jinja text of a shipped template's name or of a template file; ValueError saying what
    is wrong otherwise (EngineConfig calls this to check the value before anything loads)."""
    if value in NAMED_CHAT_TEMPLATES:
        return NAMED_CHAT_TEMPLATES[value]
    path = Path(value)
    if not path.is_file():
        raise ValueError(
            f"chat_template={value!r} is neither a chat template radixlm ships "
            f"({', '.join(sorted(NAMED_CHAT_TEMPLATES))}) nor a file: give the path of a Jinja "
            'template (e.g. template.jinja), or of a JSON file holding {"chat_template": ...}'
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the chat template file {value}: {e}") from e
    if path.suffix == ".json":
        text = _template_of_json(text, value)
    else:  # as SGLang reads a Jinja file: outer newlines off, written "\n"s made newlines
        text = text.strip("\n").replace("\\n", "\n")
    if not text.strip():
        raise ValueError(f"the chat template file {value} is empty")
    _check_jinja(text, value)
    return text


def _template_of_json(text: str, where: str) -> str:
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ValueError(f"the chat template file {where} is not valid JSON: {e}") from e
    template = data.get("chat_template") if isinstance(data, dict) else None
    if not isinstance(template, str):
        raise ValueError(
            f'the chat template file {where} holds no "chat_template" string (the JSON form '
            "read here is Hugging Face's chat_template.json; SGLang's conversation JSON is "
            "not: give a Jinja file)"
        )
    return template


def _check_jinja(text: str, where: str) -> None:
    """A template that does not parse is refused at start, not at the first chat."""
    import jinja2
    import jinja2.sandbox

    try:
        jinja2.sandbox.ImmutableSandboxedEnvironment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(
            f"the chat template {where} is not a valid Jinja template: {e.message} "
            f"(line {e.lineno})"
        ) from e
