"""Thinking text apart from the answer, under SGLang's `--reasoning-parser` names.

A reasoning model writes its thinking between `<think>` and `</think>`, then its answer.
`deepseek-r1`: the chat template opens `<think>` itself, so the output may start inside the
thinking without the tag; all of an output without `</think>` is thinking (cut off while
thinking). `qwen3`: thinking only in an output that opens `<think>` (Qwen3 with thinking turned
off writes none). The thinking goes out as the message's `reasoning_content`, the answer as its
`content` (tool calls are read from the answer only); both are stripped of the whitespace around
them. Streamed, the same split arrives in pieces (`ReasoningStream`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    # the output starts inside the thinking even without the opening tag
    forced: bool
    start: str = "<think>"
    end: str = "</think>"

    def split(self, text: str) -> tuple[str | None, str]:
        """(the thinking, or None if there is none; the answer) of a finished output."""
        stream = ReasoningStream(self)
        stream.feed(text, final=True)
        return stream.reasoning, stream.answer

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)


class ReasoningStream:
    """Splits an output into thinking and answer as it arrives: `feed` returns the new thinking;
    `answer` is the answer so far (it only ever grows)."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.state = "undecided"  # undecided | thinking | answer
        self._think_from = 0  # where the thinking starts in the output
        self._sent = 0  # characters of the thinking handed out
        self._answer_from = -1  # where the answer starts (-1: not yet)
        self.reasoning: str | None = None
        self.answer = ""

    def feed(self, text: str, final: bool = False) -> str:
        p = self.parser
        if self.state == "undecided":
            head = text.lstrip()
            opened = head.startswith(p.start)
            if not opened and p.start.startswith(head) and not final:
                return ""  # (maybe the opening tag, still arriving)
            if opened or p.forced:
                self.state = "thinking"
                self._think_from = len(text) - len(head) + (len(p.start) if opened else 0)
                self.reasoning = ""
            else:
                self.state, self._answer_from = "answer", 0
        new = ""
        if self.state == "thinking":
            closed = text.find(p.end, self._think_from)
            if closed != -1:
                upto = closed
            else:  # (a suffix that may begin the closing tag waits)
                upto = len(text) - (0 if final else _partial_suffix(text, p.end))
            # stripped: whitespace at its end is sent once text follows it
            thinking = text[self._think_from : upto].strip()
            new = thinking[self._sent :]
            self._sent, self.reasoning = len(thinking), thinking
            if closed != -1:
                self.state, self._answer_from = "answer", closed + len(p.end)
        if self.state == "answer":
            answer = text[self._answer_from :]
            self.answer = answer.lstrip() if self.reasoning is not None else answer
        return new


def _partial_suffix(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


_PARSERS = {
    "deepseek-r1": ReasoningParser("deepseek-r1", forced=True),
    "qwen3": ReasoningParser("qwen3", forced=False),
    "qwen3-thinking": ReasoningParser("qwen3-thinking", forced=True),
}
REASONING_PARSERS: tuple[str, ...] = tuple(_PARSERS)


@functools.cache
def reasoning_parser(name: str) -> ReasoningParser:
    try:
        return _PARSERS[name]
    except KeyError:
        raise ValueError(
            f"reasoning_parser={name!r}; use one of {', '.join(REASONING_PARSERS)}"
        ) from None
