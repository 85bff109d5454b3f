"""Tool-call triggers written `<...>` that are no special token of the vocabulary: the default
model's tokenizer spells `<tool_call>` in five tokens (`<`, `tool`, `_`, `call`, `>`), as most
tokenizers but Qwen's do. Such a trigger still opens a section of a structural tag (llguidance
takes a trigger written `<...>` for a special token unless told otherwise), and still binds a
call in the "auto" tools' grammar; the parsers find the call however the output's tokens cut
the trigger. A trigger that is a special token opens a section as that token only."""

from __future__ import annotations

import json

import msgspec
import pytest

from radixlm.constrained import GrammarCompiler
from radixlm.server.openai_protocol import ChatCompletionRequest
from radixlm.server.tool_parsers import tool_call_parser
from radixlm.server.tools import ToolCallStreamer, auto_output_regex, plan_tools

ZONE = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": ZONE}}
OFFERED = msgspec.convert({"messages": [], "tools": [TIME]}, ChatCompletionRequest).tools


@pytest.fixture(scope="module")
def hf_tokenizer(default_model_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_folder)


@pytest.fixture(scope="module")
def compiler(hf_tokenizer) -> GrammarCompiler:
    return GrammarCompiler(hf_tokenizer)


def accepts(grammar, ids: list[int], eos: int) -> bool:
    """Whether the matcher takes the tokens `ids`, then EOS."""
    matcher = grammar.matcher()
    return all(matcher.accept_token(t) for t in ids) and matcher.accept_token(eos)


def test_the_trigger_is_several_tokens_of_this_vocabulary(hf_tokenizer):
    # (the premise of this file)
    for trigger in ("<tool_call>", "</tool_call>"):
        ids = hf_tokenizer.encode(trigger, add_special_tokens=False)
        assert len(ids) > 1 and not set(ids) & set(hf_tokenizer.all_special_ids), ids


SECTIONS = {"structures": [{"begin": "<tool_call>", "schema": ZONE, "end": "</tool_call>"}]}
TEXTS = [
    ("No call.", True),
    ('Checking. <tool_call>{"zone":"UTC"}</tool_call> Done.', True),
    ('<tool_call>{"zone":"CET"}</tool_call><tool_call>{"zone":"UTC"}</tool_call>', True),
    ('Checking. <tool_call>{"zone":"PST"}</tool_call>', False),  # not in the enum
    ('<tool_call>{"city":"Paris"}</tool_call>', False),
    ('<tool_call>{"zone":"UTC"}', False),  # never closed
]


@pytest.mark.parametrize("thinking", [None, {"begin": "<think>", "end": "</think>"}])
@pytest.mark.parametrize("text,valid", TEXTS)
def test_a_structural_tag_trigger_spelled_in_several_tokens_opens_its_section(
    compiler, hf_tokenizer, thinking, text, valid
):
    tag = {**SECTIONS, "triggers": ["<tool_call>"]}
    if thinking is not None:  # (as the server sends it after a reasoning model's thinking)
        tag["thinking"] = {**thinking, "forced": False}
        text = f"<think>Maybe <tool_call> here.</think>{text}"  # (no section while thinking)
    grammar = compiler.compile("structural_tag", json.dumps(tag))
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    assert accepts(grammar, ids, hf_tokenizer.eos_token_id) == valid


def test_a_trigger_that_is_a_special_token_opens_sections_as_that_token(compiler, hf_tokenizer):
    special = "<|im_start|>"  # (a special token of this vocabulary)
    [token] = hf_tokenizer.encode(special, add_special_tokens=False)
    tag = {
        "structures": [{"begin": special, "schema": ZONE, "end": "</f>"}],
        "triggers": [special],
    }
    grammar = compiler.compile("structural_tag", json.dumps(tag))

    def spell(text: str) -> list[int]:
        return hf_tokenizer.encode(text, add_special_tokens=False)

    eos = hf_tokenizer.eos_token_id
    assert accepts(grammar, spell("x ") + [token] + spell('{"zone":"UTC"}</f>'), eos)
    assert not accepts(grammar, spell("x ") + [token] + spell('{"zone":"PST"}</f>'), eos)


def test_the_auto_tools_grammar_binds_a_call_whose_marker_is_several_tokens(compiler, hf_tokenizer):
    grammar = compiler.compile("regex", auto_output_regex(plan_tools(OFFERED, "auto", True)))
    eos = hf_tokenizer.eos_token_id

    def call(arguments: str) -> list[int]:
        text = f'Sure. <tool_call>\n{{"name":"get_time","arguments":{arguments}}}\n</tool_call>'
        return hf_tokenizer.encode(text, add_special_tokens=False)

    assert accepts(grammar, call('{"zone":"UTC"}'), eos)
    assert not accepts(grammar, call('{"zone":"PST"}'), eos)
    assert not accepts(grammar, call('{"city":"Paris"}'), eos)


def streamed(tokenizer, text: str) -> list[str]:
    """The output `text` as the engine streams it, token by token (an incomplete UTF-8
    character held back, as runtime/detokenizer.py does)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return [tokenizer.decode(ids[:end]).rstrip("\ufffd") for end in range(1, len(ids) + 1)]


@pytest.mark.parametrize("family", ["hermes", "deepseekv3"])
def test_the_parsers_find_a_call_streamed_as_the_tokens_cut_its_markers(hf_tokenizer, family):
    parser = tool_call_parser(family)
    text = "Let me check. " + parser.format_call("get_time", {"zone": "UTC"})
    pieces = streamed(hf_tokenizer, text)
    assert pieces[-1] == text
    stream = parser.stream({"get_time"})
    content, arguments = "", ""
    for i, so_far in enumerate(pieces):
        piece, deltas = stream.feed(so_far, final=i == len(pieces) - 1)
        content += piece
        for delta in deltas:
            assert delta["function"].get("name", "get_time") == "get_time"
            arguments += delta["function"]["arguments"]
    assert stream.count == 1 and content == "Let me check."
    assert json.loads(arguments) == {"zone": "UTC"}
    whole = parser.parse(text, {"get_time"})
    assert [(c.name, c.arguments) for c in whole.calls] == [("get_time", arguments)]


def test_the_default_format_finds_a_call_streamed_as_the_tokens_cut_its_markers(hf_tokenizer):
    text = 'Let me check. <tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    streamer = ToolCallStreamer(plan_tools(OFFERED, "auto", True))
    arguments = ""
    for so_far in streamed(hf_tokenizer, text):
        for delta in streamer.feed(so_far):
            arguments += delta["function"]["arguments"]
    assert streamer.count == 1 and json.loads(arguments) == {"zone": "UTC"}
