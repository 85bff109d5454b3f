"""Draft trees: several candidates per position, verified in one step.

A chain drafts one candidate per position; where the drafter has several (MEDUSA's heads' top-k,
n-gram matches of different lengths that continue differently), a tree holds them all, and one
verify step checks every path. `DraftTree` is the tokens in depth-first order, each with its
parent, so that the first path (the root's first child, its first child, ...) is the nodes
0, 1, 2, ... in order. It is a tuple of the tokens, so it goes wherever a chain does.

How a tree is computed (runtime/model_runner.py, the scheduler's `_tree_layout`): every node is a
decode row whose position is its depth after the root (the request's newest token) and whose
request-table row holds its own path: the first path is the request's own row (its slots are
allocated in node order, so node j of the first path sits at its depth), each further leaf's path
gets a spare row of the table with the request's prefix and that path's slots. The decode kernel
reads a row's keys up to its position, so a node sees the prefix and its ancestors, nothing else:
tree attention without a kernel of its own. After the verify, the accepted path's slots move to
the request's row and every other node's slot is freed (CacheManager.keep_path).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class DraftTree(tuple):
    """Draft tokens in depth-first order, with `parents[j]` the node before j that j follows
    (-1: the root, the request's newest token)."""

    parents: tuple[int, ...]

    def __new__(cls, tokens: Sequence[int], parents: Sequence[int]) -> DraftTree:
        if len(tokens) != len(parents):
            raise ValueError(f"{len(tokens)} tokens and {len(parents)} parents")
        for j, p in enumerate(parents):
            if not -1 <= p < j:
                raise ValueError(f"node {j}'s parent {p} does not come before it")
        self = super().__new__(cls, tokens)
        self.parents = tuple(parents)
        return self

    def depths(self) -> list[int]:
        """Each node's depth: 1 for the root's children."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def paths(self) -> list[list[int]]:
        """Each leaf's path of node indices (root excluded), in leaf order; the first is
        0, 1, ..., its depth - 1."""
        has_child = set(self.parents)
        out = []
        for j in range(len(self)):
            if j not in has_child:
                path, node = [], j
                while node >= 0:
                    path.append(node)
                    node = self.parents[node]
                out.append(path[::-1])
        return out

    def first_path(self) -> tuple[int, ...]:
        """The first path's tokens: the chain this tree would be without its other branches."""
        return tuple(self[j] for j in self.paths()[0]) if self else ()


def merge_chains(chains: Sequence[Sequence[int]], budget: int) -> tuple[int, ...]:
    """The chains as one tree (a trie: chains sharing a beginning share its nodes), the first
    chain first, at most `budget` nodes in depth-first order; a plain tuple when it is one
    chain."""
    children: dict[int, list[tuple[int, int]]] = {}  # node -> [(token, child node)]
    tokens: list[int] = []
    for chain in chains:
        node = -1
        for token in chain:
            for t, child in children.get(node, ()):
                if t == token:
                    node = child
                    break
            else:
                tokens.append(token)
                child = len(tokens) - 1
                children.setdefault(node, []).append((token, child))
                node = child
    order: list[int] = []  # trie nodes in depth-first order, first-inserted child first
    stack = [c for _, c in reversed(children.get(-1, []))]
    while stack and len(order) < budget:
        node = stack.pop()
        order.append(node)
        stack.extend(c for _, c in reversed(children.get(node, [])))
    index = {node: i for i, node in enumerate(order)}
    parent_of = {c: p for p, kids in children.items() for _, c in kids}
    out_tokens = [tokens[n] for n in order]
    parents = [index[parent_of[n]] if parent_of[n] >= 0 else -1 for n in order]
    if all(p == j - 1 for j, p in enumerate(parents)):
        return tuple(out_tokens)
    return DraftTree(out_tokens, parents)


def lay_out(tree: DraftTree, rows, row: int, root: int) -> tuple[list[int], list[int]]:
    """Each node's request-table row for a step, and the rows lent for it. The request's row
    `row` holds the slots of the tree's nodes in node order after the root's position `root`
    (CacheManager.extend made them), so the first path's nodes sit at their depths there; each
    further path gets a lent row (`rows.lend()`) with the request's slots up to the root and
    then that path's slots, and its nodes that no earlier path holds read it."""
    paths = tree.paths()
    node_rows = [row] * len(tree)
    if len(paths) < 2:
        return node_rows, []
    slots = rows.read(row, root + 1 + len(tree))
    prefix, nodes = slots[: root + 1], slots[root + 1 :]
    placed = set(paths[0])
    lent = []
    for path in paths[1:]:
        other = rows.lend()
        lent.append(other)
        rows.write(other, 0, torch.cat([prefix, nodes[path]]))
        for j in path:
            if j not in placed:
                node_rows[j] = other
                placed.add(j)
    return node_rows, lent


def accept_greedy(targets: Sequence[int], tree: DraftTree) -> tuple[list[int], list[int]]:
    """Greedy verification of a tree: `targets[0]` is the root row's argmax, `targets[j + 1]`
    node j's. From the root, follow the child whose token is the argmax of where it stands, as
    long as there is one; then the argmax there is the target's own token. Returns the output
    tokens (the path's, then that one) and the path's nodes."""
    children: dict[int, list[int]] = {}
    for j, p in enumerate(tree.parents):
        children.setdefault(p, []).append(j)
    node, path = -1, []
    while True:
        want = targets[node + 1]
        step = next((c for c in children.get(node, ()) if tree[c] == want), None)
        if step is None:
            return [tree[j] for j in path] + [want], path
        path.append(step)
        node = step


class Accepted(list):
    """A verified tree's output tokens, with the nodes of the path they took (`nodes`)."""

    nodes: list[int]

    def __init__(self, tokens: Sequence[int], nodes: Sequence[int]) -> None:
        super().__init__(tokens)
        self.nodes = list(nodes)
