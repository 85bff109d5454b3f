"""The options of `radixlm train-draft` (runtime/speculative/training.py), without torch: the
CLI builds its parser from them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

# the options a data set depends on (a run with other values makes its own)
DATA_KEYS = (
    "seed",
    "num_prompts",
    "random_prompt_fraction",
    "model_prompt_fraction",
    "max_new_tokens",
    "held_out_fraction",
    "prompts_file",
)
# options a resumed run may change (they do not change what is computed)
FREE_ON_RESUME = ("resume", "save_every", "log_every", "output", "save_dtype")
SAVE_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class TrainDraftOptions:
    output: str
    algorithm: str = "MEDUSA"
    num_heads: int = 4  # MEDUSA's heads; EAGLE3: the depth trained (draft tokens a chain)
    num_layers: int = 1  # residual blocks per head
    num_prompts: int = 256
    random_prompt_fraction: float = 0.0  # the share of prompts made of random tokens
    # the share of prompts the model writes itself (draft_data.model_prompts)
    model_prompt_fraction: float = 0.0
    # user messages to answer instead of the built-in ones (draft_data.read_prompts: JSON Lines
    # or one a line), up to --num-prompts of them, a seeded sample
    prompts_file: str | None = None
    max_new_tokens: int = 128  # each answer's length at most
    held_out_fraction: float = 0.1  # conversations kept out of training, for evaluation
    epochs: float = 2.0
    steps: int | None = None  # optimizer steps (default: from epochs)
    batch_size: int = 256  # answer positions a step
    lr: float = 1e-3
    weight_decay: float = 0.0
    head_decay: float = 0.8  # head i's loss weight: head_decay ** i
    # EAGLE3: the draft drafts the this many tokens most frequent in the answers (its LM head
    # that many rows; default: the whole vocabulary), and its MLP is this wide (default: the
    # target's)
    draft_vocab_size: int | None = None
    intermediate_size: int | None = None
    save_dtype: str = "float32"  # the written weights' (a draft to ship: bfloat16, half the bytes)
    seed: int = 0
    resume: bool = False
    save_every: int = 200
    log_every: int = 10

    def check(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"train-draft: {msg}")

        if self.algorithm.upper() not in ("MEDUSA", "EAGLE", "EAGLE3"):
            bad(
                f"--algorithm {self.algorithm}: MEDUSA heads, an EAGLE or an EAGLE3 draft can be "
                "trained"
            )
        for name in ("num_heads", "num_layers", "num_prompts", "max_new_tokens", "batch_size"):
            if getattr(self, name) < 1:
                bad(f"--{name.replace('_', '-')} must be at least 1")
        if self.num_heads > 16:
            bad("--num-heads is at most 16 (a chain rarely survives past a few heads)")
        for name in ("random_prompt_fraction", "model_prompt_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                bad(f"--{name.replace('_', '-')} must lie in [0, 1]")
        if self.random_prompt_fraction + self.model_prompt_fraction > 1.0:
            bad("--random-prompt-fraction and --model-prompt-fraction add up to more than 1")
        if not 0.0 < self.held_out_fraction < 1.0:
            bad("--held-out-fraction must lie in (0, 1)")
        if self.steps is not None and self.steps < 1:
            bad("--steps must be at least 1")
        if self.epochs <= 0:
            bad("--epochs must be positive")
        if self.lr <= 0 or self.weight_decay < 0 or not 0 < self.head_decay <= 1:
            bad("need --lr > 0, --weight-decay >= 0 and 0 < --head-decay <= 1")
        for name, kinds in (
            ("draft_vocab_size", ("EAGLE3",)),
            ("intermediate_size", ("EAGLE", "EAGLE3")),
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                bad(f"--{name.replace('_', '-')} must be at least 1")
            if value is not None and self.algorithm.upper() not in kinds:
                bad(f"--{name.replace('_', '-')} is for an {' or '.join(kinds)} draft")
        if self.prompts_file is not None and not Path(self.prompts_file).expanduser().is_file():
            bad(f"--prompts-file {self.prompts_file}: no such file")
        if self.save_dtype not in SAVE_DTYPES:
            bad(f"--save-dtype {self.save_dtype}: one of {', '.join(SAVE_DTYPES)}")
        if self.save_every < 1 or self.log_every < 1:
            bad("--save-every and --log-every must be at least 1")

    def data_settings(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in DATA_KEYS}
