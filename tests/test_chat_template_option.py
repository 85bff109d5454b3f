"""`--chat-template` (`Engine(chat_template=...)`): a Jinja file, a JSON file holding Hugging
Face's {"chat_template": ...}, or a name radixlm ships, in place of the tokenizer's own template,
wherever a chat is rendered. Over the tiny model: the template is the point, not the answers."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from radixlm import cli
from radixlm.runtime.chat_templates import NAMED_CHAT_TEMPLATES, load_chat_template
from radixlm.runtime.config import EngineConfig

# a template unlike the model's own (ChatML with a default system prompt)
TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a color."},
]
RENDERED = "[system] Be brief.\n[user] Name a color.\n[assistant] "


@pytest.fixture(scope="module")
def template_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("templates") / "brackets.jinja"
    path.write_text(TEMPLATE + "\n", encoding="utf-8")  # (a file's last newline is not kept)
    return str(path)


@pytest.fixture(scope="module")
def engine_with_template(tiny_model_folder, template_file):
    import radixlm

    with radixlm.Engine(tiny_model_folder, chat_template=template_file) as engine:
        yield engine


def test_a_jinja_file_replaces_the_tokenizers_template(engine_with_template):
    assert engine_with_template.apply_chat_template(MESSAGES) == RENDERED


def test_the_server_renders_chats_and_reports_the_given_template(engine_with_template):
    from radixlm.server.app import create_app

    tokenizer = engine_with_template.tokenizer
    with TestClient(create_app(engine_with_template, owns_engine=False)) as client:
        info = client.get("/model_info").json()
        assert info["chat_template"] == TEMPLATE
        ids = client.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
        assert ids == tokenizer.encode(RENDERED, add_special_tokens=False)
        chat = client.post(
            "/v1/chat/completions",
            json={"messages": MESSAGES, "max_tokens": 1, "temperature": 0},
        ).json()
        assert chat["usage"]["prompt_tokens"] == len(ids)


def test_programs_take_their_roles_from_the_given_template(engine_with_template):
    import radixlm as sgl

    @sgl.function
    def chat(s):
        s += sgl.system("Be brief.")
        s += sgl.user("Name a color.")
        s += sgl.assistant_begin()

    assert chat.run(backend=engine_with_template).text() == RENDERED


def test_the_engine_process_renders_with_the_template_the_engine_resolved(
    tiny_model_folder, template_file
):
    from radixlm.server.engine_process import EngineProcessBackend

    backend = EngineProcessBackend(
        {"model_path": tiny_model_folder, "chat_template": template_file, "max_total_tokens": 512}
    )
    try:
        assert backend.model_info().chat_template == TEMPLATE
        assert backend.render_chat(MESSAGES) == RENDERED
    finally:
        backend.shutdown()


def test_a_named_template_renders_the_role_markers_of_the_dsls_template_of_that_name():
    from radixlm.lang.chat_template import derive_chat_template, get_chat_template, jinja_renderer

    assert sorted(NAMED_CHAT_TEMPLATES) == ["chatml", "plain"]
    for name in NAMED_CHAT_TEMPLATES:
        derived = derive_chat_template(jinja_renderer(load_chat_template(name)), name)
        assert derived.role_prefix_and_suffix == get_chat_template(name).role_prefix_and_suffix
    render = jinja_renderer(load_chat_template("chatml"))
    assert render(MESSAGES[1:], True) == (
        "<|im_start|>user\nName a color.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_json_file_gives_its_chat_template_and_written_newlines_become_newlines(tmp_path):
    path = tmp_path / "chat_template.json"
    path.write_text(json.dumps({"chat_template": TEMPLATE}), encoding="utf-8")
    assert load_chat_template(str(path)) == TEMPLATE
    # as SGLang reads a Jinja file: "\n" written as two characters is a newline
    one_line = tmp_path / "one_line.jinja"
    one_line.write_text(TEMPLATE.replace("\n", "\\n"), encoding="utf-8")
    assert load_chat_template(str(one_line)) == TEMPLATE


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("missing.jinja", None, "neither a chat template radixlm ships"),
        ("bad.jinja", "{% for m in messages %}", "not a valid Jinja template"),
        ("empty.jinja", "\n\n", "is empty"),
        ("bad.json", "{not json", "not valid JSON"),
        ("sglang.json", '{"name": "x", "sep_style": "ADD_COLON_SINGLE"}', "give a Jinja file"),
    ],
)
def test_a_bad_template_is_refused_before_the_engine_loads(tmp_path, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        EngineConfig(chat_template=str(path))


def test_the_cli_takes_a_chat_template_and_refuses_a_missing_one(tmp_path, capsys):
    args = cli._build_parser().parse_args(["serve", "--chat-template", "chatml"])
    assert cli._engine_kwargs(args) == {"chat_template": "chatml"}
    missing = str(tmp_path / "nope.jinja")
    assert cli.main(["generate", "hi", "--chat-template", missing]) == 2
    assert "nope.jinja" in capsys.readouterr().err
