"""Training an EAGLE-3 draft (runtime/models/llama_eagle3.py), or an EAGLE-1/2 one
(llama_eagle.py), with training-time test: the draft learns on its own outputs, as it will draft.

For a sequence x_0 .. x_{L-1} the target ran, with its features f_t at each position, step 0 is
the draft reading (f_t, x_{t+1}) at position t, predicting x_{t+2}: what it does over a context.
Step j > 0 reads, at each t, its own output of step j - 1 there (EAGLE-3: no fc) with token x_{t+1+j} at
position t + j, predicting x_{t+2+j}: what its j-th draft step does after a context ending at t,
had it drafted the tokens the sequence holds. Each step's query at t attends to the step-0 keys of
positions 0 .. t (the context) and to the keys of steps 1 .. j at t (the draft steps before it
and its own), which is what the draft's KV cache holds at that draft step. All t run at once, so
a sequence of L tokens teaches L positions at each of `steps` depths in one pass.

`ttt_forward` is that pass, in plain torch (autograd through everything but the target's frozen
embedding); `ttt_loss` the cross-entropy of each step's logits against the tokens, over the
draft vocabulary (targets outside it are not counted). An EAGLE draft's features are the target's
final hidden state, each step's input fc(embedding, hidden), its logits the target's frozen LM
head's over its output (a float copy: `new_draft`).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from radixlm.kernels.fused_ref import rms_norm_ref, rope_ref
from radixlm.runtime.models import llama_eagle
from radixlm.runtime.models.llama_eagle import LlamaEagleDraft
from radixlm.runtime.models.llama_eagle3 import Eagle3Config, LlamaEagle3Draft, config_for_target
from radixlm.runtime.speculative.eagle3 import SAMPLE_KEY, target_sample


def _norm(norm, x: torch.Tensor) -> torch.Tensor:
    """The RMSNorm's torch twin (the fused kernel a GPU would pick has no backward)."""
    return rms_norm_ref(x, norm.weight, norm.eps)[0]


def new_draft(
    target,
    seed: int,
    aux_layers: tuple[int, ...] | None = None,
    vocab: list[int] | None = None,
    intermediate_size: int | None = None,
    algorithm: str = "EAGLE3",
):
    """A draft of `algorithm` (EAGLE3, EAGLE) to train for `target` (a LlamaForCausalLM) on its
    device, in float32: its config from `config_for_target`, weights drawn from `seed` (std
    0.02, norms 1, biases 0), the LM head a copy of the target's rows (a GGUF head's blocks
    dequantized; EAGLE's, frozen and not saved: the engine reads the target's own). `vocab`
    (EAGLE3): the target ids the draft drafts, ascending (draft id d is vocab[d]; default: all);
    returns (draft, its config.json dict)."""
    from radixlm.runtime.speculative.medusa import float_lm_head

    if algorithm == "EAGLE":
        return _new_eagle_draft(target, seed, intermediate_size)
    if vocab is not None and list(vocab) != sorted(set(vocab)):
        raise ValueError("a draft vocabulary is a list of distinct target ids, ascending")
    raw = config_for_target(
        target.cfg, aux_layers, None if vocab is None else len(vocab), intermediate_size
    )
    config = Eagle3Config.from_dict(raw)
    head = float_lm_head(target.lm_head)
    if head.shape[0] < target.cfg.vocab_size:
        raise ValueError("an EAGLE-3 draft is made from the whole LM head (tp_size 1)")
    device = head.device
    ids = torch.arange(config.draft_vocab_size) if vocab is None else torch.tensor(vocab)
    draft = LlamaEagle3Draft(config, target.rope.max_positions).to(device, torch.float32)
    _init_weights(draft, seed)
    with torch.no_grad():
        draft.lm_head.weight.copy_(head[ids.to(device)].float())
        draft.d2t.copy_(ids - torch.arange(len(ids)))
    draft.share_embedding(target.embed_tokens)
    draft.rope.build_tables(device)
    return draft, raw


def _new_eagle_draft(target, seed: int, intermediate_size: int | None):
    """`new_draft` of an EAGLE (EAGLE-1/2) draft."""
    from radixlm.runtime.speculative.medusa import float_lm_head

    raw = llama_eagle.config_for_target(target.cfg, intermediate_size)
    head = float_lm_head(target.lm_head)
    if head.shape[0] < target.cfg.vocab_size:
        raise ValueError("an EAGLE draft is trained through the whole LM head (tp_size 1)")
    device = head.device
    draft = LlamaEagleDraft(llama_eagle.EagleConfig.from_dict(raw), target.rope.max_positions)
    draft = draft.to(device, torch.float32)
    _init_weights(draft, seed)
    frozen = torch.nn.Linear(head.shape[1], head.shape[0], bias=False, device=device)
    frozen.weight.data.copy_(head.float())
    frozen.weight.requires_grad_(False)
    draft.share_embedding(target.embed_tokens)
    draft.share_head(frozen)
    draft.rope.build_tables(device)
    return draft, raw


def _init_weights(draft, seed: int) -> None:
    """Weights drawn from `seed`: matrices std 0.02, norms 1, biases 0."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            else:
                p.zero_()


def _draft_logits(draft, out: torch.Tensor) -> torch.Tensor:
    """The draft's logits over its outputs `out` (float32), with autograd: EAGLE-3's own head
    after its norm; EAGLE's the target's (the frozen float copy `new_draft` gave it)."""
    if isinstance(draft, LlamaEagleDraft):
        return draft.logits(out)
    return draft.lm_head(_norm(draft.norm, out)).float()


def ttt_forward(
    draft, tokens: torch.Tensor, features: torch.Tensor, steps: int
) -> list[torch.Tensor]:
    """tokens (B, L) and the target's features (B, L, F) at each position -> each step's (B, L,
    hidden) outputs; step j's row t is the draft's output after reading token x_{t+1+j} (index
    clamped at L - 1: those rows teach nothing, `ttt_loss` skips them). F: 3 x target hidden
    (EAGLE-3) or the target's hidden (EAGLE)."""
    layer = draft.layer
    attn = layer.self_attn
    b, length = tokens.shape
    heads, kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    eagle = isinstance(draft, LlamaEagleDraft)
    hidden = features if eagle else draft.fc(features)
    with torch.no_grad():
        embeds = draft.embed_tokens(tokens).to(hidden.dtype)  # (the target's: frozen)
    index = torch.arange(length, device=tokens.device)
    causal = index[None, :] <= index[:, None]  # (query t, key s): s <= t
    outs: list[torch.Tensor] = []
    context: tuple[torch.Tensor, torch.Tensor] | None = None
    chain: list[tuple[torch.Tensor, torch.Tensor]] = []
    for j in range(steps):
        token_at = (index + 1 + j).clamp(max=length - 1)
        if eagle:  # fc over the embedding and the hidden state, every step; its output the residual
            both = hidden = draft.fc(torch.cat([embeds[:, token_at], hidden], dim=-1))
        else:
            both = torch.cat(
                [
                    _norm(layer.input_layernorm, embeds[:, token_at]),
                    _norm(layer.hidden_norm, hidden),
                ],
                dim=-1,
            )
        q, k, v = F.linear(both, attn.qkv_proj.weight, attn.qkv_proj.bias).split(
            [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1
        )
        positions = (index + j).clamp(max=draft.rope.cos.shape[0] - 1)
        cos, sin = draft.rope.cos[positions], draft.rope.sin[positions]
        # (the layout RotaryEmbedding.lookup gives rope_ref: (cos, cos), (-sin, sin) per row)
        cos, sin = torch.cat([cos, cos], -1)[:, None], torch.cat([-sin, sin], -1)[:, None]
        q = rope_ref(q.view(b, length, heads, head_dim), cos, sin)
        k = rope_ref(k.view(b, length, kv_heads, head_dim), cos, sin)
        v = v.view(b, length, kv_heads, head_dim)
        k, v = (t.repeat_interleave(heads // kv_heads, dim=2) for t in (k, v))
        if j == 0:
            context = (k, v)
        else:
            chain.append((k, v))
        ck, cv = context
        scores = torch.einsum("bthd,bshd->bhts", q, ck) * attn.scale
        scores = scores.masked_fill(~causal, float("-inf"))
        own = [torch.einsum("bthd,bthd->bht", q, kk)[..., None] * attn.scale for kk, _ in chain]
        weights = torch.softmax(torch.cat([scores, *own], dim=-1).float(), dim=-1).to(q.dtype)
        a = torch.einsum("bhts,bshd->bthd", weights[..., :length], cv)
        for i, (_, vv) in enumerate(chain):
            a = a + weights[..., length + i].transpose(1, 2)[..., None] * vv
        a = F.linear(a.reshape(b, length, heads * head_dim), attn.o_proj.weight)
        summed = a + hidden
        x = _norm(layer.post_attention_layernorm, summed)
        gate, up = F.linear(x, layer.mlp.gate_up_proj.weight).chunk(2, dim=-1)
        out = F.linear(F.silu(gate) * up, layer.mlp.down_proj.weight) + summed
        outs.append(out)
        hidden = out
    return outs


def draft_targets(draft, tokens: torch.Tensor) -> torch.Tensor:
    """Target ids -> draft ids (-1 where the draft vocabulary lacks the token)."""
    vocab = draft.config.model.vocab_size
    lookup = torch.full((vocab,), -1, dtype=torch.long, device=tokens.device)
    draft_ids = torch.arange(draft.config.draft_vocab_size, device=tokens.device)
    lookup[draft.target_ids(draft_ids)] = draft_ids
    return lookup[tokens]


def _depth_rows(
    labels: torch.Tensor,
    depth: int,
    lengths: torch.Tensor,
    starts: torch.Tensor | None,
    in_vocab: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(want, keep), (B, L) each: depth `depth`'s label at each row t (the draft id of
    x_{t+2+depth}, -1 outside the draft vocabulary) and whether the row counts: that token
    exists in its sequence, is (with `in_vocab`) in the draft vocabulary, and (with `starts`)
    is at index starts[b] or later."""
    length = labels.shape[1]
    at = torch.arange(length, device=labels.device) + 2 + depth
    want = labels[:, at.clamp(max=length - 1)]
    keep = at[None, :] < lengths[:, None]
    if in_vocab:
        keep &= want >= 0
    if starts is not None:
        keep &= at[None, :] >= starts[:, None]
    return want, keep


# an EAGLE draft's loss: the distance to the target's hidden state plus this x the cross-entropy
# (EAGLE's own weights: 1 and 0.1)
EAGLE_TOKEN_WEIGHT = 0.1


def ttt_loss(
    draft,
    tokens: torch.Tensor,
    features: torch.Tensor,
    lengths: torch.Tensor,
    steps: int,
    decay: float = 0.8,
    starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[float]]:
    """The mean over steps (step j weighted decay**j) of each step's cross-entropy against
    x_{t+2+j}, over the rows t of each sequence (its `lengths`) that have that token, in the
    draft vocabulary, and (with `starts`, (B,)) whose token is at index starts[b] or later: a
    conversation's answer, the target's own tokens; and each step's top-1 accuracy there.

    An EAGLE draft's output goes into the target's LM head without a norm, so its step j at t
    also learns the target's own hidden state at t + 1 + j (what the head reads to predict
    x_{t+2+j}): EAGLE's loss, a smooth L1 distance to it plus `EAGLE_TOKEN_WEIGHT` x the
    cross-entropy. (The cross-entropy alone diverged on the default model: the output's scale is
    free, and the head's logits with it.)"""
    outs = ttt_forward(draft, tokens, features, steps)
    labels = draft_targets(draft, tokens)
    eagle = isinstance(draft, LlamaEagleDraft)
    length = tokens.shape[1]
    total, weight, accuracy = tokens.new_zeros((), dtype=torch.float32), 0.0, []
    for j, out in enumerate(outs):
        want, keep = _depth_rows(labels, j, lengths, starts)
        if not bool(keep.any()):
            accuracy.append(float("nan"))
            continue
        logits = _draft_logits(draft, out[keep])
        loss = F.cross_entropy(logits, want[keep])
        if eagle:  # (keep's rows have x_{t+2+j}, so t + 1 + j is in the sequence)
            ahead = (torch.arange(length, device=tokens.device) + 1 + j).clamp(max=length - 1)
            goal = features[:, ahead][keep].to(out.dtype)
            loss = F.smooth_l1_loss(out[keep], goal) + EAGLE_TOKEN_WEIGHT * loss
        total = total + decay**j * loss
        weight += decay**j
        accuracy.append(float((logits.argmax(-1) == want[keep]).float().mean()))
    return total / max(weight, 1e-9), accuracy


# ---- `radixlm train-draft --algorithm EAGLE3` (or EAGLE) ------------------------------------------


@dataclass
class SequenceData:
    """Conversations as training sequences: tokens, the target's features at each position,
    where each answer starts, and which are held out."""

    tokens: list[list[int]]
    features: list[torch.Tensor]  # (len, F) float32, on the CPU
    starts: list[int]
    held_out: list[bool]

    def part(self, held: bool) -> list[int]:
        return [i for i, h in enumerate(self.held_out) if h == held]

    def batch(self, rows: list[int], device) -> tuple[torch.Tensor, ...]:
        """(tokens (B, L), features (B, L, F), lengths (B,), starts (B,)), padded with 0."""
        length = max(len(self.tokens[i]) for i in rows)
        width = self.features[rows[0]].shape[1]
        tokens = torch.zeros(len(rows), length, dtype=torch.long)
        features = torch.zeros(len(rows), length, width)
        for b, i in enumerate(rows):
            n = len(self.tokens[i])
            tokens[b, :n] = torch.tensor(self.tokens[i])
            features[b, :n] = self.features[i]
        lengths = torch.tensor([len(self.tokens[i]) for i in rows])
        starts = torch.tensor([self.starts[i] for i in rows])
        return tuple(t.to(device) for t in (tokens, features, lengths, starts))


def _groups(order: list[int], data: SequenceData, positions: int) -> list[list[int]]:
    """`order` cut into batches of about `positions` answer tokens (at least one sequence
    each): what --batch-size counts, and --epochs over the training answers."""
    out, group, used = [], [], 0
    for i in order:
        group.append(i)
        used += len(data.tokens[i]) - data.starts[i]
        if used >= positions:
            out.append(group)
            group, used = [], 0
    if group:
        out.append(group)
    return out


@torch.no_grad()
def evaluate(draft, data: SequenceData, rows: list[int], depth: int, device) -> dict[str, Any]:
    """Held-out results over the answer rows of `rows`: each depth's loss (over the tokens in
    the draft vocabulary) and top-1 accuracy (a token outside it a miss), and the tokens a
    verify step of the draft's top-1 chain would give (1 + the depths right before the first
    miss, where each depth drafts after the ones before were right)."""
    losses, hits, counts, seen = [0.0] * depth, [0.0] * depth, [0] * depth, [0] * depth
    chain, positions = 0.0, 0
    for group in _groups(rows, data, 4096):
        tokens, features, lengths, starts = data.batch(group, device)
        outs = ttt_forward(draft, tokens, features, depth)
        labels = draft_targets(draft, tokens)
        right, counted = [], None
        for j, out in enumerate(outs):
            want, rows_j = _depth_rows(labels, j, lengths, starts, in_vocab=False)
            keep = rows_j & (want >= 0)
            counted = rows_j if counted is None else counted  # (the rows a chain starts from)
            logits = _draft_logits(draft, out)
            hit = (logits.argmax(-1) == want) & rows_j
            right.append(hit)
            n = int(rows_j.sum())
            if n:
                if bool(keep.any()):
                    losses[j] += float(F.cross_entropy(logits[keep], want[keep], reduction="sum"))
                    seen[j] += int(keep.sum())
                hits[j] += float(hit.sum())
                counts[j] += n
        lead = torch.cumprod(torch.stack(right, dim=-1).int(), dim=-1).sum(-1)
        chain += float((1 + lead)[counted].sum())
        positions += int(counted.sum())
    return {
        "positions": positions,
        "depth_loss": [round(v / max(c, 1), 4) for v, c in zip(losses, seen)],
        "depth_top1": [round(v / max(c, 1), 4) for v, c in zip(hits, counts)],
        "chain_accept_length": round(chain / max(positions, 1), 4),
    }


def train_eagle3(opts, engine, folder: Path, say: Callable[[str], None]) -> dict[str, Any]:
    """Train (or resume) an EAGLE-3 draft (an EAGLE one with opts.algorithm EAGLE) for the
    engine's model on its own answers; write the checkpoint folder `LlamaEagle3Draft.load`
    (`LlamaEagleDraft.load`) reads, with the recipe and held-out results in its config.json.
    `opts.num_heads` is the depth trained (draft tokens a chain makes)."""
    from tqdm import tqdm

    from radixlm.runtime.speculative import draft_data, train_common

    target = engine.model
    device = engine.device
    convs = train_common.conversations(engine, opts, say)
    held = train_common.held_out(len(convs), opts.held_out_fraction, opts.seed)
    vocab = None
    if opts.draft_vocab_size:
        answers = [c.answer_ids for c, h in zip(convs, held) if not h]
        vocab = frequent_tokens(answers, opts.draft_vocab_size)
        say(f"the draft's vocabulary: the {len(vocab)} tokens most frequent in the answers")
    draft, raw = new_draft(
        target, opts.seed, vocab=vocab, intermediate_size=opts.intermediate_size,
        algorithm=opts.algorithm.upper(),
    )  # fmt: skip
    layers = draft.config.target_layers(target.cfg)
    what = (
        "the final hidden state" if isinstance(draft, LlamaEagleDraft)
        else f"the input of layers {list(layers)}"
    )  # fmt: skip
    say(f"capturing the target's features ({what}) at every position")
    with tqdm(total=len(convs), desc="features", unit="conversation") as bar:
        features = draft_data.target_features(
            target, engine.model_config, convs, layers, device, progress=bar.update
        )
    data = SequenceData(
        [c.prompt_ids + c.answer_ids for c in convs],
        features,
        [len(c.prompt_ids) for c in convs],
        held,
    )
    train_rows, held_rows = data.part(False), data.part(True)
    n = sum(len(c.answer_ids) for c, h in zip(convs, data.held_out) if not h)
    total = opts.steps or max(1, math.ceil(opts.epochs * n / opts.batch_size))
    params = list(draft.parameters())  # (the target's embedding is not one of them)
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=opts.lr, weight_decay=opts.weight_decay)
    start, log_path = 0, folder / train_common.LOG
    fingerprint = _fingerprint(data)
    if opts.resume:
        state = torch.load(folder / train_common.CHECKPOINT, map_location=device, weights_only=True)
        train_common.check_same(state["options"], opts)
        if state.get("data") != fingerprint:
            raise ValueError(
                "train-draft --resume: the model's answers made again differ from those the "
                "checkpoint was trained on (another model, or decoding that differs from run to "
                "run); start afresh in another --output"
            )
        draft.load_state_dict(state["draft"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
        say(f"resuming from step {start} of {total}")
        train_common.truncate_log(log_path, start)
    elif log_path.exists():
        log_path.unlink()
    say(
        f"training an {draft.kind} draft {opts.num_heads} tokens deep on {n} answer positions "
        f"({len(held_rows)} conversations held out), {total} steps of ~{opts.batch_size}"
    )
    t0 = time.perf_counter()
    rng = random.Random(opts.seed)
    batches: list[list[int]] = []
    loss_value, accuracy = None, []
    with open(log_path, "a") as log, tqdm(total=total, initial=start, desc="steps") as bar:
        for step in range(total):
            if not batches:  # an epoch's batches, in a seeded order
                order = list(train_rows)
                rng.shuffle(order)
                batches = _groups(order, data, opts.batch_size)
            group = batches.pop()
            if step < start:  # (a resumed run draws the same batches, and skips them)
                continue
            for g in optimizer.param_groups:
                g["lr"] = train_common.lr_at(step, total, opts.lr)
            tokens, feats, lengths, starts = data.batch(group, device)
            loss, accuracy = ttt_loss(
                draft, tokens, feats, lengths, opts.num_heads, opts.head_decay, starts
            )
            if loss.requires_grad:  # (a batch of empty answers teaches nothing)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            loss_value = round(float(loss.detach()), 4)
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.3f}")
            done = step + 1
            if done % opts.log_every == 0 or done == total:
                top1 = [None if a != a else round(a, 4) for a in accuracy]  # (nan: no row)
                entry = {"step": done, "loss": loss_value, "depth_top1": top1}
                log.write(json.dumps(entry) + "\n")
                log.flush()
            if done % opts.save_every == 0 and done < total:
                train_common.save_checkpoint(
                    folder, done, optimizer, opts, draft=draft.state_dict(), data=fingerprint
                )
    results = evaluate(draft, data, held_rows, opts.num_heads, device)
    with open(log_path, "a") as log:
        log.write(json.dumps({"step": total, "held_out": results}) + "\n")
    recipe = {
        "command": "radixlm train-draft",
        "options": {k: v for k, v in asdict(opts).items() if k not in ("resume", "output")},
        "train_positions": n,
        "steps": total,
        "final_loss": loss_value,
        "held_out": results,
        "train_seconds": round(time.perf_counter() - t0, 1),
    }
    raw = {**raw, SAMPLE_KEY: target_sample(target), "training": recipe}
    draft.save(folder, raw, getattr(torch, opts.save_dtype))
    train_common.save_checkpoint(
        folder, total, optimizer, opts, draft=draft.state_dict(), data=fingerprint
    )
    say(
        f"held out: top-1 by depth {results['depth_top1']}, top-1 chain "
        f"{results['chain_accept_length']} tokens a step; draft written to {folder}"
    )
    return recipe


def frequent_tokens(answers: list[list[int]], size: int) -> list[int]:
    """The `size` tokens most frequent in `answers` (ties: the lower id first), ascending: an
    EAGLE-3 draft vocabulary, as SpecForge picks one (fewer when fewer tokens occur)."""
    from collections import Counter

    counts = Counter(t for answer in answers for t in answer)
    top = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    return sorted(top)


def _fingerprint(data: SequenceData) -> str:
    """What the training sequences are, in a few bytes: a resumed run must train on the same."""
    import hashlib

    text = json.dumps([data.tokens, data.starts, data.held_out])
    return hashlib.sha256(text.encode()).hexdigest()
