"""`radixlm train-draft`: draft heads trained on the target model's own outputs.

1. Data (draft_data.py): prompts (built-in, written by the model, or random tokens), the model's
   greedy answers through the engine, and the final hidden states along each answer; written to
   the output folder (data.json, data.safetensors) and reused by a run with the same data settings.
2. Training: each Medusa head's residual block is trained through the frozen LM head, head i by
   cross-entropy against the answer token i places after the one the LM head predicts from the
   same state, the heads' losses weighted decay**i (later heads are harder and matter less:
   a chain is only as long as its first miss). AdamW, linear warm-up then cosine decay, batches
   drawn in a seeded order: the same seed gives the same loss curve on the same machine.
3. Output: the head folder the engine loads (config.json, with the recipe and held-out results,
   and medusa_heads.safetensors), a checkpoint (checkpoint.pt) every --save-every steps, which
   --resume continues from, and train_log.jsonl (losses every --log-every steps, evaluations).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from radixlm.runtime.speculative.medusa import MedusaConfig, MedusaHeads, save_heads
from radixlm.runtime.speculative.train_common import (
    CHECKPOINT,
    LOG,
    check_same,
    conversations,
    held_out,
    lr_at,
    save_checkpoint,
    truncate_log,
    write_atomic,
)
from radixlm.runtime.speculative.train_options import TrainDraftOptions

DATA_JSON, DATA_TENSORS = "data.json", "data.safetensors"
_IGNORE = -100

# ---- data ---------------------------------------------------------------------------------------


@dataclass
class DraftData:
    """Answer positions of the conversations: hidden (N, H) float32, the answers' tokens, and
    which conversation each position belongs to; split by conversation."""

    hidden: torch.Tensor  # (N, H)
    prompts: list[list[int]]  # each conversation's prompt ids (chat template applied)
    answers: list[list[int]]  # each conversation's answer ids
    held_out: list[bool]  # per conversation

    def split(self, num_heads: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(train, held-out) dicts of hidden (n, H), next (n,): the token the LM head gives
        (the data's own check), targets (n, num_heads): head i's token, or -100 past the end."""
        parts: dict[bool, dict[str, list]] = {
            False: {"rows": [], "next": [], "targets": []},
            True: {"rows": [], "next": [], "targets": []},
        }
        at = 0
        for answer, held in zip(self.answers, self.held_out):
            part = parts[held]
            n = len(answer)
            part["rows"].extend(range(at, at + n))
            part["next"].extend(answer)
            for r in range(n):
                part["targets"].append(
                    [answer[r + i] if r + i < n else _IGNORE for i in range(1, num_heads + 1)]
                )
            at += n

        def tensors(part: dict[str, list]) -> dict[str, torch.Tensor]:
            return {
                "hidden": self.hidden[torch.tensor(part["rows"], dtype=torch.int64)],
                "next": torch.tensor(part["next"], dtype=torch.int64),
                "targets": torch.tensor(part["targets"], dtype=torch.int64).view(-1, num_heads),
            }

        return tensors(parts[False]), tensors(parts[True])


def make_data(engine, opts: TrainDraftOptions, say: Callable[[str], None]) -> DraftData:
    from tqdm import tqdm

    from radixlm.runtime.speculative import draft_data

    convs = conversations(engine, opts, say)
    tokens = sum(len(c.answer_ids) for c in convs)
    say(f"capturing the final hidden states of {tokens} answer positions")
    with tqdm(total=len(convs), desc="hidden states", unit="conversation") as bar:
        states = draft_data.hidden_states(
            engine.model, engine.model_config, convs, engine.device, progress=bar.update
        )
    held = held_out(len(convs), opts.held_out_fraction, opts.seed)
    prompts = [c.prompt_ids for c in convs]
    return DraftData(torch.cat(states), prompts, [c.answer_ids for c in convs], held)


def save_data(folder: Path, data: DraftData, settings: dict[str, Any], model_sample) -> None:
    from safetensors.torch import save_file

    save_file(
        {"hidden": data.hidden.contiguous(), "model_sample": model_sample},
        str(folder / DATA_TENSORS),
    )
    meta = {
        "settings": settings,
        "prompts": data.prompts,
        "answers": data.answers,
        "held_out": data.held_out,
    }
    write_atomic(folder / DATA_JSON, json.dumps(meta))


def load_data(folder: Path, settings: dict[str, Any], model_sample) -> DraftData | None:
    """The data made before in `folder` with these settings for this model; None if none."""
    if not (folder / DATA_JSON).is_file() or not (folder / DATA_TENSORS).is_file():
        return None
    from safetensors.torch import load_file

    meta = json.loads((folder / DATA_JSON).read_text())
    if meta.get("settings") != settings:
        raise ValueError(
            f"train-draft: {str(folder)!r} holds data made with other settings "
            f"({meta.get('settings')}); use the same, or another --output"
        )
    tensors = load_file(str(folder / DATA_TENSORS))
    if not torch.allclose(tensors["model_sample"], model_sample, rtol=2e-2, atol=1e-3):
        raise ValueError(
            f"train-draft: {str(folder)!r} holds data made with another model; use another --output"
        )
    return DraftData(tensors["hidden"], meta["prompts"], meta["answers"], meta["held_out"])


# ---- training -----------------------------------------------------------------------------------


def head_losses(
    heads: MedusaHeads, lm_weight: torch.Tensor, hidden: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-head mean cross-entropy (K,), per-head top-1 hits (K,)) over positions with a
    target. hidden (B, H), targets (B, K); lm_weight (V, H), frozen."""
    k = targets.shape[1]
    x = heads(hidden, k)  # (B, K, H)
    logits = F.linear(x.reshape(-1, x.shape[-1]), lm_weight)  # (B K, V)
    flat = targets.reshape(-1)
    ce = F.cross_entropy(logits, flat, ignore_index=_IGNORE, reduction="none").view(-1, k)
    valid = targets != _IGNORE
    counts = valid.sum(0).clamp(min=1)
    hits = ((logits.argmax(-1).view(-1, k) == targets) & valid).sum(0)
    return (ce * valid).sum(0) / counts, hits


@torch.no_grad()
def evaluate(heads: MedusaHeads, lm_weight, part: dict[str, torch.Tensor], chunk: int = 512):
    """Held-out results: per-head loss and top-1 accuracy, the LM head's own top-1 (how well the
    data matches the model: near 1), and the mean tokens a verify step of the top-1 chain would
    take (1 + the heads right before the first miss, where the model's own token is right)."""
    k = part["targets"].shape[1]
    n = part["targets"].shape[0]
    loss_sum = torch.zeros(k)
    hits = torch.zeros(k)
    counts = (part["targets"] != _IGNORE).sum(0).float()
    own = 0
    chain_sum = 0.0
    for at in range(0, n, chunk):
        h = part["hidden"][at : at + chunk].to(lm_weight.device)
        t = part["targets"][at : at + chunk].to(lm_weight.device)
        x = heads(h, k)
        logits = F.linear(x.reshape(-1, x.shape[-1]), lm_weight)
        ce = F.cross_entropy(logits, t.reshape(-1), ignore_index=_IGNORE, reduction="none")
        loss_sum += ce.view(-1, k).sum(0).cpu()
        right = (logits.argmax(-1).view(-1, k) == t).cpu()
        hits += right.sum(0)
        nxt = F.linear(h, lm_weight).argmax(-1).cpu() == part["next"][at : at + chunk]
        own += int(nxt.sum())
        lead = torch.cumprod(right.int(), dim=1).sum(1)  # heads right before the first miss
        chain_sum += float(torch.where(nxt, 1 + lead, torch.zeros_like(lead)).sum())
    return {
        "positions": n,
        "head_loss": [round(float(v), 4) for v in loss_sum / counts.clamp(min=1)],
        "head_top1": [round(float(v), 4) for v in hits / counts.clamp(min=1)],
        "lm_head_top1": round(own / max(n, 1), 4),
        "chain_accept_length": round(chain_sum / max(n, 1), 4),
    }


def _batch(step: int, n: int, size: int, seed: int) -> torch.Tensor:
    """The rows of `step`: epoch e's seeded permutation, cut in batches (a function of the step,
    so a resumed run draws what an uninterrupted one does)."""
    per_epoch = max(1, math.ceil(n / size))
    epoch, j = divmod(step, per_epoch)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
    return order[j * size : (j + 1) * size]


def train_draft(
    opts: TrainDraftOptions, engine_kwargs: dict[str, Any], say: Callable[[str], None] = print
) -> dict[str, Any]:
    """Make or reuse the data, train (or resume), write the head folder; returns its summary.
    With --algorithm EAGLE3, an EAGLE-3 draft instead (eagle3_training.py; its data is made
    afresh each run)."""
    import radixlm
    from radixlm.runtime import model_loader
    from radixlm.runtime.speculative.medusa import float_lm_head, lm_head_sample

    opts.check()
    folder = Path(opts.output).expanduser()
    ckpt_path = folder / CHECKPOINT
    if ckpt_path.is_file() and not opts.resume:
        raise ValueError(
            f"train-draft: {str(folder)!r} holds a checkpoint; pass --resume to continue it, or "
            "choose another --output"
        )
    if opts.resume and not ckpt_path.is_file():
        raise ValueError(f"train-draft: --resume, but {str(folder)!r} holds no {CHECKPOINT}")
    folder.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if opts.algorithm.upper() in ("EAGLE", "EAGLE3"):
        from radixlm.runtime.speculative.eagle3_training import train_eagle3

        with radixlm.Engine(**engine_kwargs) as engine:
            summary = train_eagle3(opts, engine, folder, say)
        summary["total_seconds"] = round(time.perf_counter() - started, 1)
        return summary
    with radixlm.Engine(**engine_kwargs) as engine:
        model = engine.model
        weight = float_lm_head(model.lm_head)
        if weight.shape[0] != engine.model_config.vocab_size:
            raise ValueError("train-draft needs the whole LM head on one device (tp_size 1)")
        sample = lm_head_sample(weight)
        data = load_data(folder, opts.data_settings(), sample)
        if data is None:
            data = make_data(engine, opts, say)
            save_data(folder, data, opts.data_settings(), sample)
        else:
            say(f"reusing the data in {folder} ({data.hidden.shape[0]} answer positions)")
        data_seconds = time.perf_counter() - started
        lm_weight = weight.detach()[: model.sampled_vocab].float()
        shape = engine.model_config.hidden_size, engine.model_config.vocab_size
        # the model as the user named it (a GGUF file's converted folder is a cache entry)
        model_name = Path(engine.config.model_path or model_loader.default_model_path()).name
    summary = _train(opts, folder, data, lm_weight, shape, model_name, say, sample)
    summary["data_seconds"] = round(data_seconds, 1)
    summary["total_seconds"] = round(time.perf_counter() - started, 1)
    return summary


def _train(opts, folder, data, lm_weight, shape, model_name, say, sample) -> dict[str, Any]:
    """Train (or resume) on `data` through the frozen `lm_weight` (V, H); `shape`: the model's
    (hidden_size, vocab_size); `sample`: its LM head's sample (recognizes it at load)."""
    from tqdm import tqdm

    hidden_size, vocab_size = shape

    train, held = data.split(opts.num_heads)
    n = train["targets"].shape[0]
    if n == 0:
        raise ValueError("train-draft: no training positions (more prompts, or longer answers)")
    total = opts.steps or max(1, math.ceil(opts.epochs * n / opts.batch_size))
    device = lm_weight.device
    torch.manual_seed(opts.seed)
    heads = MedusaHeads(hidden_size, opts.num_heads, opts.num_layers).to(device)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=opts.lr, weight_decay=opts.weight_decay)
    weights = torch.tensor([opts.head_decay**i for i in range(opts.num_heads)], device=device)
    start = 0
    log_path = folder / LOG
    if opts.resume:
        state = torch.load(folder / CHECKPOINT, map_location=device, weights_only=True)
        check_same(state["options"], opts)
        heads.load_state_dict(state["heads"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
        say(f"resuming from step {start} of {total}")
        truncate_log(log_path, start)
    elif log_path.exists():
        log_path.unlink()
    say(
        f"training {opts.num_heads} Medusa heads on {n} positions ({held['targets'].shape[0]} "
        f"held out), {total} steps of {opts.batch_size}"
    )
    hidden, targets = train["hidden"].to(device), train["targets"].to(device)
    t0 = time.perf_counter()
    losses = None
    with open(log_path, "a") as log, tqdm(total=total, initial=start, desc="steps") as bar:
        for step in range(start, total):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, total, opts.lr)
            rows = _batch(step, n, opts.batch_size, opts.seed).to(device)
            per_head, _ = head_losses(heads, lm_weight, hidden[rows], targets[rows])
            loss = (weights * per_head).sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses = [round(float(v), 4) for v in per_head.detach()]
            bar.update(1)
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}", head1=losses[0])
            done = step + 1
            if done % opts.log_every == 0 or done == total:
                entry = {"step": done, "loss": round(float(loss.detach()), 4), "head_loss": losses}
                log.write(json.dumps(entry) + "\n")
                log.flush()
            if done % opts.save_every == 0 and done < total:
                save_checkpoint(folder, done, optimizer, opts, heads=heads.state_dict())
    train_seconds = time.perf_counter() - t0
    heads.eval()
    results = evaluate(heads, lm_weight, held)
    with open(log_path, "a") as log:
        log.write(json.dumps({"step": total, "held_out": results}) + "\n")
    recipe = {
        "command": "radixlm train-draft",
        # (not where it ran: the folder and resuming are the run's own)
        "options": {
            k: v for k, v in dataclasses.asdict(opts).items() if k not in ("resume", "output")
        },
        "train_positions": n,
        "steps": total,
        "final_head_loss": losses,
        "held_out": results,
        "train_seconds": round(train_seconds, 1),
    }
    config = MedusaConfig(
        medusa_num_heads=opts.num_heads,
        medusa_num_layers=opts.num_layers,
        hidden_size=hidden_size,
        vocab_size=vocab_size,
        base_model_name_or_path=model_name,
        training=recipe,
    )
    save_heads(folder, heads, config, sample, getattr(torch, opts.save_dtype))
    save_checkpoint(folder, total, optimizer, opts, heads=heads.state_dict())
    say(
        f"held out: head top-1 {results['head_top1']}, top-1 chain {results['chain_accept_length']}"
        f" tokens a step; heads written to {folder}"
    )
    return recipe
