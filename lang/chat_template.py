"""Role markers (`system/user/assistant` begin and end text) from a model's own chat template.

SGLang keeps a table of templates for known models; here the markers are computed from the
tokenizer's Jinja template by rendering small conversations with sentinel contents and reading the
text around the sentinels, so any model that ships a chat template works. Rendering needs only
`jinja2` (no torch), so an HTTP client can do it from the tokenizer files.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# render(messages, add_generation_prompt) -> text
Renderer = Callable[[list[dict[str, Any]], bool], str]

_SENTINEL = "RadixlmSentinel{}Text"


@dataclass(frozen=True)
class ChatTemplate:
    """The text around each role's content. `begin` opens a conversation (a BOS token written by
    the template); `default_system_prompt` is the system message the template adds when a
    conversation starts without one; `stop_str` ends an assistant turn."""

    name: str
    role_prefix_and_suffix: dict[str, tuple[str, str]]
    default_system_prompt: str | None = None
    stop_str: tuple[str, ...] = ()
    begin: str = ""

    def get_prefix_and_suffix(
        self, role: str, hist_messages: list[dict[str, Any]]
    ) -> tuple[str, str]:
        if role not in self.role_prefix_and_suffix:
            raise ValueError(
                f"role {role!r} is not in the chat template {self.name!r}; "
                f"known roles: {sorted(self.role_prefix_and_suffix)}"
            )
        prefix, suffix = self.role_prefix_and_suffix[role]
        if not hist_messages:
            prefix = self.begin + prefix
        return prefix, suffix


def _plain() -> ChatTemplate:
    return ChatTemplate(
        name="plain",
        role_prefix_and_suffix={
            "system": ("", "\n\n"),
            "user": ("User: ", "\n"),
            "assistant": ("Assistant: ", "\n"),
        },
    )


def _chatml() -> ChatTemplate:
    return ChatTemplate(
        name="chatml",
        role_prefix_and_suffix={
            role: (f"<|im_start|>{role}\n", "<|im_end|>\n")
            for role in ("system", "user", "assistant")
        },
        stop_str=("<|im_end|>",),
    )


NAMED_TEMPLATES: dict[str, Callable[[], ChatTemplate]] = {"plain": _plain, "chatml": _chatml}


def get_chat_template(name: str) -> ChatTemplate:
    try:
        return NAMED_TEMPLATES[name]()
    except KeyError:
        raise ValueError(
            f"unknown chat template name {name!r}; known: {sorted(NAMED_TEMPLATES)}, or give "
            "the Jinja template text itself"
        ) from None


def template_from_string(
    text: str, special_tokens: dict[str, str] | None = None, bos_token: str | None = None
) -> ChatTemplate | None:
    """A `chat_template` string as the backends take it: one of our names, or a Jinja template's
    text; None for any other name (SGLang's llama-3-instruct, qwen, default, ...: the model's own
    template, which those names stand for, is then the backend's to use, with a warning)."""
    if text in NAMED_TEMPLATES:
        return get_chat_template(text)
    if "{{" in text or "{%" in text:
        return derive_chat_template(jinja_renderer(text, special_tokens), "custom", bos_token)
    logger.warning(
        "no chat template named %r here (known: %s): the model's own chat template is used",
        text,
        sorted(NAMED_TEMPLATES),
    )
    return None


def plain_template() -> ChatTemplate:
    """For models without a chat template (base models): readable role labels."""
    return _plain()


# ---- deriving the markers from a renderer ---------------------------------------------------


def derive_chat_template(
    render: Renderer, name: str = "model", bos_token: str | None = None
) -> ChatTemplate:
    """Compute the role markers of the template behind `render`.

    For each role the conversation before it is rendered with and without the role's message;
    the new text is `prefix + content + suffix`. Raises ValueError when the template does not
    render conversations incrementally (each message's text appended after the previous ones).
    """
    s = [_SENTINEL.format(i) for i in range(4)]
    system_ok = _renders(render, [{"role": "system", "content": s[0]}])
    history: list[dict[str, Any]] = [{"role": "system", "content": s[0]}] if system_ok else []

    roles: dict[str, tuple[str, str]] = {}
    after_user = [*history, {"role": "user", "content": s[1]}]
    assistant_prefix, assistant_suffix = _appended(render, after_user, "assistant", s[2])
    generation_prompt = _generation_prompt(render, after_user)
    # the text the model generates after is what matters: prefer the generation prompt
    roles["assistant"] = (generation_prompt or assistant_prefix, assistant_suffix)
    # a user message in mid-conversation: its markers without whatever opens a conversation
    after_turn = [*after_user, {"role": "assistant", "content": s[2]}]
    user_prefix, user_suffix = _appended(render, after_turn, "user", s[3])
    roles["user"] = (user_prefix, user_suffix)

    if system_ok:
        first = render([{"role": "system", "content": s[0]}], False)
        head, _, tail = first.partition(s[0])
        system_prefix, begin = _split_begin(head, user_prefix, bos_token)
        roles["system"] = (system_prefix, tail)
    else:
        first = render([{"role": "user", "content": s[1]}], False)
        head = first.partition(s[1])[0]
        begin = head[: len(head) - len(user_prefix)] if head.endswith(user_prefix) else ""

    default_system = None
    if system_ok:
        default_system = _default_system(render, roles, begin, s[3])
    stop = assistant_suffix.strip()
    return ChatTemplate(
        name=name,
        role_prefix_and_suffix=roles,
        default_system_prompt=default_system,
        stop_str=(stop,) if stop else (),
        begin=begin,
    )


def _renders(render: Renderer, messages: list[dict[str, Any]]) -> bool:
    try:
        render(messages, False)
        return True
    except Exception:
        return False


def _appended(
    render: Renderer, history: list[dict[str, Any]], role: str, content: str
) -> tuple[str, str]:
    base = render(history, False) if history else ""
    full = render([*history, {"role": role, "content": content}], False)
    if not full.startswith(base) or content not in full[len(base) :]:
        raise ValueError(
            f"the chat template does not render a {role} message after the earlier ones "
            "(it rewrites earlier text); give a chat template explicitly"
        )
    prefix, _, suffix = full[len(base) :].partition(content)
    return prefix, suffix


def _generation_prompt(render: Renderer, history: list[dict[str, Any]]) -> str:
    without = render(history, False)
    with_prompt = render(history, True)
    return with_prompt[len(without) :] if with_prompt.startswith(without) else ""


def _split_begin(head: str, user_prefix: str, bos_token: str | None) -> tuple[str, str]:
    """The first system message's head is `begin + system_prefix`: split it by the shape of the
    user prefix (the same markers with another role name), else by a leading BOS token."""
    for candidate in (user_prefix.replace("user", "system"), user_prefix.replace("User", "System")):
        if candidate and candidate != user_prefix and head.endswith(candidate):
            return candidate, head[: len(head) - len(candidate)]
    if bos_token and head.startswith(bos_token) and not user_prefix.startswith(bos_token):
        return head[len(bos_token) :], bos_token
    return head, ""


def _default_system(
    render: Renderer, roles: dict[str, tuple[str, str]], begin: str, content: str
) -> str | None:
    """The system message the template inserts before a first user message, if any."""
    text = render([{"role": "user", "content": content}], False)
    head = text.partition(content)[0]
    sys_prefix, sys_suffix = roles["system"]
    user_prefix = roles["user"][0]
    opening = begin + sys_prefix
    closing = sys_suffix + user_prefix
    if head.startswith(opening) and head.endswith(closing) and len(head) >= len(opening + closing):
        return head[len(opening) : len(head) - len(closing)] or None
    return None


# ---- rendering a template without transformers ----------------------------------------------


def jinja_renderer(template: str, special_tokens: dict[str, Any] | None = None) -> Renderer:
    """A renderer for a Hugging Face chat template, with the environment transformers uses
    (sandboxed, trim_blocks, lstrip_blocks, `raise_exception`, `tojson`); `special_tokens` and
    any other variables in that mapping (`tools`) are given to every rendering."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, **kwargs: Any) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, **kwargs)

    def strftime_now(fmt: str) -> str:
        import datetime

        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    compiled = env.from_string(template)
    tokens = dict(special_tokens or {})

    def render(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return compiled.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **tokens
        )

    return render


def template_from_tokenizer_files(folder: str | Path) -> ChatTemplate | None:
    """The chat template of a tokenizer folder (`chat_template.jinja` or the `chat_template` of
    `tokenizer_config.json`), or None when the folder has none."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    config: dict[str, Any] = {}
    config_file = folder / "tokenizer_config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text(encoding="utf-8"))
    jinja_file = folder / "chat_template.jinja"
    template = jinja_file.read_text(encoding="utf-8") if jinja_file.is_file() else None
    template = template or config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if not isinstance(template, str) or not template:
        return None
    tokens = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[key] = value
    return derive_chat_template(
        jinja_renderer(template, tokens), name=folder.name, bos_token=tokens.get("bos_token")
    )
