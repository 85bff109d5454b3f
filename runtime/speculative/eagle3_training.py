"""Training an EAGLE-3 draft (runtime/models/llama_eagle3.py) with training-time test: the draft
learns on its own outputs, as it will draft.

For a sequence x_0 .. x_{L-1} the target ran, with its features f_t at each position, step 0 is
the draft reading (f_t, x_{t+1}) at position t, predicting x_{t+2}: what it does over a context.
Step j > 0 reads, at each t, its own output of step j - 1 there (no fc) with token x_{t+1+j} at
position t + j, predicting x_{t+2+j}: what its j-th draft step does after a context ending at t,
had it drafted the tokens the sequence holds. Each step's query at t attends to the step-0 keys of
positions 0 .. t (the context) and to the keys of steps 1 .. j at t (the draft steps before it
and its own), which is what the draft's KV cache holds at that draft step. All t run at once, so
a sequence of L tokens teaches L positions at each of `steps` depths in one pass.

`ttt_forward` is that pass, in plain torch (autograd through everything but the target's frozen
embedding); `ttt_loss` the cross-entropy of each step's logits against the tokens, over the
draft vocabulary (targets outside it are not counted).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixlm.kernels.fused_ref import rms_norm_ref
from radixlm.runtime.models.llama_eagle3 import LlamaEagle3Draft


def _norm(norm, x: torch.Tensor) -> torch.Tensor:
    """The RMSNorm's torch twin (the fused kernel a GPU would pick has no backward)."""
    return rms_norm_ref(x, norm.weight, norm.eps)[0]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rope of x (B, L, heads, D) by (L, D/2) cos/sin tables' rows: the half-split layout."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def ttt_forward(
    draft: LlamaEagle3Draft, tokens: torch.Tensor, features: torch.Tensor, steps: int
) -> list[torch.Tensor]:
    """tokens (B, L) and the target's features (B, L, 3 x target hidden) at each position ->
    each step's (B, L, hidden) outputs; step j's row t is the draft's output after reading token
    x_{t+1+j} (index clamped at L - 1: those rows teach nothing, `ttt_loss` skips them)."""
    layer = draft.midlayer
    attn = layer.self_attn
    b, length = tokens.shape
    heads, kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    with torch.no_grad():
        embeds = draft.embed_tokens(tokens)  # (the target's: frozen)
    hidden = draft.fc(features)
    index = torch.arange(length, device=tokens.device)
    causal = index[None, :] <= index[:, None]  # (query t, key s): s <= t
    outs: list[torch.Tensor] = []
    context: tuple[torch.Tensor, torch.Tensor] | None = None
    chain: list[tuple[torch.Tensor, torch.Tensor]] = []
    for j in range(steps):
        token_at = (index + 1 + j).clamp(max=length - 1)
        both = torch.cat(
            [_norm(layer.input_layernorm, embeds[:, token_at]), _norm(layer.hidden_norm, hidden)],
            dim=-1,
        )
        q, k, v = F.linear(both, attn.qkv_proj.weight, attn.qkv_proj.bias).split(
            [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1
        )
        positions = (index + j).clamp(max=draft.rope.cos.shape[0] - 1)
        cos, sin = draft.rope.cos[positions], draft.rope.sin[positions]
        q = _rotate(q.view(b, length, heads, head_dim), cos, sin)
        k = _rotate(k.view(b, length, kv_heads, head_dim), cos, sin)
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


def draft_targets(draft: LlamaEagle3Draft, tokens: torch.Tensor) -> torch.Tensor:
    """Target ids -> draft ids (-1 where the draft vocabulary lacks the token)."""
    vocab = draft.config.model.vocab_size
    lookup = torch.full((vocab,), -1, dtype=torch.long, device=tokens.device)
    draft_ids = torch.arange(draft.d2t.shape[0], device=tokens.device)
    lookup[draft.target_ids(draft_ids)] = draft_ids
    return lookup[tokens]


def ttt_loss(
    draft: LlamaEagle3Draft,
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
    conversation's answer, the target's own tokens; and each step's top-1 accuracy there."""
    outs = ttt_forward(draft, tokens, features, steps)
    labels = draft_targets(draft, tokens)
    b, length = tokens.shape
    index = torch.arange(length, device=tokens.device)
    total, weight, accuracy = tokens.new_zeros((), dtype=torch.float32), 0.0, []
    for j, out in enumerate(outs):
        at = (index + 2 + j).clamp(max=length - 1)
        want = labels[:, at]
        keep = ((index + 2 + j)[None, :] < lengths[:, None]) & (want >= 0)
        if starts is not None:
            keep &= (index + 2 + j)[None, :] >= starts[:, None]
        if not bool(keep.any()):
            accuracy.append(float("nan"))
            continue
        logits = draft.lm_head(_norm(draft.norm, out[keep])).float()
        total = total + decay**j * F.cross_entropy(logits, want[keep])
        weight += decay**j
        accuracy.append(float((logits.argmax(-1) == want[keep]).float().mean()))
    return total / max(weight, 1e-9), accuracy
