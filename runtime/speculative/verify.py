"""Verification: which draft tokens the target model's own distribution accepts.

The target computed logits at every position of [newest token, d1 .. dk] in one forward. Row j
gives the distribution of the token after d_j (row 0: after the newest token). A greedy request
accepts the longest prefix of the draft that equals the argmax of each row, then takes the argmax
of the first row it did not accept (the bonus token): exactly the tokens plain greedy decoding
gives. A sampled request uses rejection sampling with the draft as a deterministic (one-hot)
proposal: d_j is accepted with probability p_j(d_j), else the token is drawn from p_j with d_j
removed, renormalized; after k acceptances the bonus is drawn from p_k. Each output token is then
distributed exactly as plain sampling draws it (Leviathan et al., 2023; Chen et al., 2023). The
uniforms and the race noise are pure functions of (request seed, output position), so a seeded run
repeats.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixlm.kernels.sampling_ref import exponential_noise, filtered_probs, row_seed
from radixlm.protocol.sampling_params import SamplingParams

_ACCEPT_STREAM = 0x5EC  # separates the acceptance uniforms from the sampling noise of a position


def greedy_accept(targets: Sequence[int], draft: Sequence[int]) -> list[int]:
    """The output tokens of a greedy verify: `targets` (k + 1) are each row's argmax."""
    m = 0
    while m < len(draft) and draft[m] == targets[m]:
        m += 1
    return [*draft[:m], targets[m]]


def acceptance_uniform(seed: int, step: int, rank: int = 0) -> float:
    """A uniform in (0, 1) for accepting the draft token at output position `step`; `rank`: of
    a draft tree's candidates there, the how-manieth (0: a chain's one)."""
    z = row_seed(row_seed(seed, step), _ACCEPT_STREAM)
    if rank:
        z = row_seed(z, rank)
    return ((z >> 39) + 0.5) / (1 << 24)


def rejection_sample(probs: torch.Tensor, draft: Sequence[int], seed: int, step: int) -> list[int]:
    """The output tokens of a sampled verify. probs: (k + 1, V) row-normalized target
    distributions; `step` is the output position row 0 samples."""
    k = len(draft)
    p_draft = probs[torch.arange(k, device=probs.device), torch.tensor(draft, device=probs.device)]
    accepted = 0
    for j, p in enumerate(p_draft.tolist()):
        if acceptance_uniform(seed, step + j) >= p:
            break
        accepted += 1
    dist = probs[accepted]
    if accepted < k:  # the residual: p without the rejected token (p - one-hot, clipped)
        dist = dist.clone()
        dist[draft[accepted]] = 0.0
    seeds = torch.tensor([row_seed(seed, step + accepted)], device=probs.device)
    noise = exponential_noise(seeds, dist.shape[-1])[0]  # the race samples from dist
    return [*draft[:accepted], int((dist / noise).argmax())]


def rejection_sample_tree(
    probs: torch.Tensor, tree, seed: int, step: int
) -> tuple[list[int], list[int]]:
    """Sampled verification of a draft tree (runtime/speculative/tree.py DraftTree). probs:
    (N + 1, V) row-normalized target distributions, the root's row first, then each node's.
    At a node its children (distinct tokens) are tried in order: each is accepted with the
    probability the residual distribution gives its token, and when refused the residual loses
    that token (renormalized), as `rejection_sample` does for a chain's one candidate (SpecInfer's
    multi-candidate rejection with one-hot proposals). The first accepted child is moved to and
    the same is done there; where every child was refused, or at a leaf, the token is drawn from
    the residual. Each output token is then distributed as plain sampling draws it. Returns the
    output tokens and the path's nodes."""
    children: dict[int, list[int]] = {}
    for j, p in enumerate(tree.parents):
        children.setdefault(p, []).append(j)
    node, path = -1, []
    while True:
        depth = len(path)
        dist = probs[node + 1]
        moved = False
        for rank, child in enumerate(children.get(node, ())):
            token = tree[child]
            if acceptance_uniform(seed, step + depth, rank) < float(dist[token] / dist.sum()):
                path.append(child)
                node, moved = child, True
                break
            dist = dist.clone()
            dist[token] = 0.0
        if not moved:
            break
    seeds = torch.tensor([row_seed(seed, step + len(path))], device=probs.device)
    noise = exponential_noise(seeds, dist.shape[-1])[0]
    return [*(tree[j] for j in path), int((dist / noise).argmax())], path


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(k + 1, V) logits -> the distributions plain sampling draws from (temperature, min-p,
    top-k, top-p), row-normalized."""
    probs = filtered_probs(logits, [params] * logits.shape[0])
    return probs / probs.sum(dim=-1, keepdim=True)
