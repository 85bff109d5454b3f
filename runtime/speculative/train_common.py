"""What both kinds of `radixlm train-draft` (training.py: MEDUSA; eagle3_training.py: EAGLE3)
share: the conversations the data comes from, the held-out split, the learning-rate schedule,
and the checkpoint and log files' handling."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from radixlm.runtime.speculative.train_options import FREE_ON_RESUME, TrainDraftOptions

CHECKPOINT, LOG = "checkpoint.pt", "train_log.jsonl"


def conversations(engine, opts: TrainDraftOptions, say: Callable[[str], None]):
    """The prompts the options ask for (seeded), and the engine's greedy answers to them."""
    from tqdm import tqdm

    from radixlm.runtime.speculative import draft_data

    rng = random.Random(opts.seed)
    num_random = round(opts.num_prompts * opts.random_prompt_fraction)
    num_written = round(opts.num_prompts * opts.model_prompt_fraction)
    rest = opts.num_prompts - num_random - num_written
    if opts.prompts_file:  # (a seeded sample of the file's, if it holds more)
        messages = draft_data.read_prompts(opts.prompts_file)
        rng.shuffle(messages)
        messages = messages[:rest]
    else:
        messages = draft_data.builtin_prompts(rest, rng)
    messages += draft_data.random_prompts(num_random, rng, engine.tokenizer, (8, 48))
    if num_written:
        say(f"the model writes {num_written} prompts")
        with tqdm(total=num_written, desc="prompts", unit="prompt") as bar:
            messages += draft_data.model_prompts(engine, num_written, rng, progress=bar.update)
    rng.shuffle(messages)
    say(f"generating the model's answers to {len(messages)} prompts")
    with tqdm(total=len(messages), desc="answers", unit="prompt") as bar:
        return draft_data.generate_answers(engine, messages, opts.max_new_tokens, bar.update)


def held_out(n: int, fraction: float, seed: int) -> list[bool]:
    order = list(range(n))
    random.Random(seed + 1).shuffle(order)
    held = set(order[: max(1, round(n * fraction))])
    return [i in held for i in range(n)]


def lr_at(step: int, total: int, peak: float) -> float:
    """Linear warm-up over the first 5% of steps, then cosine decay to a tenth of the peak."""
    warm = max(1, total // 20)
    if step < warm:
        return peak * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))


def check_same(saved: dict[str, Any], opts: TrainDraftOptions) -> None:
    now = dataclasses.asdict(opts)
    differ = sorted(k for k in now if k not in FREE_ON_RESUME and saved.get(k, now[k]) != now[k])
    if differ:
        was = ", ".join(f"{k}={saved.get(k)!r}" for k in differ)
        raise ValueError(
            f"train-draft --resume: the checkpoint was made with {was}; resume with the same "
            "options, or start afresh in another --output"
        )


def truncate_log(path: Path, step: int) -> None:
    """Keep the log's entries up to `step` (a resumed run writes the later ones again)."""
    if not path.is_file():
        return
    keep = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and "held_out" not in json.loads(line) and json.loads(line)["step"] <= step
    ]
    write_atomic(path, "".join(line + "\n" for line in keep))


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(folder: Path, step: int, optimizer, opts: TrainDraftOptions, **state) -> None:
    """checkpoint.pt: the step, the optimizer's state, the options and `state` (the weights, and
    whatever else a resumed run must find again), written whole or not at all."""
    import torch

    full = {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "options": dataclasses.asdict(opts),
        **state,
    }
    tmp = folder / (CHECKPOINT + ".tmp")
    torch.save(full, tmp)
    os.replace(tmp, folder / CHECKPOINT)  # (a run killed while saving keeps the one before)
