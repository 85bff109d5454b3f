"""Prompts of varied lengths and kinds for the end-to-end tests (the test code tokenizes them)."""

from __future__ import annotations

_PARAGRAPH = (
    "The history of computing is a story of layers. Engineers built machines that followed simple "
    "instructions, then languages to write those instructions, then systems that ran many programs "
    "at once, then networks that joined the systems together. Each layer hid the one below it, and "
    "each made new things possible for people who never saw the lower layers at all. "
)


def varied_prompts() -> list[str]:
    """24 prompts from one token to well over a thousand tokens."""
    short = [
        "Hi",
        "The capital of France is",
        "def fibonacci(n):",
        "1, 2, 3, 5, 8, 13,",
        "Translate to French: I like apples.",
        "Q: What is the boiling point of water?\nA:",
        "Les montagnes sont",
        "東京は日本の",
        "Emoji test: 🙂🚀 are",
        "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
        "Once upon a time, in a small village,",
        "SELECT name FROM users WHERE",
    ]
    long = [_PARAGRAPH * k + "In short," for k in (1, 2, 3, 5, 8, 12)]
    long += [
        "Summarize: " + _PARAGRAPH * 16,  # ~1,100 tokens
        "Story: " + " ".join(f"Day {i}: the team shipped version {i}." for i in range(1, 120)),
        "List: " + ", ".join(str(i) for i in range(300)),
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n"
        + _PARAGRAPH * 4
        + "What is this about?<|im_end|>\n<|im_start|>assistant\n",
        "x" * 50,
        "Numbers: " + " ".join(str(i * 7 % 97) for i in range(200)),
    ]
    return short + long


def hundred_prompts() -> list[str]:
    """The 24 varied prompts, 57 chat prompts and 19 plain ones (100): the numerics prompts."""
    topics = ["rivers", "bread", "chess", "volcanoes", "jazz", "bees", "trains", "glass", "maps", "tea",
              "owls", "clocks", "salt", "kites", "moss", "ink", "bridges", "wool", "comets"]  # fmt: skip
    forms = [
        "Tell me one fact about {}.",
        "Write a haiku about {}.",
        "Why do people like {}?",
        "{}:",
    ]
    chats = [
        f"<|im_start|>user\n{f.format(t)}<|im_end|>\n<|im_start|>assistant\n"
        for t in topics
        for f in forms[:3]
    ]
    plain = [forms[3].format(t.capitalize()) for t in topics]
    return (varied_prompts() + chats + plain)[:100]
