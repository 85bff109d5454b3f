"""The GPU path (bf16, Triton attention) against the CPU float32 path on the real default model."""

from __future__ import annotations

import pytest
import torch

import radixlm
from tests.prompts import varied_prompts

pytestmark = pytest.mark.gpu

TOKENS = 32


def hundred_prompts() -> list[str]:
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


def test_gpu_greedy_matches_cpu_float32_on_95_of_100_prompts(default_model_folder):
    prompts = hundred_prompts()
    assert len(prompts) == 100
    params = {"max_new_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    with radixlm.Engine(default_model_folder, device="cpu", dtype="float32") as cpu:
        expected = [o["output_ids"] for o in cpu.generate(prompts, params)]
    with radixlm.Engine(default_model_folder, device="cuda") as gpu:
        assert gpu.dtype == torch.bfloat16
        got = [o["output_ids"] for o in gpu.generate(prompts, params)]
        alone = [gpu.generate(p, params)["output_ids"] for p in prompts[:10]]
    same = sum(a == b for a, b in zip(expected, got))
    diverged = [
        (i, next(j for j, (x, y) in enumerate(zip(a, b)) if x != y))
        for i, (a, b) in enumerate(zip(expected, got))
        if a != b
    ]
    print(
        f"GPU bf16 equals CPU float32 for all {TOKENS} tokens on {same}/100 prompts; first divergence (prompt, token): {diverged}"
    )
    assert same >= 95
    assert sum(a == b for a, b in zip(alone, got[:10])) >= 9
